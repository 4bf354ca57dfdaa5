"""The sparse cuDNN backward's dK/dV accumulation: torch's cast + ``index_put_(accumulate=True)`` against
oomb's Triton row add (oomb/attention/triton_row_add.py), per call.

Workload: one chunk of the 7B shape's default sparse step (4096 queries, 128-token pages, one selection
per query block: 32 groups, 4 KV heads, the sink page and a budget of 64 distinct history pages per group),
bf16 gradients of every selected (page, KV head) row added into float32 (or, with --pool-dtype bf16,
bf16) page gradients of the whole history. CUDA events, median of ``--iters`` calls after warm-up. Each
call adds into a fresh copy of the pool; the copy's time is measured alone and subtracted.

    python benchmarks/row_add_speed.py --histories 131072 1048576 --out row_add_speed.json
    python benchmarks/row_add_speed.py --smoke     # tiny shapes on CPU (Triton interpreter)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--histories", type=int, nargs="+", default=[131072, 1048576])
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=128)
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--pool-dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (GPU if any, else CPU: Triton interpreter)")
    p.add_argument("--out", help="write the JSON report here")
    args = p.parse_args()
    if args.smoke:
        args.histories, args.chunk, args.kv_heads, args.head_dim, args.page = [64], 32, 2, 8, 8
        args.budget, args.warmup, args.iters = 3, 0, 1
    return args


def _inputs(args, history: int, pool_dtype: torch.dtype, device: torch.device):
    """(pool, rows, grad): the (page, head) rows each group selected, in the backward's (group, head, page)
    order, and one bf16 gradient row of page x head_dim values for each."""
    Hkv, P, D = args.kv_heads, args.page, args.head_dim
    n_hist, n_groups = history // P, -(-args.chunk // P)
    n_pages = n_hist + n_groups
    gen = torch.Generator(device=device).manual_seed(history)
    pool = torch.randn(n_pages * Hkv, P * D, device=device, generator=gen).to(pool_dtype)
    picks = torch.rand(n_groups, Hkv, n_hist - 1, device=device, generator=gen).argsort(-1)[..., :args.budget] + 1
    pages = torch.cat([picks.new_zeros(n_groups, Hkv, 1), picks], dim=-1)  # the sink page, then the budget's
    rows = (pages * Hkv + torch.arange(Hkv, device=device)[None, :, None]).reshape(-1)
    grad = torch.randn(rows.numel(), P * D, device=device, generator=gen).to(torch.bfloat16)
    return pool, rows, grad


def _paths(pool, rows, grad, add_rows_) -> dict:
    """The timed calls: the pool's copy alone, torch's path and the kernel's, each on a fresh copy."""
    return {
        "copy only": lambda: pool.clone(),
        "torch cast + index_put": lambda: pool.clone().index_put_((rows,), grad.to(pool.dtype), accumulate=True),
        "triton row add": lambda: add_rows_(pool.clone(), rows, grad),
    }


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from attention import Timer, kernel_device, write_kernel_report

    device = kernel_device(args.smoke)
    from oomb.attention.triton_row_add import add_rows_

    timer = Timer(device)
    results = []
    for history in args.histories:
        for dtype_name in args.pool_dtypes:
            pool, rows, grad = _inputs(args, history, getattr(torch, dtype_name), device)
            paths = _paths(pool, rows, grad, add_rows_)
            row = {"history": history, "pool_dtype": dtype_name, "rows": rows.numel(),
                   "gradient_mib": grad.numel() * grad.element_size() / 2 ** 20}
            outputs = {name: fn() for name, fn in paths.items()}
            row["max_abs_diff"] = (outputs["triton row add"].float()
                                   - outputs["torch cast + index_put"].float()).abs().max().item()
            row["bitwise_equal"] = torch.equal(outputs["triton row add"], outputs["torch cast + index_put"])
            for name, fn in paths.items():
                row[f"{name} ms"] = timer(fn, args.warmup, args.iters)
            for name in ("torch cast + index_put", "triton row add"):
                row[f"{name} ms without the copy"] = row[f"{name} ms"] - row["copy only ms"]
            results.append(row)
            print(json.dumps(row), flush=True)
    write_kernel_report(args, device, results)


if __name__ == "__main__":
    main()
