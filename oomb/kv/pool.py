"""Page ids and their free list: the allocator behind the paged KV store.

A page id indexes the first dimension of every layer's pool tensors (K, V, dK, dV), so one
allocation serves all layers: a chunk's token positions map to the same page ids in each layer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class PageRecord:
    page_id: int
    ref_cnt: int = 0


class PagePool:
    """Hands out page ids from a fixed capacity; only this class touches the free list."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page, got num_pages={num_pages}")
        self.records = [PageRecord(i) for i in range(num_pages)]
        self._free: deque[int] = deque(range(num_pages))

    @property
    def capacity(self) -> int:
        return len(self.records)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take n free pages; raises RuntimeError with the numbers when the pool is short."""
        if n > len(self._free):
            raise RuntimeError(
                f"page pool exhausted: {n} pages requested, {len(self._free)} of {self.capacity} free"
            )
        ids = [self._free.popleft() for _ in range(n)]
        for page_id in ids:
            record = self.records[page_id]
            assert record.ref_cnt == 0, f"page {page_id} on the free list is still referenced"
            record.ref_cnt = 1
        return ids

    def free(self, ids: list[int]) -> None:
        """Drop one reference of each page; a page with no reference returns to the free list."""
        for page_id in ids:
            record = self.records[page_id]
            if record.ref_cnt <= 0:
                raise RuntimeError(f"page {page_id} freed twice")
            record.ref_cnt -= 1
            if record.ref_cnt == 0:
                self._free.append(page_id)
