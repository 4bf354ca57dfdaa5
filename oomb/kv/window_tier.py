"""Host tier of offloaded sliding-window layers: their slabs, their slots, and when pages enter them.

With host offload (kv/offload.py) a global layer keeps every page of a step on the host; an offloaded
window layer keeps only what its GPU pages hold without offload, so its slabs are bounded by the window::

    window k, v, dk, dv   (window layers, B, slots, Hkv, P, D)   slots = ``window_pages_per_sequence``

A page position's slot comes from ``WindowSlots`` (kv/window_slots.py, the same in every sequence).
Over a step, ``OffloadedKVStore``'s page-lifetime calls do for the window layers:

* ``allocate``: slots for the chunk's tail only, the last W - 1 keys, all later windows read of it
  (stage 1 stores no head: the chunk's own attention reads it from the GPU tensors);
* ``refill``: stage 2, before the chunk's recompute, slots for its head, marked not yet written;
* ``rewrite``: the recomputed k, v go to those head slots before the chunk's attention stages them
  (the values stage 1 computed, as without offload), once per chunk;
* ``free``: head and tail slots go back once the chunk's backward is done.

A window layer keeps no page summaries (sparse mode reads windows densely) and is never gathered by
the mapped-memory kernels; window layers are not supported with context parallelism, so slots are
per position of the whole sequence.
"""

from __future__ import annotations

import torch

from .host_slabs import KINDS, HostSlabs
from .store import ChunkSpan, window_pages_per_sequence
from .window_slots import WindowSlots

WINDOW_SLAB = "window_"
"""Prefix of the window layers' slab names in HostSlabs ("window_k", ...)."""


def reserve_window_slabs(slabs: HostSlabs, dtypes: dict[str, torch.dtype], *, num_layers: int, batch_size: int,
                         num_tokens: int, chunk_size: int, num_kv_heads: int, head_dim: int, page_size: int,
                         window: int) -> dict[str, torch.Tensor]:
    """The host tensors of ``num_layers`` offloaded window layers, taken from ``slabs``: "window_k", ...
    (layers, B, slots, Hkv, P, D), slots = ``window_pages_per_sequence`` (module docstring)."""
    slots = window_pages_per_sequence(num_tokens, chunk_size, page_size, window)
    shape = (num_layers, batch_size, slots, num_kv_heads, page_size, head_dim)
    return {WINDOW_SLAB + kind: slabs.take(WINDOW_SLAB + kind, shape, dtypes[kind]) for kind in KINDS}


class WindowTier:
    """The offloaded window layers' host tensors and slots, addressed by offloaded layer index."""

    def __init__(self, tiers: dict[str, torch.Tensor], indices: list[int], chunks: list[ChunkSpan],
                 tail_starts: list[int], page_size: int) -> None:
        """``tiers``: what ``reserve_host_slabs`` took (the window slabs among them, if any); ``indices``:
        the offloaded indices of the window layers; ``tail_starts[i]``: chunk i's first tail page."""
        self.host = {kind: tiers[WINDOW_SLAB + kind] for kind in KINDS if WINDOW_SLAB + kind in tiers}
        """(window layers, B, window slots, Hkv, P, D) per kind, bounded by their window (module
        docstring); empty without them."""
        self.indices = indices
        self._rows = {index: row for row, index in enumerate(indices)}  # offloaded index -> row in ``host``
        self.slots = None
        if indices:
            self.slots = WindowSlots(chunks, tail_starts, page_size)
            assert self.slots.capacity == self.host["k"].shape[2], "window slots differ from slabs"
        self._refilled: set[int] = set()  # stage 2: chunks whose heads wait for ``rewrite``

    def __contains__(self, index: int) -> bool:
        """Whether offloaded layer ``index`` is a window layer of this tier."""
        return index in self._rows

    def layer(self, kind: str, index: int) -> torch.Tensor:
        """Window layer ``index``'s host tensor of ``kind``: (B, window slots, Hkv, P, D)."""
        return self.host[kind][self._rows[index]]

    def runs(self, first: int, last: int) -> list[tuple[int, int, slice]]:
        """The page positions [first, last) as runs (start, stop, where in a layer's host tensor), following
        their slots; raises RuntimeError for a position without its slot."""
        return [(start, stop, slice(slot, slot + stop - start)) for start, stop, slot in self.slots.runs(first, last)]

    # --- page lifetime (module docstring) -----------------------------------------------------------
    def allocate(self, tail: int, last: int) -> None:
        """Stage 1: slots for the chunk's tail pages [tail, last)."""
        self.slots.take(tail, last)

    def refill(self, chunk: ChunkSpan, first: int, tail: int, kv_on_host: torch.Tensor,
               grad_on_host: torch.Tensor) -> None:
        """Stage 2, before the chunk's recompute: slots for its head pages [first, tail), marked in the
        store's (offloaded layers, pages) ``kv_on_host`` and ``grad_on_host`` as not on the host."""
        if tail > first:
            self.slots.take(first, tail)
            kv_on_host[self.indices, first:tail] = False
            grad_on_host[self.indices, first:tail] = False  # no later window reaches a head
            self._refilled.add(chunk.index)

    def awaits_rewrite(self, index: int, chunk: ChunkSpan) -> bool:
        """Whether offloaded layer ``index`` is a window layer whose head of ``chunk`` waits for its
        recomputed k, v."""
        return index in self and chunk.index in self._refilled

    def free(self, chunk: ChunkSpan, first: int, last: int) -> None:
        """The chunk's backward is done: its head and tail slots go back."""
        self.slots.release(first, last)
        self._refilled.discard(chunk.index)

    def free_all(self, num_pages: int) -> None:
        """Every slot of the ``num_pages`` positions goes back (the end of a step)."""
        if self.slots is not None:
            self.slots.release(0, num_pages)
            self._refilled.clear()

    @property
    def is_empty(self) -> bool:
        return self.slots is None or self.slots.num_used == 0
