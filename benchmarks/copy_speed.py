"""The cuDNN paths' layout copies: torch's ``contiguous`` against oomb's Triton row copy (triton_copy.py).

Views of the 7B shape's 4096-token chunk (28 query heads, 4 KV heads, head dim 128, bf16) that the cuDNN paths
copy: the model's transposed queries (B, Hq, L, D) of a (B, L, Hq, D) tensor, the sparse path's groups of
query blocks (one selection per 128-query block: (n, Hkv, G, rows, D) from the transposed queries), and
the chunk's KV heads expanded per query head. CUDA events, median of ``--iters`` calls; each row also says
whether the two copies are equal.

    python benchmarks/copy_speed.py --out copy_speed.json
    python benchmarks/copy_speed.py --smoke      # tiny shapes (CPU: Triton interpreter)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rows", type=int, default=128, help="queries per sparse group")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (GPU if any, else CPU: Triton interpreter)")
    p.add_argument("--out", help="write the JSON report here")
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.heads, args.kv_heads, args.head_dim, args.rows = 32, 4, 2, 16, 8
        args.warmup, args.iters = 0, 1
    return args


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from attention import Timer, kernel_device, write_kernel_report

    device = kernel_device(args.smoke)
    import torch

    from oomb.attention.triton_copy import contiguous_rows

    L, Hq, Hkv, D, rows = args.tokens, args.heads, args.kv_heads, args.head_dim, args.rows
    G, n = Hq // Hkv, L // rows
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, L, Hq, D, device=device, generator=gen).to(torch.bfloat16).transpose(1, 2)
    kv = torch.randn(1, Hkv, L, D, device=device, generator=gen).to(torch.bfloat16)
    views = {
        "transposed queries": q,
        "sparse groups": q.reshape(1, Hkv, G, n, rows, D).transpose(2, 3).transpose(1, 2),
        "repeated KV heads": kv[:, :, None].expand(1, Hkv, G, L, D),
    }
    timer = Timer(device)
    report = []
    for name, x in views.items():
        row = {"view": name, "shape": list(x.shape), "strides": list(x.stride()),
               "megabytes": x.numel() * x.element_size() / 1e6,
               "equal": bool(torch.equal(contiguous_rows(x), x.contiguous())),
               "torch_ms": timer(x.contiguous, args.warmup, args.iters),
               "triton_ms": timer(lambda x=x: contiguous_rows(x), args.warmup, args.iters)}
        report.append(row)
        print(f"{name:<20} {row['megabytes']:7.1f} MB  torch {row['torch_ms']:.4f} ms  triton {row['triton_ms']:.4f} ms"
              f"  equal {row['equal']}", flush=True)
    write_kernel_report(args, device, report)


if __name__ == "__main__":
    main()
