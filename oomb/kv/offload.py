"""Host offload of the paged store: K, V, dK, dV in pinned host memory, streamed through the GPU.

With ``offload.enabled`` (OOMBConfig.offload) the first ``offload.resident_layers`` layers keep their pools on
the GPU (kv/store.py); every other layer's pages live in the host tier below, addressed by token
position, not page id::

    host k, v, dk, dv   (layers, B, max_pages, Hkv, P, D)   four pinned slabs, reused across steps
    window k, v, dk, dv (window layers, B, slots, Hkv, P, D)  offloaded sliding-window layers' (kv/window_tier.py)
    GPU staging slots   stream_buffers x (B * slot_pages, Hkv, P, D) for k, v, dk, dv

A dense attention call reads its chunk's key windows (kv/store.py ``attention_windows``: history
blocks of ``stream_block_pages`` pages, then the chunk) one slot at a time. All copies run in issue
order on one side stream and are ordered with the compute stream by CUDA events:

    copy stream:     load w0 | load w1 | load w2 |  wait(computed w0) store dK,dV w0 | load w3 ...
    compute stream:  wait(loaded w0) attend w0 | wait(loaded w1) attend w1 | ...

* Stage 1 writes a chunk's K, V to the host once (device -> host after the layer computed them) and
  attends to its own pages straight from the GPU tensors.
* K and V are never written back; only gradients return, after the backward that produced them.
* Gradient pages are zeroed where accumulation begins: a window whose gradients were never written
  back is zero-filled on the GPU instead of loaded, so the host slabs are never cleared.
* No stale data: every page records whether its K/V and its gradients are on the host for this
  step; reading a page that was never written raises.

A sparse call (docs/sparse.md) stages only the pages its query blocks selected plus its own, gathered
from the mapped slabs by one kernel per kind (kv/mapped.py); in stage 2 each call stages the next
call's pages while it computes: kv/sparse_staging.py (``SparseStaging``, which the store inherits).
With packed documents neither mode moves pages no query of the call sees: dense windows start at the
chunk's first document (kv/store.py ``history_starts``), and a sparse call leaves out the pages its
blocks selected only to fill up (wholly before their document).

A sliding-window layer (``window_layers``, kv/store.py) stages only the pages its chunk's window
overlaps, [chunk start - (W - 1), chunk end) rounded out to pages, in both stages: its history windows
start at its window (``window_history_starts``), and in stage 2 only those pages' gradients go back to
the host (a chunk's pages no later window reaches load zero gradients for its own call: none was
added). The kernels see a page table of the staged layout, as for any window. Its host pages are
window slots, as many as its GPU pages without offload (kv/window_tier.py: stage 1 stores only the
chunk's tail, ``refill`` and ``rewrite`` store the recomputed head in stage 2, ``free`` returns both).
It keeps no page summaries (sparse mode reads windows densely). When every offloaded layer slides, the
staging slots shrink to a chunk or a window's pages.

In stage 2 a chunk's own K, V are read back from the host (what stage 1 stored; a window layer's head:
what ``rewrite`` stored), so the attention reads exactly the values of the GPU tier: gradients are
bit-identical with and without offload.
On CPU (tests) the same bookkeeping runs with ordinary tensors and synchronous copies.

Under context parallelism (oomb/context_parallel.py) each rank's slabs hold only its own chunks'
pages, packed in chunk order (``ContextShard.local_page``: host memory per rank about 1 / cp of the
sequence's), and a rank moves only its own pages: the windows of its own chunks, the selected pages
and rerank candidates on them, the chunk itself on its owner. Selected pages held by other ranks
point at the zero page, like unseen ones. The per-position bookkeeping (``kv_on_host``,
``grad_on_host``) stays full width: a bit per page.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .host_slabs import KINDS, HostSlabs, _load_grads
from .sparse_staging import SparseStaging
from .store import ChunkSpan, PagedKVStore, WindowView, split_into_chunks
from .window_tier import WindowTier, reserve_window_slabs

if TYPE_CHECKING:
    from ..context_parallel import ContextShard
    from .window_slots import WindowSlots

__all__ = ["HostSlabs", "OffloadedKVStore", "reserve_host_slabs"]


@dataclass
class _Slot:
    """One GPU staging buffer of ``capacity`` pages per sequence and its events."""

    k: torch.Tensor
    v: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    loaded: torch.cuda.Event | None = None  # the copy stream filled it
    released: torch.cuda.Event | None = None  # compute (and write-back) finished with it


class OffloadedKVStore(SparseStaging, PagedKVStore):
    """A PagedKVStore whose layers from ``resident_layers`` on live in pinned host memory (sparse mode's
    staging of selected pages: ``SparseStaging``, kv/sparse_staging.py)."""

    def __init__(self, *, slabs: HostSlabs, resident_layers: int, stream_buffers: int, chunk_size: int,
                 **store_options) -> None:
        super().__init__(gpu_layers=resident_layers, chunk_size=chunk_size, **store_options)
        self.resident = len(self.layers)
        self.slabs = slabs  # the host tensors are views: the slabs must outlive the store
        num_offloaded = self.num_layers - self.resident
        template = store_options
        B, P = self.batch_size, self.page_size
        Hkv, D = template["num_kv_heads"], template["head_dim"]
        tiers = reserve_host_slabs(slabs, resident_layers=resident_layers, chunk_size=chunk_size, **store_options)
        self.host = {kind: tiers[kind] for kind in KINDS}  # global layers: (layers, B, pages, Hkv, P, D)
        offloaded = range(self.resident, self.num_layers)
        window_indices = [layer - self.resident for layer in offloaded if layer in self.window_layers]
        global_indices = [layer - self.resident for layer in offloaded if layer not in self.window_layers]
        self._global_rows = {index: row for row, index in enumerate(global_indices)}  # offloaded index -> row
        chunks = split_into_chunks(store_options["num_tokens"], chunk_size) if window_indices else []
        self.window_tier = WindowTier(tiers, window_indices, chunks, [self.tail_start(c) for c in chunks], P)
        """The offloaded window layers' host tensors and slots (kv/window_tier.py)."""
        self.host_pages = self.host["k"].shape[2]  # per sequence: all, or this cp rank's (module docstring)
        # Sparse mode gathers selected pages with kernels that read the host tensors in place (None:
        # the device cannot address them; copies per run of pages instead, kv/mapped.py).
        mapped = {kind: slabs.mapped(kind, tuple(t.shape), t.dtype, self.device) for kind, t in self.host.items()}
        self.mapped_host = mapped if all(t is not None for t in mapped.values()) else None
        # Where each page position is, per offloaded layer (all sequences move together).
        self.kv_on_host = torch.zeros((num_offloaded, self.max_pages_per_seq), dtype=torch.bool)
        self.grad_on_host = torch.zeros((num_offloaded, self.max_pages_per_seq), dtype=torch.bool)
        cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.slot_pages = max(self.history_block_pages(), -(-chunk_size // P))
        self.slots = []
        if num_offloaded:
            shape = (B * self.slot_pages, Hkv, P, D)
            for _ in range(stream_buffers):
                tensors = {kind: torch.zeros(shape, dtype=self.host[kind].dtype, device=self.device)
                           for kind in KINDS}
                events = dict(loaded=torch.cuda.Event(), released=torch.cuda.Event()) if cuda else {}
                self.slots.append(_Slot(**tensors, **events))
        if self.copy_stream is not None:  # the slots were zeroed on the compute stream
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        # Sparse mode: page summaries of the offloaded layers stay on the GPU (what grows with context);
        # window layers keep none (they read their window densely, never select).
        summary_shape = (self.summary_rows, Hkv, D)
        self.offloaded_summaries = [
            {} if layer in self.window_layers else
            {name: torch.empty(summary_shape, dtype=template["kv_dtype"], device=self.device)
             for name in self.summary_kinds} for layer in range(self.resident, self.num_layers)]
        self._fresh_kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor] | None] = {}
        """Stage 1: (layer, chunk index) -> the chunk's K, V pages on the GPU, from its write until its
        attention (None: another context-parallel rank holds them); present only in stage 1."""
        self._own_grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> chunk's dK, dV pages
        self._tables: dict[tuple[int, int, int], torch.Tensor] = {}  # window page tables, made once per step
        self.chunk_size, self.num_tokens = chunk_size, store_options["num_tokens"]
        self._prefetched = None  # ((layer, chunk index, grads), window loads or staged selection) started ahead
        self.prefetch_across_chunks = True
        """Whether a chunk's last call predicts the next chunk's first (the two-stage order); False where the
        step runs its chunks in another order (oomb/shared_context.py): only the next layer is predicted."""
        self._selection_copied: dict[tuple[int, int], torch.cuda.Event] = {}  # (chunk, layer) -> D2H done
        self.prefetch_hits = 0
        """Attention calls whose first windows (sparse: selected pages) were loaded during the previous
        call (diagnostics)."""
        self.staged_history_pages = 0
        """History pages (per sequence) staged by the calls so far (diagnostics: what the transfers
        cost): dense, the pages of the history windows; sparse, the union of each call's selections
        without the pages no query of the call sees (packed documents' fill-up pages)."""

    def _offloaded(self, layer: int) -> int | None:
        return layer - self.resident if layer >= self.resident else None

    def history_block_pages(self) -> int:
        """The most pages per sequence one history window of an offloaded layer stages (with the
        chunk's pages, the size of a staging slot): a streamed block; when every offloaded layer
        slides, at most the ceil((W - 1) / P) pages before a chunk that its window overlaps."""
        offloaded = range(self.resident, self.num_layers)
        if not offloaded or not self.window_layers.issuperset(offloaded):
            return self.stream_block_pages
        return min(self.stream_block_pages, -(-(self.window - 1) // self.page_size))

    def _layer_windows(self, layer: int, chunk: ChunkSpan) -> list[tuple[int, int]]:
        """The key windows of ``layer``'s call on ``chunk``: a window layer's start at its window."""
        return self.windows(chunk, layer=layer) if layer in self.window_layers else self.windows(chunk)

    def _holds(self, position: int) -> bool:
        """Whether page ``position`` lives on this rank (always, without context parallelism)."""
        return self.context is None or self.context.owns(position * self.page_size // self.chunk_size)

    def _host_range(self, first: int, last: int) -> slice:
        """Where the page positions [first, last) lie in the host slabs: themselves, or under context
        parallelism their places among this rank's pages (the range must be consecutive there)."""
        if self.context is None:
            return slice(first, last)
        start = self.context.local_page(first, self.page_size)
        assert last == first or self.context.local_page(last - 1, self.page_size) == start + last - 1 - first, \
            f"pages {first}..{last - 1} are not consecutive on this context-parallel rank"
        return slice(start, start + last - first)

    def _host_positions(self, positions) -> list[int]:
        """Host-slab places of page positions (this rank's own, under context parallelism)."""
        if self.context is None:
            return list(positions)
        return [self.context.local_page(p, self.page_size) for p in positions]

    @property
    def window_host(self) -> dict[str, torch.Tensor]:
        """The offloaded window layers' host tensors (kv/window_tier.py); empty without them."""
        return self.window_tier.host

    @property
    def window_slots(self) -> WindowSlots | None:
        """The offloaded window layers' slots (kv/window_slots.py); None without them."""
        return self.window_tier.slots

    def _host_layer(self, kind: str, index: int) -> torch.Tensor:
        """Offloaded layer ``index``'s host tensor of ``kind``: (B, pages or window slots, Hkv, P, D)."""
        if index in self.window_tier:
            return self.window_tier.layer(kind, index)
        return self.host[kind][self._global_rows[index]]

    def _host_runs(self, index: int, first: int, last: int) -> list[tuple[int, int, slice]]:
        """The page positions [first, last) of offloaded layer ``index`` as runs (start, stop, where in
        its host tensor): one run for a global layer; a window layer's follow its slots."""
        if index in self.window_tier:
            return self.window_tier.runs(first, last)
        return [(first, last, self._host_range(first, last))] if last > first else []

    def _store_pages(self, index: int, chunk_first: int, start: int, stop: int, pages: dict[str, torch.Tensor]) -> None:
        """Copy positions [start, stop) of a chunk's (B * n, Hkv, P, D) pages (n from ``chunk_first``) to
        offloaded layer ``index``'s host tensors, on the copy stream after the compute that made them."""
        n = next(iter(pages.values())).shape[0] // self.batch_size
        with self._on_copy_stream(after_compute=True):
            for lo, hi, host in self._host_runs(index, start, stop):
                for b in range(self.batch_size):
                    rows = slice(b * n + lo - chunk_first, b * n + hi - chunk_first)
                    for kind, x in pages.items():
                        self._host_layer(kind, index)[b, host].copy_(x[rows], non_blocking=True)
        self._keep_alive(*pages.values())
        self.kv_on_host[index, start:stop] = True

    # --- page lifetime --------------------------------------------------------------------------
    def allocate(self, chunk: ChunkSpan) -> None:
        super().allocate(chunk)
        first, last = self._page_range(chunk)
        self.kv_on_host[:, first:last] = False
        self.grad_on_host[:, first:last] = False
        if self.window_tier.indices:  # window layers: host slots for the tail only (stage 1 stores no head)
            self.window_tier.allocate(self.tail_start(chunk), last)

    def refill(self, chunk: ChunkSpan) -> None:
        """Stage 2, before the chunk's recompute: host slots for the offloaded window layers' head pages,
        which ``rewrite`` fills from the recomputed k, v (kv/window_tier.py)."""
        super().refill(chunk)
        first, _ = self._page_range(chunk)
        if self.window_tier.indices:
            self.window_tier.refill(chunk, first, self.tail_start(chunk), self.kv_on_host, self.grad_on_host)

    def rewrite(self, layer: int, chunk: ChunkSpan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stage 2: an offloaded window layer's recomputed (B, Hkv, L, D) k, v of the chunk go to its head's
        host slots, before its attention stages them (stage 1 wrote the same values, docs/design.md)."""
        index = self._offloaded(layer)
        if index is None or not self.window_tier.awaits_rewrite(index, chunk):
            return super().rewrite(layer, chunk, k, v)
        first, _ = self._page_range(chunk)
        pages = {kind: self._to_pages(x.detach()).to(self.window_tier.host[kind].dtype)
                 for kind, x in (("k", k), ("v", v))}
        self._store_pages(index, first, first, self.tail_start(chunk), pages)

    def free(self, chunk: ChunkSpan) -> None:
        super().free(chunk)
        for key in [key for key in self._selection_copied if key[0] == chunk.index]:
            del self._selection_copied[key]
        if self.window_tier.indices:
            self.window_tier.free(chunk, *self._page_range(chunk))

    @property
    def is_empty(self) -> bool:
        return super().is_empty and self.window_tier.is_empty

    def free_all(self) -> None:
        super().free_all()
        self.window_tier.free_all(self.max_pages_per_seq)
        self._selection_copied.clear()
        self._prefetched = None
        self._fresh_kv.clear()
        self._own_grads.clear()
        if self.copy_stream is not None:  # nothing of this step may still be in flight
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)

    # --- stage 1: K, V of a chunk to the host -------------------------------------------------
    def write(self, layer: int, chunk: ChunkSpan, k: torch.Tensor, v: torch.Tensor) -> None:
        index = self._offloaded(layer)
        if index is None:
            return super().write(layer, chunk, k, v)
        first, last = self._page_range(chunk)
        k_pages = self._to_pages(k).to(self.host["k"].dtype)  # (B * n, Hkv, P, D), zero-padded tail
        self._write_summaries(self.offloaded_summaries[index], chunk, k_pages)
        if not self.owns(chunk):  # context parallel: another rank keeps the pages; the summaries are ours too
            self._fresh_kv[layer, chunk.index] = None
            return
        v_pages = self._to_pages(v).to(self.host["v"].dtype)
        self._fresh_kv[layer, chunk.index] = (k_pages, v_pages)
        # A window layer stores only the chunk's tail: its own attention reads the head from the GPU.
        start = self.tail_start(chunk) if index in self.window_tier else first
        self._store_pages(index, first, start, last, {"k": k_pages, "v": v_pages})

    # --- streaming windows ----------------------------------------------------------------------
    def stream(self, layer: int, chunk: ChunkSpan, grads: bool, whole_history: bool = False) -> Iterator[WindowView]:
        index = self._offloaded(layer)
        if index is None:
            yield from super().stream(layer, chunk, grads, whole_history)
            return
        windows = self._layer_windows(layer, chunk)
        P = self.page_size
        self.staged_history_pages += sum(-(-hi // P) - lo // P for lo, hi in windows if hi <= chunk.start)
        stage_one = not grads and (layer, chunk.index) in self._fresh_kv
        fresh = self._fresh_kv.pop((layer, chunk.index)) if stage_one else None
        if fresh is not None:  # stage 1: the chunk's own pages are still on the GPU
            windows = windows[:-1]
        loads = []
        if self._prefetched is not None and self._prefetched[0] == (layer, chunk.index, grads):
            loads = list(self._prefetched[1])  # started while the previous layer computed
            self.prefetch_hits += 1
        self._prefetched = None
        for i in range(len(loads), min(len(self.slots) - 1, len(windows))):
            loads.append(self._load(index, windows[i], self.slots[i % len(self.slots)], grads))
        for i, key_range in enumerate(windows):
            ahead = i + len(self.slots) - 1
            if ahead < len(windows):  # its slot was released at the end of iteration i - 1
                loads.append(self._load(index, windows[ahead], self.slots[ahead % len(self.slots)], grads))
            slot, table = loads[i]
            if slot.loaded is not None:
                torch.cuda.current_stream(self.device).wait_event(slot.loaded)
            yield WindowView(key_range, slot.k, slot.v, table, slot.dk if grads else None,
                             slot.dv if grads else None)
            # The caller has launched its work on this window.
            if grads:
                self._finish_backward_window(index, key_range, slot, chunk)
            elif slot.released is not None:
                slot.released.record(torch.cuda.current_stream(self.device))
        if fresh is not None:
            k_pages, v_pages = fresh
            first, last = self._page_range(chunk)
            yield WindowView((chunk.start, chunk.end), k_pages, v_pages, self._window_table(first, last))
        self._prefetch(self._next_call(layer, chunk, grads, stage_one=stage_one))

    def _next_call(self, layer: int, chunk: ChunkSpan, grads: bool, stage_one: bool):
        """(layer, chunk, grads) of the attention call that follows this one in a step, or None.

        Stage 1 runs layers 0..L-1 of chunks 0..N-1; stage 2 runs, per chunk N-1..0, the forward of
        layers 0..L-1, then their backward L-1..0 (a checkpoint replay reuses the forward's result)."""
        if not grads:
            if layer + 1 < self.num_layers:
                return layer + 1, chunk, False
            if not stage_one:
                return layer, chunk, True
            if not self.prefetch_across_chunks:
                return None
            if chunk.end >= self.num_tokens:
                return None  # the first call of stage 2 is not predicted
            return 0, ChunkSpan(chunk.index + 1, chunk.end, min(chunk.end + self.chunk_size, self.num_tokens)), False
        if layer > 0:
            return layer - 1, chunk, True
        if chunk.index == 0 or not self.prefetch_across_chunks:
            return None
        return 0, ChunkSpan(chunk.index - 1, chunk.start - self.chunk_size, chunk.start), False

    def _prefetch(self, call) -> None:
        """Start loading the first history windows of the next call into the slots it will use, so
        the copies overlap the rest of this layer (MLP, next projections) instead of waiting."""
        if call is None or self._offloaded(call[0]) is None:
            return
        layer, chunk, grads = call
        if self.summary_kinds and layer not in self.window_layers:  # window layers read densely
            selection = self._selections.get((chunk.index, layer), "unknown")
            if isinstance(selection, torch.Tensor):
                # Sparse, stage 2: the selection waits on the host since stage 1; stage its pages now.
                staged = self._stage_selection(self._offloaded(layer), layer, chunk, selection, grads)
                self._prefetched = ((layer, chunk.index, grads), staged)
            if selection is not None:
                return  # a sparse call; stage 1 makes its selection only when the call comes
        history = [w for w in self._layer_windows(layer, chunk) if w[1] <= chunk.start][:len(self.slots) - 1]
        index = self._offloaded(layer)
        P = self.page_size
        if history and all(bool(self.kv_on_host[index, lo // P: -(-hi // P)].all()) for lo, hi in history):
            loads = [self._load(index, w, self.slots[i % len(self.slots)], grads) for i, w in enumerate(history)]
            self._prefetched = ((layer, chunk.index, grads), loads)

    def _window_table(self, first: int, last: int, capacity: int | None = None) -> torch.Tensor:
        """(B, last) int32: position p of sequence b in [first, last) -> slot page b * capacity + p - first."""
        capacity = capacity or (last - first)
        key = (first, last, capacity)
        if key not in self._tables:
            table = torch.zeros((self.batch_size, last), dtype=torch.int32)
            table[:, first:last] = (torch.arange(self.batch_size)[:, None] * capacity
                                    + torch.arange(last - first)[None, :]).to(torch.int32)
            self._tables[key] = table.to(self.device)
        return self._tables[key]

    def _load(self, index: int, key_range: tuple[int, int], slot: _Slot, grads: bool):
        """Start copying a window's pages (and, for backward, gradients or zeros) into ``slot``."""
        first, last = key_range[0] // self.page_size, -(-key_range[1] // self.page_size)
        n = last - first
        assert n <= self.slot_pages, f"window {key_range} has {n} pages, a staging slot {self.slot_pages}"
        if not bool(self.kv_on_host[index, first:last].all()):
            raise RuntimeError(f"pages {first}..{last - 1} of offloaded layer {index + self.resident} were never "
                               "written: stage 1 must store a chunk before any attention reads it")
        runs = self._host_runs(index, first, last)
        with self._on_copy_stream(after_compute=False, wait=slot.released):
            for lo, hi, host in runs:
                grad_valid = self.grad_on_host[index, lo:hi]
                for b in range(self.batch_size):
                    rows = slice(b * self.slot_pages + lo - first, b * self.slot_pages + hi - first)
                    slot.k[rows].copy_(self._host_layer("k", index)[b, host], non_blocking=True)
                    slot.v[rows].copy_(self._host_layer("v", index)[b, host], non_blocking=True)
                    if grads:
                        for kind in ("dk", "dv"):
                            _load_grads(getattr(slot, kind)[rows], self._host_layer(kind, index)[b, host],
                                        grad_valid)
            if slot.loaded is not None:
                slot.loaded.record(self.copy_stream)
        return slot, self._window_table(first, last, self.slot_pages)

    def _finish_backward_window(self, index: int, key_range: tuple[int, int], slot: _Slot, chunk: ChunkSpan) -> None:
        """After a window's backward: history gradients go back to the host; the chunk's own are kept."""
        first, last = key_range[0] // self.page_size, -(-key_range[1] // self.page_size)
        n = last - first
        if key_range[0] >= chunk.start:  # the chunk's own pages: nobody reads their gradients later
            rows = (torch.arange(self.batch_size)[:, None] * self.slot_pages + torch.arange(n)).flatten()
            rows = rows.to(self.device, non_blocking=True)
            self._own_grads[index] = (slot.dk.index_select(0, rows), slot.dv.index_select(0, rows))
            if slot.released is not None:
                slot.released.record(torch.cuda.current_stream(self.device))
            return
        runs = self._host_runs(index, first, last)
        with self._on_copy_stream(after_compute=True):
            for lo, hi, host in runs:
                for b in range(self.batch_size):
                    rows = slice(b * self.slot_pages + lo - first, b * self.slot_pages + hi - first)
                    self._host_layer("dk", index)[b, host].copy_(slot.dk[rows], non_blocking=True)
                    self._host_layer("dv", index)[b, host].copy_(slot.dv[rows], non_blocking=True)
            if slot.released is not None:
                slot.released.record(self.copy_stream)
        self.grad_on_host[index, first:last] = True

    def chunk_grads(self, layer: int, chunk: ChunkSpan) -> tuple[torch.Tensor, torch.Tensor]:
        index = self._offloaded(layer)
        if index is None or not self.owns(chunk):  # context parallel, not the owner: zeros
            return super().chunk_grads(layer, chunk)
        if index not in self._own_grads:
            raise RuntimeError(f"no gradients of chunk {chunk.index} in layer {layer}: its backward did not run")
        dk, dv = self._own_grads.pop(index)
        return self._from_pages(dk, chunk.length), self._from_pages(dv, chunk.length)

    # --- streams ------------------------------------------------------------------------------------
    def _on_copy_stream(self, after_compute: bool, wait: torch.cuda.Event | None = None):
        """Context for work on the copy stream, ordered after the compute stream's work so far
        (``after_compute``) and after ``wait``; a no-op on CPU."""
        if self.copy_stream is None:
            return _NullContext()
        if after_compute:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        if wait is not None:
            self.copy_stream.wait_event(wait)
        return torch.cuda.stream(self.copy_stream)

    def _copies_recorded(self) -> torch.cuda.Event | None:
        """An event recorded on the copy stream after the copies issued so far (None on CPU): the compute
        stream waits on it before reading what they staged."""
        if self.copy_stream is None:
            return None
        ready = torch.cuda.Event()
        ready.record(self.copy_stream)
        return ready

    def _keep_alive(self, *tensors: torch.Tensor) -> None:
        """Tensors made on the compute stream and read by the copy stream: tell the allocator."""
        if self.copy_stream is not None:
            for t in tensors:
                t.record_stream(self.copy_stream)

    # --- sparse mode: the offloaded layers' page summaries stay on the GPU ------------------------
    def _layer_summaries(self, layer: int) -> dict[str, torch.Tensor]:
        index = self._offloaded(layer)
        return super()._layer_summaries(layer) if index is None else self.offloaded_summaries[index]


def reserve_host_slabs(slabs: HostSlabs, *, num_layers: int, resident_layers: int, batch_size: int,
                       num_tokens: int, num_kv_heads: int, head_dim: int, page_size: int, kv_dtype: torch.dtype,
                       grad_dtype: torch.dtype, context: ContextShard | None = None,
                       window_layers: tuple[int, ...] = (), window: int | None = None, chunk_size: int | None = None,
                       **_) -> dict[str, torch.Tensor]:
    """The host tensors of a step, taken from ``slabs``: "k", "v", "dk", "dv" (global layers, B, pages,
    Hkv, P, D), pages = every page of a sequence, or with ``context`` this context-parallel rank's own;
    with offloaded ``window_layers`` (engine.window_store_options) also "window_k", ... (window layers,
    B, slots, Hkv, P, D), kv/window_tier.py. Calling it ahead of a step pins the memory outside the step
    (as a benchmark does before timing)."""
    offloaded = range(min(resident_layers, num_layers), num_layers)
    windowed = sum(layer in window_layers for layer in offloaded)
    pages = -(-num_tokens // page_size) if context is None else context.owned_pages(num_tokens, page_size)
    shape = (len(offloaded) - windowed, batch_size, pages, num_kv_heads, page_size, head_dim)
    dtypes = {"k": kv_dtype, "v": kv_dtype, "dk": grad_dtype, "dv": grad_dtype}
    tensors = {kind: slabs.take(kind, shape, dtypes[kind]) for kind in KINDS}
    if windowed:
        tensors.update(reserve_window_slabs(slabs, dtypes, num_layers=windowed, batch_size=batch_size,
                                            num_tokens=num_tokens, chunk_size=chunk_size, num_kv_heads=num_kv_heads,
                                            head_dim=head_dim, page_size=page_size, window=window))
    return tensors


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
