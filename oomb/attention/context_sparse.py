"""Sparse attention over one context-parallel rank's share of the keys, in plain PyTorch.

Under context parallelism (oomb/context_parallel.py) every rank runs the same sparse call with the
same selection (oomb/sparse.py: each rank scores the whole history from summaries it holds for
every chunk), and reads only the keys it holds::

    query block j, KV head h:   selected pages  p0   p1   p2   p3  |  chunk's own keys (causal)
    rank r reads:               those on r       x         x       |  all, if r owns the chunk

Each rank returns its partial (out, lse) in float32; ``ContextShard.merge`` folds them in rank order,
as the dense path merges key windows. Backward takes the merged (out, lse), adds dK, dV into the
rank's own pages only and returns its float32 share of dQ, which ``ContextShard.sum`` adds up.

The contract is reference_sparse.py's (same arguments, same masks for packed documents) plus
``share``; the float operations per block are the reference's on the rank's keys. Pages of other
ranks are never read: their rows in this rank's pools (page-table entries of chunks it does not
hold) may be anything, so their keys and values are replaced by zeros before any product and their
scores by -inf (forward) or 0 (backward); no gradient is added for them. A row may see no key on a
rank (every selected page elsewhere, the chunk on another rank): its partial out is 0 and its lse
-inf, an empty window to the merge.

Why a reference of its own rather than the Triton / cuDNN sparse kernels: those read every selected
page and the chunk itself; reading a subset needs a per-page mask and an "own chunk" switch in the
kernels (not there yet). The engine therefore runs sparse calls under cp with these functions on
every device (dense calls keep the step's backend: engine.attention_setup).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace

import torch

from ..documents import Documents
from .backend import AttentionBackend
from .reference import _check, _gather_block, _scatter_add_block
from .reference_sparse import _check_selection, _document_mask, _own_mask

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeyShare:
    """The keys of a sparse call one context-parallel rank reads."""

    visible: torch.Tensor
    """(B, Hkv, n_blocks, K) bool, any strides: which selected pages live on this rank
    (ContextShard.owned_positions of the selection)."""
    own_chunk: bool
    """Whether this rank holds the chunk's own pages (the chunk's owner)."""


def share_backend(backend: AttentionBackend) -> AttentionBackend:
    """``backend`` with its sparse functions replaced by this module's (dense ones unchanged)."""
    if backend.name != "torch":
        _warn_kernels(backend.name)
    return replace(backend, sparse_forward=sparse_attention_forward, sparse_backward=sparse_attention_backward)


@functools.cache
def _warn_kernels(backend: str) -> None:
    logger.warning("context-parallel sparse attention runs in torch (oomb/attention/context_sparse.py): the %s "
                   "sparse kernels cannot read only one rank's pages yet; dense calls keep %s", backend, backend)


def _rank_pages(pool: torch.Tensor, page_table: torch.Tensor, selection: torch.Tensor, share: KeyShare,
                block: int) -> torch.Tensor:
    """(B, Hkv, K * P, D) float32: the pages block ``block`` selected, zeros for those of other ranks."""
    B, Hkv, _, K = selection.shape
    positions = selection[:, :, block, :].long().reshape(B, Hkv * K)
    ids = page_table.long().gather(1, positions).reshape(B, Hkv, K)
    heads = torch.arange(Hkv, device=pool.device).reshape(1, Hkv, 1)
    pages = pool[ids, heads].float()  # (B, Hkv, K, P, D): head h of page ids[b, h, k]
    pages = torch.where(share.visible[:, :, block, :, None, None], pages, 0.0)
    return pages.reshape(B, Hkv, K * pool.shape[2], pool.shape[3])


def _hidden(share: KeyShare, block: int, page_size: int) -> torch.Tensor:
    """(B, Hkv, 1, 1, K * P) bool: the selected keys of block ``block`` on other ranks."""
    visible = share.visible[:, :, block, :, None].expand(-1, -1, -1, page_size).flatten(2)
    return ~visible[:, :, None, None]


