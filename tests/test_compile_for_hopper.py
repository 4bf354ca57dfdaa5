"""oomb's Triton kernels compile for an H100/H200 (sm_90) in bf16, with no GPU (tests/compile_for_hopper.py):
the launches of a tiny bf16 model's dense and sparse steps are captured under the interpreter, then
compiled at the 7B shape without it, with the launcher's specialization of the arguments, and the score
kernels' variants. The CPU tests' interpreter upcasts every tile to float32, which hid a bf16 dtype error
once; a compile without the specialization builds another kernel (no pipelined loads, a third of the shared
memory), which hid how close the forward's tiles are to the H200's limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("compile_for_hopper.py")


def _run(*args: str, interpret: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_kernels_compile_for_hopper_in_bf16(tmp_path):
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton has no ptxas for the CUDA backend")
    captured = tmp_path / "launches.json"
    _run("capture", str(captured), interpret=True)
    launches = json.loads(captured.read_text())
    kernels = {f"{launch['module'].rsplit('.', 1)[-1]}.{launch['kernel']}" for launch in launches}
    assert {"triton_paged._fwd_kernel", "triton_paged._dkdv_kernel", "triton_paged._dq_kernel",
            "triton_sparse._fwd_kernel", "triton_sparse._dq_kernel"} <= kernels
    assert all(launch["types"]["q_ptr"] == "*bf16" for launch in launches)
    # the launcher's marks: aligned pointers, the head dim's unit stride a constant
    assert all(launch["specialization"]["q_ptr"] == "D" and launch["specialization"]["stride_qd"] == 1
               for launch in launches)
    results = [json.loads(line) for line in _run("compile", str(captured), interpret=False).stdout.splitlines()]
    plain = {"exact_scores", "block_scores", "row_lse", "row_add", "loss_gradient"}
    assert {r["kernel"] for r in results} >= plain | kernels
    failed = [r for r in results if not r["ok"]]
    assert not failed, failed
    # every attention kernel also with gemma2's logit softcap (its pointer forward once failed to compile)
    assert {r["kernel"] for r in results if '"SOFTCAP": 30.0' in r["variant"]} >= kernels
    assert all(r["shared"] <= 232448 for r in results)  # within the H200's shared memory per program
    assert all(r["shared"] > 0 for r in results if r["kernel"] != "row_add")  # (the row add stages nothing)
    # with the marks the K/V loads are pipelined: the dense forward keeps its query tile and num_stages K and V
    # tiles in shared memory (unmarked, the loads went through registers and the kernel had a third of that)
    forward = [r for r in results if r["kernel"] == "triton_paged._fwd_kernel"]
    for r in forward:
        block_m, block_n, _, stages = r["config"]
        assert r["shared"] >= 2 * 128 * (block_m + stages * 2 * block_n), r
    if (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        assert all(r["registers"] <= 255 and r["spill_bytes"] >= 0 for r in results)
        assert all(r["instructions"]["HGMMA"] > 0 for r in results if r["kernel"].startswith("triton_"))  # wgmma
    # every config of the dense forward's list fits (the H200's pick, 128 x 128 over 3 stages, is 3 KB under the
    # limit: a kernel change that pushes it over would drop it from autotuning silently)
    forward_launches = [launch for launch in launches
                        if launch["module"].endswith("triton_paged") and launch["kernel"] == "_fwd_kernel"]
    captured.write_text(json.dumps(forward_launches))
    printed = _run("compile", str(captured), "--all-configs", interpret=False).stdout
    every = [json.loads(line) for line in printed.splitlines()]
    forward = [r for r in every if r["kernel"] == "triton_paged._fwd_kernel"]
    assert len({tuple(r["config"]) for r in forward}) == 3 and all(r["ok"] for r in forward), forward
    assert all(r["shared"] <= 232448 for r in forward), forward
