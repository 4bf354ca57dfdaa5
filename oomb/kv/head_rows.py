"""Sparse offload by (page, KV head) rows: each head's selected pages move, not every head of their union.

A sparse call's selection names pages per KV head, but kv/sparse_staging.py stages the union of every
head's pages with all their heads (a page's K is Hkv x P x D): when the heads choose different pages,
a call moves up to Hkv times the bytes its attention reads, and finding the union reads the selection
on the host (in stage 1 a device sync per layer and chunk). With one selection per chunk (stride 0
over the blocks, oomb/sparse.py) a call can instead stage *virtual pages*: staged row j of a sequence
holds, for every head h, head h's j-th selected page, gathered as (page, head) rows of P x D values by
one index kernel per kind. The backend is handed the virtual selection (row j for every head; its order
is the selection's, so every sum runs in the same order and the result is bit-identical) and a page
table that maps virtual position j to row j and the chunk's own positions to the rows after them.

Gradients go back the same way, one (page, head) row each. The host's per-position flag ``grad_on_host``
says a page's gradients were written this step; a head row alone would leave the page's other heads
unwritten, so the first write-back of a position zeroes all its heads first. Virtual positions stay
below the chunk's first page: a selection is never longer than the history (one that would cover it
is the dense path), which ``_stages_head_rows`` checks all the same.

Rerank's candidate keys (stage 1, ``scoring_head_rows``) move the same way: the score reads them at
virtual positions and writes each score to its candidate's own (oomb/sparse.py ``key_pages``). Leak-free
scoring masks the last history page by its position, so its candidates keep their page layout (moved
without the union's sync by kv/sparse_staging.py's in-place path).

Why: the 7B shape's 1M sparse+offload step (first 2 layers, one H200) took 28.56 s with it against
33.61 s with the union (``offload-staging-1m`` in docs/results.md). Context parallelism keeps the union
(its selections point at pages of other ranks). Packed documents' backends read a document's first page by
its position and mask by position what lies before it: where every row's selection is its document's own
pages led by that first page (a sink; the document has more history pages than the selection reads), the
virtual pages are numbered from that page on, so it sits at its own position and every other selected page
inside the document; other selections with documents stage in place in stage 1 (kv/sparse_staging.py) and
as the union in stage 2. Rerank's candidate keys move as (page, head) rows with documents too (the score
reads no document; in place, every candidate page would move with all its heads, Hkv times the bytes).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..attention.reference_sparse import shared_by_all_blocks
from .mapped import index_tensor, rows_of
from .store import ChunkSpan


@dataclass(frozen=True)
class _Layout:
    """A call's (page, head) rows: ``n`` staged rows per sequence (the virtual pages, then the chunk's)."""

    n: int
    table: torch.Tensor  # (B, chunk's last page) int32: virtual positions, then the chunk's own
    source: torch.Tensor  # host (sequence, position, head) rows of the virtual pages
    target: torch.Tensor  # their staged (row, head) rows
    virtual: torch.Tensor  # (B, Hkv, n_blocks, K) int32 selection of the virtual pages, stride 0 over blocks
    own_target: torch.Tensor  # staged rows of the chunk's own pages (every head)


@dataclass
class _StagedSelection:
    """A sparse call's pages on the GPU: ``num_pages`` per sequence (its selections' union that some
    query sees, then the chunk's own), after them one zero page where unseen selected pages point,
    and the page table of that layout."""

    pages: dict[str, torch.Tensor]
    table: torch.Tensor
    history: list[int]  # the selections' union (seen pages): positions of the first rows
    runs: list[tuple[int, int, int]] | None  # copied run by run (None: gathered by kernels)
    num_pages: int
    ready: torch.cuda.Event | None  # the copy stream has filled them
    stage_one: bool  # the chunk's own pages came from the GPU (stage 1)
    own_chunk: bool = True  # the chunk's own pages are the last rows (context parallel: on its owner only)
    selection: torch.Tensor | None = None  # staged as (page, head) rows: the virtual selection the backend reads
    head_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (host rows, staged rows) of (page, head) rows


class HeadRowStaging:
    """Methods of ``OffloadedKVStore`` (through kv/sparse_staging.py's ``SparseStaging``) that stage a
    call's selection as (page, head) rows; they read the store's host tensors and bookkeeping."""

    def _gathers_by_device_index(self, documents_allowed: bool = False) -> bool:
        """Whether pages can move by index tensors on the device, without the host reading the positions:
        kernels that read host memory (mapped slabs, or a CPU device), and no context parallelism (a
        selection points at pages other ranks hold). Packed documents only where ``documents_allowed``:
        where nothing finds a page's document from its staged position. So for pages kept at their real
        positions in the page table (kv/sparse_staging.py's in-place path: a block whose document holds
        fewer history pages than it reads fills its selection up with earlier pages, which the backend masks
        by position, so they may move too), and for rerank's candidate keys (the score masks no document;
        top_pages does, on the candidates' own positions). An attention call's virtual positions (head
        rows) would hide where each page's document starts. Otherwise copies run by run, or the union,
        stage them."""
        if self.context is not None or (self.document_starts is not None and not documents_allowed):
            return False
        return self.mapped_host is not None or self.device.type != "cuda"

    def _stages_head_rows(self, chunk: ChunkSpan, selection: torch.Tensor, scoring: bool = False) -> bool:
        """Whether this call's selection (host or device) can move as (page, head) rows; ``scoring``: rerank's
        candidate keys, which may with packed documents too, as may a selection of its documents' own pages
        (``_document_first_pages``)."""
        if not shared_by_all_blocks(selection):
            return False
        documents_allowed = scoring or self._document_first_pages(chunk, selection.shape[3]) is not None
        if not self._gathers_by_device_index(documents_allowed=documents_allowed):
            return False
        first, _ = self._page_range(chunk)
        return 0 < selection.shape[3] <= first

    def _document_first_pages(self, chunk: ChunkSpan, selected: int) -> torch.Tensor | None:
        """Packed documents: (B,) host positions of the first page of the document each row's chunk starts in,
        where every row's selection is that document's own pages led by that page: the document has more history
        pages than the selection reads, and each block's selection begins with its document's first page (a sink,
        ``document_sinks``). Head rows then number their virtual pages from it, so the backends find the
        document's first page at its own position and every other selected page inside the document. None
        otherwise (and without packed documents)."""
        if self.document_starts is None or not self.document_sinks:
            return None
        firsts = torch.div(self.document_starts[:, chunk.start], self.page_size, rounding_mode="floor")
        return firsts if bool((chunk.start // self.page_size - firsts > selected).all()) else None

    def _head_rows_of(self, pages: torch.Tensor) -> torch.Tensor:
        """(n, Hkv, P, D) pages as n * Hkv rows of P x D values."""
        return rows_of(pages.reshape(-1, *pages.shape[-2:]))

    def _host_layer_rows(self, kind: str, index: int) -> torch.Tensor:
        """Offloaded global layer ``index``'s host pages, (sequence x position, Hkv, P, D), as kernels on the
        device read them: mapped into its address space, or the host tensor itself on a CPU device."""
        if self.mapped_host is not None:
            return self._mapped_layer(kind, index).flatten(0, 1)
        assert self.device.type == "cpu", "without mapped slabs a CUDA device gathers run by run"
        return self._host_layer(kind, index).flatten(0, 1)

    def _host_head_rows(self, kind: str, index: int) -> torch.Tensor:
        """The same as (sequence, position, head) rows of P x D values."""
        return self._head_rows_of(self._host_layer_rows(kind, index))

    def _head_row_layout(self, index: int, layer: int, chunk: ChunkSpan, pages: torch.Tensor,
                         first_pages: torch.Tensor | None = None) -> _Layout:
        """Where a call's (page, head) rows come from and go, its page table and virtual selection: virtual
        positions 0..K-1, or from each row's ``first_pages`` on (packed documents, ``_document_first_pages``)."""
        first, last = self._page_range(chunk)
        B, Hkv, n_blocks, K = pages.shape
        n, dev = K + last - first, self.device
        if not bool(self.kv_on_host[index, :first].all()):  # (the chunk's own: checked where read from the host)
            raise RuntimeError(f"pages of offloaded layer {layer} were read before they were written")
        positions = pages[:, :, 0].to(dev, non_blocking=True).long()  # (B, Hkv, K); a host copy is pinned
        b = torch.arange(B, device=dev)[:, None, None]
        h = torch.arange(Hkv, device=dev)[None, :, None]
        rows = torch.arange(B, device=dev)[:, None] * n + torch.arange(n, device=dev)[None, :]
        table = torch.zeros((B, last), dtype=torch.int32, device=dev)
        if first_pages is None:
            table[:, :K] = rows[:, :K].to(torch.int32)
            virtual = torch.arange(K, dtype=torch.int32, device=dev).expand(B, Hkv, n_blocks, K)  # stride 0
        else:  # from the host's positions: no copy to the device to wait for
            numbered = torch.stack([torch.arange(p, p + K, device=dev) for p in first_pages.tolist()])  # (B, K)
            table.scatter_(1, numbered, rows[:, :K].to(torch.int32))
            virtual = numbered.to(torch.int32)[:, None, None, :].expand(B, Hkv, n_blocks, K)
        table[:, first:last] = rows[:, K:].to(torch.int32)
        return _Layout(
            n=n, table=table,
            source=((b * self.host_pages + positions) * Hkv + h).reshape(-1),  # host (sequence, position, head)
            target=((b * n + torch.arange(K, device=dev)) * Hkv + h).reshape(-1),  # staged (row, head)
            virtual=virtual, own_target=rows[:, K:].reshape(-1))

    @contextmanager
    def scoring_head_rows(self, index: int, layer: int, chunk: ChunkSpan, candidates: torch.Tensor):
        """Stage 1's candidate keys as (page, head) rows, then the chunk's own keys (still on the GPU):
        (keys, page table, virtual candidates) for oomb/sparse.py's rerank score."""
        layout = self._head_row_layout(index, layer, chunk, candidates)
        B, n = self.batch_size, layout.n
        own_keys = self._fresh_kv[layer, chunk.index][0]
        keys = torch.empty((B * n, *self.host["k"].shape[3:]), dtype=self.host["k"].dtype, device=self.device)
        with self._on_copy_stream(after_compute=True):  # after the history's writes to the host
            self._head_rows_of(keys).index_copy_(
                0, layout.target, self._host_head_rows("k", index).index_select(0, layout.source))
            keys.index_copy_(0, layout.own_target, own_keys)
            ready = self._copies_recorded()
        self._keep_alive(layout.source, layout.target, layout.own_target, keys)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        yield keys, layout.table, layout.virtual

    def _stage_head_rows(self, index: int, layer: int, chunk: ChunkSpan, selection: torch.Tensor, grads: bool):
        """Start moving a call's (page, head) rows and the chunk's own pages to the GPU; returns the
        staged selection with its virtual selection and page table (module docstring)."""
        first, last = self._page_range(chunk)
        B, Hkv, n_blocks, K = selection.shape
        own, dev = last - first, self.device
        layout = self._head_row_layout(index, layer, chunk, selection, self._document_first_pages(chunk, K))
        n, table, source, target, virtual = layout.n, layout.table, layout.source, layout.target, layout.virtual
        own_target = layout.own_target
        stage_one = not grads and (layer, chunk.index) in self._fresh_kv
        fresh = self._fresh_kv.pop((layer, chunk.index)) if stage_one else None
        # The chunk's own pages, every head: from the host, unless stage 1 still holds them on the GPU.
        own_source = None if fresh is not None else self._rows(self.host_pages, range(first, last))
        kinds = ("k", "v", "dk", "dv") if grads else ("k", "v")
        staged = {kind: torch.empty((B * n, *self.host[kind].shape[3:]), dtype=self.host[kind].dtype, device=dev)
                  for kind in kinds}
        if fresh is None and not bool(self.kv_on_host[index, first:last].all()):
            raise RuntimeError(f"pages of offloaded layer {layer} were read before they were written")
        history, stale_rows = [], ([], [])
        if grads:  # which gradients were written back this step: read from the selection's host copy
            host_positions = self._host_selection(layer, chunk, selection)  # (B, Hkv, K) int64
            history = torch.unique(host_positions).tolist()
            on_host = self.grad_on_host[index]
            j = torch.arange(K)
            stale = ((torch.arange(B)[:, None, None] * n + j) * Hkv + torch.arange(Hkv)[None, :, None])[
                ~on_host[host_positions]]
            own_off = torch.nonzero(~on_host[first:last]).flatten()
            stale_rows = (stale.tolist(), (torch.arange(B)[:, None] * n + K + own_off[None, :]).flatten().tolist())
        with self._on_copy_stream(after_compute=True):  # after the history's writes to the host
            # Made on the copy stream, which reads them (made on the compute stream, the allocator could
            # hand their memory to a later kernel before the copies run).
            stale_history, stale_own = (index_tensor(rows, dev) if rows else None for rows in stale_rows)
            for kind, pages in staged.items():
                if kind in ("dk", "dv") and not bool(self.grad_on_host[index].any()):
                    pages.zero_()  # accumulation begins here: nothing to read
                    continue
                head_rows = self._host_head_rows(kind, index).index_select(0, source)
                self._head_rows_of(pages).index_copy_(0, target, head_rows)
                if fresh is not None:
                    pages.view(B, n, *pages.shape[1:])[:, K:].copy_(fresh[kind == "v"].view(B, own, *pages.shape[1:]))
                else:
                    host = rows_of(self._host_layer_rows(kind, index))
                    rows_of(pages).index_copy_(0, own_target, host.index_select(0, own_source))
                if kind in ("dk", "dv"):
                    if stale_history is not None:
                        self._head_rows_of(pages).index_fill_(0, stale_history, 0)
                    if stale_own is not None:
                        rows_of(pages).index_fill_(0, stale_own, 0)
            ready = self._copies_recorded()
        self._keep_alive(source, target, own_target, *staged.values())
        if own_source is not None:
            self._keep_alive(own_source)
        self.staged_history_pages += K
        return _StagedSelection(staged, table, history, None, n, ready, stage_one=stage_one, selection=virtual,
                                head_rows=(source, target))

    def _host_selection(self, layer: int, chunk: ChunkSpan, selection: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, K) int64 positions of the call's selection on the host: its copy kept since stage 1
        (complete by stage 2: no device sync), else read from ``selection``."""
        host = self._selections.get((chunk.index, layer))
        if host is None or host.device.type != "cpu" or host.shape != selection.shape:
            host = selection.cpu()
        else:
            copied = self._selection_copied.get((chunk.index, layer))
            if copied is not None:
                copied.synchronize()
        return host[:, :, 0].long()

    def _finish_head_rows_backward(self, index: int, staged) -> None:
        """Send the (page, head) rows' gradients back; a position written back for the first time this
        step has its other heads zeroed first (its flag covers every head)."""
        source, target = staged.head_rows
        new = [p for p in staged.history if not bool(self.grad_on_host[index, p])]
        with self._on_copy_stream(after_compute=True):
            for kind in ("dk", "dv"):
                if new:
                    rows_of(self._host_layer_rows(kind, index)).index_fill_(
                        0, self._rows(self.host_pages, new), 0)
                self._host_head_rows(kind, index).index_copy_(
                    0, source, self._head_rows_of(staged.pages[kind]).index_select(0, target))
        self.grad_on_host[index, staged.history] = True
