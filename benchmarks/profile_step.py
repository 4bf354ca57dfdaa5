"""Where a step's time goes: one oomb (or HF) step under torch.profiler, grouped by kernel.

The dense step is 1.6x HF at 128K on the H200 although it does about the same attention FLOPs and
one extra forward of the linear layers (docs/results.md): this script finds the rest. It runs a
warm-up step, then profiles one step and writes the kernels sorted by device time, with their
share, grouped into attention (oomb's Triton kernels, SDPA), GEMM, copies and the rest.

    python benchmarks/profile_step.py --contexts 32K --out profile_32k.json                # H200
    python benchmarks/profile_step.py --preset tiny-qwen2 --device cpu --contexts 2K --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from oomb import machine  # noqa: E402
from oomb.bench import BenchOptions, build_model, make_step, token_ids, warmup_tokens  # noqa: E402
from oomb.plan import MODES, parse_tokens  # noqa: E402
from oomb.presets import PRESETS  # noqa: E402

GROUPS = (  # first match wins; names as the profiler reports kernels and ops
    ("attention (oomb Triton)", ("_fwd_kernel", "_dkdv_kernel", "_dq_kernel", "_delta_kernel", "_sparse")),
    ("attention (SDPA)", ("sdpa", "flash", "fmha")),
    ("GEMM", ("gemm", "cutlass", "sm90_xmma", "nvjet", "addmm", "aten::mm", "aten::bmm", "matmul")),
    ("copies", ("memcpy", "copy", "index_select", "index_copy", "cat", "fill", "zero")),
)


def group_of(name: str) -> str:
    lowered = name.lower()
    for group, keys in GROUPS:
        if any(key.lower() in lowered for key in keys):
            return group
    return "other"


def profile_step(mode: str, options: BenchOptions, tokens: int) -> dict:
    device = torch.device(options.device)
    warmup = warmup_tokens(mode, options)
    model = build_model(options.preset, max(tokens, warmup), device, options.dtype, options.seed)
    step = make_step(mode, options)
    vocab = model.config.vocab_size
    step(model, token_ids(vocab, warmup, options.seed, device))  # compile, autotune
    ids = token_ids(vocab, tokens, options.seed, device)
    if hasattr(step, "prepare"):
        step.prepare(model, ids)
    model.zero_grad(set_to_none=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        step(model, ids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    use_device = device.type == "cuda"
    rows = []
    for event in prof.key_averages():
        # On the GPU only device events (kernels, memcpy, memset): an operator's device time is that
        # of the kernels it launched, which are rows of their own.
        if use_device and event.device_type != DeviceType.CUDA:
            continue
        us = event.self_device_time_total if use_device else event.self_cpu_time_total
        if us > 0 and (use_device or event.key.startswith("aten::")):
            rows.append({"name": event.key, "calls": event.count, "ms": round(us / 1000, 3),
                         "group": group_of(event.key)})
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows) or 1.0
    groups: dict[str, float] = {}
    for r in rows:
        groups[r["group"]] = groups.get(r["group"], 0.0) + r["ms"]
    return {"mode": mode, "tokens": tokens, "step_seconds_under_profiler": round(seconds, 3),
            "time_kind": "device (kernels)" if use_device else "CPU self time (aten ops)",
            "groups_ms": {k: round(v, 1) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
            "groups_share": {k: round(v / total, 4) for k, v in groups.items()}, "top": rows[:40]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-7b")
    parser.add_argument("--modes", nargs="+", default=["dense", "hf"], choices=list(MODES))
    parser.add_argument("--contexts", type=parse_tokens, nargs="+", default=[32768])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--warmup-tokens", type=parse_tokens, default=8192)
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--out", default="profile_step.json")
    args = parser.parse_args()
    options = BenchOptions(preset=args.preset, device=args.device, warmup_tokens=args.warmup_tokens,
                           contexts=list(args.contexts), chunk_size=args.chunk_size)
    report = {"command": "python " + " ".join(sys.argv), "machine": machine.machine_info(torch.device(args.device)),
              "runs": []}
    for tokens in args.contexts:
        for mode in args.modes:
            run = profile_step(mode, options, tokens)
            report["runs"].append(run)
            print(f"{mode:>14} {tokens:>9,}: {run['step_seconds_under_profiler']} s;",
                  ", ".join(f"{k} {v / 1000:.2f} s" for k, v in run["groups_ms"].items()))
            Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
