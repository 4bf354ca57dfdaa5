"""Add gradient rows into a pool's rows, duplicates summed in a fixed order, in one Triton kernel.

    add_rows_(pool_rows, rows, grad)   # pool_rows[rows[i]] += grad[i], in place

Why: the sparse cuDNN backward adds each selection group's dK, dV (bf16, one row of page x head_dim
values per selected (page, KV head)) into the float32 page gradients. With torch that is a cast of the
whole gradient to float32 (a copy of twice its size) and ``index_put_(accumulate=True)``, which sorts
the indices and reads the float32 copy again: about 50 ms per layer of the 7B's 128K step, measured in
the chosen-plan profile (float32 casts ~31 ms, most of them these gradients' by size, an attribution the
profile does not make; sorted scatter ~20 ms per layer). Here the bf16 rows are read
once and converted in registers.

Determinism: a row that several groups selected receives its updates one after another in the order
of ``rows`` (a stable sort puts equal indices in their original order), each added in float32 and
rounded to the pool's dtype, as ``index_put_(accumulate=True)`` does. The result is the same bits in
every run, and equals the sequential sum ``pool[r] += g_1; pool[r] += g_2; ...`` in that order.
No atomics: one program owns one destination row's tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_paged import INTERPRET

_BLOCK = 256 if INTERPRET else 2048
"""Values of a row per program: 2048 float32 = 8 KB of accumulator over 4 warps (16 per thread)."""


@triton.jit(do_not_specialize=["num_rows", "width"])
def _add_rows_kernel(pool_ptr, grad_ptr, sorted_rows_ptr, order_ptr, num_rows, width,
                     BLOCK: tl.constexpr):
    """Grid (num_rows, cdiv(width, BLOCK)): program (i, c) does the work of sorted entry i's row if i
    is the first entry of that row, and nothing otherwise."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    row = tl.load(sorted_rows_ptr + i)
    previous = tl.load(sorted_rows_ptr + i - 1, mask=i > 0, other=-1)
    if previous != row:
        target = pool_ptr + row * width + cols
        total = tl.load(target, mask=ok, other=0.0).to(tl.float32)
        j = i
        current = row
        while current == row:
            source = tl.load(order_ptr + j)
            update = tl.load(grad_ptr + source * width + cols, mask=ok, other=0.0).to(tl.float32)
            total = (total + update).to(pool_ptr.dtype.element_ty).to(tl.float32)  # rounded as each add is
            j += 1
            current = tl.load(sorted_rows_ptr + j, mask=j < num_rows, other=-1)
        tl.store(target, total.to(pool_ptr.dtype.element_ty), mask=ok)


def sorted_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` sorted (int64) and the stable order that sorts them: what add_rows_ needs, computed once for
    several gradients added at the same rows (the sparse backward's dK and dV; a sort of 8,320 indices is
    about 56 us on the H200, several small kernels)."""
    return torch.sort(rows.long(), stable=True)


def add_rows_(pool_rows: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor,
              order: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``pool_rows[rows[i]] += grad[i]`` for every i, in place, duplicates in the order of ``rows``.

    pool_rows: contiguous (R, W) float32/bf16/fp16; rows: (N,) integer indices in [0, R); grad:
    contiguous (N, W) of any floating dtype (converted in the kernel); order: ``sorted_rows(rows)`` if already
    made. Returns ``pool_rows``."""
    if pool_rows.dim() != 2 or grad.dim() != 2 or rows.dim() != 1:
        raise ValueError(f"add_rows_ takes (R, W) rows, (N,) indices and (N, W) gradients; got "
                         f"{tuple(pool_rows.shape)}, {tuple(rows.shape)}, {tuple(grad.shape)}")
    if grad.shape != (rows.shape[0], pool_rows.shape[1]):
        raise ValueError(f"{rows.shape[0]} indices need ({rows.shape[0]}, {pool_rows.shape[1]}) gradients, "
                         f"got {tuple(grad.shape)}")
    if not (pool_rows.is_contiguous() and grad.is_contiguous()):
        raise ValueError("add_rows_ needs contiguous pool rows and gradients")
    if pool_rows.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before import)")
    num_rows, width = rows.shape[0], pool_rows.shape[1]
    if num_rows == 0 or width == 0:
        return pool_rows
    in_order, order = sorted_rows(rows) if order is None else order
    grid = (num_rows, triton.cdiv(width, _BLOCK))
    _add_rows_kernel[grid](pool_rows, grad, in_order, order, num_rows, width, BLOCK=_BLOCK, num_warps=4)
    return pool_rows
