"""Dense paged attention on a fused attention kernel: cuDNN's, the one plain HF's SDPA runs on Hopper.

It follows reference.py's contract (key windows included), so the engine, the checkpoint replay and
host offload use it unchanged. Each key window is one kernel call:

* a window's pages are gathered from the pools into one contiguous (B, Hkv, S, D) block (a copy of
  S tokens of K and V: bandwidth, not compute);
* a history window is seen whole by every query, so a KV head's G query heads fold into one query
  sequence of G * Lq rows: grouped-query attention without repeating K or V;
* the local window (the chunk itself) is causal, so it cannot fold; the chunk's K and V (Lq tokens)
  are repeated per query head instead, and its dK, dV summed over the group.

Backward hands the kernel the merged out and lse of the whole chunk (not the window's own), so each
window's dQ, dK, dV is its exact share of the full gradient; dK, dV are added into the page buffers
and dQ into a float32 accumulator.

Packed documents (``documents=``, oomb/documents.py) need no mask: per row, the chunk's queries are
cut at the document starts inside it into segments, and each segment is plain attention with an
offset. Only the first segment (the document the chunk starts in) has history: it sees every key
of a history window from its document's start on, whole (a window, or its tail starting inside a
page). Every segment sees its own keys causally from its first query on: a square, top-left causal
call. Rows of a batch run one by one (their boundaries differ); a row's queries outside the first
segment see no key of a history window (out 0, lse -inf, merged as empty). A chunk costs one
kernel call per document in it (plus one per history window), so many tiny documents mean many
small calls.

Documents also make calls of new lengths in every chunk, and cuDNN builds a graph for each new shape
(about 38 ms forward and 46 ms backward on an H100, against 0.4-5 ms to run one; a 128K step of the embedded
corpus makes about 50 new shapes, a 1M one about 390). So the calls take lengths from a small set, which a run
has built after its first steps: a segment's queries and keys, and a history window's queries, are padded with
zeros to a multiple of ``shape_step`` (a padded query's output is dropped and its zero dO adds nothing to any
gradient; a causal segment's padded keys come after every real query), and a history window's keys, which
cannot be padded, are cut at the next multiples of ``shape_step`` and ``history_step`` into at most three calls
merged by their log-sum-exp; the first of them, under ``shape_step`` keys where a document starts inside a page,
runs on plain torch (its length differs at almost every document: each would be a new graph).

Sliding windows alone (``documents`` from documents.window_bounds with ``window`` set) are a band:
its first key moves at every query, so segments would be one call per query; cudnn_band.py cuts the
band into a few batched plain calls instead. Windows inside packed documents are refused (their
first key is neither a document start nor the band's).

Unlike the Triton kernels this is not bitwise deterministic (torch documents cuDNN attention's
backward as non-deterministic), its window outputs are rounded to q's dtype before the merge, and
each window's dK, dV reach the page buffers rounded to q's dtype. It takes bf16/fp16 CUDA tensors
only. Sparse mode's selected pages run on the same kernel in cudnn_sparse.py.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .cudnn_band import BandAttention
from .cudnn_layout import FusedKernel, _add_into_pages, _fold, _gather, _gather_from, _unfold
from .reference import _check, _check_backward_extras, check_key_range, merge_window


@functools.cache
def _cudnn_stats_rank(device: torch.device) -> int:
    """Rank of the log-sum-exp tensor torch's cuDNN attention returns here ((B, H, S) or
    (B, H, S, 1), depending on the torch version); its backward wants the same shape back."""
    x = torch.zeros((1, 1, 8, 64), dtype=torch.bfloat16, device=device)
    return torch.ops.aten._scaled_dot_product_cudnn_attention(x, x, x, None, True, 0.0, False, False)[1].dim()


@contextlib.contextmanager
def _explained(what: str, q: torch.Tensor, k: torch.Tensor):
    """cuDNN's own errors name neither the shapes nor a way out: add both."""
    if q.numel() == 0 or k.numel() == 0:  # torch's cuDNN path would return uninitialised memory
        raise ValueError(f"cuDNN fused attention {what} called with an empty q {tuple(q.shape)} or k {tuple(k.shape)}")
    try:
        yield
    except torch.OutOfMemoryError:
        raise  # a result for `oomb bench`, and no reason to switch backends
    except RuntimeError as err:
        raise RuntimeError(f"cuDNN fused attention {what} refused q {tuple(q.shape)} / k {tuple(k.shape)} {q.dtype} "
                           f"on {q.device} ({err}); backend='triton' runs the same step on oomb's kernels") from err


