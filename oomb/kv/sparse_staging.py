"""Sparse mode of the host tier (kv/offload.py): only the pages a sparse call selected move.

A sparse call (docs/sparse.md) stages the union of the pages its query blocks selected plus the
chunk's own pages, with a page table of the staged layout: gathered from the mapped host slabs by one
kernel per kind (kv/mapped.py), or copied run by run where the device cannot address them. After a
backward the history pages' gradients go back to the host and the chunk's own are kept.

* Stage 1's selections wait in host memory until stage 2 needs them (``save_selection``), so only the
  page summaries of the store grow with the context on the GPU. In stage 2 the next call's pages are
  therefore known, and each call stages them while it computes (``OffloadedKVStore._prefetch``).
* Stage 1's exact page scores move only keys: those of the candidate pages, from the host, and the
  chunk's own, still on the GPU (``scoring_keys``).
* Stage 1 without a device sync (the in-place path): a selection (or candidate set) that one group
  shares over the chunk's blocks (stride 0, oomb/sparse.py) and that (page, head) rows do not take
  (kv/head_rows.py; leak-free rerank's candidate keys, which keep their page layout) is staged as it
  lies on the GPU, every KV head's pages in turn, gathered by index from the host and placed in the
  page table by a scatter: the host never reads it. A page several heads chose moves once per head (the
  same bytes, so any of its slots is read alike). Packed documents take it too (the pages keep their
  positions); other selections and context parallelism take the union (``_selected_columns``), whose
  positions the host reads: one sync per layer and chunk, two with rerank's candidate keys.
* Packed documents: a query block whose document holds fewer history pages than it reads fills its
  selection up with pages wholly before the document (oomb/sparse.py), which the backend masks. The
  union leaves those on the host: the page table sends them to one zero page after every sequence's rows
  (the result is bit-identical to reading the real pages); the in-place path moves them, as it must not
  read the selection to leave them out.
* Context parallel: only this rank's selected pages and, on its owner, the chunk's own move; the
  selected pages of other ranks point at the zero page too.

``SparseStaging`` is a mixin of ``OffloadedKVStore``: it reads the store's host tensors, its
bookkeeping (``kv_on_host``, ``grad_on_host``) and its copy stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..attention.reference_sparse import shared_by_all_blocks
from .head_rows import HeadRowStaging, _StagedSelection
from .host_slabs import _load_grads
from .mapped import index_tensor, rows_of
from .store import ChunkSpan, WindowView

__all__ = ["SparseStaging"]

class SparseStaging(HeadRowStaging):
    """The sparse-mode methods of ``OffloadedKVStore`` (module docstring); the dense streaming and the
    page bookkeeping stay in kv/offload.py, staging by (page, head) rows in kv/head_rows.py."""

    # --- stage 1's selections wait in host memory -------------------------------------------------
    def save_selection(self, layer: int, chunk: ChunkSpan, selection: torch.Tensor | None) -> None:
        """Keep an offloaded layer's selection on the host until stage 2 needs it: then only the page
        summaries of the store grow with the context on the GPU (about 1/3 of the growth otherwise,
        e.g. 2.3 of 6.8 MB per 10K tokens of the 7B shape at budget 64)."""
        if selection is not None and self._offloaded(layer) is not None:  # on a CPU device: a copy, as tested
            # One row shared by every block (stride 0, oomb/sparse.py) stays one row, expanded again.
            rows = selection[:, :, :1] if shared_by_all_blocks(selection) else selection
            host = torch.empty(rows.shape, dtype=selection.dtype, pin_memory=self.device.type == "cuda")
            host.copy_(rows, non_blocking=True)  # ordered before stage 2's copy back: same stream
            if self.device.type == "cuda":
                self._selection_copied[chunk.index, layer] = torch.cuda.Event()
                self._selection_copied[chunk.index, layer].record()
            selection = host.expand(selection.shape)
        super().save_selection(layer, chunk, selection)

    def _selected_columns(self, layer: int, chunk: ChunkSpan, selection: torch.Tensor) -> tuple[list[int], bool]:
        """The distinct history positions of ``selection`` (the one saved for (chunk, layer)) that some
        query of the call sees, and whether it selects others. Packed documents: a query block whose
        document holds fewer history pages than it reads fills its selection up with pages wholly
        before the document (oomb/sparse.py), which the backend masks; those are not staged. Read from
        the selection's host copy when there is one: in stage 2 that copy is long complete, so no
        device sync."""
        host = self._selections.get((chunk.index, layer))
        if host is None or host.shape != selection.shape:
            host = selection.cpu()  # one device sync
        else:
            copied = self._selection_copied.get((chunk.index, layer))
            if copied is not None:
                copied.synchronize()  # stage 1: waits for the copy just made (a sync, as .cpu() would be)
        if self.document_starts is None:
            return torch.unique(host).tolist(), False
        P, positions = self.page_size, host.long()
        # Block j's queries see no key before its first query's document start (starts never decrease).
        block_starts = self.document_starts[:, chunk.start:chunk.end:P]  # (B, n_blocks)
        seen = (positions + 1) * P > block_starts[:, None, :, None]
        return torch.unique(positions[seen]).tolist(), not bool(seen.all())

    def selection(self, layer: int, chunk: ChunkSpan) -> torch.Tensor | None:
        selection = super().selection(layer, chunk)
        if selection is not None and selection.device != self.device:
            if shared_by_all_blocks(selection):  # moves one row; stays a stride-0 view (no sync to group it)
                return selection[:, :, :1].to(self.device, non_blocking=True).expand(selection.shape)
            selection = selection.to(self.device, non_blocking=True)
        return selection

    # --- only the selected pages move -------------------------------------------------------------
    @contextmanager
    def selected_pages(self, layer: int, chunk: ChunkSpan, selection: torch.Tensor, grads: bool):
        """Stage the union of the pages any query block selected plus the chunk's own pages (gathered
        by kernels from the mapped host slabs, or copied run by run), with a page table of the staged
        layout; after a backward, the history pages' gradients go back to the host and the chunk's
        own are kept. In stage 2 the next call's pages are known (its selection waits on the host),
        so they are staged while this call and the rest of its layer compute."""
        index = self._offloaded(layer)
        if index is None:
            with super().selected_pages(layer, chunk, selection, grads) as view:
                yield view
            return
        staged = None
        if self._prefetched is not None and self._prefetched[0] == (layer, chunk.index, grads):
            staged = self._prefetched[1]  # started during the previous call
            self.prefetch_hits += 1
        self._prefetched = None
        if staged is None:
            staged = self._stage_selection(index, layer, chunk, selection, grads)
        if staged.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(staged.ready)
        pages = staged.pages
        yield WindowView((0, chunk.end), pages["k"], pages["v"], staged.table, pages.get("dk"), pages.get("dv"),
                         selection=staged.selection)
        if grads:
            self._finish_selected_backward(index, chunk, staged)
        self._prefetch(self._next_call(layer, chunk, grads, stage_one=staged.stage_one))

    @contextmanager
    def scoring_keys(self, layer: int, chunk: ChunkSpan, history: torch.Tensor, by_head: bool = False
                     ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Stage 1 of an offloaded layer: only keys move, those of the distinct pages in ``history``
        (from the host, as selected pages move) and the chunk's own (still on the GPU), with a page
        table of the staged layout. One device sync, to read the positions, unless the in-place path
        or, with ``by_head``, (page, head) rows take them (kv/head_rows.py: then the third item is the
        virtual positions to read ``history``'s keys at). Context parallel: only the pages this rank
        holds (the others' positions point at row 0; the score masks them)."""
        index = self._offloaded(layer)
        if index is None:
            with super().scoring_keys(layer, chunk, history, by_head) as keys:
                yield keys
            return
        if (layer, chunk.index) not in self._fresh_kv:
            raise RuntimeError(f"scoring keys of offloaded layer {layer} are staged in stage 1, after its write")
        fresh = self._fresh_kv[layer, chunk.index]  # None: another context-parallel rank holds the chunk
        first, last = self._page_range(chunk)
        if by_head and self._stages_head_rows(chunk, history, scoring=True):
            with self.scoring_head_rows(index, layer, chunk, history) as keys:
                yield keys
            return
        in_place = self._in_place_pages(history)
        if in_place is not None:
            staged = self._stage_in_place(index, layer, chunk, in_place, ("k",), fresh[:1])
            yield staged.pages["k"], staged.table, None
            return
        positions = [p for p in torch.unique(history.cpu()).tolist() if self._holds(p)]
        columns = positions + (list(range(first, last)) if fresh is not None else [])
        n, B, own = len(columns), self.batch_size, last - first
        table = torch.zeros((B, last), dtype=torch.int32)
        table[:, columns] = (torch.arange(B)[:, None] * n + torch.arange(n)[None, :]).to(torch.int32)
        table = table.to(self.device, non_blocking=True)
        keys = torch.zeros if n == 0 else torch.empty  # no column: one zero row for the table's zeros
        keys = keys((max(B * n, 1), *self.host["k"].shape[3:]), dtype=self.host["k"].dtype, device=self.device)
        with self._on_copy_stream(after_compute=True):  # after the history's writes to the host
            if self.mapped_host is not None:
                self._gather_pages(index, positions, {"k": keys})
            else:
                self._copy_runs(index, _runs(positions, self.grad_on_host[index]), {"k": keys})
            ready = self._copies_recorded()
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        self._keep_alive(keys)
        if fresh is not None:
            for b in range(B):
                keys[b * n + len(positions):(b + 1) * n].copy_(fresh[0][b * own:(b + 1) * own])
        yield keys, table, None

    def _stage_selection(self, index: int, layer: int, chunk: ChunkSpan, selection: torch.Tensor,
                         grads: bool) -> _StagedSelection:
        """Start moving a sparse call's pages (and, for backward, gradients or zeros) to the GPU: the
        union of its selections that some query sees, then the chunk's own pages. Selected pages no
        query sees (packed documents) stay on the host: the page table sends them to one zero page
        after every sequence's rows, so the backend, which masks their keys, reads finite values and
        adds its zero gradients there (the result is bit-identical to reading the real pages).
        Context parallel: only this rank's selected pages and, on its owner, the chunk's own move; the
        selected pages of other ranks point at the zero page too (the backend reads none of them)."""
        if self._stages_head_rows(chunk, selection):
            return self._stage_head_rows(index, layer, chunk, selection, grads)
        if not grads and (layer, chunk.index) in self._fresh_kv:
            in_place = self._in_place_pages(selection)
            if in_place is not None:  # stage 1, one selection for the chunk: no device sync
                return self._stage_in_place(index, layer, chunk, in_place, ("k", "v"),
                                            self._fresh_kv.pop((layer, chunk.index)))
        first, last = self._page_range(chunk)
        history, unseen = self._selected_columns(layer, chunk, selection)
        held = [p for p in history if self._holds(p)]
        unseen, history = unseen or len(held) < len(history), held
        own_chunk = self.owns(chunk)
        columns = history + (list(range(first, last)) if own_chunk else [])
        n, B = len(columns), self.batch_size
        table = torch.full((B, last), B * n if unseen else 0, dtype=torch.int32)
        table[:, columns] = (torch.arange(B)[:, None] * n + torch.arange(n)[None, :]).to(torch.int32)
        table = table.to(self.device, non_blocking=True)
        kinds = ("k", "v", "dk", "dv") if grads else ("k", "v")
        stage_one = not grads and (layer, chunk.index) in self._fresh_kv
        fresh = self._fresh_kv.pop((layer, chunk.index)) if stage_one else None
        self.staged_history_pages += len(history)
        # Stage 1 attends to the chunk's own pages straight from the GPU; otherwise all come from the host.
        from_host = history if fresh is not None else columns
        if not bool(self.kv_on_host[index, from_host].all()):
            raise RuntimeError(f"pages of offloaded layer {layer} were read before they were written")
        # Allocated on the compute stream, which reads them; filled on the copy stream.
        staged = {kind: torch.empty((B * n + int(unseen), *self.host[kind].shape[3:]), dtype=self.host[kind].dtype,
                                    device=self.device) for kind in kinds}
        if unseen:
            for pages in staged.values():
                pages[B * n].zero_()  # the zero page of the unseen selections
        rows = {kind: pages[:B * n] for kind, pages in staged.items()}  # every sequence's n pages
        with self._on_copy_stream(after_compute=True):
            if self.mapped_host is not None:
                self._gather_pages(index, from_host, rows)
                runs = None
            else:
                runs = _runs(history, self.grad_on_host[index]) + _runs(
                    columns[len(history):], self.grad_on_host[index], offset=len(history))
                self._copy_runs(index, [r for r in runs if fresh is None or r[0] < first], rows)
            if fresh is not None:  # the chunk's own pages, after the history ones
                own = last - first
                for b in range(B):
                    for kind, pages in zip(("k", "v"), fresh, strict=True):
                        rows[kind][b * n + len(history):(b + 1) * n].copy_(pages[b * own:(b + 1) * own])
            ready = self._copies_recorded()
        self._keep_alive(*staged.values())
        return _StagedSelection(staged, table, history, runs, n, ready, stage_one=stage_one, own_chunk=own_chunk)

    def _in_place_pages(self, pages: torch.Tensor) -> torch.Tensor | None:
        """(B, Hkv * K) int64 page positions (B, K where every head reads the same), on the device, of a
        selection or candidate set (B, Hkv, n_blocks, K) that one group shares over the chunk's blocks, when
        stage 1 can stage them without reading them on the host (module docstring); else None. Needs kernels
        that gather from host memory (mapped slabs, or a CPU device) and no context parallelism. With packed
        documents the pages a selection fills up with (wholly before its document) move too: the backend
        masks them."""
        if not shared_by_all_blocks(pages) or not self._gathers_by_device_index(documents_allowed=True):
            return None
        if pages.stride(1) == 0:  # every KV head reads the same pages (oomb/sparse.py's recent pages): each once
            return pages[:, 0, 0].long()
        return pages[:, :, 0].reshape(pages.shape[0], -1).long()

    def _stage_in_place(self, index: int, layer: int, chunk: ChunkSpan, pages: torch.Tensor, kinds: tuple[str, ...],
                        fresh: tuple[torch.Tensor, ...]) -> _StagedSelection:
        """Stage 1's pages of a call without a device sync: per sequence the ``pages`` (B, m) positions
        (device, duplicates allowed) gathered from the host, then the chunk's own pages (``fresh``, still
        on the GPU, per kind), and the page table of that layout, built on the device."""
        first, last = self._page_range(chunk)
        if not bool(self.kv_on_host[index, :first].all()):
            raise RuntimeError(f"pages of offloaded layer {layer} were read before they were written")
        B, m = pages.shape
        own = last - first
        n = m + own
        slots = (torch.arange(B, device=self.device)[:, None] * n
                 + torch.arange(n, device=self.device)[None, :])  # (B, n): row of each staged page
        table = torch.zeros((B, last), dtype=torch.int32, device=self.device)
        table.scatter_(1, pages, slots[:, :m].to(torch.int32))  # a page chosen twice: either copy, the same bytes
        table[:, first:last] = slots[:, m:].to(torch.int32)
        source = (torch.arange(B, device=self.device)[:, None] * self.host_pages + pages).reshape(-1)
        target = slots[:, :m].reshape(-1)
        staged = {kind: torch.empty((B * n, *self.host[kind].shape[3:]), dtype=self.host[kind].dtype,
                                    device=self.device) for kind in kinds}
        with self._on_copy_stream(after_compute=True):  # after the history's writes to the host
            for kind, rows in staged.items():
                if m:
                    host = rows_of(self._host_layer_rows(kind, index))  # kv/head_rows.py
                    rows_of(rows).index_copy_(0, target, host.index_select(0, source))
            ready = self._copies_recorded()
        self._keep_alive(source, target, *staged.values())
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        for rows, own_pages in zip(staged.values(), fresh, strict=True):
            rows.view(B, n, *rows.shape[1:])[:, m:].copy_(own_pages.view(B, own, *own_pages.shape[1:]))
        self.staged_history_pages += m
        return _StagedSelection(staged, table, [], None, n, None, stage_one=True)

    def _gather_pages(self, index: int, positions: list[int], staged: dict[str, torch.Tensor]) -> None:
        """One kernel per kind reads the pages at ``positions`` of every sequence from host memory into
        the first len(positions) of each sequence's rows of ``staged`` (gradients that were never
        written back this step read as zeros)."""
        B, count = self.batch_size, len(positions)
        if count == 0:  # context parallel: no page of the call on this rank (nor in its slabs, maybe)
            return
        n = staged["k"].shape[0] // B
        source = self._rows(self.host_pages, self._host_positions(positions))
        target = None if count == n else self._rows(n, range(count))
        on_host = self.grad_on_host[index, positions]
        stale = [b * n + j for b in range(B) for j in torch.nonzero(~on_host).flatten().tolist()]
        for kind, pages in staged.items():
            host = rows_of(self._mapped_layer(kind, index).flatten(0, 1))  # a row per (sequence, position)
            if kind in ("dk", "dv") and not bool(on_host.any()):
                pages.zero_()  # accumulation begins here: nothing to read
                continue
            if target is None:
                torch.index_select(host, 0, source, out=rows_of(pages))
            else:
                rows_of(pages).index_copy_(0, target, host.index_select(0, source))
            if kind in ("dk", "dv") and stale:
                pages.index_fill_(0, index_tensor(stale, self.device), 0)

    def _mapped_layer(self, kind: str, index: int) -> torch.Tensor:
        """What ``_host_layer`` gives, as kernels read it in place (global layers: sparse mode only)."""
        assert index not in self.window_tier, "window layers read their windows densely, never gathered"
        return self.mapped_host[kind][self._global_rows[index]]

    def _rows(self, stride: int, positions) -> torch.Tensor:
        """Indices of ``positions`` in every sequence's block of ``stride`` rows (host slabs flattened
        over (sequence, position), or staged pages), on the device."""
        return index_tensor([b * stride + p for b in range(self.batch_size) for p in positions], self.device)

    def _copy_runs(self, index: int, runs: list[tuple[int, int, int]], staged: dict) -> None:
        """One copy per run of consecutive pages, sequence and kind (devices without mapped memory)."""
        n = staged["k"].shape[0] // self.batch_size
        for start, stop, column in runs:
            for b in range(self.batch_size):
                rows = slice(b * n + column, b * n + column + stop - start)
                for kind, pages in staged.items():
                    source = self._host_layer(kind, index)[b, self._host_range(start, stop)]
                    if kind in ("dk", "dv"):
                        _load_grads(pages[rows], source, self.grad_on_host[index, start:stop])
                    else:
                        pages[rows].copy_(source, non_blocking=True)

    def _finish_selected_backward(self, index: int, chunk: ChunkSpan, staged: _StagedSelection) -> None:
        """Keep the chunk's own page gradients; send the history pages' back to the host."""
        first, last = self._page_range(chunk)
        B, n, pages, history = self.batch_size, staged.num_pages, staged.pages, staged.history
        if staged.own_chunk:
            own_rows = (torch.arange(B)[:, None] * n + torch.arange(n - (last - first), n)[None, :]).flatten()
            own_rows = own_rows.to(self.device, non_blocking=True)
            self._own_grads[index] = (pages["dk"].index_select(0, own_rows), pages["dv"].index_select(0, own_rows))
        if staged.head_rows is not None:
            self._finish_head_rows_backward(index, staged)
            return
        with self._on_copy_stream(after_compute=True):
            if self.mapped_host is not None and history:
                target = self._rows(self.host_pages, self._host_positions(history))
                source = self._rows(n, range(len(history)))
                for kind in ("dk", "dv"):
                    host = self._mapped_layer(kind, index).flatten(0, 1)
                    rows_of(host).index_copy_(0, target, rows_of(pages[kind]).index_select(0, source))
            elif staged.runs is not None:
                for start, stop, column in staged.runs:
                    if start >= first:
                        continue
                    host = self._host_range(start, stop)
                    for b in range(B):
                        rows = slice(b * n + column, b * n + column + stop - start)
                        self._host_layer("dk", index)[b, host].copy_(pages["dk"][rows], non_blocking=True)
                        self._host_layer("dv", index)[b, host].copy_(pages["dv"][rows], non_blocking=True)
        self.grad_on_host[index, history] = True


def _runs(columns: list[int], grad_on_host: torch.Tensor, offset: int = 0) -> list[tuple[int, int, int]]:
    """Runs of consecutive sorted positions whose gradients are all on the host or all not:
    (start, stop, index of start in the staged layout)."""
    runs = []
    for i, position in enumerate(columns):
        if runs and runs[-1][1] == position and bool(grad_on_host[position]) == bool(grad_on_host[runs[-1][0]]):
            runs[-1] = (runs[-1][0], position + 1, runs[-1][2])
        else:
            runs.append((position, position + 1, offset + i))
    return runs
