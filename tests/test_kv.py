"""The page allocator and the paged KV store."""

from __future__ import annotations

import pytest
import torch

from oomb.kv import ChunkSpan, PagedKVStore, PagePool, split_into_chunks


def test_pool_allocate_and_free():
    pool = PagePool(6)
    assert (pool.capacity, pool.num_free, pool.num_used) == (6, 6, 0)
    first = pool.allocate(4)
    second = pool.allocate(2)
    assert sorted(first + second) == list(range(6))
    assert (pool.num_free, pool.num_used) == (0, 6)
    assert all(pool.records[i].ref_cnt == 1 for i in first + second)
    pool.free(first)
    assert (pool.num_free, pool.num_used) == (4, 2)
    assert all(pool.records[i].ref_cnt == 0 for i in first)
    again = pool.allocate(4)
    assert sorted(again) == sorted(first)
    assert pool.allocate(0) == []


def test_pool_exhaustion_names_the_numbers():
    pool = PagePool(5)
    pool.allocate(3)
    with pytest.raises(RuntimeError, match="4 pages requested, 2 of 5 free"):
        pool.allocate(4)
    assert pool.num_free == 2, "a failed allocation takes nothing"


def test_pool_double_free_is_an_error():
    pool = PagePool(3)
    ids = pool.allocate(2)
    pool.free(ids[:1])
    with pytest.raises(RuntimeError, match=f"page {ids[0]} freed twice"):
        pool.free(ids[:1])
    assert pool.num_free == 2


@pytest.mark.parametrize("num_pages", [0, -1])
def test_pool_needs_a_page(num_pages):
    with pytest.raises(ValueError, match=f"at least one page, got num_pages={num_pages}"):
        PagePool(num_pages)


@pytest.mark.parametrize(
    ("num_tokens", "chunk_size", "spans"),
    [
        (1, 4, [(0, 0, 1)]),
        (8, 4, [(0, 0, 4), (1, 4, 8)]),
        (10, 4, [(0, 0, 4), (1, 4, 8), (2, 8, 10)]),
        (3, 32, [(0, 0, 3)]),
        (0, 4, []),
    ],
)
def test_split_into_chunks(num_tokens, chunk_size, spans):
    chunks = split_into_chunks(num_tokens, chunk_size)
    assert chunks == [ChunkSpan(*span) for span in spans]
    assert sum(chunk.length for chunk in chunks) == num_tokens


B, HKV, D, P = 2, 3, 8, 4
NUM_TOKENS = 18  # 5 pages per sequence, the last one half full
CHUNK = 8


def _store(num_layers: int = 2) -> PagedKVStore:
    return PagedKVStore(
        num_layers=num_layers, batch_size=B, num_tokens=NUM_TOKENS, num_kv_heads=HKV, head_dim=D,
        page_size=P, kv_dtype=torch.float32, grad_dtype=torch.float32, device=torch.device("cpu"),
    )


def _chunks() -> list[ChunkSpan]:
    return split_into_chunks(NUM_TOKENS, CHUNK)


def test_store_shapes_and_pool_size():
    store = _store()
    assert store.max_pages_per_seq == 5
    assert store.pool.capacity == B * 5
    assert store.page_table.shape == (B, 5) and store.page_table.dtype == torch.int32
    for layer in store.layers:
        for tensor in (layer.k, layer.v, layer.dk, layer.dv):
            assert tensor.shape == (B * 5, HKV, P, D)
    assert store.is_empty
    expected = 2 * 2 * (B * 5 * HKV * P * D) * (4 + 4)
    assert PagedKVStore.bytes_needed(
        num_layers=2, batch_size=B, num_tokens=NUM_TOKENS, num_kv_heads=HKV, head_dim=D, page_size=P,
        kv_dtype=torch.float32, grad_dtype=torch.float32,
    ) == expected == sum(t.numel() * t.element_size() for layer in store.layers
                         for t in (layer.k, layer.v, layer.dk, layer.dv))


