"""What scoring a chunk's pages costs: the exact score's Triton kernel vs the minmax summary score vs
one dense attention forward over the same history (the unit a step's attention is made of).

Workload (as benchmarks/attention.py): one chunk of 4096 queries of the 7B shape (28 query heads,
4 KV heads, head dim 128, bf16, pages of 128 tokens, shuffled page ids) against histories of 32K to
1M tokens. Timed per call (CUDA events, median, warm-up and autotuning excluded):

* ``minmax``: oomb.sparse.block_scores from the pages' min/max summaries, then top_pages (budget 64);
* ``exact`` (row stride 1, 2, 8): oomb/attention/triton_scores.py, then top_pages;
* ``rerank`` (factor 2, 4): minmax picks factor x budget candidates, the kernel scores them exactly
  (oomb.sparse.rerank_block_scores), then top_pages;
* ``dense_fwd``: triton_paged.paged_attention_forward over the whole history and the chunk.

A step's scoring time is then *estimated* (not measured) for a whole sequence of 28 layers from the
per-call times, interpolated linearly in the history length: printed and saved as such.

    python benchmarks/sparse_score_speed.py --out benchmarks/results/sparse_score_speed_h200_<date>.json
    python benchmarks/sparse_score_speed.py --smoke        # tiny shapes on CPU (Triton interpreter)
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--histories", type=int, nargs="+", default=[32768, 131072, 524288, 1048576])
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=128)
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--strides", type=int, nargs="+", default=[1, 2, 8])
    p.add_argument("--factors", type=int, nargs="+", default=[2, 4], help="rerank: candidates / budget")
    p.add_argument("--layers", type=int, default=28, help="layers of the estimated step")
    p.add_argument("--steps", type=int, nargs="+", default=[131072, 1048576], help="sequence lengths to estimate")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (GPU if any, else CPU: Triton interpreter)")
    p.add_argument("--out", help="write the JSON report here")
    args = p.parse_args()
    if args.smoke:
        args.histories, args.chunk, args.heads, args.kv_heads = [32, 64], 32, 4, 2
        args.head_dim, args.page, args.budget, args.warmup, args.iters = 16, 16, 1, 0, 1
        args.steps, args.strides, args.factors = [128], [1, 4], [2]
    return args


def bench_history(args, history: int, device: torch.device, timer) -> dict:
    from oomb.attention import triton_paged, triton_scores
    from oomb.kv import ChunkSpan
    from oomb.kv.summaries import summarize_pages
    from oomb.sparse import SparseOptions, block_scores, candidate_options, rerank_block_scores, top_pages

    Hq, Hkv, D, P, Lq = args.heads, args.kv_heads, args.head_dim, args.page, args.chunk
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n_pages = -(-(history + Lq) // P)
    n_hist = history // P
    gen = torch.Generator(device=device).manual_seed(history)
    k_pool = torch.randn(n_pages, Hkv, P, D, device=device, dtype=dtype, generator=gen)
    v_pool = torch.randn(n_pages, Hkv, P, D, device=device, dtype=dtype, generator=gen)
    table = torch.randperm(n_pages, device=device, generator=gen).to(torch.int32)[None]
    q = torch.randn(1, Lq, Hq, D, device=device, dtype=dtype, generator=gen).transpose(1, 2)  # HF layout
    scale = D ** -0.5
    history_pages = k_pool[table[0, :n_hist].long()][None]  # (1, n_hist, Hkv, P, D)
    summaries = summarize_pages(history_pages, P, ("key_min", "key_max"))  # name -> (1, n_hist, Hkv, D)
    options = SparseOptions(budget=args.budget, sink_pages=1, score="minmax", selection="kv_head", leak_free=False)

    def minmax():
        return top_pages(block_scores(q, summaries, P, options, scale), options)

    row = {"history": history, "history_pages": n_hist}
    row["minmax_ms"] = timer(minmax, args.warmup, args.iters)
    for stride in args.strides:
        def exact(stride=stride):
            scores = triton_scores.exact_page_scores(q, k_pool, table, history, scale, row_stride=stride)
            return top_pages(scores, options)
        row[f"exact_stride{stride}_ms"] = timer(exact, args.warmup, args.iters)
    chunk = ChunkSpan(1, history, history + Lq)
    for factor in args.factors:
        def rerank(factor=factor):
            candidates = top_pages(block_scores(q, summaries, P, options, scale),
                                   candidate_options(replace(options, rerank_factor=factor), 0))
            return top_pages(rerank_block_scores(q, k_pool, table, chunk, candidates, options, scale), options)
        row[f"rerank_x{factor}_ms"] = timer(rerank, args.warmup, args.iters)
    row["dense_fwd_ms"] = timer(lambda: triton_paged.paged_attention_forward(q, k_pool, v_pool, table, history, scale),
                                args.warmup, args.iters)
    # Same pages? The overlap of the two rules' selections (a diagnostic of random data, not of quality).
    chosen = top_pages(triton_scores.exact_page_scores(q, k_pool, table, history, scale), options)
    row["exact_vs_minmax_overlap"] = _overlap(chosen, minmax())
    return row


def _overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean fraction of a's selected pages that b also selects."""
    hits = (a[..., :, None] == b[..., None, :]).any(-1).float()
    return hits.mean().item()


