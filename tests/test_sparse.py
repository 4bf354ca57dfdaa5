"""Sparse attention: page summaries, selection, the sparse reference backend and the engine in sparse mode."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields, replace

import pytest
import torch
from helpers import build_tiny_model, grads, random_ids, relative_error, sparse_replace, visible_from_selections
from transformers import AttentionInterface

import oomb
import oomb.attention.function
import oomb.engine
import oomb.models
from oomb import OOMBConfig
from oomb.attention import reference, reference_sparse
from oomb.config import OffloadConfig, PerformanceConfig, SparseConfig, SparseResearch
from oomb.evaluate import forward_hidden
from oomb.kv import ChunkSpan, PagedKVStore
from oomb.kv.summaries import summarize_pages
from oomb.sparse import block_scores, exact_block_scores, group_scores, page_summaries, select_pages, top_pages

TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_RTOL = 1e-5


def _options(**changes) -> SparseConfig:
    research = {k: changes.pop(k) for k in list(changes) if k in {f.name for f in fields(SparseResearch)}}
    base = dict(budget=3, sink_pages=1, score="minmax", leak_free=False)
    return SparseConfig(**{**base, **changes}, research=SparseResearch(**research)).resolved()


# --------------------------------------------------------------------------------------------
# Page summaries
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [16, 13, 1])
def test_store_writes_page_summaries(length):
    """min/max/mean over the written keys of each page; the zero padding of a partial page is no key."""
    P, Hkv, D, B = 4, 2, 8, 2
    store = PagedKVStore(num_layers=1, batch_size=B, num_tokens=20, num_kv_heads=Hkv, head_dim=D, page_size=P,
                         kv_dtype=torch.float32, grad_dtype=torch.float32, device=torch.device("cpu"),
                         summaries=("key_min", "key_max", "key_mean"))
    chunk = ChunkSpan(0, 0, length)
    store.allocate(chunk)
    # All keys > 0: a zero of the padding would win the min if it counted.
    k = torch.randn(B, Hkv, length, D, generator=torch.Generator().manual_seed(0)).abs() + 3.0
    store.write(0, chunk, k, torch.randn_like(k))
    n = -(-length // P)
    got = store.history_summaries(0, n)
    for page in range(n):
        keys = k[:, :, page * P:(page + 1) * P]  # (B, Hkv, <=P, D)
        torch.testing.assert_close(got["key_min"][:, page], keys.amin(2))
        torch.testing.assert_close(got["key_max"][:, page], keys.amax(2))
        torch.testing.assert_close(got["key_mean"][:, page], keys.mean(2))
    store.free(chunk)


def test_summaries_keep_the_page_dtype():
    pages = torch.randn(1, 2, 3, 4, 8).to(torch.bfloat16)
    out = summarize_pages(pages, 4, ("key_min", "key_max", "key_mean"))
    assert all(t.dtype == torch.bfloat16 and t.shape == (1, 2, 3, 8) for t in out.values())
    assert torch.equal(out["key_max"], pages.amax(3))  # exact: an element of the page


# --------------------------------------------------------------------------------------------
# Selection
# --------------------------------------------------------------------------------------------
@dataclass
class Scoring:
    q: torch.Tensor  # (B, Hq, Lq, D)
    keys: torch.Tensor  # (B, n_hist, Hkv, P, D): the history pages' keys
    summaries: dict[str, torch.Tensor]
    page: int


def _scoring(seed=0, B=2, Hkv=2, G=3, Lq=10, D=8, P=4, n_hist=9) -> Scoring:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, n_hist, Hkv, P, D, generator=g)
    summaries = summarize_pages(keys, P, ("key_min", "key_max", "key_mean"))
    return Scoring(torch.randn(B, Hkv * G, Lq, D, generator=g), keys, summaries, P)


def _brute_force_scores(s: Scoring, options: SparseConfig) -> torch.Tensor:
    """(B, Hkv, n_blocks, n_hist) by the definitions, one (block, page) pair at a time."""
    B, Hq, Lq, D = s.q.shape
    n_hist, Hkv = s.keys.shape[1], s.keys.shape[2]
    G, P = Hq // Hkv, s.page
    n_blocks = -(-Lq // P)
    out = torch.empty(B, Hkv, n_blocks, n_hist)
    for b in range(B):
        for h in range(Hkv):
            for j in range(n_blocks):
                # Leak-free: the block before (all earlier than the block's first query) and that first query.
                queries = ([*range(max(0, (j - 1) * P), j * P), j * P] if options.leak_free
                           else range(j * P, min(Lq, (j + 1) * P)))
                rows = s.q[b, h * G:(h + 1) * G][:, list(queries)].reshape(-1, D)  # (rows, D)
                for p in range(n_hist):
                    if options.score == "minmax":
                        lo, hi = s.summaries["key_min"][b, p, h], s.summaries["key_max"][b, p, h]
                        per_row = torch.maximum(rows * lo, rows * hi).sum(-1)
                    else:
                        per_row = rows @ s.summaries["key_mean"][b, p, h]
                    out[b, h, j, p] = per_row.max()
    if options.research.selection == "shared":
        out = out.amax(1, keepdim=True).expand_as(out)
    return out


@pytest.mark.parametrize("selection", ["kv_head", "shared"])
@pytest.mark.parametrize("leak_free", [False, True], ids=["block", "leak_free"])
@pytest.mark.parametrize("score", ["minmax", "mean"])
def test_block_scores_match_the_definition(score, leak_free, selection):
    s = _scoring()
    options = _options(score=score, leak_free=leak_free, selection=selection)
    torch.testing.assert_close(block_scores(s.q, s.summaries, s.page, options), _brute_force_scores(s, options),
                               **TOL)


@pytest.mark.parametrize("with_own", [True, False], ids=["own_pages", "history_only"])
@pytest.mark.parametrize("score", ["minmax", "mean"])
def test_softmax_max_pooling_is_the_best_rows_estimated_log_probability(score, with_own):
    """pooling="softmax_max": per row, scale x score of every page it sees (history pages; own pages up
    to its block) normalised by their log-sum-exp; per page, the best row's value. (Leak-free: the
    engine-level test below checks no later token changes a selection.)"""
    s = _scoring(Lq=10, n_hist=9)
    g = torch.Generator().manual_seed(9)
    B, Hq, Lq, D = s.q.shape
    Hkv, P = s.keys.shape[2], s.page
    n_blocks = -(-Lq // P)
    own_keys = torch.randn(B, n_blocks, Hkv, P, D, generator=g)
    own = summarize_pages(own_keys, Lq - (n_blocks - 1) * P, ("key_min", "key_max", "key_mean")) if with_own else None
    options = _options(score=score, pooling="softmax_max")
    got = block_scores(s.q, s.summaries, P, options, scale=0.3, own=own)
    raw = _brute_force_scores(s, _options(score=score))  # only to get the shapes; recomputed per row below
    want = torch.empty_like(raw)
    G = Hq // Hkv
    for b in range(B):
        for h in range(Hkv):
            for j in range(n_blocks):
                rows = s.q[b, h * G:(h + 1) * G, j * P:min(Lq, (j + 1) * P)].reshape(-1, D)
                pages = [(s.summaries, p) for p in range(9)] + ([(own, p) for p in range(j + 1)] if with_own else [])
                logits = []
                for summary, p in pages:
                    if score == "minmax":
                        lo, hi = summary["key_min"][b, p, h], summary["key_max"][b, p, h]
                        logits.append(torch.maximum(rows * lo, rows * hi).sum(-1))
                    else:
                        logits.append(rows @ summary["key_mean"][b, p, h])
                logits = torch.stack(logits, dim=-1) * 0.3  # (rows, pages)
                want[b, h, j] = (logits[:, :9] - logits.logsumexp(-1, keepdim=True)).amax(0)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("score", ["minmax", "mean"])
def test_gpu_low_precision_scores_equal_float32_scores_up_to_summation_order(score):
    """bf16 queries and summaries on a GPU are scored by tensor cores with a float32 result: their
    products are exact, so only the order of the float32 sums differs from scoring float32 copies."""
    s = _scoring(B=1, Hkv=4, G=7, Lq=300, D=128, P=128, n_hist=50)
    q = s.q.to("cuda", torch.bfloat16)
    summaries = {name: t.to("cuda", torch.bfloat16) for name, t in s.summaries.items()}
    options = SparseConfig(budget=4, sink_pages=1, score=score).resolved()
    fast = block_scores(q, summaries, s.page, options)
    exact = block_scores(q.float(), {name: t.float() for name, t in summaries.items()}, s.page, options)
    torch.testing.assert_close(fast, exact, rtol=1e-5, atol=1e-4)


def test_low_precision_scoring_falls_back_to_float32_where_refused(monkeypatch):
    """bmm with float32 results exists on CUDA only (torch >= 2.8): where the library refuses it,
    scoring says so and multiplies float32 copies (the CPU is made to ask for it here)."""
    from oomb import fp32_linear

    g = torch.Generator().manual_seed(0)
    rows, keys = torch.randn(2, 5, 16, generator=g).bfloat16(), torch.randn(2, 16, 3, generator=g).bfloat16()
    monkeypatch.setattr(fp32_linear, "tensor_cores_give_float32", lambda a, b: True)
    with pytest.warns(UserWarning, match="scoring in float32"):
        scores = fp32_linear.matmul_float32(rows, keys, "scoring")
    assert scores.dtype == torch.float32 and torch.equal(scores, torch.bmm(rows.float(), keys.float()))


def test_scores_are_computed_in_tiles(monkeypatch):
    """Tiling the blocks (to bound memory) does not change the scores."""
    s = _scoring(Lq=23)
    options = _options()
    whole = block_scores(s.q, s.summaries, s.page, options)
    monkeypatch.setattr(oomb.sparse, "SCORE_TILE_ELEMENTS", 1)  # one block per tile
    torch.testing.assert_close(block_scores(s.q, s.summaries, s.page, options), whole, rtol=0, atol=0)


def test_minmax_score_bounds_every_key_of_the_page():
    """Quest: the min/max score of a query row is >= q . k for every key of the page."""
    s = _scoring(G=1, Lq=4, P=4)  # one block; every query is a row
    options = _options(score="minmax")
    for i in range(s.q.shape[2]):
        q_row = s.q[:, :, i:i + 1]
        bound = block_scores(q_row, s.summaries, s.page, options)[:, :, 0]  # (B, Hkv, n_hist)
        exact = torch.einsum("bhd,bphtd->bhpt", q_row[:, :, 0], s.keys).amax(-1)
        assert (bound >= exact - 1e-5).all()


@pytest.mark.parametrize(("budget", "sinks"), [(3, 1), (0, 2), (4, 0), (8, 1), (20, 3)])
def test_top_pages_are_sinks_plus_the_best_scores_sorted(budget, sinks):
    s = _scoring(n_hist=9)
    options = _options(budget=budget, sink_pages=sinks)
    scores = block_scores(s.q, s.summaries, s.page, options)
    selection = top_pages(scores, options)
    n_hist = scores.shape[-1]
    K = min(n_hist, budget + sinks)
    assert selection.dtype == torch.int32 and selection.shape == (*scores.shape[:3], K)
    for index in torch.cartesian_prod(*(torch.arange(n) for n in scores.shape[:3])):
        row = selection[tuple(index)].tolist()
        assert row == sorted(set(row)), "ascending and distinct"
        assert row[:min(sinks, n_hist)] == list(range(min(sinks, n_hist))), "sinks always in"
        page_scores = scores[tuple(index)]
        best = sorted(range(sinks, n_hist), key=lambda p: -float(page_scores[p]))[:K - min(sinks, n_hist)]
        assert set(row[min(sinks, n_hist):]) == set(best)


def test_leak_free_selection_ignores_later_queries_of_the_block():
    """Leak-free: changing the queries after a block's first one (5..7 of block 1) cannot change any
    selection. The default (every query votes) can: a later query that matches one page strongly
    pulls it in."""
    s = _scoring(Lq=8, P=4, n_hist=9)
    target_page = 5
    changed = s.q.clone()
    changed[:, :, 5:8] = 0.0
    changed[:, :, 7] = 50.0 * s.keys[:, target_page].mean(dim=2).repeat_interleave(3, dim=1)  # wants page 5
    for leak_free in (True, False):
        options = _options(budget=2, sink_pages=1, leak_free=leak_free)
        before = top_pages(block_scores(s.q, s.summaries, s.page, options), options)
        after = top_pages(block_scores(changed, s.summaries, s.page, options), options)
        assert torch.equal(before[:, :, 0], after[:, :, 0])  # block 0 (queries 0..3) is untouched
        if leak_free:
            assert torch.equal(before, after)
        else:
            assert not torch.equal(before[:, :, 1], after[:, :, 1])
            assert (after[:, :, 1] == target_page).any(-1).all()


def test_leak_free_softmax_max_ignores_later_keys_of_the_chunk():
    """softmax_max normalises with the chunk's own page summaries: leak-free, block j's selection may
    use only own pages wholly before its first query, so keys from that query on change nothing."""
    s = _scoring(Lq=12, P=4, n_hist=9)
    g = torch.Generator().manual_seed(5)
    own_keys = torch.randn(2, 3, 2, 4, 8, generator=g)  # (B, n_own pages, Hkv, P, D)
    changed = own_keys.clone()
    changed[:, 1, :, 1:] = 40.0  # tokens 5..7: after block 1's first query (token 4)
    changed[:, 2] = -40.0  # block 2's page
    options = _options(budget=2, sink_pages=1, leak_free=True, pooling="softmax_max")

    def selection(keys):
        own = summarize_pages(keys, 4, ("key_min", "key_max"))
        return top_pages(block_scores(s.q, s.summaries, s.page, options, own=own), options)

    before, after = selection(own_keys), selection(changed)
    assert torch.equal(before[:, :, :2], after[:, :, :2])  # blocks 0 and 1 read the same pages
    leaky = replace(options, leak_free=False)
    scores = [block_scores(s.q, s.summaries, s.page, leaky, own=summarize_pages(k, 4, ("key_min", "key_max")))
              for k in (own_keys, changed)]
    assert not torch.equal(scores[0][:, :, 1], scores[1][:, :, 1])  # without leak_free page 1 counts


def test_leak_free_scores_a_block_with_the_queries_before_it():
    """Leak-free block j is scored with block j-1's queries and its own first one; a chunk's first
    block with the previous chunk's last page of queries when given."""
    s = _scoring(Lq=8, P=4, n_hist=9)
    options = _options(budget=2, sink_pages=1, leak_free=True)
    earlier = s.q.clone()
    earlier[:, :, 1:4] = 7.0  # queries of block 0 after its first: they precede block 1
    assert not torch.equal(block_scores(s.q, s.summaries, s.page, options)[:, :, 1],
                           block_scores(earlier, s.summaries, s.page, options)[:, :, 1])
    previous = torch.randn(*s.q.shape[:2], s.page, s.q.shape[3], generator=torch.Generator().manual_seed(5))
    with_previous = block_scores(s.q, s.summaries, s.page, options, previous=previous)
    votes = _options(budget=2, sink_pages=1)  # every row of what is scored votes (max)
    want = torch.maximum(block_scores(previous, s.summaries, s.page, votes)[:, :, 0],
                         block_scores(s.q[:, :, :1], s.summaries, s.page, votes)[:, :, 0])  # block 0's rows
    torch.testing.assert_close(with_previous[:, :, 0], want)


