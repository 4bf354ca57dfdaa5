"""Host slots of offloaded sliding-window layers: a stack of chunk tails, bounded by the window.

A window layer's K/V of chunk c are read by other chunks only in its *tail*, the pages holding its
last W - 1 keys (kv/store.py, "Window layers"); its *head* is read by the chunk's own attention only.
With host offload a window layer therefore keeps on the host the tails of the chunks before the
current one and the current chunk's pages, like its GPU pages without offload:

* stage 1 stores only the chunk's tail (its own attention reads the head from the GPU tensors);
* stage 2, before recomputing chunk c, takes slots for its head (``WindowTier.refill``,
  kv/window_tier.py) and stores the recomputed k, v there (``rewrite``) before its attention reads
  them; ``free`` returns head and tail once its backward is done.

Stage 1 takes tails in chunk order and stage 2 returns chunks in reverse, so the slots are a stack.
Slot of page position p, per sequence (all sequences move together)::

    slots   | tail c0 | tail c1 | ... | tail c-1 | tail c | head c |
    chunk c: positions [first, tail) -> head slots, [tail, last) -> tail slots, stack base S_c
             S_0 = 0, S_{c+1} = S_c + (last_c - tail_c)

The most slots in use is the sum of the earlier tails plus one chunk, maximised over the chunks:
``window_pages_per_sequence`` (kv/store.py), the same count as the GPU pages of a window layer
without offload. A slot holds at most one live position (``take`` refuses otherwise), so a step
that used chunks out of this order fails loudly instead of overwriting a tail.
"""

from __future__ import annotations

from .store import ChunkSpan


class WindowSlots:
    """Position -> slot map of the window layers' host tier, and which position holds each slot."""

    def __init__(self, chunks: list[ChunkSpan], tail_starts: list[int], page_size: int) -> None:
        """``tail_starts[i]``: the first page position of chunk i's tail (its end page: no tail)."""
        self.slot_of: list[int] = []
        """Page position -> its slot (the same in every sequence)."""
        base, capacity = 0, 0
        for chunk, tail in zip(chunks, tail_starts, strict=True):
            first, last = chunk.start // page_size, -(-chunk.end // page_size)
            assert first <= tail <= last and len(self.slot_of) == first, (chunk, tail)
            tail_pages = last - tail
            self.slot_of += [base + tail_pages + p - first for p in range(first, tail)]  # head, above the tail
            self.slot_of += [base + p - tail for p in range(tail, last)]
            capacity = max(capacity, base + last - first)
            base += tail_pages
        self.capacity = max(capacity, 1)
        self._holder = [-1] * self.capacity  # slot -> live position (-1: free); only take/release touch it

    def take(self, first: int, last: int) -> None:
        """Give page positions [first, last) their slots; raises RuntimeError if one is held."""
        for p in range(first, last):
            holder = self._holder[self.slot_of[p]]
            if holder != -1:
                raise RuntimeError(f"window slot {self.slot_of[p]} for page {p} still holds page {holder}: "
                                   "chunks must be stored in order and freed in reverse")
            self._holder[self.slot_of[p]] = p

    def release(self, first: int, last: int) -> None:
        """Free the slots of the positions in [first, last) that hold one."""
        for p in range(first, last):
            if self._holder[self.slot_of[p]] == p:
                self._holder[self.slot_of[p]] = -1

    def runs(self, first: int, last: int) -> list[tuple[int, int, int]]:
        """Positions [first, last) as runs of consecutive slots: (start, stop, first slot). Raises
        RuntimeError for a position without its slot (freed, or never taken)."""
        runs: list[tuple[int, int, int]] = []
        for p in range(first, last):
            slot = self.slot_of[p]
            if self._holder[slot] != p:
                raise RuntimeError(f"page {p} of the window layers has no host slot (freed or never stored)")
            if runs and runs[-1][1] == p and runs[-1][2] + p - runs[-1][0] == slot:
                runs[-1] = (runs[-1][0], p + 1, runs[-1][2])
            else:
                runs.append((p, p + 1, slot))
        return runs

    @property
    def num_used(self) -> int:
        return sum(holder != -1 for holder in self._holder)
