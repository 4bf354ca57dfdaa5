"""The exact sparse score in Triton: each query's true attention probability on every history page,
the largest over a query block's rows (oomb/sparse.py ``exact_block_scores`` is the reference).

    exact_page_scores(q, k_pool, page_table, query_start, scale, row_stride) -> (B, Hkv, n_blocks, n_hist)

Why a kernel: the score needs every row's log-sum-exp over every key it sees before any page's
probability is known, and materialising the (rows x history keys) logits costs far more memory
traffic than the matmuls. One program owns a tile of one query block's rows (query x group head,
packed as the attention kernels pack them) and makes two passes over the keys without storing a
logit:

1. the row's log-sum-exp over the history and its own chunk up to itself (causal), online;
2. per history page, each row's probability ``sum_k exp(s_rk - lse_r)``, the tile's largest, folded
   into ``out[b, h, j, page]`` by an atomic max (order-free, so the result is deterministic).

``leak_free`` (listed pages only) scores block j from the page of queries before it and its first query,
each seeing only the keys at or before it (oomb.sparse.leak_free_rows): nothing after a block's first
token decides what the block reads.

``row_stride`` > 1 scores a block from every row_stride-th query only (the last of each group of
queries), as the reference's ``row_stride`` does: an eighth of the rows is an eighth of the work.

Pass 1 reads every key the rows see, pass 2 every history key: about one attention forward's
``Q K^T`` twice, without the ``P V`` products. The keys must be in GPU memory (not offloaded).

With listed pages (the "rerank" score's candidates, a few hundred per block at most) pass 1 also keeps
each row's log-mass on each listed page, ``log2 sum_k 2^(s_rk)``, in a scratch buffer (rows x listed
pages per program, float32), and pass 2 reads those back instead of recomputing the logits: the listed
keys are read once, which halves the candidates' ``Q K^T`` (the chunk's own keys are read once either
way). The whole history (the oracle) keeps two passes: its scratch would grow with the history.

Supported: bf16/fp16/fp32, head dims up to 256, any group size, page sizes that are multiples of 16
(a key tile lies in one page); query_start a multiple of the page size (chunks start on pages).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_paged import (
    _LOG2E,
    _TUNING_KEY,
    CACHE_TUNING,
    INTERPRET,
    MAX_HEAD_DIM,
    SUPPORTED_DTYPES,
    _configs,
    _key_offsets,
    _load_tile,
    _meta,
    _prune_for_dtype,
)

# The last config only serves pages of 16 or 48 keys (pruned whenever a larger key tile fits). The others
# measured on the H200 (rerank x4's 256 listed pages per block
# of the 7B shape; score-kernel-configs in docs/results.md): 128 rows on one warpgroup (4 warps) ran fastest,
# whole 128-key pages (3.3 ms per chunk at 128K) or half pages (3.7 ms; it also serves 64-key pages), against
# 4.1 ms for the autotuner's pick of the list before, (64, 64, 4, 3); (128, 64, 8, 3), first in that list,
# took 4.5 ms.
_SCORE_CONFIGS = _configs([(128, 128, 4, 2), (128, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 4), (64, 16, 4, 2)])
_DYNAMIC = ["num_kv_heads", "seq_len", "query_start", "num_history", "stride_tb", "stride_lb", "stride_lh",
            "stride_lj", "stride_ob", "stride_oh", "stride_oj", "stride_sbh", "stride_sj", "stride_si", "first_block",
            "tuning_bucket"]
SCRATCH_ELEMENTS = 1 << 24
"""At most this many float32 log-masses (64 MiB) in the listed pages' scratch: launches cover fewer blocks."""
_SCRATCH_ROWS = 128
"""The scratch's rows per block are a multiple of this, which every BLOCK_M must divide (a program's tile
past a block's last row stores there too). Not 256: the 7B shape's 896 rows would become 1024, a
power-of-two stride between a row's pages, and the kernel ran about 10 % slower on the H200."""
if any(_SCRATCH_ROWS % config.kwargs["BLOCK_M"] for config in _SCORE_CONFIGS):
    raise ImportError("every score config's BLOCK_M must divide _SCRATCH_ROWS (the scratch's row padding)")


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Key tiles must lie in one page (BLOCK_N divides P), and the smallest tile only serves pages no
    larger tile fits; float32 as the attention kernels (one config)."""
    page = kwargs.get("PAGE_SIZE") or named_args.get("PAGE_SIZE")
    fitting = [c for c in configs if page % c.kwargs["BLOCK_N"] == 0]
    larger = [c for c in fitting if c.kwargs["BLOCK_N"] > 16]
    fitting = larger or fitting
    return _prune_for_dtype(fitting, named_args, **kwargs)


@triton.jit
def _scaled_logits(q, k_base, table_row_ptr, start_n, offs_n, offs_d, d_ok, qk_scale,
                   stride_kp, stride_kt, stride_kd,
                   PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
                   UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(BLOCK_M, BLOCK_N) base-2 logits of the rows against keys start_n + offs_n (one page)."""
    k_rows = _key_offsets(table_row_ptr, start_n, offs_n, offs_n < BLOCK_N, stride_kp, stride_kt,
                          PAGE_SIZE, BLOCK_N, False)
    k = _load_tile(k_base + k_rows[:, None] + offs_d[None, :] * stride_kd, offs_n < BLOCK_N, d_ok, False, EVEN_D)
    if UPCAST:
        k = k.to(tl.float32)
    return tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale


