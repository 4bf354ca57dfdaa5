"""Host offload (oomb/kv/offload.py): the tier's bookkeeping with CPU tensors, and whole steps with
offload equal, bit for bit, to steps without. The same equality on a GPU (side streams, pinned
memory) is test_gpu_offload_* below, marked gpu."""

from __future__ import annotations

import mmap
import time

import pytest
import torch
from helpers import build_tiny_model, grads, page_locked, random_ids

import oomb
import oomb.engine
import oomb.kv.host_slabs
from oomb.config import OffloadConfig, PerformanceConfig, PrecisionConfig, SparseConfig, SparseResearch
from oomb.kv import ChunkSpan, PagedKVStore
from oomb.kv.capacity import PagesDoNotFitError, PageShape, check_pages_fit, page_footprint
from oomb.kv.offload import HostSlabs, OffloadedKVStore

P = 4  # page size of the bookkeeping tests


def _store(slabs: HostSlabs, tokens: int = 40, batch: int = 2, resident: int = 0, block_pages: int = 2,
           chunk: int = 8, **windows) -> OffloadedKVStore:
    return OffloadedKVStore(
        slabs=slabs, resident_layers=resident, stream_buffers=2, chunk_size=chunk,
        num_layers=2, batch_size=batch, num_tokens=tokens, num_kv_heads=2, head_dim=3, page_size=P,
        kv_dtype=torch.float32, grad_dtype=torch.float32, device=torch.device("cpu"), stream_block_pages=block_pages,
        **windows,
    )


def _kv(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 3, generator=g), torch.randn(batch, 2, length, 3, generator=g)


def test_slabs_are_reused_across_steps_and_grow_only_when_needed():
    slabs = HostSlabs(pin=False)
    a = slabs.take("k", (4, 8), torch.float32)
    b = slabs.take("k", (2, 8), torch.bfloat16)  # smaller: same memory
    assert slabs.allocations == 1 and a.data_ptr() == b.data_ptr()
    slabs.take("k", (100, 8), torch.float32)  # larger: replaced
    assert slabs.allocations == 2 and slabs.nbytes == 100 * 8 * 4
    _store(slabs), _store(slabs)  # the first regrows "k" and adds v, dk, dv; the second reuses all four
    assert slabs.allocations == 2 + 4
    slabs.release()
    assert slabs.nbytes == 0


