"""What the cuDNN paths share: the fused kernel's contract and the page gathers around its calls.

A fused attention kernel takes contiguous (B, H, S, D) tensors, not pages: the dense (cudnn_paged.py), band
(cudnn_band.py) and sparse (cudnn_sparse.py) paths gather a window's keys into one block before each call
and add its key gradients back into their pages after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .reference import _gather_block, _scatter_add_block

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class FusedKernel:
    """Plain (B, H, S, D) attention with equal head counts for q, k, v, contiguous inputs.

    forward(q, k, v, causal, scale) -> (out in q's dtype, lse (B, H, Sq) float32 natural log)
    backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv); out and lse may be the merged
        ones of several windows: the result is then that window's share.
    causal means square, top-left aligned (only the local window uses it: Sq == Sk).
    """

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES
    """Input dtypes the kernel takes."""
    grouped_forward: Callable[[torch.device, torch.dtype], bool] | None = None
    """Whether ``forward`` on this device takes K and V with fewer heads than q (each KV head serving its
    consecutive query heads), or None (never): the chunk's own causal window then skips repeating them
    (local_forward). The backward keeps repeated heads: their dK/dV come back per query head and are summed
    in float32, where a grouped backward rounds each KV head's sum to bf16 (about twice the error against
    float32, measured)."""


def _gather(pool: torch.Tensor, page_table: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Keys [lo, hi) (lo on a page boundary) as one contiguous (B, Hkv, hi - lo, D) block."""
    P = pool.shape[2]
    return _gather_block(pool, page_table, lo // P, -(-hi // P), dtype=None)[:, :, : hi - lo].contiguous()


def _add_into_pages(pool: torch.Tensor, page_table: torch.Tensor, lo: int, grad: torch.Tensor) -> None:
    """Add the (B, Hkv, L, D) gradients of keys [lo, lo + L) into their pages, in the pool's dtype."""
    P = pool.shape[2]
    n = -(-grad.shape[2] // P)
    grad = torch.nn.functional.pad(grad, (0, 0, 0, n * P - grad.shape[2]))  # a partial last page
    _scatter_add_block(pool, page_table, lo // P, lo // P + n, grad)


def _gather_from(pool: torch.Tensor, page_table: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Keys [lo, hi) as one contiguous (B, Hkv, hi - lo, D) block; ``lo`` may lie inside a page."""
    P = pool.shape[2]
    first = lo // P * P
    block = _gather_block(pool, page_table, first // P, -(-hi // P), dtype=None)
    return block[:, :, lo - first: hi - first].contiguous()


def _fold(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, Hq, L, D) -> contiguous (B, Hkv, G * L, D): each KV head's query heads as one sequence."""
    B, Hq, L, D = x.shape
    return x.contiguous().view(B, num_kv_heads, (Hq // num_kv_heads) * L, D)


def _unfold(x: torch.Tensor, num_kv_heads: int, length: int) -> torch.Tensor:
    B, _, _, D = x.shape
    return x.reshape(B, -1, length, D)

