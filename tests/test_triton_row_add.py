"""The Triton row add (oomb/attention/triton_row_add.py) that puts the sparse cuDNN backward's dK, dV into
the page gradients. CPU: the Triton interpreter (conftest sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

triton_row_add = pytest.importorskip("oomb.attention.triton_row_add")

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(pool_dtype, rows_count=9, width=600, updates=23, seed=0):
    """A pool, indices with duplicates (the last index repeated at the end) and bf16 gradient rows."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(rows_count, width, generator=gen).to(DEVICE, pool_dtype)
    rows = torch.randint(0, rows_count, (updates,), generator=gen)
    rows[-3:] = rows[-1]
    grad = torch.randn(updates, width, generator=gen).to(DEVICE, torch.bfloat16)
    return pool, rows.to(DEVICE), grad


def _sequential(pool, rows, grad):
    """The contract: each update added in float32 and rounded to the pool's dtype, in the order of rows."""
    out = pool.clone()
    for i, r in enumerate(rows.tolist()):
        out[r] = (out[r].float() + grad[i].float()).to(pool.dtype)
    return out


def test_float32_pool_equals_index_put_bit_for_bit():
    """Several column tiles, a partial last one, rows selected several times and some never."""
    pool, rows, grad = _case(torch.float32)
    got = triton_row_add.add_rows_(pool.clone(), rows, grad)
    assert torch.equal(got, _sequential(pool, rows, grad))
    want = pool.clone().index_put_((rows,), grad.float(), accumulate=True)
    if DEVICE == "cpu":  # the CPU's index_put adds duplicates in order, as the kernel does
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_sort_made_once_serves_several_gradients_at_the_same_rows():
    """sorted_rows(rows) handed to add_rows_ (the sparse backward sorts dK's rows once, for dV too): the same
    sums as add_rows_ sorting them itself."""
    pool, rows, grad = _case(torch.float32, seed=3)
    order = triton_row_add.sorted_rows(rows)
    assert torch.equal(triton_row_add.add_rows_(pool.clone(), rows, grad, order),
                       triton_row_add.add_rows_(pool.clone(), rows, grad))


def test_low_precision_pool_rounds_after_every_add():
    """A bf16 pool gets each update rounded as it lands. The interpreter converts float32 to bf16 by
    truncation where the GPU rounds to nearest even, so only the GPU is held to the bits."""
    pool, rows, grad = _case(torch.bfloat16, seed=1)
    got = triton_row_add.add_rows_(pool.clone(), rows, grad)
    want = _sequential(pool, rows, grad)
    if DEVICE == "cuda":
        assert torch.equal(got, want)
    else:  # truncation is less than one bf16 step (2^-4 below 16) per add away from rounding
        adds = torch.bincount(rows.cpu()).max().item()
        assert want.float().abs().max().item() < 16
        assert (got.float() - want.float()).abs().max().item() <= adds * 2 ** -4


def test_the_same_bits_in_every_run_and_nothing_for_no_rows():
    pool, rows, grad = _case(torch.float32, seed=2)
    first = triton_row_add.add_rows_(pool.clone(), rows, grad)
    assert torch.equal(first, triton_row_add.add_rows_(pool.clone(), rows, grad))
    untouched = pool.clone()
    triton_row_add.add_rows_(untouched, rows[:0], grad[:0])
    assert torch.equal(untouched, pool)


def test_bad_inputs_are_refused():
    pool, rows, grad = _case(torch.float32)
    with pytest.raises(ValueError, match="need"):
        triton_row_add.add_rows_(pool, rows[:-1], grad)
    with pytest.raises(ValueError, match="contiguous"):
        triton_row_add.add_rows_(pool.t().contiguous().t(), rows, grad)
    with pytest.raises(ValueError, match="takes"):
        triton_row_add.add_rows_(pool.view(-1), rows, grad)


@pytest.mark.gpu
def test_the_sparse_cudnn_backward_adds_through_the_kernel(monkeypatch):
    """_add_selected on a CUDA float32 pool goes through the kernel and gives index_put's sums."""
    from oomb.attention import cudnn_sparse

    gen = torch.Generator().manual_seed(3)
    B, Hkv, n_groups, K, P, D, pages = 1, 2, 5, 3, 4, 8, 7
    pool = torch.randn(pages, Hkv, P, D, generator=gen).cuda()
    ids = torch.randint(0, pages, (B, Hkv, n_groups, K), generator=gen).cuda()
    heads = torch.arange(Hkv).reshape(1, Hkv, 1, 1).expand_as(ids).cuda()
    grad = torch.randn(B * n_groups, Hkv, K * P, D, generator=gen).to(torch.bfloat16).cuda()
    calls = []
    kernel = cudnn_sparse._row_add_kernel()
    monkeypatch.setattr(cudnn_sparse, "_row_add_kernel", lambda: lambda *a: calls.append(1) or kernel(*a))
    got = pool.clone()
    cudnn_sparse.SelectedPagesAttention._add_selected(got, ids, heads, grad)
    want = pool.clone()
    rows = (ids * Hkv + heads).transpose(1, 2).reshape(-1)
    want.view(-1, P * D).index_put_((rows,), grad.reshape(-1, P * D).float(), accumulate=True)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


