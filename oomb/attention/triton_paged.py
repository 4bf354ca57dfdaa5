"""Paged causal attention in Triton: a forward and a deterministic, atomic-free backward.

Implements the contract of ``oomb/attention/reference.py`` (read it first):

    paged_attention_forward(q, k_pool, v_pool, page_table, query_start, scale,
                            *, key_range=None, out_dtype=None, documents=None, softcap=None) -> (out, lse)
    paged_attention_backward(q, k_pool, v_pool, page_table, query_start, scale,
                             out, dout, lse, dk_pool, dv_pool,
                             *, key_range=None, delta=None, dq_accumulator=None, documents=None,
                             softcap=None) -> dq   (dK, dV added into the pools)
    backward_delta(out, dout) -> delta

Design (details and diagrams in docs/kernels.md):

* GQA by row packing. The G = Hq // Hkv query heads that share a KV head are processed by the same
  program: tile row r of a (batch, KV head) pair is query i = r // G of head g = r % G. A row tile
  of BLOCK_M rows therefore covers about BLOCK_M / G consecutive queries of all G heads, every K/V
  tile is loaded once for the whole group, and K/V are never repeated. Any G works (1, 7, ...).
* Pages are decoupled from key tiles. Key j of a sequence lives in page ``page_table[b, j // P]``
  at slot ``j % P``. When BLOCK_N divides P a key tile sits in one page (one page-id load per
  tile); otherwise every key of the tile looks up its own page (P = 64 with BLOCK_N = 128, or any
  P that is not a power of two). All pool offsets are int64.
* Causality is bottom-right aligned: query i (absolute position query_start + i) sees keys
  0 .. query_start + i. Key tiles visible to every row of a tile run without masks; only the
  few tiles on the diagonal are masked; fully masked tiles are never visited.
* Key windows (``key_range``, for host offload streaming history through the GPU): the kernels
  take the window [key_lo, key_hi) as runtime ints. Forward and dQ run the unmasked loop over the
  tiles wholly inside the window and visible to every row, and masked tiles at its edges (which
  need not be tile-aligned); only masked tiles look keys up one by one, with loads masked to the
  window, so no table entry or page outside it is read. dK/dV launch only the window's key tiles.
  Without a window the compiled code is today's (``WINDOW`` and ``ACCUMULATE_DQ`` are constexpr).
* Packed documents (``documents``, oomb/documents.py; constexpr ``DOCS``): query t of row b sees keys
  start[b, t] <= j <= t. Forward and dQ start a row tile at the key tile of its earliest document
  start and mask the tiles up to its latest one; dK/dV of a key tile loop only over the rows whose
  documents reach it (t < end[b, last key]) and mask those whose document starts inside the tile.
  Rows that see no key of a window get out 0 and lse -inf (merged as an empty window).
* Logit softcapping (``softcap`` c, Gemma 2; constexpr ``SOFTCAP``, 0.0 = off): a score s = scale * q.k
  becomes c * tanh(s / c) before the softmax. The inner loops multiply q.k by scale / c instead of
  scale * log2(e) and turn tanh of that into base-2 logits (``_cap``); backward multiplies dS by
  1 - tanh^2 before the dQ and dK products. tanh is built from exp2 (``_tanh``: no tanh runs in the
  interpreter), so a capped tile costs one more exp2 and one division per score. Without a cap the
  launches pass no SOFTCAP and the kernels compile to exactly the code of before (PTX for sm_90
  compared instruction for instruction); each cap value compiles its own kernels (a model has one).
* Backward without atomics: ``_dkdv_kernel`` owns one key tile of one (batch, KV head), loops
  over all query row tiles (all G heads of the group), keeps dK, dV in registers and adds them
  once into the page gradient buffers (read-modify-write: it is the only writer of those slots
  in the launch). ``_dq_kernel`` owns one row tile and loops over key tiles. ``_delta_kernel``
  computes rowsum(dO * O) first. Every reduction has a fixed order: two runs are bit-identical.

Supported: q/k/v in bfloat16, float16 or float32 (one dtype for all three; float32 dots use IEEE
precision, not TF32); gradient pools in any of those dtypes (accumulation is float32, one
rounding per backward); head dims up to 256 (64 and 128 are the tuned ones; others are padded to
the next power of two >= 16 and masked; above 128 low-spill tiles are tried first: WIDE_HEAD_DIM);
any page size (64 and 128 are the tuned ones); any query_start >= 0, any chunk length, any batch
size; logit softcapping (``softcap``).

Caveats:
* Page ids in ``page_table[:, :n_pages]`` must be unique (as in the reference): two programs of the
  dK/dV kernel writing the same page slot would race. Not checked (a check costs a device sync).
* Autotuning runs on the first call per (head dim, page size, group, dtypes) and benchmarks the
  dK/dV kernel on clones of the gradient pools (``restore_value``): a one-off copy of both pools.
  The choice is kept in Triton's on-disk cache (``cache_results``; ``OOMB_TRITON_AUTOTUNE_CACHE=0``
  turns that off), so later processes on the machine reuse it: without the cache two processes
  may pick different configs and differ in the last bits (bf16 gradient error 0.0106 vs 0.0114
  measured on the H200, docs/results.md). ``OOMB_TRITON_AUTOTUNE=0`` pins the first config of
  each list instead.
* Under ``TRITON_INTERPRET=1`` (CPU tests) every tile is upcast to float32 before ``tl.dot``
  (the interpreter computes bfloat16 dots wrongly) and a single small config is used.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..documents import Documents
from .reference import _check_backward_extras, check_key_range

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Read once at import, like triton.jit does: the interpreter must be chosen before importing."""
AUTOTUNE = os.environ.get("OOMB_TRITON_AUTOTUNE", "1") != "0"
"""OOMB_TRITON_AUTOTUNE=0 pins each kernel to its first config: fewer compiles (quicker tests) and
the same config, hence bit-identical results, in every process."""
CACHE_TUNING = AUTOTUNE and not INTERPRET and os.environ.get("OOMB_TRITON_AUTOTUNE_CACHE", "1") != "0"
"""Keep autotuning results in Triton's on-disk cache: later processes on the machine reuse the first
one's choice (same configs, hence the same bits, and no tuning in their warm-up).
OOMB_TRITON_AUTOTUNE_CACHE=0 tunes afresh in every process."""

_LOG2E = tl.constexpr(1.4426950408889634)  # = 1 / ln(2): softmax runs in base 2 (exp2 is native)
_LN2 = tl.constexpr(0.6931471805599453)  # = ln(2): turns the base-2 log-sum-exp into natural log
_TWO_LOG2E = tl.constexpr(2.8853900817779268)  # = 2 / ln(2): e^(2x) = 2^(x * 2 / ln 2), for tanh