def _cudnn_forward(q, k, v, causal: bool, scale: float):
    with _explained("forward", q, k):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                          scale=scale)
    return out, lse.reshape(q.shape[:-1])


def _cudnn_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    stats = lse.reshape(lse.shape + (1,) * (_cudnn_stats_rank(q.device) - 3)).contiguous()
    rng = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout's seed and offset: unused at p=0
    with _explained("backward", q, k):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, stats, rng, rng, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale
        )
    return dq, dk, dv


@functools.cache
def _cudnn_takes_grouped_heads(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether torch's cuDNN attention forward here takes fewer KV heads than query heads, with the results
    of repeated heads (bitwise on the H200 with torch 2.11, and 0.15 ms of 1.14 faster for a 4096-token chunk
    of the 7B's causal forward and backward, measured). Checked once per device and dtype on a
    small causal case of 7 query heads per KV head, head dim 128; a refusal or another result keeps the
    repeats (running out of memory is raised, not taken for an answer)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn((1, 14, 96, 128), generator=gen, device=device).to(dtype)
    kv = torch.randn((2, 1, 2, 96, 128), generator=gen, device=device).to(dtype)
    try:
        grouped = _cudnn_forward(q, kv[0], kv[1], True, 128 ** -0.5)
        repeated = _cudnn_forward(q, kv[0].repeat_interleave(7, 1), kv[1].repeat_interleave(7, 1), True, 128 ** -0.5)
    except torch.OutOfMemoryError:  # no answer (functools.cache keeps none): asked again on the next call
        raise
    except RuntimeError:
        return False
    return all(torch.equal(a, b) for a, b in zip(grouped, repeated, strict=True))


CUDNN_KERNEL = FusedKernel(_cudnn_forward, _cudnn_backward, grouped_forward=_cudnn_takes_grouped_heads)


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _torch_forward(q, k, v, causal: bool, scale: float):
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - lse[..., None]) @ v.float()).to(q.dtype), lse


def _torch_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    p = torch.exp(_scores(q, k, causal, scale) - lse.float()[..., None])
    dout = dout.float()
    ds = p * (dout @ v.float().transpose(-1, -2) - (dout * out.float()).sum(-1, keepdim=True))
    grads = (ds @ k.float()) * scale, (ds.transpose(-1, -2) @ q.float()) * scale, p.transpose(-1, -2) @ dout
    return tuple(g.to(q.dtype) for g in grads)  # as cuDNN: in the inputs' dtype


TORCH_KERNEL = FusedKernel(_torch_forward, _torch_backward, (torch.bfloat16, torch.float16, torch.float32))
"""The FusedKernel contract in plain float32 torch: packed documents' short segments and the band's
small calls (cudnn_band.py) run on it."""
SHAPE_STEP = 128
"""Packed documents: segment and query lengths are padded to a multiple of this (module docstring)."""
HISTORY_STEP = 4096
"""Packed documents: a history window's keys are cut at the next multiple of SHAPE_STEP and of this."""
SHORT_SEGMENT = 64
"""Packed documents and sliding windows: a call with fewer query rows (after folding) or keys than this
runs on TORCH_KERNEL, not cuDNN (documents of a few tokens, windows under 65 tokens and small band
remainders make such calls; see WindowedAttention)."""


@functools.cache
def _merge_kernel():
    """triton_merge.merge_pair, imported on first use; None without Triton (an optional dependency)."""
    try:
        from .triton_merge import merge_pair  # local: Triton is optional
    except ImportError:
        return None
    return merge_pair


