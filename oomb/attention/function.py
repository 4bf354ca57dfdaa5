"""The autograd Function of a chunk's attention over the paged store.

Forward reads K, V of every page up to and including the chunk from the store (the chunk's own
pages hold exactly the k, v it was given: they were written in stage 1 from the same inputs).
Backward adds dK, dV of every page it read into the page gradient buffers, outside autograd, and
returns the chunk's own accumulated page gradients as the gradients of k and v. By then those
buffers hold the contributions of every later chunk (processed earlier in the reverse pass) plus
the chunk's own, so summed over chunks the result is the exact full-sequence gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv import ChunkSpan, PagedKVStore
from .backend import AttentionBackend


@dataclass(frozen=True)
class PagedAttentionCall:
    """What one attention call needs besides q, k, v: the store, the layer and the chunk."""

    store: PagedKVStore
    layer: int
    chunk: ChunkSpan
    backend: AttentionBackend
    scale: float


class _PagedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: PagedAttentionCall,
                recompute_cache: dict | None):
        pages = call.store.layers[call.layer]
        if recompute_cache is not None and call.layer in recompute_cache:
            # Layer checkpointing replays this forward in backward with the same q and pages:
            # reuse the result of the first pass instead of recomputing attention.
            out, lse = recompute_cache.pop(call.layer)
        else:
            out, lse = call.backend.forward(
                q, pages.k, pages.v, call.store.page_table, call.chunk.start, call.scale
            )
            if recompute_cache is not None:
                recompute_cache[call.layer] = (out.detach(), lse)
        ctx.save_for_backward(q, out, lse)
        ctx.call = call
        ctx.kv_dtype = k.dtype
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, out, lse = ctx.saved_tensors
        call: PagedAttentionCall = ctx.call
        pages = call.store.layers[call.layer]
        dq = call.backend.backward(
            q, pages.k, pages.v, call.store.page_table, call.chunk.start, call.scale,
            out, dout, lse, pages.dk, pages.dv,
        )
        dk, dv = call.store.chunk_grads(call.layer, call.chunk)
        return dq, dk.to(ctx.kv_dtype), dv.to(ctx.kv_dtype), None, None


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: PagedAttentionCall, recompute_cache: dict | None = None
) -> torch.Tensor:
    """(B, Hq, L, D) attention output of the chunk; differentiable in q, k, v.

    ``recompute_cache`` (layer -> (out, lse)), given when the layer is checkpointed, lets the
    checkpoint's replay of this forward reuse the first pass's result.
    """
    return _PagedAttention.apply(q, k, v, call, recompute_cache)


def fill_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: PagedAttentionCall) -> torch.Tensor:
    """Stage 1 (no grad): write the chunk's k, v into its pages, then attend."""
    call.store.write(call.layer, call.chunk, k, v)
    pages = call.store.layers[call.layer]
    out, _ = call.backend.forward(q, pages.k, pages.v, call.store.page_table, call.chunk.start, call.scale)
    return out
