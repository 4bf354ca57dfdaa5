"""Registers, spill bytes and shared memory of every tile config of oomb's Triton kernels, compiled for an
H100/H200 (sm_90) at the 7B shape on any machine with Triton's CUDA backend (no GPU needed).

What a GPU run's autotuner chooses from: a config whose shared memory is over the H200's 232,448 bytes per
program never runs, and one that spills registers to the stack pays local-memory traffic in its inner loop.
These are compile-time facts, not timings: they say which tiles are worth timing (benchmarks/attention.py,
after editing a list), not which is fastest.

    python benchmarks/kernel_resources.py --out benchmarks/results/kernel_resources_sm90.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
HARNESS = ROOT / "tests" / "compile_for_hopper.py"


def _harness(*args: str, interpret: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, str(HARNESS), *args], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{HARNESS.name} {args[0]} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def warp_specialization_probe() -> dict:
    """Does Triton's automatic warp specialization (``tl.range(..., warp_specialize=True)``) change an
    attention loop compiled for sm_90? A flash-attention forward of one 128 x 128 tile per step, compiled
    without and with it: producer/consumer warp groups would show as ``setmaxnreg`` (register reallocation
    between them) and a different shared-memory plan. Triton 3.6 documents it for Blackwell only."""
    import re

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def attention_loop(q_ptr, k_ptr, v_ptr, o_ptr, keys, SPECIALIZE: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, BLOCK)
        q = tl.load(q_ptr + rows[:, None] * BLOCK + cols[None, :])
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK], tl.float32)
        acc = tl.zeros([BLOCK, BLOCK], tl.float32)
        for start in tl.range(0, keys, BLOCK, warp_specialize=SPECIALIZE):
            k = tl.load(k_ptr + (start + cols)[:, None] * BLOCK + cols[None, :])
            v = tl.load(v_ptr + (start + cols)[:, None] * BLOCK + cols[None, :])
            s = tl.dot(q, tl.trans(k))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            total = total * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
            m = m_new
        tl.store(o_ptr + rows[:, None] * BLOCK + cols[None, :], (acc / total[:, None]).to(tl.bfloat16))

    signature = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "keys": "i32",
                 "SPECIALIZE": "constexpr", "BLOCK": "constexpr"}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(5)}
    probe, texts = {}, []
    for specialize in (False, True):
        compiled = triton.compile(ASTSource(attention_loop, signature, {(5,): specialize, (6,): 128}, aligned),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=3))
        ptx = compiled.asm["ptx"]
        texts.append(ptx)
        probe[f"warp_specialize={specialize}"] = {
            "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)), "setmaxnreg": len(re.findall("setmaxnreg", ptx)),
            "shared": compiled.metadata.shared, "ptx_lines": ptx.count("\n")}
    probe["same_code"] = texts[0] == texts[1]  # the PTX, character for character
    return probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON path (default: print only)")
    args = parser.parse_args()
    from oomb.attention.triton_paged import _SHARED_MEMORY_BYTES as SHARED_MEMORY_BYTES  # per program, H100/H200

    with tempfile.TemporaryDirectory() as tmp:
        captured = str(Path(tmp) / "launches.json")
        _harness("capture", captured, interpret=True)
        lines = _harness("compile", captured, "--all-configs", interpret=False).splitlines()
    rows = [json.loads(line) for line in lines]
    for row in rows:
        row["fits"] = row.get("ok", False) and row["shared"] <= SHARED_MEMORY_BYTES
        config = "x".join(map(str, row.get("config", [])))
        print(f"{row['kernel']:<36} {config:<14} shared {row.get('shared', '-'):>7} registers "
              f"{row.get('registers', '-'):>4} spill {row.get('spill_bytes', '-'):>5} B  {row['variant']}"
              + ("" if row["fits"] else "  DOES NOT FIT" if row.get("ok") else f"  {row.get('error')}"))
    import triton

    from oomb import machine

    probe = warp_specialization_probe()
    verdict = "the same code as without" if probe["same_code"] else "other code"
    print(f"tl.range(warp_specialize=True) on sm_90: {verdict} ({probe['warp_specialize=True']})")

    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": machine.git_commit(), "command": "python " + " ".join(sys.argv),
              "machine": {"cpu": machine.cpu_name(), "compiled_for": "sm_90 (H100/H200), no GPU",
                          "triton": triton.__version__},
              "config": "[BLOCK_M, BLOCK_N, num_warps, num_stages] (the plain kernels: [num_warps, num_stages])",
              "shape": "7B: head dim 128, 7 query heads per KV head, pages of 128, bf16",
              "shared_memory_limit": SHARED_MEMORY_BYTES, "kernels": rows,
              "warp_specialization_probe": probe}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
