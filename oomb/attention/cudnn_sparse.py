"""Sparse paged attention on a fused attention kernel (cuDNN's): reference_sparse.py's contract.

Consecutive query blocks with the same selection (``sparse_query_block_pages`` > 1 makes whole
groups of them) read the same history pages, so a group is plain attention of its queries over its
gathered pages: every query sees every selected key, and a KV head's query heads fold into one
query sequence as in cudnn_paged.py. Groups of one length run as one batched kernel call (the
chunk's partial last block is padded with zero queries, which contribute nothing to dK, dV); the
chunk's own keys are the causal local window of cudnn_paged.py; the two merge by their log-sum-exp.

The groups are known without reading the selection when the caller passes ``block_group`` (the
step's ``sparse_query_block_pages``: runs of that many blocks share one selection by construction) or
when the selection is one row expanded over the chunk's blocks (stride 0: oomb/sparse.py makes it so
when one group covers the chunk). Otherwise finding them reads the selection on the host: one device
synchronisation per call, which stalls the host's kernel launches behind the GPU.

Packed documents (``documents=``) need no mask, given selections as oomb/sparse.py makes them (a block
chooses among its first query's document's pages, that document's first page always among them, and
pages before the document only when it has fewer history pages than the budget). Only the document the
chunk starts in has history (cudnn_paged.py's segments). If it has at most the budget's pages of history,
the selection holds all of them: its queries read the history from the document's start as one dense
window. Otherwise every selected page is the document's, its first page first, and only that page may
hold keys of an earlier document: the page is read densely from the document's start, the rest of the
selection by the groups above. Queries of documents that start inside the chunk take no part in the
groups (forward: discarded; backward: dO = O = 0 and an lse above every score).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..documents import Documents
from .cudnn_paged import (
    CUDNN_KERNEL,
    FusedKernel,
    WindowedAttention,
    check_inputs,
    document_segments,
    local_backward,
    local_forward,
    merge_into,
)
from .reference import _check
from .reference_sparse import _check_selection, shared_by_all_blocks


def _pool_rows(pool: torch.Tensor, ids: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """Rows of a contiguous pool seen as (pages * Hkv, P * D), in (B, n_groups, Hkv, K) order."""
    return (ids * pool.shape[1] + heads).transpose(1, 2).reshape(-1)


@functools.cache
def _row_add_kernel():
    """triton_row_add.add_rows_, imported on first use; None without Triton (an optional dependency)."""
    try:
        from .triton_row_add import add_rows_  # local: Triton is optional
    except ImportError:
        return None
    return add_rows_


def _groups(selection: torch.Tensor, block_group: int | None = None) -> list[tuple[int, int]]:
    """Runs [b0, b1) of consecutive query blocks that share one selection (every sequence and head):
    runs of ``block_group`` blocks when given, else the runs of equal rows (read on the host)."""
    n = selection.shape[2]
    if n <= 1 or selection.shape[3] == 0 or shared_by_all_blocks(selection):
        return [(0, n)]
    if block_group is not None:
        return [(b0, min(b0 + block_group, n)) for b0 in range(0, n, block_group)]
    same = (selection[:, :, 1:] == selection[:, :, :-1]).all(dim=3).all(dim=1).all(dim=0).tolist()
    starts = [0] + [j + 1 for j, equal in enumerate(same) if not equal]
    return list(zip(starts, starts[1:] + [n], strict=True))


def _by_length(groups: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Groups of one length batch together without padding (runs such as [29, 1, 1, 1] blocks would
    otherwise pad every group to the longest)."""
    classes: dict[int, list[tuple[int, int]]] = {}
    for b0, b1 in groups:
        classes.setdefault(b1 - b0, []).append((b0, b1))
    return list(classes.values())


