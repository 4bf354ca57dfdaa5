"""Paged causal attention in plain PyTorch: the oracle for the kernels and the CPU path.

The contract every backend implements (see ``oomb.attention.backend``):

    forward(q, k_pool, v_pool, page_table, query_start, scale) -> (out, lse)
    backward(q, k_pool, v_pool, page_table, query_start, scale, out, dout, lse, dk_pool, dv_pool) -> dq

    q          (B, Hq, Lq, D)         queries of one chunk, any strides, model dtype
    k_pool     (num_pages, Hkv, P, D) post-RoPE keys of one layer, addressed by page id
    v_pool     (num_pages, Hkv, P, D)
    page_table (B, >= n_pages) int32  page ids of each sequence in token order; only the first
                                      n_pages = ceil((query_start + Lq) / P) entries are read
    query_start                       absolute position of the chunk's first query; the chunk's
                                      own keys are the last Lq of the query_start + Lq keys
    out        (B, Hq, Lq, D) q.dtype     lse (B, Hq, Lq) float32 (natural log)
    dk_pool, dv_pool                  page gradient buffers: backward *adds* into them in place

Query i (absolute position query_start + i) sees keys 0..query_start + i. Query head h reads KV
head h // (Hq // Hkv) (grouped-query attention); K and V are never repeated.

Queries are processed in tiles and keys in blocks with an online softmax, so no score matrix over
the whole context ever exists; key blocks wholly in a tile's future are skipped. All arithmetic is
float32.
"""

from __future__ import annotations

import torch

KEY_BLOCK_TOKENS = 512
"""Keys per block of the online softmax."""
QUERY_BLOCK_TOKENS = 512
"""Queries per tile. A score tile is B x Hq x 512 x 512 floats (1 MiB per head): small tiles stay
in cache and below malloc's mmap threshold, which matters on CPU, where this is the real path."""


def _gather_block(pool: torch.Tensor, page_table: torch.Tensor, first_page: int, last_page: int) -> torch.Tensor:
    """Pages [first_page, last_page) of every sequence as one (B, Hkv, n*P, D) float32 tensor."""
    ids = page_table[:, first_page:last_page].long()  # (B, n)
    pages = pool[ids]  # (B, n, Hkv, P, D)
    B, n, Hkv, P, D = pages.shape
    return pages.permute(0, 2, 1, 3, 4).reshape(B, Hkv, n * P, D).float()


def _causal_mask(first_query: int, num_queries: int, first_key: int, num_keys: int, device) -> torch.Tensor:
    """(num_queries, num_keys) bool, True where the query may see the key; positions are absolute."""
    q_pos = torch.arange(first_query, first_query + num_queries, device=device)
    k_pos = torch.arange(first_key, first_key + num_keys, device=device)
    return k_pos[None, :] <= q_pos[:, None]


