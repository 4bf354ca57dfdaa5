"""cuDNN's selected-pages path (oomb/attention/cudnn_sparse.py): finding a call's selection groups."""

import pytest
import torch

from oomb.attention import cudnn_sparse
from oomb.config import OffloadConfig, SparseConfig


@pytest.mark.parametrize("n_blocks, group, want", [
    (5, 1, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
    (5, 2, [(0, 2), (2, 4), (4, 5)]),
    (6, 3, [(0, 3), (3, 6)]),
])
def test_known_block_groups_are_not_read_from_the_selection(monkeypatch, n_blocks, group, want):
    """With the step's blocks per selection given, the groups come from it: the selection's values are
    never compared (on a GPU that comparison is a device synchronisation per call)."""
    sel = torch.arange(n_blocks * 2, dtype=torch.int32).reshape(1, 1, n_blocks, 2)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("the selection was read"))
    assert cudnn_sparse._groups(sel, group) == want


def test_known_groups_give_the_groups_found_by_reading():
    """Runs of equal selections built as sparse_query_block_pages builds them: both ways agree."""
    rows = torch.randint(0, 50, (2, 3, 4, 5), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    sel = rows.repeat_interleave(3, dim=2)[:, :, :10].contiguous()  # groups of 3, a partial last one
    assert cudnn_sparse._groups(sel, 3) == cudnn_sparse._groups(sel) == [(0, 3), (3, 6), (6, 9), (9, 10)]


def test_the_cudnn_backend_is_handed_the_steps_blocks_per_selection(monkeypatch):
    """A sparse step on a backend that takes ``block_group`` gets sparse_query_block_pages in every call
    (stage 1 and stage 2, forward and backward), and the result equals the torch backend's."""
    from helpers import build_tiny_model, random_ids
    from test_cudnn_paged import MATH, SPARSE_MATH, assert_step_matches_torch

    import oomb
    from oomb.attention import cudnn_paged
    from oomb.attention.backend import AttentionBackend

    seen = []

    def forward(*args, block_group=None, **kwargs):
        seen.append(block_group)
        return SPARSE_MATH.sparse_attention_forward(*args, block_group=block_group, **kwargs)

    def backward(*args, block_group=None, **kwargs):
        seen.append(block_group)
        return SPARSE_MATH.sparse_attention_backward(*args, block_group=block_group, **kwargs)

    stand_in = AttentionBackend("stand-in", MATH.paged_attention_forward, MATH.paged_attention_backward,
                                cudnn_paged.no_delta, forward, backward, sparse_block_group=True)
    model = build_tiny_model("qwen2", seed=43, num_hidden_layers=2)
    ids = random_ids(1, 96, seed=43)
    config = oomb.OOMBConfig(chunk_size=32, page_size=8, attention="sparse",
                             sparse=SparseConfig(budget=2, query_block_pages=2))
    assert_step_matches_torch(monkeypatch, stand_in, model, ids, config)
    assert seen and set(seen) == {2}


@pytest.mark.parametrize("groups, num_queries, in_order", [
    ([(0, 1), (1, 2), (2, 3), (3, 4)], 64, True),  # one selection per block
    ([(0, 2), (2, 4)], 64, True),  # per two blocks
    ([(0, 4)], 64, True),  # per chunk (also "whole")
    ([(0, 1), (1, 2), (2, 3), (3, 4)], 60, False),  # a partial last block pads
    ([(0, 2), (3, 5)], 80, False),  # a class of groups that leaves blocks out
])
def test_groups_tiling_the_chunk_in_order_are_a_permutation(groups, num_queries, in_order):
    """Groups that tile the chunk's queries in order take the one-copy layout; it gives exactly what the
    general (pad, gather, transpose) layout gives, both ways."""
    x = torch.randn(2, 6, num_queries, 8)  # (B, Hq, Lq, D), 3 KV heads, pages of 16
    fast = cudnn_sparse._Layout(groups, num_queries, 16, x.device)
    general = cudnn_sparse._Layout(groups, num_queries, 16, x.device)
    general.in_order = general.whole = False
    assert fast.in_order == in_order
    for t in (x, x[..., 0]):
        grouped = fast.to_groups(t, 3)
        torch.testing.assert_close(grouped, general.to_groups(t, 3), rtol=0, atol=0)
        back = fast.from_groups(grouped, 2, 6)
        torch.testing.assert_close(back, general.from_groups(grouped, 2, 6), rtol=0, atol=0)
        if in_order:
            torch.testing.assert_close(back, t, rtol=0, atol=0)


@pytest.mark.parametrize("contiguous", [True, False])
def test_selected_gradients_land_in_their_page_and_head_slots(contiguous):
    """_add_selected adds each (group, head, k) gradient row into pool[page, head], duplicates summed:
    the same sums as adding them one by one (integer values, so the order of a sum cannot matter)."""
    gen = torch.Generator().manual_seed(0)
    B, Hkv, n_groups, K, P, D, n_pages = 2, 3, 4, 5, 4, 2, 7
    ids = torch.randint(0, n_pages, (B, Hkv, n_groups, K), generator=gen)
    heads = torch.arange(Hkv).reshape(1, Hkv, 1, 1).expand_as(ids)
    grad = torch.randint(-8, 8, (B * n_groups, Hkv, K * P, D), generator=gen).float()
    pool = torch.randint(-8, 8, (n_pages, Hkv, P, D), generator=gen).float()
    want = pool.clone()
    rows = grad.reshape(B, n_groups, Hkv, K, P, D)
    for b in range(B):
        for g in range(n_groups):
            for h in range(Hkv):
                for k in range(K):
                    want[ids[b, h, g, k], h] += rows[b, g, h, k]
    target = pool if contiguous else pool.transpose(2, 3).contiguous().transpose(2, 3)
    assert target.is_contiguous() == contiguous
    cudnn_sparse.SelectedPagesAttention._add_selected(target, ids, heads, grad)
    torch.testing.assert_close(target, want, rtol=0, atol=0)


def test_groups_in_order_put_no_index_on_the_device(monkeypatch):
    """A layout that is a permutation builds no index tensors (no host-to-device copies per call)."""
    layout = cudnn_sparse._Layout([(0, 2), (2, 4)], 64, 16, torch.device("cpu"))
    monkeypatch.setattr(torch.Tensor, "to", lambda *a, **k: pytest.fail("an index was moved to the device"))
    x = torch.randn(1, 4, 64, 8)
    layout.from_groups(layout.to_groups(x, 2), 1, 4)
    sel = torch.arange(8, dtype=torch.int32).reshape(1, 1, 4, 2)
    assert torch.equal(layout.group_rows(sel), sel[:, :, ::2].long())


# --- packed documents --------------------------------------------------------------------------------
# Rows of 104 tokens, the chunk at 64 (8 history pages of 8), budget 2 + 1 sink: the chunk's first
# document starts mid-page with 7 history pages (its first page read densely, the rest selected); on a
# page start with 6 (all selected); with 2 (fewer than the budget: one dense window); at the chunk's
# start (no history). Later documents start inside the chunk, one of a single token.
DOCUMENT_ROWS = [[0, 13, 70, 71, 90, 104], [0, 16, 75, 104], [0, 48, 104], [0, 64, 66, 104]]


def _documents_case(group: int, seed: int = 0, scale: int = 1, D: int = 16):
    """DOCUMENT_ROWS with every length (pages, chunk, documents) times ``scale``."""
    from test_cudnn_paged import _grouped

    from oomb.config import SparseConfig
    from oomb.documents import resolve_documents
    from oomb.kv import ChunkSpan
    from oomb.sparse import block_first_pages, top_pages

    g = torch.Generator().manual_seed(seed)
    B, Hq, Hkv, P, qs, Lq = len(DOCUMENT_ROWS), 4, 2, 8 * scale, 64 * scale, 40 * scale
    pages = B * (qs + Lq) // P
    k_pool, v_pool = (torch.randn(pages, Hkv, P, D, generator=g) for _ in range(2))
    table = torch.randperm(pages, generator=g).to(torch.int32).reshape(B, -1)
    q = torch.randn(B, Hq, Lq, D, generator=g)
    dout = torch.randn(B, Hq, Lq, D, generator=g)
    docs = resolve_documents(None, [[n * scale for n in row] for row in DOCUMENT_ROWS], (B, qs + Lq),
                             torch.device("cpu"))
    n_blocks = -(-Lq // P)
    scores = torch.randn(B, Hkv, n_blocks, qs // P, generator=g)
    options = SparseConfig(budget=2, sink_pages=1, score="minmax").resolved()
    selection = top_pages(scores, options, first_pages=block_first_pages(docs, ChunkSpan(1, qs, qs + Lq), P))
    return q, k_pool, v_pool, table, qs, _grouped(selection, group), dout, docs


@pytest.mark.parametrize("group", [1, 2, 5], ids=["per-block", "groups-of-2", "one-group"])
def test_selected_pages_with_documents_match_the_sparse_reference(group):
    """Every way a row reads its history (module docstring of cudnn_sparse.py) on the stand-in kernel vs
    reference_sparse.py, which masks each query's keys before its document start: out, lse, dQ, dK, dV."""
    from test_cudnn_paged import DOC_MATH, MATH

    from oomb.attention import reference_sparse

    q, k_pool, v_pool, table, qs, selection, dout, docs = _documents_case(group)
    ours = cudnn_sparse.SelectedPagesAttention(MATH.kernel, windowed=DOC_MATH)
    plans = cudnn_sparse._document_plans(docs, qs, q.shape[2], k_pool.shape[2], selection.shape[3])
    assert [p.drop_first_page for p in plans] == [True, False, None, None]  # each case is covered
    args = (q, k_pool, v_pool, table, qs, 0.25, selection)
    results = {}
    for name, impl, kwargs in (("ours", ours, {"block_group": group}), ("reference", reference_sparse, {})):
        out, lse = impl.sparse_attention_forward(*args, documents=docs, **kwargs)
        dk, dv = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
        dq = impl.sparse_attention_backward(*args, out, dout, lse, dk, dv, documents=docs, **kwargs)
        results[name] = (out, lse, dq, dk, dv)
    for label, got, want in zip(("out", "lse", "dq", "dk", "dv"), results["ours"], results["reference"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=label)


def test_sliding_windows_in_sparse_mode_are_refused_with_the_way_out():
    from test_cudnn_paged import MATH

    from oomb.documents import window_bounds

    q, k_pool, v_pool, table, qs, selection, _, _ = _documents_case(1)
    band = window_bounds(None, 16, (q.shape[0], qs + q.shape[2]), torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="backend='triton'"):
        cudnn_sparse.SelectedPagesAttention(MATH.kernel).sparse_attention_forward(q, k_pool, v_pool, table, qs, 0.25,
                                                                            selection, documents=band)


@pytest.mark.parametrize("query_block_pages, offload", [(1, False), (2, True), (4, False)])
def test_sparse_documents_step_on_the_stand_in_matches_the_torch_backend(monkeypatch, query_block_pages, offload):
    """A whole sparse step with packed documents (two rows; documents starting inside pages and chunks,
    one shorter than the budget, a one-token one) through the cudnn backend's code equals the torch
    backend's."""
    from helpers import build_tiny_model, random_ids
    from test_cudnn_paged import DOC_MATH, MATH, assert_step_matches_torch

    import oomb
    from oomb.attention import cudnn_paged
    from oomb.attention.backend import AttentionBackend

    selected = cudnn_sparse.SelectedPagesAttention(MATH.kernel, windowed=DOC_MATH)
    stand_in = AttentionBackend("stand-in", DOC_MATH.paged_attention_forward, DOC_MATH.paged_attention_backward,
                                cudnn_paged.no_delta, selected.sparse_attention_forward,
                                selected.sparse_attention_backward, whole_history=True, sparse_block_group=True)
    model = build_tiny_model("qwen2", seed=44, num_hidden_layers=2)
    ids = random_ids(2, 200, seed=44)
    cu = [[0, 13, 14, 90, 130, 200], [0, 70, 75, 76, 181, 200]]
    config = oomb.OOMBConfig(chunk_size=32, page_size=8, attention="sparse",
                             sparse=oomb.SparseConfig(budget=2, query_block_pages=query_block_pages),
                             offload=OffloadConfig(enabled=offload))
    assert_step_matches_torch(monkeypatch, stand_in, model, ids, config, cu_seqlens=cu)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 5], ids=["per-block", "one-group"])
def test_gpu_cudnn_sparse_documents_bf16_error_within_twice_reference(group):
    """The documents cases above at pages of 64 on cuDNN in bf16, within twice the sparse reference's own
    bf16 error against float32 (the bound of tests/test_cudnn_paged.py)."""
    from test_cudnn_paged import _assert_within_twice_reference

    from oomb.attention import reference_sparse
    from oomb.documents import resolve_documents

    q, k_pool, v_pool, table, qs, selection, dout, docs = _documents_case(group, scale=8, D=64)
    cuda_docs = resolve_documents(None, [[n * 8 for n in row] for row in DOCUMENT_ROWS], tuple(docs.start.shape),
                                  torch.device("cuda"))

    def run(impl, dtype, **kwargs):
        qq, kk, vv, do = (t.cuda().to(dtype) for t in (q, k_pool, v_pool, dout))
        args = (qq, kk, vv, table.cuda(), qs, 64 ** -0.5, selection.cuda())
        out, lse = impl.sparse_attention_forward(*args, documents=cuda_docs, **kwargs)
        dk = torch.zeros(kk.shape, dtype=torch.float32, device="cuda")
        dv = torch.zeros_like(dk)
        dq = impl.sparse_attention_backward(*args, out, do, lse, dk, dv, documents=cuda_docs, **kwargs)
        return out, lse, dq, dk, dv

    _assert_within_twice_reference(run(cudnn_sparse.SelectedPagesAttention(), torch.bfloat16, block_group=group),
                                   run(reference_sparse, torch.bfloat16), run(reference_sparse, torch.float32))


def test_a_selection_without_the_documents_first_page_fails_loudly():
    """The invariant the cudnn path rests on (each block of the chunk's first document reads that
    document's first page first) is checked on the device: a selection made otherwise raises."""
    from test_cudnn_paged import DOC_MATH, MATH

    q, k_pool, v_pool, table, qs, selection, _, docs = _documents_case(1)
    broken = selection.clone()
    broken[0, :, 0, 0] = broken[0, :, 0, 1]  # row 0's first block no longer reads page 1 (its sink)
    ours = cudnn_sparse.SelectedPagesAttention(MATH.kernel, windowed=DOC_MATH)
    with pytest.raises(RuntimeError, match="sink_pages >= 1"):
        ours.sparse_attention_forward(q, k_pool, v_pool, table, qs, 0.25, broken, documents=docs)


def test_sparse_documents_without_sinks_stay_off_cudnn(monkeypatch):
    """sparse.sink_pages=0 breaks that invariant: "auto" takes triton, and cudnn asked for is refused."""
    from helpers import build_tiny_model

    import oomb.engine
    from oomb import OOMBConfig, SparseConfig
    from oomb.attention.backend import AttentionBackend
    from oomb.documents import resolve_documents

    model = build_tiny_model("llama", seed=2).to(torch.bfloat16)
    docs = resolve_documents(None, [0, 20, 40], (1, 40), torch.device("cpu"))
    config = OOMBConfig(chunk_size=16, page_size=8, attention="sparse", sparse=SparseConfig(sink_pages=0))
    asked = []
    fake = AttentionBackend("cudnn", None, None, None)
    monkeypatch.setattr(oomb.engine, "select_backend", lambda name, device, **kw: asked.append(kw["dtype"]) or fake)
    with pytest.raises(NotImplementedError, match="sparse.sink_pages >= 1"):
        oomb.engine.attention_setup(model, config, torch.device("cuda"), 40, docs)
    assert asked == [None]  # "auto" would have resolved to triton
