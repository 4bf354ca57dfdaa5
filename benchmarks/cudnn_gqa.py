"""Does torch's cuDNN attention take grouped-query inputs (fewer key/value heads than query heads) and strided
query views, with the same results as the repeated-heads, packed-copy inputs oomb gives it today, and faster?

oomb's cuDNN paths (oomb/attention/cudnn_paged.py, cudnn_sparse.py) hand cuDNN equal head counts: the chunk's
own causal attention repeats each KV head for its G query heads (``repeat_interleave``, then dK/dV summed over
the G copies), and the sparse path copies the queries (and dO, O, lse) into (groups, Hkv, G * rows, D) so that a
group's G heads share one KV head. Two cases of the 7B shape (28 query heads, 4 KV heads, head dim 128, bf16):

    local    a 4096-token chunk's causal attention over its own keys: repeated heads vs KV heads as they are
    sparse   32 query blocks of 128 queries, each against its own 8320 selected keys: packed copies vs a strided
             (blocks, Hq, 128, D) view of q with the KV heads as they are

Each arm runs forward + backward (what oomb's code around the kernel does included: the repeats, the packing
copies, the dK/dV sums); the JSON has the largest differences of out, lse, dQ, dK, dV from the current arm and
from a float32 reference (the current arm's own difference from that reference is the yardstick), and the
median milliseconds (CUDA events).

    python benchmarks/cudnn_gqa.py --out cudnn_gqa.json     # a GPU with cuDNN attention
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rows", type=int, default=128, help="queries per block (sparse case)")
    p.add_argument("--keys", type=int, default=8320, help="selected keys per block (sparse case)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", help="write the JSON report here")
    return p.parse_args()


def _forward(q, k, v, causal, scale):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                      scale=scale)
    return out, lse


def _backward(dout, q, k, v, out, lse, causal, scale):
    rng = torch.zeros((), dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, rng, rng, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale)


def _reference(q, k, v, dout, causal, scale):
    """float32 attention per query head (KV heads repeated), its out, lse and gradients."""
    G = q.shape[1] // k.shape[1]
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    s = qf @ kf.repeat_interleave(G, 1).transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ vf.repeat_interleave(G, 1)
    out.backward(dout.float())
    return out.detach(), lse.detach(), qf.grad, kf.grad, vf.grad


def local_arms(q, k, v, dout, scale):
    """The chunk's causal attention: (name -> callable returning out, lse, dq, dk, dv)."""
    G = q.shape[1] // k.shape[1]
    B, Hkv, L, D = k.shape

    def repeated():
        kr, vr = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        out, lse = _forward(q, kr, vr, True, scale)
        dq, dk, dv = _backward(dout, q, kr, vr, out, lse, True, scale)
        return (out, lse.reshape(q.shape[:3]), dq, dk.float().view(B, Hkv, G, L, D).sum(2),
                dv.float().view(B, Hkv, G, L, D).sum(2))

    def grouped():
        out, lse = _forward(q, k, v, True, scale)
        dq, dk, dv = _backward(dout, q, k, v, out, lse, True, scale)
        return out, lse.reshape(q.shape[:3]), dq, dk.float(), dv.float()

    return {"repeated": repeated, "grouped": grouped}