@triton.jit
def _online_lse(m_i, l_i, s):
    """One tile of base-2 logits folded into the running (max, sum of exp2) of each row."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    return m_new, l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)


@triton.autotune(configs=_SCORE_CONFIGS, key=_TUNING_KEY + ["ROW_STRIDE", "LISTED", "LEAK_FREE", "tuning_bucket"],
                 cache_results=CACHE_TUNING, prune_configs_by={"early_config_prune": _prune},
                 reset_to_zero=["out_ptr"])  # tuning reruns the kernel: each config's max from zero
@triton.jit(do_not_specialize=_DYNAMIC)
def _exact_scores_kernel(
    q_ptr, k_ptr, table_ptr, list_ptr, out_ptr, scratch_ptr,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kp, stride_kh, stride_kt, stride_kd,
    stride_tb, stride_lb, stride_lh, stride_lj, stride_ob, stride_oh, stride_oj,
    stride_sbh, stride_sj, stride_si,
    num_kv_heads, seq_len, query_start, num_history, scale, first_block, tuning_bucket,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, ROW_STRIDE: tl.constexpr, LISTED: tl.constexpr,
    LEAK_FREE: tl.constexpr, NO_PREVIOUS: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (n_blocks * tiles per block, B * Hkv): one tile of one query block's scoring rows. LISTED:
    the history is the block's listed pages (``num_history`` of them, page-table positions in
    ``list_ptr``), ``out`` has one column per listed page, and each row's log-mass per listed page
    goes through ``scratch`` (B * Hkv, this launch's blocks from ``first_block``, listed pages, >= tiles x
    BLOCK_M rows); else every
    page before query_start, scored in two passes. LEAK_FREE (listed pages only): ``q`` holds the
    previous chunk's last page of queries, then the chunk's (``seq_len`` = P + the chunk's length), and
    block j is scored by the P queries before its first and that first query, each seeing only the keys
    at or before it; NO_PREVIOUS: the first P are copies of query 0 (at its position). ROWS: a block's
    scoring rows, (P + 1) x GROUP leak-free, else (P / ROW_STRIDE) x GROUP. ``tuning_bucket`` (unused by the
    code) is the tuning key's class of the work: tune_bucket(num_history)."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(PAGE_SIZE % BLOCK_N == 0)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    TILES: tl.constexpr = (ROWS + BLOCK_M - 1) // BLOCK_M
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_kv_heads).to(tl.int64)
    kvh = pid_bh % num_kv_heads
    j = first_block + tl.program_id(0) // TILES
    local = (tl.program_id(0) % TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
    if LEAK_FREE:
        qi = j * PAGE_SIZE + local // GROUP  # in q: the previous page of queries, then the chunk
    else:
        qi = j * PAGE_SIZE + (local // GROUP) * ROW_STRIDE + ROW_STRIDE - 1  # query index in the chunk
    row_ok = (local < ROWS) & (qi < seq_len)
    qi = tl.minimum(qi, seq_len - 1)  # rows past the chunk read a real query; their result is dropped
    head = (kvh * GROUP + local % GROUP).to(tl.int64)
    if LEAK_FREE:
        q_pos = query_start - PAGE_SIZE + qi
        if NO_PREVIOUS:
            q_pos = tl.maximum(q_pos, query_start)
    else:
        q_pos = query_start + qi
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = _load_tile(q_ptr + b * stride_qb + head[:, None] * stride_qh + qi.to(tl.int64)[:, None] * stride_ql
                   + offs_d[None, :] * stride_qd, row_ok, d_ok, True, EVEN_D)
    if UPCAST:
        q = q.to(tl.float32)
    qk_scale = scale * _LOG2E
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    table_row_ptr = table_ptr + b * stride_tb
    list_row_ptr = list_ptr + b * stride_lb + kvh.to(tl.int64) * stride_lh + j.to(tl.int64) * stride_lj

    # Pass 1: each row's base-2 log-sum-exp over every key it sees: the history (or the listed pages),
    # the chunk before the block (visible to every row), the block itself (causal).
    block_first = query_start + j * PAGE_SIZE
    last = tl.max(tl.where(row_ok, q_pos, 0))
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    scratch_row = scratch_ptr + pid_bh.to(tl.int64) * stride_sbh + (j - first_block).to(tl.int64) * stride_sj + local
    if LISTED:  # one flat loop over the listed pages' key tiles; each tile's key rows are found one
        # iteration ahead, so its load depends on no load of its own iteration and runs stages ahead
        TILES_PER_PAGE: tl.constexpr = PAGE_SIZE // BLOCK_N
        n_tiles = num_history * TILES_PER_PAGE
        m_p = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_p = tl.zeros([BLOCK_M], dtype=tl.float32)
        next_first = tl.load(list_row_ptr) * PAGE_SIZE
        next_rows = _key_offsets(table_row_ptr, next_first, offs_n, offs_n < BLOCK_N, stride_kp, stride_kt,
                                 PAGE_SIZE, BLOCK_N, False)
        for t in range(0, n_tiles):
            slot = t % TILES_PER_PAGE
            first_key = next_first
            k_rows = next_rows
            ahead = tl.minimum(t + 1, n_tiles - 1)
            next_first = (tl.load(list_row_ptr + ahead // TILES_PER_PAGE) * PAGE_SIZE
                          + (ahead % TILES_PER_PAGE) * BLOCK_N)
            next_rows = _key_offsets(table_row_ptr, next_first, offs_n, offs_n < BLOCK_N, stride_kp, stride_kt,
                                     PAGE_SIZE, BLOCK_N, False)
            k = _load_tile(k_base + k_rows[:, None] + offs_d[None, :] * stride_kd, offs_n < BLOCK_N, d_ok, False,
                           EVEN_D)
            if UPCAST:
                k = k.to(tl.float32)
            # unscaled logits: the maxima are taken before the scale, which then folds into each exponent's
            # subtraction (one fused multiply-add per logit instead of a multiply and a subtraction)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            if LEAK_FREE:  # rows of the previous chunk's last page see that page up to themselves
                s = tl.where((first_key + offs_n)[None, :] <= q_pos[:, None], s, float("-inf"))
            m_p = tl.where(slot == 0, float("-inf"), m_p)  # a page's first tile starts its log-mass afresh
            l_p = tl.where(slot == 0, 0.0, l_p)
            m_pn = tl.maximum(m_p, tl.max(s, 1) * qk_scale)  # finite: every row sees a listed page's first key
            l_t = tl.sum(tl.exp2(s * qk_scale - m_pn[:, None]), 1)
            l_p = l_p * tl.exp2(m_p - m_pn) + l_t
            m_p = m_pn
            # the row's base-2 log-mass on the page, stored after the page's last tile
            tl.store(scratch_row + (t // TILES_PER_PAGE) * stride_si, m_p + tl.log2(l_p),
                     mask=(local >= 0) & (slot == TILES_PER_PAGE - 1))
            m_new = tl.maximum(m_i, m_pn)  # the tile folded into the row's running log-sum-exp
            l_i = l_i * tl.exp2(m_i - m_new) + l_t * tl.exp2(m_pn - m_new)
            m_i = m_new
        own_first = query_start
    else:
        own_first = 0
    if LEAK_FREE:  # the rows end at the block's first query: the chunk's keys up to each row, causally
        block_first = own_first
    for start_n in range(own_first, block_first, BLOCK_N):
        s = _scaled_logits(q, k_base, table_row_ptr, start_n, offs_n, offs_d, d_ok, qk_scale,
                           stride_kp, stride_kt, stride_kd, PAGE_SIZE, BLOCK_N, EVEN_D, UPCAST, DOT_PRECISION)
        m_i, l_i = _online_lse(m_i, l_i, s)
    for start_n in range(block_first, last + 1, BLOCK_N):
        s = _scaled_logits(q, k_base, table_row_ptr, start_n, offs_n, offs_d, d_ok, qk_scale,
                           stride_kp, stride_kt, stride_kd, PAGE_SIZE, BLOCK_N, EVEN_D, UPCAST, DOT_PRECISION)
        s = tl.where((start_n + offs_n)[None, :] <= q_pos[:, None], s, float("-inf"))
        m_i, l_i = _online_lse(m_i, l_i, s)  # finite: the listed pages' keys, or each row's own in its first tile
    lse2 = m_i + tl.log2(l_i)
    if LISTED:  # pass 1's scratch stores are read below in another layout, by other threads
        tl.debug_barrier()

    # Pass 2: per history (listed) page, each row's probability there; the tile's largest, max-folded
    # into out (atomics of a max: the result does not depend on the programs' order).
    out_row = out_ptr + b * stride_ob + kvh.to(tl.int64) * stride_oh + j.to(tl.int64) * stride_oj
    if LISTED:  # the log-masses this program stored in pass 1, a (rows x BLOCK_N pages) tile at a time
        for first in range(0, num_history, BLOCK_N):
            listed = first + offs_n
            log_mass = tl.load(scratch_row[:, None] + listed[None, :] * stride_si,
                               mask=row_ok[:, None] & (listed < num_history)[None, :], other=float("-inf"))
            mass = tl.exp2(log_mass - lse2[:, None])
            tl.atomic_max(out_row + listed, tl.max(mass, 0), mask=listed < num_history)
    else:
        for i in range(0, num_history):
            first_key = i * PAGE_SIZE
            mass = tl.zeros([BLOCK_M], dtype=tl.float32)
            for slot in range(0, PAGE_SIZE, BLOCK_N):
                s = _scaled_logits(q, k_base, table_row_ptr, first_key + slot, offs_n, offs_d, d_ok, qk_scale,
                                   stride_kp, stride_kt, stride_kd, PAGE_SIZE, BLOCK_N, EVEN_D, UPCAST,
                                   DOT_PRECISION)
                mass += tl.sum(tl.exp2(s - lse2[:, None]), 1)
            tl.atomic_max(out_row + i, tl.max(tl.where(row_ok, mass, 0.0)))


def tune_bucket(num_history: int) -> int:
    """The tuning key's class of a call's scored pages: the next power of two. A program's loop runs over
    them, and the best tiles for a few dozen pages need not be those for a few hundred; keyed on the head
    dim, page size and group alone, a step's first scoring call (under 100 listed pages in `oomb bench`'s
    warm-up) chose the config of every later one (257 listed pages with the defaults: 256 candidates and
    the sink)."""
    return triton.next_power_of_2(max(1, num_history))


def exact_page_scores(q: torch.Tensor, k_pool: torch.Tensor, page_table: torch.Tensor, query_start: int,
                      scale: float, row_stride: int = 1, pages: torch.Tensor | None = None,
                      leak_free: bool = False, previous: torch.Tensor | None = None) -> torch.Tensor:
    """The exact score with max pooling: the largest probability any scoring row of a block puts on
    each history page.

    Args:
        q: (B, Hq, Lq, D) the chunk's post-RoPE queries (any strides).
        k_pool: (num_pages, Hkv, P, D) keys in q's dtype, holding every history page and the chunk's own.
        page_table: int32 (B, >= ceil((query_start + Lq) / P)).
        query_start: position of query 0, a multiple of P. scale: the attention's logit scale.
        row_stride: score from every row_stride-th query of a block (1: all of them).
        pages: None, or (B, Hkv, n_blocks, M) int32 page-table positions of the history pages each
            block scores ("rerank"'s candidates): the rows' probabilities are then normalised over
            these pages' keys and the chunk's own (causal), not over the whole history.
        leak_free: with ``pages``: score block j from the P queries before its first and that first
            query (oomb.sparse.leak_free_rows), each normalised over the keys at or before it; block 0's
            P earlier queries are ``previous`` (B, Hq, P, D), the previous chunk's last page, or without
            one copies of query 0.
    Returns:
        (B, Hkv, n_blocks, n_hist) float32, n_hist = query_start // P; with ``pages``: (B, Hkv,
        n_blocks, M), the score of each listed page.
    """
    B, Hq, Lq, D = q.shape
    _, Hkv, P, _ = k_pool.shape
    if q.dtype not in SUPPORTED_DTYPES or k_pool.dtype != q.dtype:
        raise TypeError(f"q and k_pool must share a dtype of {SUPPORTED_DTYPES}; got {q.dtype}, {k_pool.dtype}")
    if P % 16 or query_start % P or not 1 <= D <= MAX_HEAD_DIM or Hq % Hkv:
        raise ValueError(f"unsupported shape: page size {P} (a multiple of 16), query_start {query_start} "
                         f"(a multiple of it), head_dim {D} (<= {MAX_HEAD_DIM}), {Hq} query heads over {Hkv}")
    if not isinstance(row_stride, int) or not 1 <= row_stride <= P:
        raise ValueError(f"row_stride={row_stride!r} must be an integer in 1..{P}")
    if leak_free and (pages is None or row_stride != 1):
        raise ValueError("leak_free scores listed pages (rerank's candidates) from every row")
    if q.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before import)")
    n_blocks = -(-Lq // P)
    if pages is not None:
        if pages.dtype != torch.int32 or pages.shape[:3] != (B, Hkv, n_blocks) or pages.stride(3) != 1:
            raise ValueError(f"pages must be int32 (B, Hkv, n_blocks, M) = ({B}, {Hkv}, {n_blocks}, M) with "
                             f"contiguous rows; got {pages.dtype} {tuple(pages.shape)}")
        n_scored = pages.shape[3]
    else:
        n_scored = query_start // P
    out = torch.zeros((B, Hkv, n_blocks, n_scored), dtype=torch.float32, device=q.device)
    if B * Lq * n_scored == 0:
        return out
    rows = ((P + 1) if leak_free else (P // row_stride)) * (Hq // Hkv)
    no_previous = previous is None or previous.shape[2] != P
    if leak_free:  # the rows of block j are q_rows[j P : j P + P + 1]
        before = q[:, :, :1].expand(B, Hq, P, D) if no_previous else previous.to(q.dtype)
        q_rows = torch.cat([before, q], dim=2)
    else:
        q_rows = q
    listed = pages if pages is not None else out  # an unused pointer when nothing is listed
    if pages is not None:  # BLOCK_M divides _SCRATCH_ROWS: tiles x BLOCK_M <= rows rounded up
        padded_rows = -(-rows // _SCRATCH_ROWS) * _SCRATCH_ROWS
        per_block = B * Hkv * n_scored * padded_rows
        blocks_per_launch = max(1, min(n_blocks, SCRATCH_ELEMENTS // per_block))
        scratch = torch.empty((B * Hkv, blocks_per_launch, n_scored, padded_rows), dtype=torch.float32,
                              device=q.device)
    else:
        blocks_per_launch = n_blocks
        scratch = out.new_empty((1, 1, 1, 1))
    for first in range(0, n_blocks, blocks_per_launch):
        count = min(blocks_per_launch, n_blocks - first)

        def grid(meta, count=count):
            return (count * triton.cdiv(rows, meta["BLOCK_M"]), B * Hkv)

        _exact_scores_kernel[grid](
            q_rows, k_pool, page_table, listed, out, scratch, *q_rows.stride(), *k_pool.stride(),
            page_table.stride(0), *listed.stride()[:3], *out.stride()[:3], *scratch.stride()[:3], Hkv,
            q_rows.shape[2], query_start, n_scored, float(scale), first, tune_bucket(n_scored),
            ROW_STRIDE=row_stride, LISTED=pages is not None, LEAK_FREE=leak_free,
            NO_PREVIOUS=leak_free and no_previous, ROWS=rows, **_meta(q, Hq, Hkv, D, P),
        )
    return out