def _tiles(query_start: int, num_queries: int, page_size: int, query_block: int, key_block: int):
    """Yield (q0, q1, first_page, last_page, needs_mask) for every (query tile, key block) pair
    with at least one visible key; key blocks entirely in a tile's future are skipped."""
    pages_per_block = max(1, key_block // page_size)
    for q0 in range(0, num_queries, query_block):
        q1 = min(q0 + query_block, num_queries)
        first_masked_key = query_start + q0 + 1  # keys from here on are hidden from the tile's first query
        n_pages = -(-(query_start + q1) // page_size)
        for first in range(0, n_pages, pages_per_block):
            last = min(first + pages_per_block, n_pages)
            yield q0, q1, first, last, last * page_size > first_masked_key


def _check(q: torch.Tensor, k_pool: torch.Tensor, page_table: torch.Tensor, query_start: int) -> None:
    B, Hq, Lq, D = q.shape
    num_pages, Hkv, P, Dk = k_pool.shape
    assert Dk == D, f"head_dim of q ({D}) and pages ({Dk}) differ"
    assert Hq % Hkv == 0, f"{Hq} query heads are not a multiple of {Hkv} KV heads"
    assert query_start % P == 0, f"query_start={query_start} is not on a page boundary (page size {P})"
    assert page_table.dtype == torch.int32 and page_table.shape[0] == B
    assert page_table.shape[1] * P >= query_start + Lq, "page table too short for the chunk"


def paged_attention_forward(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    query_start: int,
    scale: float,
    key_block_tokens: int = KEY_BLOCK_TOKENS,
    query_block_tokens: int = QUERY_BLOCK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a chunk's queries over its paged history and itself."""
    _check(q, k_pool, page_table, query_start)
    B, Hq, Lq, D = q.shape
    Hkv, P = k_pool.shape[1], k_pool.shape[2]
    G = Hq // Hkv
    qf = q.float().reshape(B, Hkv, G, Lq, D) * scale
    row_max = torch.full((B, Hkv, G, Lq), float("-inf"), device=q.device)
    row_sum = torch.zeros((B, Hkv, G, Lq), device=q.device)
    acc = torch.zeros((B, Hkv, G, Lq, D), device=q.device)
    for q0, q1, first, last, needs_mask in _tiles(query_start, Lq, P, query_block_tokens, key_block_tokens):
        k = _gather_block(k_pool, page_table, first, last)  # (B, Hkv, n, D)
        v = _gather_block(v_pool, page_table, first, last)
        scores = torch.einsum("bhgqd,bhkd->bhgqk", qf[..., q0:q1, :], k)
        if needs_mask:
            visible = _causal_mask(query_start + q0, q1 - q0, first * P, k.shape[2], q.device)
            scores.masked_fill_(~visible, float("-inf"))
        # Key 0 is in every tile's first block and visible to all queries: row_max is finite after it.
        tile_max = row_max[..., q0:q1]
        new_max = torch.maximum(tile_max, scores.amax(-1))
        probs = scores.sub_(new_max[..., None]).exp_()
        correction = (tile_max - new_max).exp_()
        row_sum[..., q0:q1].mul_(correction).add_(probs.sum(-1))
        acc[..., q0:q1, :].mul_(correction[..., None]).add_(torch.einsum("bhgqk,bhkd->bhgqd", probs, v))
        row_max[..., q0:q1] = new_max
    out = (acc / row_sum[..., None]).reshape(B, Hq, Lq, D).to(q.dtype)
    lse = (row_max + torch.log(row_sum)).reshape(B, Hq, Lq)
    return out, lse


def paged_attention_backward(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    query_start: int,
    scale: float,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    dk_pool: torch.Tensor,
    dv_pool: torch.Tensor,
    key_block_tokens: int = KEY_BLOCK_TOKENS,
    query_block_tokens: int = QUERY_BLOCK_TOKENS,
) -> torch.Tensor:
    """Return dQ and add dK, dV of every page the chunk read into dk_pool, dv_pool in place."""
    _check(q, k_pool, page_table, query_start)
    B, Hq, Lq, D = q.shape
    Hkv, P = k_pool.shape[1], k_pool.shape[2]
    G = Hq // Hkv
    qf = q.float().reshape(B, Hkv, G, Lq, D)
    do = dout.float().reshape(B, Hkv, G, Lq, D)
    delta = (do * out.float().reshape(B, Hkv, G, Lq, D)).sum(-1)  # rowsum(dO * O)
    lse = lse.reshape(B, Hkv, G, Lq)
    dq = torch.zeros_like(qf)
    for q0, q1, first, last, needs_mask in _tiles(query_start, Lq, P, query_block_tokens, key_block_tokens):
        k = _gather_block(k_pool, page_table, first, last)
        v = _gather_block(v_pool, page_table, first, last)
        q_t, do_t = qf[..., q0:q1, :], do[..., q0:q1, :]
        scores = torch.einsum("bhgqd,bhkd->bhgqk", q_t, k).mul_(scale)
        probs = scores.sub_(lse[..., q0:q1, None]).exp_()
        if needs_mask:
            visible = _causal_mask(query_start + q0, q1 - q0, first * P, k.shape[2], q.device)
            probs.masked_fill_(~visible, 0.0)
        dv = torch.einsum("bhgqk,bhgqd->bhkd", probs, do_t)
        dprobs = torch.einsum("bhgqd,bhkd->bhgqk", do_t, v)
        dscores = probs.mul_(dprobs.sub_(delta[..., q0:q1, None]))
        dq[..., q0:q1, :] += torch.einsum("bhgqk,bhkd->bhgqd", dscores, k).mul_(scale)
        dk = torch.einsum("bhgqk,bhgqd->bhkd", dscores, q_t).mul_(scale)
        _scatter_add_block(dk_pool, page_table, first, last, dk)
        _scatter_add_block(dv_pool, page_table, first, last, dv)
    return dq.reshape(B, Hq, Lq, D).to(q.dtype)


def _scatter_add_block(
    pool: torch.Tensor, page_table: torch.Tensor, first_page: int, last_page: int, grad: torch.Tensor
) -> None:
    """Add a (B, Hkv, n*P, D) block gradient into its pages of the pool (page ids are unique)."""
    B, Hkv, _, D = grad.shape
    n, P = last_page - first_page, pool.shape[2]
    per_page = grad.reshape(B, Hkv, n, P, D).permute(0, 2, 1, 3, 4).reshape(B * n, Hkv, P, D)
    ids = page_table[:, first_page:last_page].reshape(-1).long()
    pool.index_add_(0, ids, per_page.to(pool.dtype))


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Plain attention over contiguous (B, H, L, D) tensors, bottom-right causal: a test oracle."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    k = k.float().repeat_interleave(G, dim=1)
    v = v.float().repeat_interleave(G, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.float(), k) * scale
    visible = _causal_mask(Lk - Lq, Lq, 0, Lk, q.device)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("bhqk,bhkd->bhqd", probs, v)
