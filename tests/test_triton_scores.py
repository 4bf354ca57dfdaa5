"""The Triton exact score (oomb/attention/triton_scores.py) vs the torch reference
(oomb.sparse.exact_block_scores). CPU: the Triton interpreter (conftest sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from oomb.kv import ChunkSpan, PagedKVStore
from oomb.sparse import SparseConfig, exact_block_scores

triton_scores = pytest.importorskip("oomb.attention.triton_scores")

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPTIONS = SparseConfig(budget=2, sink_pages=1, score="exact").resolved()


def _store_and_queries(B, Hkv, G, D, P, history, length, dtype, seed=0):
    """A store holding ``history`` tokens then a chunk of ``length`` (pages allocated out of order by
    a throwaway chunk first), and the chunk's queries."""
    gen = torch.Generator().manual_seed(seed)
    store = PagedKVStore(num_layers=1, batch_size=B, num_tokens=history + length + 2 * P, num_kv_heads=Hkv,
                         head_dim=D, page_size=P, kv_dtype=dtype, grad_dtype=torch.float32,
                         device=torch.device(DEVICE))
    spans = [ChunkSpan(0, 0, history), ChunkSpan(1, history, history + length)]
    for span in spans:
        store.allocate(span)
        k = torch.randn(B, Hkv, span.length, D, generator=gen).to(DEVICE, dtype)
        store.write(0, span, k, torch.randn_like(k))
    q = (torch.randn(B, Hkv * G, length, D, generator=gen) * 2).to(DEVICE, dtype)
    return store, spans[1], q


@pytest.mark.parametrize("length,row_stride", [(32, 1), (29, 1), (32, 4), (45, 16)])
def test_exact_scores_kernel_matches_the_reference(length, row_stride):
    """Every row's probability per history page, the best row's per block: several row tiles per block
    (G x P rows > the interpreter's 32), a partial last block, strided rows."""
    B, Hkv, G, D, P = 2, 2, 3, 24, 16
    store, chunk, q = _store_and_queries(B, Hkv, G, D, P, history=48, length=length, dtype=torch.float32)
    want = exact_block_scores(q, store, 0, chunk, OPTIONS, row_stride=row_stride)
    got = triton_scores.exact_page_scores(q, store.layers[0].k, store.page_table, chunk.start, D ** -0.5,
                                          row_stride=row_stride)
    assert got.shape == want.shape == (B, Hkv, -(-length // P), 3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    store.free_all()


def test_exact_scores_kernel_in_bf16_and_through_select_pages():
    """bf16 keys and queries: the reference on the same bf16 values (float32 sums in both); the engine's
    scoring picks the kernel for CUDA tensors or when asked to."""
    B, Hkv, G, D, P = 1, 1, 4, 32, 16
    store, chunk, q = _store_and_queries(B, Hkv, G, D, P, history=64, length=32, dtype=torch.bfloat16, seed=1)
    want = exact_block_scores(q, store, 0, chunk, OPTIONS, kernel=False)
    got = exact_block_scores(q, store, 0, chunk, OPTIONS, kernel=True)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-5)
    store.free_all()


def test_exact_scores_kernel_refuses_what_it_cannot_score():
    q = torch.zeros(1, 2, 8, 16)
    k_pool = torch.zeros(4, 1, 8, 16)
    table = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="page size 8"):
        triton_scores.exact_page_scores(q, k_pool, table, 16, 0.25)
    with pytest.raises(TypeError, match="share a dtype"):
        triton_scores.exact_page_scores(q.bfloat16(), torch.zeros(4, 1, 16, 16), table, 16, 0.25)
    with pytest.raises(ValueError, match="row_stride"):
        triton_scores.exact_page_scores(q, torch.zeros(4, 1, 16, 16), table, 16, 0.25, row_stride=0)


