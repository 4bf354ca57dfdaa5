"""Sparse paged attention in Triton: each query block reads its selected history pages and its chunk.

Implements the contract of ``oomb/attention/reference_sparse.py`` (read it first):

    sparse_attention_forward(q, k_pool, v_pool, page_table, query_start, scale, selection,
                             documents=None, softcap=None) -> (out, lse)
    sparse_attention_backward(q, k_pool, v_pool, page_table, query_start, scale, selection,
                              out, dout, lse, dk_pool, dv_pool, documents=None, softcap=None) -> dq
                              (dK, dV added into the pools)

Design: the dense kernels of ``triton_paged.py`` (row packing of GQA groups, page-decoupled key
tiles, the online softmax, the deterministic atomic-free backward), with key tiles taken from a
query block's page list:

* Row tiles never straddle query blocks: a block of P queries is P * G packed rows, cut into
  ceil(P * G / BLOCK_M) tiles; every row of a tile shares the block's selection.
* ``_fwd_kernel`` / ``_dq_kernel``: one row tile; first the block's K selected history pages
  (``selection[b, h, j, :]`` -> page-table position -> page id; whole pages, no causal mask,
  slots past P masked when BLOCK_N does not divide P), then the chunk's own keys with
  ``triton_paged._fwd_inner`` / ``_dq_inner`` (unmasked, then the causal diagonal).
* dK, dV without atomics: the selection is inverted on the device (sort of (page, block) pairs) into
  work items "(sequence, KV head, history page) <- the blocks that read it, in ascending order".
  ``_history_dkdv_kernel`` owns one key tile of one item, loops over the item's blocks and their
  row tiles (``triton_paged._dkdv_inner``), and adds dK, dV once into its page slots: it is the
  only writer of those slots. The chunk's own pages run ``triton_paged._dkdv_kernel`` on the page
  table shifted to the chunk (no history: exactly the causal part). Every reduction has a fixed
  order: two runs are bit-identical.

Supported: as triton_paged.py (bf16/fp16/fp32, head dims up to 256, any group size), with page
sizes that make chunks start on page boundaries (query_start % P == 0, as the engine guarantees).
Packed documents (``documents=``, constexpr ``DOCS``): every key before a row's document start is
hidden, in the selected pages (per row) and in the chunk (every own-chunk tile then runs masked,
with triton_paged's guard for rows that saw no key yet); the own pages' dK/dV kernel gets the
documents shifted to the chunk like its page table. Logit softcapping (``softcap=``, constexpr
``SOFTCAP``) is triton_paged's: capped scores over the selected pages and the chunk, dS times
1 - tanh^2 in every backward kernel; without it the kernels compile as before.

Caveats:
* Tested under the interpreter and on an H200 (tests/test_triton_sparse.py, ``-m gpu``); tuned only
  through the dense kernels' autotune spaces. ``performance.backend="torch"`` runs the sparse reference on
  a GPU if they fail there.
* The number of work items of the dK/dV launch is data-dependent: building them costs one device
  synchronisation per backward call (``unique_consecutive``).
* Under ``TRITON_INTERPRET=1`` (CPU tests) tiles are upcast to float32 before ``tl.dot`` and one
  small config is used, as in triton_paged.py.
* float32 inputs use one config per kernel, pruned as the dense kernels' (triton_paged's
  ``_prune_for_dtype``: tuning every float32 config compiled and timed for minutes there); not yet
  measured on a GPU for these kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..documents import Documents
from .reference_sparse import shared_by_all_blocks
from .triton_paged import (
    _DELTA_BLOCK_M,
    _DKDV_CONFIGS,
    _DKDV_PRUNE,
    _DQ_CONFIGS,
    _DQ_PRUNE,
    _DYNAMIC_INTS,
    _FWD_CONFIGS,
    _FWD_PRUNE,
    _LN2,
    _LOG2E,
    _TUNING_KEY,
    CACHE_TUNING,
    _cap,
    _check_inputs,
    _delta_kernel,
    _dkdv_inner,
    _dkdv_kernel,
    _document_args,
    _dq_inner,
    _fwd_inner,
    _load_kv,
    _load_tile,
    _meta,
    _qk_scale,
)

# Also not specialized: the selection's length and strides (change with the chunk), the history length.
_ROW_DYNAMIC_INTS = _DYNAMIC_INTS + ["num_selected", "stride_sb", "stride_sh", "stride_sj", "stride_db"]
_ITEM_DYNAMIC_INTS = _DYNAMIC_INTS + ["num_history", "stride_db"]


# --------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------
@triton.jit
def _block_rows(pid_m, seq_len, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows of the tile ``pid_m``: (query block j, row ids in the chunk, row mask, query index, first
    and last query position offsets). Tiles of a block: ceil(P * G / BLOCK_M); none spans two blocks."""
    TILES: tl.constexpr = (PAGE_SIZE * GROUP + BLOCK_M - 1) // BLOCK_M
    j = pid_m // TILES
    first_in_block = (pid_m % TILES) * BLOCK_M
    block_queries = tl.minimum(PAGE_SIZE, seq_len - j * PAGE_SIZE)
    local = first_in_block + tl.arange(0, BLOCK_M)
    row_ok = local < block_queries * GROUP
    # Padding rows borrow the block's last query: never stored, never masked out of a softmax.
    qi = j * PAGE_SIZE + tl.minimum(local // GROUP, block_queries - 1)
    rows = j * PAGE_SIZE * GROUP + local
    first_q = j * PAGE_SIZE + first_in_block // GROUP
    last_q = j * PAGE_SIZE + tl.minimum((first_in_block + BLOCK_M - 1) // GROUP, block_queries - 1)
    return j, rows, row_ok, qi, first_q, last_q


@triton.jit
def _page_offsets(table_row_ptr, position, slots, stride_page, stride_slot):
    """int64 offsets of ``slots`` of the page at page-table ``position`` of one sequence."""
    page = tl.load(table_row_ptr + position).to(tl.int64)
    return page * stride_page + slots.to(tl.int64) * stride_slot


@triton.jit
def _selected_tile(table_row_ptr, sel_row_ptr, t, n_tiles, offs_n, stride_kp, stride_kt, stride_vp, stride_vt,
                   PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tile t (clamped to the last; none: page-table position 0) of a row tile's selected pages: its
    page-table position, slots in the page, and the pool offsets of its keys and values. Looked up a tile
    ahead of use, so that the K/V loads depend on no load of their own iteration (Triton then keeps them
    in flight while the previous tile computes)."""
    TILES: tl.constexpr = (PAGE_SIZE + BLOCK_N - 1) // BLOCK_N
    tile = tl.maximum(tl.minimum(t, n_tiles - 1), 0)
    position = tl.load(sel_row_ptr + tile // TILES, mask=n_tiles > 0, other=0)
    slots = (tile % TILES) * BLOCK_N + offs_n
    return (position, slots, _page_offsets(table_row_ptr, position, slots, stride_kp, stride_kt),
            _page_offsets(table_row_ptr, position, slots, stride_vp, stride_vt))


@triton.jit
def _fwd_pages_inner(
    acc, l_i, m_i, q, k_base, v_base, table_row_ptr, sel_row_ptr, num_selected, qk_scale,
    stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd, offs_n, offs_d, d_ok,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, doc_start=0, DOCS: tl.constexpr = False,
    SOFTCAP: tl.constexpr = 0.0,
):
    """Online softmax over every key of the selected history pages (all visible to every row; with
    DOCS only keys at or after each row's document start; SOFTCAP as triton_paged._fwd_inner)."""
    EVEN_PAGE: tl.constexpr = PAGE_SIZE % BLOCK_N == 0
    TILES: tl.constexpr = (PAGE_SIZE + BLOCK_N - 1) // BLOCK_N
    n_tiles = num_selected * TILES  # one flat loop over the selected pages' key tiles, each found a tile ahead
    next_position, next_slots, next_k, next_v = _selected_tile(
        table_row_ptr, sel_row_ptr, 0, n_tiles, offs_n, stride_kp, stride_kt, stride_vp, stride_vt, PAGE_SIZE, BLOCK_N)
    for t in range(0, n_tiles):
        position, slots, k_rows, v_rows = next_position, next_slots, next_k, next_v
        next_position, next_slots, next_k, next_v = _selected_tile(
            table_row_ptr, sel_row_ptr, t + 1, n_tiles, offs_n, stride_kp, stride_kt, stride_vp, stride_vt,
            PAGE_SIZE, BLOCK_N)
        slot_ok = slots < PAGE_SIZE
        k, v = _load_kv(k_base, v_base, k_rows, v_rows, offs_d, stride_kd, stride_vd, slot_ok, d_ok, not EVEN_PAGE,
                        EVEN_D, UPCAST)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP > 0:
            qk, _ = _cap(qk, SOFTCAP)
        if not EVEN_PAGE:
            qk = tl.where(slot_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = m_new
        if DOCS:  # a row may see none of the tile (its document starts later): no exp2(-inf + inf)
            keys = position * PAGE_SIZE + slots
            qk = tl.where(keys[None, :] >= doc_start[:, None], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _dq_pages_inner(
    dq, q, do, lse2, delta, k_base, v_base, table_row_ptr, sel_row_ptr, num_selected, qk_scale,
    stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd, offs_n, offs_d, d_ok,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, doc_start=0, DOCS: tl.constexpr = False,
    SOFTCAP: tl.constexpr = 0.0,
):
    """Accumulate dQ of one row tile over the keys of its selected history pages (DOCS, SOFTCAP: as the
    forward; dS times the cap's derivative as in triton_paged._dq_inner)."""
    EVEN_PAGE: tl.constexpr = PAGE_SIZE % BLOCK_N == 0
    for s in range(0, num_selected):
        position = tl.load(sel_row_ptr + s)
        for start in range(0, PAGE_SIZE, BLOCK_N):
            slots = start + offs_n
            slot_ok = slots < PAGE_SIZE
            k_rows = _page_offsets(table_row_ptr, position, slots, stride_kp, stride_kt)
            v_rows = _page_offsets(table_row_ptr, position, slots, stride_vp, stride_vt)
            k, v = _load_kv(k_base, v_base, k_rows, v_rows, offs_d, stride_kd, stride_vd, slot_ok, d_ok, not EVEN_PAGE,
                            EVEN_D, UPCAST)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            if SOFTCAP > 0:
                qk, tanh = _cap(qk, SOFTCAP)
            p = tl.exp2(qk - lse2[:, None])
            if not EVEN_PAGE:
                p = tl.where(slot_ok[None, :], p, 0.0)
            if DOCS:
                keys = position * PAGE_SIZE + slots
                p = tl.where(keys[None, :] >= doc_start[:, None], p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            if SOFTCAP > 0:
                ds = ds * (1.0 - tanh * tanh)
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------
@triton.autotune(configs=_FWD_CONFIGS, key=_TUNING_KEY, cache_results=CACHE_TUNING, prune_configs_by=_FWD_PRUNE)
@triton.jit(do_not_specialize=_ROW_DYNAMIC_INTS)
def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, sel_ptr, out_ptr, lse_ptr, doc_start_ptr,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kp, stride_kh, stride_kt, stride_kd,
    stride_vp, stride_vh, stride_vt, stride_vd,
    stride_tb,
    stride_sb, stride_sh, stride_sj,
    stride_ob, stride_oh, stride_ol, stride_od,
    stride_lb, stride_lh, stride_ll, stride_db,
    num_kv_heads, seq_len, query_start, scale, num_selected,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, DOCS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr = 0.0,
):
    """Grid (n_blocks * tiles per block, B * Hkv): one row tile over its block's pages and its chunk
    (DOCS: keys before each row's document start hidden, and every own-chunk tile masked; SOFTCAP = c
    > 0: scores c * tanh(scale * q.k / c))."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_kv_heads).to(tl.int64)
    kvh = pid_bh % num_kv_heads
    j, rows, row_ok, qi, first_q, last_q = _block_rows(tl.program_id(0), seq_len, GROUP, PAGE_SIZE, BLOCK_M)
    head = (kvh * GROUP + rows % GROUP).to(tl.int64)
    q_pos = query_start + qi
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_rows = b * stride_qb + head * stride_qh + qi.to(tl.int64) * stride_ql
    q = _load_tile(q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd, row_ok, d_ok, True, EVEN_D)
    if UPCAST:
        q = q.to(tl.float32)
    qk_scale = _qk_scale(scale, SOFTCAP)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    table_row_ptr = table_ptr + b * stride_tb
    sel_row_ptr = sel_ptr + b * stride_sb + kvh.to(tl.int64) * stride_sh + j.to(tl.int64) * stride_sj
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    doc_start = 0
    if DOCS:
        doc_start = tl.load(doc_start_ptr + b * stride_db + q_pos)

    acc, l_i, m_i = _fwd_pages_inner(
        acc, l_i, m_i, q, k_base, v_base, table_row_ptr, sel_row_ptr, num_selected, qk_scale,
        stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd, offs_n, offs_d, d_ok,
        PAGE_SIZE, BLOCK_N, EVEN_D, UPCAST, DOT_PRECISION, doc_start, DOCS, SOFTCAP,
    )
    # The chunk's own keys [query_start, .. ]: visible to every row up to the tile's first query.
    num_keys = query_start + seq_len
    lo = query_start
    full_end = lo + (query_start + first_q + 1 - lo) // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, q_pos, k_base, v_base, table_row_ptr, lo, full_end, num_keys, qk_scale,
        stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd, offs_n, offs_d, d_ok,
        PAGE_SIZE, BLOCK_N, EVEN_D, DOCS, UPCAST, DOT_PRECISION, 0, False, doc_start, DOCS, SOFTCAP=SOFTCAP,
    )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, q_pos, k_base, v_base, table_row_ptr, full_end, query_start + last_q + 1, num_keys,
        qk_scale, stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd, offs_n, offs_d, d_ok,
        PAGE_SIZE, BLOCK_N, EVEN_D, True, UPCAST, DOT_PRECISION, 0, False, doc_start, DOCS, SOFTCAP=SOFTCAP,
    )

    out = acc / l_i[:, None]
    o_rows = b * stride_ob + head * stride_oh + qi.to(tl.int64) * stride_ol
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    lse = (m_i + tl.log2(l_i)) * _LN2
    tl.store(lse_ptr + b * stride_lb + head * stride_lh + qi.to(tl.int64) * stride_ll, lse, mask=row_ok)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------
@triton.autotune(configs=_DQ_CONFIGS, key=_TUNING_KEY, cache_results=CACHE_TUNING, prune_configs_by=_DQ_PRUNE)
@triton.jit(do_not_specialize=_ROW_DYNAMIC_INTS)
def _dq_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, sel_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr, doc_start_ptr,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kp, stride_kh, stride_kt, stride_kd,
    stride_vp, stride_vh, stride_vt, stride_vd,
    stride_tb,
    stride_sb, stride_sh, stride_sj,
    stride_gb, stride_gh, stride_gl, stride_gd,
    stride_lb, stride_lh, stride_ll,
    stride_dqb, stride_dqh, stride_dql, stride_dqd, stride_db,
    num_kv_heads, seq_len, query_start, scale, num_selected,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, DOCS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr = 0.0,
):
    """Grid (n_blocks * tiles per block, B * Hkv): dQ of one row tile, same traversal as the forward."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_kv_heads).to(tl.int64)
    kvh = pid_bh % num_kv_heads
    j, rows, row_ok, qi, first_q, last_q = _block_rows(tl.program_id(0), seq_len, GROUP, PAGE_SIZE, BLOCK_M)
    head = (kvh * GROUP + rows % GROUP).to(tl.int64)
    q_pos = query_start + qi
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_rows = b * stride_qb + head * stride_qh + qi.to(tl.int64) * stride_ql
    g_rows = b * stride_gb + head * stride_gh + qi.to(tl.int64) * stride_gl
    q = _load_tile(q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd, row_ok, d_ok, True, EVEN_D)
    do = _load_tile(dout_ptr + g_rows[:, None] + offs_d[None, :] * stride_gd, row_ok, d_ok, True, EVEN_D)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    stat = b * stride_lb + head * stride_lh + qi.to(tl.int64) * stride_ll
    lse2 = tl.load(lse_ptr + stat, mask=row_ok, other=0.0) * _LOG2E
    delta = tl.load(delta_ptr + stat, mask=row_ok, other=0.0)
    qk_scale = _qk_scale(scale, SOFTCAP)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    table_row_ptr = table_ptr + b * stride_tb
    sel_row_ptr = sel_ptr + b * stride_sb + kvh.to(tl.int64) * stride_sh + j.to(tl.int64) * stride_sj
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    doc_start = 0
    if DOCS:
        doc_start = tl.load(doc_start_ptr + b * stride_db + q_pos)

    dq = _dq_pages_inner(
        dq, q, do, lse2, delta, k_base, v_base, table_row_ptr, sel_row_ptr, num_selected, qk_scale,
        stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd, offs_n, offs_d, d_ok,
        PAGE_SIZE, BLOCK_N, EVEN_D, UPCAST, DOT_PRECISION, doc_start, DOCS, SOFTCAP,
    )
    num_keys = query_start + seq_len
    lo = query_start
    full_end = lo + (query_start + first_q + 1 - lo) // BLOCK_N * BLOCK_N
    dq = _dq_inner(
        dq, q, do, lse2, delta, q_pos, k_base, v_base, table_row_ptr, lo, full_end, num_keys, qk_scale,
        stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd, offs_n, offs_d, d_ok,
        PAGE_SIZE, BLOCK_N, EVEN_D, DOCS, UPCAST, DOT_PRECISION, 0, False, doc_start, DOCS, SOFTCAP=SOFTCAP,
    )
    dq = _dq_inner(
        dq, q, do, lse2, delta, q_pos, k_base, v_base, table_row_ptr, full_end, query_start + last_q + 1, num_keys,
        qk_scale, stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd, offs_n, offs_d, d_ok,
        PAGE_SIZE, BLOCK_N, EVEN_D, True, UPCAST, DOT_PRECISION, 0, False, doc_start, DOCS, SOFTCAP=SOFTCAP,
    )
    dq = dq * scale
    dq_rows = b * stride_dqb + head * stride_dqh + qi.to(tl.int64) * stride_dql
    tl.store(dq_ptr + dq_rows[:, None] + offs_d[None, :] * stride_dqd, dq.to(dq_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


@triton.autotune(configs=_DKDV_CONFIGS, key=_TUNING_KEY, restore_value=["dk_ptr", "dv_ptr"],
                 cache_results=CACHE_TUNING, prune_configs_by=_DKDV_PRUNE)
@triton.jit(do_not_specialize=_ITEM_DYNAMIC_INTS)
def _history_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, dout_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    item_ptr, item_start_ptr, item_count_ptr, item_block_ptr, doc_start_ptr,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kp, stride_kh, stride_kt, stride_kd,
    stride_vp, stride_vh, stride_vt, stride_vd,
    stride_tb,
    stride_gb, stride_gh, stride_gl, stride_gd,
    stride_lb, stride_lh, stride_ll,
    stride_dkp, stride_dkh, stride_dkt, stride_dkd,
    stride_dvp, stride_dvh, stride_dvt, stride_dvd, stride_db,
    num_kv_heads, seq_len, query_start, scale, num_history,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, DOCS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr = 0.0,
):
    """Grid (key tiles per page, work items): dK, dV of one key tile of one selected history page,
    from every block that selected it (ascending), added once into the pools (DOCS: rows whose
    document starts after a key give it nothing)."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    EVEN_PAGE: tl.constexpr = PAGE_SIZE % BLOCK_N == 0
    item = tl.program_id(1)
    key = tl.load(item_ptr + item)  # (b * Hkv + kvh) * num_history + page-table position
    first = tl.load(item_start_ptr + item)
    count = tl.load(item_count_ptr + item)
    bh = key // num_history
    position = key % num_history
    b = (bh // num_kv_heads).to(tl.int64)
    kvh = (bh % num_kv_heads).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    slots = tl.program_id(0) * BLOCK_N + offs_n
    slot_ok = slots < PAGE_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    table_row_ptr = table_ptr + b * stride_tb

    k_rows = _page_offsets(table_row_ptr, position, slots, stride_kp, stride_kt)
    v_rows = _page_offsets(table_row_ptr, position, slots, stride_vp, stride_vt)
    k = _load_tile(k_ptr + kvh * stride_kh + k_rows[:, None] + offs_d[None, :] * stride_kd, slot_ok, d_ok,
                   not EVEN_PAGE, EVEN_D)
    v = _load_tile(v_ptr + kvh * stride_vh + v_rows[:, None] + offs_d[None, :] * stride_vd, slot_ok, d_ok,
                   not EVEN_PAGE, EVEN_D)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk_scale = _qk_scale(scale, SOFTCAP)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for i in range(first, first + count):
        j = tl.load(item_block_ptr + i)
        lo = j * PAGE_SIZE * GROUP
        hi = tl.minimum((j + 1) * PAGE_SIZE, seq_len) * GROUP
        # History keys precede every row of the block: no causal mask (rows >= hi are padding); with
        # DOCS the masked path hides keys before each row's document start (causality holds trivially).
        dk, dv = _dkdv_inner(
            dk, dv, k, v, position * PAGE_SIZE + slots, q_ptr, dout_ptr, lse_ptr, delta_ptr, b, kvh, lo, hi,
            hi, seq_len, query_start, qk_scale,
            stride_qb, stride_qh, stride_ql, stride_qd, stride_gb, stride_gh, stride_gl, stride_gd,
            stride_lb, stride_lh, stride_ll, offs_d, d_ok,
            GROUP, BLOCK_M, EVEN_D, DOCS, UPCAST, DOT_PRECISION, doc_start_ptr + b * stride_db, DOCS,
            SOFTCAP=SOFTCAP,
        )
    dk = dk * scale

    # The only program touching these slots in the launch: plain read-modify-write.
    tile_mask = slot_ok[:, None] & d_ok[None, :]
    dk_rows = _page_offsets(table_row_ptr, position, slots, stride_dkp, stride_dkt)
    dk_ptrs = dk_ptr + kvh * stride_dkh + dk_rows[:, None] + offs_d[None, :] * stride_dkd
    old = tl.load(dk_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
    tl.store(dk_ptrs, (old + dk).to(dk_ptr.dtype.element_ty), mask=tile_mask)
    dv_rows = _page_offsets(table_row_ptr, position, slots, stride_dvp, stride_dvt)
    dv_ptrs = dv_ptr + kvh * stride_dvh + dv_rows[:, None] + offs_d[None, :] * stride_dvd
    old = tl.load(dv_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
    tl.store(dv_ptrs, (old + dv).to(dv_ptr.dtype.element_ty), mask=tile_mask)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def _check_selection(selection: torch.Tensor, q: torch.Tensor, k_pool: torch.Tensor, query_start: int) -> int:
    """Validate the selection; return the number of history pages."""
    B, _, Lq, _ = q.shape
    Hkv, P = k_pool.shape[1], k_pool.shape[2]
    if query_start % P:
        raise ValueError(f"query_start={query_start} must be a multiple of the page size {P} in sparse attention")
    n_blocks = -(-Lq // P)
    if selection.dtype != torch.int32 or selection.dim() != 4 or tuple(selection.shape[:3]) != (B, Hkv, n_blocks):
        raise ValueError(f"selection must be int32 (B={B}, Hkv={Hkv}, n_blocks={n_blocks}, K); got "
                         f"{selection.dtype} {tuple(selection.shape)}")
    if selection.shape[3] and selection.stride(3) != 1:
        raise ValueError("selection rows must be contiguous (stride(3) == 1)")
    if selection.device != q.device:
        raise ValueError(f"selection is on {selection.device}, q on {q.device}")
    return query_start // P


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
    """Each query block's attention over its selected history pages and its own chunk (causal).

    Args:
        q, k_pool, v_pool, page_table, query_start, scale: as triton_paged.paged_attention_forward.
        selection: int32 (B, Hkv, ceil(Lq / P), K) page-table positions < query_start / P.
        documents: packed documents: keys before each query's document start are hidden.
        softcap: logit softcapping c: scores c * tanh(scale * q.k / c) (Gemma 2); None: off.
    Returns:
        out (B, Hq, Lq, D) in q's dtype and layout, lse (B, Hq, Lq) float32 natural log.
    """
    B, Hq, Lq, D, Hkv, P = _check_inputs(q, k_pool, v_pool, page_table, query_start)
    _check_selection(selection, q, k_pool, query_start)
    meta = _meta(q, Hq, Hkv, D, P, softcap)
    out = torch.empty_like(q)
    lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
    if B * Lq == 0:
        return out, lse
    G, n_blocks = Hq // Hkv, -(-Lq // P)

    def grid(meta):
        return (n_blocks * triton.cdiv(P * G, meta["BLOCK_M"]), B * Hkv)

    doc_start, _, stride_db = _document_args(documents, q, query_start, page_table)
    _fwd_kernel[grid](
        q, k_pool, v_pool, page_table, selection, out, lse, doc_start,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), page_table.stride(0), *selection.stride()[:3],
        *out.stride(), *lse.stride(), stride_db,
        Hkv, Lq, query_start, float(scale), selection.shape[3],
        DOCS=documents is not None, **meta,
    )
    return out, lse


def _history_work_items(selection: torch.Tensor, num_history: int):
    """Invert the selection: the (sequence, KV head, history page) triples some block reads, each with
    the ascending list of blocks that read it.

    Returns:
        items (N,) int64 keys (b * Hkv + h) * num_history + position, int32 starts (N,) and counts (N,)
        into blocks (B * Hkv * n_blocks * K,) int32 block indices; all on selection's device.
    Rows of the selection are distinct and ascending (oomb.sparse.top_pages). One device sync, unless
    every block shares one row (stride 0 over the blocks).
    """
    B, Hkv, n_blocks, K = selection.shape
    if shared_by_all_blocks(selection):  # one row for every block: known sizes, no device sync
        bh = torch.arange(B * Hkv, device=selection.device).reshape(B, Hkv, 1)
        items = (bh * num_history + selection[:, :, 0].long()).reshape(-1)  # rows ascending: items sorted
        counts = torch.full_like(items, n_blocks, dtype=torch.int32)
        starts = torch.arange(items.numel(), device=items.device, dtype=torch.int32) * n_blocks
        blocks = torch.arange(n_blocks, device=items.device, dtype=torch.int32).repeat(items.numel())
        return items, starts, counts, blocks
    bh = torch.arange(B * Hkv, device=selection.device).reshape(B, Hkv, 1, 1)
    block = torch.arange(n_blocks, device=selection.device).reshape(1, 1, n_blocks, 1)
    pairs = ((bh * num_history + selection.long()) * n_blocks + block).reshape(-1).sort().values
    items, counts = torch.unique_consecutive(pairs // n_blocks, return_counts=True)  # one device sync
    starts = torch.cumsum(counts, 0) - counts
    return items, starts.to(torch.int32), counts.to(torch.int32), (pairs % n_blocks).to(torch.int32)


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
    """Return dQ and add dK, dV into the selected history pages and the chunk's own pages.

    Same arguments as triton_paged.paged_attention_backward plus the selection (and, as the forward,
    the documents and the softcap). Deterministic: no atomics.
    """
    B, Hq, Lq, D, Hkv, P = _check_inputs(q, k_pool, v_pool, page_table, query_start)
    num_history = _check_selection(selection, q, k_pool, query_start)
    for name, t in (("out", out), ("dout", dout)):
        if t.shape != q.shape or t.device != q.device:
            raise ValueError(f"{name} {tuple(t.shape)} on {t.device} must match q {tuple(q.shape)} on {q.device}")
    if lse.shape != (B, Hq, Lq) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 {(B, Hq, Lq)}; got {lse.dtype} {tuple(lse.shape)}")
    for name, t in (("dk_pool", dk_pool), ("dv_pool", dv_pool)):
        if t.shape != k_pool.shape or t.device != k_pool.device:
            raise ValueError(f"{name} {tuple(t.shape)} on {t.device} must match k_pool {tuple(k_pool.shape)}")
    dq = torch.empty_like(q)
    if B * Lq == 0:
        return dq
    G, n_blocks, K = Hq // Hkv, -(-Lq // P), selection.shape[3]
    meta = _meta(q, Hq, Hkv, D, P, softcap)
    dout = dout.to(q.dtype)
    lse = lse.contiguous()  # the kernels index lse and delta with the same strides
    delta = torch.empty_like(lse)  # (B, Hq, Lq) float32 rowsum(dO * O)
    _delta_kernel[(triton.cdiv(Lq, _DELTA_BLOCK_M), B * Hq)](
        out, dout, delta, *out.stride(), *dout.stride(), Hq, Lq,
        HEAD_DIM=D, BLOCK_D=meta["BLOCK_D"], BLOCK_M=_DELTA_BLOCK_M,
    )
    common = (*q.stride(), *k_pool.stride(), *v_pool.stride(), page_table.stride(0))

    doc_start, _, stride_db = _document_args(documents, q, query_start, page_table)
    docs = documents is not None
    # The chunk's own pages: the dense dK/dV kernel on the table shifted to the chunk (no history);
    # documents in the same shifted positions (a start before the chunk becomes negative: all visible).
    own_table = page_table[:, num_history:]
    own_docs = {}
    if docs:
        own_start = (documents.start[:, query_start:] - query_start).contiguous()
        own_end = (documents.end[:, query_start:] - query_start).contiguous()
        own_docs = dict(doc_start_ptr=own_start, doc_end_ptr=own_end, stride_db=own_start.stride(0), DOCS=True)
    _dkdv_kernel[lambda m: (triton.cdiv(Lq, m["BLOCK_N"]), B * Hkv)](
        q, k_pool, v_pool, own_table, dout, lse, delta, dk_pool, dv_pool,
        *common, *dout.stride(), *lse.stride(), *dk_pool.stride(), *dv_pool.stride(),
        Hkv, Lq, 0, float(scale), **meta, **own_docs,
    )
    if K:
        items, starts, counts, blocks = _history_work_items(selection, num_history)
        _history_dkdv_kernel[lambda m: (triton.cdiv(P, m["BLOCK_N"]), items.numel())](
            q, k_pool, v_pool, page_table, dout, lse, delta, dk_pool, dv_pool, items, starts, counts, blocks,
            doc_start, *common, *dout.stride(), *lse.stride(), *dk_pool.stride(), *dv_pool.stride(), stride_db,
            Hkv, Lq, query_start, float(scale), num_history, DOCS=docs, **meta,
        )
    _dq_kernel[lambda m: (n_blocks * triton.cdiv(P * G, m["BLOCK_M"]), B * Hkv)](
        q, k_pool, v_pool, page_table, selection, dout, lse, delta, dq, doc_start,
        *common, *selection.stride()[:3], *dout.stride(), *lse.stride(), *dq.stride(), stride_db,
        Hkv, Lq, query_start, float(scale), K, DOCS=docs, **meta,
    )
    return dq
