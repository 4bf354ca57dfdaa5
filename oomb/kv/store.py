"""The paged KV store of one training step: K, V and their gradients, per layer, in pages.

Layout (one layer; every layer shares the page ids)::

    page_table (B, max_pages) int32     row b: page ids of sequence b in token order
        seq 0: [ 7 | 2 | 9 | 4 | ...]   token t of sequence b lives in page page_table[b, t // P],
        seq 1: [ 0 | 5 | 1 | 8 | ...]   slot t % P
    k, v    (num_pages, Hkv, P, D)     model dtype, post-RoPE
    dk, dv  (num_pages, Hkv, P, D)     kv_grad_dtype, zeroed when a page is allocated
    summaries[name] (num_pages, Hkv, D) sparse mode only: per-page key summaries (kv/summaries.py)

Chunks start on page boundaries (chunk_size is a multiple of page_size), so a chunk owns whole
pages; the tail of a partial last page is written with zeros, never left uninitialised.

In sparse mode the store also keeps, per (chunk, layer), the page selection stage 1 made (int32
(B, Hkv, n_blocks, K) page-table positions, or None when the chunk reads every earlier page), so
that stage 2 reads exactly the same pages; it is freed with the chunk.

Under context parallelism (``context``, oomb/context_parallel.py) the store holds only the chunks
this rank owns: its pool is sized for them, other chunks get no pages (their page-table entries are
never read), and ``windows`` yields only the parts of a chunk's key windows on its own pages. Page
summaries are the exception: every rank summarises every chunk (its k is the same on every rank),
indexed by position (row b * max_pages + p) rather than page id, so that each rank scores the whole
history with exactly the inputs and code of one process, and every rank selects the same pages.
They cost 1 / (2 P) of the K, V pages per summary vector (fp32 page gradients: less).

Window layers (``window_layers``, sliding window W; see docs/models.md "Sliding windows") have their
own page table and a smaller pool, so that their pages do not live as long as global layers'. Which
of a window layer's K/V are needed when (chunk size C, chunks start on page boundaries):

* Stage 1, chunk c reads keys [cC - W + 1, cC) of the history and the chunk itself. A key j of
  chunk c is read by a later chunk c' > c (in either stage) iff c'C - W + 1 <= j, i.e. iff
  j >= (c + 1) C - W + 1: only the chunk's *tail*, its last W - 1 keys (all of it when W - 1 >= C),
  is ever read by another chunk. The chunk's *head* (its pages before the tail's first page) is read
  only by the chunk's own attention.
* Stage 2 recomputes chunk c with grad: the attention of every layer is handed the recomputed k, v
  of the chunk, the same values stage 1 wrote (the same inputs, the same RNG state, the same kernels:
  the assumption the whole two-stage step rests on, docs/design.md). Chunks c' > c run before c
  in stage 2 and read c's tail from its pages (its K/V, and they add into its dK/dV): the tail must
  persist from stage 1 to stage 2. The head need not: ``finish_fill`` frees the head pages once
  stage 1 is done with the chunk, ``refill`` gives them back (dK/dV zeroed: no later chunk reaches
  them) before stage 2 recomputes the chunk, and ``rewrite`` stores the recomputed k, v in them
  before the chunk's attention reads them. Its own dK/dV (handed to k, v by ``chunk_grads``) are then
  the tail's accumulated contributions of later chunks plus the chunk's own: exactly as before.
* ``free`` (stage 2, after the chunk's backward) returns the tail and head together.

So a window layer holds, at any time, the tails of the chunks before the current one and all pages
of the current chunk: B * (sum of tails + C / P) pages, with ceil((W - 1) / P) pages per tail
(min with the chunk's pages). That still grows with the context, by (W - 1) / C of a global layer:
the tails are the recurrent state that stage 2 needs back in reverse order, and dropping them
would mean recomputing each chunk's tail from the start of its window layers' receptive field (up to
W - 1 tokens per window layer below, i.e. many chunks' forward per chunk): not cheap, so they are
kept and the gradients stay exact. With one W among several windows the largest is used. Window
layers keep no page summaries (sparse mode reads windows densely) and their history windows
(``window_history_starts``) start at their own windows, so no freed page is ever read.

With host offload (``gpu_layers``, kv/offload.py) resident window layers keep every page in the shared
table, like global layers; offloaded ones keep the same tails and chunk in host slots
(kv/window_slots.py: stage 1 stores only the tail, stage 2 stores the recomputed head before the
chunk's attention, as ``rewrite`` does here). Their history windows start at their own windows, so a
window layer's call reads, and with offload stages, only the pages its window overlaps:
[chunk start - (W - 1), chunk end), rounded out to pages.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .pool import PagePool
from .summaries import SUMMARY_KINDS, summarize_pages

if TYPE_CHECKING:
    from ..context_parallel import ContextShard


@dataclass(frozen=True)
class ChunkSpan:
    """Token positions [start, end) of one chunk, the same for every sequence of the batch."""

    index: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def split_into_chunks(num_tokens: int, chunk_size: int) -> list[ChunkSpan]:
    return [
        ChunkSpan(i, start, min(start + chunk_size, num_tokens))
        for i, start in enumerate(range(0, num_tokens, chunk_size))
    ]


@dataclass(frozen=True)
class WindowView:
    """Where a dense attention call finds the keys [key_range[0], key_range[1]) of its chunk: pools
    (num_pages, Hkv, P, D) and a (B, >= n_pages) int32 page table valid inside the window. On the
    GPU tier these are the layer's own pools; with offload, a staging buffer's."""

    key_range: tuple[int, int]
    k: torch.Tensor
    v: torch.Tensor
    page_table: torch.Tensor
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None
    selection: torch.Tensor | None = None
    """Sparse: the selection to read these pools with, where staging laid the pages out by (page, head)
    rows (kv/head_rows.py); None: the call's own."""


