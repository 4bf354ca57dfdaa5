"""Tensor parallel vs one GPU: step time and per-GPU peak memory of oomb's dense step.

Standard workload: Qwen2.5-7B shape with random weights (built locally, no
download), bf16, one forward + backward without optimizer, chunk 4096, page 128, fp32 KV gradients.
Run it once per degree; the process count is the TP degree (1 = the single-GPU baseline):

    torchrun --nproc-per-node 1 benchmarks/parallel.py --contexts 131072 --out tp1.json
    torchrun --nproc-per-node 2 benchmarks/parallel.py --contexts 131072 --out tp2.json
    torchrun --nproc-per-node 2 benchmarks/parallel.py --preset tiny-qwen2 --contexts 2048 --device cpu \\
        --chunk-size 512 --warmup-tokens 512 --out /tmp/tp2.json          # CPU smoke test (gloo)

Each context is timed after a warm-up step (Triton compilation and autotuning excluded), with the
devices synchronised and peak statistics reset. Memory is each rank's peak above its own share of
the weights. Rank 0 writes OUT (JSON) after every context.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from oomb.config import (
    OOMBConfig,  # noqa: E402
    PrecisionConfig,
)
from oomb.engine import forward_backward  # noqa: E402
from oomb.parallel import init_distributed, setup_parallel  # noqa: E402
from oomb.planning.memory import GIB  # noqa: E402
from oomb.tools.bench import build_model, measure, token_ids  # noqa: E402
from oomb.training.presets import PRESETS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description="oomb dense step: tensor parallel over the torchrun processes")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-7b")
    parser.add_argument("--contexts", type=int, nargs="+", default=[131072])
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--kv-grad-dtype", default="float32")
    parser.add_argument("--warmup-tokens", type=int, default=8192)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="parallel.json")
    args = parser.parse_args()

    tp = init_distributed(args.device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.preset, max(args.contexts + [args.warmup_tokens]), device, dtype, args.seed)
    setup = setup_parallel(model, tp=tp, device_type=device.type)
    config = OOMBConfig(chunk_size=args.chunk_size, page_size=args.page_size,
                        precision=PrecisionConfig(kv_grad_dtype=args.kv_grad_dtype))
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0

    def step(m, ids):
        return float(forward_backward(m, ids, config=config, parallel=setup))

    report = base_report("oomb dense step, tensor parallel", args, dtype, device, weights, tp=tp)
    time_contexts(step, model, args, device, report, tp, rank, f"tp={tp}")
    if dist.is_initialized():
        dist.destroy_process_group()


def base_report(benchmark: str, args: argparse.Namespace, dtype: torch.dtype, device: torch.device, weights: int,
                **extra) -> dict:
    """The JSON header of a parallel step benchmark: what ran, where, and the command."""
    return {
        "benchmark": benchmark, **extra, "preset": args.preset, "dtype": str(dtype), "chunk_size": args.chunk_size,
        "page_size": args.page_size, "kv_grad_dtype": args.kv_grad_dtype,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
        "weights_gib_per_rank": round(weights / GIB, 3), "rows": [],
    }


def time_contexts(step: Callable, model, args: argparse.Namespace, device: torch.device, report: dict, world: int,
                  rank: int, label: str, row_extras: Callable[[], dict] | None = None,
                  describe: Callable[[list[dict]], str] | None = None) -> None:
    """A warm-up step, then one timed step per ``args.contexts``: every rank's row (plus ``row_extras()``)
    gathered into ``report``, which rank 0 writes to ``args.out`` and summarises after each context
    (``describe(rows)`` appends to its line). Stops at the first context some rank ran out of memory in."""
    vocab = model.config.vocab_size
    start = time.perf_counter()
    measure(step, model, token_ids(vocab, args.warmup_tokens, args.seed, device), device)
    report["warmup_s"] = round(time.perf_counter() - start, 1)
    for tokens in args.contexts:
        try:
            row = measure(step, model, token_ids(vocab, tokens, args.seed, device), device)
            row.update(row_extras() if row_extras is not None else {})
        except torch.OutOfMemoryError as err:
            row = {"error": f"out of memory: {str(err).splitlines()[0]}"}
        rows = _gather(row, world)
        result = {"tokens": tokens, "seconds": max(r.get("seconds", float("nan")) for r in rows), "per_rank": rows}
        report["rows"].append(result)
        if rank == 0:
            Path(args.out).write_text(json.dumps(report, indent=1))
            peaks = [r.get("peak_gpu_above_weights_gib") for r in rows]
            print(f"{label} {tokens:,} tokens: {result['seconds']:.1f} s, peak GPU above weights per rank {peaks} GiB"
                  + (describe(rows) if describe is not None else ""), flush=True)
        if any("error" in r for r in rows):
            break


def _gather(row: dict, world: int) -> list[dict]:
    """Every rank's measurement, on every rank (a small object collective; reporting only)."""
    if world == 1 or not dist.is_initialized():
        return [row]
    rows: list = [None] * world
    dist.all_gather_object(rows, row)
    return rows


if __name__ == "__main__":
    main()
