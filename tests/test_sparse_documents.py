"""Sparse mode with packed documents: each block selects within its document, sinks are the
document's first pages, and the backend masks keys before each query's document start.

The oracle is a full-sequence HF backward (restarting positions, labels masked at document starts)
whose attention reads, per query, exactly the keys oomb's step read: the selected pages and its own
chunk, causally, from its document's first token on.
"""

from __future__ import annotations

import pytest
import torch
from helpers import build_tiny_model, grads, random_ids, relative_error, visible_from_selections
from transformers import AttentionInterface

import oomb
from oomb import OOMBConfig
from oomb.attention.reference_sparse import shared_by_all_blocks
from oomb.config import PerformanceConfig, SparseConfig
from oomb.documents import resolve_documents
from oomb.kv import ChunkSpan, PagedKVStore
from oomb.kv.offload import HostSlabs, OffloadedKVStore
from oomb.sparse import block_first_pages, top_pages

TOKENS, CHUNK, PAGE = 200, 32, 8
# Documents start mid-page and mid-chunk; one spans four chunks; a one-token document.
LENGTHS = [13, 1, 70, 44, 72]
LENGTHS_2 = [100, 9, 91]
GRAD_RTOL = 1e-5
ORACLE = "oomb_test_sparse_documents_oracle"
CONFIG = OOMBConfig(chunk_size=CHUNK, page_size=PAGE, attention="sparse", sparse=SparseConfig(budget=2, sink_pages=1),
                    performance=PerformanceConfig(backend="torch"))


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


@pytest.fixture
def selections(monkeypatch):
    kept = {}
    real_save = PagedKVStore.save_selection

    def recording_save(self, layer, chunk, selection):
        kept[layer, chunk.index] = (chunk, selection)
        real_save(self, layer, chunk, selection)

    monkeypatch.setattr(PagedKVStore, "save_selection", recording_save)
    return kept


def _visible(kept, layer, batch, kv_heads, starts):
    tokens = starts.shape[1]
    visible = visible_from_selections(kept, layer, batch, kv_heads, tokens, PAGE)
    keys = torch.arange(tokens)
    return visible & (keys[None, None, :] >= starts[:, :, None])[:, None]


def _oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    visible = kwargs["sparse_visible"][module.layer_idx]
    G = query.shape[1] // key.shape[1]
    scores = query @ key.repeat_interleave(G, 1).transpose(-1, -2) * scaling
    scores = scores.masked_fill(~visible.repeat_interleave(G, 1), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ value.repeat_interleave(G, 1)).transpose(1, 2), None


AttentionInterface.register(ORACLE, _oracle_attention)


@pytest.mark.parametrize(("family", "sparse"), [
    ("llama", {}),
    pytest.param("llama", {"performance.backend": "triton"}, marks=pytest.mark.slow),  # the interpreter: minutes
    ("qwen2", {"sparse.research.selection": "shared", "sparse.leak_free": True, "sparse.research.pooling": "softmax"}),
    ("qwen3", {"sparse.query_block_pages": 2, "sparse.sink_pages": 2, "sparse.budget": 1}),
], ids=["kv_head", "triton", "shared-leak_free-softmax", "query_groups"])
def test_sparse_with_documents_is_exact_for_what_it_reads(family, sparse, selections):
    model = build_tiny_model(family, seed=51)
    ids = random_ids(2, TOKENS, seed=51)
    cu = [_cu(LENGTHS), _cu(LENGTHS_2)]
    model.zero_grad(set_to_none=True)
    loss = oomb.forward_backward(model, ids, None, CONFIG.with_options(sparse), cu_seqlens=cu)
    got = grads(model)
    assert sum(selection is not None for _, selection in selections.values()) > 0
    docs = resolve_documents(None, cu, tuple(ids.shape), torch.device("cpu"))
    for chunk, selection in selections.values():  # every block reads its document's first page (a sink)
        if selection is not None:
            firsts = block_first_pages(docs, chunk, PAGE)  # (B, n_blocks)
            in_history = firsts < chunk.start // PAGE
            has_sink = (selection.long() == firsts[:, None, :, None]).any(-1).all(1)  # (B, n_blocks)
            assert bool(has_sink[in_history].all())
    Hkv, L = model.config.num_key_value_heads, model.config.num_hidden_layers
    visible = [_visible(selections, layer, 2, Hkv, docs.start_cpu) for layer in range(L)]
    labels = docs.mask_labels(ids.clone())
    model.zero_grad(set_to_none=True)
    model.set_attn_implementation(ORACLE)
    try:
        want_loss = model(input_ids=ids, labels=labels, position_ids=docs.positions, use_cache=False,
                          sparse_visible=visible).loss
        want_loss.backward()
    finally:
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=0)
    assert relative_error(got, grads(model)) <= GRAD_RTOL


