"""TFLOP/s of oomb's paged Triton attention vs torch SDPA (flash backend) on the same causal work.

Workload (docs/kernels.md): one chunk of 4096 queries against histories of 32K, 128K and 512K
tokens, 28 query heads, 4 KV heads, head dim 128, bfloat16, pages of 128 tokens (shuffled page ids).
SDPA gets the same keys as dense tensors with K/V repeated to 28 heads (repetition not timed) and
a bottom-right causal mask (``causal_lower_right``), under ``sdpa_kernel(FLASH_ATTENTION)``. On a GPU
the cudnn backend (oomb/attention/cudnn_paged.py: cuDNN's kernels over the same pages) is timed too.

FLOPs are counted identically for both, causal-aware: forward = 4 * D * Hq * (visible query-key
pairs), backward = 2.5 x forward (the FlashAttention convention: 5 matmuls vs 2). Times are CUDA
events around each call, warm-up (and autotuning) excluded, median over the timed iterations.

    python benchmarks/attention.py                 # full run on a GPU, writes the JSON
    python benchmarks/attention.py --smoke         # tiny shapes (CPU: the Triton interpreter)

``--softcap C`` also times our kernels with logit softcapping (Gemma 2: c * tanh(s / c)), counting the
same FLOPs, so that ``softcap_*_cost`` is the capped kernels' time over the plain ones'.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

BWD_FLOP_RATIO = 2.5  # backward = 5 matmuls of the forward's 2
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def add_workload_args(p: argparse.ArgumentParser, histories: list[int]) -> None:
    """The chunk's shape (paged_inputs reads it) and --smoke."""
    p.add_argument("--histories", type=int, nargs="+", default=histories)
    p.add_argument("--chunk", type=int, default=4096, help="queries per chunk")
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=128)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (GPU if any, else CPU: Triton interpreter)")


def shrink_for_smoke(args: argparse.Namespace) -> None:
    """--smoke: tiny shapes that the Triton interpreter runs in seconds."""
    args.histories, args.chunk, args.heads, args.kv_heads = [32], 16, 4, 2
    args.head_dim, args.page = 16, 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(p, [32768, 131072, 524288])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", help="also write the JSON report here (the default file is named after the GPU)")
    p.add_argument("--softcap", type=float, default=None,
                   help="also time our kernels with this logit softcap (Gemma 2: 50)")
    args = p.parse_args()
    if args.smoke:
        shrink_for_smoke(args)
        args.warmup, args.iters = 1, 1
    return args


def visible_pairs(history: int, chunk: int) -> int:
    """Query-key pairs a bottom-right causal chunk computes: every history key, then a triangle."""
    return chunk * history + chunk * (chunk + 1) // 2


