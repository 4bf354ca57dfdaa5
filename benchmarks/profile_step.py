"""Where a step's time goes: one oomb (or HF) step under torch.profiler, grouped by kernel.

The dense step is 1.6x HF at 128K on the H200 although it does about the same attention FLOPs and
one extra forward of the linear layers (docs/results.md): this script finds the rest. It runs a
warm-up step, then profiles one step and writes the kernels sorted by device time, with their
share, grouped into attention (oomb's Triton kernels, SDPA), GEMM, copies and the rest.

    python benchmarks/profile_step.py --contexts 32K --modes dense hf --name profile_32k      # H200
    python benchmarks/profile_step.py --quick --modes sparse --out-dir /tmp --name p             # CPU smoke

It takes `oomb bench`'s options (backend, budget, chunk size, ...). On a GPU it also reports the
step's wall time against the time the GPU was busy (the union of its kernels' and copies'
intervals): the difference is time the GPU waited on the host (launches, synchronisations).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from oomb import machine  # noqa: E402
from oomb.tools.bench import (  # noqa: E402
    BenchOptions,
    add_arguments,
    build_model,
    make_step,
    options_from_args,
    token_ids,
    warmup_tokens,
)

GROUPS = (  # first match wins; names as the profiler reports kernels and ops
    ("attention (oomb Triton)", ("_fwd_kernel", "_dkdv_kernel", "_dq_kernel", "_delta_kernel", "_sparse")),
    ("attention (SDPA, cuDNN)", ("sdpa", "flash", "fmha", "cudnn")),
    ("GEMM", ("gemm", "cutlass", "sm90_xmma", "nvjet", "addmm", "aten::mm", "aten::bmm", "matmul")),
    ("copies", ("memcpy", "copy", "index_select", "index_copy", "cat", "fill", "zero")),
)


def group_of(name: str) -> str:
    lowered = name.lower()
    for group, keys in GROUPS:
        if any(key.lower() in lowered for key in keys):
            return group
    return "other"


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")
"""Host-side events that wait for the GPU (an .item(), .tolist(), bool() of a CUDA tensor, ...)."""


def busy_seconds(events) -> float:
    """Seconds in which at least one kernel or copy ran: the union of their intervals."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    busy, end = 0.0, -math.inf
    for start, stop in spans:
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy / 1e6


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
    syncs = {e.key: {"calls": e.count, "host_ms": round(e.cpu_time_total / 1000, 1)}
             for e in prof.key_averages() if e.key in SYNC_CALLS}
    groups: dict[str, float] = {}
    for r in rows:
        groups[r["group"]] = groups.get(r["group"], 0.0) + r["ms"]
    busy = busy_seconds(prof.events()) if use_device else None
    return {"mode": mode, "tokens": tokens, "step_seconds_under_profiler": round(seconds, 3),
            "gpu_busy_seconds": None if busy is None else round(busy, 3), "host_waits": syncs,
            "time_kind": "device (kernels)" if use_device else "CPU self time (aten ops)",
            "groups_ms": {k: round(v, 1) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
            "groups_share": {k: round(v / total, 4) for k, v in groups.items()}, "top": rows[:40]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    if args.replot:
        parser.error("--replot is an option of `oomb bench` only")
    options = options_from_args(args)
    out = Path(options.out_dir) / f"{options.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.device(options.device)
    report = {"command": "python " + " ".join(sys.argv), "machine": machine.machine_info(device),
              "options": dataclasses.asdict(options), "runs": []}
    for tokens in options.contexts:
        for mode in options.modes:
            run = profile_step(mode, options, tokens)
            report["runs"].append(run)
            busy = "" if run["gpu_busy_seconds"] is None else f" (GPU busy {run['gpu_busy_seconds']} s)"
            print(f"{mode:>14} {tokens:>9,}: {run['step_seconds_under_profiler']} s{busy};",
                  ", ".join(f"{k} {v / 1000:.2f} s" for k, v in run["groups_ms"].items()))
            out.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