def test_blocks_select_within_their_document_and_sink_at_its_first_page():
    """Block scores favour pages of earlier documents: the selection still takes the document's first
    page as its sink and its best pages, and earlier pages only when the document has too few."""
    B, Hkv, n_blocks, n_hist = 1, 2, 3, 12
    scores = torch.zeros(B, Hkv, n_blocks, n_hist)
    scores[..., :5] = 100.0  # earlier documents' pages score best
    scores[..., 9] = 50.0
    first_pages = torch.tensor([[6, 6, 11]])  # blocks 0, 1 in a document from page 6; block 2 from page 11
    options = SparseConfig(budget=2, sink_pages=1, score="minmax").resolved()
    selection = top_pages(scores, options, first_pages=first_pages)
    assert selection.shape == (B, Hkv, n_blocks, 3)
    for h in range(Hkv):
        for j in (0, 1):
            row = selection[0, h, j].tolist()
            assert 6 in row and 9 in row and all(p >= 6 for p in row)  # sink 6, best page 9, one more >= 6
        row = selection[0, h, 2].tolist()  # one history page of its own document: 11, then fill-ups
        assert 11 in row and len(set(row)) == 3


def test_block_first_pages_are_the_first_querys_document():
    docs = resolve_documents(None, [_cu(LENGTHS)], (1, TOKENS), torch.device("cpu"))
    firsts = block_first_pages(docs, ChunkSpan(3, 96, 128), PAGE)
    # blocks start at 96, 104, 112, 120: documents from 84 (page 10), then 128 > 120 is the next start
    assert firsts.tolist() == [[10, 10, 10, 10]]


def test_a_full_budget_with_documents_is_dense_bitwise():
    model = build_tiny_model("llama", seed=52)
    ids = random_ids(1, TOKENS, seed=52)
    cu = [_cu(LENGTHS)]
    dense_config = OOMBConfig(chunk_size=CHUNK, page_size=PAGE, performance=PerformanceConfig(backend="torch"))
    model.zero_grad(set_to_none=True)
    dense_loss = oomb.forward_backward(model, ids, None, dense_config, cu_seqlens=cu)
    dense = grads(model)
    model.zero_grad(set_to_none=True)
    sparse_loss = oomb.forward_backward(model, ids, None, CONFIG.with_options({"sparse.budget": TOKENS}), cu_seqlens=cu)
    assert torch.equal(sparse_loss, dense_loss)
    assert all(torch.equal(grads(model)[n], dense[n]) for n in dense)


def _assert_offload_bitwise(config: OOMBConfig, seed: int) -> None:
    """Two rows of packed documents: the step with offload equals the step without, bit for bit."""
    model = build_tiny_model("qwen2", seed=seed)
    ids = random_ids(2, TOKENS, seed=seed)
    cu = [_cu(LENGTHS), _cu(LENGTHS_2)]
    results = []
    for step_config, slabs in ((config, None), (config.with_options({"offload.enabled": True}), HostSlabs(pin=False))):
        model.zero_grad(set_to_none=True)
        results.append((oomb.forward_backward(model, ids, None, step_config, cu_seqlens=cu, host_slabs=slabs),
                        grads(model)))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


