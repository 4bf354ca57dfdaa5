"""Paged causal attention in plain PyTorch: the oracle for the kernels and the CPU path.

The contract every backend implements (see ``oomb.attention.backend``):

    forward(q, k_pool, v_pool, page_table, query_start, scale, *, key_range=None, out_dtype=None,
            documents=None, softcap=None) -> (out, lse)
    backward(q, k_pool, v_pool, page_table, query_start, scale, out, dout, lse, dk_pool, dv_pool,
             *, key_range=None, delta=None, dq_accumulator=None, documents=None, softcap=None) -> dq
    backward_delta(out, dout) -> delta   rowsum(dO * O), (B, Hq, Lq) float32

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

Key windows (host offload streams a layer's history through the GPU a few pages at a time, so a
chunk's attention must be a merge of partial attentions over disjoint key ranges):

    key_range  (lo, hi): only keys at absolute positions lo <= j < hi, either a history window
               (0 <= lo < hi <= query_start, both multiples of P: every query sees all of it) or
               the local window (query_start, query_start + Lq): the chunk itself, causal.
               None: all keys, as without windows. Only the table entries of the window's pages
               are read (entries outside may be garbage, pages outside may hold NaN), and the table
               need only be ceil(hi / P) columns wide.
    forward    returns the attention normalised within the window and the window's lse; the
               windows' results combine with merge_partials into the full attention. out_dtype
               (default q's dtype) lets partial outputs stay float32 until the merge.
    backward   takes the GLOBAL (merged) out and lse, adds dK, dV of the window's keys only into
               dk_pool, dv_pool (which may be small staging pools: page_table addresses them) and
               returns the window's share of dQ. delta: optional precomputed backward_delta(out,
               dout), so that a caller streaming many windows computes it once (out may then be
               None). dq_accumulator: optional float32 (B, Hq, Lq, D); the window's dQ is added into
               it in place (no rounding to q's dtype between windows) and it is returned.
    Summed over windows covering [0, query_start + Lq), backward gives the full dQ, dK, dV.

Packed documents (oomb/documents.py):

    documents  None, or a Documents of the whole (B, T) step: query t of row b sees only keys
               documents.start[b, t] <= j <= t. Key blocks wholly before every row's document start
               of a tile's first query are skipped; a block holding some row's document start is
               masked per query. A query may then see no key of a window: its partial output is 0
               and its lse -inf, which merge_window folds in as an empty window.

Sliding-window layers pass their key bounds as ``documents`` (documents.window_bounds): the same
per-query first key, so they are masked exactly and read only the pages their windows overlap.

Logit softcapping (Gemma 2): ``softcap`` c replaces every score s = scale * q.k by c * tanh(s / c)
before the softmax (forward and backward; None: off). Attention sinks are a backend wrapper
(attention/variants.py), not a backend argument.

Queries are processed in tiles and keys in blocks with an online softmax, so no score matrix over
the whole context ever exists; key blocks wholly in a tile's future are skipped. All arithmetic is
float32.
"""

from __future__ import annotations

import operator

import torch

from ..documents import Documents

KEY_BLOCK_TOKENS = 512
"""Keys per block of the online softmax."""
QUERY_BLOCK_TOKENS = 512
"""Queries per tile. A score tile is B x Hq x 512 x 512 floats (1 MiB per head): small tiles stay
in cache and below malloc's mmap threshold, which matters on CPU, where this is the real path."""


def _gather_block(
    pool: torch.Tensor, page_table: torch.Tensor, first_page: int, last_page: int,
    dtype: torch.dtype | None = torch.float32,
) -> torch.Tensor:
    """Pages [first_page, last_page) of every sequence as one (B, Hkv, n*P, D) tensor in ``dtype``
    (None: the pool's)."""
    ids = page_table[:, first_page:last_page].long()  # (B, n)
    pages = pool[ids]  # (B, n, Hkv, P, D)
    B, n, Hkv, P, D = pages.shape
    return pages.permute(0, 2, 1, 3, 4).reshape(B, Hkv, n * P, D).to(dtype or pool.dtype)