def test_shared_selection_is_the_same_for_every_kv_head():
    s = _scoring()
    options = _options(selection="shared")
    selection = top_pages(block_scores(s.q, s.summaries, s.page, options), options)
    assert torch.equal(selection, selection[:, :1].expand_as(selection))


@pytest.mark.parametrize("leak_free", [False, True], ids=["block", "leak_free"])
def test_grouped_blocks_share_their_groups_best_pages(leak_free):
    """query_block_pages=g: the g blocks of a group read the same pages, the top pages of the
    group's best score (leak-free: of its first block's first query); a last group may be short."""
    s = _scoring(Lq=20, P=4, n_hist=9)  # 5 query blocks -> groups (0, 1), (2, 3), (4,)
    options = _options(budget=2, sink_pages=1, leak_free=leak_free)
    scores = block_scores(s.q, s.summaries, s.page, options)
    grouped = group_scores(scores, 2, leak_free)
    assert grouped.shape == (*scores.shape[:2], 3, scores.shape[3])
    if leak_free:
        assert torch.equal(grouped, scores[:, :, [0, 2, 4]])
    else:
        assert torch.equal(grouped[:, :, 0], torch.maximum(scores[:, :, 0], scores[:, :, 1]))
        assert torch.equal(grouped[:, :, 2], scores[:, :, 4])
    store = PagedKVStore(num_layers=1, batch_size=2, num_tokens=56, num_kv_heads=2, head_dim=8, page_size=4,
                         kv_dtype=torch.float32, grad_dtype=torch.float32, device=torch.device("cpu"),
                         summaries=("key_min", "key_max"))
    history, chunk = ChunkSpan(0, 0, 36), ChunkSpan(1, 36, 56)
    for span, keys in ((history, s.keys.flatten(1, 2).reshape(2, 9, 2, 4, 8)), (chunk, None)):
        store.allocate(span)
        k = (keys.permute(0, 2, 1, 3, 4).reshape(2, 2, 36, 8) if keys is not None
             else torch.randn(2, 2, span.length, 8))
        store.write(0, span, k, k)
    grouped_options = _options(budget=2, sink_pages=1, leak_free=leak_free, query_block_pages=2)
    selection = select_pages(s.q, store, 0, chunk, grouped_options)
    want = top_pages(group_scores(block_scores(s.q, store.history_summaries(0, 9), 4, options), 2, leak_free),
                     options)
    assert selection.shape == (2, 2, 5, 3)
    assert torch.equal(selection, want[:, :, [0, 0, 1, 1, 2]])
    assert selection.stride(2) != 0  # three groups: materialised
    one_group = select_pages(s.q, store, 0, chunk, _options(budget=2, sink_pages=1, leak_free=leak_free,
                                                                query_block_pages=5))
    want = top_pages(group_scores(block_scores(s.q, store.history_summaries(0, 9), 4, options), 5, leak_free),
                     options)
    assert one_group.stride(2) == 0 and torch.equal(one_group, want.expand(-1, -1, 5, -1))
    store.free_all()


