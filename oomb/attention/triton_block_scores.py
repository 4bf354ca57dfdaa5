"""The summary scores (minmax, mean) of every (query block, history page) pair, pooled by max over the
block's rows, in one Triton kernel (oomb/sparse.py ``block_scores`` is the reference and the CPU's path).

    summary_block_scores(q, summaries, page_size, score, scale=None) -> (B, Hkv, n_blocks, n_hist) float32

Why a kernel: the torch path multiplies every row of a chunk (queries x group heads) with every page's
summary and writes the (rows x pages) float32 products before taking each block's maximum: at 1M tokens
of the 7B shape that is ~3.7 GB written and read per chunk and layer for ~0.5 TFLOP of products. Here
one program owns one block and a tile of pages, keeps the pages' summaries in registers, runs over the
block's rows tile by tile and keeps only the running maximum: the products never leave the chip.

minmax: ``sum_d max(q_d min_d, q_d max_d) = relu(q) . max + min(q, 0) . min`` (two products per tile);
mean: ``q . mean``. Rows past the chunk's end score as copies of its last query (they cannot change a
maximum), as the reference pads them. All query rows (not leak-free). Max pooling of the raw scores (the
default sparse settings and rerank's candidates), or with ``scale`` the "softmax_max" pooling
(OOMBConfig.sparse.research.candidate_pooling, sparse_pooling): each row's scaled scores minus their log-sum-exp
over every history page (or the sinks and the last pages: OOMBConfig.sparse.research.normaliser_pages) and the
chunk's own pages up to its block, the best row's. The log-sum-exps come
from a first kernel (one program per tile of one head's rows, an online log-sum-exp over the pages), which
the block kernel subtracts per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_paged import (
    CACHE_TUNING,
    INTERPRET,
    MAX_HEAD_DIM,
    SUPPORTED_DTYPES,
    _configs,
    _meta,
    _prune_for_dtype,
)

# (BLOCK_M rows, BLOCK_N pages, warps, stages)
_CONFIGS = _configs([(128, 64, 8, 2), (64, 64, 4, 2), (128, 128, 8, 2), (64, 32, 4, 3)])
_DYNAMIC = ["num_kv_heads", "seq_len", "num_history", "stride_ab", "stride_ap", "stride_bb", "stride_bp",
            "stride_ob", "stride_oh", "stride_oj"]


@triton.jit
def _summary_scores(q, a, lo, MINMAX: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(rows, pages) float32 summary scores of query rows ``q`` against page summaries ``a`` (key_max or
    key_mean) and ``lo`` (key_min, minmax only)."""
    if MINMAX:  # max / min promote bf16 to float32: back to q's dtype (exact) for the dots
        zero = tl.zeros_like(q)
        s = tl.dot(tl.maximum(q, zero).to(q.dtype), tl.trans(a), input_precision=DOT_PRECISION)
        s = tl.dot(tl.minimum(q, zero).to(q.dtype), tl.trans(lo), s, input_precision=DOT_PRECISION)
    else:
        s = tl.dot(q, tl.trans(a), input_precision=DOT_PRECISION)
    return s


@triton.jit
def _load_summaries(a_ptr, b_ptr, b, kvh, offs_n, offs_d, n_ok, d_ok,
                    stride_ab, stride_ap, stride_ah, stride_ad, stride_bb, stride_bp, stride_bh, stride_bd,
                    MINMAX: tl.constexpr, UPCAST: tl.constexpr):
    """A tile of pages' summaries of KV head ``kvh``: ``a`` (key_max or key_mean) and ``lo`` (key_min;
    ``a`` again without MINMAX), masked pages and dimensions 0."""
    kv_mask = n_ok[:, None] & d_ok[None, :]
    a = tl.load(a_ptr + b * stride_ab + offs_n.to(tl.int64)[:, None] * stride_ap + kvh * stride_ah
                + offs_d[None, :] * stride_ad, mask=kv_mask, other=0.0)
    lo = a
    if MINMAX:
        lo = tl.load(b_ptr + b * stride_bb + offs_n.to(tl.int64)[:, None] * stride_bp + kvh * stride_bh
                     + offs_d[None, :] * stride_bd, mask=kv_mask, other=0.0)
    if UPCAST:
        a = a.to(tl.float32)
        lo = lo.to(tl.float32)
    return a, lo


@triton.autotune(configs=_CONFIGS, key=["HEAD_DIM", "PAGE_SIZE", "GROUP", "MINMAX"], cache_results=CACHE_TUNING,
                 prune_configs_by={"early_config_prune": _prune_for_dtype})