def _causal_mask(first_query: int, num_queries: int, first_key: int, num_keys: int, device) -> torch.Tensor:
    """(num_queries, num_keys) bool, True where the query may see the key; positions are absolute."""
    q_pos = torch.arange(first_query, first_query + num_queries, device=device)
    k_pos = torch.arange(first_key, first_key + num_keys, device=device)
    return k_pos[None, :] <= q_pos[:, None]


def _visible(
    first_query: int, num_queries: int, first_key: int, num_keys: int, window: tuple[int, int] | None, device,
    documents: Documents | None = None,
) -> torch.Tensor:
    """The causal mask, further restricted to the key window when there is one: (queries, keys), or
    with documents (B, 1, 1, queries, keys), also hiding keys before each query's document start."""
    visible = _causal_mask(first_query, num_queries, first_key, num_keys, device)
    k_pos = torch.arange(first_key, first_key + num_keys, device=device)
    if window is not None:
        visible &= ((k_pos >= window[0]) & (k_pos < window[1]))[None, :]
    if documents is not None:
        doc_start = documents.start[:, first_query:first_query + num_queries].to(device, torch.long)  # (B, q)
        visible = (visible[None] & (k_pos[None, None, :] >= doc_start[:, :, None]))[:, None, None]
    return visible


def _tiles(
    query_start: int, num_queries: int, page_size: int, query_block: int, key_block: int,
    window: tuple[int, int] | None = None, documents: Documents | None = None,
):
    """Yield (q0, q1, first_page, last_page, needs_mask) for every (query tile, key block) pair
    with at least one visible key; key blocks entirely in a tile's future are skipped. With a
    window (lo, hi) the blocks start at lo's page and stop at hi: no other page is gathered. With
    documents the blocks start at the page of the earliest document start of the tile's first
    query over the batch, and blocks before the latest start of its last query are masked."""
    lo, hi = window if window is not None else (0, query_start + num_queries)
    pages_per_block = max(1, key_block // page_size)
    for q0 in range(0, num_queries, query_block):
        q1 = min(q0 + query_block, num_queries)
        # Keys from here on are hidden from the tile's first query (causality or the window's end).
        first_masked_key = min(query_start + q0 + 1, hi)
        n_pages = -(-min(query_start + q1, hi) // page_size)
        first_page, doc_edge = lo // page_size, 0
        if documents is not None:  # host copy: no device sync
            first_page = max(first_page, int(documents.start_cpu[:, query_start + q0].min()) // page_size)
            doc_edge = int(documents.start_cpu[:, query_start + q1 - 1].max())
        for first in range(first_page, n_pages, pages_per_block):
            last = min(first + pages_per_block, n_pages)
            yield q0, q1, first, last, (first * page_size < lo or last * page_size > first_masked_key
                                        or first * page_size < doc_edge)


def _check(
    q: torch.Tensor, k_pool: torch.Tensor, page_table: torch.Tensor, query_start: int, key_end: int | None = None
) -> None:
    """``key_end``: keys the call reads (default: the whole chunk); the table must cover them."""
    B, Hq, Lq, D = q.shape
    num_pages, Hkv, P, Dk = k_pool.shape
    assert Dk == D, f"head_dim of q ({D}) and pages ({Dk}) differ"
    assert Hq % Hkv == 0, f"{Hq} query heads are not a multiple of {Hkv} KV heads"
    assert query_start % P == 0, f"query_start={query_start} is not on a page boundary (page size {P})"
    assert page_table.dtype == torch.int32 and page_table.shape[0] == B
    key_end = query_start + Lq if key_end is None else key_end
    assert page_table.shape[1] * P >= key_end, "page table too short for the chunk"


def check_key_range(
    key_range: tuple[int, int] | None, query_start: int, num_queries: int, page_size: int
) -> tuple[int, int] | None:
    """Validate a key window (module docstring) and return it as a pair of ints (None: all keys).

    Only whole-page history windows and the chunk itself are allowed: they are what offload
    streams, and they need no causal mask (history) or exactly today's (local)."""
    if key_range is None:
        return None
    try:
        if any(isinstance(x, bool) for x in key_range):
            raise TypeError
        lo, hi = (operator.index(x) for x in key_range)
    except (TypeError, ValueError):
        raise ValueError(f"key_range must be a pair (lo, hi) of ints; got {key_range!r}") from None
    if lo == query_start and hi == query_start + num_queries:
        return lo, hi  # the local window
    if not 0 <= lo < hi <= query_start:
        raise ValueError(
            f"key_range={key_range!r} is neither a history window (0 <= lo < hi <= query_start={query_start}) "
            f"nor the local window ({query_start}, {query_start + num_queries})"
        )
    if lo % page_size or hi % page_size:
        raise ValueError(f"history window key_range={key_range!r} must start and end on page boundaries "
                         f"(page size {page_size})")
    return lo, hi


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine the (out, lse) of disjoint key windows into the attention over their union.

    lse = logsumexp_w(lse_w), out = sum_w exp(lse_w - lse) * out_w, in float32, folded window by
    window in list order (deterministic). out is returned in outs[0]'s dtype, lse in float32; one
    window comes back as is.
    """
    if not outs or len(outs) != len(lses):
        raise ValueError(f"need one lse per output and at least one window; got {len(outs)} and {len(lses)}")
    if len(outs) == 1:
        return outs[0], lses[0]
    for out, lse in zip(outs, lses, strict=True):
        if out.shape != outs[0].shape or lse.shape != out.shape[:-1]:
            raise ValueError(f"window shapes differ: out {tuple(out.shape)}, lse {tuple(lse.shape)} "
                             f"(first window: out {tuple(outs[0].shape)})")
    out, lse = outs[0].float(), lses[0].float()
    for out_w, lse_w in zip(outs[1:], lses[1:], strict=True):
        out, lse = merge_window(out, lse, out_w.float(), lse_w.float())
    return out.to(outs[0].dtype), lse


def merge_window(out: torch.Tensor, lse: torch.Tensor, out_w: torch.Tensor, lse_w: torch.Tensor):
    """Fold the attention over one more disjoint key window into a running (out, lse), in float32:
    the step of merge_partials, and what the engine runs as windows stream in one at a time. Outputs
    in bf16/fp16 are read as they are (type promotion with the float32 weights gives the same float32
    products as casting them first, without a float32 copy of each)."""
    merged = torch.logaddexp(lse, lse_w)
    # Rows that saw no key in either window (packed documents) stay empty: weights 0, not NaN.
    shift = torch.where(merged == float("-inf"), 0.0, merged)
    out = out * torch.exp(lse - shift)[..., None] + out_w * torch.exp(lse_w - shift)[..., None]
    return out, merged


def backward_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """rowsum(dO * O) as float32 (B, Hq, Lq): computed once per chunk when backward runs per window."""
    if out.shape != dout.shape or out.dim() != 4:
        raise ValueError(f"out {tuple(out.shape)} and dout {tuple(dout.shape)} must be one (B, Hq, Lq, D) shape")
    return (dout.float() * out.float()).sum(-1)


def _check_backward_extras(
    q: torch.Tensor, out: torch.Tensor | None, delta: torch.Tensor | None, dq_accumulator: torch.Tensor | None
) -> None:
    """Validate the optional backward arguments shared by both backends."""
    B, Hq, Lq, D = q.shape
    if delta is None and out is None:
        raise ValueError("backward needs out (to compute delta) when no delta is given")
    if delta is not None and (delta.shape != (B, Hq, Lq) or delta.dtype != torch.float32 or delta.device != q.device):
        raise ValueError(f"delta must be float32 {(B, Hq, Lq)} on {q.device}; "
                         f"got {delta.dtype} {tuple(delta.shape)} on {delta.device}")
    if dq_accumulator is not None and (
        dq_accumulator.shape != q.shape or dq_accumulator.dtype != torch.float32 or dq_accumulator.device != q.device
    ):
        raise ValueError(f"dq_accumulator must be float32 {tuple(q.shape)} on {q.device}; got "
                         f"{dq_accumulator.dtype} {tuple(dq_accumulator.shape)} on {dq_accumulator.device}")


def paged_attention_forward(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    query_start: int,
    scale: float,
    key_block_tokens: int = KEY_BLOCK_TOKENS,
    query_block_tokens: int = QUERY_BLOCK_TOKENS,
    *,
    key_range: tuple[int, int] | None = None,
    out_dtype: torch.dtype | None = None,
    documents: Documents | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a chunk's queries over its paged history and itself (or one key window).

    ``out_dtype`` (default q's dtype): float32 keeps a window's partial output unrounded until the merge.
    ``documents``: attention stays inside each query's document (or sliding window; module docstring).
    ``softcap``: scores become softcap * tanh(score / softcap) (Gemma 2); None: off."""
    B, Hq, Lq, D = q.shape
    Hkv, P = k_pool.shape[1], k_pool.shape[2]
    window = check_key_range(key_range, query_start, Lq, P)
    _check(q, k_pool, page_table, query_start, None if window is None else window[1])
    G = Hq // Hkv
    # With softcapping the scale goes inside the tanh: score = softcap * tanh(scale * q.k / softcap).
    qf = q.float().reshape(B, Hkv, G, Lq, D) * (scale if softcap is None else scale / softcap)
    row_max = torch.full((B, Hkv, G, Lq), float("-inf"), device=q.device)
    row_sum = torch.zeros((B, Hkv, G, Lq), device=q.device)
    acc = torch.zeros((B, Hkv, G, Lq, D), device=q.device)
    tiles = _tiles(query_start, Lq, P, query_block_tokens, key_block_tokens, window, documents)
    for q0, q1, first, last, needs_mask in tiles:
        k = _gather_block(k_pool, page_table, first, last)  # (B, Hkv, n, D)
        v = _gather_block(v_pool, page_table, first, last)
        scores = torch.einsum("bhgqd,bhkd->bhgqk", qf[..., q0:q1, :], k)
        if softcap is not None:
            scores = scores.tanh_().mul_(softcap)
        if needs_mask:
            visible = _visible(query_start + q0, q1 - q0, first * P, k.shape[2], window, q.device, documents)
            scores.masked_fill_(~visible, float("-inf"))
        # The window's first key (key 0 without a window) is in every tile's first block and visible
        # to all queries: row_max is finite after it. Not so with documents: a row may see no key yet
        # (new_max -inf), and then shifts by 0 so that its probabilities and correction are 0, not NaN.
        tile_max = row_max[..., q0:q1]
        new_max = torch.maximum(tile_max, scores.amax(-1))
        shift = new_max if documents is None else torch.where(new_max == float("-inf"), 0.0, new_max)
        probs = scores.sub_(shift[..., None]).exp_()
        correction = (tile_max - shift).exp_()
        row_sum[..., q0:q1].mul_(correction).add_(probs.sum(-1))
        acc[..., q0:q1, :].mul_(correction[..., None]).add_(torch.einsum("bhgqk,bhkd->bhgqd", probs, v))
        row_max[..., q0:q1] = new_max
    lse = row_max + torch.log(row_sum)
    if documents is not None:  # rows that saw no key of the window (sum 0, acc 0): out 0, lse -inf
        row_sum = torch.where(row_sum == 0, 1.0, row_sum)
    out = (acc / row_sum[..., None]).reshape(B, Hq, Lq, D).to(out_dtype or q.dtype)
    return out, lse.reshape(B, Hq, Lq)


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
    *,
    key_range: tuple[int, int] | None = None,
    delta: torch.Tensor | None = None,
    dq_accumulator: torch.Tensor | None = None,
    documents: Documents | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Return dQ and add dK, dV of every page the chunk read into dk_pool, dv_pool in place.

    With a key window: the window's share of dQ (added into dq_accumulator when given), and dK, dV of
    the window's keys only; lse and out (or delta) are those of the full attention."""
    B, Hq, Lq, D = q.shape
    Hkv, P = k_pool.shape[1], k_pool.shape[2]
    window = check_key_range(key_range, query_start, Lq, P)
    _check(q, k_pool, page_table, query_start, None if window is None else window[1])
    _check_backward_extras(q, out, delta, dq_accumulator)
    G = Hq // Hkv
    qf = q.float().reshape(B, Hkv, G, Lq, D)
    do = dout.float().reshape(B, Hkv, G, Lq, D)
    if delta is None:
        delta = (do * out.float().reshape(B, Hkv, G, Lq, D)).sum(-1)  # rowsum(dO * O)
    else:
        delta = delta.reshape(B, Hkv, G, Lq)
    lse = lse.reshape(B, Hkv, G, Lq)
    dq = torch.zeros_like(qf)
    tiles = _tiles(query_start, Lq, P, query_block_tokens, key_block_tokens, window, documents)
    for q0, q1, first, last, needs_mask in tiles:
        k = _gather_block(k_pool, page_table, first, last)
        v = _gather_block(v_pool, page_table, first, last)
        q_t, do_t = qf[..., q0:q1, :], do[..., q0:q1, :]
        scores = torch.einsum("bhgqd,bhkd->bhgqk", q_t, k).mul_(scale)
        if softcap is not None:  # d(c tanh(s / c)) / ds = 1 - tanh(s / c)^2
            tanh = scores.div_(softcap).tanh_()
            dcap = 1 - tanh * tanh
            scores = tanh.mul(softcap)
        probs = scores.sub_(lse[..., q0:q1, None]).exp_()
        if needs_mask:
            visible = _visible(query_start + q0, q1 - q0, first * P, k.shape[2], window, q.device, documents)
            probs.masked_fill_(~visible, 0.0)
        dv = torch.einsum("bhgqk,bhgqd->bhkd", probs, do_t)
        dprobs = torch.einsum("bhgqd,bhkd->bhgqk", do_t, v)
        dscores = probs.mul_(dprobs.sub_(delta[..., q0:q1, None]))
        if softcap is not None:
            dscores.mul_(dcap)
        dq[..., q0:q1, :] += torch.einsum("bhgqk,bhkd->bhgqd", dscores, k).mul_(scale)
        dk = torch.einsum("bhgqk,bhgqd->bhkd", dscores, q_t).mul_(scale)
        _scatter_add_block(dk_pool, page_table, first, last, dk)
        _scatter_add_block(dv_pool, page_table, first, last, dv)
    if dq_accumulator is not None:
        return dq_accumulator.add_(dq.reshape(B, Hq, Lq, D))
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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, window: int | None = None,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain attention over contiguous (B, H, L, D) tensors, bottom-right causal: a test oracle.

    ``window``: query i sees only keys i - window < j <= i; ``softcap``: scores c * tanh(s / c);
    ``sinks``: (Hq,) an extra logit per head in every softmax denominator (gpt-oss), no value."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    k = k.float().repeat_interleave(G, dim=1)
    v = v.float().repeat_interleave(G, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.float(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    visible = _causal_mask(Lk - Lq, Lq, 0, Lk, q.device)
    if window is not None:
        visible &= ~_causal_mask(Lk - Lq - window, Lq, 0, Lk, q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float()[None, :, None, None].expand(B, Hq, Lq, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :Lk]
    return torch.einsum("bhqk,bhkd->bhqd", probs, v)