def sparse_arms(q, k_blocks, v_blocks, dout, rows, scale):
    """Each block of ``rows`` queries against its own keys (k_blocks: (n, Hkv, keys, D)): packed copies as
    cudnn_sparse.py's in-order layout makes them, vs strided views of q and dO with the KV heads as they are."""
    B, Hq, L, D = q.shape
    n, Hkv = k_blocks.shape[:2]
    G = Hq // Hkv

    def packed_layout(x):  # (1, Hq, L[, D]) -> (n, Hkv, G * rows[, D]), contiguous
        grouped = x.reshape((1, Hkv, G, n, rows) + x.shape[3:]).transpose(2, 3).transpose(1, 2)
        return grouped.reshape((n, Hkv, G * rows) + x.shape[3:]).contiguous()

    def unpack(y):  # inverse for (n, Hkv, G * rows[, D]) -> (1, Hq, L[, D])
        y = y.reshape((1, n, Hkv, G, rows) + y.shape[3:]).transpose(1, 2).transpose(2, 3)
        return y.reshape((1, Hq, n * rows) + y.shape[5:])

    def view_blocks(x):  # (1, Hq, L, D) -> (n, Hq, rows, D) strided view, no copy
        return x.view(Hq, n, rows, D).transpose(0, 1)

    def packed():
        qp = packed_layout(q)
        out, lse = _forward(qp, k_blocks, v_blocks, False, scale)
        dq, dk, dv = _backward(packed_layout(dout), qp, k_blocks, v_blocks, out, lse, False, scale)
        return unpack(out), unpack(lse.reshape(out.shape[:3])), unpack(dq), dk, dv

    def strided():
        qv = view_blocks(q)
        out, lse = _forward(qv, k_blocks, v_blocks, False, scale)
        dq, dk, dv = _backward(view_blocks(dout), qv, k_blocks, v_blocks, out, lse, False, scale)
        to_seq = lambda y: y.transpose(0, 1).reshape(1, Hq, L, *y.shape[3:])  # noqa: E731
        return to_seq(out), to_seq(lse.reshape(out.shape[:3])), to_seq(dq), dk, dv

    return {"packed": packed, "strided_grouped": strided}


def _max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def run_case(name: str, arms: dict, reference: tuple, timer, args) -> list[dict]:
    rows, baseline = [], None
    for arm, fn in arms.items():
        row = {"case": name, "arm": arm}
        try:
            result = [x.reshape(r.shape) for x, r in zip(fn(), reference, strict=True)]
            baseline = result if baseline is None else baseline
            for field, x, base, ref in zip(("out", "lse", "dq", "dk", "dv"), result, baseline, reference,
                                           strict=True):
                row[f"{field}_vs_reference"] = _max_diff(x, ref)
                row[f"{field}_vs_first_arm"] = _max_diff(x, base)
            row["ms"] = timer(fn, args.warmup, args.iters)
        except Exception as error:  # the op refuses the inputs
            row["error"] = f"{type(error).__name__}: {str(error)[:400]}"
        rows.append(row)
        print(name, arm, {k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()
                          if k not in ("case", "arm")}, flush=True)
    return rows


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from attention import Timer, kernel_device, write_kernel_report

    device = kernel_device(False)
    gen = torch.Generator(device=device).manual_seed(0)
    Hq, Hkv, D, L = args.heads, args.kv_heads, args.head_dim, args.chunk
    scale = D ** -0.5

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen).to(torch.bfloat16)

    timer = Timer(device)
    q, dout = randn(1, Hq, L, D), randn(1, Hq, L, D)
    k, v = randn(1, Hkv, L, D), randn(1, Hkv, L, D)
    rows = run_case("local", local_arms(q, k, v, dout, scale), _reference(q, k, v, dout, True, scale), timer, args)
    n = L // args.rows
    kb, vb = randn(n, Hkv, args.keys, D), randn(n, Hkv, args.keys, D)
    q_blocks = q.view(Hq, n, args.rows, D).transpose(0, 1)
    dout_blocks = dout.view(Hq, n, args.rows, D).transpose(0, 1)
    ref = _reference(q_blocks, kb, vb, dout_blocks, False, scale)
    to_seq = lambda y: y.transpose(0, 1).reshape(1, Hq, L, *y.shape[3:])  # noqa: E731
    reference = (to_seq(ref[0]), to_seq(ref[1]), to_seq(ref[2]), ref[3], ref[4])
    rows += run_case("sparse", sparse_arms(q, kb, vb, dout, args.rows, scale), reference, timer, args)
    write_kernel_report(args, device, rows)


if __name__ == "__main__":
    main()
