"""Pinned host memory for offloaded pages: four slabs (k, v, dk, dv) kept across steps, and
staging their gradient pages to the GPU (``_load_grads``)."""

from __future__ import annotations

import math
import mmap
import time

import torch

from .mapped import mapped_view

KINDS = ("k", "v", "dk", "dv")
"""The slabs' kinds: keys, values and their gradients."""


class HostSlabs:
    """Pinned host memory for the offloaded pages: one slab per kind (k, v, dk, dv), kept across
    steps and grown only when a step needs more, never one allocation per page.

    Slabs are page-aligned CPU tensors page-locked with ``cudaHostRegister``: the bytes needed,
    rounded up to whole pages.
    (``pin_memory=True`` goes through torch's caching host allocator, which rounds every block up
    to a power of two and keeps freed blocks: 28 GiB slabs would take 32 GiB each, and 1M tokens of
    the 7B shape would no longer fit 125 GiB of RAM.)
    """

    def __init__(self, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._slabs: dict[str, torch.Tensor] = {}
        self._mapped: dict[str, torch.Tensor | None] = {}  # name -> CUDA alias of the slab (kv/mapped.py)
        self.allocations = 0
        """How many slabs were allocated so far (reuse across steps keeps it at 4)."""
        self.pin_seconds = 0.0
        """Seconds spent allocating and page-locking slabs so far (a first step's share of its overhead: at 1M
        tokens of the 7B shape, 116 GiB)."""

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` viewing slab ``name``; contents are whatever the last step left."""
        nbytes = math.prod(shape) * dtype.itemsize
        slab = self._slabs.get(name)
        if slab is None or slab.numel() < nbytes:
            if slab is not None:  # free the old slab before pinning a larger one
                self._drop(name)
            del slab
            start = time.perf_counter()
            slab = _page_aligned(nbytes) if self.pin else torch.empty(max(nbytes, 1), dtype=torch.uint8)
            if self.pin:
                _register(slab)
            self.pin_seconds += time.perf_counter() - start
            self._slabs[name] = slab
            self.allocations += 1
        return slab[:nbytes].view(dtype).view(shape)

    def mapped(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor | None:
        """What ``take`` returned, as a tensor kernels on ``device`` read and write in place: on a CPU
        device the host tensor itself; on a GPU an alias of the registered slab (kv/mapped.py), or
        None where the device cannot address it. Call after ``take``."""
        view = self._slabs[name][:math.prod(shape) * dtype.itemsize]
        if device.type != "cuda":
            return view.view(dtype).view(shape)
        if not self.pin:
            return None
        if name not in self._mapped:  # probed once per slab, before the slab holds any page
            self._mapped[name] = mapped_view(self._slabs[name], device)
        alias = self._mapped[name]
        return None if alias is None else alias[:view.numel()].view(dtype).view(shape)

    @property
    def nbytes(self) -> int:
        return sum(slab.numel() for slab in self._slabs.values())

    def _drop(self, name: str) -> None:
        self._mapped.pop(name, None)
        slab = self._slabs.pop(name)
        if self.pin:
            _unregister(slab)

    def release(self) -> None:
        """Unpin and free every slab (also done when the object is garbage collected)."""
        for name in list(self._slabs):
            self._drop(name)

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown: CUDA may already be gone, and the process with it
            pass


def _load_grads(target: torch.Tensor, source: torch.Tensor, on_host: torch.Tensor) -> None:
    """Stage gradient pages: copy those written back this step, zeros where accumulation begins
    (``on_host`` False), so the host slabs are never cleared and stale values are never read."""
    if not bool(on_host.any()):
        target.zero_()
        return
    target.copy_(source, non_blocking=True)
    if not bool(on_host.all()):
        fresh = torch.nonzero(~on_host).flatten().to(target.device, non_blocking=True)
        target.index_fill_(0, fresh, 0)


def _page_aligned(nbytes: int) -> torch.Tensor:
    """A CPU byte tensor that starts on a page boundary and spans whole pages: registering it pins
    no page shared with another allocation (the driver pins whole pages, and registering a page
    twice fails)."""
    page = mmap.PAGESIZE
    size = max(page, -(-nbytes // page) * page)
    raw = torch.empty(size + page, dtype=torch.uint8)
    offset = -raw.data_ptr() % page
    return raw[offset:offset + size]  # a view: keeps ``raw`` alive


def _register(slab: torch.Tensor) -> None:
    """Page-lock a CPU tensor's memory so that copies to and from the GPU are asynchronous DMA
    (portable: pinned for every device; mapped: kernels may address it, kv/mapped.py)."""
    portable, mapped = 1, 2  # cudaHostRegisterPortable, cudaHostRegisterMapped
    error = int(torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), slab.numel(), portable | mapped))
    if error != 0:
        raise RuntimeError(f"pinning {slab.numel() / 2**30:.2f} GiB of host memory failed (cudaError {error}); "
                           "is the memory limit (ulimit -l, container) too low?")


def _unregister(slab: torch.Tensor) -> None:
    for device in range(torch.cuda.device_count()):  # no copy may still read or write it
        torch.cuda.synchronize(device)
    error = int(torch.cuda.cudart().cudaHostUnregister(slab.data_ptr()))
    if error != 0:
        raise RuntimeError(f"unpinning host memory failed (cudaError {error})")
