"""The Triton row copy (oomb/attention/triton_copy.py) that makes the cuDNN paths' strided views contiguous,
against torch's ``contiguous``. CPU: the Triton interpreter (conftest sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from oomb.attention import cudnn_paged, cudnn_sparse

triton_copy = pytest.importorskip("oomb.attention.triton_copy")

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _views():
    """The views the cuDNN paths copy: transposed queries (B, Hq, L, D) of a (B, L, Hq, D) tensor, the sparse
    path's six-dim group permutation, KV heads expanded per query head (stride 0), a float32 lse permutation,
    a last dim of one."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 37, 6, 24, generator=gen).to(DEVICE, torch.bfloat16).transpose(1, 2)
    grouped = q[:, :, :32].reshape(2, 3, 2, 4, 8, 24).transpose(2, 3).transpose(1, 2)
    kv = torch.randn(2, 3, 37, 24, generator=gen).to(DEVICE, torch.bfloat16)
    lse = torch.randn(2, 6, 32, generator=gen).to(DEVICE).reshape(2, 3, 2, 4, 8).transpose(2, 3)
    column = torch.randn(5, 7, 1, generator=gen).to(DEVICE).transpose(0, 1)
    return {"transposed": q, "groups": grouped, "expanded": kv[:, :, None].expand(2, 3, 2, 37, 24),
            "lse": lse, "column": column}


@pytest.mark.parametrize("name", ["transposed", "groups", "expanded", "lse", "column"])
def test_contiguous_rows_is_torchs_contiguous(name):
    x = _views()[name]
    got = triton_copy.contiguous_rows(x)
    assert got.is_contiguous() and got.dtype == x.dtype and torch.equal(got, x.contiguous())


def test_contiguous_rows_refuses_what_it_cannot_copy():
    x = torch.zeros(2, 3, 4, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous last dim"):
        triton_copy.contiguous_rows(x.transpose(1, 2))
    with pytest.raises(ValueError, match="at most 6 dims"):
        triton_copy.contiguous_rows(torch.zeros((1,) * 7 + (4,), device=DEVICE))


def test_layouts_take_the_kernel_on_cuda_only(monkeypatch):
    """cudnn_paged.contiguous: torch's copy on the CPU, the kernel for CUDA views with a contiguous last dim;
    contiguous tensors are returned as they are; OOMB_COPY_KERNEL=0 (COPY_KERNEL) keeps torch's copy. The
    sparse layout and the repeated heads give the values torch's reshapes and repeat_interleave give."""
    calls = []
    real = cudnn_paged._copy_kernel()
    monkeypatch.setattr(cudnn_paged, "_copy_kernel", lambda: lambda x: calls.append(x.shape) or real(x))
    views = _views()
    assert cudnn_paged.contiguous(views["transposed"]).is_contiguous()
    kv = views["expanded"][:, :, 0]
    assert cudnn_paged.contiguous(kv) is kv
    assert torch.equal(cudnn_paged._repeat_heads(kv, 2), kv.repeat_interleave(2, dim=1))
    assert len(calls) == (2 if DEVICE == "cuda" else 0)
    q = views["transposed"][:, :, :32]
    layout = cudnn_sparse._Layout([(i, i + 1) for i in range(4)], 32, 8, q.device)
    grouped = layout.to_groups(q, 3)
    want = q.reshape(2, 3, 2, 4, 8, 24).transpose(2, 3).transpose(1, 2).reshape(8, 3, 16, 24)
    assert torch.equal(grouped, want) and torch.equal(layout.from_groups(grouped, 2, 6), q)
    monkeypatch.undo()
    monkeypatch.setattr(cudnn_paged, "COPY_KERNEL", False)
    cudnn_paged._copy_kernel.cache_clear()
    try:
        assert cudnn_paged._copy_kernel() is None
    finally:
        cudnn_paged._copy_kernel.cache_clear()