def test_pinned_slabs_are_whole_pages_and_unregistered_when_replaced(monkeypatch):
    calls = []

    def register(t):
        assert t.data_ptr() % mmap.PAGESIZE == 0  # no page shared with another allocation
        calls.append(("pin", t.numel()))
        time.sleep(0.01)  # the time pinning takes is counted (a first step's overhead, reported apart)

    monkeypatch.setattr(oomb.kv.host_slabs, "_register", register)
    monkeypatch.setattr(oomb.kv.host_slabs, "_unregister", lambda t: calls.append(("unpin", t.numel())))
    slabs = HostSlabs(pin=True)
    slabs.take("dk", (3, 1000), torch.float32)  # 12,000 bytes: three 4 KiB pages, not a power of two
    slabs.take("dk", (2, 1000), torch.float32)  # reused
    slabs.take("dk", (5, 1000), torch.float32)  # replaced: the old one is unpinned first
    assert slabs.pin_seconds >= 0.02
    slabs.release()
    page = mmap.PAGESIZE
    assert calls == [("pin", -(-12000 // page) * page), ("unpin", -(-12000 // page) * page),
                     ("pin", -(-20000 // page) * page), ("unpin", -(-20000 // page) * page)]


def test_pages_go_to_the_host_by_position_and_unwritten_pages_are_never_read():
    store = _store(HostSlabs(pin=False))
    c0, c1 = ChunkSpan(0, 0, 8), ChunkSpan(1, 8, 16)
    store.allocate(c0)
    k, v = _kv(2, 8, 0)
    store.write(1, c0, k, v)
    assert store.kv_on_host[1, :2].all() and not store.kv_on_host[0].any() and not store.kv_on_host[1, 2:].any()
    # sequence b, position p -> host[layer - resident, b, p]
    torch.testing.assert_close(store.host["k"][1, 1, 1], k[1, :, 4:8], rtol=0, atol=0)
    store.allocate(c1)
    with pytest.raises(RuntimeError, match="never written"):  # layer 0 of chunk 0 was not stored
        list(store.stream(0, c1, grads=False))
    k1, v1 = _kv(2, 8, 1)
    store.write(1, c1, k1, v1)  # stage 1: the chunk's pages are written, then attention reads them
    views = list(store.stream(1, c1, grads=False))
    assert [view.key_range for view in views] == [(0, 8), (8, 16)]
    assert views[1].k.data_ptr() != store.slots[0].k.data_ptr()  # its own pages come straight from the GPU
    history = views[0]  # staged: read through the window's own page table
    ids = history.page_table[1, :2].long()
    torch.testing.assert_close(history.k[ids].transpose(0, 1).reshape(2, 8, 3), k[1], rtol=0, atol=0)
    store.free_all()


def test_gradients_start_from_zero_then_accumulate_on_the_host():
    slabs = HostSlabs(pin=False)
    store = _store(slabs)
    for kind in ("dk", "dv"):  # whatever an earlier step left must never be read
        store.host[kind].fill_(float("nan"))
    chunks = [ChunkSpan(i, 8 * i, 8 * i + 8) for i in range(3)]
    for chunk in chunks:
        store.allocate(chunk)
        for layer in range(2):
            store.write(layer, chunk, *_kv(2, 8, chunk.index))
    # Backward of chunk 2 (history windows [0, 8), [8, 16), then itself): gradients start at zero.
    seen = []
    for view in store.stream(1, chunks[2], grads=True):
        ids = view.page_table[:, view.key_range[0] // P:view.key_range[1] // P].reshape(-1).long()
        seen.append(view.dk[ids].clone())
        view.dk[ids] += 1.0  # what an attention backward adds
        view.dv[ids] += 2.0
    assert all(torch.equal(s, torch.zeros_like(s)) for s in seen)
    assert store.grad_on_host[1, :4].all() and not store.grad_on_host[1, 4:].any()
    assert torch.equal(store.host["dk"][1, :, :4], torch.ones_like(store.host["dk"][1, :, :4]))
    dk, dv = store.chunk_grads(1, chunks[2])  # the chunk's own pages: kept on the GPU, returned
    assert torch.equal(dk, torch.ones_like(dk)) and torch.equal(dv, 2 * torch.ones_like(dv))
    store.free(chunks[2])
    # Chunk 1 continues from what chunk 2 wrote back, for its history and its own pages.
    for view in store.stream(1, chunks[1], grads=True):
        ids = view.page_table[:, view.key_range[0] // P:view.key_range[1] // P].reshape(-1).long()
        assert torch.equal(view.dk[ids], torch.ones_like(view.dk[ids]))
        view.dk[ids] += 1.0
    dk, _ = store.chunk_grads(1, chunks[1])
    assert torch.equal(dk, 2 * torch.ones_like(dk))
    with pytest.raises(RuntimeError, match="no gradients"):
        store.chunk_grads(1, chunks[1])
    store.free_all()
    assert store.is_empty


def test_window_layers_stage_only_their_windows_and_write_back_only_their_gradients():
    """Layer 0 slides (window 3: a chunk of 8 sees 2 keys before it, on one page), layer 1 is global.
    Per call, layer 0 stages the one page before its chunk, layer 1 every earlier page, in stage 1 and
    in stage 2 (where both also stage their own chunk); stage 2 writes back only staged pages' gradients."""
    store = _store(HostSlabs(pin=False), window_layers=(0,), window=3)
    chunks = [ChunkSpan(i, 8 * i, 8 * i + 8) for i in range(5)]  # 10 pages of 4 per sequence
    staged = {0: [], 1: []}

    def attend(layer, chunk, backward):
        before = store.staged_history_pages
        for view in store.stream(layer, chunk, backward):
            if backward:
                ids = view.page_table[:, view.key_range[0] // P:-(-view.key_range[1] // P)].reshape(-1).long()
                view.dk[ids] += 1.0  # what an attention backward adds
            yield view.key_range
        staged[layer].append(store.staged_history_pages - before)

    for chunk in chunks:  # stage 1
        store.allocate(chunk)
        for layer in range(2):
            store.write(layer, chunk, *_kv(2, 8, chunk.index))
            windows = list(attend(layer, chunk, backward=False))
            if layer == 0 and chunk.index:  # (no window_history_starts: the window's own first page)
                assert windows == [(chunk.start - 4, chunk.start), (chunk.start, chunk.end)]
    assert staged == {0: [0, 1, 1, 1, 1], 1: [0, 2, 4, 6, 8]}
    # Layer 0's host pages: the tails (its last page, the one the next window reaches) of the chunks
    # before the current one, plus that chunk: 4 + 2 slots per sequence, not 10; layer 1 keeps all 10.
    assert store.window_host["k"].shape[:3] == (1, 2, 6) and store.host["k"].shape[:3] == (1, 2, 10)
    assert store.window_slots.num_used == 4  # stage 1 stores only the tails (the last chunk has none)
    for chunk in reversed(chunks):  # stage 2: forward, then backward, of both layers
        store.refill(chunk)  # layer 0's head: slots, filled by the recomputed k, v before its attention
        with pytest.raises(RuntimeError, match="never written"):
            list(store.stream(0, chunk, grads=False))
        for layer in range(2):
            store.rewrite(layer, chunk, *_kv(2, 8, chunk.index))  # (layer 1: nothing to do)
        for backward in (False, True):
            for layer in range(2):
                list(attend(layer, chunk, backward))
        for layer in range(2):
            dk, _ = store.chunk_grads(layer, chunk)
            # Layer 0: its chunk's last page also got the next chunk's window's gradient.
            want = torch.ones_like(dk)
            if layer == 0 and chunk.index < 4:
                want[:, :, 4:] = 2
            elif layer == 1:
                want *= 1 + (4 - chunk.index)
            assert torch.equal(dk, want), (layer, chunk.index)
        store.free(chunk)
    assert staged[0][5:] == [1, 1] * 4 + [0, 0] and staged[1][5:] == [8, 8, 6, 6, 4, 4, 2, 2, 0, 0]
    assert store.grad_on_host[0].tolist() == [i % 2 == 1 and i < 8 for i in range(10)]
    assert store.grad_on_host[1].tolist() == [i < 8 for i in range(10)]
    store.free_all()
    assert store.is_empty and store.slot_pages == 2


def test_staging_slots_shrink_to_windows_when_every_offloaded_layer_slides():
    """Blocks of 8 pages; windows of 6 keys cover at most 2 pages before a chunk (of 2 pages): slots of
    2 pages when every offloaded layer slides, of a block as soon as one global layer is offloaded."""
    slabs = HostSlabs(pin=False)
    assert _store(slabs, block_pages=8, window_layers=(0, 1), window=6).slot_pages == 2
    assert _store(slabs, block_pages=8, window_layers=(1,), window=6, resident=1).slot_pages == 2
    assert _store(slabs, block_pages=8, window_layers=(0,), window=6).slot_pages == 8
    assert _store(slabs, block_pages=8, window_layers=(0, 1), window=30).slot_pages == 8  # 29 keys: 8 pages, a block
    assert _store(slabs, block_pages=8, window_layers=(0, 1), window=6, chunk=16).slot_pages == 4  # the chunk


def test_resident_layers_keep_gpu_pools():
    store = _store(HostSlabs(pin=False), resident=1)
    assert len(store.layers) == 1 and store.host["k"].shape[0] == 1
    chunk = ChunkSpan(0, 0, 8)
    store.allocate(chunk)
    store.write(0, chunk, *_kv(2, 8, 1))
    assert not store.kv_on_host.any()  # layer 0 went to its GPU pool
    view = next(iter(store.stream(0, chunk, grads=True)))
    assert view.k is store.layers[0].k and view.dk is store.layers[0].dk
    store.free_all()


@pytest.fixture
def offload_stores(monkeypatch):
    """Every OffloadedKVStore the engine creates during the test."""
    created = []

    class Recording(OffloadedKVStore):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            created.append(self)

    monkeypatch.setattr(oomb.engine, "OffloadedKVStore", Recording)
    return created


def _steps(model, config, lengths, slabs=None):
    out = []
    for i, tokens in enumerate(lengths):
        model.zero_grad(set_to_none=True)
        ids = random_ids(1, tokens, seed=10 + i)
        loss = oomb.forward_backward(model, ids, None, config, host_slabs=slabs)
        out.append((loss, grads(model)))
    return out


SPARSE = {"budget": 2, "sink_pages": 1}
"""The sparse options of the offloaded sparse steps below (with attention="sparse")."""


@pytest.mark.parametrize("resident", [0, 1])
@pytest.mark.parametrize(("selection", "group", "pooling", "score"),
                         [("kv_head", 1, "max", "minmax"), ("shared", 1, "max", "minmax"),
                          ("kv_head", 4, "max", "minmax"), ("kv_head", 1, "softmax_max", "minmax"),
                          ("kv_head", 1, "max", "rerank"), ("kv_head", 4, "max", "rerank")])
@pytest.mark.parametrize("staging", ["gather", pytest.param("copy per run", marks=pytest.mark.slow)])
def test_sparse_offload_steps_equal_sparse_steps_without_bitwise(resident, selection, group, pooling, score, staging,
                                                                 offload_stores, monkeypatch):
    """Sparse: only the selected pages (and the chunk's own) are staged; same bits as on the GPU tier.
    Staged by index kernels over the host tensors, or (devices without mapped host memory) by copies.
    Score "rerank": its candidates' keys are staged in stage 1 for scoring. "copy per run" stands for a
    CUDA device without mapped slabs, which stages the union: no gather by device index."""
    import oomb.kv.head_rows as head_rows

    if staging == "copy per run":
        monkeypatch.setattr(HostSlabs, "mapped", lambda *args: None)
        monkeypatch.setattr(head_rows.HeadRowStaging, "_gathers_by_device_index",
                            lambda self, documents_allowed=False: False)  # as CUDA
    model = build_tiny_model("qwen2", seed=4)
    base = oomb.OOMBConfig(chunk_size=32, page_size=8, attention="sparse",
                           sparse=SparseConfig(**SPARSE, query_block_pages=group, score=score,
                                               research=SparseResearch(selection=selection, pooling=pooling,
                                                                       rerank_factor=2)),
                           performance=PerformanceConfig(backend="torch"), offload=OffloadConfig(stream_block_pages=2))
    lengths = (150, 97, 200)
    want = _steps(model, base, lengths)
    offload = base.with_options({"offload.enabled": True, "offload.resident_layers": resident})
    got = _steps(model, offload, lengths, HostSlabs(pin=False))
    for (loss_a, grads_a), (loss_b, grads_b) in zip(want, got, strict=True):
        assert torch.equal(loss_a, loss_b)
        for name in grads_a:
            assert torch.equal(grads_a[name], grads_b[name]), name
    assert all(store.is_empty for store in offload_stores)
    assert all((store.mapped_host is None) == (staging == "copy per run") for store in offload_stores)


def _assert_offload_is_bitwise_the_same(model, ids, base: oomb.OOMBConfig) -> None:
    """One step of ``base`` and one with offload (unpinned slabs): the same loss and gradients, bit for bit."""
    results = []
    for config, slabs in ((base, None), (base.with_options({"offload.enabled": True}), HostSlabs(pin=False))):
        model.zero_grad(set_to_none=True)
        results.append((oomb.forward_backward(model, ids, None, config, host_slabs=slabs), grads(model)))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[name], grads_b[name]) for name in grads_a)


def _record_calls(monkeypatch, cls, method: str, arg: int) -> list:
    """Wrap ``cls.method``: the list of its ``arg``-th positional argument (after self) per call."""
    calls, original = [], getattr(cls, method)
    monkeypatch.setattr(cls, method, lambda self, *args: calls.append(args[arg]) or original(self, *args))
    return calls


@pytest.mark.parametrize("score", ["minmax", "rerank"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("resident", [0, 1])
@pytest.mark.parametrize("staging", ["gather", pytest.param("host tensors", marks=pytest.mark.slow)])
def test_head_row_staging_is_bitwise_the_same(score, batch, resident, staging, offload_stores, monkeypatch):
    """One selection per chunk moves as (page, KV head) rows in both stages (virtual
    pages; gradients written back per head, a page's other heads zeroed on its first write), and so do
    rerank's candidate keys: the same bits as without offload."""
    import oomb.kv.head_rows as head_rows

    if staging == "host tensors":  # a CPU device without mapped slabs reads the host tensors themselves
        monkeypatch.setattr(HostSlabs, "mapped", lambda *args: None)
    calls = _record_calls(monkeypatch, head_rows.HeadRowStaging, "_stage_head_rows", 4)  # grads
    scored = _record_calls(monkeypatch, head_rows.HeadRowStaging, "scoring_head_rows", 3)  # candidates
    model = build_tiny_model("qwen2", seed=4)
    ids = random_ids(batch, 200, seed=3)
    base = oomb.OOMBConfig(chunk_size=32, page_size=8, attention="sparse",
                           sparse=SparseConfig(**SPARSE, query_block_pages=4, score=score,
                                               research=SparseResearch(rerank_factor=2)),
                           performance=PerformanceConfig(backend="torch"),
                           offload=OffloadConfig(resident_layers=resident))
    _assert_offload_is_bitwise_the_same(model, ids, base)
    assert True in calls and False in calls  # backward and forward calls staged by head rows
    assert bool(scored) == (score == "rerank")  # rerank's candidate keys too
    assert all(store.is_empty for store in offload_stores)


@pytest.mark.parametrize("batch", [1, 2])
def test_leak_free_candidates_move_in_place_by_default(batch, offload_stores, monkeypatch):
    """Leak-free rerank's candidate keys keep their page layout (their score masks the last history page by
    position) and move by stage 1's in-place path, without a sync, the selections by (page, head) rows: the
    same bits as without offload."""
    import oomb.kv.head_rows as head_rows
    import oomb.kv.sparse_staging as staging_module

    in_place = _record_calls(monkeypatch, staging_module.SparseStaging, "_stage_in_place", 3)
    rows = _record_calls(monkeypatch, head_rows.HeadRowStaging, "_stage_head_rows", 4)
    model = build_tiny_model("qwen2", seed=4)
    base = oomb.OOMBConfig(chunk_size=32, page_size=8, attention="sparse",
                           sparse=SparseConfig(**SPARSE, query_block_pages=4, score="rerank", leak_free=True,
                                               research=SparseResearch(rerank_factor=2)),
                           performance=PerformanceConfig(backend="torch"))
    _assert_offload_is_bitwise_the_same(model, random_ids(batch, 200, seed=3), base)
    assert in_place and all(pages.shape[0] == batch for pages in in_place)  # the candidates' keys
    assert rows  # the selections themselves: (page, head) rows
    assert all(store.is_empty for store in offload_stores)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("staging", ["gather", "copy per run"])
def test_sparse_offload_of_two_sequences_equals_sparse_bitwise(group, staging, monkeypatch):
    """Two sequences: each one's pages are gathered into its own rows and written back to its own slots
    ("copy per run": the union's copies, as on a CUDA device without mapped slabs)."""
    import oomb.kv.head_rows as head_rows

    if staging == "copy per run":
        monkeypatch.setattr(HostSlabs, "mapped", lambda *args: None)
        monkeypatch.setattr(head_rows.HeadRowStaging, "_gathers_by_device_index",
                            lambda self, documents_allowed=False: False)  # as CUDA
    model = build_tiny_model("qwen2", seed=4)
    ids = random_ids(2, 150, seed=3)
    base = oomb.OOMBConfig(chunk_size=32, page_size=8, attention="sparse", sparse=SparseConfig(**SPARSE,
                                                                                               query_block_pages=group),
                           performance=PerformanceConfig(backend="torch"))
    _assert_offload_is_bitwise_the_same(model, ids, base)


def test_query_groups_stage_fewer_pages(offload_stores):
    """One selection per group of query blocks: a chunk's calls stage fewer distinct history pages."""
    model = build_tiny_model("qwen2", seed=4)
    staged = {}
    for group in (1, 4):  # 4 query blocks per chunk: one selection per chunk
        config = oomb.OOMBConfig(chunk_size=32, page_size=8, attention="sparse", sparse=SparseConfig(**SPARSE,
                                                                                                     query_block_pages=group),
                                 performance=PerformanceConfig(backend="torch"), offload=OffloadConfig(enabled=True))
        offload_stores.clear()
        oomb.forward_backward(model, random_ids(1, 200, seed=12), None, config, host_slabs=HostSlabs(pin=False))
        staged[group] = sum(store.staged_history_pages for store in offload_stores)
    assert 0 < staged[4] < staged[1]


def test_sparse_stage_two_calls_are_prefetched(offload_stores):
    """Stage 2 knows every call's selection (kept on the host since stage 1): each sparse call but
    the first of stage 2 finds its pages staged by the call before it."""
    model = build_tiny_model("llama", seed=1)  # 2 layers
    config = oomb.OOMBConfig(chunk_size=32, page_size=8, attention="sparse", sparse=SparseConfig(**SPARSE),
                             performance=PerformanceConfig(backend="torch"),
                             offload=OffloadConfig(enabled=True))
    oomb.forward_backward(model, random_ids(1, 100, seed=0), None, config)  # 4 chunks
    # Chunks 1-3 select pages (chunk 0 has no history); stage 1 cannot stage them ahead (a selection
    # is made by its own call). Stage 2: 3 chunks x 2 layers x (forward, backward), the first unpredicted.
    assert offload_stores[0].prefetch_hits == 3 * 2 * 2 - 1


def test_sparse_runs_split_by_gradient_state():
    from oomb.kv.sparse_staging import _runs

    on_host = torch.tensor([True, True, False, False, True, True, True, False])
    assert _runs([0, 1, 2, 4, 5, 7], on_host) == [(0, 2, 0), (2, 3, 2), (4, 6, 3), (7, 8, 5)]
    assert _runs([3, 4], on_host, offset=6) == [(3, 4, 6), (4, 5, 7)]


@pytest.mark.parametrize("resident", [0, 1])
def test_offload_steps_equal_steps_without_bitwise(resident):
    """Three steps of different lengths in one process, slabs reused; several history windows."""
    model = build_tiny_model("qwen2", seed=3)
    base = oomb.OOMBConfig(chunk_size=32, page_size=8, performance=PerformanceConfig(backend="torch"),
                           offload=OffloadConfig(stream_block_pages=2))
    lengths = (150, 97, 200)
    want = _steps(model, base, lengths)
    slabs = HostSlabs(pin=False)
    offload = base.with_options({"offload.enabled": True, "offload.resident_layers": resident})
    got = _steps(model, offload, lengths, slabs)
    assert slabs.allocations == 4 * 2  # one slab per kind, regrown once for the longest step
    for (loss_a, grads_a), (loss_b, grads_b) in zip(want, got, strict=True):
        assert torch.equal(loss_a, loss_b)
        for name in grads_a:
            assert torch.equal(grads_a[name], grads_b[name]), name


def test_next_calls_are_predicted_and_prefetched(offload_stores):
    model = build_tiny_model("llama", seed=1)  # 2 layers
    config = oomb.OOMBConfig(chunk_size=32, page_size=8, performance=PerformanceConfig(backend="torch"),
                             offload=OffloadConfig(enabled=True, stream_block_pages=1))
    oomb.forward_backward(model, random_ids(1, 100, seed=0), None, config)  # 4 chunks
    # Calls that read history: stage 1, chunks 1-3 x 2 layers (6); stage 2, chunks 3-1 x 2 layers x
    # (forward, backward) (12). Each is prefetched by the call before it, except the first call of
    # stage 2, which is not predicted.
    store = offload_stores[0]
    assert store.prefetch_hits == 6 + 12 - 1


def test_engine_uses_the_host_tier_and_leaves_it_empty(offload_stores):
    model = build_tiny_model("llama", seed=1)
    config = oomb.OOMBConfig(chunk_size=32, page_size=8, performance=PerformanceConfig(backend="torch"),
                             offload=OffloadConfig(enabled=True))
    oomb.forward_backward(model, random_ids(1, 100, seed=0), None, config)
    assert len(offload_stores) == 1 and offload_stores[0].is_empty and offload_stores[0].kv_on_host.all()
    # host_slabs=None: the store owns the slabs it viewed, so they stay pinned for the whole step
    assert offload_stores[0].slabs.nbytes > 0


def test_config_refuses_bad_offload_options():
    with pytest.raises(ValueError, match="offload.stream_buffers=1 must be an integer >= 2"):
        oomb.OOMBConfig(offload=OffloadConfig(stream_buffers=1))
    with pytest.raises(ValueError, match="offload.resident_layers=-1"):
        oomb.OOMBConfig(offload=OffloadConfig(resident_layers=-1))
    with pytest.raises(TypeError, match="read offload.enabled"):  # `if config.offload:` of earlier versions
        bool(oomb.OOMBConfig().offload)


SHAPE_7B_1M = PageShape(num_layers=28, batch_size=1, num_tokens=1 << 20, num_kv_heads=4, head_dim=128,
                        kv_dtype=torch.bfloat16)
GIB = 1024**3


def test_page_footprint_of_the_7b_shape():
    dense = page_footprint(SHAPE_7B_1M, oomb.OOMBConfig())
    assert dense == type(dense)(gpu=28 * (1 << 20) * 2 * 4 * 128 * (2 + 4), host=0)
    offload = page_footprint(SHAPE_7B_1M, oomb.OOMBConfig(offload=OffloadConfig(enabled=True),
                                                          precision=PrecisionConfig(kv_grad_dtype="bfloat16")))
    assert offload.gpu == 0 and offload.host == 28 * (1 << 20) * 2 * 4 * 128 * 4  # 112 GiB


def test_pages_that_do_not_fit_fail_early_naming_bytes_and_options():
    with pytest.raises(PagesDoNotFitError) as err:
        check_pages_fit(SHAPE_7B_1M, oomb.OOMBConfig(), gpu_free=120 * GIB, host_free=125 * GIB)
    message = str(err.value)
    assert "GPU needs 168.00 GiB, 120.00 GiB available" in message
    assert "offload.enabled=True, precision.kv_grad_dtype='bfloat16'" in message and "options that would fit" in message
    with pytest.raises(PagesDoNotFitError, match="no page option fits"):
        check_pages_fit(SHAPE_7B_1M, oomb.OOMBConfig(offload=OffloadConfig(enabled=True)), gpu_free=10 * GIB,
                        host_free=50 * GIB)
    check_pages_fit(SHAPE_7B_1M, oomb.OOMBConfig(offload=OffloadConfig(enabled=True),
                                                 precision=PrecisionConfig(kv_grad_dtype="bf16")), 10 * GIB, 125 * GIB)


def test_engine_checks_pages_against_free_memory_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * GIB, 140 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(oomb.engine, "host_available_bytes", lambda: 115 * GIB)
    cuda = torch.device("cuda")
    with pytest.raises(PagesDoNotFitError, match="GPU needs 168.00 GiB, 100.00 GiB available"):
        oomb.engine._check_pages(SHAPE_7B_1M, oomb.OOMBConfig(), cuda, None)
    with pytest.raises(PagesDoNotFitError, match="host RAM needs 112.00 GiB, 115.00 GiB available"):
        offload = oomb.OOMBConfig(offload=OffloadConfig(enabled=True), precision=PrecisionConfig(kv_grad_dtype="bf16"))
        oomb.engine._check_pages(SHAPE_7B_1M, offload, cuda, None)
    slabs = HostSlabs(pin=False)
    slabs.take("k", (20 * 1024**2,), torch.float32)  # 80 MiB held from an earlier step count as available
    monkeypatch.setattr(oomb.engine, "host_available_bytes", lambda: int(117.85 * GIB))
    oomb.engine._check_pages(SHAPE_7B_1M, oomb.OOMBConfig(offload=OffloadConfig(enabled=True),
                                                          precision=PrecisionConfig(kv_grad_dtype="bf16")), cuda, slabs)
    oomb.engine._check_pages(SHAPE_7B_1M, oomb.OOMBConfig(), torch.device("cpu"), None)  # not checked on CPU


def test_a_later_step_reusing_its_pinned_slabs_is_not_refused(monkeypatch):
    """The headroom applies to what a step must newly pin, not to slabs it reuses: a 1M-token `oomb train` on an
    H100 (128 GiB host) ran its first step and was refused at its second with "host RAM needs 114.00 GiB, 119.51
    GiB available" (114 > 0.95 x 119.51), its 114 GiB of slabs among the 119.51."""
    config = oomb.OOMBConfig(offload=OffloadConfig(enabled=True), precision=PrecisionConfig(kv_grad_dtype="bf16"))
    need = page_footprint(SHAPE_7B_1M, config).host  # 112 GiB
    check_pages_fit(SHAPE_7B_1M, config, None, host_free=int(5.5 * GIB), host_held=need)
    check_pages_fit(SHAPE_7B_1M, config, None, host_free=int(0.95 * 40 * GIB) + GIB, host_held=80 * GIB)
    with pytest.raises(PagesDoNotFitError, match=r"host RAM needs 112.00 GiB \(80.00 GiB of it pinned already\), "
                                                 r"30.00 GiB more available"):
        check_pages_fit(SHAPE_7B_1M, config, None, host_free=30 * GIB, host_held=80 * GIB)
    monkeypatch.setattr(oomb.engine, "host_available_bytes", lambda: int(5.5 * GIB))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    slabs = HostSlabs(pin=False)
    slabs._slabs["k"] = torch.empty(1, dtype=torch.uint8).expand(need)  # the first step's bytes, not allocated here
    oomb.engine._check_pages(SHAPE_7B_1M, config, torch.device("cuda"), slabs)


def test_pages_freed_into_the_caching_allocator_count_as_free(monkeypatch):
    """A second step's check sees the first step's pages, freed but still reserved by PyTorch's caching
    allocator, as available (the driver's free figure misses them: a 1M-token `oomb train` stopped at its
    second step with "GPU needs 84.00 GiB, 11.40 GiB available")."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(11.4 * GIB), 140 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 125 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 16 * GIB)  # the weights
    cuda = torch.device("cuda")
    assert oomb.machine.gpu_free_bytes(cuda) == int(11.4 * GIB) + 109 * GIB
    # 112 GiB of pages with every layer on the GPU
    gpu_only = oomb.OOMBConfig(precision=PrecisionConfig(kv_grad_dtype="bf16"))
    oomb.engine._check_pages(SHAPE_7B_1M, gpu_only, cuda, None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 125 * GIB)  # still in use: no
    with pytest.raises(PagesDoNotFitError, match="GPU needs 112.00 GiB, 11.40 GiB available"):
        oomb.engine._check_pages(SHAPE_7B_1M, gpu_only, cuda, None)


@pytest.mark.gpu
def test_gpu_freed_pages_count_as_free_memory():
    """On the GPU: memory freed into the caching allocator is counted free again."""
    device = torch.device("cuda")
    before = oomb.machine.gpu_free_bytes(device)
    pages = torch.empty(4 * GIB, dtype=torch.uint8, device=device)
    assert oomb.machine.gpu_free_bytes(device) <= before - 4 * GIB + 64 * 1024**2
    del pages
    assert torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) >= 4 * GIB  # still cached
    assert oomb.machine.gpu_free_bytes(device) >= before - 64 * 1024**2


@pytest.mark.gpu
def test_gpu_offload_steps_equal_steps_without_bitwise(offload_stores):
    """On the GPU (Triton kernels, side streams, pinned slabs): 3 steps of different lengths. The Triton
    backend is pinned: "auto" gives bf16 cuDNN, whose dense path reads the GPU-resident history as one
    window and offloaded pages block by block (other float operations; cudnn is not bitwise promised)."""
    torch.manual_seed(0)
    model = build_tiny_model("qwen2", seed=5, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=3).to("cuda", torch.bfloat16)
    base = oomb.OOMBConfig(chunk_size=256, page_size=64, offload=OffloadConfig(stream_block_pages=4),
                           performance=PerformanceConfig(backend="triton"))
    lengths = (1500, 900, 2100)
    want = _steps(model, base, lengths)
    slabs = HostSlabs()
    for resident in (0, 1):
        offload = base.with_options({"offload.enabled": True, "offload.resident_layers": resident})
        got = _steps(model, offload, lengths, slabs)
        for (loss_a, grads_a), (loss_b, grads_b) in zip(want, got, strict=True):
            assert torch.equal(loss_a, loss_b)
            for name in grads_a:
                assert torch.equal(grads_a[name], grads_b[name]), (resident, name)
    assert slabs.pin and all(page_locked(slab) for slab in slabs._slabs.values())
    assert page_locked(torch.empty(64, pin_memory=True)) and not page_locked(torch.empty(64))  # the probe itself
    for group in (1, 4):  # one selection per page of queries, or per 4 of them
        sparse = base.with_options({"attention": "sparse", "sparse": {**SPARSE, "query_block_pages": group}})
        want = _steps(model, sparse, lengths)
        got = _steps(model, sparse.with_options({"offload.enabled": True}), lengths, slabs)
        for (loss_a, grads_a), (loss_b, grads_b) in zip(want, got, strict=True):
            assert torch.equal(loss_a, loss_b)
            for name in grads_a:
                assert torch.equal(grads_a[name], grads_b[name]), ("sparse", group, name)
    # Sparse staging ran through kernels over the mapped slabs, not copies per run (kv/mapped.py).
    assert offload_stores and all(store.mapped_host is not None for store in offload_stores)


def test_page_store_without_offload_streams_the_same_windows():
    store = PagedKVStore(num_layers=1, batch_size=1, num_tokens=40, num_kv_heads=1, head_dim=2, page_size=P,
                         kv_dtype=torch.float32, grad_dtype=torch.float32, device=torch.device("cpu"),
                         stream_block_pages=3)
    assert store.windows(ChunkSpan(3, 24, 32)) == [(0, 12), (12, 24), (24, 32)]
    assert store.windows(ChunkSpan(0, 0, 8)) == [(0, 8)]


def test_mapped_views_only_where_kernels_can_address_the_slabs():
    """On a CPU device the host tensors are used in place; on a GPU only registered slabs are
    aliased."""
    import oomb.kv.mapped as mapped

    slabs = HostSlabs(pin=False)
    taken = slabs.take("k", (3, 4, 8), torch.bfloat16)
    in_place = slabs.mapped("k", (3, 4, 8), torch.bfloat16, torch.device("cpu"))
    assert in_place.data_ptr() == taken.data_ptr() and in_place.shape == taken.shape
    assert slabs.mapped("k", (3, 4, 8), torch.bfloat16, torch.device("cuda")) is None  # not registered
    assert mapped.mapped_view(taken.view(torch.uint8).flatten(), torch.device("cpu")) is None


def test_pages_move_as_rows_of_8_byte_words_where_they_divide():
    from oomb.kv.mapped import rows_of

    pages = torch.arange(3 * 2 * 8, dtype=torch.float32).view(3, 2, 8).to(torch.bfloat16)
    rows = rows_of(pages)
    assert rows.dtype == torch.int64 and rows.shape == (3, 4) and rows.data_ptr() == pages.data_ptr()
    odd = torch.zeros(3, 1, 3, dtype=torch.bfloat16)  # 6 bytes per page: elements as they are
    assert rows_of(odd).dtype == torch.bfloat16 and rows_of(odd).shape == (3, 3)


def test_a_selection_shared_by_every_block_stays_one_row_on_the_host():
    """An offloaded layer keeps a chunk-wide selection (stride 0 over the blocks) as one host row and
    hands it back still expanded, so stage 2 groups it without reading it."""
    store = _store(HostSlabs(pin=False))
    chunk = ChunkSpan(1, 8, 16)
    store.allocate(ChunkSpan(0, 0, 8))
    store.allocate(chunk)
    row = torch.tensor([[[[0]], [[1]]], [[[1]], [[0]]]], dtype=torch.int32)  # (B=2, Hkv=2, 1, K=1)
    store.save_selection(0, chunk, row.expand(2, 2, 2, 1))
    back = store.selection(0, chunk)
    assert back.stride(2) == 0 and torch.equal(back, row.expand(2, 2, 2, 1))
    assert store._selected_columns(0, chunk, back) == ([0, 1], False)  # no documents: nothing unseen
    store.free_all()


@pytest.mark.gpu
def test_gpu_sparse_offload_by_head_rows_equals_no_offload_bitwise(offload_stores):
    """On the GPU (mapped slabs, side streams): one selection per chunk staged as (page, head) rows gives the
    bits of the step without offload."""
    torch.manual_seed(0)
    model = build_tiny_model("qwen2", seed=5, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=3).to("cuda", torch.bfloat16)
    sparse = oomb.OOMBConfig(chunk_size=256, page_size=64, attention="sparse", sparse=SparseConfig(**SPARSE,
                                                                                                   query_block_pages=4),
                             offload=OffloadConfig(stream_block_pages=4),
                             performance=PerformanceConfig(backend="triton"))
    lengths = (1500, 2100)
    want = _steps(model, sparse, lengths)
    got = _steps(model, sparse.with_options({"offload.enabled": True}), lengths, HostSlabs())
    for (loss_a, grads_a), (loss_b, grads_b) in zip(want, got, strict=True):
        assert torch.equal(loss_a, loss_b)
        for name in grads_a:
            assert torch.equal(grads_a[name], grads_b[name]), name
    assert offload_stores and all(store.mapped_host is not None for store in offload_stores)
