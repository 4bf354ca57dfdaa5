"""The autograd Function of a chunk's attention over the paged store.

Forward reads K, V of every page up to and including the chunk from the store (the chunk's own
pages hold exactly the k, v it was given: they were written in stage 1 from the same inputs).
Backward adds dK, dV of every page it read into the page gradient buffers, outside autograd, and
returns the chunk's own accumulated page gradients as the gradients of k and v. By then those
buffers hold the contributions of every later chunk (processed earlier in the reverse pass) plus
the chunk's own, so summed over chunks the result is the exact full-sequence gradient.

Dense attention reads the chunk's keys window by window (kv/store.py ``attention_windows``):
blocks of history pages, then the chunk itself (a backend may ask for the GPU-resident history as
one block: ``AttentionBackend.whole_history``). Forward merges the windows' partial results by
their log-sum-exp; backward runs each window with the merged statistics. Unless the backend asks for
the whole history, the windows are the same whether pages live on the GPU or stream from host memory
(kv/offload.py), so both compute the same float operations in the same order. Under context
parallelism (oomb/context_parallel.py) the store yields only the windows on this rank's pages, and
three hooks make the call exact on every rank: the partial (out, lse) merged across ranks, the dQ
shares summed, the chunk's own dK/dV taken from the rank that holds its pages.

With packed documents (oomb/documents.py) a dense call carries the step's Documents: the store's
windows start at the chunk's earliest document start (kv/store.py ``history_starts``) and the
backend masks keys before each query's own document start.

In sparse mode a call carries its page selection (oomb/sparse.py): each query block reads only its
selected history pages and its own chunk, and backward adds dK, dV only into those pages. Stage 1
makes the selection after writing the chunk's pages and keeps it in the store; stage 2 is handed
the same tensor, so it recomputes exactly the attention stage 1 computed. Under context parallelism
every rank holds the same selection and reads its share of the selected keys (attention/
context_sparse.py); the same three hooks merge the ranks' results.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.profiler import record_function

from ..config import SparseConfig
from ..documents import Documents
from ..kv import ChunkSpan, PagedKVStore
from ..sparse import select_pages
from .backend import AttentionBackend
from .context_sparse import KeyShare
from .reference import merge_window

SCORING_RANGE = "oomb.scoring"
"""Profiler range around stage 1's page selection (scores, candidates, top-k)."""


@dataclass(frozen=True)
class PagedAttentionCall:
    """What one attention call needs besides q, k, v: the store, the layer and the chunk."""

    store: PagedKVStore
    layer: int
    chunk: ChunkSpan
    backend: AttentionBackend
    scale: float
    sparse: SparseConfig | None = None
    """Sparse mode's options (None: dense). Stage 1 uses them to select pages."""
    selection: torch.Tensor | None = None
    """(B, Hkv, n_blocks, K) int32 history pages per query block (reference_sparse.py); None: all."""
    documents: Documents | None = None
    """Packed documents of the step (dense, and sparse on the torch and triton backends); None: plain
    causal attention."""

    def document_kwargs(self) -> dict:
        """The backend keyword for documents, only when there are some (backends without support keep
        their signature)."""
        return {} if self.documents is None else {"documents": self.documents}

    def sparse_kwargs(self) -> dict:
        """The sparse backend's keywords: documents, the blocks per selection where the backend takes
        them, and, context parallel, this rank's share of the keys."""
        kwargs = self.document_kwargs()
        if self.backend.sparse_block_group and self.sparse is not None:
            kwargs["block_group"] = self.sparse.query_block_pages
        context = self.store.context
        if context is None:
            return kwargs
        visible = context.owned_positions(self.selection, self.store.page_size)
        return {**kwargs, "share": KeyShare(visible, context.owns(self.chunk.index))}