def estimate_step(rows: list[dict], key: str, seq_len: int, chunk: int, layers: int) -> float:
    """Seconds of scoring in a step of ``seq_len`` tokens: per chunk the per-call time at its history,
    linearly interpolated (extrapolated) between the measured histories, times the layers."""
    xs = [r["history"] for r in rows]
    ys = [r[key] for r in rows]

    def at(h: int) -> float:
        if len(xs) == 1:
            return ys[0] * h / xs[0]
        i = max(1, min(len(xs) - 1, sum(x <= h for x in xs)))
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (h - x0) / (x1 - x0)

    ms = sum(max(0.0, at(start)) for start in range(chunk, seq_len, chunk))  # chunk 0 has no history
    return ms * layers / 1e3


def _tuned_configs() -> dict:
    """The configs the score kernels' autotuners picked, per tuning key (the kernels' real choices)."""
    from oomb.attention import triton_block_scores, triton_scores

    return {kernel.fn.__name__: {str(key): str(config) for key, config in getattr(kernel, "cache", {}).items()}
            for kernel in (triton_scores._exact_scores_kernel, triton_block_scores._block_scores_kernel)}


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from attention import Timer, kernel_device

    device = kernel_device(args.smoke)
    from oomb.machine import git_commit  # after kernel_device: importing oomb reads TRITON_INTERPRET

    timer = Timer(device)
    rows = []
    for history in args.histories:
        rows.append(bench_history(args, history, device, timer))
        r = rows[-1]
        print(f"history {history:>8}: minmax {r['minmax_ms']:8.2f} ms | "
              + " | ".join(f"exact/{s} {r[f'exact_stride{s}_ms']:8.2f} ms" for s in args.strides)
              + " | " + " | ".join(f"rerank x{f} {r[f'rerank_x{f}_ms']:8.2f} ms" for f in args.factors)
              + f" | dense fwd {r['dense_fwd_ms']:8.2f} ms | overlap {r['exact_vs_minmax_overlap']:.2f}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    keys = ["minmax_ms", *(f"exact_stride{s}_ms" for s in args.strides), *(f"rerank_x{f}_ms" for f in args.factors),
            "dense_fwd_ms"]
    estimates = {str(n): {k.removesuffix("_ms"): estimate_step(rows, k, n, args.chunk, args.layers) for k in keys}
                 for n in args.steps}
    for n, est in estimates.items():
        print(f"estimated seconds per step of {n} tokens ({args.layers} layers): "
              + ", ".join(f"{k} {v:.2f}" for k, v in est.items()))
    commit = git_commit()
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
        "commit": commit or None,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "workload": {"chunk": args.chunk, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                     "page": args.page, "budget": args.budget, "dtype": str(torch.bfloat16 if device.type == "cuda"
                                                                           else torch.float32)},
        "measured_per_call": rows,
        "tuned_configs": _tuned_configs(),
        "estimated_step_seconds": {"note": "estimate: per-call times interpolated over a step's chunks x layers",
                                   "layers": args.layers, **estimates},
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