class _Layout:
    """Where the queries of some groups of equal length sit in one batched, folded kernel input."""

    def __init__(self, groups: list[tuple[int, int]], num_queries: int, page_size: int, device) -> None:
        self.num_groups = len(groups)
        self.group_blocks = groups[0][1] - groups[0][0]
        self.rows = self.group_blocks * page_size  # queries per group (the chunk's end pads)
        # Groups that tile exactly the chunk's queries in order (one selection per block, per group of
        # blocks dividing the chunk, per chunk): the layout is a permutation of dimensions, no gather,
        # and needs no index on the device.
        self.in_order = self.num_groups * self.rows == num_queries and groups[0][0] == 0 and all(
            b0 == a1 for (_, a1), (b0, _) in zip(groups, groups[1:], strict=False))
        # One group of exactly the chunk's queries (one selection per chunk): the layout is a reshape.
        self.whole = self.in_order and self.num_groups == 1
        self._groups, self._num_queries, self._page_size, self._device = groups, num_queries, page_size, device

    @functools.cached_property
    def _rows(self) -> torch.Tensor:
        """The queries of the groups in order, on the host; past the chunk's end for a partial block."""
        P = self._page_size
        return torch.cat([torch.arange(b0 * P, b1 * P) for b0, b1 in self._groups])

    @functools.cached_property
    def queries(self) -> torch.Tensor:
        """The groups' queries inside the chunk, on the device (the gather layout only)."""
        return self._rows[self._rows < self._num_queries].to(self._device, non_blocking=True)

    @functools.cached_property
    def rows_of_groups(self) -> torch.Tensor:
        """Every group row's query on the device; rows past the chunk's end read an appended zero row."""
        return self._rows.clamp(max=self._num_queries).to(self._device, non_blocking=True)

    @functools.cached_property
    def first_blocks(self) -> torch.Tensor:
        return torch.tensor([b0 for b0, _ in self._groups], dtype=torch.long).to(self._device, non_blocking=True)

    @functools.cached_property
    def num_valid(self) -> int:
        """Rows of the groups that are queries of the chunk."""
        if self.in_order:
            return self._num_queries
        return int((self._rows < self._num_queries).sum())

    def group_rows(self, selection: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, n_groups, K) int64: each group's selection (its first block's row)."""
        if self.in_order:
            return selection[:, :, ::self.group_blocks].long()
        return selection.long().index_select(2, self.first_blocks)

    def to_groups(self, x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        """(B, Hq, Lq[, D]) -> contiguous (B * n_groups, Hkv, G * rows[, D]); rows past the chunk are 0."""
        B, Hq, Lq = x.shape[:3]
        if self.whole:
            return x.contiguous().view((B, num_kv_heads, -1) + x.shape[3:])
        if self.in_order:  # one copy, where padding and gathering the rows would make three
            grouped = x.reshape((B, num_kv_heads, Hq // num_kv_heads, self.num_groups, self.rows) + x.shape[3:])
            grouped = grouped.transpose(2, 3).transpose(1, 2)  # (B, n_groups, Hkv, G, rows[, D])
            return grouped.contiguous().view((B * self.num_groups, num_kv_heads, -1) + x.shape[3:])
        padded = torch.cat([x, x.new_zeros((B, Hq, 1) + x.shape[3:])], dim=2)
        grouped = padded.index_select(2, self.rows_of_groups)  # (B, Hq, n_groups * rows[, D])
        grouped = grouped.reshape((B, num_kv_heads, Hq // num_kv_heads, self.num_groups, self.rows) + x.shape[3:])
        grouped = grouped.transpose(2, 3).transpose(1, 2)  # (B, n_groups, Hkv, G, rows[, D])
        return grouped.reshape((B * self.num_groups, num_kv_heads, -1) + x.shape[3:]).contiguous()

    def from_groups(self, y: torch.Tensor, batch: int, num_q_heads: int) -> torch.Tensor:
        """Inverse of to_groups for the groups' queries (``self.queries``, in that order): -> (B, Hq, n[, D])."""
        Hkv = y.shape[1]
        if self.whole:
            return y.reshape((batch, num_q_heads, self.rows) + y.shape[3:])
        y = y.reshape((batch, self.num_groups, Hkv, num_q_heads // Hkv, self.rows) + y.shape[3:])
        y = y.transpose(1, 2).transpose(2, 3).contiguous()  # (B, Hkv, G, n_groups, rows[, D])
        y = y.view((batch, num_q_heads, self.num_groups * self.rows) + y.shape[5:])
        return y[:, :, : self.num_valid]  # rows past the chunk's end come last


class SelectedPagesAttention:
    """reference_sparse.py's contract on a :class:`FusedKernel`."""

    def __init__(self, kernel: FusedKernel = CUDNN_KERNEL, windowed: WindowedAttention | None = None) -> None:
        self.kernel = kernel
        self.windowed = windowed or WindowedAttention(kernel)  # packed documents' dense windows

    def _check(self, q, k_pool, v_pool, page_table, query_start, selection) -> None:
        check_inputs(self.kernel, q, k_pool, v_pool)
        _check(q, k_pool, page_table, query_start)
        _check_selection(selection, q, k_pool)

    @staticmethod
    def _batches(q, k_pool, page_table, selection, block_group):
        """Per length of group: its layout and its (B, Hkv, n_groups, K) page ids and head indices."""
        B, Hkv = selection.shape[:2]
        for groups in _by_length(_groups(selection, block_group)):
            layout = _Layout(groups, q.shape[2], k_pool.shape[2], q.device)
            positions = layout.group_rows(selection)
            ids = page_table.long().gather(1, positions.reshape(B, -1)).reshape(positions.shape)
            heads = torch.arange(Hkv, device=q.device).reshape(1, Hkv, 1, 1).expand_as(ids)
            yield layout, ids, heads

    @staticmethod
    def _selected(pool, ids, heads) -> torch.Tensor:
        """Contiguous (B * n_groups, Hkv, K * P, D): each group's selected pages, per KV head.

        A contiguous pool is gathered as whole (page, head) rows of P * D values, already in the output's
        order: one vectorised row gather, where advanced indexing moves 2-byte elements one by one and
        the transpose copies everything once more (0.49 + ~0.4 s of the 128K default step's 4-layer
        profile, one selection per block)."""
        B, Hkv, n_groups, K = ids.shape
        P, D = pool.shape[2:]
        if pool.is_contiguous():
            return pool.view(-1, P * D).index_select(0, _pool_rows(pool, ids, heads)).view(B * n_groups, Hkv, K * P, D)
        pages = pool[ids, heads]  # (B, Hkv, n_groups, K, P, D)
        return pages.transpose(1, 2).reshape(B * n_groups, Hkv, K * P, D).contiguous()

    @staticmethod
    def _add_selected(pool, ids, heads, grad, order=None):
        """Add (B * n_groups, Hkv, K * P, D) gradients into the selected (page, head) slots; a page
        several groups selected gets each group's share, in the groups' order. The (small) indices are put
        in the gradient's order, so the gradient is read in place: no transposed copy of it. On CUDA one
        Triton kernel (triton_row_add.py) reads it and adds in float32, where torch would cast all of it
        to the pool's dtype first and sort-scatter the copy. Returns the indices' sort when the kernel ran
        (``order``: one made for the same ids and heads, e.g. dK's for dV: a sort is several kernels)."""
        P, D = pool.shape[2:]
        grad = grad.reshape(-1, P * D)  # (B, n_groups, Hkv, K) rows of P * D
        if pool.is_contiguous():
            rows, flat = _pool_rows(pool, ids, heads), pool.view(-1, P * D)
            kernel = _row_add_kernel() if pool.is_cuda else None
            if kernel is not None:  # the gradient read once, converted in registers
                if order is None:
                    from .triton_row_add import sorted_rows  # local: Triton is optional; the kernel came from there

                    order = sorted_rows(rows)
                kernel(flat, rows, grad.contiguous(), order)
                return order
            flat.index_put_((rows,), grad.to(pool.dtype), accumulate=True)
            return None
        grad = grad.to(pool.dtype)
        ids, heads = (x.transpose(1, 2).reshape(-1) for x in (ids, heads))
        pool.index_put_((ids, heads), grad.view(-1, P, D), accumulate=True)
        return None

    def sparse_attention_forward(self, q, k_pool, v_pool, page_table, query_start, scale, selection, *,
                                 block_group: int | None = None, documents: Documents | None = None):
        self._check(q, k_pool, v_pool, page_table, query_start, selection)
        B, Hq, Lq, D = q.shape
        if B * Lq == 0:
            return torch.empty_like(q), q.new_empty((B, Hq, Lq), dtype=torch.float32)
        q = q.contiguous()  # once, for the chunk's own keys and the groups (a view of it for one group per chunk)
        if documents is not None:
            return self._documents_forward(q, k_pool, v_pool, page_table, query_start, scale, selection, block_group,
                                           _no_window(documents))
        out, lse = local_forward(self.kernel, q, k_pool, v_pool, page_table, query_start, scale)
        if selection.shape[3] == 0:
            return out, lse
        out_h, lse_h = self._groups_forward(q, k_pool, v_pool, page_table, scale, selection, block_group)
        return merge_into(out_h, lse_h, out, lse, q.dtype)

    def _groups_forward(self, q, k_pool, v_pool, page_table, scale, selection, block_group):
        """(out, lse) of every query over its group's selected pages alone."""
        B, Hq = q.shape[:2]
        Hkv = k_pool.shape[1]
        out_h = torch.empty_like(q)  # every query is in one group
        lse_h = q.new_empty(q.shape[:3], dtype=torch.float32)
        for layout, ids, heads in self._batches(q, k_pool, page_table, selection, block_group):
            o, s = self.kernel.forward(layout.to_groups(q, Hkv), self._selected(k_pool, ids, heads),
                                       self._selected(v_pool, ids, heads), False, scale)
            o, s = layout.from_groups(o, B, Hq).to(out_h.dtype), layout.from_groups(s.reshape(o.shape[:3]), B, Hq)
            if layout.in_order:  # every query, in order
                out_h, lse_h = o, s
            else:
                out_h.index_copy_(2, layout.queries, o)
                lse_h.index_copy_(2, layout.queries, s)
        return out_h, lse_h

    def sparse_attention_backward(self, q, k_pool, v_pool, page_table, query_start, scale, selection, out, dout, lse,
                                  dk_pool, dv_pool, *, block_group: int | None = None,
                                  documents: Documents | None = None):
        self._check(q, k_pool, v_pool, page_table, query_start, selection)
        B, Hq, Lq, D = q.shape
        if B * Lq == 0:
            return torch.empty_like(q)
        # once each, for the chunk's own keys and the groups (views of them for one group per chunk)
        q, out, dout, lse = q.contiguous(), out.to(q.dtype).contiguous(), dout.to(q.dtype).contiguous(), lse.float()
        if documents is not None:
            return self._documents_backward(q, k_pool, v_pool, page_table, query_start, scale, selection, out, dout,
                                            lse, dk_pool, dv_pool, block_group, _no_window(documents))
        dq = local_backward(self.kernel, q, k_pool, v_pool, page_table, query_start, scale, out, dout, lse, dk_pool,
                            dv_pool)
        if selection.shape[3] == 0:
            return dq.to(q.dtype)
        batches = list(self._batches(q, k_pool, page_table, selection, block_group))
        total = None  # the float32 sum of dQ's partials, past the chunk's own
        for layout, ids, heads in batches:
            dq_h = self._batch_backward(layout, ids, heads, q, k_pool, v_pool, scale, out, dout, lse, dk_pool, dv_pool)
            if layout.in_order and len(batches) == 1 and dq.dtype == dq_h.dtype == q.dtype:
                # every query in one batch: the two partials' float32 sum rounded once, which torch's add of
                # two bf16 tensors is (the same bits as the float32 path below, without its copies)
                return torch.add(dq, dq_h)
            total = dq.float() if total is None else total
            _add_group_dq(total, layout, dq_h)
        return total.to(q.dtype)

    def _batch_backward(self, layout, ids, heads, q, k_pool, v_pool, scale, out, dout, lse, dk_pool, dv_pool):
        """One batch of groups' backward over their selected pages: adds dK, dV into the pages and returns
        dQ in the groups' layout."""
        Hkv = k_pool.shape[1]
        dq_h, dk, dv = self.kernel.backward(
            layout.to_groups(dout, Hkv), layout.to_groups(q, Hkv), self._selected(k_pool, ids, heads),
            self._selected(v_pool, ids, heads), layout.to_groups(out, Hkv), layout.to_groups(lse, Hkv), False, scale,
        )
        order = self._add_selected(dk_pool, ids, heads, dk)
        self._add_selected(dv_pool, ids, heads, dv, order)
        return layout.from_groups(dq_h, q.shape[0], q.shape[1])

    # --- packed documents (module docstring) ------------------------------------------------------
    def _documents_forward(self, q, k_pool, v_pool, page_table, query_start, scale, selection, block_group,
                           documents):
        outs, lses = [], []
        for b, plan in enumerate(_document_plans(documents, query_start, q.shape[2], k_pool.shape[2],
                                                 selection.shape[3])):
            rows, row_docs = slice(b, b + 1), documents.row(b)
            out, lse = self.windowed.documents_forward(q[rows], k_pool, v_pool, page_table[rows], query_start, scale,
                                                       plan.windows, None, row_docs)
            row_selection = plan.selected(selection[rows])
            if row_selection is not None:
                out_h, lse_h = self._groups_forward(q[rows], k_pool, v_pool, page_table[rows], scale, row_selection,
                                                    block_group)
                if plan.first_document_end < q.shape[2]:  # later documents' queries see no history
                    lse_h[:, :, plan.first_document_end:] = float("-inf")
                    out_h[:, :, plan.first_document_end:] = 0
                out, lse = merge_into(out_h, lse_h, out, lse, q.dtype)
            outs.append(out)
            lses.append(lse)
        return (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(lses))

    def _documents_backward(self, q, k_pool, v_pool, page_table, query_start, scale, selection, out, dout, lse,
                            dk_pool, dv_pool, block_group, documents):
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        for b, plan in enumerate(_document_plans(documents, query_start, q.shape[2], k_pool.shape[2],
                                                 selection.shape[3])):
            rows, row_docs = slice(b, b + 1), documents.row(b)
            q_b, out_b, dout_b, lse_b, dq_b = q[rows], out[rows], dout[rows], lse[rows], dq[rows]
            self.windowed.documents_backward(q_b, k_pool, v_pool, page_table[rows], query_start, scale, out_b,
                                             dout_b, lse_b, dk_pool, dv_pool, plan.windows, dq_b, row_docs)
            row_selection = plan.selected(selection[rows])
            if row_selection is None:
                continue
            e = plan.first_document_end
            if e < q.shape[2]:
                # Later documents' queries add nothing: with dO = O = 0 their dS is P * (0 - 0) = 0, and an
                # lse above every score keeps P = 0 (an lse they have from their own keys could overflow it).
                out_b, dout_b, lse_b = out_b.clone(), dout_b.clone(), lse_b.clone()
                out_b[:, :, e:], dout_b[:, :, e:], lse_b[:, :, e:] = 0, 0, NO_HISTORY_LSE
            for layout, ids, heads in self._batches(q_b, k_pool, page_table[rows], row_selection, block_group):
                dq_h = self._batch_backward(layout, ids, heads, q_b, k_pool, v_pool, scale, out_b, dout_b, lse_b,
                                            dk_pool, dv_pool)
                _add_group_dq(dq_b, layout, dq_h)
        return dq.to(q.dtype)


NO_HISTORY_LSE = 1e30
"""The log-sum-exp given to the selected pages' backward for queries of documents that start inside the
chunk (they see no history): exp(score - 1e30) is 0 for every score, so they add nothing."""


def _add_group_dq(total: torch.Tensor, layout: _Layout, dq_h: torch.Tensor) -> None:
    """Add one batch of groups' dQ (already in (B, Hq, queries, D) order) into the float32 ``total``."""
    if layout.in_order:
        total.add_(dq_h)  # float32 sums of the bf16 partials, as index_add_'s
    else:
        total.index_add_(2, layout.queries, dq_h.float())


def _no_window(documents: Documents) -> Documents:
    if documents.window is not None:
        raise NotImplementedError("sliding-window layers in sparse mode are not supported by the cudnn backend's "
                                  "selected pages; use backend='triton' or 'torch'")
    return documents


@dataclass(frozen=True)
class _DocumentPlan:
    """How one row of a chunk with packed documents reads its history (module docstring)."""

    windows: list[tuple[int, int]]
    """Key windows read densely per document: the chunk's own keys, and the history as the case needs."""
    first_document_end: int
    """Queries [0, this) of the chunk are in the document it starts in, the only one with history."""
    drop_first_page: bool | None
    """None: no selected page is read (the windows hold all the history a query sees); True: the selection's
    first page (the document's partial first page, in ``windows``) is left out; False: all of it is read."""

    def selected(self, selection: torch.Tensor) -> torch.Tensor | None:
        """The selected pages the fused kernel reads, or None."""
        if self.drop_first_page is None:
            return None
        selection = selection[..., 1:] if self.drop_first_page else selection
        return selection if selection.shape[3] else None


def _document_plans(documents: Documents, query_start: int, num_queries: int, page_size: int,
                    budget: int) -> list[_DocumentPlan]:
    """Per row: the document the chunk starts in (the only one with history) either has at most
    ``budget`` history pages, so the selection holds all of them and its history is one dense window
    from the document's start; or more, so every page the selection holds is the document's, its first
    page first (a sink), and only that page may start before the document: a dense window from the
    document's start to the page's end, the rest of the selection on the fused kernel."""
    own = (query_start, query_start + num_queries)
    plans = []
    for segments in document_segments(documents, query_start, num_queries):
        _, first_end, start = segments[0]
        P = page_size
        history_pages = query_start // P - start // P
        if history_pages <= budget:
            plans.append(_DocumentPlan(([(0, query_start)] if history_pages > 0 else []) + [own], first_end, None))
        elif start % P:
            page = start // P * P
            plans.append(_DocumentPlan([(page, page + P), own], first_end, True))
        else:
            plans.append(_DocumentPlan([own], first_end, False))
    return plans
