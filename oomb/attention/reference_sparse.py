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
"""

from __future__ import annotations

import torch

from ..documents import Documents
from .reference import _check, _gather_block, _scatter_add_block


def shared_by_all_blocks(selection: torch.Tensor) -> bool:
    """Whether every query block reads the same row: a view with stride 0 over the blocks, which is
    how oomb/sparse.py hands over a selection one group covers. Known without reading its values."""
    return selection.stride(2) == 0


def _check_selection(selection: torch.Tensor, q: torch.Tensor, k_pool: torch.Tensor) -> None:
    B, _, Lq, _ = q.shape
    Hkv, P = k_pool.shape[1], k_pool.shape[2]
    n_blocks = -(-Lq // P)
    assert selection.dtype == torch.int32, f"selection must be int32, got {selection.dtype}"
    assert selection.dim() == 4 and selection.shape[:3] == (B, Hkv, n_blocks), (
        f"selection {tuple(selection.shape)} must be (B={B}, Hkv={Hkv}, n_blocks={n_blocks}, K)"
    )


def _selected_pages(pool: torch.Tensor, page_table: torch.Tensor, selection: torch.Tensor, block: int) -> torch.Tensor:
    """The pages query block ``block`` selected, per KV head, as one (B, Hkv, K * P, D) float32 tensor."""
    B, Hkv, _, K = selection.shape
    positions = selection[:, :, block, :].long().reshape(B, Hkv * K)
    ids = page_table.long().gather(1, positions).reshape(B, Hkv, K)
    heads = torch.arange(Hkv, device=pool.device).reshape(1, Hkv, 1)
    pages = pool[ids, heads]  # (B, Hkv, K, P, D): head h of page ids[b, h, k]
    P, D = pool.shape[2], pool.shape[3]
    return pages.reshape(B, Hkv, K * P, D).float()


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query block's attention over its selected history pages and its own chunk (causal)."""
    _check(q, k_pool, page_table, query_start)
    _check_selection(selection, q, k_pool)
    B, Hq, Lq, D = q.shape
    Hkv, P = k_pool.shape[1], k_pool.shape[2]
    G = Hq // Hkv
    K = selection.shape[3]
    c0, n_blocks = query_start // P, -(-Lq // P)
    # With softcapping the scale goes inside the tanh: score = softcap * tanh(scale * q.k / softcap).
    qf = q.float().reshape(B, Hkv, G, Lq, D) * (scale if softcap is None else scale / softcap)
    k_own = _gather_block(k_pool, page_table, c0, c0 + n_blocks)  # (B, Hkv, n_blocks * P, D)
    v_own = _gather_block(v_pool, page_table, c0, c0 + n_blocks)
    out = torch.empty((B, Hkv, G, Lq, D), device=q.device)
    lse = torch.empty((B, Hkv, G, Lq), device=q.device)
    for j in range(n_blocks):
        q0, q1 = j * P, min((j + 1) * P, Lq)
        k_hist = _selected_pages(k_pool, page_table, selection, j)
        v_hist = _selected_pages(v_pool, page_table, selection, j)
        k = torch.cat([k_hist, k_own[:, :, : (j + 1) * P]], dim=2)  # (B, Hkv, K*P + (j+1)*P, D)
        v = torch.cat([v_hist, v_own[:, :, : (j + 1) * P]], dim=2)
        scores = torch.einsum("bhgqd,bhkd->bhgqk", qf[..., q0:q1, :], k)
        if softcap is not None:
            scores = scores.tanh_().mul_(softcap)
        scores[..., K * P:].masked_fill_(~_own_mask(j, q1 - q0, P, q.device), float("-inf"))
        if documents is not None:
            scores.masked_fill_(~_document_mask(documents, selection, j, q0, q1, query_start, P), float("-inf"))
        # Every query sees its own key: the row maximum is finite.
        block_lse = torch.logsumexp(scores, dim=-1)
        probs = scores.sub_(block_lse[..., None]).exp_()
        out[..., q0:q1, :] = torch.einsum("bhgqk,bhkd->bhgqd", probs, v)
        lse[..., q0:q1] = block_lse
    return out.reshape(B, Hq, Lq, D).to(q.dtype), lse.reshape(B, Hq, Lq)


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
) -> torch.Tensor:
    """Return dQ and add dK, dV into the selected history pages and the chunk's own pages, in place.

    A history page read by several blocks gets their contributions summed in float32 first, so
    each touched slot of the pools is rounded once per call, as in the dense reference.
    """
    _check(q, k_pool, page_table, query_start)
    _check_selection(selection, q, k_pool)
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
    k_own = _gather_block(k_pool, page_table, c0, c0 + n_blocks)
    v_own = _gather_block(v_pool, page_table, c0, c0 + n_blocks)
    dk_own = torch.zeros_like(k_own)
    dv_own = torch.zeros_like(v_own)
    # History pages read by any block: union per call, float32 sums indexed by rank in the union.
    union = torch.unique(selection.long())  # sorted page-table positions
    rank = torch.searchsorted(union, selection.long())  # (B, Hkv, n_blocks, K)
    dk_hist = torch.zeros((B, Hkv, union.numel(), P, D), device=q.device)
    dv_hist = torch.zeros_like(dk_hist)
    batch = torch.arange(B, device=q.device).reshape(B, 1, 1)
    heads = torch.arange(Hkv, device=q.device).reshape(1, Hkv, 1)
    for j in range(n_blocks):
        q0, q1 = j * P, min((j + 1) * P, Lq)
        own = (j + 1) * P
        k_hist = _selected_pages(k_pool, page_table, selection, j)
        v_hist = _selected_pages(v_pool, page_table, selection, j)
        k = torch.cat([k_hist, k_own[:, :, :own]], dim=2)
        v = torch.cat([v_hist, v_own[:, :, :own]], dim=2)
        q_t, do_t = qf[..., q0:q1, :], do[..., q0:q1, :]
        scores = torch.einsum("bhgqd,bhkd->bhgqk", q_t, k).mul_(scale)
        if softcap is not None:  # d(c tanh(s / c)) / ds = 1 - tanh(s / c)^2
            tanh = scores.div_(softcap).tanh_()
            dcap = 1 - tanh * tanh
            scores = tanh.mul(softcap)
        probs = scores.sub_(lse[..., q0:q1, None]).exp_()
        probs[..., K * P:].masked_fill_(~_own_mask(j, q1 - q0, P, q.device), 0.0)
        if documents is not None:
            probs.masked_fill_(~_document_mask(documents, selection, j, q0, q1, query_start, P), 0.0)
        dv = torch.einsum("bhgqk,bhgqd->bhkd", probs, do_t)
        dprobs = torch.einsum("bhgqd,bhkd->bhgqk", do_t, v)
        dscores = probs.mul_(dprobs.sub_(delta[..., q0:q1, None]))
        if softcap is not None:
            dscores.mul_(dcap)
        dq[..., q0:q1, :] = torch.einsum("bhgqk,bhkd->bhgqd", dscores, k).mul_(scale)
        dk = torch.einsum("bhgqk,bhgqd->bhkd", dscores, q_t).mul_(scale)
        dk_own[:, :, :own] += dk[:, :, K * P:]
        dv_own[:, :, :own] += dv[:, :, K * P:]
        if K:
            slot = rank[:, :, j, :]  # (B, Hkv, K): distinct within a row
            dk_hist[batch, heads, slot] += dk[:, :, : K * P].reshape(B, Hkv, K, P, D)
            dv_hist[batch, heads, slot] += dv[:, :, : K * P].reshape(B, Hkv, K, P, D)
    _scatter_add_block(dk_pool, page_table, c0, c0 + n_blocks, dk_own)
    _scatter_add_block(dv_pool, page_table, c0, c0 + n_blocks, dv_own)
    if union.numel():
        # Only the (page, head) pairs some block selected carry a gradient; the rest of dk_hist is 0
        # and is not added, so unselected heads of a page are not even rounded.
        touched = torch.zeros((B, Hkv, union.numel()), dtype=torch.bool, device=q.device)
        touched.scatter_(2, rank.reshape(B, Hkv, -1), True)
        b_idx, h_idx, u_idx = touched.nonzero(as_tuple=True)
        ids = page_table.long()[b_idx, union[u_idx]]
        dk_pool.index_put_((ids, h_idx), dk_hist[b_idx, h_idx, u_idx].to(dk_pool.dtype), accumulate=True)
        dv_pool.index_put_((ids, h_idx), dv_hist[b_idx, h_idx, u_idx].to(dv_pool.dtype), accumulate=True)
    return dq.reshape(B, Hq, Lq, D).to(q.dtype)
