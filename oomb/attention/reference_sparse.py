"""Sparse paged attention in plain PyTorch: the oracle for the sparse kernels and the CPU path.

The contract of a sparse backend (the dense one, oomb/attention/reference.py, plus a selection):

    forward(q, k_pool, v_pool, page_table, query_start, scale, selection) -> (out, lse)
    backward(q, k_pool, v_pool, page_table, query_start, scale, selection,
             out, dout, lse, dk_pool, dv_pool) -> dq                 (dK, dV added into the pools)

    q, k_pool, v_pool, page_table, query_start, scale, out, lse, dk_pool, dv_pool: as in reference.py
    selection (B, Hkv, n_blocks, K) int32   page-table positions of the history pages query block j
                                            reads with KV head h: distinct, each < query_start // P.
                                            n_blocks = ceil(Lq / P); block j = queries [jP, (j+1)P)
                                            May be one row expanded over the blocks (stride 0: see
                                            shared_by_all_blocks), which backends group without
                                            reading it (no device synchronisation).

Query i of block j = i // P reads, for KV head h, every key of the pages selection[b, h, j, :]
(history pages are complete) and the chunk's own keys query_start .. query_start + i (causal).
Nothing else: the output and the gradients are those of exactly this attention. K may be 0 (the
first chunk, or no sinks and no budget). Backward adds dK, dV only into the selected pages and the
chunk's own pages.

Each block is one softmax over its K * P selected keys followed by its own chunk's keys up to its
last query. All arithmetic is float32.

``documents`` (packed documents, oomb/documents.py; optional keyword of both functions): query t of
row b also drops every key before ``documents.start[b, t]``, selected or its chunk's own. Every query
sees its own key, so no row is empty.

``softcap`` (logit softcapping, Gemma 2; optional keyword of both functions): every score s = scale * q.k
becomes softcap * tanh(s / softcap) before the softmax, as in reference.py.

``share`` (one context-parallel rank's keys, attention/context_sparse.py; optional keyword of both
functions): only the selected pages ``share.visible`` marks are read, and the chunk's own keys only
if ``share.own_chunk``. The pools' rows of other pages may hold anything (NaN included): their keys
and values are replaced by zeros before any product, their scores masked, and no gradient is added
for them. Forward returns float32 partials, in which a row may see no key (out 0, lse -inf);
backward takes the merged (out, lse) and returns the rank's float32 share of dQ. The float
operations are the unshared ones on the rank's keys, so the ranks' partials, merged in rank order
(``ContextShard.merge``), are the unshared attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..documents import Documents
from .reference import _check, _gather_block, _scatter_add_block


@dataclass(frozen=True)
class KeyShare:
    """The keys of a sparse call one context-parallel rank reads (oomb/context_parallel.py)."""

    visible: torch.Tensor
    """(B, Hkv, n_blocks, K) bool, any strides: which selected pages live on this rank
    (ContextShard.owned_positions of the selection)."""
    own_chunk: bool
    """Whether this rank holds the chunk's own pages (the chunk's owner)."""


def shared_by_all_blocks(selection: torch.Tensor) -> bool:
    """Whether every query block reads the same row: a view with stride 0 over the blocks, which is
    how oomb/sparse.py hands over a selection one group covers. Known without reading its values."""
    return selection.stride(2) == 0


def _check_selection(selection: torch.Tensor, q: torch.Tensor, k_pool: torch.Tensor,
                     share: KeyShare | None = None) -> None:
    B, _, Lq, _ = q.shape
    Hkv, P = k_pool.shape[1], k_pool.shape[2]
    n_blocks = -(-Lq // P)
    assert selection.dtype == torch.int32, f"selection must be int32, got {selection.dtype}"
    assert selection.dim() == 4 and selection.shape[:3] == (B, Hkv, n_blocks), (
        f"selection {tuple(selection.shape)} must be (B={B}, Hkv={Hkv}, n_blocks={n_blocks}, K)"
    )
    assert share is None or share.visible.shape == selection.shape, (
        f"share.visible {tuple(share.visible.shape)} must have the selection's shape {tuple(selection.shape)}"
    )


def _selected_pages(pool: torch.Tensor, page_table: torch.Tensor, selection: torch.Tensor, share: KeyShare | None,
                    block: int) -> torch.Tensor:
    """The pages query block ``block`` selected, per KV head, as one (B, Hkv, K * P, D) float32 tensor;
    zeros for those a ``share`` does not hold."""
    B, Hkv, _, K = selection.shape
    positions = selection[:, :, block, :].long().reshape(B, Hkv * K)
    ids = page_table.long().gather(1, positions).reshape(B, Hkv, K)
    heads = torch.arange(Hkv, device=pool.device).reshape(1, Hkv, 1)
    pages = pool[ids, heads]  # (B, Hkv, K, P, D): head h of page ids[b, h, k]
    if share is not None:  # another rank's page: its row here may be anything
        pages = torch.where(share.visible[:, :, block, :, None, None], pages, 0.0)
    P, D = pool.shape[2], pool.shape[3]
    return pages.reshape(B, Hkv, K * P, D).float()


def _own_keys(pool: torch.Tensor, page_table: torch.Tensor, query_start: int, num_queries: int,
              share: KeyShare | None) -> torch.Tensor | None:
    """(B, Hkv, n_blocks * P, D) float32: the chunk's own keys (or values); None if ``share`` lacks them."""
    if share is not None and not share.own_chunk:
        return None
    P = pool.shape[2]
    c0 = query_start // P
    return _gather_block(pool, page_table, c0, c0 + -(-num_queries // P))


def _block_keys(k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor, selection: torch.Tensor,
                share: KeyShare | None, block: int, k_own: torch.Tensor | None, v_own: torch.Tensor | None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Hkv, keys, D) float32 keys and values block ``block`` reads: its selected pages, then the
    chunk's own keys up to the block's end (unless ``k_own`` is None)."""
    k = _selected_pages(k_pool, page_table, selection, share, block)
    v = _selected_pages(v_pool, page_table, selection, share, block)
    if k_own is None:
        return k, v
    end = (block + 1) * k_pool.shape[2]
    return torch.cat([k, k_own[:, :, :end]], dim=2), torch.cat([v, v_own[:, :, :end]], dim=2)


def _own_mask(block: int, num_queries: int, page_size: int, device) -> torch.Tensor:
    """(num_queries, (block + 1) * P) bool: query jP + r of the chunk sees its own keys 0 .. jP + r."""
    q_pos = torch.arange(block * page_size, block * page_size + num_queries, device=device)
    k_pos = torch.arange((block + 1) * page_size, device=device)
    return k_pos[None, :] <= q_pos[:, None]


def _document_mask(documents: Documents, selection: torch.Tensor, block: int, q0: int, q1: int, query_start: int,
                   page_size: int) -> torch.Tensor:
    """(B, Hkv, 1, queries, K * P + (block + 1) * P) bool: the keys of block ``block`` (its selected
    pages, then its chunk's own keys) at or after each query's document start."""
    B, Hkv, _, K = selection.shape
    P = page_size
    slots = torch.arange(P, device=selection.device)
    hist_pos = (selection[:, :, block, :].long()[..., None] * P + slots).reshape(B, Hkv, K * P)
    own_pos = torch.arange(query_start, query_start + (block + 1) * P, device=selection.device)
    key_pos = torch.cat([hist_pos, own_pos.expand(B, Hkv, -1)], dim=2)  # (B, Hkv, keys)
    start = documents.start[:, query_start + q0: query_start + q1].to(selection.device, torch.long)  # (B, q)
    return (key_pos[:, :, None, :] >= start[:, None, :, None])[:, :, None]


def _hidden_keys(selection: torch.Tensor, share: KeyShare | None, documents: Documents | None, block: int, q0: int,
                 q1: int, query_start: int, page_size: int) -> list[tuple[slice, torch.Tensor]]:
    """The keys of block ``block`` (as _block_keys lays them out) queries q0 .. q1 may not see, as
    [(slice of the keys, bool mask broadcastable to the scores there)]: selected pages ``share`` does
    not hold, the chunk's later keys, keys before a query's document start."""
    K, P = selection.shape[3], page_size
    own_chunk = share is None or share.own_chunk
    hidden = []
    if share is not None:
        visible = share.visible[:, :, block, :, None].expand(-1, -1, -1, P).flatten(2)  # (B, Hkv, K * P)
        hidden.append((slice(0, K * P), ~visible[:, :, None, None]))
    if own_chunk:
        hidden.append((slice(K * P, None), ~_own_mask(block, q1 - q0, P, selection.device)))
    if documents is not None:
        seen = _document_mask(documents, selection, block, q0, q1, query_start, P)
        keys = K * P + ((block + 1) * P if own_chunk else 0)
        hidden.append((slice(0, None), ~seen[..., :keys]))
    return hidden


def sparse_attention_forward(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    query_start: int,
    scale: float,
    selection: torch.Tensor,
    documents: Documents | None = None,
    softcap: float | None = None,
    share: KeyShare | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query block's attention over its selected history pages and its own chunk (causal).

    Returns:
        out (B, Hq, Lq, D) in q's dtype and lse (B, Hq, Lq) float32. With ``share``: the rank's partial
        out in float32 (0 where a row sees no key here) and lse (-inf there).
    """
    _check(q, k_pool, page_table, query_start)
    _check_selection(selection, q, k_pool, share)
    B, Hq, Lq, D = q.shape
    Hkv, P = k_pool.shape[1], k_pool.shape[2]
    G = Hq // Hkv
    n_blocks = -(-Lq // P)
    # With softcapping the scale goes inside the tanh: score = softcap * tanh(scale * q.k / softcap).
    qf = q.float().reshape(B, Hkv, G, Lq, D) * (scale if softcap is None else scale / softcap)
    k_own = _own_keys(k_pool, page_table, query_start, Lq, share)  # (B, Hkv, n_blocks * P, D) or None
    v_own = _own_keys(v_pool, page_table, query_start, Lq, share)
    out = torch.empty((B, Hkv, G, Lq, D), device=q.device)
    lse = torch.empty((B, Hkv, G, Lq), device=q.device)
    for j in range(n_blocks):
        q0, q1 = j * P, min((j + 1) * P, Lq)
        k, v = _block_keys(k_pool, v_pool, page_table, selection, share, j, k_own, v_own)
        scores = torch.einsum("bhgqd,bhkd->bhgqk", qf[..., q0:q1, :], k)
        if softcap is not None:
            scores = scores.tanh_().mul_(softcap)
        for keys, hidden in _hidden_keys(selection, share, documents, j, q0, q1, query_start, P):
            scores[..., keys].masked_fill_(hidden, float("-inf"))
        block_lse = torch.logsumexp(scores, dim=-1)
        # Without a share every query sees its own key. With one a row may see no key here (lse -inf),
        # where exp(-inf - -inf) would be NaN: it subtracts 0 instead and gets weights exp(-inf) = 0.
        shift = torch.where(block_lse == float("-inf"), 0.0, block_lse)
        probs = scores.sub_(shift[..., None]).exp_()
        out[..., q0:q1, :] = torch.einsum("bhgqk,bhkd->bhgqd", probs, v)
        lse[..., q0:q1] = block_lse
    out = out.reshape(B, Hq, Lq, D)
    return (out.to(q.dtype) if share is None else out), lse.reshape(B, Hq, Lq)


def sparse_attention_backward(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    query_start: int,
    scale: float,
    selection: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    dk_pool: torch.Tensor,
    dv_pool: torch.Tensor,
    documents: Documents | None = None,
    softcap: float | None = None,
    share: KeyShare | None = None,
) -> torch.Tensor:
    """Return dQ and add dK, dV into the selected history pages and the chunk's own pages, in place.

    A history page read by several blocks gets their contributions summed in float32 first, so
    each touched slot of the pools is rounded once per call, as in the dense reference. With
    ``share``: ``out`` and ``lse`` are the merged ones (every rank's keys), dK and dV go into the
    pages the share holds only, and the rank's float32 share of dQ is returned.
    """
    _check(q, k_pool, page_table, query_start)
    _check_selection(selection, q, k_pool, share)
    B, Hq, Lq, D = q.shape
    Hkv, P = k_pool.shape[1], k_pool.shape[2]
    G = Hq // Hkv
    K = selection.shape[3]
    c0, n_blocks = query_start // P, -(-Lq // P)
    qf = q.float().reshape(B, Hkv, G, Lq, D)
    do = dout.float().reshape(B, Hkv, G, Lq, D)
    delta = (do * out.float().reshape(B, Hkv, G, Lq, D)).sum(-1)  # rowsum(dO * O)
    lse = lse.reshape(B, Hkv, G, Lq)
    dq = torch.empty_like(qf)
    k_own = _own_keys(k_pool, page_table, query_start, Lq, share)
    v_own = _own_keys(v_pool, page_table, query_start, Lq, share)
    if k_own is not None:
        dk_own, dv_own = torch.zeros_like(k_own), torch.zeros_like(v_own)
    # History pages read by any block: union per call, float32 sums indexed by rank in the union.
    union = torch.unique(selection.long())  # sorted page-table positions
    rank = torch.searchsorted(union, selection.long())  # (B, Hkv, n_blocks, K)
    dk_hist = torch.zeros((B, Hkv, union.numel(), P, D), device=q.device)
    dv_hist = torch.zeros_like(dk_hist)
    batch = torch.arange(B, device=q.device).reshape(B, 1, 1)
    heads = torch.arange(Hkv, device=q.device).reshape(1, Hkv, 1)
    for j in range(n_blocks):
        q0, q1 = j * P, min((j + 1) * P, Lq)
        k, v = _block_keys(k_pool, v_pool, page_table, selection, share, j, k_own, v_own)
        q_t, do_t = qf[..., q0:q1, :], do[..., q0:q1, :]
        scores = torch.einsum("bhgqd,bhkd->bhgqk", q_t, k).mul_(scale)
        if softcap is not None:  # d(c tanh(s / c)) / ds = 1 - tanh(s / c)^2
            tanh = scores.div_(softcap).tanh_()
            dcap = 1 - tanh * tanh
            scores = tanh.mul(softcap)
        probs = scores.sub_(lse[..., q0:q1, None]).exp_()  # lse (merged, under a share) is finite in every row
        for keys, hidden in _hidden_keys(selection, share, documents, j, q0, q1, query_start, P):
            probs[..., keys].masked_fill_(hidden, 0.0)
        dv = torch.einsum("bhgqk,bhgqd->bhkd", probs, do_t)
        dprobs = torch.einsum("bhgqd,bhkd->bhgqk", do_t, v)
        dscores = probs.mul_(dprobs.sub_(delta[..., q0:q1, None]))
        if softcap is not None:
            dscores.mul_(dcap)
        dq[..., q0:q1, :] = torch.einsum("bhgqk,bhkd->bhgqd", dscores, k).mul_(scale)
        dk = torch.einsum("bhgqk,bhgqd->bhkd", dscores, q_t).mul_(scale)
        if k_own is not None:
            own = (j + 1) * P
            dk_own[:, :, :own] += dk[:, :, K * P:]
            dv_own[:, :, :own] += dv[:, :, K * P:]
        if K:
            slot = rank[:, :, j, :]  # (B, Hkv, K): distinct within a row
            dk_hist[batch, heads, slot] += dk[:, :, : K * P].reshape(B, Hkv, K, P, D)
            dv_hist[batch, heads, slot] += dv[:, :, : K * P].reshape(B, Hkv, K, P, D)
    if k_own is not None:
        _scatter_add_block(dk_pool, page_table, c0, c0 + n_blocks, dk_own)
        _scatter_add_block(dv_pool, page_table, c0, c0 + n_blocks, dv_own)
    if union.numel():
        # Only the (page, head) pairs some block selected carry a gradient; the rest of dk_hist is 0
        # and is not added, so unselected heads of a page are not even rounded. With a share, only
        # the pairs it holds (a page lives on one rank: visible in every block that selects it or in none).
        touched = torch.zeros((B, Hkv, union.numel()), dtype=torch.bool, device=q.device)
        held = True if share is None else share.visible.expand(selection.shape).reshape(B, Hkv, -1)
        touched.scatter_(2, rank.reshape(B, Hkv, -1), held)
        b_idx, h_idx, u_idx = touched.nonzero(as_tuple=True)
        ids = page_table.long()[b_idx, union[u_idx]]
        dk_pool.index_put_((ids, h_idx), dk_hist[b_idx, h_idx, u_idx].to(dk_pool.dtype), accumulate=True)
        dv_pool.index_put_((ids, h_idx), dv_hist[b_idx, h_idx, u_idx].to(dv_pool.dtype), accumulate=True)
    dq = dq.reshape(B, Hq, Lq, D)
    return dq.to(q.dtype) if share is None else dq
