"""Paged KV store: page allocator, per-layer pools, page tables."""

from .pool import PagePool, PageRecord
from .store import ChunkSpan, LayerPages, PagedKVStore, split_into_chunks

__all__ = ["ChunkSpan", "LayerPages", "PagePool", "PageRecord", "PagedKVStore", "split_into_chunks"]