def attention_windows(
    chunk: ChunkSpan, page_size: int, block_pages: int | None, first_key: int = 0
) -> list[tuple[int, int]]:
    """Key windows of a chunk's dense attention: its history [first_key, chunk.start) in blocks aligned
    to multiples of block_pages pages (None: one block), then the chunk itself. Every tier streams the
    same windows. ``first_key`` (page-aligned; packed documents): keys before it belong to earlier
    documents of every sequence, so their pages are neither read nor staged."""
    if first_key % page_size or not 0 <= first_key <= chunk.start:
        raise ValueError(f"first_key={first_key} must be a page-aligned position in [0, {chunk.start}]")
    block = max(chunk.start, 1) if block_pages is None else block_pages * page_size
    history = [(max(lo, first_key), min(lo + block, chunk.start)) for lo in range(0, chunk.start, block)
               if min(lo + block, chunk.start) > first_key]
    return history + [(chunk.start, chunk.end)]


def window_pages_per_sequence(num_tokens: int, chunk_size: int, page_size: int, window: int) -> int:
    """Peak pages per sequence of a window layer with its own pages (PagedKVStore ``window_layers``):
    the tails (pages holding the last ``window - 1`` keys before a chunk boundary, at most the chunk)
    of the chunks before one, plus all of that chunk's pages; the most over the chunks."""
    tails, peak = 0, 0
    for chunk in split_into_chunks(num_tokens, chunk_size):
        first, last = chunk.start // page_size, -(-chunk.end // page_size)
        peak = max(peak, tails + last - first)
        if chunk.end < num_tokens:
            tails += last - min(last, max(first, (chunk.end - window + 1) // page_size))
    return max(peak, 1)


@dataclass
class LayerPages:
    """One layer's pool tensors, each (num_pages, Hkv, P, D)."""

    k: torch.Tensor
    v: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    summaries: dict[str, torch.Tensor] = field(default_factory=dict)
    """Sparse mode: name (kv/summaries.py) -> (num_pages, Hkv, D) per-page key summary, kv dtype."""


class PagedKVStore:
    """Pages of every layer for a batch of sequences of ``num_tokens`` tokens."""

    def __init__(
        self,
        *,
        num_layers: int,
        batch_size: int,
        num_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        kv_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        device: torch.device,
        summaries: tuple[str, ...] = (),
        stream_block_pages: int = 256,
        gpu_layers: int | None = None,
        context: ContextShard | None = None,
        window_layers: tuple[int, ...] = (),
        window: int | None = None,
        chunk_size: int | None = None,
    ) -> None:
        """``gpu_layers``: allocate pools for only the first this many layers (the rest live in a
        host tier, kv/offload.py); None: all. ``context``: this rank's share of a context-parallel
        group (pages of its own chunks only); None: every page. ``window_layers``: the layers with a
        sliding ``window`` (the largest, if several): their history windows start at their window, and
        without ``gpu_layers`` their pages live in their own table and pool, freed as soon as no
        remaining use needs them (module docstring); needs ``chunk_size``, not ``context``."""
        unknown = sorted(set(summaries) - set(SUMMARY_KINDS))
        assert not unknown, f"unknown page summaries {unknown}; known: {SUMMARY_KINDS}"
        self.page_size = page_size
        self.batch_size = batch_size
        self.num_layers = num_layers
        self.stream_block_pages = stream_block_pages
        self.device = torch.device(device)
        self.max_pages_per_seq = -(-num_tokens // page_size)
        self.context = context
        self.num_kv_heads, self.head_dim, self.grad_dtype = num_kv_heads, head_dim, grad_dtype
        own_pages = self.max_pages_per_seq if context is None else context.owned_pages(num_tokens, page_size)
        self.pool = PagePool(batch_size * max(own_pages, 1))  # a rank may own no chunk of a short step
        shape = (self.pool.capacity, num_kv_heads, page_size, head_dim)
        # Summary rows: by page id; context parallel, by position, for every chunk (module docstring).
        self.summary_rows = self.pool.capacity if context is None else batch_size * self.max_pages_per_seq
        self.window_layers = frozenset(window_layers)
        self.window = window
        self.window_pool: PagePool | None = None
        if self.window_layers:
            if window is None or window < 1 or chunk_size is None or chunk_size % page_size:
                raise ValueError(f"window layers need a window >= 1 (got {window}) and a chunk size that is a "
                                 f"multiple of the page size (got {chunk_size})")
            if context is not None:
                raise ValueError("window layers are not supported with context parallelism")
        if self.window_layers and gpu_layers is None:  # offload: host window slots (module docstring)
            pages = window_pages_per_sequence(num_tokens, chunk_size, page_size, window)
            self.window_pool = PagePool(batch_size * pages)
        self.own_window_layers = self.window_layers if self.window_pool is not None else frozenset()
        """The window layers with their own GPU page table and pool (none with offload: resident window
        layers keep every page, offloaded ones have host window slots, kv/window_slots.py)."""
        window_shape = (self.window_pool.capacity if self.window_pool else 0, num_kv_heads, page_size, head_dim)

        def layer_pages(index: int) -> LayerPages:
            windowed = index in self.window_layers
            layer_shape = window_shape if index in self.own_window_layers else shape
            return LayerPages(
                k=torch.empty(layer_shape, dtype=kv_dtype, device=device),
                v=torch.empty(layer_shape, dtype=kv_dtype, device=device),
                dk=torch.empty(layer_shape, dtype=grad_dtype, device=device),
                dv=torch.empty(layer_shape, dtype=grad_dtype, device=device),
                summaries={} if windowed else {  # window layers read their window densely, never select
                    name: torch.empty((self.summary_rows, num_kv_heads, head_dim), dtype=kv_dtype, device=device)
                    for name in summaries
                },
            )

        self.layers = [layer_pages(i) for i in range(num_layers if gpu_layers is None else min(gpu_layers, num_layers))]
        self.summary_kinds = tuple(summaries)
        self.page_table = torch.zeros((batch_size, self.max_pages_per_seq), dtype=torch.int32, device=device)
        self.window_table = torch.zeros_like(self.page_table) if self.own_window_layers else None
        """Window layers' page table (stale outside the pages alive: module docstring)."""
        self._chunk_pages: dict[int, list[int]] = {}  # chunk index -> page ids it owns
        self._window_pages: dict[int, dict[int, list[int]]] = {}
        """Window layers: chunk index -> {first page position of a run -> its page ids (B-major)}: the
        tail from stage 1 on, the head during the chunk's two uses."""
        self._refilled: set[int] = set()  # stage 2: chunks whose head pages wait for ``rewrite``
        self.window_history_starts: dict[int, int] = {}
        """Window layers: chunk index -> first (page-aligned) history key their queries see (engine)."""
        self.peak_window_pages = 0  # diagnostics: the most window pages in use at once
        self._selections: dict[tuple[int, int], torch.Tensor | None] = {}  # (chunk index, layer) -> selection
        self._scoring_queries: dict[int, tuple[int, torch.Tensor]] = {}
        """Sparse, leak-free: layer -> (chunk index, its last page of queries), kept by stage 1 so the
        next chunk's first query block can be scored with queries before it (oomb/sparse.py)."""
        self.history_starts: dict[int, int] = {}
        """Packed documents: chunk index -> first (page-aligned) history key any query of the chunk
        sees (oomb/documents.py); absent: 0. Set once per step, before stage 1."""
        self.document_starts: torch.Tensor | None = None
        """Packed documents: (B, T) int64 host copy of each token's document start (Documents.start_cpu),
        or None (one document per row). With offload, a sparse call does not stage the selected pages
        wholly before its query blocks' documents (kv/sparse_staging.py). Set once per step, before stage 1."""
        self.document_sinks = False
        """Packed documents, sparse: every block's selection begins with its document's first page
        (sparse.sink_pages >= 1), so offload may stage it as (page, head) rows (kv/head_rows.py)."""

    @staticmethod
    def bytes_needed(
        *, num_layers: int, batch_size: int, num_tokens: int, num_kv_heads: int, head_dim: int,
        page_size: int, kv_dtype: torch.dtype, grad_dtype: torch.dtype,
    ) -> int:
        """Bytes of the pool tensors this store would allocate (K, V, dK, dV of all layers)."""
        pages = batch_size * -(-num_tokens // page_size)
        elems = num_layers * pages * num_kv_heads * page_size * head_dim
        return 2 * elems * (kv_dtype.itemsize + grad_dtype.itemsize)

    def tail_start(self, chunk: ChunkSpan) -> int:
        """Window layers: the first page position of the chunk's tail, the pages a later chunk's window
        reaches (module docstring); the chunk's end page when none does (the last chunk)."""
        first, last = self._page_range(chunk)
        if chunk.end >= self.max_pages_per_seq * self.page_size or chunk.end % self.page_size:
            return last  # the last chunk: no later chunk
        return min(last, max(first, (chunk.end - self.window + 1) // self.page_size))

    def is_window_layer(self, layer: int) -> bool:
        return layer in self.window_layers

    def table(self, layer: int) -> torch.Tensor:
        """The page table of ``layer``: the window layers' own, or the shared one."""
        return self.window_table if layer in self.own_window_layers else self.page_table

    def _allocate_window(self, chunk: ChunkSpan, first: int, last: int) -> None:
        """Window pages for positions [first, last) of the chunk, dK/dV zeroed in every window layer."""
        if last <= first:
            return
        ids = self.window_pool.allocate(self.batch_size * (last - first))
        self._window_pages.setdefault(chunk.index, {})[first] = ids
        self.window_table[:, first:last].copy_(torch.tensor(ids, dtype=torch.int32).reshape(self.batch_size, -1))
        self.peak_window_pages = max(self.peak_window_pages, self.window_pool.num_used)
        index = self.window_table[:, first:last].reshape(-1).long()
        for layer in self.own_window_layers:
            self.layers[layer].dk.index_fill_(0, index, 0)
            self.layers[layer].dv.index_fill_(0, index, 0)

    def finish_fill(self, chunk: ChunkSpan) -> None:
        """Stage 1 is done with the chunk: free its window layers' head pages (no later chunk reads them)."""
        if not self.own_window_layers:
            return
        first, _ = self._page_range(chunk)
        if self.tail_start(chunk) > first:
            self.window_pool.free(self._window_pages[chunk.index].pop(first))

    def refill(self, chunk: ChunkSpan) -> None:
        """Stage 2, before the chunk's recompute: give its window layers' head pages back (``rewrite``
        fills them from the recomputed k, v)."""
        if not self.own_window_layers:
            return
        first, _ = self._page_range(chunk)
        if self.tail_start(chunk) > first:
            self._allocate_window(chunk, first, self.tail_start(chunk))
            self._refilled.add(chunk.index)

    def rewrite(self, layer: int, chunk: ChunkSpan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stage 2: store a window layer's recomputed (B, Hkv, L, D) k, v of the chunk in its head pages
        (the tail still holds what stage 1 wrote, which later chunks read); other layers: nothing."""
        if layer not in self.own_window_layers or chunk.index not in self._refilled:
            return
        first, _ = self._page_range(chunk)
        n = self.tail_start(chunk) - first
        pages = self.layers[layer]
        index = self.window_table[:, first:first + n].reshape(-1).long()
        for pool, x in ((pages.k, k), (pages.v, v)):
            by_sequence = self._to_pages(x.detach()).reshape(self.batch_size, -1, *pool.shape[1:])
            pool.index_copy_(0, index, by_sequence[:, :n].reshape(-1, *pool.shape[1:]).to(pool.dtype))

    def _page_range(self, chunk: ChunkSpan) -> tuple[int, int]:
        assert chunk.start % self.page_size == 0, "chunks must start on a page boundary"
        return chunk.start // self.page_size, -(-chunk.end // self.page_size)

    def _chunk_ids(self, chunk: ChunkSpan, layer: int | None = None) -> torch.Tensor:
        first, last = self._page_range(chunk)
        table = self.page_table if layer is None else self.table(layer)
        return table[:, first:last].reshape(-1).long()  # (B * n,)

    def allocate(self, chunk: ChunkSpan) -> None:
        """Give the chunk its pages in every sequence and zero their gradient buffers."""
        if chunk.index in self._chunk_pages:
            raise RuntimeError(f"chunk {chunk.index} already has pages")
        if not self.owns(chunk):
            self._chunk_pages[chunk.index] = []  # another context-parallel rank holds them
            return
        first, last = self._page_range(chunk)
        ids = self.pool.allocate(self.batch_size * (last - first))
        self._chunk_pages[chunk.index] = ids
        table = torch.tensor(ids, dtype=torch.int32).reshape(self.batch_size, last - first)
        self.page_table[:, first:last].copy_(table)
        index = self._chunk_ids(chunk)
        for i, layer in enumerate(self.layers):
            if i not in self.own_window_layers:
                layer.dk.index_fill_(0, index, 0)
                layer.dv.index_fill_(0, index, 0)
        if self.own_window_layers:  # head and tail as two runs: ``finish_fill`` frees the head
            self._allocate_window(chunk, first, self.tail_start(chunk))
            self._allocate_window(chunk, self.tail_start(chunk), last)

    def free(self, chunk: ChunkSpan) -> None:
        """Return the chunk's pages: no remaining chunk attends to them."""
        if chunk.index not in self._chunk_pages:
            raise RuntimeError(f"chunk {chunk.index} has no pages (never allocated, or freed twice)")
        self.pool.free(self._chunk_pages.pop(chunk.index))
        for ids in self._window_pages.pop(chunk.index, {}).values():
            self.window_pool.free(ids)
        self._refilled.discard(chunk.index)
        for key in [key for key in self._selections if key[0] == chunk.index]:
            del self._selections[key]

    def free_all(self) -> None:
        for index in list(self._chunk_pages):
            self.pool.free(self._chunk_pages.pop(index))
        for runs in self._window_pages.values():
            for ids in runs.values():
                self.window_pool.free(ids)
        self._window_pages.clear()
        self._refilled.clear()
        self._selections.clear()
        self._scoring_queries.clear()

    def keep_scoring_queries(self, layer: int, chunk: ChunkSpan, queries: torch.Tensor) -> None:
        """Stage 1, sparse leak-free: the chunk's last page of queries (B, Hq, P, D), for the next chunk."""
        self._scoring_queries[layer] = (chunk.index, queries)

    def scoring_queries(self, layer: int, chunk: ChunkSpan) -> torch.Tensor | None:
        """The previous chunk's last page of queries in ``layer``, if stage 1 kept it."""
        kept = self._scoring_queries.get(layer)
        return kept[1] if kept is not None and kept[0] == chunk.index - 1 else None

    @contextmanager
    def branch(self) -> Iterator[None]:
        """A branch of the sequence after the chunks allocated so far (a shared context's continuation,
        oomb/shared_context.py): chunks allocated inside take the page positions after the trunk's and must
        be freed inside; on exit the trunk reads on as before the branch (stage 1's leak-free scoring queries,
        which the branch's chunks replaced, are the trunk's last chunk's again)."""
        kept = dict(self._scoring_queries)
        try:
            yield
        finally:
            self._scoring_queries = kept

    def owns(self, chunk: ChunkSpan) -> bool:
        """Whether this store holds the chunk's pages (always, without context parallelism)."""
        return self.context is None or self.context.owns(chunk.index)

    @property
    def is_empty(self) -> bool:
        windows_empty = self.window_pool is None or (self.window_pool.num_used == 0 and not self._window_pages)
        return self.pool.num_used == 0 and not self._chunk_pages and not self._selections and windows_empty

    def write(self, layer: int, chunk: ChunkSpan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the chunk's (B, Hkv, L, D) keys and values in its pages, zero-padding the last one;
        in sparse mode also the pages' key summaries. A context-parallel rank not owning the chunk keeps
        only the summaries."""
        pages = self.layers[layer]
        if not self.owns(chunk):
            if self.summary_kinds:
                self._write_summaries(pages.summaries, chunk, self._to_pages(k).to(pages.k.dtype))
            return
        index = self._chunk_ids(chunk, layer)
        k_pages = self._to_pages(k).to(pages.k.dtype)  # (B * n, Hkv, P, D)
        pages.k.index_copy_(0, index, k_pages)
        pages.v.index_copy_(0, index, self._to_pages(v).to(pages.v.dtype))
        self._write_summaries(pages.summaries, chunk, k_pages)

    def _write_summaries(self, summaries: dict[str, torch.Tensor], chunk: ChunkSpan, k_pages: torch.Tensor) -> None:
        """Sparse mode: the key summaries of the chunk's (B * n, Hkv, P, D) pages, by page id (window
        layers keep none)."""
        if not self.summary_kinds or not summaries:
            return
        valid = chunk.length - (-(-chunk.length // self.page_size) - 1) * self.page_size
        by_sequence = k_pages.reshape(self.batch_size, -1, *k_pages.shape[1:])  # (B, n, Hkv, P, D)
        rows = self._summary_index(*self._page_range(chunk)).reshape(-1)
        for name, summary in summarize_pages(by_sequence, valid, self.summary_kinds).items():
            summaries[name].index_copy_(0, rows, summary.flatten(0, 1).to(summaries[name].dtype))

    def _summary_index(self, first: int, last: int) -> torch.Tensor:
        """(B, last - first) rows of the summary tensors holding positions [first, last) of every
        sequence: their page ids; context parallel, b * max_pages + position (module docstring)."""
        if self.context is None:
            return self.page_table[:, first:last].long()
        positions = torch.arange(first, last, device=self.device)
        return torch.arange(self.batch_size, device=self.device)[:, None] * self.max_pages_per_seq + positions

    def _layer_summaries(self, layer: int) -> dict[str, torch.Tensor]:
        return self.layers[layer].summaries

    def history_summaries(self, layer: int, num_pages: int) -> dict[str, torch.Tensor]:
        """Summaries of the first ``num_pages`` pages of every sequence: name -> (B, num_pages, Hkv, D)."""
        rows = self._summary_index(0, num_pages)  # (B, num_pages)
        return {name: summary[rows] for name, summary in self._layer_summaries(layer).items()}

    @contextmanager
    def scoring_keys(self, layer: int, chunk: ChunkSpan, history: torch.Tensor, by_head: bool = False
                     ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """(k_pool, page_table, key positions) holding the keys of the history pages at the page-table
        positions in ``history`` (a (B, Hkv, n_blocks, M) selection) and of the chunk's own pages, as
        stage 1 wrote them: what an exact page score over candidate pages reads (oomb/sparse.py). Key
        positions: None (read ``history``'s keys at its own positions), or, where ``by_head`` let the
        offloaded store stage each head's pages as rows of their own (kv/head_rows.py), the positions
        to read them at. Here: the layer's pool and table."""
        yield self.layers[layer].k, self.page_table, None

    @contextmanager
    def selected_pages(self, layer: int, chunk: ChunkSpan, selection: torch.Tensor, grads: bool):
        """Sparse mode: where the pages ``selection`` names and the chunk's own pages can be read
        (and, with grads, their gradients added), as a WindowView over all keys up to the chunk's end."""
        pages = self.layers[layer]
        yield WindowView((0, chunk.end), pages.k, pages.v, self.page_table,
                         pages.dk if grads else None, pages.dv if grads else None)

    def save_selection(self, layer: int, chunk: ChunkSpan, selection: torch.Tensor | None) -> None:
        """Keep stage 1's page selection of (chunk, layer) for stage 2; freed with the chunk."""
        if chunk.index not in self._chunk_pages:
            raise RuntimeError(f"chunk {chunk.index} has no pages: cannot keep a selection for it")
        self._selections[chunk.index, layer] = selection

    def selection(self, layer: int, chunk: ChunkSpan) -> torch.Tensor | None:
        """Stage 1's page selection of (chunk, layer); None means every earlier page."""
        if (chunk.index, layer) not in self._selections:
            raise RuntimeError(f"no page selection for chunk {chunk.index}, layer {layer}: stage 1 makes it")
        return self._selections[chunk.index, layer]

    def windows(self, chunk: ChunkSpan, whole_history: bool = False, layer: int | None = None
                ) -> list[tuple[int, int]]:
        """The chunk's key windows on this store's pages (context parallel: the parts on its own);
        a window layer's start at its window (the only pages it reads, and with its own pages the only
        ones alive): ``window_history_starts``, or without them the first page of the chunk's window."""
        if layer in self.window_layers:
            first_key = self.window_history_starts.get(
                chunk.index, max(0, chunk.start - self.window + 1) // self.page_size * self.page_size)
        else:
            first_key = self.history_starts.get(chunk.index, 0)
        windows = attention_windows(chunk, self.page_size, None if whole_history else self.stream_block_pages,
                                    first_key)
        return windows if self.context is None else self.context.own_windows(windows, chunk.index)

    def stream(self, layer: int, chunk: ChunkSpan, grads: bool, whole_history: bool = False) -> Iterator[WindowView]:
        """The chunk's key windows in order, ready to read (and, with grads, to add dK/dV into);
        the caller launches its work on the window before asking for the next one. ``whole_history``:
        the history as one window where the pages are on the GPU (streamed pages keep their blocks)."""
        pages = self.layers[layer]
        windowed = layer in self.window_layers  # (subclasses may override windows(chunk, whole_history))
        key_ranges = self.windows(chunk, whole_history, layer) if windowed else self.windows(chunk, whole_history)
        for key_range in key_ranges:
            yield WindowView(key_range, pages.k, pages.v, self.table(layer),
                             pages.dk if grads else None, pages.dv if grads else None)

    def chunk_grads(self, layer: int, chunk: ChunkSpan) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's accumulated dK, dV as (B, Hkv, L, D): contributions of it and every later chunk.
        Zeros on a context-parallel rank not owning it (the owner's are broadcast, attention/function.py)."""
        if not self.owns(chunk):
            shape = (self.batch_size, self.num_kv_heads, chunk.length, self.head_dim)
            return (torch.zeros(shape, dtype=self.grad_dtype, device=self.device),
                    torch.zeros(shape, dtype=self.grad_dtype, device=self.device))
        pages = self.layers[layer]
        index = self._chunk_ids(chunk, layer)
        return (
            self._from_pages(pages.dk.index_select(0, index), chunk.length),
            self._from_pages(pages.dv.index_select(0, index), chunk.length),
        )

    def _to_pages(self, x: torch.Tensor) -> torch.Tensor:
        B, H, L, D = x.shape
        P = self.page_size
        n = -(-L // P)
        padded = torch.nn.functional.pad(x, (0, 0, 0, n * P - L))  # (B, H, n*P, D)
        return padded.reshape(B, H, n, P, D).transpose(1, 2).reshape(B * n, H, P, D)

    def _from_pages(self, pages: torch.Tensor, length: int) -> torch.Tensor:
        _, H, P, D = pages.shape
        B = self.batch_size
        n = pages.shape[0] // B
        return pages.reshape(B, n, H, P, D).transpose(1, 2).reshape(B, H, n * P, D)[:, :, :length]