def test_allocate_zeroes_the_gradient_buffers():
    store = _store()
    for layer in store.layers:
        layer.dk.fill_(float("nan"))
        layer.dv.fill_(7.0)
    chunk = _chunks()[1]  # tokens 8..15: pages 2, 3 of each sequence
    store.allocate(chunk)
    ids = store.page_table[:, 2:4].reshape(-1).long()
    assert len(set(ids.tolist())) == 2 * B
    assert store.pool.num_used == 2 * B
    untouched = torch.ones(store.pool.capacity, dtype=torch.bool)
    untouched[ids] = False
    for layer in store.layers:
        assert torch.equal(layer.dk[ids], torch.zeros_like(layer.dk[ids]))
        assert torch.equal(layer.dv[ids], torch.zeros_like(layer.dv[ids]))
        assert layer.dk[untouched].isnan().all()  # other pages are left alone
        assert (layer.dv[untouched] == 7.0).all()
        dk, dv = store.chunk_grads(0, chunk)
        assert dk.shape == dv.shape == (B, HKV, chunk.length, D)
        assert not dk.any() and not dv.any()


def test_allocating_a_chunk_twice_is_an_error():
    store = _store()
    chunk = _chunks()[0]
    store.allocate(chunk)
    with pytest.raises(RuntimeError, match="chunk 0 already has pages"):
        store.allocate(chunk)


@pytest.mark.parametrize("chunk_index", [0, 2], ids=["full_pages", "partial_last_page"])
def test_write_and_read_back_through_the_pages(chunk_index):
    store = _store()
    for layer in store.layers:  # garbage everywhere: the write must cover whole pages
        for tensor in (layer.k, layer.v):
            tensor.fill_(float("nan"))
    chunk = _chunks()[chunk_index]
    store.allocate(chunk)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(B, HKV, chunk.length, D, generator=g)
    v = torch.randn(B, HKV, chunk.length, D, generator=g)
    store.write(1, chunk, k, v)

    first, last = chunk.start // P, -(-chunk.end // P)
    for b in range(B):
        for t in range(chunk.length):
            page = int(store.page_table[b, first + t // P])
            assert torch.equal(store.layers[1].k[page, :, t % P], k[b, :, t])
            assert torch.equal(store.layers[1].v[page, :, t % P], v[b, :, t])
    # The tail of a partial last page is zero, never left uninitialised.
    pages = store.page_table[:, first:last].reshape(-1).long()
    assert not store.layers[1].k[pages].isnan().any()
    assert not store.layers[1].v[pages].isnan().any()
    tail = chunk.length % P
    if tail:
        last_pages = store.page_table[:, last - 1].long()
        assert not store.layers[1].k[last_pages][:, :, tail:].any()
        assert not store.layers[1].v[last_pages][:, :, tail:].any()
    assert store.layers[0].k.isnan().all(), "another layer's pages are not written"

    # Gradients written into the pages come back as (B, Hkv, L, D) in token order.
    dk = torch.randn(B, HKV, chunk.length, D, generator=g)
    dv = torch.randn(B, HKV, chunk.length, D, generator=g)
    for b in range(B):
        for t in range(chunk.length):
            page = int(store.page_table[b, first + t // P])
            store.layers[1].dk[page, :, t % P] = dk[b, :, t]
            store.layers[1].dv[page, :, t % P] = dv[b, :, t]
    got_dk, got_dv = store.chunk_grads(1, chunk)
    assert torch.equal(got_dk, dk) and torch.equal(got_dv, dv)


def test_store_casts_to_its_dtypes():
    store = PagedKVStore(
        num_layers=1, batch_size=1, num_tokens=8, num_kv_heads=1, head_dim=4, page_size=4,
        kv_dtype=torch.bfloat16, grad_dtype=torch.float32, device=torch.device("cpu"),
    )
    chunk = ChunkSpan(0, 0, 6)
    store.allocate(chunk)
    k = torch.randn(1, 1, 6, 4)
    store.write(0, chunk, k, k)
    assert store.layers[0].k.dtype == torch.bfloat16 and store.layers[0].dk.dtype == torch.float32
    page = int(store.page_table[0, 0])
    assert torch.equal(store.layers[0].k[page, 0], k[0, 0, :4].to(torch.bfloat16))


def test_free_returns_pages():
    store = _store()
    chunks = _chunks()
    for chunk in chunks:
        store.allocate(chunk)
    assert store.pool.num_free == 0 and not store.is_empty
    store.free(chunks[2])  # one page per sequence
    assert store.pool.num_free == B
    store.free(chunks[0])
    assert store.pool.num_free == 3 * B
    with pytest.raises((KeyError, RuntimeError)):
        store.free(chunks[0])
    store.free_all()
    assert store.is_empty and store.pool.num_free == store.pool.capacity
    store.free_all()  # nothing left: a no-op
    assert store.is_empty
    store.allocate(chunks[0])  # pages can be handed out again
    assert store.pool.num_used == 2 * B
