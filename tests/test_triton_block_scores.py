"""The Triton summary-score kernel (oomb/attention/triton_block_scores.py) vs the torch reference
(oomb.sparse.block_scores). CPU: the Triton interpreter (conftest sets TRITON_INTERPRET=1)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import sparse_replace

from oomb.kv.summaries import summarize_pages
from oomb.sparse import SparseConfig, block_scores

triton_block_scores = pytest.importorskip("oomb.attention.triton_block_scores")

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPTIONS = SparseConfig(budget=2, sink_pages=1, score="minmax").resolved()


def _queries_and_summaries(B, Hkv, G, D, P, n_hist, length, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, n_hist, Hkv, P, D, generator=gen)
    summaries = summarize_pages(keys, P, ("key_min", "key_max", "key_mean"))
    summaries = {name: s.to(DEVICE, dtype) for name, s in summaries.items()}
    q = (torch.randn(B, Hkv * G, length, D, generator=gen) * 2).to(DEVICE, dtype)
    return q, summaries


@pytest.mark.parametrize("score", ["minmax", "mean"])
@pytest.mark.parametrize("length,n_hist", [(32, 5), (29, 21), (16, 1)])
def test_kernel_matches_the_reference(score, length, n_hist):
    """Several row tiles per block (G x P = 48 rows > the interpreter's 32), a partial last block (its
    missing rows: copies of the last query), page tiles with a ragged end (21 pages, tiles of 16)."""
    B, Hkv, G, D, P = 2, 2, 3, 24, 16
    q, summaries = _queries_and_summaries(B, Hkv, G, D, P, n_hist, length, torch.float32)
    options = replace(OPTIONS, score=score)
    want = block_scores(q, summaries, P, options, kernel=False)
    got = block_scores(q, summaries, P, options, kernel=True)
    assert got.shape == want.shape == (B, Hkv, -(-length // P), n_hist)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("score", ["minmax", "mean"])
def test_kernel_in_bf16_and_shared_selection(score):
    """bf16 queries and summaries (float32 sums in both paths); selection="shared" pools the heads. (On the
    CPU the interpreter upcasts the tiles: tests/test_compile_for_hopper.py compiles the bf16 kernel.)"""
    B, Hkv, G, D, P = 1, 2, 2, 32, 16
    q, summaries = _queries_and_summaries(B, Hkv, G, D, P, 7, 40, torch.bfloat16, seed=1)
    options = sparse_replace(OPTIONS, selection="shared", score=score)
    want = block_scores(q, summaries, P, options, kernel=False)
    got = block_scores(q, summaries, P, options, kernel=True)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    assert torch.equal(got[:, 0], got[:, 1])


@pytest.mark.slow
@pytest.mark.parametrize("score", ["minmax", "mean"])
@pytest.mark.parametrize("length,n_hist,dtype", [(32, 5, torch.float32), (29, 21, torch.float32),
                                                 (16, 1, torch.float32), (40, 7, torch.bfloat16)])
def test_kernel_normalised_over_the_history_matches_the_reference(score, length, n_hist, dtype):
    """Pooling "softmax_max" (sparse_candidate_pooling, sparse_pooling): each row's scaled scores minus their
    log-sum-exp over the history pages, and with own pages also those up to its block (the row kernel's online
    log-sum-exp over ragged page tiles and the causal own pages), the best row's; a ragged last block, several
    row tiles per block."""
    B, Hkv, G, D, P = 2, 2, 3, 24, 16
    n_own = -(-length // P)
    q, pages = _queries_and_summaries(B, Hkv, G, D, P, n_hist + n_own, length, dtype, seed=3)
    summaries = {name: s[:, :n_hist] for name, s in pages.items()}
    own = {name: s[:, n_hist:] for name, s in pages.items()}
    options = sparse_replace(OPTIONS, score=score, pooling="softmax_max")
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    for chunk_pages in (None, own):  # the history alone; with the chunk's own pages up to each block
        want = block_scores(q, summaries, P, options, scale=0.3, own=chunk_pages, kernel=False)
        got = block_scores(q, summaries, P, options, scale=0.3, own=chunk_pages, kernel=True)
        assert got.shape == want.shape == (B, Hkv, -(-length // P), n_hist)
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
        # Log-probabilities: at most 0, to the rounding of a score minus its log-sum-exp. The scaled scores reach
        # ~126 here, where a float32 ulp is 7.6e-6 (one history page: the kernel gave 1.9e-6 and 3.8e-6 for 0).
        pooled = block_scores(q, summaries, P, sparse_replace(options, pooling="max"), scale=0.3, own=chunk_pages,
                              kernel=False)
        assert (got <= 2 * torch.finfo(torch.float32).eps * pooled.abs().max()).all()
    alone = block_scores(q, summaries, P, options, scale=0.3, kernel=True)
    assert (got < alone - 1e-4).any()  # the own pages take probability from the history's


@pytest.mark.parametrize("score", ["minmax", "mean"])
@pytest.mark.parametrize("n_hist,bound,sinks", [(40, 5, 1), (40, 20, 2), (23, 22, 1), (40, 5, 0), (60, 10, 20)])
def test_kernel_bounded_normaliser_matches_the_reference(score, n_hist, bound, sinks):
    """sparse_normaliser_pages: the row kernel counts the sinks, then the last ``bound`` history pages and
    the own pages (one numbering without the gap, tiles straddling both spans; no sinks; more sinks than a
    tile holds), as the torch path does."""
    B, Hkv, G, D, P, length = 1, 2, 3, 24, 16, 29
    n_own = -(-length // P)
    q, pages = _queries_and_summaries(B, Hkv, G, D, P, n_hist + n_own, length, torch.float32, seed=5)
    summaries = {name: s[:, :n_hist] for name, s in pages.items()}
    own = {name: s[:, n_hist:] for name, s in pages.items()}
    options = sparse_replace(OPTIONS, score=score, pooling="softmax_max", sink_pages=sinks, normaliser_pages=bound)
    want = block_scores(q, summaries, P, options, scale=0.3, own=own, kernel=False)
    got = block_scores(q, summaries, P, options, scale=0.3, own=own, kernel=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    every_page = sparse_replace(options, normaliser_pages=None)
    full = block_scores(q, summaries, P, every_page, scale=0.3, own=own, kernel=True)
    assert torch.equal(got, full) == (n_hist <= sinks + bound)
    with pytest.raises(ValueError, match="normaliser_span"):
        triton_block_scores.summary_block_scores(q, pages, P, score, 0.3, n_own, (3, 3))


def test_kernel_refuses_what_it_does_not_score():
    q, summaries = _queries_and_summaries(1, 1, 2, 16, 16, 3, 16, torch.float32)
    for options in (sparse_replace(OPTIONS, pooling="softmax"), replace(OPTIONS, leak_free=True)):
        with pytest.raises(ValueError, match="block-score kernel"):
            block_scores(q, summaries, 16, options, kernel=True)
    with pytest.raises(ValueError, match="'minmax' or 'mean'"):
        triton_block_scores.summary_block_scores(q, summaries, 16, "exact")
    with pytest.raises(TypeError, match="share a dtype"):
        triton_block_scores.summary_block_scores(q.bfloat16(), summaries, 16, "minmax")
