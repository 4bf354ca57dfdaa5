"""cuDNN's selected-pages path (oomb/attention/cudnn_sparse.py): finding a call's selection groups."""

import pytest
import torch

from oomb.attention import cudnn_sparse
from oomb.config import SparseConfig


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
    from helpers import build_tiny_model, grads, random_ids, relative_error
    from test_cudnn_paged import MATH, SPARSE_MATH

    import oomb
    import oomb.engine
    from oomb.attention import cudnn_paged
    from oomb.attention.backend import TORCH_BACKEND, AttentionBackend

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
    results = {}
    for name, backend in (("torch", TORCH_BACKEND), ("stand-in", stand_in)):
        monkeypatch.setattr(oomb.engine, "select_backend", lambda *_, b=backend, **__: b)
        model.zero_grad(set_to_none=True)
        config = oomb.OOMBConfig(chunk_size=32, page_size=8, attention="sparse", sparse=SparseConfig(budget=2,
                                                                                                     query_block_pages=2))
        results[name] = (oomb.forward_backward(model, ids, None, config), grads(model))
    assert seen and set(seen) == {2}
    torch.testing.assert_close(results["stand-in"][0], results["torch"][0], rtol=1e-5, atol=0)
    assert relative_error(results["stand-in"][1], results["torch"][1]) <= 1e-5


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