@pytest.mark.parametrize("options", [{}, {"sparse.query_block_pages": CHUNK // PAGE},
                                     {"offload.enabled": True, "sparse.query_block_pages": CHUNK // PAGE}])
def test_chunks_whose_documents_fit_the_selection_skip_scoring_with_the_same_result(options, monkeypatch):
    """Where every block's document has at most as many history pages as the selection reads, the chunk reads
    the pages just before it instead of scoring (the document's pages, and earlier ones the backend masks as it
    masked the scored fill-ups): the step's loss and gradients equal the scored step's bit for bit."""
    import oomb.sparse

    config = CONFIG.with_options(options)
    model = build_tiny_model("qwen2", seed=56)
    ids = random_ids(2, TOKENS, seed=56)
    cu = [_cu(LENGTHS), _cu(LENGTHS_2)]
    shortcuts = []
    real = oomb.sparse.recent_pages_hold_the_documents

    def recording(*args):
        shortcuts.append(real(*args) is not None)
        return real(*args)

    widths = []  # pages listed per sequence by each stage-1 in-place staging
    real_stage = OffloadedKVStore._stage_in_place

    def stage_recording(self, index, layer, chunk, pages, kinds, fresh):
        widths.append((kinds, pages.shape[1]))
        return real_stage(self, index, layer, chunk, pages, kinds, fresh)

    monkeypatch.setattr(OffloadedKVStore, "_stage_in_place", stage_recording)
    results = []
    for shortcut in (recording, lambda *args: None):  # the shortcut, then every chunk scored
        monkeypatch.setattr(oomb.sparse, "recent_pages_hold_the_documents", shortcut)
        model.zero_grad(set_to_none=True)
        slabs = HostSlabs(pin=False) if config.offload.enabled else None
        results.append((oomb.forward_backward(model, ids, None, config, cu_seqlens=cu, host_slabs=slabs),
                        grads(model)))
    assert any(shortcuts) and not all(shortcuts)  # both kinds of chunk occur
    if config.offload.enabled and config.sparse.query_block_pages > 1:  # the recent pages move once, not per head
        selected = config.sparse.budget + config.sparse.sink_pages
        kv_heads = model.config.num_key_value_heads
        assert {w for kinds, w in widths if kinds == ("k", "v")} == {selected, kv_heads * selected}
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def test_sparse_documents_with_offload_equal_without_bitwise():
    _assert_offload_bitwise(CONFIG, seed=53)


@pytest.mark.parametrize(("backend", "staging", "rows"), [
    ("torch", "gather", [LENGTHS, LENGTHS_2]),
    ("torch", "copy per run", [LENGTHS, LENGTHS_2]),
    pytest.param("triton", "gather", [LENGTHS[:4]], marks=pytest.mark.slow),  # 128 tokens: the interpreter is slow
])
def test_sparse_offload_stages_only_pages_some_query_sees(backend, staging, rows, selections, monkeypatch):
    """A block whose document holds fewer history pages than it reads fills its selection up with
    earlier pages, which the backend masks: offload leaves them on the host (the page table points
    them at a zero page), staging per call exactly the selected pages some query of it sees, with
    gradients bit-identical to sparse without offload."""
    if staging == "copy per run":
        monkeypatch.setattr(HostSlabs, "mapped", lambda *args: None)
    staged, in_place = [], []  # (layer, chunk, history positions staged, selected) per call; in-place calls

    class Recording(OffloadedKVStore):
        def _stage_selection(self, index, layer, chunk, selection, grads):
            result = super()._stage_selection(index, layer, chunk, selection, grads)
            if shared_by_all_blocks(selection) and not grads and result.stage_one:
                in_place.append((layer, chunk.index))  # the documents' recent pages (oomb/sparse.py): moved whole
            else:
                staged.append((layer, chunk, result.history, torch.unique(selection).tolist()))
            return result

    monkeypatch.setattr(oomb.engine, "OffloadedKVStore", Recording)
    model = build_tiny_model("qwen2", seed=54)
    ids = random_ids(len(rows), sum(rows[0]), seed=54)
    cu = [_cu(lengths) for lengths in rows]
    config = CONFIG.with_options({"performance.backend": backend})
    results = []
    for step_config, slabs in ((config, None), (config.with_options({"offload.enabled": True}), HostSlabs(pin=False))):
        model.zero_grad(set_to_none=True)
        results.append((oomb.forward_backward(model, ids, None, step_config, cu_seqlens=cu, host_slabs=slabs),
                        grads(model)))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    # The oracle: a history page is needed iff some query of the chunk reads one of its keys unmasked.
    docs = resolve_documents(None, cu, tuple(ids.shape), torch.device("cpu"))
    Hkv = model.config.num_key_value_heads
    visible = {layer: _visible(selections, layer, len(rows), Hkv, docs.start_cpu) for layer in (0, 1)}
    assert len(staged) + len(in_place) == 3 * sum(s is not None for _, s in selections.values())  # stages 1, 2 (x2)
    assert in_place  # chunks whose blocks' documents all fit the selection are not scored: their recent pages
    for layer, chunk, history, selected in staged:
        seen = visible[layer][:, :, chunk.start:chunk.end, :chunk.start].any(dim=(0, 1, 2))
        assert history == [p for p in range(chunk.start // PAGE) if bool(seen[p * PAGE:(p + 1) * PAGE].any())]
        assert set(history) <= set(selected)
    skipped = sum(len(selected) - len(history) for _, _, history, selected in staged)
    assert skipped > 0  # chunk 3 holds blocks of a document with too few history pages (and chunks 4-6)
    assert sum(len(history) for _, _, history, _ in staged) < sum(len(selected) for *_, selected in staged)


@pytest.mark.parametrize("score", ["minmax", "rerank"])
def test_stage_one_with_documents_stages_in_place_without_reading_selections_bitwise(score, monkeypatch):
    """One selection per chunk (what the chooser gives sparse offload): stage 1 of a step with packed documents
    stages its selected pages in place, by index on the device, so the host never reads a selection there (on a
    GPU, each read is a device synchronisation per layer and chunk); the pages a selection fills up with before
    its document move too and are masked. Rerank's candidate keys move as (page, head) rows, each head's own
    candidates only (the score reads no document), and so does a selection of its document's own pages, its
    virtual pages numbered from the document's first; otherwise stage 2 keeps the union of the pages some query
    sees. Gradients equal sparse without offload bit for bit."""
    in_place, union, head_rows, numbered = [], [], [], []

    class Recording(OffloadedKVStore):
        def _stage_in_place(self, index, layer, chunk, pages, kinds, fresh):
            in_place.append((layer, chunk.index, kinds))
            return super()._stage_in_place(index, layer, chunk, pages, kinds, fresh)

        def scoring_head_rows(self, index, layer, chunk, candidates):
            head_rows.append((layer, chunk.index))
            return super().scoring_head_rows(index, layer, chunk, candidates)

        def _head_row_layout(self, index, layer, chunk, pages, first_pages=None):
            if first_pages is not None:
                numbered.append((layer, chunk.index))
            return super()._head_row_layout(index, layer, chunk, pages, first_pages)

        def _selected_columns(self, layer, chunk, selection):
            union.append((layer, chunk.index, (layer, chunk.index) in self._fresh_kv))
            return super()._selected_columns(layer, chunk, selection)

    monkeypatch.setattr(oomb.engine, "OffloadedKVStore", Recording)
    _assert_offload_bitwise(CONFIG.with_options({"sparse.query_block_pages": CHUNK // PAGE, "sparse.score": score}),
                            seed=55)
    assert ("k", "v") in {kinds for *_, kinds in in_place}  # stage 1's selected pages
    assert ("k",) not in {kinds for *_, kinds in in_place}  # candidate keys never move with all their heads
    assert bool(head_rows) == (score == "rerank")  # stage 1's candidate keys
    # Selections of a document's own pages, led by its first (a sink), move as (page, head) rows numbered from it.
    assert numbered
    # The host reads selections in stage 2 only, but for the last chunk: one block (200 = 6 x 32 + 8), whose
    # selection is not a stride-0 view over blocks.
    assert union and {chunk for _, chunk, stage_one in union if stage_one} == {TOKENS // CHUNK}