def test_a_budget_covering_the_history_selects_nothing():
    """Sinks + budget >= history pages: no selection (None), i.e. the dense path."""
    P = 4
    store = PagedKVStore(num_layers=1, batch_size=1, num_tokens=32, num_kv_heads=1, head_dim=8, page_size=P,
                         kv_dtype=torch.float32, grad_dtype=torch.float32, device=torch.device("cpu"),
                         summaries=("key_min", "key_max"))
    chunks = [ChunkSpan(0, 0, 16), ChunkSpan(1, 16, 32)]  # chunk 1 has 4 history pages
    for chunk in chunks:
        store.allocate(chunk)
        k = torch.randn(1, 1, 16, 8)
        store.write(0, chunk, k, k)
    q = torch.randn(1, 2, 16, 8)
    assert select_pages(q, store, 0, chunks[1], _options(budget=3, sink_pages=1)) is None
    assert select_pages(q, store, 0, chunks[0], _options(budget=0, sink_pages=0)) is None  # no history
    selection = select_pages(q, store, 0, chunks[1], _options(budget=2, sink_pages=1))
    assert selection.shape == (1, 1, 4, 3)
    store.free_all()
    assert store.is_empty


@pytest.mark.parametrize("pooling", ["max", "softmax"])
@pytest.mark.parametrize("length", [16, 13])
def test_exact_score_is_the_true_attention_mass_of_each_page(pooling, length):
    """score="exact": each row's softmax over every key it sees (history + own chunk, causal), summed
    per history page, pooled over the block's rows and the KV head's query heads."""
    P, Hkv, G, D, B = 4, 2, 3, 8, 2
    store = PagedKVStore(num_layers=1, batch_size=B, num_tokens=40, num_kv_heads=Hkv, head_dim=D, page_size=P,
                         kv_dtype=torch.float32, grad_dtype=torch.float32, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    history, chunk = ChunkSpan(0, 0, 20), ChunkSpan(1, 20, 20 + length)
    keys = []
    for span in (history, chunk):
        store.allocate(span)
        k = torch.randn(B, Hkv, span.length, D, generator=gen)
        store.write(0, span, k, torch.randn_like(k))
        keys.append(k)
    q = torch.randn(B, Hkv * G, length, D, generator=gen)
    got = exact_block_scores(q, store, 0, chunk, _options(pooling=pooling))
    k_all = torch.cat(keys, dim=2).repeat_interleave(G, dim=1)  # (B, Hq, 20 + length, D)
    logits = (q @ k_all.transpose(-1, -2)) * D ** -0.5
    causal = torch.arange(20 + length)[None, :] > (20 + torch.arange(length))[:, None]
    probs = torch.softmax(logits.masked_fill(causal, float("-inf")), dim=-1)[..., :20]
    page_mass = probs.reshape(B, Hkv, G, length, 5, P).sum(-1)  # (B, Hkv, G, rows, pages)
    n_blocks = -(-length // P)
    want = torch.zeros(B, Hkv, n_blocks, 5)
    for b in range(n_blocks):
        rows = page_mass[:, :, :, b * P:(b + 1) * P]
        want[:, :, b] = rows.sum(dim=(2, 3)) if pooling == "softmax" else rows.amax(dim=(2, 3))
    torch.testing.assert_close(got, want, **TOL)
    # Through select_pages: no summaries are needed, the selection is the top pages of these scores.
    options = _options(score="exact", pooling=pooling, budget=2)
    assert torch.equal(select_pages(q, store, 0, chunk, options), top_pages(want, options))
    store.free_all()


def test_exact_scores_refuse_offload_and_leak_free():
    """exact scores a block with its own queries (no leak-free variant) and reads every history key from
    the GPU (no offload); rerank takes both (its candidates' keys are staged with offload)."""
    exact = OOMBConfig(attention="sparse", sparse=SparseConfig(score="exact"))
    for bad in ({"offload.enabled": True}, {"sparse.leak_free": True}):
        with pytest.raises(ValueError, match="sparse.score='exact'"):
            exact.with_options(bad)
    OOMBConfig(attention="sparse", sparse=SparseConfig(score="rerank", leak_free=True),
               offload=OffloadConfig(enabled=True))
    with pytest.raises(ValueError, match="sparse.research.rerank_factor"):
        OOMBConfig(attention="sparse", sparse=SparseConfig(score="rerank", research=SparseResearch(rerank_factor=0)))
    with pytest.raises(ValueError, match="sparse.research.pooling='softmax' does not apply"):
        OOMBConfig(attention="sparse", sparse=SparseConfig(score="rerank", research=SparseResearch(pooling="softmax")))


def test_auto_score_is_rerank_unless_another_pooling():
    assert OOMBConfig(attention="sparse").sparse.resolved_score == "rerank"
    assert OOMBConfig(attention="sparse", sparse=SparseConfig(leak_free=True)).sparse.resolved_score == "rerank"
    assert SparseConfig(research=SparseResearch(pooling="softmax_max")).resolved_score == "minmax"
    assert OOMBConfig(attention="sparse", sparse=SparseConfig(score="mean")).sparse.resolved_score == "mean"
    assert (OOMBConfig(attention="sparse")).resolved_sparse(4).score == "rerank"


def _filled_store(B, Hkv, D, P, spans, seed, summaries=("key_min", "key_max")):
    store = PagedKVStore(num_layers=1, batch_size=B, num_tokens=spans[-1].end, num_kv_heads=Hkv, head_dim=D,
                         page_size=P, kv_dtype=torch.float32, grad_dtype=torch.float32, device=torch.device("cpu"),
                         summaries=summaries)
    gen = torch.Generator().manual_seed(seed)
    for span in spans:
        store.allocate(span)
        k = torch.randn(B, Hkv, span.length, D, generator=gen)
        store.write(0, span, k, torch.randn_like(k))
    return store, gen


@pytest.mark.parametrize("length", [16, 13])
def test_rerank_score_is_the_attention_mass_among_the_candidates(length):
    """score="rerank": the minmax bound's top factor x budget pages (and the sinks) are the candidates;
    each row's softmax over the candidates' keys and its own chunk (causal), per candidate page, the
    best row's; other pages score -1. With every page a candidate it is the exact score."""
    P, Hkv, G, D, B, n_hist = 4, 2, 3, 8, 2, 6
    spans = [ChunkSpan(0, 0, n_hist * P), ChunkSpan(1, n_hist * P, n_hist * P + length)]
    store, gen = _filled_store(B, Hkv, D, P, spans, seed=5)
    chunk = spans[1]
    q = torch.randn(B, Hkv * G, length, D, generator=gen)
    options = _options(score="rerank", budget=1, rerank_factor=2, rerank_candidates="minmax",
                       candidate_pooling="max")  # 1 sink + 2 of 6, the candidates by the best row's raw bound
    minmax = block_scores(q, store.history_summaries(0, n_hist), P, _options())
    candidates = top_pages(minmax, oomb.sparse.candidate_options(options, 0))
    assert candidates.shape[-1] == 3
    got = oomb.sparse.rerank_block_scores(q, store.layers[0].k, store.page_table, chunk, candidates, options)

    k_all = torch.stack([store.layers[0].k[store.page_table[b].long()].permute(1, 0, 2, 3).reshape(Hkv, -1, D)
                         for b in range(B)])[:, :, :n_hist * P + length]  # (B, Hkv, tokens, D)
    want = torch.full((B, Hkv, -(-length // P), n_hist), -1.0)
    for b in range(B):
        for h in range(Hkv):
            for j in range(want.shape[2]):
                pages = candidates[b, h, j].tolist()
                best = torch.zeros(n_hist)
                for g in range(G):
                    for r in range(j * P, min((j + 1) * P, length)):
                        visible = [t for p in pages for t in range(p * P, (p + 1) * P)]
                        visible += list(range(n_hist * P, n_hist * P + r + 1))
                        logits = (q[b, h * G + g, r] @ k_all[b, h, visible].T) * D ** -0.5
                        probs = torch.softmax(logits, dim=0)
                        for i, p in enumerate(pages):
                            best[p] = max(best[p], probs[i * P:(i + 1) * P].sum())
                want[b, h, j, pages] = best[pages]
    torch.testing.assert_close(got, want, **TOL)
    every_page = torch.arange(n_hist, dtype=torch.int32).expand(B, Hkv, want.shape[2], -1)
    everything = oomb.sparse.rerank_block_scores(q, store.layers[0].k, store.page_table, chunk, every_page, options)
    torch.testing.assert_close(everything, exact_block_scores(q, store, 0, chunk, options), **TOL)
    # Through select_pages: the budget's best of the candidates.
    assert torch.equal(select_pages(q, store, 0, chunk, options), top_pages(want, options))
    store.free_all()


@pytest.mark.parametrize("with_previous", [True, False], ids=["previous_page", "no_previous"])
def test_leak_free_rerank_scores_a_block_with_the_queries_before_it(with_previous):
    """Leak-free rerank: block j's rows are the page of queries before it (block 0: the previous chunk's
    last page, or copies of query 0 without it) and its first query; each row's softmax over the keys at
    or before it among the candidates and the chunk, per candidate page, the best row's."""
    P, Hkv, G, D, B, n_hist, length = 4, 2, 2, 8, 2, 6, 11
    spans = [ChunkSpan(0, 0, n_hist * P), ChunkSpan(1, n_hist * P, n_hist * P + length)]
    store, gen = _filled_store(B, Hkv, D, P, spans, seed=7)
    chunk = spans[1]
    q = torch.randn(B, Hkv * G, length, D, generator=gen)
    previous = torch.randn(B, Hkv * G, P, D, generator=gen) if with_previous else None
    options = _options(score="rerank", budget=1, rerank_factor=3, rerank_candidates="minmax", leak_free=True)
    n_blocks = -(-length // P)
    candidates = torch.stack([torch.randperm(n_hist, generator=gen)[:4].sort().values
                              for _ in range(B * Hkv * n_blocks)]).reshape(B, Hkv, n_blocks, 4)
    candidates[0, 0, 0] = torch.tensor([0, 2, 4, n_hist - 1])  # the previous page's rows see it causally
    got = oomb.sparse.rerank_block_scores(q, store.layers[0].k, store.page_table, chunk, candidates, options,
                                          previous=previous)

    k_all = torch.stack([store.layers[0].k[store.page_table[b].long()].permute(1, 0, 2, 3).reshape(Hkv, -1, D)
                         for b in range(B)])[:, :, :n_hist * P + length]  # (B, Hkv, tokens, D)
    start = n_hist * P
    want = torch.full((B, Hkv, n_blocks, n_hist), -1.0)
    for b in range(B):
        for h in range(Hkv):
            for j in range(n_blocks):
                pages = candidates[b, h, j].tolist()
                best = torch.zeros(n_hist)
                rows = [(start + r, None) for r in range((j - 1) * P, j * P)] if j else (
                    [(start - P + r, previous[b, :, r]) for r in range(P)] if with_previous
                    else [(start, q[b, :, 0])] * P)
                rows = [*rows, (start + j * P, None)]
                for position, vector in rows:
                    for g in range(G):
                        query = (vector if vector is not None else q[b, :, position - start])[h * G + g]
                        keys = [t for p in pages for t in range(p * P, (p + 1) * P)]
                        keys += list(range(start, start + length))
                        seen = torch.tensor([t <= position for t in keys])
                        logits = (query @ k_all[b, h, keys].T) * D ** -0.5
                        probs = torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=0)
                        for i, p in enumerate(pages):
                            best[p] = max(best[p], probs[i * P:(i + 1) * P].sum())
                want[b, h, j, pages] = best[pages]
    torch.testing.assert_close(got, want, **TOL)
    if with_previous:  # a later query of block 1 (position 6 of the chunk) cannot change block 1's scores
        changed = q.clone()
        changed[:, :, 5:8] = 100.0
        again = oomb.sparse.rerank_block_scores(changed, store.layers[0].k, store.page_table, chunk, candidates,
                                                options, previous=previous)
        torch.testing.assert_close(again[:, :, :2], got[:, :, :2], **TOL)
    store.free_all()


def test_rerank_with_mean_candidates_reranks_the_mean_keys_top_pages():
    """sparse_rerank_candidates="mean": the pages with the best q . mean key propose the candidates, kept
    as the only summary; the rerank over them is the same as over minmax's."""
    P, Hkv, G, D, B, n_hist, length = 4, 2, 3, 8, 2, 8, 12
    spans = [ChunkSpan(0, 0, n_hist * P), ChunkSpan(1, n_hist * P, n_hist * P + length)]
    store, gen = _filled_store(B, Hkv, D, P, spans, seed=9, summaries=("key_mean",))
    q = torch.randn(B, Hkv * G, length, D, generator=gen)
    options = _options(score="rerank", budget=1, rerank_factor=2, rerank_candidates="mean", candidate_pooling="max")
    assert page_summaries(options) == ("key_mean",)
    mean = block_scores(q, store.history_summaries(0, n_hist), P, _options(score="mean"))
    candidates = top_pages(mean, oomb.sparse.candidate_options(options, 0))
    scores = oomb.sparse.rerank_block_scores(q, store.layers[0].k, store.page_table, spans[1], candidates, options)
    assert torch.equal(select_pages(q, store, 0, spans[1], options), top_pages(scores, options))
    config = OOMBConfig(attention="sparse", sparse=SparseConfig(research=SparseResearch(rerank_candidates="mean")))
    assert page_summaries(config.resolved_sparse(4)) == ("key_mean",)
    with pytest.raises(ValueError, match="sparse.research.rerank_candidates='median'"):
        OOMBConfig(attention="sparse", sparse=SparseConfig(research=SparseResearch(rerank_candidates="median")))
    store.free_all()


def test_minmax_mean_candidates_are_minmax_half_then_the_mean_keys_best():
    P, Hkv, G, D, B, n_hist, length = 4, 2, 3, 8, 1, 12, 8
    spans = [ChunkSpan(0, 0, n_hist * P), ChunkSpan(1, n_hist * P, n_hist * P + length)]
    store, gen = _filled_store(B, Hkv, D, P, spans, seed=4, summaries=("key_min", "key_max", "key_mean"))
    q = torch.randn(B, Hkv * G, length, D, generator=gen)
    options = _options(score="rerank", budget=2, rerank_factor=2, rerank_candidates="minmax_mean",
                       candidate_pooling="max")  # 4 + 1 sink, by the best row's raw summary scores
    summaries = store.history_summaries(0, n_hist)
    got = oomb.sparse.propose_candidates(q, summaries, P, options, 0)
    minmax = block_scores(q, summaries, P, _options())
    mean = block_scores(q, summaries, P, _options(score="mean"))
    for b, h, j in itertools.product(range(B), range(Hkv), range(got.shape[2])):
        want = {0} | set(minmax[b, h, j, 1:].topk(2).indices.add(1).tolist())  # the sink, minmax's half
        rest = [p for p in mean[b, h, j].argsort(descending=True).tolist() if p not in want]
        want |= set(rest[:5 - len(want)])
        assert sorted(want) == got[b, h, j].tolist()
    store.free_all()


def test_candidates_pooled_by_softmax_max_rank_each_rows_normalised_scores():
    """sparse_candidate_pooling="softmax_max": a block's candidates are ranked by its rows' summary scores
    normalised over the history pages (log-sum-exp per row) before the max over rows, so a row with large
    scores everywhere no longer decides alone; with one loud row the two poolings propose different pages."""
    P, Hkv, G, D, B, n_hist, length = 4, 1, 2, 8, 1, 12, 4
    spans = [ChunkSpan(0, 0, n_hist * P), ChunkSpan(1, n_hist * P, n_hist * P + length)]
    store, gen = _filled_store(B, Hkv, D, P, spans, seed=6, summaries=("key_min", "key_max", "key_mean"))
    q = torch.randn(B, Hkv * G, length, D, generator=gen)
    q[:, 0, 0] *= 30  # one loud row
    summaries = store.history_summaries(0, n_hist)
    options = _options(score="rerank", budget=2, rerank_factor=2, rerank_candidates="minmax", candidate_pooling="max")
    pooled = replace(options, research=replace(options.research, candidate_pooling="softmax_max"))
    scale = D ** -0.5
    rows = q.reshape(B, Hkv, G, length, D)
    keys = torch.cat([summaries["key_max"], summaries["key_min"]], dim=-1)[:, :, 0]  # (B, n_hist, 2D)
    s = torch.cat([rows.clamp(min=0), rows.clamp(max=0)], dim=-1) @ keys.transpose(-1, -2)[:, None, None] * scale
    want = (s - s.logsumexp(dim=-1, keepdim=True)).amax(dim=(2, 3))[:, :, None]  # (B, Hkv, 1 block, n_hist)
    softmax_max = sparse_replace(_options(), pooling="softmax_max")
    torch.testing.assert_close(block_scores(q, summaries, P, softmax_max, scale), want)
    got = oomb.sparse.propose_candidates(q, summaries, P, pooled, 0, scale)
    assert torch.equal(got, top_pages(want, oomb.sparse.candidate_options(options, 0)))
    assert not torch.equal(got, oomb.sparse.propose_candidates(q, summaries, P, options, 0, scale))
    config = OOMBConfig(attention="sparse",
                        sparse=SparseConfig(research=SparseResearch(candidate_pooling="softmax_max")))
    assert (config).resolved_sparse(4).research.candidate_pooling == "softmax_max"
    assert (OOMBConfig(attention="sparse")).resolved_sparse(4).research.candidate_pooling == "softmax_max"  # "auto"
    assert OOMBConfig(attention="sparse",
                      sparse=SparseConfig(score="minmax")).sparse.resolved_candidate_pooling == "max"
    max_pooling = SparseConfig(research=SparseResearch(candidate_pooling="max"))
    assert max_pooling.resolved(4).research.candidate_pooling == "max"
    with pytest.raises(ValueError, match="sparse.research.candidate_pooling='softmax'"):
        OOMBConfig(attention="sparse", sparse=SparseConfig(research=SparseResearch(candidate_pooling="softmax")))
    with pytest.raises(ValueError, match="does not apply to sparse.score='minmax'"):
        OOMBConfig(attention="sparse", sparse=SparseConfig(score="minmax",
                                                           research=SparseResearch(candidate_pooling="softmax_max")))
    store.free_all()


@pytest.mark.parametrize("n_hist,bound,sinks", [(12, 5, 1), (12, 5, 2), (12, 11, 1), (7, 6, 1)])
def test_bounded_normaliser_counts_the_sinks_the_last_pages_and_the_own_pages(n_hist, bound, sinks):
    """sparse_normaliser_pages: a softmax_max row's log-sum-exp counts the sink pages, the last ``bound``
    history pages and the own pages up to its block, nothing between; the same as every page's once the
    history holds at most the sinks and the bound (the last two cases)."""
    P, Hkv, G, D, B, length = 4, 1, 2, 8, 1, 10
    gen = torch.Generator().manual_seed(11)
    pages = summarize_pages(torch.randn(B, n_hist + 3, Hkv, P, D, generator=gen), P, ("key_mean",))
    history = {"key_mean": pages["key_mean"][:, :n_hist]}
    own = {"key_mean": pages["key_mean"][:, n_hist:]}
    q = torch.randn(B, Hkv * G, length, D, generator=gen) * 3
    scale = 0.4
    options = _options(score="mean", pooling="softmax_max", sink_pages=sinks)
    counted = [p for p in range(n_hist) if p < sinks or p >= n_hist - bound]
    padded = torch.cat([q, q[:, :, -1:].expand(B, Hkv * G, 3 * P - length, D)], dim=2)
    want = torch.empty(B, Hkv, 3, n_hist)
    for j in range(3):  # each block's rows: its queries x the group's heads
        s = padded[:, :, j * P:(j + 1) * P] @ pages["key_mean"][:, :, 0].transpose(1, 2)[:, None] * scale
        seen = counted + [n_hist + i for i in range(j + 1)]
        lse = s[..., seen].logsumexp(dim=-1, keepdim=True)
        want[:, 0, j] = (s[..., :n_hist] - lse).amax(dim=(1, 2))
    bounded = replace(options, research=replace(options.research, normaliser_pages=bound))
    got = block_scores(q, history, P, bounded, scale, own=own)
    torch.testing.assert_close(got, want)
    full = block_scores(q, history, P, options, scale, own=own)
    assert torch.equal(got, full) == (n_hist <= sinks + bound)
    assert oomb.sparse.normaliser_span(n_hist, bounded) == ((0, 0) if n_hist <= sinks + bound
                                                             else (sinks, n_hist - bound))


def test_bounded_normaliser_config():
    """OOMBConfig.sparse_normaliser_pages reaches SparseConfig; "auto" (the default) is 256 where a
    softmax_max normaliser runs and None elsewhere; a number needs a softmax_max pooling and is positive."""
    config = OOMBConfig(attention="sparse",
                        sparse=SparseConfig(research=SparseResearch(candidate_pooling="softmax_max",
                                                                    normaliser_pages=100)))
    assert (config).resolved_sparse(4).research.normaliser_pages == 100
    assert (OOMBConfig(attention="sparse")).resolved_sparse(4).research.normaliser_pages == 256
    full = OOMBConfig(attention="sparse",
                      sparse=SparseConfig(research=SparseResearch(normaliser_pages=None)))  # every history page
    assert (full).resolved_sparse(4).research.normaliser_pages is None
    for no_normaliser in (SparseConfig(research=SparseResearch(candidate_pooling="max")), SparseConfig(score="minmax"),
                          SparseConfig(score="exact", research=SparseResearch(pooling="softmax_max"))):
        config = OOMBConfig(attention="sparse", sparse=no_normaliser)
        assert config.resolved_sparse(4).research.normaliser_pages is None
    with pytest.raises(ValueError, match="bounds the softmax_max pooling's normaliser"):
        OOMBConfig(attention="sparse", sparse=SparseConfig(research=SparseResearch(candidate_pooling="max",
                                                                                   normaliser_pages=256)))
    with pytest.raises(ValueError, match="got score 'exact'"):  # the exact score reads no summaries
        OOMBConfig(attention="sparse", sparse=SparseConfig(score="exact",
                                                           research=SparseResearch(pooling="softmax_max",
                                                                                   normaliser_pages=4)))
    minmax = OOMBConfig(attention="sparse", sparse=SparseConfig(score="minmax",
                                                                research=SparseResearch(pooling="softmax_max",
                                                                                        normaliser_pages=4)))
    assert (minmax).resolved_sparse(4).research.normaliser_pages == 4
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="positive number of pages"):
            OOMBConfig(attention="sparse", sparse=SparseConfig(research=SparseResearch(candidate_pooling="softmax_max",
                                                                                       normaliser_pages=bad)))


# --------------------------------------------------------------------------------------------
# The sparse reference backend against autograd on dense attention masked by the selection
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    groups: int
    kv_heads: int
    head_dim: int
    page: int
    history_pages: int
    chunk: int
    selected: int  # K
    batch: int = 2


CASES = [
    Case(groups=2, kv_heads=2, head_dim=16, page=8, history_pages=6, chunk=20, selected=3),  # last block partial
    Case(groups=1, kv_heads=1, head_dim=8, page=4, history_pages=5, chunk=4, selected=0),  # chunk-local only
    Case(groups=4, kv_heads=2, head_dim=16, page=16, history_pages=4, chunk=17, selected=4, batch=1),  # all
    Case(groups=3, kv_heads=1, head_dim=8, page=4, history_pages=9, chunk=1, selected=2),
    Case(groups=1, kv_heads=2, head_dim=8, page=4, history_pages=7, chunk=12, selected=1),
]


def _case_id(case: Case) -> str:
    return (f"g{case.groups}-hkv{case.kv_heads}-d{case.head_dim}-p{case.page}-hist{case.history_pages}-"
            f"l{case.chunk}-k{case.selected}-b{case.batch}")


@dataclass
class Sparse:
    q: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    page_table: torch.Tensor
    selection: torch.Tensor
    query_start: int
    num_pages: int
    scale: float


def _sparse_inputs(case: Case, seed: int = 0) -> Sparse:
    g = torch.Generator().manual_seed(seed)
    B, Hkv, D, P = case.batch, case.kv_heads, case.head_dim, case.page
    num_pages = case.history_pages + -(-case.chunk // P)
    pool_pages = B * (num_pages + 1) + 2  # spare pages: never named by a read column
    k_pool = torch.randn(pool_pages, Hkv, P, D, generator=g)
    v_pool = torch.randn(pool_pages, Hkv, P, D, generator=g)
    table = torch.randperm(pool_pages, generator=g)[:B * (num_pages + 1)].reshape(B, num_pages + 1).to(torch.int32)
    n_blocks = -(-case.chunk // P)
    selection = torch.stack([
        torch.randperm(case.history_pages, generator=g)[:case.selected].sort().values
        for _ in range(B * Hkv * n_blocks)
    ]).reshape(B, Hkv, n_blocks, case.selected).to(torch.int32)
    q = torch.randn(B, case.chunk, Hkv * case.groups, D, generator=g).transpose(1, 2)  # HF's layout
    return Sparse(q, k_pool, v_pool, table, selection, case.history_pages * P, num_pages, 1 / math.sqrt(D))


def _visible(x: Sparse) -> torch.Tensor:
    """(B, Hkv, Lq, num_keys) bool: what each query reads, per KV head, by the contract."""
    B, Hkv, n_blocks, K = x.selection.shape
    Lq, P = x.q.shape[2], x.k_pool.shape[2]
    num_keys = x.query_start + Lq
    mask = torch.zeros(B, Hkv, Lq, num_keys, dtype=torch.bool)
    q_pos = torch.arange(x.query_start, num_keys)
    mask[..., x.query_start:] = torch.arange(x.query_start, num_keys)[None, :] <= q_pos[:, None]
    for b in range(B):
        for h in range(Hkv):
            for j in range(n_blocks):
                for page in x.selection[b, h, j].tolist():
                    mask[b, h, j * P:(j + 1) * P, page * P:(page + 1) * P] = True
    return mask


def _oracle(x: Sparse, dout: torch.Tensor):
    """Float64 out, lse, dQ, dK, dV (contiguous keys) by autograd on masked dense attention."""
    B, Hq, Lq, D = x.q.shape
    Hkv = x.k_pool.shape[1]
    G = Hq // Hkv
    num_keys = x.query_start + Lq

    def contiguous(pool):
        pages = pool[x.page_table[:, :x.num_pages].long()]  # (B, n, Hkv, P, D)
        return pages.permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, D)[:, :, :num_keys].double().requires_grad_()

    q = x.q.double().requires_grad_()
    k, v = contiguous(x.k_pool), contiguous(x.v_pool)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(G, 1)) * x.scale
    scores = scores.masked_fill(~_visible(x).repeat_interleave(G, 1), float("-inf"))
    out = torch.softmax(scores, -1) @ v.repeat_interleave(G, 1)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.double())
    return out.detach(), torch.logsumexp(scores, -1).detach(), dq, dk, dv


def _to_pool(grad: torch.Tensor, x: Sparse, like: torch.Tensor) -> torch.Tensor:
    B, Hkv, num_keys, D = grad.shape
    P = like.shape[2]
    padded = torch.nn.functional.pad(grad, (0, 0, 0, x.num_pages * P - num_keys))
    per_page = padded.reshape(B, Hkv, x.num_pages, P, D).permute(0, 2, 1, 3, 4).reshape(-1, Hkv, P, D)
    pool = torch.zeros_like(like, dtype=grad.dtype)
    pool[x.page_table[:, :x.num_pages].reshape(-1).long()] = per_page
    return pool


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_sparse_reference_matches_masked_dense_attention(case):
    x = _sparse_inputs(case)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(x.q.shape, generator=g)
    want_out, want_lse, want_dq, want_dk, want_dv = _oracle(x, dout)
    args = (x.q, x.k_pool, x.v_pool, x.page_table, x.query_start, x.scale, x.selection)
    out, lse = reference_sparse.sparse_attention_forward(*args)
    torch.testing.assert_close(out.double(), want_out, **TOL)
    torch.testing.assert_close(lse.double(), want_lse, **TOL)
    dk_start = torch.randn(x.k_pool.shape, generator=g)
    dv_start = torch.randn(x.v_pool.shape, generator=g)
    dk_pool, dv_pool = dk_start.clone(), dv_start.clone()
    dq = reference_sparse.sparse_attention_backward(*args, out, dout, lse, dk_pool, dv_pool)
    torch.testing.assert_close(dq.double(), want_dq, **TOL)
    torch.testing.assert_close(dk_pool.double(), dk_start.double() + _to_pool(want_dk, x, dk_pool), **TOL)
    torch.testing.assert_close(dv_pool.double(), dv_start.double() + _to_pool(want_dv, x, dv_pool), **TOL)

    # Exactly the selected (page, KV head) pairs and the chunk's own pages change.
    P = case.page
    touched = torch.zeros(x.k_pool.shape[:2], dtype=torch.bool)
    own = x.page_table[:, case.history_pages:x.num_pages].long()
    touched[own] = True
    for b in range(case.batch):
        for h in range(case.kv_heads):
            for page in x.selection[b, h].unique().tolist():
                touched[x.page_table[b, page], h] = True
    assert torch.equal(dk_pool[~touched], dk_start[~touched])
    assert torch.equal(dv_pool[~touched], dv_start[~touched])
    assert (dv_pool[touched] != dv_start[touched]).flatten(1).any(1).all()
    assert P * case.history_pages == x.query_start


def test_sparse_reference_with_every_page_equals_the_dense_reference():
    case = Case(groups=2, kv_heads=2, head_dim=16, page=8, history_pages=5, chunk=21, selected=5)
    x = _sparse_inputs(case, seed=3)
    dout = torch.randn(x.q.shape, generator=torch.Generator().manual_seed(4))
    sparse_out, sparse_lse = reference_sparse.sparse_attention_forward(
        x.q, x.k_pool, x.v_pool, x.page_table, x.query_start, x.scale, x.selection)
    dense_out, dense_lse = reference.paged_attention_forward(
        x.q, x.k_pool, x.v_pool, x.page_table, x.query_start, x.scale)
    torch.testing.assert_close(sparse_out, dense_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sparse_lse, dense_lse, rtol=1e-6, atol=1e-6)
    pools = [torch.zeros_like(x.k_pool) for _ in range(4)]
    dq_sparse = reference_sparse.sparse_attention_backward(
        x.q, x.k_pool, x.v_pool, x.page_table, x.query_start, x.scale, x.selection,
        dense_out, dout, dense_lse, pools[0], pools[1])
    dq_dense = reference.paged_attention_backward(
        x.q, x.k_pool, x.v_pool, x.page_table, x.query_start, x.scale, dense_out, dout, dense_lse, pools[2], pools[3])
    torch.testing.assert_close(dq_sparse, dq_dense, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pools[0], pools[2], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pools[1], pools[3], rtol=1e-6, atol=1e-6)


def test_sparse_backward_is_bitwise_repeatable():
    x = _sparse_inputs(CASES[0], seed=5)
    args = (x.q, x.k_pool, x.v_pool, x.page_table, x.query_start, x.scale, x.selection)
    out, lse = reference_sparse.sparse_attention_forward(*args)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    results = []
    for _ in range(2):
        dk_pool, dv_pool = torch.zeros_like(x.k_pool), torch.zeros_like(x.v_pool)
        dq = reference_sparse.sparse_attention_backward(*args, out, dout, lse, dk_pool, dv_pool)
        results.append((dq, dk_pool, dv_pool))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


# --------------------------------------------------------------------------------------------
# The engine in sparse mode
# --------------------------------------------------------------------------------------------
TOKENS, CHUNK, PAGE = 333, 64, 16  # 6 chunks, the last 13 tokens; up to 20 history pages


def _config(**sections) -> OOMBConfig:
    """A sparse step of ``sections`` (sparse=SparseConfig(...), ...) on the torch backend."""
    config = OOMBConfig(chunk_size=CHUNK, page_size=PAGE, attention="sparse", **sections)
    return config.with_options({"performance.backend": "torch"})


@pytest.fixture
def recorded(monkeypatch):
    """Every selection stage 1 keeps, by (layer, chunk index), and every store the engine makes."""
    selections, stores = {}, []
    real_save = PagedKVStore.save_selection

    def recording_save(self, layer, chunk, selection):
        selections[layer, chunk.index] = (chunk, selection)
        real_save(self, layer, chunk, selection)

    class RecordingStore(PagedKVStore):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            stores.append(self)

    monkeypatch.setattr(PagedKVStore, "save_selection", recording_save)
    monkeypatch.setattr(oomb.engine, "PagedKVStore", RecordingStore)
    yield selections, stores
    for store in stores:
        assert store.is_empty and store.pool.num_free == store.pool.capacity


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_budget_covering_every_page_is_dense_bitwise(family, recorded):
    model = build_tiny_model(family, seed=30)
    ids = random_ids(2, TOKENS, seed=30)
    ids_labels = ids.clone()
    ids_labels[1, 100:150] = -100
    model.zero_grad(set_to_none=True)
    dense_loss = oomb.forward_backward(model, ids, ids_labels, OOMBConfig(chunk_size=CHUNK, page_size=PAGE,
                                                                          performance=PerformanceConfig(backend="torch")))
    dense = grads(model)
    model.zero_grad(set_to_none=True)
    history_pages = (TOKENS // CHUNK) * CHUNK // PAGE  # of the last chunk: 20
    sparse_loss = oomb.forward_backward(model, ids, ids_labels,
                                        _config(sparse=SparseConfig(budget=history_pages - 1)))
    sparse = grads(model)
    assert torch.equal(sparse_loss, dense_loss)
    assert all(torch.equal(sparse[name], dense[name]) for name in dense)
    selections, _ = recorded
    assert len(selections) == 6 * model.config.num_hidden_layers
    assert all(selection is None for _, selection in selections.values())


ORACLE_NAME = "oomb_test_sparse_oracle"


def _oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Full-sequence attention restricted to what oomb's sparse step read (a test oracle)."""
    visible = kwargs["sparse_visible"][module.layer_idx]  # (B, Hkv, T, T)
    G = query.shape[1] // key.shape[1]
    scores = query @ key.repeat_interleave(G, 1).transpose(-1, -2) * scaling
    scores = scores.masked_fill(~visible.repeat_interleave(G, 1), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ value.repeat_interleave(G, 1)
    return out.transpose(1, 2), None


AttentionInterface.register(ORACLE_NAME, _oracle_attention)


def _visible_from_selections(selections, layer, batch, kv_heads, tokens) -> torch.Tensor:
    return visible_from_selections(selections, layer, batch, kv_heads, tokens, PAGE)


@pytest.mark.parametrize(
    ("family", "sparse"),
    [
        ("qwen2", dict(sparse=SparseConfig(budget=3, sink_pages=1))),
        ("llama", dict(sparse=SparseConfig(budget=2, sink_pages=0, score="mean", leak_free=True,
                                           research=SparseResearch(selection="shared")))),
        ("qwen3", dict(sparse=SparseConfig(budget=0, sink_pages=2, leak_free=True))),
        ("mistral", dict(sparse=SparseConfig(budget=5, sink_pages=1),
                         performance=PerformanceConfig(checkpoint_layers=False))),
        ("qwen2", dict(sparse=SparseConfig(budget=2, sink_pages=1, query_block_pages=3))),
        ("qwen2", dict(sparse=SparseConfig(budget=2, sink_pages=1, query_block_pages=64))),
        ("llama", dict(sparse=SparseConfig(budget=2, sink_pages=1, score="exact"))),
        ("qwen2", dict(sparse=SparseConfig(budget=2, sink_pages=1, research=SparseResearch(pooling="softmax_max")))),
        ("qwen3", dict(sparse=SparseConfig(budget=2, sink_pages=1, leak_free=True, query_block_pages=2,
                                           research=SparseResearch(pooling="softmax_max")))),
        ("llama", dict(sparse=SparseConfig(budget=2, sink_pages=1, leak_free=True))),
    ],
    ids=["minmax-kv_head", "mean-shared-leak_free", "sinks_only", "no_checkpointing", "query_groups",
         "one_group_per_chunk", "exact_oracle", "softmax_max", "softmax_max-leak_free-groups", "rerank-leak_free"],
)
def test_sparse_gradients_are_exact_for_the_selected_pages(family, sparse, recorded):
    """oomb's sparse step = a full-sequence backward whose attention reads exactly the selected pages."""
    model = build_tiny_model(family, seed=31)
    ids = random_ids(2, TOKENS, seed=31)
    model.zero_grad(set_to_none=True)
    loss = oomb.forward_backward(model, ids, None, _config(**sparse))
    got = grads(model)
    selections, _ = recorded
    assert sum(selection is not None for _, selection in selections.values()) > 0
    Hkv, L = model.config.num_key_value_heads, model.config.num_hidden_layers
    visible = [_visible_from_selections(selections, layer, 2, Hkv, TOKENS) for layer in range(L)]
    model.zero_grad(set_to_none=True)
    model.set_attn_implementation(ORACLE_NAME)
    try:
        want_loss = model(input_ids=ids, labels=ids, sparse_visible=visible).loss
        want_loss.backward()
    finally:
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=0)
    assert relative_error(got, grads(model)) <= GRAD_RTOL


def test_sparse_differs_from_dense_with_a_small_budget(recorded):
    model = build_tiny_model("qwen2", seed=32)
    ids = random_ids(1, TOKENS, seed=32)
    model.zero_grad(set_to_none=True)
    oomb.forward_backward(model, ids, None, OOMBConfig(chunk_size=CHUNK, page_size=PAGE,
                                                       performance=PerformanceConfig(backend="torch")))
    dense = grads(model)
    model.zero_grad(set_to_none=True)
    oomb.forward_backward(model, ids, None, _config(sparse=SparseConfig(budget=2)))
    error = relative_error(grads(model), dense)
    assert 1e-3 < error < 1.0


def test_stage_two_reads_stage_one_selection(monkeypatch, recorded):
    """Selection runs once per (chunk, layer) in stage 1; stage 2 is handed the very same tensors."""
    model = build_tiny_model("llama", seed=33)
    ids = random_ids(1, TOKENS, seed=33)
    select_calls, stage_two = [], []
    real_select, real_attention = oomb.attention.function.select_pages, oomb.models.paged_attention

    def counting_select(q, store, layer, chunk, options, scale=None, documents=None):
        select_calls.append((layer, chunk.index))
        return real_select(q, store, layer, chunk, options, scale, documents)

    def recording_attention(q, k, v, call, *args):
        stage_two.append((call.layer, call.chunk.index, call.selection))
        return real_attention(q, k, v, call, *args)

    monkeypatch.setattr(oomb.attention.function, "select_pages", counting_select)
    monkeypatch.setattr(oomb.models, "paged_attention", recording_attention)
    oomb.forward_backward(model, ids, None, _config(sparse=SparseConfig(budget=2)))
    selections, stores = recorded
    L = model.config.num_hidden_layers
    assert sorted(select_calls) == sorted((layer, c) for c in range(6) for layer in range(L))
    assert len(stage_two) == 2 * 6 * L  # forward + checkpoint replay
    for layer, chunk, selection in stage_two:
        assert selection is selections[layer, chunk][1]
    assert sum(s is not None for _, s in selections.values()) == 5 * L  # chunks 1..5: > 1 + 2 history pages
    assert stores[0]._selections == {}


def test_failure_in_stage_two_frees_selections(monkeypatch, recorded):
    model = build_tiny_model("qwen2", seed=34)
    ids = random_ids(1, TOKENS, seed=34)
    real_loss = oomb.engine.chunked_cross_entropy
    calls = []

    def failing_loss(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure in stage 2")
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(oomb.engine, "chunked_cross_entropy", failing_loss)
    with pytest.raises(RuntimeError, match="injected failure"):
        oomb.forward_backward(model, ids, None, _config(sparse=SparseConfig(budget=2)))
    _, stores = recorded
    assert stores[0].is_empty and stores[0]._selections == {}


def test_forward_hidden_matches_the_model_and_frees_its_pages(recorded):
    """Forward only (stage 1): dense equals HF's hidden states; a budget covering everything is dense."""
    model = build_tiny_model("qwen2", seed=35)
    ids = random_ids(2, TOKENS, seed=35)
    with torch.no_grad():
        want = model.model(input_ids=ids).last_hidden_state
    dense = forward_hidden(model, ids, OOMBConfig(chunk_size=CHUNK, page_size=PAGE,
                                                  performance=PerformanceConfig(backend="torch")))
    torch.testing.assert_close(dense, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(forward_hidden(model, ids, _config(sparse=SparseConfig(budget=100))), dense)
    sparse = forward_hidden(model, ids, _config(sparse=SparseConfig(budget=1)))
    assert sparse.shape == dense.shape and not torch.equal(sparse, dense)
    assert torch.equal(sparse[:, :CHUNK], dense[:, :CHUNK])  # chunk 0 has no history


def test_read_share_grows_the_budget_with_the_history_in_steps():
    from oomb.config import READ_SHARE_STEP

    options = _options(budget=4, read_share=0.25)
    assert options.num_selected(8) == 8  # the step covers a short history: dense
    assert options.budget_of(0, 100) == READ_SHARE_STEP * 2  # ceil(25 pages) -> 32
    assert options.num_selected(1000) == 1 + 256  # sinks + 250 rounded up to a multiple of the step
    assert _options(budget=300, read_share=0.25).budget_of(0, 1000) == 300  # the budget is a floor
    assert _options(budget=4).budget_of(0, 1000) == 4
    wanted = oomb.sparse.candidate_options(_options(budget=4, read_share=0.25, rerank_factor=4), 0, 1000)
    assert wanted.budget == 4 * 256 and wanted.read_share is None
    with pytest.raises(ValueError, match="sparse.read_share=1.5 must be a share"):
        OOMBConfig(attention="sparse", sparse=SparseConfig(read_share=1.5))


def test_a_full_read_share_is_dense_and_a_partial_one_reads_more_than_its_floor():
    model = build_tiny_model("qwen2", seed=36)
    ids = random_ids(1, TOKENS, seed=36)
    dense_loss = oomb.forward_backward(model, ids, None, OOMBConfig(chunk_size=CHUNK, page_size=PAGE,
                                                                    performance=PerformanceConfig(backend="torch")))
    dense = grads(model)
    model.zero_grad(set_to_none=True)
    full_loss = oomb.forward_backward(model, ids, None, _config(sparse=SparseConfig(budget=1, read_share=1.0)))
    full = grads(model)
    assert torch.equal(full_loss, dense_loss) and all(torch.equal(full[name], dense[name]) for name in dense)
    errors = {}
    arms = {"floor": SparseConfig(budget=1), "share": SparseConfig(budget=1, read_share=0.05)}
    for name, options in arms.items():
        model.zero_grad(set_to_none=True)
        oomb.forward_backward(model, ids, None, _config(sparse=options))
        errors[name] = relative_error(grads(model), dense)
    assert 0 < errors["share"] < errors["floor"]


@pytest.mark.parametrize("sparse", [SparseConfig(budget=2, sink_pages=1), SparseConfig(budget=2, query_block_pages=64),
                                    SparseConfig(budget=2, read_share=0.5)],
                         ids=["per_block", "one_group_per_chunk", "read_share"])
def test_kept_selections_are_the_bytes_the_memory_model_counts(sparse, recorded):
    """planning/memory.selection_bytes is what stage 1 keeps for stage 2, per layer: one int32 row per query
    block (one per chunk when a group covers it), the chunk's own budget, nothing for chunks read densely."""
    from oomb.planning.memory import selection_bytes

    model = build_tiny_model("qwen2", seed=34)
    oomb.forward_backward(model, random_ids(2, TOKENS, seed=34), None, _config(sparse=sparse))
    selections, _ = recorded
    for layer in range(model.config.num_hidden_layers):
        kept = [s for (lay, _), (_, s) in selections.items() if lay == layer and s is not None]
        storages = {s.untyped_storage().data_ptr(): s.untyped_storage().nbytes() for s in kept}
        assert sum(storages.values()) == selection_bytes(sparse.resolved(), TOKENS, CHUNK, PAGE, 2,
                                                         model.config.num_key_value_heads, layer) > 0
