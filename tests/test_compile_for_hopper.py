"""The score kernels compile for an H100/H200 (sm_90) in bf16, with no GPU: tests/compile_for_hopper.py
in a process without the interpreter (the CPU tests' interpreter upcasts every tile, which hid a bf16
dtype error once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def test_score_kernels_compile_for_hopper_in_bf16():
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton has no ptxas for the CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_for_hopper.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert {r["kernel"] for r in results} == {"exact_scores", "block_scores"} and len(results) == 5
    failed = [r for r in results if not r["ok"]]
    assert not failed, failed
    assert all(0 < r["shared"] <= 232448 for r in results)  # within the H200's shared memory per program