MIN_BLOCK_D = 16
"""tl.dot needs every tile dimension >= 16: smaller head dims are padded and masked."""
MAX_HEAD_DIM = 256
"""Beyond this the per-program tiles (BLOCK_M x BLOCK_D accumulators) no longer fit registers."""
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Integer arguments that change with every chunk (lengths, and strides of the page table and the
# (B, Hq, Lq) statistics): not specialized, so that a new chunk does not compile a new kernel.
_DYNAMIC_INTS = ["num_kv_heads", "seq_len", "query_start", "key_lo", "key_hi", "stride_tb", "stride_lb", "stride_lh"]
_DOC_DYNAMIC_INTS = _DYNAMIC_INTS + ["stride_db"]  # the documents' row stride is the step's length
_TUNING_KEY = ["HEAD_DIM", "PAGE_SIZE", "GROUP"]  # pointer dtypes are added to the key by Triton

# --------------------------------------------------------------------------------------------
# Tuning configs. Under the interpreter autotune cannot benchmark: exactly one config, with small
# tiles so that tiny test shapes still run several tiles and both page paths.
# --------------------------------------------------------------------------------------------
_INTERPRET_BLOCK_M = 32  # rows (query x group head) per tile in CPU tests
_INTERPRET_BLOCK_N = 16  # keys per tile in CPU tests: P = 16, 32 take the one-page path, P = 8, 12 not


def _configs(gpu: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) tuples -> Configs; one small config when interpreting."""
    if INTERPRET:
        gpu = [(_INTERPRET_BLOCK_M, _INTERPRET_BLOCK_N, 4, 1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in gpu]


_SHARED_MEMORY_BYTES = 232448
"""Shared memory one program may use on the H100/H200 (Triton's limit in its out-of-resource error)."""


def _prune_for_dtype(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """float32 inputs: one config, no search. Tuning the float32 kernels compiled and timed every
    config for minutes (113 s in the first step of a 2-layer 8K model on the H200; 15.7 s with this
    pruning). The config: the first whose staged tiles, num_stages x (BLOCK_M + BLOCK_N) x BLOCK_D
    float32, fit shared memory (the first dK/dV config needs 295,936 bytes at head_dim 128: out of
    resources), else the smallest. bf16/fp16 keep the whole list (the tuning key includes the dtypes), or
    its first config with OOMB_TRITON_AUTOTUNE=0 (float32 there too: the first that fits, as the pin
    must compile)."""
    q = named_args.get("q_ptr")
    if getattr(q, "dtype", None) != torch.float32:
        return configs if AUTOTUNE else configs[:1]
    block_d = kwargs.get("BLOCK_D") or named_args.get("BLOCK_D") or MAX_HEAD_DIM

    def staged_bytes(config: triton.Config) -> int:
        return config.num_stages * (config.kwargs["BLOCK_M"] + config.kwargs["BLOCK_N"]) * block_d * 4

    fitting = [c for c in configs if staged_bytes(c) <= _SHARED_MEMORY_BYTES]
    return fitting[:1] or [min(configs, key=staged_bytes)]


# Chosen for H100/H200 (wgmma wants >= 64 rows per warpgroup); the autotuner picks per shape key.
_FWD_CONFIGS = _configs([(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3)])
_DQ_CONFIGS = _configs([(128, 64, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3)])
# dK/dV: BLOCK_N keys stay resident (two BLOCK_N x BLOCK_D float32 accumulators), BLOCK_M rows stream.
_DKDV_CONFIGS = _configs([(64, 128, 8, 3), (32, 128, 4, 4), (64, 64, 4, 3)])

WIDE_HEAD_DIM = 128
"""Above this (Gemma's head dim 256) the tiles above outgrow the registers: ptxas for sm_90a spills, per
thread, 2.4 KB in the best forward config at D = 256 (bf16), 3.6 KB in dQ's and 9.0 KB in dK/dV's
(128 keys x 64 rows: two 128 x 256 float32 accumulators). The _WIDE lists, tried first for such head
dims (and the only ones a float32 kernel's staged tiles fit), spill 28 B / 0.8 KB / 0.9 KB there.
Chosen from those compile-time counts; not yet measured on a GPU."""


def _wide_configs(gpu: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """Configs added in front of a kernel's list for head dims above WIDE_HEAD_DIM (none when
    interpreting: one config there)."""
    return [] if INTERPRET else _configs(gpu)


def _pruner(wide: list[triton.Config]) -> dict:
    """prune_configs_by of a kernel: ``wide`` first for head dims above WIDE_HEAD_DIM (alone when
    OOMB_TRITON_AUTOTUNE=0 pins the first config), then the float32 pruning of _prune_for_dtype.
    Head dims up to WIDE_HEAD_DIM see exactly the kernel's own list (the tuning key holds HEAD_DIM)."""

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        block_d = kwargs.get("BLOCK_D") or named_args.get("BLOCK_D") or MAX_HEAD_DIM
        if block_d > WIDE_HEAD_DIM and wide:
            configs = wide + configs if AUTOTUNE else wide
        return _prune_for_dtype(configs, named_args, **kwargs)

    return {"early_config_prune": prune}


_FWD_PRUNE = _pruner(_wide_configs([(64, 32, 8, 2), (128, 32, 8, 2), (64, 64, 8, 2)]))
_DQ_PRUNE = _pruner(_wide_configs([(64, 32, 8, 2), (32, 32, 4, 2)]))
_DKDV_PRUNE = _pruner(_wide_configs([(64, 32, 8, 2), (32, 64, 8, 2)]))
_DELTA_BLOCK_M = 64  # rows per program of the elementwise rowsum(dO * O)


# --------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------
@triton.jit
def _key_offsets(
    table_row_ptr, start_n, offs_n, key_ok, stride_page, stride_slot,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KEYS: tl.constexpr, tile_ok=True,
    GUARD: tl.constexpr = False,
):
    """int64 (BLOCK_N,) offsets into a pool of keys start_n + offs_n of one sequence.

    A one-page tile always holds a key the caller reads, so its page id is one the caller may read."""
    if PAGE_SIZE % BLOCK_N == 0:
        # The tile lies in one page (start_n is a multiple of BLOCK_N): one page-id load.
        if GUARD:  # a look-up ahead of a loop that may run no tile: read nothing then
            page = tl.load(table_row_ptr + start_n // PAGE_SIZE, mask=tile_ok, other=0).to(tl.int64)
        else:
            page = tl.load(table_row_ptr + start_n // PAGE_SIZE).to(tl.int64)
        slot = (start_n % PAGE_SIZE + offs_n).to(tl.int64)
    else:
        keys = start_n + offs_n
        if GUARD:
            page = tl.load(table_row_ptr + keys // PAGE_SIZE, mask=key_ok & tile_ok, other=0).to(tl.int64)
        elif MASK_KEYS:  # keys past the end or outside the window: their table entries may be garbage
            page = tl.load(table_row_ptr + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
        else:
            page = tl.load(table_row_ptr + keys // PAGE_SIZE).to(tl.int64)
        slot = (keys % PAGE_SIZE).to(tl.int64)
    return page * stride_page + slot * stride_slot


@triton.jit
def _load_tile(ptrs, row_ok, d_ok, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a (rows, BLOCK_D) tile; masked entries read as 0 (never NaN from unused page slots)."""
    if MASK_ROWS:
        if EVEN_D:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    return x


@triton.jit
def _load_kv(k_base, v_base, k_rows, v_rows, offs_d, stride_kd, stride_vd, key_ok, d_ok,
             MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr, UPCAST: tl.constexpr):
    """A key tile's K and V (BLOCK_N, BLOCK_D) at pool offsets k_rows / v_rows (float32 under UPCAST)."""
    k = _load_tile(k_base + k_rows[:, None] + offs_d[None, :] * stride_kd, key_ok, d_ok, MASK_ROWS, EVEN_D)
    v = _load_tile(v_base + v_rows[:, None] + offs_d[None, :] * stride_vd, key_ok, d_ok, MASK_ROWS, EVEN_D)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _tanh(x):
    """tanh(x) = 1 - 2 / (e^(2x) + 1) in float32, from exp2: Triton has no tanh that also runs in the
    interpreter (libdevice's does not). Saturates to +-1 for large |x| (2 / inf = 0, never inf / inf);
    absolute error about 1e-7, of the order of the rounding of the scores themselves."""
    return 1.0 - 2.0 / (tl.exp2(x * _TWO_LOG2E) + 1.0)


@triton.jit
def _qk_scale(scale, SOFTCAP: tl.constexpr):
    """What the inner loops multiply q.k by: base-2 logits scale * log2(e) * q.k, or with logit
    softcapping (SOFTCAP = c > 0) the tanh's argument scale * q.k / c, which they cap (_cap)."""
    if SOFTCAP > 0:
        qk_scale = scale / SOFTCAP
    else:
        qk_scale = scale * _LOG2E
    return qk_scale


@triton.jit
def _cap(x, SOFTCAP: tl.constexpr):
    """(base-2 softcapped logits c * log2(e) * tanh(x), tanh(x)) for x = scale * q.k / c (Gemma 2: the
    score s = scale * q.k becomes c * tanh(s / c)). The backward multiplies dS by 1 - tanh(x)^2."""
    t = _tanh(x)
    return t * (SOFTCAP * _LOG2E), t


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------
@triton.jit
def _tile_keys(start_n, offs_n, key_lo, key_hi, doc_start, WINDOW: tl.constexpr, DOCS: tl.constexpr):
    """A key tile's key indices and which of them may be read: keys < key_hi, with WINDOW also >= key_lo,
    with DOCS also >= the tile's earliest row document start (keys before it are not even loaded)."""
    keys = start_n + offs_n
    if WINDOW:
        key_ok = (keys >= key_lo) & (keys < key_hi)
    else:
        key_ok = keys < key_hi
    if DOCS:
        key_ok = key_ok & (keys >= tl.min(doc_start, 0))
    return keys, key_ok


@triton.jit
def _kv_rows(table_row_ptr, start_n, offs_n, key_ok, stride_kp, stride_kt, stride_vp, stride_vt,
             PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, tile_ok=True,
             GUARD: tl.constexpr = False):
    """The pool offsets of key tile start_n's keys and values (_key_offsets for both; key_ok: _tile_keys')."""
    k_rows = _key_offsets(table_row_ptr, start_n, offs_n, key_ok, stride_kp, stride_kt, PAGE_SIZE, BLOCK_N, MASKED,
                          tile_ok, GUARD)
    v_rows = _key_offsets(table_row_ptr, start_n, offs_n, key_ok, stride_vp, stride_vt, PAGE_SIZE, BLOCK_N, MASKED,
                          tile_ok, GUARD)
    return k_rows, v_rows


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, q_pos, k_base, v_base, table_row_ptr, lo, hi, key_hi, qk_scale,
    stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd,
    offs_n, offs_d, d_ok,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, key_lo=0, WINDOW: tl.constexpr = False,
    doc_start=0, DOCS: tl.constexpr = False, SOFTCAP: tl.constexpr = 0.0,
):
    """Online softmax over key tiles [lo, hi); MASKED tiles apply causality and keys < key_hi (the
    key count), with WINDOW also keys >= key_lo, and with DOCS keys >= doc_start (per row). SOFTCAP
    (c > 0; 0: off): qk_scale is _qk_scale's and the logits are capped before the softmax."""
    # Each tile's page rows are looked up one iteration ahead: its K/V loads then depend on no load of
    # their own iteration, and Triton keeps them in flight while the previous tile computes.
    last = lo + tl.maximum(hi - lo - 1, 0) // BLOCK_N * BLOCK_N  # the last tile (lo itself if none)
    _, next_ok = _tile_keys(lo, offs_n, key_lo, key_hi, doc_start, WINDOW, DOCS)
    next_k, next_v = _kv_rows(table_row_ptr, lo, offs_n, next_ok, stride_kp, stride_kt, stride_vp, stride_vt,
                              PAGE_SIZE, BLOCK_N, MASKED, lo < hi, True)
    for start_n in range(lo, hi, BLOCK_N):
        keys, key_ok = _tile_keys(start_n, offs_n, key_lo, key_hi, doc_start, WINDOW, DOCS)
        k_rows, v_rows = next_k, next_v
        ahead = tl.minimum(start_n + BLOCK_N, last)
        _, next_ok = _tile_keys(ahead, offs_n, key_lo, key_hi, doc_start, WINDOW, DOCS)
        next_k, next_v = _kv_rows(table_row_ptr, ahead, offs_n, next_ok, stride_kp, stride_kt, stride_vp,
                                  stride_vt, PAGE_SIZE, BLOCK_N, MASKED)
        k, v = _load_kv(k_base, v_base, k_rows, v_rows, offs_d, stride_kd, stride_vd, key_ok, d_ok, MASKED,
                        EVEN_D, UPCAST)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (M, N) base-2 logits
        if SOFTCAP > 0:
            qk, _tanh = _cap(qk, SOFTCAP)  # (not `_`: the loop carries it as a key tile)
        if MASKED:
            if WINDOW:
                visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
            else:
                visible = keys[None, :] <= q_pos[:, None]
            if DOCS:
                visible = visible & (keys[None, :] >= doc_start[:, None])
            qk = tl.where(visible, qk, float("-inf"))
        # The first tile visited holds a key every row sees (key 0, or a window's first key), so
        # m_new is finite from then on (not with DOCS: see below).
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = m_new
        if MASKED:
            if WINDOW:
                # Guard anyway in window edge tiles, which may hide every key of some rows: a row
                # with m_new = -inf gets p = alpha = 0 instead of exp2(-inf + inf) = NaN.
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            elif DOCS:  # a row whose document starts after every key so far: the same guard
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_documents(
    acc, l_i, m_i, q, q_pos, k_base, v_base, table_row_ptr, doc_row_ptr, first_q, last_q, num_keys,
    key_lo, key_hi, qk_scale, stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd,
    offs_n, offs_d, d_ok,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr = 0.0,
):
    """The forward's traversal of a row tile with packed documents: key tiles [start, end), masked up
    to mid (the window's edge tile and the tiles holding some row's document start), unmasked over
    [mid, full_end) (inside the window, in every row's document, before the diagonal), masked after.
    Returns (out, l, m); a row that saw no key of the window gets out 0 (and lse -inf from l = 0)."""
    row_doc = tl.load(doc_row_ptr + q_pos)  # document start of every row (non-decreasing in q_pos)
    start = tl.min(row_doc, 0) // BLOCK_N * BLOCK_N
    if WINDOW:
        start = tl.maximum(key_lo // BLOCK_N * BLOCK_N, start)
        full_lo = (key_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        full_end = tl.maximum(full_lo, tl.minimum(key_hi, first_q + 1) // BLOCK_N * BLOCK_N)
        end = tl.minimum(key_hi, last_q + 1)
        key_end = key_hi
    else:
        full_lo = 0
        full_end = (first_q + 1) // BLOCK_N * BLOCK_N
        end = last_q + 1
        key_end = num_keys
    mid = tl.maximum(full_lo, (tl.max(row_doc, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N)
    unmasked_end = tl.maximum(mid, full_end)
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, q_pos, k_base, v_base, table_row_ptr, start, tl.minimum(mid, end), key_end, qk_scale,
        stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd, offs_n, offs_d, d_ok,
        PAGE_SIZE, BLOCK_N, EVEN_D, True, UPCAST, DOT_PRECISION, key_lo, WINDOW, row_doc, True, SOFTCAP=SOFTCAP,
    )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, q_pos, k_base, v_base, table_row_ptr, mid, unmasked_end, key_end, qk_scale,
        stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd, offs_n, offs_d, d_ok,
        PAGE_SIZE, BLOCK_N, EVEN_D, False, UPCAST, DOT_PRECISION, SOFTCAP=SOFTCAP,
    )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, q_pos, k_base, v_base, table_row_ptr, unmasked_end, end, key_end, qk_scale,
        stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd, offs_n, offs_d, d_ok,
        PAGE_SIZE, BLOCK_N, EVEN_D, True, UPCAST, DOT_PRECISION, key_lo, WINDOW, row_doc, True, SOFTCAP=SOFTCAP,
    )
    return acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None], l_i, m_i


@triton.autotune(configs=_FWD_CONFIGS, key=_TUNING_KEY, cache_results=CACHE_TUNING,
                 prune_configs_by=_FWD_PRUNE)
@triton.jit(do_not_specialize=_DOC_DYNAMIC_INTS)
def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, out_ptr, lse_ptr, doc_start_ptr,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kp, stride_kh, stride_kt, stride_kd,
    stride_vp, stride_vh, stride_vt, stride_vd,
    stride_tb,
    stride_ob, stride_oh, stride_ol, stride_od,
    stride_lb, stride_lh, stride_ll,
    stride_db,
    num_kv_heads, seq_len, query_start, key_lo, key_hi, scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    WINDOW: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, DOCS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr = 0.0,
):
    """Grid (row tiles, B * Hkv): one tile of packed (query, group head) rows against all its keys
    (with WINDOW: its keys in [key_lo, key_hi); with DOCS: only keys of each row's document; with
    SOFTCAP = c > 0: scores c * tanh(scale * q.k / c))."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_kv_heads).to(tl.int64)
    kvh = pid_bh % num_kv_heads
    num_rows = seq_len * GROUP
    num_keys = query_start + seq_len

    first_row = pid_m * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    qi = tl.minimum(rows // GROUP, seq_len - 1)  # padding rows borrow the last query; never stored
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
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys [0, full_end) are visible to every row of the tile; [full_end, last_q] is the diagonal.
    first_q = query_start + first_row // GROUP
    last_q = query_start + tl.minimum((first_row + BLOCK_M - 1) // GROUP, seq_len - 1)
    if DOCS:
        out, l_i, m_i = _fwd_documents(
            acc, l_i, m_i, q, q_pos, k_base, v_base, table_row_ptr, doc_start_ptr + b * stride_db,
            first_q, last_q, num_keys, key_lo, key_hi, qk_scale,
            stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd, offs_n, offs_d, d_ok,
            PAGE_SIZE, BLOCK_N, EVEN_D, UPCAST, DOT_PRECISION, WINDOW, SOFTCAP,
        )
    else:
        # [full_lo, full_end): tiles inside the window (if any) and visible to every row. With WINDOW a tile
        # straddling key_lo runs masked first: it holds key_lo, which every row sees. Tiles from full_end to
        # the last key a row may see (the window's end or the diagonal) run masked.
        if WINDOW:
            window_lo = key_lo // BLOCK_N * BLOCK_N
            full_lo = (key_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N
            full_end = tl.maximum(full_lo, tl.minimum(key_hi, first_q + 1) // BLOCK_N * BLOCK_N)
            end = tl.minimum(key_hi, last_q + 1)
            key_end = key_hi
        else:
            window_lo = 0
            full_lo = 0
            full_end = (first_q + 1) // BLOCK_N * BLOCK_N
            end = last_q + 1
            key_end = num_keys
        if WINDOW:
            acc, l_i, m_i = _fwd_inner(
                acc, l_i, m_i, q, q_pos, k_base, v_base, table_row_ptr, window_lo, full_lo,
                key_hi, qk_scale, stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd,
                offs_n, offs_d, d_ok, PAGE_SIZE, BLOCK_N, EVEN_D, True, UPCAST, DOT_PRECISION, key_lo, True,
                SOFTCAP=SOFTCAP,
            )
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, q_pos, k_base, v_base, table_row_ptr, full_lo, full_end, key_end, qk_scale,
            stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd, offs_n, offs_d, d_ok,
            PAGE_SIZE, BLOCK_N, EVEN_D, False, UPCAST, DOT_PRECISION, SOFTCAP=SOFTCAP,
        )
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, q_pos, k_base, v_base, table_row_ptr, full_end, end, key_end, qk_scale,
            stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd, offs_n, offs_d, d_ok,
            PAGE_SIZE, BLOCK_N, EVEN_D, True, UPCAST, DOT_PRECISION, key_lo, WINDOW, SOFTCAP=SOFTCAP,
        )

        out = acc / l_i[:, None]
    o_rows = b * stride_ob + head * stride_oh + qi.to(tl.int64) * stride_ol
    o_ptrs = out_ptr + o_rows[:, None] + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    lse = (m_i + tl.log2(l_i)) * _LN2
    tl.store(lse_ptr + b * stride_lb + head * stride_lh + qi.to(tl.int64) * stride_ll, lse, mask=row_ok)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------
@triton.jit
def _delta_kernel(
    out_ptr, dout_ptr, delta_ptr,
    stride_ob, stride_oh, stride_ol, stride_od,
    stride_gb, stride_gh, stride_gl, stride_gd,
    num_heads, seq_len,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Grid (query tiles, B * Hq): delta = rowsum(dO * O) in float32, written contiguous (B, Hq, Lq)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < seq_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = offs_m.to(tl.int64)
    o = tl.load(out_ptr + b * stride_ob + h * stride_oh + rows[:, None] * stride_ol
                + offs_d[None, :] * stride_od, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(dout_ptr + b * stride_gb + h * stride_gh + rows[:, None] * stride_gl
                 + offs_d[None, :] * stride_gd, mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + pid_bh * seq_len + rows, tl.sum(o * do, 1), mask=offs_m < seq_len)


@triton.jit
def _dkdv_inner(
    dk, dv, k, v, keys, q_ptr, dout_ptr, lse_ptr, delta_ptr, b, kvh, lo, hi,
    num_rows, seq_len, query_start, qk_scale,
    stride_qb, stride_qh, stride_ql, stride_qd, stride_gb, stride_gh, stride_gl, stride_gd,
    stride_lb, stride_lh, stride_ll, offs_d, d_ok,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    doc_row_ptr=0, DOCS: tl.constexpr = False, SOFTCAP: tl.constexpr = 0.0,
):
    """Accumulate dK, dV of one key tile over row tiles [lo, hi), in order (deterministic). With DOCS
    (MASKED tiles) a row also hides the keys before its document start, read at doc_row_ptr + position.
    SOFTCAP: as _fwd_inner; dS is multiplied by the cap's derivative 1 - tanh^2."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        row_ok = rows < num_rows
        qi = tl.minimum(rows // GROUP, seq_len - 1).to(tl.int64)
        head = (kvh * GROUP + rows % GROUP).to(tl.int64)
        q_rows = b * stride_qb + head * stride_qh + qi * stride_ql
        g_rows = b * stride_gb + head * stride_gh + qi * stride_gl
        q = _load_tile(q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd, row_ok, d_ok, True, EVEN_D)
        do = _load_tile(dout_ptr + g_rows[:, None] + offs_d[None, :] * stride_gd, row_ok, d_ok, True, EVEN_D)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        stat = b * stride_lb + head * stride_lh + qi * stride_ll
        # Padding rows get lse = +inf, hence p = 0: they add nothing.
        lse2 = tl.load(lse_ptr + stat, mask=row_ok, other=float("inf")) * _LOG2E
        delta = tl.load(delta_ptr + stat, mask=row_ok, other=0.0)
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # (N, M)
        if SOFTCAP > 0:
            qk_t, tanh_t = _cap(qk_t, SOFTCAP)
        p_t = tl.exp2(qk_t - lse2[None, :])
        if MASKED:
            visible_t = keys[:, None] <= (query_start + qi)[None, :]
            if DOCS:
                row_doc = tl.load(doc_row_ptr + query_start + qi)
                visible_t = visible_t & (keys[:, None] >= row_doc[None, :])
            p_t = tl.where(visible_t, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (N, M)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP > 0:
            ds_t = ds_t * (1.0 - tanh_t * tanh_t)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.autotune(configs=_DKDV_CONFIGS, key=_TUNING_KEY, restore_value=["dk_ptr", "dv_ptr"],
                 cache_results=CACHE_TUNING, prune_configs_by=_DKDV_PRUNE)
@triton.jit(do_not_specialize=_DYNAMIC_INTS)
def _dkdv_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, dout_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kp, stride_kh, stride_kt, stride_kd,
    stride_vp, stride_vh, stride_vt, stride_vd,
    stride_tb,
    stride_gb, stride_gh, stride_gl, stride_gd,
    stride_lb, stride_lh, stride_ll,
    stride_dkp, stride_dkh, stride_dkt, stride_dkd,
    stride_dvp, stride_dvh, stride_dvt, stride_dvd,
    num_kv_heads, seq_len, query_start, scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    key_lo=0, key_hi=2**31 - 1,
    doc_start_ptr=0, doc_end_ptr=0, stride_db=0, DOCS: tl.constexpr = False, SOFTCAP: tl.constexpr = 0.0,
):
    """Grid (key tiles of [key_lo, key_hi), B * Hkv): dK, dV of one key tile from every row that sees
    it, added once. key_lo, key_hi come last, with defaults meaning all keys (key_hi is clipped to the
    key count), so that triton_sparse's launch of this kernel (without them) keeps working; so do the
    packed documents' arguments (DOCS: only rows of the documents reaching the tile)."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_kv_heads).to(tl.int64)
    kvh = pid_bh % num_kv_heads
    num_rows = seq_len * GROUP
    num_keys = query_start + seq_len
    key_hi = tl.minimum(key_hi, num_keys)

    start_n = (key_lo // BLOCK_N + pid_n) * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    keys = start_n + offs_n
    # Keys outside the window are loaded as 0 and never stored: their table entries are not read.
    key_ok = (keys >= key_lo) & (keys < key_hi)
    if DOCS:  # nor are keys of documents that ended before the chunk's first query (no row sees them)
        key_ok = key_ok & (keys >= tl.load(doc_start_ptr + b * stride_db + query_start))
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    table_row_ptr = table_ptr + b * stride_tb
    kv64 = kvh.to(tl.int64)

    k_rows = _key_offsets(table_row_ptr, start_n, offs_n, key_ok, stride_kp, stride_kt,
                          PAGE_SIZE, BLOCK_N, True)
    v_rows = _key_offsets(table_row_ptr, start_n, offs_n, key_ok, stride_vp, stride_vt,
                          PAGE_SIZE, BLOCK_N, True)
    k = _load_tile(k_ptr + kv64 * stride_kh + k_rows[:, None] + offs_d[None, :] * stride_kd,
                   key_ok, d_ok, True, EVEN_D)
    v = _load_tile(v_ptr + kv64 * stride_vh + v_rows[:, None] + offs_d[None, :] * stride_vd,
                   key_ok, d_ok, True, EVEN_D)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk_scale = _qk_scale(scale, SOFTCAP)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Rows r >= row_lo see part of the tile (query_start + r // G >= start_n); rows >= row_mid see
    # all of it (query_start + r // G >= start_n + BLOCK_N - 1). Earlier rows see none of it. A
    # history window's keys precede every query, so every row sees all of them: no masked rows
    # (the tile's keys outside the window are never stored, whatever rows compute for them).
    row_lo = tl.maximum(start_n - query_start, 0) * GROUP // BLOCK_M * BLOCK_M
    row_full = tl.where(key_hi <= query_start, 0, tl.maximum(start_n + BLOCK_N - 1 - query_start, 0) * GROUP)
    row_mid = tl.minimum((row_full + BLOCK_M - 1) // BLOCK_M * BLOCK_M, num_rows)
    if DOCS:
        # Rows see a key j only while their document lasts (t < end[j]): rows from row_hi on see none
        # of the tile; rows before row_doc_full have documents holding the tile's first key.
        doc_end_row = doc_end_ptr + b * stride_db
        last_key = tl.minimum(start_n + BLOCK_N - 1, key_hi - 1)
        row_hi = tl.minimum(tl.maximum(tl.load(doc_end_row + last_key) - query_start, 0), seq_len) * GROUP
        first_key = tl.maximum(start_n, key_lo)
        row_doc_full = (tl.minimum(tl.maximum(tl.load(doc_end_row + first_key) - query_start, 0), seq_len)
                        * GROUP // BLOCK_M * BLOCK_M)
        unmasked_end = tl.maximum(row_mid, row_doc_full)
        doc_row_ptr = doc_start_ptr + b * stride_db
        dk, dv = _dkdv_inner(
            dk, dv, k, v, keys, q_ptr, dout_ptr, lse_ptr, delta_ptr, b, kvh, row_lo, tl.minimum(row_mid, row_hi),
            num_rows, seq_len, query_start, qk_scale,
            stride_qb, stride_qh, stride_ql, stride_qd, stride_gb, stride_gh, stride_gl, stride_gd,
            stride_lb, stride_lh, stride_ll, offs_d, d_ok,
            GROUP, BLOCK_M, EVEN_D, True, UPCAST, DOT_PRECISION, doc_row_ptr, True, SOFTCAP=SOFTCAP,
        )
        dk, dv = _dkdv_inner(
            dk, dv, k, v, keys, q_ptr, dout_ptr, lse_ptr, delta_ptr, b, kvh, row_mid, unmasked_end,
            num_rows, seq_len, query_start, qk_scale,
            stride_qb, stride_qh, stride_ql, stride_qd, stride_gb, stride_gh, stride_gl, stride_gd,
            stride_lb, stride_lh, stride_ll, offs_d, d_ok,
            GROUP, BLOCK_M, EVEN_D, False, UPCAST, DOT_PRECISION, SOFTCAP=SOFTCAP,
        )
        dk, dv = _dkdv_inner(
            dk, dv, k, v, keys, q_ptr, dout_ptr, lse_ptr, delta_ptr, b, kvh, unmasked_end, row_hi,
            num_rows, seq_len, query_start, qk_scale,
            stride_qb, stride_qh, stride_ql, stride_qd, stride_gb, stride_gh, stride_gl, stride_gd,
            stride_lb, stride_lh, stride_ll, offs_d, d_ok,
            GROUP, BLOCK_M, EVEN_D, True, UPCAST, DOT_PRECISION, doc_row_ptr, True, SOFTCAP=SOFTCAP,
        )
    else:
        dk, dv = _dkdv_inner(
            dk, dv, k, v, keys, q_ptr, dout_ptr, lse_ptr, delta_ptr, b, kvh, row_lo, row_mid,
            num_rows, seq_len, query_start, qk_scale,
            stride_qb, stride_qh, stride_ql, stride_qd, stride_gb, stride_gh, stride_gl, stride_gd,
            stride_lb, stride_lh, stride_ll, offs_d, d_ok,
            GROUP, BLOCK_M, EVEN_D, True, UPCAST, DOT_PRECISION, SOFTCAP=SOFTCAP,
        )
        dk, dv = _dkdv_inner(
            dk, dv, k, v, keys, q_ptr, dout_ptr, lse_ptr, delta_ptr, b, kvh, row_mid, num_rows,
            num_rows, seq_len, query_start, qk_scale,
            stride_qb, stride_qh, stride_ql, stride_qd, stride_gb, stride_gh, stride_gl, stride_gd,
            stride_lb, stride_lh, stride_ll, offs_d, d_ok,
            GROUP, BLOCK_M, EVEN_D, False, UPCAST, DOT_PRECISION, SOFTCAP=SOFTCAP,
        )
    dk = dk * scale  # scores are scale * q.k

    # This program is the only one touching these slots in the launch: plain read-modify-write.
    tile_mask = key_ok[:, None] & d_ok[None, :]
    dk_rows = _key_offsets(table_row_ptr, start_n, offs_n, key_ok, stride_dkp, stride_dkt,
                           PAGE_SIZE, BLOCK_N, True)
    dk_ptrs = dk_ptr + kv64 * stride_dkh + dk_rows[:, None] + offs_d[None, :] * stride_dkd
    old = tl.load(dk_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
    tl.store(dk_ptrs, (old + dk).to(dk_ptr.dtype.element_ty), mask=tile_mask)
    dv_rows = _key_offsets(table_row_ptr, start_n, offs_n, key_ok, stride_dvp, stride_dvt,
                           PAGE_SIZE, BLOCK_N, True)
    dv_ptrs = dv_ptr + kv64 * stride_dvh + dv_rows[:, None] + offs_d[None, :] * stride_dvd
    old = tl.load(dv_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
    tl.store(dv_ptrs, (old + dv).to(dv_ptr.dtype.element_ty), mask=tile_mask)


@triton.jit
def _dq_inner(
    dq, q, do, lse2, delta, q_pos, k_base, v_base, table_row_ptr, lo, hi, key_hi, qk_scale,
    stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd,
    offs_n, offs_d, d_ok,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, key_lo=0, WINDOW: tl.constexpr = False,
    doc_start=0, DOCS: tl.constexpr = False, SOFTCAP: tl.constexpr = 0.0,
):
    """Accumulate dQ of one row tile over key tiles [lo, hi); masks and SOFTCAP as in _fwd_inner, dS
    times the cap's derivative as in _dkdv_inner."""
    # The page rows are looked up in the tile's own iteration: looked up a tile ahead (as _fwd_inner does)
    # dQ took 1.19x as long on the H200 (7.47 vs 6.29 ms at 32K of history, benchmarks/attention.py).
    for start_n in range(lo, hi, BLOCK_N):
        keys, key_ok = _tile_keys(start_n, offs_n, key_lo, key_hi, doc_start, WINDOW, DOCS)
        k_rows, v_rows = _kv_rows(table_row_ptr, start_n, offs_n, key_ok, stride_kp, stride_kt, stride_vp,
                                  stride_vt, PAGE_SIZE, BLOCK_N, MASKED)
        k, v = _load_kv(k_base, v_base, k_rows, v_rows, offs_d, stride_kd, stride_vd, key_ok, d_ok, MASKED,
                        EVEN_D, UPCAST)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP > 0:
            qk, tanh = _cap(qk, SOFTCAP)
        p = tl.exp2(qk - lse2[:, None])
        if MASKED:
            if WINDOW:
                visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
            else:
                visible = keys[None, :] <= q_pos[:, None]
            if DOCS:
                visible = visible & (keys[None, :] >= doc_start[:, None])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP > 0:
            ds = ds * (1.0 - tanh * tanh)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


# restore_value: with ACCUMULATE_DQ, benchmarking configs would add into the caller's accumulator.
@triton.autotune(configs=_DQ_CONFIGS, key=_TUNING_KEY, restore_value=["dq_ptr"],
                 cache_results=CACHE_TUNING, prune_configs_by=_DQ_PRUNE)
@triton.jit(do_not_specialize=_DOC_DYNAMIC_INTS)
def _dq_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr, doc_start_ptr,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kp, stride_kh, stride_kt, stride_kd,
    stride_vp, stride_vh, stride_vt, stride_vd,
    stride_tb,
    stride_gb, stride_gh, stride_gl, stride_gd,
    stride_lb, stride_lh, stride_ll,
    stride_dqb, stride_dqh, stride_dql, stride_dqd,
    stride_db,
    num_kv_heads, seq_len, query_start, key_lo, key_hi, scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    WINDOW: tl.constexpr, ACCUMULATE_DQ: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOCS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr = 0.0,
):
    """Grid (row tiles, B * Hkv): dQ of one tile of packed rows, same traversal as the forward.
    ACCUMULATE_DQ: add into a float32 dq (one window's share of a streamed backward) instead of
    storing in q's dtype; each element has one writer per launch, so no atomics."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_kv_heads).to(tl.int64)
    kvh = pid_bh % num_kv_heads
    num_rows = seq_len * GROUP
    num_keys = query_start + seq_len

    first_row = pid_m * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    qi = tl.minimum(rows // GROUP, seq_len - 1)
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
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    first_q = query_start + first_row // GROUP
    last_q = query_start + tl.minimum((first_row + BLOCK_M - 1) // GROUP, seq_len - 1)
    if DOCS:  # the forward's traversal with documents (_fwd_documents)
        row_doc = tl.load(doc_start_ptr + b * stride_db + q_pos)
        start = tl.min(row_doc, 0) // BLOCK_N * BLOCK_N
        if WINDOW:
            start = tl.maximum(key_lo // BLOCK_N * BLOCK_N, start)
            full_lo = (key_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N
            full_end = tl.maximum(full_lo, tl.minimum(key_hi, first_q + 1) // BLOCK_N * BLOCK_N)
            end = tl.minimum(key_hi, last_q + 1)
            key_end = key_hi
        else:
            full_lo = 0
            full_end = (first_q + 1) // BLOCK_N * BLOCK_N
            end = last_q + 1
            key_end = num_keys
        mid = tl.maximum(full_lo, (tl.max(row_doc, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N)
        unmasked_end = tl.maximum(mid, full_end)
        dq = _dq_inner(
            dq, q, do, lse2, delta, q_pos, k_base, v_base, table_row_ptr, start, tl.minimum(mid, end), key_end,
            qk_scale, stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd, offs_n, offs_d, d_ok,
            PAGE_SIZE, BLOCK_N, EVEN_D, True, UPCAST, DOT_PRECISION, key_lo, WINDOW, row_doc, True, SOFTCAP=SOFTCAP,
        )
        dq = _dq_inner(
            dq, q, do, lse2, delta, q_pos, k_base, v_base, table_row_ptr, mid, unmasked_end, key_end,
            qk_scale, stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd, offs_n, offs_d, d_ok,
            PAGE_SIZE, BLOCK_N, EVEN_D, False, UPCAST, DOT_PRECISION, SOFTCAP=SOFTCAP,
        )
        dq = _dq_inner(
            dq, q, do, lse2, delta, q_pos, k_base, v_base, table_row_ptr, unmasked_end, end, key_end,
            qk_scale, stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd, offs_n, offs_d, d_ok,
            PAGE_SIZE, BLOCK_N, EVEN_D, True, UPCAST, DOT_PRECISION, key_lo, WINDOW, row_doc, True, SOFTCAP=SOFTCAP,
        )
    else:
        if WINDOW:  # the forward's traversal of the window: masked edge tile, unmasked, masked
            full_lo = (key_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N
            dq = _dq_inner(
                dq, q, do, lse2, delta, q_pos, k_base, v_base, table_row_ptr, key_lo // BLOCK_N * BLOCK_N, full_lo,
                key_hi, qk_scale, stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd,
                offs_n, offs_d, d_ok, PAGE_SIZE, BLOCK_N, EVEN_D, True, UPCAST, DOT_PRECISION, key_lo, True,
                SOFTCAP=SOFTCAP,
            )
            full_end = tl.maximum(full_lo, tl.minimum(key_hi, first_q + 1) // BLOCK_N * BLOCK_N)
            end = tl.minimum(key_hi, last_q + 1)
            key_end = key_hi
        else:
            full_lo = 0
            full_end = (first_q + 1) // BLOCK_N * BLOCK_N
            end = last_q + 1
            key_end = num_keys
        dq = _dq_inner(
            dq, q, do, lse2, delta, q_pos, k_base, v_base, table_row_ptr, full_lo, full_end, key_end, qk_scale,
            stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd, offs_n, offs_d, d_ok,
            PAGE_SIZE, BLOCK_N, EVEN_D, False, UPCAST, DOT_PRECISION, SOFTCAP=SOFTCAP,
        )
        dq = _dq_inner(
            dq, q, do, lse2, delta, q_pos, k_base, v_base, table_row_ptr, full_end, end, key_end,
            qk_scale, stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd, offs_n, offs_d, d_ok,
            PAGE_SIZE, BLOCK_N, EVEN_D, True, UPCAST, DOT_PRECISION, key_lo, WINDOW, SOFTCAP=SOFTCAP,
        )
    dq = dq * scale
    dq_rows = b * stride_dqb + head * stride_dqh + qi.to(tl.int64) * stride_dql
    dq_ptrs = dq_ptr + dq_rows[:, None] + offs_d[None, :] * stride_dqd
    dq_mask = row_ok[:, None] & d_ok[None, :]
    if ACCUMULATE_DQ:
        dq += tl.load(dq_ptrs, mask=dq_mask, other=0.0)
    tl.store(dq_ptrs, dq.to(dq_ptr.dtype.element_ty), mask=dq_mask)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def _check_inputs(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor, query_start: int,
    key_range: tuple[int, int] | None = None,
) -> tuple[int, int, int, int, int, int]:
    """Validate the forward inputs (and the key window, if any); return (B, Hq, Lq, D, Hkv, P)."""
    if q.dim() != 4 or k_pool.dim() != 4:
        raise ValueError(f"q must be (B, Hq, Lq, D) and k_pool (num_pages, Hkv, P, D); "
                         f"got q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}")
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"v_pool {tuple(v_pool.shape)} must have k_pool's shape {tuple(k_pool.shape)}")
    B, Hq, Lq, D = q.shape
    _, Hkv, P, Dk = k_pool.shape
    if Dk != D:
        raise ValueError(f"head_dim of q ({D}) and of the pages ({Dk}) differ")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise NotImplementedError(f"head_dim={D} is not supported: the kernels take 1..{MAX_HEAD_DIM}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"{Hq} query heads must be a positive multiple of the {Hkv} KV heads")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q dtype {q.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise TypeError(f"q, k_pool, v_pool must share a dtype; "
                        f"got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}")
    if page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.shape[0] != B:
        raise ValueError(f"page_table must be int32 (B={B}, n_pages); got {page_table.dtype} "
                         f"{tuple(page_table.shape)}")
    if page_table.stride(1) != 1:
        raise ValueError("page_table rows must be contiguous (stride(1) == 1)")
    if isinstance(query_start, bool) or not isinstance(query_start, int) or query_start < 0:
        raise ValueError(f"query_start must be an int >= 0; got {query_start!r}")
    window = check_key_range(key_range, query_start, Lq, P)
    key_end = query_start + Lq if window is None else window[1]  # a window reads no entry past its end
    n_pages = -(-key_end // P)
    if page_table.shape[1] < n_pages:
        raise ValueError(f"page_table has {page_table.shape[1]} columns but {key_end} keys "
                         f"need {n_pages} pages of {P}")
    devices = {t.device for t in (q, k_pool, v_pool, page_table)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")
    if q.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before import)")
    return B, Hq, Lq, D, Hkv, P


def _document_args(documents: Documents | None, q: torch.Tensor, query_start: int, page_table: torch.Tensor):
    """(doc_start, doc_end, row stride) for the kernels: the step's (B, T) int32 document bounds, or the
    page table as an unread stand-in (DOCS off) so that every launch has the same argument list."""
    if documents is None:
        return page_table, page_table, 0
    B, _, Lq, _ = q.shape
    start, end = documents.start, documents.end
    if start.shape != end.shape or start.dim() != 2 or start.shape[0] != B or start.shape[1] < query_start + Lq:
        raise ValueError(f"documents must cover (B={B}, >= {query_start + Lq}) positions; "
                         f"got start {tuple(start.shape)}, end {tuple(end.shape)}")
    if start.dtype != torch.int32 or end.dtype != torch.int32 or start.device != q.device or end.device != q.device:
        raise ValueError(f"documents must be int32 on {q.device}; got {start.dtype}/{end.dtype} on {start.device}")
    if not (start.is_contiguous() and end.is_contiguous()):
        raise ValueError("documents' start and end must be contiguous")
    return start, end, start.stride(0)


def _meta(q: torch.Tensor, Hq: int, Hkv: int, D: int, P: int, softcap: float | None = None) -> dict:
    """Constexpr arguments shared by the attention kernels. ``SOFTCAP`` only when there is a cap: the
    launches without one are exactly those of before (the kernels' default 0.0 means off)."""
    meta = dict(
        GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_D=max(MIN_BLOCK_D, triton.next_power_of_2(D)), PAGE_SIZE=P,
        UPCAST=INTERPRET, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    if softcap is not None:
        meta["SOFTCAP"] = check_softcap(softcap)
    return meta


def check_softcap(softcap: float) -> float:
    """The cap as the kernels' constexpr: a finite float > 0 (each value compiles its own kernels, as a
    model has one: Gemma 2's attn_logit_softcapping is 50.0 in every layer)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < float("inf"):
        raise ValueError(f"softcap must be a finite number > 0 (or None: off); got {softcap!r}")
    return float(softcap)


def paged_attention_forward(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    query_start: int,
    scale: float,
    *,
    key_range: tuple[int, int] | None = None,
    out_dtype: torch.dtype | None = None,
    documents: Documents | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a chunk's queries over its paged history and itself (or one key window).

    Args:
        q: (B, Hq, Lq, D), any strides. k_pool, v_pool: (num_pages, Hkv, P, D), q's dtype.
        page_table: int32 (B, >= ceil((query_start + Lq) / P)). query_start: absolute position of
            query 0. scale: softmax scale.
        key_range: optional key window (lo, hi) (reference.py's contract); the table need only
            cover it, and only its entries are read. out_dtype: dtype of out (default q's); float32
            keeps a window's partial output unrounded until the merge.
        documents: packed documents of the step (oomb/documents.py): each query sees only keys of
            its own document; a row seeing no key of the window gets out 0 and lse -inf.
        softcap: logit softcapping c (Gemma 2): every score s = scale * q.k becomes c * tanh(s / c)
            before the softmax; None: off.
    Returns:
        out (B, Hq, Lq, D) in out_dtype and q's layout, lse (B, Hq, Lq) float32 natural log, both
        normalised within the window when there is one.
    """
    B, Hq, Lq, D, Hkv, P = _check_inputs(q, k_pool, v_pool, page_table, query_start, key_range)
    window = check_key_range(key_range, query_start, Lq, P)
    meta = _meta(q, Hq, Hkv, D, P, softcap)
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"out_dtype {out_dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    # Keeps q's strides when q is dense: the kernel takes them explicitly.
    out = torch.empty_like(q) if out_dtype is None else torch.empty_like(q, dtype=out_dtype)
    lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
    if B * Lq == 0:
        return out, lse
    G = Hq // Hkv
    key_lo, key_hi = (0, query_start + Lq) if window is None else window

    def grid(meta):
        return (triton.cdiv(Lq * G, meta["BLOCK_M"]), B * Hkv)

    doc_start, _, stride_db = _document_args(documents, q, query_start, page_table)
    _fwd_kernel[grid](
        q, k_pool, v_pool, page_table, out, lse, doc_start,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), page_table.stride(0), *out.stride(), *lse.stride(),
        stride_db, Hkv, Lq, query_start, key_lo, key_hi, float(scale),
        WINDOW=window is not None, DOCS=documents is not None, **meta,
    )
    return out, lse


def backward_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """rowsum(dO * O) as contiguous float32 (B, Hq, Lq), computed once per chunk and shared by the
    windows of a streamed backward. (backward itself rounds dout to q's dtype first: pass dout in
    q's dtype for the very same delta.)"""
    if out.dim() != 4 or out.shape != dout.shape or out.device != dout.device:
        raise ValueError(f"out {tuple(out.shape)} on {out.device} and dout {tuple(dout.shape)} on {dout.device} "
                         f"must be one (B, Hq, Lq, D) shape on one device")
    if dout.dtype not in SUPPORTED_DTYPES or out.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"out/dout dtypes {out.dtype}/{dout.dtype} are not supported; use {SUPPORTED_DTYPES}")
    B, Hq, Lq, D = out.shape
    delta = torch.empty((B, Hq, Lq), dtype=torch.float32, device=out.device)
    if delta.numel() == 0:
        return delta
    _delta_kernel[(triton.cdiv(Lq, _DELTA_BLOCK_M), B * Hq)](
        out, dout, delta, *out.stride(), *dout.stride(), Hq, Lq,
        HEAD_DIM=D, BLOCK_D=max(MIN_BLOCK_D, triton.next_power_of_2(D)), BLOCK_M=_DELTA_BLOCK_M,
    )
    return delta


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
    *,
    key_range: tuple[int, int] | None = None,
    delta: torch.Tensor | None = None,
    dq_accumulator: torch.Tensor | None = None,
    documents: Documents | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Return dQ (q's dtype, q's layout) and add dK, dV of every page the chunk read into the pools.

    ``out`` and ``lse`` are the forward's results; ``dout`` the gradient of ``out`` (any strides).
    ``dk_pool``/``dv_pool`` have k_pool's shape, any floating dtype; each touched slot is rounded
    once to that dtype after a float32 accumulation. Deterministic: no atomics.

    With ``key_range`` (reference.py's contract): dQ is the window's share and only the window's
    keys get dK, dV; ``out``/``lse`` are the merged ones (``out`` may be None when ``delta``, the
    float32 ``backward_delta``, is given). ``dq_accumulator``: float32 (B, Hq, Lq, D), any
    non-overlapping strides; dQ is added into it in place and it is returned. ``documents``: as in
    the forward (dK, dV of a key come only from queries of its document). ``softcap``: as the
    forward (dS of a score is multiplied by the cap's derivative 1 - tanh^2(s / c)).
    """
    B, Hq, Lq, D, Hkv, P = _check_inputs(q, k_pool, v_pool, page_table, query_start, key_range)
    window = check_key_range(key_range, query_start, Lq, P)
    _check_backward_extras(q, out, delta, dq_accumulator)
    for name, t in (("out", out), ("dout", dout)):
        if t is None:
            continue
        if t.shape != q.shape or t.device != q.device:
            raise ValueError(f"{name} {tuple(t.shape)} on {t.device} must match "
                             f"q {tuple(q.shape)} on {q.device}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} dtype {t.dtype} is not supported; use {SUPPORTED_DTYPES}")
    if lse.shape != (B, Hq, Lq) or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(f"lse must be float32 {(B, Hq, Lq)} on {q.device}; "
                         f"got {lse.dtype} {tuple(lse.shape)}")
    for name, t in (("dk_pool", dk_pool), ("dv_pool", dv_pool)):
        if t.shape != k_pool.shape or t.device != k_pool.device:
            raise ValueError(f"{name} {tuple(t.shape)} on {t.device} must match k_pool {tuple(k_pool.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} dtype {t.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    dq = torch.empty_like(q) if dq_accumulator is None else dq_accumulator
    if B * Lq == 0:
        return dq
    G = Hq // Hkv
    meta = _meta(q, Hq, Hkv, D, P, softcap)
    key_lo, key_hi = (0, query_start + Lq) if window is None else window
    # dO must have q's dtype for the dots (autograd may hand over another float dtype).
    dout = dout.to(q.dtype)

    lse = lse.contiguous()  # the kernels index lse and delta with the same strides
    # (B, Hq, Lq) float32 rowsum(dO * O)
    delta = backward_delta(out, dout) if delta is None else delta.contiguous()

    doc_start, doc_end, stride_db = _document_args(documents, q, query_start, page_table)
    doc_kwargs = {} if documents is None else dict(doc_start_ptr=doc_start, doc_end_ptr=doc_end,
                                                   stride_db=stride_db, DOCS=True)

    def key_grid(meta):
        return (triton.cdiv(key_hi, meta["BLOCK_N"]) - key_lo // meta["BLOCK_N"], B * Hkv)

    _dkdv_kernel[key_grid](
        q, k_pool, v_pool, page_table, dout, lse, delta, dk_pool, dv_pool,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), page_table.stride(0), *dout.stride(),
        *lse.stride(), *dk_pool.stride(), *dv_pool.stride(),
        Hkv, Lq, query_start, float(scale), **meta, key_lo=key_lo, key_hi=key_hi,
        **doc_kwargs,
    )

    def row_grid(meta):
        return (triton.cdiv(Lq * G, meta["BLOCK_M"]), B * Hkv)

    _dq_kernel[row_grid](
        q, k_pool, v_pool, page_table, dout, lse, delta, dq, doc_start,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), page_table.stride(0), *dout.stride(),
        *lse.stride(), *dq.stride(), stride_db,
        Hkv, Lq, query_start, key_lo, key_hi, float(scale),
        WINDOW=window is not None, ACCUMULATE_DQ=dq_accumulator is not None, DOCS=documents is not None, **meta,
    )
    return dq
