"""oomb/machine.py: what this machine has, and how a CPU step keeps its host memory."""

import ctypes

from oomb import machine


def test_bound_heap_retention_fixes_glibcs_mmap_threshold(monkeypatch):
    """On Linux with glibc the threshold is set through mallopt (M_MMAP_THRESHOLD, 4 MiB); elsewhere nothing."""
    calls = []

    class FakeLibc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(machine.sys, "platform", "linux")
    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeLibc())
    assert machine.bound_heap_retention() is True
    assert calls == [(-3, 4 << 20)]
    monkeypatch.setattr(ctypes, "CDLL", lambda name: object())  # a libc without mallopt (musl)
    assert machine.bound_heap_retention() is False
    monkeypatch.setattr(machine.sys, "platform", "darwin")
    assert machine.bound_heap_retention() is False