def _attention_forward(q: torch.Tensor, call: PagedAttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    context = call.store.context
    if call.selection is not None:
        with call.store.selected_pages(call.layer, call.chunk, call.selection, grads=False) as view:
            selection = call.selection if view.selection is None else view.selection
            out, lse = call.backend.sparse_forward(q, view.k, view.v, view.page_table, call.chunk.start, call.scale,
                                                   selection, **call.sparse_kwargs())
        if context is None:
            return out, lse
        out, lse = context.merge(q, out, lse)  # context parallel: every rank's share of the selected keys
        return out.to(q.dtype), lse
    # Dense: the chunk's key windows (history blocks, then the chunk) one at a time, merged exactly.
    # With several windows (any history) the partial outputs stay float32 until the merge is complete.
    # Context parallel: this rank's windows (its own pages), then the ranks' partials merged the same way.
    out_dtype = torch.float32 if call.chunk.start > 0 or context is not None else None
    out = lse = None
    for view in call.store.stream(call.layer, call.chunk, grads=False, whole_history=call.backend.whole_history):
        out_w, lse_w = call.backend.forward(q, view.k, view.v, view.page_table, call.chunk.start, call.scale,
                                            key_range=view.key_range, out_dtype=out_dtype, **call.document_kwargs())
        out, lse = (out_w, lse_w) if out is None else merge_window(out, lse, out_w, lse_w)
    if context is not None:
        out, lse = context.merge(q, out, lse)
    return out.to(q.dtype), lse


def _attention_backward(q, out, dout, lse, call: PagedAttentionCall) -> torch.Tensor:
    """dQ; dK, dV of every page read are added into the page gradients (of the tier holding them)."""
    if call.selection is not None:
        with call.store.selected_pages(call.layer, call.chunk, call.selection, grads=True) as view:
            selection = call.selection if view.selection is None else view.selection
            dq = call.backend.sparse_backward(q, view.k, view.v, view.page_table, call.chunk.start, call.scale,
                                              selection, out, dout, lse, view.dk, view.dv, **call.sparse_kwargs())
        if call.store.context is not None:  # context parallel: the float32 dQ shares of every rank
            dq = call.store.context.sum(dq).to(q.dtype)
        return dq
    dout = dout.to(q.dtype)  # the kernels' dots take dO in q's dtype; delta must see the same values
    delta = call.backend.backward_delta(out, dout)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for view in call.store.stream(call.layer, call.chunk, grads=True, whole_history=call.backend.whole_history):
        call.backend.backward(q, view.k, view.v, view.page_table, call.chunk.start, call.scale, out, dout, lse,
                              view.dk, view.dv, key_range=view.key_range, delta=delta, dq_accumulator=dq,
                              **call.document_kwargs())
    if call.store.context is not None:  # context parallel: the dQ shares of every rank's pages
        dq = call.store.context.sum(dq)
    return dq.to(q.dtype)


class KeptOutputs:
    """OOMBConfig.performance.keep_attention_outputs: stage 1's (out, lse) per (layer, chunk index), taken by stage 2.

    A plain object rather than a dict on purpose: compiled decoder layers receive it inside the step's
    state, and torch.compile (2.11) guards on a dict's entries, so every layer and chunk recompiled the
    layer (46 graphs instead of 8 for a tiny model; the 7B's 128K step outlasted 120 s of warm-up)."""

    def __init__(self) -> None:
        self._outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(self, layer: int, chunk: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        self._outputs[(layer, chunk)] = (out, lse)

    def take(self, layer: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._outputs.pop((layer, chunk), None)

    def clear(self) -> None:
        self._outputs.clear()

    def __len__(self) -> int:
        return len(self._outputs)


class _PagedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: PagedAttentionCall,
                recompute_cache: dict | None, kept_outputs: KeptOutputs | None):
        if recompute_cache is not None and call.layer in recompute_cache:
            # Layer checkpointing replays this forward in backward with the same q and pages:
            # reuse the result of the first pass instead of recomputing attention.
            out, lse = recompute_cache.pop(call.layer)
        else:
            kept = kept_outputs.take(call.layer, call.chunk.index) if kept_outputs is not None else None
            out, lse = kept if kept is not None else _attention_forward(q, call)  # stage 1's, when it kept them
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
        dq = _attention_backward(q, out, dout, lse, call)
        dk, dv = call.store.chunk_grads(call.layer, call.chunk)
        if call.store.context is not None:  # context parallel: as the chunk's owner holds them
            dk, dv = call.store.context.from_owner(call.chunk.index, dk, dv)
        return dq, dk.to(ctx.kv_dtype), dv.to(ctx.kv_dtype), None, None, None


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: PagedAttentionCall, recompute_cache: dict | None = None,
    kept_outputs: KeptOutputs | None = None,
) -> torch.Tensor:
    """(B, Hq, L, D) attention output of the chunk; differentiable in q, k, v.

    ``recompute_cache`` (layer -> (out, lse)), given when the layer is checkpointed, lets the
    checkpoint's replay of this forward reuse the first pass's result. ``kept_outputs``
    (OOMBConfig.performance.keep_attention_outputs): stage 1's result, taken instead of computing.
    """
    return _PagedAttention.apply(q, k, v, call, recompute_cache, kept_outputs)


def fill_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: PagedAttentionCall,
                    kept_outputs: KeptOutputs | None = None) -> torch.Tensor:
    """Stage 1 (no grad): write the chunk's k, v into its pages (sparse: select and keep the pages
    each query block reads), then attend; ``kept_outputs``: keep (out, lse) there for stage 2."""
    call.store.write(call.layer, call.chunk, k, v)
    if call.sparse is not None:
        with record_function(SCORING_RANGE):  # benchmarks/profile_step.py counts what runs inside as scoring
            selection = select_pages(q, call.store, call.layer, call.chunk, call.sparse, call.scale, call.documents)
        call.store.save_selection(call.layer, call.chunk, selection)
        call = replace(call, selection=selection)
    out, lse = _attention_forward(q, call)
    if kept_outputs is not None:
        kept_outputs.keep(call.layer, call.chunk.index, out, lse)
    return out