@pytest.mark.parametrize("length,P,row_stride", [(32, 16, 1), (29, 16, 1), (61, 32, 1), (29, 16, 4), (61, 32, 2)])
def test_listed_pages_kernel_matches_the_rerank_reference(length, P, row_stride):
    """score="rerank": probabilities over each block's listed candidate pages (normaliser: those pages
    and the chunk, causal), scattered into the history's columns, -1 elsewhere. Pages of 32 take two key
    tiles each under the interpreter (a page's log-mass is folded over its tiles); row_stride pools every
    n-th query of a block only."""
    B, Hkv, G, D = 2, 2, 3, 24
    store, chunk, q = _store_and_queries(B, Hkv, G, D, P, history=5 * P, length=length, dtype=torch.float32,
                                         seed=2)
    gen = torch.Generator().manual_seed(4)
    n_blocks = -(-length // P)
    candidates = torch.stack([torch.randperm(5, generator=gen)[:3].sort().values
                              for _ in range(B * Hkv * n_blocks)]).reshape(B, Hkv, n_blocks, 3)
    candidates = candidates.to(DEVICE, torch.int32)
    options = SparseConfig(budget=1, sink_pages=1, score="rerank").resolved()
    from oomb.sparse import rerank_block_scores

    args = (q, store.layers[0].k, store.page_table, chunk, candidates, options)
    want = rerank_block_scores(*args, kernel=False, row_stride=row_stride)
    got = rerank_block_scores(*args, kernel=True, row_stride=row_stride)
    assert (got == -1).sum() == (want == -1).sum() == B * Hkv * n_blocks * 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if row_stride > 1:  # fewer rows pooled: no score above the all-rows one, some below it
        every = rerank_block_scores(*args, kernel=False)
        assert (want <= every + 1e-7).all() and (want < every - 1e-6).any()
    store.free_all()


@pytest.mark.parametrize("with_previous,P", [(True, 16), (False, 16), pytest.param(True, 32, marks=pytest.mark.slow)],
                         ids=["previous_page", "no_previous", "previous_page_of_two_tiles"])
def test_leak_free_listed_pages_kernel_matches_the_reference(with_previous, P, monkeypatch):
    """Leak-free rerank: block j scored by the page of queries before it and its first query, each seeing
    the keys at or before it (the last history page causally, for the previous chunk's queries; at pages
    of 32 its second key tile is hidden from some of those rows)."""
    B, Hkv, G, D = 2, 2, 3, 24
    length = 45 if P == 16 else 90
    store, chunk, q = _store_and_queries(B, Hkv, G, D, P, history=5 * P, length=length, dtype=torch.float32,
                                         seed=3)
    gen = torch.Generator().manual_seed(5)
    n_blocks = -(-length // P)
    candidates = torch.stack([torch.cat([torch.randperm(4, generator=gen)[:2].sort().values, torch.tensor([4])])
                              for _ in range(B * Hkv * n_blocks)]).reshape(B, Hkv, n_blocks, 3)
    candidates = candidates.to(DEVICE, torch.int32)
    previous = torch.randn(B, Hkv * G, P, D, generator=gen).to(DEVICE) if with_previous else None
    options = SparseConfig(budget=1, sink_pages=1, score="rerank", leak_free=True).resolved()
    from oomb.sparse import rerank_block_scores

    args = (q, store.layers[0].k, store.page_table, chunk, candidates, options)
    want = rerank_block_scores(*args, kernel=False, previous=previous)
    got = rerank_block_scores(*args, kernel=True, previous=previous)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # A scratch bound below one call's need: the blocks go in several launches, the same scores.
    monkeypatch.setattr(triton_scores, "SCRATCH_ELEMENTS", B * Hkv * 3 * 128)  # one block per launch
    assert torch.equal(rerank_block_scores(*args, kernel=True, previous=previous), got)
    leaky = rerank_block_scores(q, store.layers[0].k, store.page_table, chunk, candidates,
                                SparseConfig(budget=1, sink_pages=1, score="rerank").resolved(), kernel=True)
    assert not torch.equal(got, leaky)
    with pytest.raises(ValueError, match="row_stride must be 1"):
        rerank_block_scores(*args, kernel=False, previous=previous, row_stride=2)
    with pytest.raises(ValueError, match="leak_free scores listed pages"):
        triton_scores.exact_page_scores(q, store.layers[0].k, store.page_table, chunk.start, D ** -0.5,
                                        leak_free=True)
    store.free_all()


def test_tuning_key_classes_the_scored_pages():
    """The autotuner tunes per power of two of a call's scored pages, not once per head dim, page size and
    group: a step's first scoring call (a few dozen pages) must not choose the tiles of its later calls
    (hundreds)."""
    assert "tuning_bucket" in triton_scores._exact_scores_kernel.keys
    assert [triton_scores.tune_bucket(n) for n in (0, 1, 65, 96, 128, 129, 256, 8192)] == \
        [1, 1, 128, 128, 128, 256, 256, 8192]