def _block_keys(k_pool, v_pool, page_table, selection, share, block, own_k, own_v):
    """Keys and values block ``block`` reads on this rank: its visible selected pages, then (owner)
    the chunk's own keys up to the block's end."""
    k = _rank_pages(k_pool, page_table, selection, share, block)
    v = _rank_pages(v_pool, page_table, selection, share, block)
    if own_k is not None:
        end = (block + 1) * k_pool.shape[2]
        k, v = torch.cat([k, own_k[:, :, :end]], dim=2), torch.cat([v, own_v[:, :, :end]], dim=2)
    return k, v


def _masks(share, selection, documents, block, q0, q1, query_start, page_size, device):
    """Per block: [(slice of the keys, bool mask of the hidden ones)], broadcastable to the scores."""
    K, P = selection.shape[3], page_size
    masks = [(slice(0, K * P), _hidden(share, block, P))]
    if share.own_chunk:
        masks.append((slice(K * P, None), ~_own_mask(block, q1 - q0, P, device)))
    if documents is not None:
        seen = _document_mask(documents, selection, block, q0, q1, query_start, P)
        keys = K * P + ((block + 1) * P if share.own_chunk else 0)
        masks.append((slice(0, None), ~seen[..., :keys]))
    return masks


def sparse_attention_forward(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor, query_start: int,
    scale: float, selection: torch.Tensor, documents: Documents | None = None, *, share: KeyShare,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's partial attention of each query block over its share of the block's keys.

    Returns:
        out (B, Hq, Lq, D) float32 (0 where a row sees no key here) and lse (B, Hq, Lq) float32 (-inf there).
    """
    _check(q, k_pool, page_table, query_start)
    _check_selection(selection, q, k_pool)
    B, Hq, Lq, D = q.shape
    Hkv, P = k_pool.shape[1], k_pool.shape[2]
    G, c0, n_blocks = Hq // Hkv, query_start // P, -(-Lq // P)
    own_k = own_v = None
    if share.own_chunk:
        own_k = _gather_block(k_pool, page_table, c0, c0 + n_blocks)  # (B, Hkv, n_blocks * P, D)
        own_v = _gather_block(v_pool, page_table, c0, c0 + n_blocks)
    qf = q.float().reshape(B, Hkv, G, Lq, D) * scale
    out = torch.empty((B, Hkv, G, Lq, D), device=q.device)
    lse = torch.empty((B, Hkv, G, Lq), device=q.device)
    for j in range(n_blocks):
        q0, q1 = j * P, min((j + 1) * P, Lq)
        k, v = _block_keys(k_pool, v_pool, page_table, selection, share, j, own_k, own_v)
        scores = torch.einsum("bhgqd,bhkd->bhgqk", qf[..., q0:q1, :], k)
        for keys, hidden in _masks(share, selection, documents, j, q0, q1, query_start, P, q.device):
            scores[..., keys].masked_fill_(hidden, float("-inf"))
        block_lse = torch.logsumexp(scores, dim=-1)
        shift = torch.where(block_lse == float("-inf"), 0.0, block_lse)  # rows with no key here: weights 0
        probs = scores.sub_(shift[..., None]).exp_()
        out[..., q0:q1, :] = torch.einsum("bhgqk,bhkd->bhgqd", probs, v)
        lse[..., q0:q1] = block_lse
    return out.reshape(B, Hq, Lq, D), lse.reshape(B, Hq, Lq)


def sparse_attention_backward(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor, query_start: int,
    scale: float, selection: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
    dk_pool: torch.Tensor, dv_pool: torch.Tensor, documents: Documents | None = None, *, share: KeyShare,
) -> torch.Tensor:
    """Add dK, dV of this rank's share of the keys into its pages; return its float32 share of dQ.

    ``out`` and ``lse`` are the merged ones (every rank's keys). As in the reference, a history page
    read by several blocks gets their contributions summed in float32 before one addition to the pool.
    """
    _check(q, k_pool, page_table, query_start)
    _check_selection(selection, q, k_pool)
    B, Hq, Lq, D = q.shape
    Hkv, P = k_pool.shape[1], k_pool.shape[2]
    G, K, c0, n_blocks = Hq // Hkv, selection.shape[3], query_start // P, -(-Lq // P)
    qf = q.float().reshape(B, Hkv, G, Lq, D)
    do = dout.float().reshape(B, Hkv, G, Lq, D)
    delta = (do * out.float().reshape(B, Hkv, G, Lq, D)).sum(-1)  # rowsum(dO * O)
    lse = lse.reshape(B, Hkv, G, Lq)
    dq = torch.empty_like(qf)
    own_k = own_v = None
    if share.own_chunk:
        own_k = _gather_block(k_pool, page_table, c0, c0 + n_blocks)
        own_v = _gather_block(v_pool, page_table, c0, c0 + n_blocks)
        dk_own, dv_own = torch.zeros_like(own_k), torch.zeros_like(own_v)
    # Selected pages of any block: float32 sums indexed by rank in the union, as in the reference.
    union = torch.unique(selection.long())
    rank = torch.searchsorted(union, selection.long())  # (B, Hkv, n_blocks, K)
    dk_hist = torch.zeros((B, Hkv, union.numel(), P, D), device=q.device)
    dv_hist = torch.zeros_like(dk_hist)
    batch = torch.arange(B, device=q.device).reshape(B, 1, 1)
    heads = torch.arange(Hkv, device=q.device).reshape(1, Hkv, 1)
    for j in range(n_blocks):
        q0, q1 = j * P, min((j + 1) * P, Lq)
        k, v = _block_keys(k_pool, v_pool, page_table, selection, share, j, own_k, own_v)
        q_t, do_t = qf[..., q0:q1, :], do[..., q0:q1, :]
        scores = torch.einsum("bhgqd,bhkd->bhgqk", q_t, k).mul_(scale)
        probs = scores.sub_(lse[..., q0:q1, None]).exp_()  # the merged lse: finite in every row
        for keys, hidden in _masks(share, selection, documents, j, q0, q1, query_start, P, q.device):
            probs[..., keys].masked_fill_(hidden, 0.0)
        dv = torch.einsum("bhgqk,bhgqd->bhkd", probs, do_t)
        dprobs = torch.einsum("bhgqd,bhkd->bhgqk", do_t, v)
        dscores = probs.mul_(dprobs.sub_(delta[..., q0:q1, None]))
        dq[..., q0:q1, :] = torch.einsum("bhgqk,bhkd->bhgqd", dscores, k).mul_(scale)
        dk = torch.einsum("bhgqk,bhgqd->bhkd", dscores, q_t).mul_(scale)
        if share.own_chunk:
            end = (j + 1) * P
            dk_own[:, :, :end] += dk[:, :, K * P:]
            dv_own[:, :, :end] += dv[:, :, K * P:]
        if K:
            slot = rank[:, :, j, :]  # (B, Hkv, K): distinct within a row
            dk_hist[batch, heads, slot] += dk[:, :, : K * P].reshape(B, Hkv, K, P, D)
            dv_hist[batch, heads, slot] += dv[:, :, : K * P].reshape(B, Hkv, K, P, D)
    if share.own_chunk:
        _scatter_add_block(dk_pool, page_table, c0, c0 + n_blocks, dk_own)
        _scatter_add_block(dv_pool, page_table, c0, c0 + n_blocks, dv_own)
    if union.numel():
        # Only the (page, head) pairs some block selected on this rank get an addition (a page lives on
        # one rank: visible in every block that selects it or in none).
        touched = torch.zeros((B, Hkv, union.numel()), dtype=torch.bool, device=q.device)
        visible = share.visible.expand(selection.shape).reshape(B, Hkv, -1)
        touched.scatter_(2, rank.reshape(B, Hkv, -1), visible)
        b_idx, h_idx, u_idx = touched.nonzero(as_tuple=True)
        ids = page_table.long()[b_idx, union[u_idx]]
        dk_pool.index_put_((ids, h_idx), dk_hist[b_idx, h_idx, u_idx].to(dk_pool.dtype), accumulate=True)
        dv_pool.index_put_((ids, h_idx), dv_hist[b_idx, h_idx, u_idx].to(dv_pool.dtype), accumulate=True)
    return dq.reshape(B, Hq, Lq, D)
