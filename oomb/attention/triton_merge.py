"""Two partial attentions over disjoint keys merged into one, in one Triton kernel.

    merge_pair(out_a, lse_a, out_b, lse_b, out_dtype) -> (out, lse)

Why: the cuDNN paths run a chunk's attention as two calls (its history, then its own keys causally) and
fold them with reference.merge_window: a log-add-exp of the two lse, two exponentials, two float32
products of (B, Hq, L, D) size, their sum and a cast back, each a pass over device memory. In the 7B's
128K sparse step that was about 50 ms of every 4 layers' forward passes on the H200 (profile-sparse-
chosen-128k: the products, the sum and the casts by their launching ops). Here each row is read once per
input and written once, in float32 arithmetic: ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a *
exp(lse_a - lse) + out_b * exp(lse_b - lse)``, rows that saw no key in either part empty (weights 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_paged import INTERPRET

_ROWS = 16 if INTERPRET else 32
"""Rows per program: 32 x 128 float32 per input is 16 KB over 4 warps."""


@triton.jit(do_not_specialize=["num_heads", "length"])
def _merge_pair_kernel(out_ptr, lse_ptr, a_ptr, la_ptr, b_ptr, lb_ptr,
                       s_ab, s_ah, s_al, s_bb, s_bh, s_bl, s_lab, s_lah, s_lbb, s_lbh,
                       num_heads, length, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """Grid (B * H * cdiv(length, ROWS),), row tiles fastest. The output is contiguous (B, H, L, D) and
    (B, H, L); the inputs' last dim is contiguous, the others any strides."""
    tiles = tl.cdiv(length, ROWS)
    bh = tl.program_id(0) // tiles
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    rows = (tl.program_id(0) % tiles) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < length
    ok = row_ok[:, None] & (cols < HEAD_DIM)[None, :]
    la = tl.load(la_ptr + b * s_lab + h * s_lah + rows, mask=row_ok, other=float("-inf"))
    lb = tl.load(lb_ptr + b * s_lbb + h * s_lbh + rows, mask=row_ok, other=float("-inf"))
    top = tl.maximum(la, lb)
    empty = top == float("-inf")
    shift = tl.where(empty, 0.0, top)
    wa = tl.exp(la - shift)
    wb = tl.exp(lb - shift)
    total = tl.where(empty, 1.0, wa + wb)  # 0 + 0 in an empty row: its weights stay 0
    lse = tl.where(empty, float("-inf"), shift + tl.log(total))
    scale = 1.0 / total
    wa = wa * scale
    wb = wb * scale
    r64 = rows.to(tl.int64)[:, None]
    oa = tl.load(a_ptr + b * s_ab + h * s_ah + r64 * s_al + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    ob = tl.load(b_ptr + b * s_bb + h * s_bh + r64 * s_bl + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    merged = oa * wa[:, None] + ob * wb[:, None]
    tl.store(out_ptr + (bh.to(tl.int64) * length + r64) * HEAD_DIM + cols[None, :],
             merged.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(lse_ptr + bh.to(tl.int64) * length + rows, lse, mask=row_ok)


def merge_pair(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
               out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of two disjoint key sets from each one's (out, lse).

    out_a, out_b: (B, H, L, D) float32/bf16/fp16 with a contiguous last dim; lse_a, lse_b: (B, H, L) float32
    natural-log sums with a contiguous last dim (-inf: a row that saw no key there). Returns a contiguous
    ``out_dtype`` out and a float32 lse."""
    if out_a.dim() != 4 or out_a.shape != out_b.shape or lse_a.shape != out_a.shape[:3] \
            or lse_b.shape != lse_a.shape:
        raise ValueError(f"merge_pair takes two (B, H, L, D) outs and their (B, H, L) lse; got "
                         f"{tuple(out_a.shape)}, {tuple(lse_a.shape)}, {tuple(out_b.shape)}, {tuple(lse_b.shape)}")
    if lse_a.dtype != torch.float32 or lse_b.dtype != torch.float32:
        raise TypeError(f"the lse must be float32; got {lse_a.dtype}, {lse_b.dtype}")
    if any(t.stride(-1) != 1 for t in (out_a, out_b, lse_a, lse_b)):
        raise ValueError("merge_pair needs a contiguous last dim in every input")
    if out_a.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before import)")
    B, H, L, D = out_a.shape
    out = torch.empty((B, H, L, D), dtype=out_dtype, device=out_a.device)
    lse = torch.empty((B, H, L), dtype=torch.float32, device=out_a.device)
    if out.numel() == 0:
        return out, lse
    grid = (B * H * triton.cdiv(L, _ROWS),)  # one axis: CUDA caps the second at 65535
    _merge_pair_kernel[grid](out, lse, out_a, lse_a, out_b, lse_b, *out_a.stride()[:3], *out_b.stride()[:3],
                             *lse_a.stride()[:2], *lse_b.stride()[:2], H, L, HEAD_DIM=D,
                             BLOCK_D=triton.next_power_of_2(D), ROWS=_ROWS, num_warps=4)
    return out, lse
