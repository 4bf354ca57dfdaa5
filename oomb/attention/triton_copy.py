"""A strided tensor copied into a contiguous one, a row of its last dim at a time, in one Triton kernel.

    contiguous_rows(x) -> x.contiguous()   # x: up to 6 dims, its last dim contiguous (stride 1)

Why: the cuDNN paths reorder the queries, their gradient and the output between the model's layout and
the kernels' (the sparse path's groups of query blocks, the dense path's folded heads), repeat K and V
per query head (an expanded view, stride 0), and make the model's transposed queries contiguous. torch's
copy of such permuted views with 128-value rows moved about 1.3 TB/s on the H200 (40-46 us for the 7B's
29 MB of a 4096-token chunk, ~72 ms of every 4 layers of the 128K chosen-plan profile by launching op,
`profile-sparse-chosen-128k`); here each program moves whole rows, contiguous on both sides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_paged import INTERPRET

_ROWS = 16 if INTERPRET else 64
"""Rows per program: 64 rows of 128 bf16 values are 16 KB in flight."""
MAX_DIMS = 6


@triton.jit(do_not_specialize=["n_rows", "s0", "s1", "s2", "s3", "s4", "n1", "n2", "n3", "n4"])
def _copy_rows_kernel(src_ptr, dst_ptr, n_rows, s0, s1, s2, s3, s4, n1, n2, n3, n4,
                      WIDTH: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Grid (cdiv(n_rows, ROWS),): output row m (of WIDTH values) is the input row at the index that m
    unravels to over the leading sizes (n0, n1, n2, n3, n4), last fastest, with the input's strides."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    ok = (rows < n_rows)[:, None] & (cols < WIDTH)[None, :]
    r = rows.to(tl.int64)
    i4 = r % n4
    r = r // n4
    i3 = r % n3
    r = r // n3
    i2 = r % n2
    r = r // n2
    i1 = r % n1
    i0 = r // n1
    offset = i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3 + i4 * s4
    x = tl.load(src_ptr + offset[:, None] + cols[None, :], mask=ok)
    tl.store(dst_ptr + rows.to(tl.int64)[:, None] * WIDTH + cols[None, :], x, mask=ok)


def contiguous_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.contiguous()`` (the same values, a new contiguous tensor) for a tensor of at most 6 dims whose
    last dim is contiguous; any other strides, zero (expanded views) included."""
    if x.dim() > MAX_DIMS or x.dim() == 0 or (x.shape[-1] > 1 and x.stride(-1) != 1):
        raise ValueError(f"contiguous_rows takes at most {MAX_DIMS} dims with a contiguous last dim; got shape "
                         f"{tuple(x.shape)}, strides {x.stride()}")
    if x.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before import)")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    lead = [1] * (MAX_DIMS - x.dim()) + list(x.shape[:-1])
    strides = [0] * (MAX_DIMS - x.dim()) + list(x.stride()[:-1])
    n_rows = out.numel() // x.shape[-1]
    grid = (triton.cdiv(n_rows, _ROWS),)
    _copy_rows_kernel[grid](x, out, n_rows, *strides, *lead[1:], WIDTH=x.shape[-1],
                            BLOCK=triton.next_power_of_2(x.shape[-1]), ROWS=_ROWS, num_warps=4)
    return out