@triton.jit(do_not_specialize=_DYNAMIC + ["stride_lb", "stride_lh", "num_own", "num_head", "first_counted"])
def _row_lse_kernel(
    q_ptr, a_ptr, b_ptr, lse_ptr,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_ab, stride_ap, stride_ah, stride_ad,
    stride_bb, stride_bp, stride_bh, stride_bd,
    stride_lb, stride_lh, stride_ll,
    num_kv_heads, seq_len, num_history, num_own, scale, num_head, first_counted,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, MINMAX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (query tiles, B * Hq): each query row's log-sum-exp of its scaled summary scores over the
    history pages before ``num_head`` and from ``first_counted`` on (0, 0: every one) and the chunk's own
    pages up to its block's (the ``num_own`` pages after the history in the summaries), into ``lse``
    (B, Hq, Lq) float32."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    pid_bh = tl.program_id(1)
    b = (pid_bh // (num_kv_heads * GROUP)).to(tl.int64)
    head = (pid_bh % (num_kv_heads * GROUP)).to(tl.int64)
    kvh = head // GROUP
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seq_len
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + head * stride_qh + offs_m.to(tl.int64)[:, None] * stride_ql
                + offs_d[None, :] * stride_qd, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    block = offs_m // PAGE_SIZE
    num_counted = num_head + num_history + num_own - first_counted
    for n0 in range(0, num_counted, BLOCK_N):
        offs_c = n0 + tl.arange(0, BLOCK_N)  # the counted pages, numbered without the gap between the two spans
        offs_n = tl.where(offs_c < num_head, offs_c, offs_c - num_head + first_counted)
        n_ok = offs_c < num_counted
        a, lo = _load_summaries(a_ptr, b_ptr, b, kvh, offs_n, offs_d, n_ok, d_ok, stride_ab, stride_ap, stride_ah,
                                stride_ad, stride_bb, stride_bp, stride_bh, stride_bd, MINMAX, UPCAST)
        s = _summary_scores(q, a, lo, MINMAX, DOT_PRECISION) * scale
        # history pages, and own pages up to the row's block (own page i covers keys before block i + 1)
        visible = (offs_n < num_history)[None, :] | (n_ok[None, :] & (offs_n[None, :] - num_history <= block[:, None]))
        s = tl.where(visible, s, float("-inf"))
        # finite from the first tile on: it starts with history page 0 or first_counted (num_history >= 1)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m_i = m_new
    tl.store(lse_ptr + b * stride_lb + head * stride_lh + offs_m.to(tl.int64) * stride_ll, m_i + tl.log(l_i),
             mask=m_ok)


@triton.autotune(configs=_CONFIGS, key=["HEAD_DIM", "PAGE_SIZE", "GROUP", "MINMAX"], cache_results=CACHE_TUNING,
                 prune_configs_by={"early_config_prune": _prune_for_dtype})
@triton.jit(do_not_specialize=_DYNAMIC + ["stride_lb", "stride_lh"])
def _block_scores_kernel(
    q_ptr, a_ptr, b_ptr, out_ptr,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_ab, stride_ap, stride_ah, stride_ad,
    stride_bb, stride_bp, stride_bh, stride_bd,
    stride_ob, stride_oh, stride_oj,
    num_kv_heads, seq_len, num_history,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, MINMAX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    lse_ptr=0, stride_lb=0, stride_lh=0, stride_ll=0, scale=1.0, NORMALISED: tl.constexpr = False,
):
    """Grid (n_blocks, page tiles, B * Hkv). ``a``: key_max (minmax) or key_mean; ``b``: key_min
    (minmax only), each (B, n_hist, Hkv, D). NORMALISED: a row scores ``scale * s - lse`` (``lse``: (B, Hq,
    Lq) float32, _row_lse_kernel's)."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    ROWS: tl.constexpr = PAGE_SIZE * GROUP  # a block's rows: its queries x the group's query heads
    j = tl.program_id(0)
    pid_bh = tl.program_id(2)
    b = (pid_bh // num_kv_heads).to(tl.int64)
    kvh = (pid_bh % num_kv_heads).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < num_history
    d_ok = offs_d < HEAD_DIM
    a, lo = _load_summaries(a_ptr, b_ptr, b, kvh, offs_n, offs_d, n_ok, d_ok, stride_ab, stride_ap, stride_ah,
                            stride_ad, stride_bb, stride_bp, stride_bh, stride_bd, MINMAX, UPCAST)
    best = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    for r0 in range(0, ROWS, BLOCK_M):
        local = r0 + tl.arange(0, BLOCK_M)
        row_ok = local < ROWS
        qi = tl.minimum(j * PAGE_SIZE + local // GROUP, seq_len - 1)  # past the end: the last query
        head = (kvh * GROUP + local % GROUP).to(tl.int64)
        q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + qi.to(tl.int64)[:, None] * stride_ql
                    + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        s = _summary_scores(q, a, lo, MINMAX, DOT_PRECISION)
        if NORMALISED:
            lse = tl.load(lse_ptr + b * stride_lb + head * stride_lh + qi.to(tl.int64) * stride_ll, mask=row_ok,
                          other=0.0)
            s = s * scale - lse[:, None]
        s = tl.where(row_ok[:, None], s, float("-inf"))
        best = tl.maximum(best, tl.max(s, 0))
    tl.store(out_ptr + b * stride_ob + kvh * stride_oh + j.to(tl.int64) * stride_oj + offs_n, best, mask=n_ok)


def summary_block_scores(q: torch.Tensor, summaries: dict[str, torch.Tensor], page_size: int,
                         score: str, scale: float | None = None, own_pages: int = 0,
                         normaliser_span: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Each query block's best row's summary score on each history page (max pooling; with ``scale``,
    softmax_max pooling).

    Args:
        q: (B, Hq, Lq, D) the chunk's post-RoPE queries (any strides).
        summaries: name -> (B, n_hist, Hkv, D) summaries in q's dtype: key_max and key_min for
            "minmax", key_mean for "mean" (PagedKVStore.history_summaries).
        page_size: P, the queries per block. score: "minmax" or "mean".
        scale: None: the raw scores' maximum. A logit scale: each row's scaled scores minus their
            log-sum-exp over the history pages (and the own pages), the best row's (block_scores with
            pooling "softmax_max").
        own_pages: with ``scale``, the summaries' last pages are the chunk's own this many: block j's rows
            count own pages 0..j in their normaliser, and no block scores them.
        normaliser_span: with ``scale``, (head, start): the normaliser counts the history pages before
            head and from start on (oomb/sparse.py normaliser_span); (0, 0): every history page.
    Returns:
        (B, Hkv, n_blocks, n_hist) float32, as block_scores with pooling "max" (unscaled: a scale > 0
        does not change a maximum or a ranking), or "softmax_max" with ``scale``.
    """
    if score not in ("minmax", "mean"):
        raise ValueError(f"score must be 'minmax' or 'mean'; got {score!r}")
    names = ("key_max", "key_min") if score == "minmax" else ("key_mean", "key_mean")
    a, lo = summaries[names[0]], summaries[names[1]]
    B, Hq, Lq, D = q.shape
    if own_pages and scale is None:
        raise ValueError("own pages only count in the normaliser: give a scale")
    n_hist, Hkv = a.shape[1] - own_pages, a.shape[2]
    if q.dtype not in SUPPORTED_DTYPES or a.dtype != q.dtype or lo.dtype != q.dtype:
        raise TypeError(f"q and the summaries must share a dtype of {SUPPORTED_DTYPES}; got {q.dtype}, {a.dtype}")
    if not 1 <= D <= MAX_HEAD_DIM or Hq % Hkv or a.shape != (B, n_hist + own_pages, Hkv, D) or lo.shape != a.shape:
        raise ValueError(f"unsupported shapes: q {tuple(q.shape)}, summaries {tuple(a.shape)} (B, pages, Hkv, "
                         f"D <= {MAX_HEAD_DIM})")
    if q.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before import)")
    head, start = normaliser_span
    if not (0 <= head <= start <= n_hist) or (start and head == start):
        raise ValueError(f"normaliser_span {normaliser_span} must be (0, 0) or 0 <= head < start <= {n_hist} pages")
    n_blocks = -(-Lq // page_size)
    out = torch.empty((B, Hkv, n_blocks, n_hist), dtype=torch.float32, device=q.device)
    if B * Lq * n_hist == 0:
        return out

    meta = dict(MINMAX=score == "minmax", **_meta(q, Hq, Hkv, D, page_size))
    normaliser = {}
    if scale is not None:
        lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
        _row_lse_kernel[lambda m: (triton.cdiv(Lq, m["BLOCK_M"]), B * Hq)](
            q, a, lo, lse, *q.stride(), *a.stride(), *lo.stride(), *lse.stride(), Hkv, Lq, n_hist, own_pages,
            float(scale), head, start, **meta)
        normaliser = dict(lse_ptr=lse, stride_lb=lse.stride(0), stride_lh=lse.stride(1), stride_ll=lse.stride(2),
                          scale=float(scale), NORMALISED=True)

    def grid(meta):
        return (n_blocks, triton.cdiv(n_hist, meta["BLOCK_N"]), B * Hkv)

    _block_scores_kernel[grid](
        q, a, lo, out, *q.stride(), *a.stride(), *lo.stride(), *out.stride()[:3], Hkv, Lq, n_hist,
        **normaliser, **meta,
    )
    return out