class Timer:
    """Median milliseconds per call: CUDA events on a GPU, perf_counter on CPU (smoke runs)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, warmup: int, iters: int) -> float:
        for _ in range(warmup):
            fn()
        self._sync()
        times = []
        for _ in range(iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def paged_inputs(args: argparse.Namespace, history: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The workload's chunk: q (1, Hq, Lq, D) in HF's transposed layout, K/V pools (pages, Hkv, P, D) of
    history + Lq keys under a shuffled page table (1, pages), and dout; bf16 on a GPU, float32 on CPU."""
    B, Hq, Hkv, D, P, Lq = 1, args.heads, args.kv_heads, args.head_dim, args.page, args.chunk
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n_pages = -(-(history + Lq) // P)
    gen = torch.Generator(device=device).manual_seed(history)
    k_pool = torch.randn(n_pages, Hkv, P, D, device=device, dtype=dtype, generator=gen)
    v_pool = torch.randn(n_pages, Hkv, P, D, device=device, dtype=dtype, generator=gen)
    page_table = torch.randperm(n_pages, device=device, generator=gen).to(torch.int32)[None]
    q = torch.randn(B, Lq, Hq, D, device=device, dtype=dtype, generator=gen).transpose(1, 2)
    dout = torch.randn(B, Hq, Lq, D, device=device, dtype=dtype, generator=gen)
    return q, k_pool, v_pool, page_table, dout


def bench_history(args, history: int, device: torch.device, timer: Timer) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from oomb.attention import triton_paged

    B, Hq, Hkv, D, P, Lq = 1, args.heads, args.kv_heads, args.head_dim, args.page, args.chunk
    num_keys = history + Lq
    n_pages = -(-num_keys // P)
    q, k_pool, v_pool, page_table, dout = paged_inputs(args, history, device)
    dk_pool = torch.zeros(k_pool.shape, device=device, dtype=torch.float32)  # fp32 gradient pages
    dv_pool = torch.zeros_like(dk_pool)
    scale = D**-0.5

    # Dense copies for SDPA: (B, Hq, num_keys, D), K/V repeated for GQA outside the timed region.
    def dense(pool):
        keys = pool[page_table[0].long()].permute(1, 0, 2, 3).reshape(Hkv, n_pages * P, D)[:, :num_keys]
        return keys.repeat_interleave(Hq // Hkv, dim=0)[None].contiguous()

    k, v = dense(k_pool).requires_grad_(), dense(v_pool).requires_grad_()
    qs = q.detach().clone().requires_grad_()
    mask = causal_lower_right(Lq, num_keys)
    backend = SDPBackend.FLASH_ATTENTION if device.type == "cuda" else SDPBackend.MATH

    def ours_fwd():
        return triton_paged.paged_attention_forward(q, k_pool, v_pool, page_table, history, scale)

    def ours_fwd_bwd():
        out, lse = ours_fwd()
        triton_paged.paged_attention_backward(
            q, k_pool, v_pool, page_table, history, scale, out, dout, lse, dk_pool, dv_pool
        )

    def capped_fwd():
        return triton_paged.paged_attention_forward(q, k_pool, v_pool, page_table, history, scale,
                                                    softcap=args.softcap)

    def capped_fwd_bwd():
        out, lse = capped_fwd()
        triton_paged.paged_attention_backward(q, k_pool, v_pool, page_table, history, scale, out, dout, lse,
                                              dk_pool, dv_pool, softcap=args.softcap)

    def sdpa_fwd():
        with sdpa_kernel(backend), torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)

    def sdpa_fwd_bwd():
        qs.grad = k.grad = v.grad = None  # no gradient accumulation pass
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
        out.backward(dout)

    # The cudnn backend (oomb/attention/cudnn_paged.py) on the same pages: cuDNN's kernels per window.
    from oomb.attention.cudnn_paged import WindowedAttention

    windowed = WindowedAttention()

    def cudnn_fwd():
        return windowed.paged_attention_forward(q, k_pool, v_pool, page_table, history, scale)

    def cudnn_fwd_bwd():
        out, lse = cudnn_fwd()
        windowed.paged_attention_backward(q, k_pool, v_pool, page_table, history, scale, out, dout, lse, dk_pool,
                                          dv_pool)

    # Same work: both must give the same attention output.
    max_diff = (ours_fwd()[0].float() - sdpa_fwd().float()).abs().max().item()

    fwd_flops = 4 * D * Hq * B * visible_pairs(history, Lq)
    row = {"history": history, "num_keys": num_keys, "fwd_tflop": fwd_flops / 1e12,
           "max_abs_diff_out": max_diff}
    for name, fn, flops in (
        ("ours_fwd", ours_fwd, fwd_flops),
        ("sdpa_fwd", sdpa_fwd, fwd_flops),
        ("ours_fwd_bwd", ours_fwd_bwd, fwd_flops * (1 + BWD_FLOP_RATIO)),
        ("sdpa_fwd_bwd", sdpa_fwd_bwd, fwd_flops * (1 + BWD_FLOP_RATIO)),
        *((("cudnn_fwd", cudnn_fwd, fwd_flops), ("cudnn_fwd_bwd", cudnn_fwd_bwd, fwd_flops * (1 + BWD_FLOP_RATIO)))
          if device.type == "cuda" else ()),
        *((("softcap_fwd", capped_fwd, fwd_flops), ("softcap_fwd_bwd", capped_fwd_bwd,
                                                     fwd_flops * (1 + BWD_FLOP_RATIO)))
          if args.softcap else ()),
    ):
        try:
            ms = timer(fn, args.warmup, args.iters)
        except RuntimeError as err:  # cuDNN may refuse a shape (head dim 256 in some versions): keep the rest
            if not name.startswith("cudnn"):
                raise
            row[f"{name}_error"] = str(err)[:300]
            continue
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = flops / (ms * 1e-3) / 1e12
    if device.type == "cuda":
        row["ours_kernel_ms"] = kernel_times(ours_fwd_bwd)
    if args.softcap:
        row["softcap_fwd_cost"] = row["softcap_fwd_ms"] / row["ours_fwd_ms"]
        row["softcap_fwd_bwd_cost"] = row["softcap_fwd_bwd_ms"] / row["ours_fwd_bwd_ms"]
    row["fwd_ratio"] = row["ours_fwd_tflops"] / row["sdpa_fwd_tflops"]
    row["fwd_bwd_ratio"] = row["ours_fwd_bwd_tflops"] / row["sdpa_fwd_bwd_tflops"]
    return row


def kernel_times(fn) -> dict[str, float]:
    """Device milliseconds per kernel name over one call (where the time of a step goes)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us:
            times[event.key] = round(us / 1e3, 3)
    return times


def chosen_configs() -> dict:
    """The autotuner's pick per kernel and key (empty under the interpreter)."""
    from oomb.attention import triton_paged

    picks = {}
    for name in ("_fwd_kernel", "_dkdv_kernel", "_dq_kernel"):
        cache = getattr(getattr(triton_paged, name), "cache", {})
        picks[name] = {str(key): str(cfg) for key, cfg in cache.items()}
    return picks


def write_kernel_report(args: argparse.Namespace, device: torch.device, rows: list[dict]) -> dict:
    """The per-call benchmarks' JSON (date, commit, device, command, workload, rows), written to ``args.out``
    when given."""
    from oomb.machine import git_commit

    report = {"date": datetime.date.today().isoformat(), "commit": git_commit(),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "command": " ".join(sys.argv), "workload": {k: v for k, v in vars(args).items() if k != "out"},
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        print("wrote", args.out)
    return report


def kernel_device(smoke: bool) -> torch.device:
    """The GPU; without one, with ``smoke``, the CPU through the Triton interpreter (chosen before any
    kernel module is imported); exits without a GPU otherwise. A smoke run on a GPU machine runs its tiny
    shapes on the GPU (the kernel modules there are compiled, not interpreted)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not smoke:
        sys.exit("needs a CUDA device (or --smoke for a CPU check through the Triton interpreter)")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return torch.device("cpu")


def main() -> None:
    from oomb.machine import git_commit

    args = parse_args()
    device = kernel_device(args.smoke)
    import triton

    timer = Timer(device)
    rows = []
    for history in args.histories:
        rows.append(bench_history(args, history, device, timer))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the previous history's tensors are gone

    header = (f"{'history':>8} | {'fwd ours':>9} {'fwd sdpa':>9} {'ratio':>6} | "
              f"{'f+b ours':>9} {'f+b sdpa':>9} {'ratio':>6}")
    print(f"TFLOP/s, {args.chunk} queries, Hq={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, "
          f"page={args.page}")
    print(header)
    for r in rows:
        print(f"{r['history']:>8} | {r['ours_fwd_tflops']:>9.1f} {r['sdpa_fwd_tflops']:>9.1f} "
              f"{r['fwd_ratio']:>6.2f} | {r['ours_fwd_bwd_tflops']:>9.1f} {r['sdpa_fwd_bwd_tflops']:>9.1f} "
              f"{r['fwd_bwd_ratio']:>6.2f}")
        if args.softcap:
            print(f"{'':>8}   softcap {args.softcap}: fwd {r['softcap_fwd_tflops']:.1f} "
                  f"({r['softcap_fwd_cost']:.2f}x the time), f+b {r['softcap_fwd_bwd_tflops']:.1f} "
                  f"({r['softcap_fwd_bwd_cost']:.2f}x)")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": git_commit(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "workload": {
            "chunk": args.chunk, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
            "page": args.page, "dtype": "bfloat16" if device.type == "cuda" else "float32",
            "sdpa": "flash backend, K/V repeated to Hq, causal_lower_right",
            "flops": "fwd = 4*D*Hq*visible_pairs, bwd = 2.5*fwd", "softcap": args.softcap,
            "warmup": args.warmup, "iters": args.iters, "statistic": "median",
        },
        "autotuned_configs": chosen_configs(),
        "results": rows,
    }
    text = json.dumps(report, indent=2)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "attention.json").write_text(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    if not args.smoke:
        slug = "h200" if "H200" in gpu else gpu.lower().replace(" ", "_")
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        (RESULTS_DIR / f"attention_{slug}.json").write_text(text)


if __name__ == "__main__":
    main()
