"""Sliding-window attention as a few batched plain calls of a fused kernel (cuDNN's): the band path.

A window layer's key bounds (documents.window_bounds without packed documents: ``Documents.window``
W set) are a band, query t sees keys t - W < j <= t. cuDNN's fused attention masks nothing but
"causal" (square, top-left), and its first key moves at every query, so cudnn_paged.py's document
segments would be one call per query. The band is cut into pieces that are each a plain call:

* **The chunk (local window).** Its queries are cut into tiles of T = W - 1 (whole tiles, then r < T
  remainder rows). Query a + i of the tile starting at a sees key a - T + j of the previous tile iff
  a + i - W < a - T + j, i.e. j >= i (T = W - 1 makes the offset vanish), its own tile causally, and
  nothing two tiles back. So each tile is two square calls: its own keys (causal) and the previous
  tile's, "j >= i", which becomes causal "j' <= i'" once the rows and the keys are reversed (the
  results are reversed back). All tiles' own blocks are one batched call (tiles as batch entries),
  all previous blocks another (L: j <= i, U: j >= i, within a tile's block)::

        keys ->   tile 0   tile 1   tile 2
        tile 0      L
        tile 1      U        L
        tile 2               U        L

* **A history window (lo, hi)** matters from the chunk's first window start s - W + 1 on. Against
  n keys [ka, ka + n) before it, query row i sees key ka + j iff j >= d + i, d = s - W + 1 - ka:
  rows with d + i <= 0 see all n keys (a full call: a KV head's query heads fold into one sequence,
  as in cudnn_paged.py), rows with d + i in (0, n) a shrinking tail (the reversed causal square
  again, over as many keys as it has rows; keys every such row sees go to a full call), later rows
  none (out 0, lse -inf, merged as empty). The remainder rows of the chunk against the last whole
  tile are the same kind of block (d = 0).

No row is padded and no key outside a query's window is gathered (the store may have freed the
pages before a window layer's windows). Causal calls cannot fold query heads, so K and V are
repeated per query head there and dK, dV summed over each KV head's group, as cudnn_paged.py's own
chunk. Backward hands every piece the merged out and lse: each returns its exact share of dQ, dK, dV.
Calls of fewer than SHORT_SEGMENT rows or keys (windows under 65 tokens, small remainders) run on
the plain-torch kernel, as short document segments do (cuDNN's backward crashed on short ones).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .cudnn_layout import FusedKernel, _add_into_pages, _fold, _gather, _gather_from, _unfold
from .reference import merge_window


class BandAttention:
    """reference.py's dense contract for window bounds, the key windows of one call on plain calls of
    the kernels ``pick(rows, keys)`` returns."""

    def __init__(self, pick: Callable[[int, int], FusedKernel]) -> None:
        self.pick = pick

    def forward(self, q, k_pool, v_pool, page_table, query_start: int, scale: float, windows, out_dtype,
                window: int):
        """(out, lse) over the key ``windows`` (history windows, then maybe the chunk), merged."""
        out = lse = None
        for lo, hi in windows:
            if lo == query_start:
                out_w, lse_w = self._local_forward(q, k_pool, v_pool, page_table, query_start, scale, window)
            else:
                out_w, lse_w = self._history_forward(q, k_pool, v_pool, page_table, query_start, scale, lo, hi,
                                                     window)
            out, lse = (out_w, lse_w) if out is None else merge_window(out, lse, out_w, lse_w)
        return out.to(out_dtype or q.dtype), lse

    def backward(self, q, k_pool, v_pool, page_table, query_start: int, scale: float, out, dout, lse, dk_pool,
                 dv_pool, windows, dq: torch.Tensor, window: int) -> None:
        """Adds each window's share of dQ into ``dq`` (float32) and of dK, dV into the pages."""
        for lo, hi in windows:
            if lo == query_start:
                self._local_backward(q, k_pool, v_pool, page_table, query_start, scale, out, dout, lse, dk_pool,
                                     dv_pool, dq, window)
            else:
                self._history_backward(q, k_pool, v_pool, page_table, query_start, scale, out, dout, lse, dk_pool,
                                       dv_pool, dq, lo, hi, window)

    # --- the chunk's own keys ---------------------------------------------------------------------
    def _local_forward(self, q, k_pool, v_pool, page_table, query_start, scale, window):
        """Whole tiles: own block merged with the previous tile's; remainder rows: own block merged with
        the last whole tile's keys as a block (d = 0)."""
        B, Hq, Lq, D = q.shape
        T, n, r = _tiles(window, Lq)
        a = n * T  # the remainder's first query
        k, v = (_gather(pool, page_table, query_start, query_start + Lq) for pool in (k_pool, v_pool))
        out = torch.empty((B, Hq, Lq, D), dtype=torch.float32, device=q.device)
        lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
        kernel = self.pick(T, T)
        q_t, k_t, v_t = (_to_tiles(x, T, n) for x in (q, k, v))  # (B * n, H, T, D)
        out_t, lse_t = _causal_forward(kernel, q_t, k_t, v_t, scale, flip=False)
        out[:, :, :a], lse[:, :, :a] = _from_tiles(out_t, B), _from_tiles(lse_t, B)
        if window > 1 and n > 1:  # W = 1: a query sees only itself
            o, s = _causal_forward(kernel, _later(q_t, B), _earlier(k_t, B), _earlier(v_t, B), scale, flip=True)
            out[:, :, T:a], lse[:, :, T:a] = merge_window(out[:, :, T:a], lse[:, :, T:a], _from_tiles(o, B),
                                                          _from_tiles(s, B))
        if r:  # then W > 1 and n >= 1
            o, s = _causal_forward(self.pick(r, r), q[:, :, a:], k[:, :, a:], v[:, :, a:], scale, flip=False)
            o_b, s_b = self._block_forward(q[:, :, a:], k[:, :, a - T:a], v[:, :, a - T:a], 0, r, r, scale)
            out[:, :, a:], lse[:, :, a:] = merge_window(o, s, o_b, s_b)
        return out, lse

    def _local_backward(self, q, k_pool, v_pool, page_table, query_start, scale, out, dout, lse, dk_pool, dv_pool,
                        dq, window) -> None:
        B, _, Lq, _ = q.shape
        T, n, r = _tiles(window, Lq)
        a = n * T
        k, v = (_gather(pool, page_table, query_start, query_start + Lq) for pool in (k_pool, v_pool))
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)  # (B, Hkv, Lq, D): summed over the calls
        dv = torch.zeros_like(dk)
        kernel = self.pick(T, T)
        do_t, q_t, out_t, lse_t, k_t, v_t = (_to_tiles(x, T, n) for x in (dout, q, out, lse, k, v))
        dq_t, dk_t, dv_t = _causal_backward(kernel, do_t, q_t, k_t, v_t, out_t, lse_t, scale, flip=False)
        dq[:, :, :a] += _from_tiles(dq_t, B)
        dk[:, :, :a], dv[:, :, :a] = _from_tiles(dk_t, B), _from_tiles(dv_t, B)
        if window > 1 and n > 1:
            dq_t, dk_t, dv_t = _causal_backward(kernel, _later(do_t, B), _later(q_t, B), _earlier(k_t, B),
                                                _earlier(v_t, B), _later(out_t, B), _later(lse_t, B), scale,
                                                flip=True)
            dq[:, :, T:a] += _from_tiles(dq_t, B)
            dk[:, :, :a - T] += _from_tiles(dk_t, B)
            dv[:, :, :a - T] += _from_tiles(dv_t, B)
        if r:
            rows = dout[:, :, a:], q[:, :, a:]
            dq_r, dk_r, dv_r = _causal_backward(self.pick(r, r), *rows, k[:, :, a:], v[:, :, a:], out[:, :, a:],
                                                lse[:, :, a:], scale, flip=False)
            dq[:, :, a:] += dq_r
            dk[:, :, a:], dv[:, :, a:] = dk_r, dv_r
            dq_r, dk_r, dv_r = self._block_backward(*rows, k[:, :, a - T:a], v[:, :, a - T:a], out[:, :, a:],
                                                    lse[:, :, a:], 0, r, r, scale)
            dq[:, :, a:] += dq_r
            dk[:, :, a - T:a] += dk_r
            dv[:, :, a - T:a] += dv_r
        _add_into_pages(dk_pool, page_table, query_start, dk)
        _add_into_pages(dv_pool, page_table, query_start, dv)

    # --- history windows ----------------------------------------------------------------------------
    def _history_forward(self, q, k_pool, v_pool, page_table, query_start, scale, lo, hi, window):
        B, Hq, Lq, D = q.shape
        out = torch.zeros((B, Hq, Lq, D), dtype=torch.float32, device=q.device)
        lse = torch.full((B, Hq, Lq), float("-inf"), dtype=torch.float32, device=q.device)
        block = _history_block(Lq, query_start, lo, hi, window)
        if block is not None:  # else no query sees a key of the window: out 0, lse -inf
            first, f, e, m = block
            k, v = (_gather_from(pool, page_table, first, hi) for pool in (k_pool, v_pool))  # (B, Hkv, n, D)
            out[:, :, :e], lse[:, :, :e] = self._block_forward(q, k, v, f, e, m, scale)
        return out, lse

    def _history_backward(self, q, k_pool, v_pool, page_table, query_start, scale, out, dout, lse, dk_pool, dv_pool,
                          dq, lo, hi, window) -> None:
        block = _history_block(q.shape[2], query_start, lo, hi, window)
        if block is None:
            return
        first, f, e, m = block
        k, v = (_gather_from(pool, page_table, first, hi) for pool in (k_pool, v_pool))
        dq_b, dk, dv = self._block_backward(dout, q, k, v, out, lse, f, e, m, scale)
        dq[:, :, :e] += dq_b
        P = k_pool.shape[2]
        pad = first - first // P * P  # keys before the block's first in its page get zeros
        for pool, grad in ((dk_pool, dk), (dv_pool, dv)):
            _add_into_pages(pool, page_table, first - pad, torch.nn.functional.pad(grad, (0, 0, pad, 0)))

    # --- a block of rows over keys before them (_rows) ----------------------------------------------
    def _block_forward(self, q, k, v, f: int, e: int, m: int, scale: float):
        """Rows [0, e) of q (B, Hq, >= e, D) over keys k, v (B, Hkv, n, D) before them: rows [0, f) see
        every key, row f + i the keys j >= i (m = e - f). Returns (out, lse) of those rows, float32."""
        B, Hq, _, D = q.shape
        Hkv = k.shape[1]
        out = torch.zeros((B, Hq, e, D), dtype=torch.float32, device=q.device)
        lse = torch.full((B, Hq, e), float("-inf"), dtype=torch.float32, device=q.device)
        for rows, keys in _full_parts(f, e, m, k.shape[2]):
            kernel = self.pick(Hq // Hkv * rows.stop, keys.stop - keys.start)
            o, s = kernel.forward(_fold(q[:, :, rows], Hkv), k[:, :, keys].contiguous(), v[:, :, keys].contiguous(),
                                  False, scale)
            out[:, :, rows], lse[:, :, rows] = merge_window(out[:, :, rows], lse[:, :, rows],
                                                            _unfold(o, Hkv, rows.stop), s.reshape(B, Hq, rows.stop))
        if m:
            o, s = _causal_forward(self.pick(m, m), q[:, :, f:e], k[:, :, :m], v[:, :, :m], scale, flip=True)
            out[:, :, f:e], lse[:, :, f:e] = merge_window(out[:, :, f:e], lse[:, :, f:e], o, s)
        return out, lse

    def _block_backward(self, dout, q, k, v, out, lse, f: int, e: int, m: int, scale: float):
        """The backward of _block_forward (out, lse: the merged ones): dQ (B, Hq, e, D) and dK, dV
        (B, Hkv, n, D), float32."""
        B, Hq, _, D = q.shape
        Hkv = k.shape[1]
        dq = torch.zeros((B, Hq, e, D), dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros_like(dk)
        for rows, keys in _full_parts(f, e, m, k.shape[2]):
            kernel = self.pick(Hq // Hkv * rows.stop, keys.stop - keys.start)
            dq_w, dk_w, dv_w = kernel.backward(_fold(dout[:, :, rows], Hkv), _fold(q[:, :, rows], Hkv),
                                               k[:, :, keys].contiguous(), v[:, :, keys].contiguous(),
                                               _fold(out[:, :, rows], Hkv),
                                               lse[:, :, rows].reshape(B, Hkv, -1).contiguous(), False, scale)
            dq[:, :, rows] += _unfold(dq_w, Hkv, rows.stop)
            dk[:, :, keys] += dk_w
            dv[:, :, keys] += dv_w
        if m:
            dq_w, dk_w, dv_w = _causal_backward(self.pick(m, m), dout[:, :, f:e], q[:, :, f:e], k[:, :, :m],
                                                v[:, :, :m], out[:, :, f:e], lse[:, :, f:e], scale, flip=True)
            dq[:, :, f:e] += dq_w
            dk[:, :, :m] += dk_w
            dv[:, :, :m] += dv_w
        return dq, dk, dv


def _tiles(window: int, num_queries: int) -> tuple[int, int, int]:
    """(T, n, r): the chunk's queries as n whole tiles of T = W - 1 (at least 1, at most the chunk) and
    r < T remainder rows."""
    tile = min(max(window - 1, 1), num_queries)
    return tile, num_queries // tile, num_queries % tile


def _rows(query_first: int, num_queries: int, key_first: int, num_keys: int, window: int):
    """How ``num_queries`` rows from absolute position ``query_first`` see the keys [key_first,
    key_first + num_keys) (all before the rows) through the window. With d = query_first - window + 1 -
    key_first, row i sees key key_first + j iff j >= d + i. Returns (f, e, skip): rows [0, f) see every
    key; row i in [f, e) sees keys j >= skip + i - f (a reversed causal square from key skip on, row f
    seeing all of them); rows [e, num_queries) see none. skip > 0 only when d > 0 (keys before the
    first row's window)."""
    d = query_first - window + 1 - key_first
    f = min(num_queries, max(0, -d))
    e = min(num_queries, max(0, num_keys - d))
    return f, e, max(d, 0)


def _history_block(num_queries: int, query_start: int, lo: int, hi: int, window: int):
    """A history window's block: None when no query sees a key of it, else (first, f, e, m): the keys
    [first, hi) to gather (none before the chunk's first window start s - W + 1, so none before 0 or
    before ``lo``) and _rows' rows, m = e - f, the square's keys [0, m) relative to ``first``."""
    first = max(lo, query_start - window + 1)
    if first >= hi:
        return None
    f, e, skip = _rows(query_start, num_queries, first, hi - first, window)
    return None if e == 0 else (first + skip, f, e, e - f)


def _full_parts(f: int, e: int, m: int, num_keys: int) -> list[tuple[slice, slice]]:
    """The full (non-causal, foldable) calls of a block, (rows, keys): rows [0, e) see the keys past the
    square's (from m on), rows [0, f) also the square's keys [0, m) (keys relative to the block)."""
    parts = []
    if e and m < num_keys:
        parts.append((slice(0, e), slice(m, num_keys)))
    if f and m:
        parts.append((slice(0, f), slice(0, m)))
    return parts


def _causal_forward(kernel: FusedKernel, q, k, v, scale: float, flip: bool):
    """Square causal calls: (N, Hq, n, D) queries over (N, Hkv, n, D) keys, K and V repeated per query
    head; row i sees keys j <= i, or with ``flip`` keys j >= i (rows and keys reversed, results reversed
    back). Returns (out, lse)."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    if flip:
        q, k, v = q.flip(2), k.flip(2), v.flip(2)
    out, lse = kernel.forward(q.contiguous(), k, v, True, scale)
    return (out.flip(2), lse.flip(2)) if flip else (out, lse)


def _causal_backward(kernel: FusedKernel, dout, q, k, v, out, lse, scale: float, flip: bool):
    """The backward of _causal_forward with the merged out and lse: dQ in q's dtype, dK and dV
    (N, Hkv, n, D) float32 summed over each KV head's query heads."""
    N, Hkv, n, D = k.shape
    G = q.shape[1] // Hkv
    inputs = (dout, q, k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1), out, lse)
    if flip:
        inputs = tuple(x.flip(2) for x in inputs)
    dq, dk, dv = kernel.backward(*(x.contiguous() for x in inputs), True, scale)
    dk, dv = (g.float().reshape(N, Hkv, G, n, D).sum(2) for g in (dk, dv))
    return (dq.flip(2), dk.flip(2), dv.flip(2)) if flip else (dq, dk, dv)


def _to_tiles(x: torch.Tensor, tile: int, n: int) -> torch.Tensor:
    """(B, H, L[, D]) -> contiguous (B * n, H, tile[, D]): the first n * tile positions as n tiles."""
    B, H = x.shape[:2]
    rest = x.shape[3:]
    return x[:, :, :n * tile].reshape(B, H, n, tile, *rest).transpose(1, 2).reshape(B * n, H, tile, *rest).contiguous()


def _from_tiles(x: torch.Tensor, batch: int) -> torch.Tensor:
    """(B * n, H, tile[, D]) -> (B, H, n * tile[, D]): _to_tiles undone."""
    _, H, tile = x.shape[:3]
    rest = x.shape[3:]
    return x.reshape(batch, -1, H, tile, *rest).transpose(1, 2).reshape(batch, H, -1, *rest)


def _later(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Tiles 1..n-1 of every row of a (B * n, ...) tile batch."""
    return x.unflatten(0, (batch, -1))[:, 1:].flatten(0, 1)


def _earlier(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Tiles 0..n-2 of every row of a (B * n, ...) tile batch: the keys the later tiles look back at."""
    return x.unflatten(0, (batch, -1))[:, :-1].flatten(0, 1)
