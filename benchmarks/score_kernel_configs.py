"""Rerank's listed-page score kernel under each launch config, one config at a time (no autotuning).

The kernel (oomb/attention/triton_scores.py ``_exact_scores_kernel`` with listed pages) is a large part of a
sparse step: an estimated 4.3 s of the 7B shape's 128K step and 40 s of its 1M step. Its autotuner picks
among a fixed list; this sweep times configs outside that list too (larger row tiles, whole-page key
tiles, more or fewer stages), so the list is chosen from measurements.

Workload: one chunk of 4096 queries of the 7B shape (28 query heads, 4 KV heads, head dim 128, bf16,
128-token pages, shuffled page ids), every query block scoring ``factor x budget`` random distinct listed
pages of the history (rerank x4 at budget 64: 256). CUDA events, median of ``--iters`` calls after warm-up.

    python benchmarks/score_kernel_configs.py --histories 131072 1048576 --out score_configs.json
    python benchmarks/score_kernel_configs.py --smoke     # tiny shapes on CPU (Triton interpreter)
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

CONFIGS = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_M divides triton_scores._SCRATCH_ROWS (128)
    (128, 128, 4, 2), (128, 128, 4, 3), (128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3),
    (64, 64, 4, 3), (64, 32, 4, 4),
]


def add_workload_arguments(p: argparse.ArgumentParser, histories: list[int], iters: int) -> None:
    """The workload's options (shared with score_kernel_ablation.py), --smoke and --out."""
    p.add_argument("--histories", type=int, nargs="+", default=histories)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=128)
    p.add_argument("--listed", type=int, default=256, help="listed pages per block (rerank x4 at budget 64)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (GPU if any, else CPU: Triton interpreter)")
    p.add_argument("--out", help="write the JSON report here")


def smoke_workload(args: argparse.Namespace) -> argparse.Namespace:
    """With --smoke, the tiny shapes."""
    if args.smoke:
        args.histories, args.chunk, args.heads, args.kv_heads = [64], 32, 4, 2
        args.head_dim, args.page, args.listed, args.warmup, args.iters = 16, 16, 2, 0, 1
    return args


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(p, [131072, 1048576], iters=7)
    p.add_argument("--autotuned-only", action="store_true", help="time the autotuner's own pick only")
    return smoke_workload(p.parse_args())


def _inputs(args, history: int, device: torch.device) -> dict:
    Hq, Hkv, D, P, Lq = args.heads, args.kv_heads, args.head_dim, args.page, args.chunk
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n_pages = -(-(history + Lq) // P)
    n_hist, n_blocks = history // P, -(-Lq // P)
    gen = torch.Generator(device=device).manual_seed(history)
    k_pool = torch.randn(n_pages, Hkv, P, D, device=device, dtype=dtype, generator=gen)
    table = torch.randperm(n_pages, device=device, generator=gen).to(torch.int32)[None]
    q = torch.randn(1, Lq, Hq, D, device=device, dtype=dtype, generator=gen).transpose(1, 2)
    noise = torch.rand(1, Hkv, n_blocks, n_hist, device=device, generator=gen)
    listed = noise.argsort(-1)[..., :min(args.listed, n_hist)].sort(-1).values.to(torch.int32).contiguous()
    return dict(q=q, k_pool=k_pool, page_table=table, query_start=history, scale=D ** -0.5, pages=listed)


def _run_config(kernel, config, call) -> None:
    """Pin the autotuner to ``config`` (None: its own list) and drop what it had tuned."""
    kernel.configs = [config] if config is not None else kernel._oomb_all_configs
    kernel.cache.clear()
    call()


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from attention import Timer, kernel_device, write_kernel_report

    device = kernel_device(args.smoke)
    import triton

    from oomb.attention import triton_scores

    kernel = triton_scores._exact_scores_kernel
    if any(triton_scores._SCRATCH_ROWS % m for m, *_ in CONFIGS):
        raise SystemExit(f"every BLOCK_M must divide the scratch's row padding ({triton_scores._SCRATCH_ROWS})")
    kernel._oomb_all_configs = list(kernel.configs)
    timer = Timer(device)
    configs = [None] + ([] if args.smoke or args.autotuned_only else [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in CONFIGS])
    rows = []
    for history in args.histories:
        inputs = _inputs(args, history, device)
        call = functools.partial(triton_scores.exact_page_scores, **inputs)
        reference = None
        for config in configs:
            name = "autotuned" if config is None else str(config)
            row = {"history": history, "config": name}
            try:
                _run_config(kernel, config, call)
                out = call()
                reference = out if reference is None else reference
                row["max_abs_diff_vs_autotuned"] = (out - reference).abs().max().item()
                row["ms"] = timer(call, args.warmup, args.iters)
                if config is None:
                    row["picked"] = {str(k): str(v) for k, v in kernel.cache.items()}
            except Exception as error:  # out of resources, or a tile the kernel refuses
                row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
            rows.append(row)
            print(f"history {history:>8} {name:<60} "
                  + (f"{row['ms']:8.3f} ms  diff {row['max_abs_diff_vs_autotuned']:.2e}" if "ms" in row
                     else row["error"]), flush=True)
    kernel.configs = kernel._oomb_all_configs
    write_kernel_report(args, device, rows)


if __name__ == "__main__":
    main()