def merge_into(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
               out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.merge_window of two partial attentions, its out in ``out_dtype``: on CUDA one kernel that
    reads each input once (triton_merge.py), else merge_window's float32 passes and a cast."""
    kernel = _merge_kernel() if out_a.is_cuda else None
    if kernel is not None and lse_a.dtype == lse_b.dtype == torch.float32 \
            and all(t.stride(-1) == 1 for t in (out_a, lse_a, out_b, lse_b)):
        return kernel(out_a, lse_a, out_b, lse_b, out_dtype)
    out, lse = merge_window(out_a, lse_a, out_b, lse_b)
    return out.to(out_dtype), lse


def no_delta(out: torch.Tensor, dout: torch.Tensor) -> None:
    """The backend's backward_delta: none, since the fused kernel computes rowsum(dO * O) from out."""
    return None


def check_inputs(kernel: FusedKernel, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    if q.dtype not in kernel.dtypes or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise TypeError(f"this backend takes q, K and V of one dtype among {kernel.dtypes}; got {q.dtype}, "
                        f"{k_pool.dtype}, {v_pool.dtype} (use backend='triton' or 'torch' for float32)")


def local_forward(kernel: FusedKernel, q, k_pool, v_pool, page_table, query_start: int, scale: float):
    """The chunk's causal attention over its own keys: (out, lse). K and V as they are where the kernel's
    forward takes grouped heads (FusedKernel.grouped_forward), else repeated per query head."""
    grouped = kernel.grouped_forward is not None and q.shape[1] != k_pool.shape[1] \
        and kernel.grouped_forward(q.device, q.dtype)
    k, v = _local_keys(q, k_pool, v_pool, page_table, query_start, repeat=not grouped)
    return kernel.forward(q.contiguous(), k, v, True, scale)


def local_backward(kernel: FusedKernel, q, k_pool, v_pool, page_table, query_start: int, scale: float, out, dout,
                   lse, dk_pool, dv_pool) -> torch.Tensor:
    """The chunk's own keys' share of the backward (merged out and lse): adds dK, dV (summed over each
    KV head's query heads) into the chunk's pages and returns its share of dQ in q's dtype."""
    B, Hq, Lq, D = q.shape
    Hkv = k_pool.shape[1]
    k, v = _local_keys(q, k_pool, v_pool, page_table, query_start)
    dq, dk, dv = kernel.backward(dout.contiguous(), q.contiguous(), k, v, out.contiguous(), lse.contiguous(), True,
                                 scale)
    _add_into_pages(dk_pool, page_table, query_start, dk.view(B, Hkv, Hq // Hkv, Lq, D).sum(2, dtype=torch.float32))
    _add_into_pages(dv_pool, page_table, query_start, dv.view(B, Hkv, Hq // Hkv, Lq, D).sum(2, dtype=torch.float32))
    return dq


def _local_keys(q, k_pool, v_pool, page_table, query_start: int, repeat: bool = True):
    """The chunk's own K and V, (B, Hkv, Lq, D), or repeated per query head, (B, Hq, Lq, D)."""
    Lq, G = q.shape[2], q.shape[1] // k_pool.shape[1]
    k, v = (_gather(pool, page_table, query_start, query_start + Lq) for pool in (k_pool, v_pool))
    return (k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)) if repeat else (k, v)


class WindowedAttention:
    """reference.py's dense contract on a :class:`FusedKernel`, one kernel call per key window."""

    def __init__(self, kernel: FusedKernel = CUDNN_KERNEL, short_kernel: FusedKernel = TORCH_KERNEL,
                 short_segment: int = SHORT_SEGMENT, shape_step: int = SHAPE_STEP,
                 history_step: int = HISTORY_STEP) -> None:
        self.kernel = kernel
        self.short_kernel, self.short_segment = short_kernel, short_segment
        self.shape_step, self.history_step = shape_step, history_step
        self.band = BandAttention(self._segment_kernel)

    def _segment_kernel(self, queries: int, keys: int) -> FusedKernel:
        """The kernel of a packed-documents or band call of ``queries`` rows and ``keys`` keys."""
        return self.short_kernel if min(queries, keys) < self.short_segment else self.kernel

    def _piece_kernel(self, queries: int, keys: int) -> FusedKernel:
        """The kernel of a history piece: one under ``shape_step`` keys (a window starting inside a page has
        1 to shape_step - 1, a new length at almost every document) runs on the short kernel, so that cuDNN
        only ever sees key lengths from the small set and builds no graph for such a piece."""
        return self.short_kernel if keys < self.shape_step else self._segment_kernel(queries, keys)

    def _padded(self, length: int) -> int:
        """A packed-documents call's query (and causal key) count: ``length`` up to a multiple of shape_step."""
        return -(-length // self.shape_step) * self.shape_step

    def _key_pieces(self, first: int, hi: int) -> list[tuple[int, int]]:
        """A history window's keys [first, hi) cut at the next multiples of shape_step and history_step: every
        piece but the first (under shape_step keys) has a length from a small set (module docstring)."""
        steps = (self.shape_step, self.history_step)
        cuts = sorted({first, hi, *(min(hi, -(-first // step) * step) for step in steps)})
        return list(zip(cuts[:-1], cuts[1:], strict=True))

    def _windows(self, q, k_pool, v_pool, page_table, query_start, key_range) -> list[tuple[int, int]]:
        """Validate the inputs; return the key windows to run: the given one, or history then chunk."""
        check_inputs(self.kernel, q, k_pool, v_pool)
        Lq = q.shape[2]
        window = check_key_range(key_range, query_start, Lq, k_pool.shape[2])
        _check(q, k_pool, page_table, query_start, query_start + Lq if window is None else window[1])
        if window is not None:
            return [window]
        return ([(0, query_start)] if query_start else []) + [(query_start, query_start + Lq)]

    def paged_attention_forward(self, q, k_pool, v_pool, page_table, query_start, scale, *, key_range=None,
                                out_dtype=None, documents=None):
        windows = self._windows(q, k_pool, v_pool, page_table, query_start, key_range)
        B, Hq, Lq, D = q.shape
        Hkv = k_pool.shape[1]
        if B * Lq == 0:
            return torch.empty_like(q, dtype=out_dtype or q.dtype), q.new_empty((B, Hq, Lq), dtype=torch.float32)
        q = q.contiguous()  # once, for the history's folded heads and the chunk's own keys
        if documents is not None and documents.window is not None:
            return self.band.forward(q, k_pool, v_pool, page_table, query_start, scale, windows, out_dtype,
                                     documents.window)
        if documents is not None:
            return self.documents_forward(q, k_pool, v_pool, page_table, query_start, scale, windows, out_dtype,
                                           documents)
        out = lse = None
        q_folded = _fold(q, Hkv) if windows[0][0] != query_start else None  # once for all history windows
        for i, (lo, hi) in enumerate(windows):
            if lo == query_start:
                out_w, lse_w = local_forward(self.kernel, q, k_pool, v_pool, page_table, query_start, scale)
            else:
                k, v = _gather(k_pool, page_table, lo, hi), _gather(v_pool, page_table, lo, hi)
                out_w, lse_w = self.kernel.forward(q_folded, k, v, False, scale)
                out_w, lse_w = _unfold(out_w, Hkv, Lq), lse_w.reshape(B, Hq, Lq)
            if out is None:
                out, lse = out_w, lse_w
            else:  # float32 until the last window
                last = i == len(windows) - 1
                out, lse = merge_into(out, lse, out_w, lse_w, (out_dtype or q.dtype) if last else torch.float32)
        return out.to(out_dtype or q.dtype), lse

    def paged_attention_backward(self, q, k_pool, v_pool, page_table, query_start, scale, out, dout, lse, dk_pool,
                                 dv_pool, *, key_range=None, delta=None, dq_accumulator=None, documents=None):
        windows = self._windows(q, k_pool, v_pool, page_table, query_start, key_range)
        _check_backward_extras(q, out, delta, dq_accumulator)
        if out is None:
            raise ValueError("the cudnn backend's backward needs the merged out (the kernel computes its own delta)")
        B, Hq, Lq, D = q.shape
        Hkv = k_pool.shape[1]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if dq_accumulator is None else dq_accumulator
        if B * Lq == 0:
            return dq if dq_accumulator is not None else dq.to(q.dtype)
        q, out, dout, lse = q.contiguous(), out.to(q.dtype).contiguous(), dout.to(q.dtype).contiguous(), lse.float()
        if documents is not None:
            if documents.window is not None:
                self.band.backward(q, k_pool, v_pool, page_table, query_start, scale, out, dout, lse, dk_pool,
                                   dv_pool, windows, dq, documents.window)
            else:
                self.documents_backward(q, k_pool, v_pool, page_table, query_start, scale, out, dout, lse,
                                         dk_pool, dv_pool, windows, dq, documents)
            return dq if dq_accumulator is not None else dq.to(q.dtype)
        if windows[0][0] != query_start:  # history windows share one folded copy of each operand
            folded = _fold(dout, Hkv), _fold(q, Hkv), _fold(out, Hkv), lse.reshape(B, Hkv, -1).contiguous()
        for lo, hi in windows:
            if lo == query_start:
                dq_w = local_backward(self.kernel, q, k_pool, v_pool, page_table, query_start, scale, out, dout, lse,
                                      dk_pool, dv_pool)
            else:
                k, v = _gather(k_pool, page_table, lo, hi), _gather(v_pool, page_table, lo, hi)
                dout_f, q_f, out_f, lse_f = folded
                dq_w, dk, dv = self.kernel.backward(dout_f, q_f, k, v, out_f, lse_f, False, scale)
                dq_w = _unfold(dq_w, Hkv, Lq)
                _add_into_pages(dk_pool, page_table, lo, dk)
                _add_into_pages(dv_pool, page_table, lo, dv)
            dq.add_(dq_w)
        return dq if dq_accumulator is not None else dq.to(q.dtype)

    # --- packed documents: segments of plain attention (module docstring) ---------------------------
    def documents_forward(self, q, k_pool, v_pool, page_table, query_start, scale, windows, out_dtype, documents):
        """(out, lse) over the key ``windows`` (history ones, and the chunk's own as (query_start, end)),
        each query reading only its document's keys; ``q`` contiguous."""
        B, Hq, Lq, D = q.shape
        Hkv = k_pool.shape[1]
        out = lse = None
        for lo, hi in windows:
            out_w = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
            lse_w = torch.full((B, Hq, Lq), float("-inf"), dtype=torch.float32, device=q.device)
            for b, segments in enumerate(document_segments(documents, query_start, Lq)):
                rows = slice(b, b + 1)
                if lo == query_start:
                    for a, e, _ in segments:
                        n, m = e - a, self._padded(e - a)
                        k, v = _segment_keys(Hq // Hkv, k_pool, v_pool, page_table[rows], query_start, a, e)
                        o, s = self._segment_kernel(n, n).forward(*(_pad_rows(x, m) for x in (q[rows, :, a:e], k, v)),
                                                                 True, scale)
                        out_w[rows, :, a:e], lse_w[rows, :, a:e] = o[:, :, :n], s[:, :, :n]
                    continue
                _, e, start = segments[0]  # only the chunk's first document has history
                first = max(lo, start)
                if first >= hi:
                    continue  # the document starts after this window: its queries see none of it
                m = self._padded(e)
                q_f = _fold(_pad_rows(q[rows, :, :e], m), Hkv)
                o = s = None
                for a_k, b_k in self._key_pieces(first, hi):
                    k, v = (_gather_from(pool, page_table[rows], a_k, b_k) for pool in (k_pool, v_pool))
                    o_k, s_k = self._piece_kernel(Hq // Hkv * e, b_k - a_k).forward(q_f, k, v, False, scale)
                    o, s = (o_k, s_k) if o is None else merge_window(o, s, o_k, s_k)
                out_w[rows, :, :e], lse_w[rows, :, :e] = _unfold(o, Hkv, m)[:, :, :e], s.reshape(1, Hq, m)[:, :, :e]
            out, lse = (out_w, lse_w) if out is None else merge_window(out, lse, out_w, lse_w)
        return out.to(out_dtype or q.dtype), lse

    def documents_backward(self, q, k_pool, v_pool, page_table, query_start, scale, out, dout, lse, dk_pool,
                           dv_pool, windows, dq, documents) -> None:
        """Adds each window's share of dQ into ``dq`` (float32) and of dK, dV into the pages."""
        B, Hq, Lq, D = q.shape
        Hkv, P = k_pool.shape[1], k_pool.shape[2]
        for lo, hi in windows:
            local = lo == query_start
            if local:  # the chunk's own dK, dV, summed over segments and query heads, added once
                dk_own = torch.zeros((B, Hkv, Lq, D), dtype=torch.float32, device=q.device)
                dv_own = torch.zeros_like(dk_own)
            for b, segments in enumerate(document_segments(documents, query_start, Lq)):
                rows = slice(b, b + 1)
                if local:
                    for a, e, _ in segments:
                        n, m = e - a, self._padded(e - a)
                        k, v = _segment_keys(Hq // Hkv, k_pool, v_pool, page_table[rows], query_start, a, e)
                        do_s, q_s, out_s = (_pad_rows(x[rows, :, a:e], m) for x in (dout, q, out))
                        lse_s = _pad_rows(lse[rows, :, a:e], m)
                        dq_s, dk, dv = self._segment_kernel(n, n).backward(
                            do_s, q_s, _pad_rows(k, m), _pad_rows(v, m), out_s, lse_s, True, scale)
                        dq[rows, :, a:e] += dq_s[:, :, :n]
                        dk_own[rows, :, a:e] = dk[:, :, :n].float().reshape(1, Hkv, Hq // Hkv, n, D).sum(2)
                        dv_own[rows, :, a:e] = dv[:, :, :n].float().reshape(1, Hkv, Hq // Hkv, n, D).sum(2)
                    continue
                _, e, start = segments[0]
                first = max(lo, start)
                if first >= hi:
                    continue
                m = self._padded(e)
                do_f, q_f, out_f = (_fold(_pad_rows(x[rows, :, :e], m), Hkv) for x in (dout, q, out))
                lse_f = _pad_rows(lse[rows, :, :e], m).reshape(1, Hkv, -1)
                for a_k, b_k in self._key_pieces(first, hi):
                    k, v = (_gather_from(pool, page_table[rows], a_k, b_k) for pool in (k_pool, v_pool))
                    kernel = self._piece_kernel(Hq // Hkv * e, b_k - a_k)
                    dq_w, dk, dv = kernel.backward(do_f, q_f, k, v, out_f, lse_f, False, scale)
                    dq[rows, :, :e] += _unfold(dq_w, Hkv, m)[:, :, :e]
                    pad = a_k - a_k // P * P  # keys before the piece in its first page get zeros
                    for pool, grad in ((dk_pool, dk), (dv_pool, dv)):
                        grad = torch.nn.functional.pad(grad, (0, 0, pad, 0))
                        _add_into_pages(pool, page_table[rows], a_k - pad, grad)
            if local:
                _add_into_pages(dk_pool, page_table, query_start, dk_own)
                _add_into_pages(dv_pool, page_table, query_start, dv_own)


def document_segments(documents, query_start: int, num_queries: int) -> list[list[tuple[int, int, int]]]:
    """Per row, the chunk's queries cut at document starts: (first, end, document start) with first and
    end relative to ``query_start`` and the document start absolute, in order; the first segment's
    document may start before the chunk, every other one's starts at its first query. Read from the
    documents' host copy: no device synchronisation."""
    starts = documents.start_cpu[:, query_start:query_start + num_queries]
    rows = []
    for row in starts:
        cut = torch.nonzero(row[1:] != row[:-1]).flatten() + 1
        if bool((row[cut] != query_start + cut).any()):  # a later segment must start its own document
            raise NotImplementedError(
                "key bounds whose first key moves inside a document (a sliding window cut by packed documents) "
                "are not supported by the cudnn backend: it runs documents as segments and windows alone as a "
                "band; use backend='triton' or 'torch'")
        cuts = cut.tolist()
        firsts, ends = [0] + cuts, cuts + [num_queries]
        rows.append([(a, e, int(row[a])) for a, e in zip(firsts, ends, strict=True)])
    return rows


def _pad_rows(x: torch.Tensor, length: int) -> torch.Tensor:
    """(B, H, L, D) or an lse's (B, H, L), contiguous, zeros appended along L up to ``length`` (no copy of a
    contiguous one already there; a padded row's lse is irrelevant, its dO being zero)."""
    if x.shape[2] == length:
        return x.contiguous()
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 3) + (0, length - x.shape[2]))


def _segment_keys(group: int, k_pool, v_pool, page_table, query_start: int, a: int, e: int):
    """A segment's own keys [query_start + a, query_start + e), K and V repeated per query head."""
    lo, hi = query_start + a, query_start + e
    return tuple(_gather_from(pool, page_table, lo, hi).repeat_interleave(group, dim=1) for pool in (k_pool, v_pool))
