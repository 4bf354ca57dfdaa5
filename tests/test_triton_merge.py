"""The Triton merge of two partial attentions (oomb/attention/triton_merge.py) vs reference.merge_window, and
the cuDNN paths' use of it (cudnn_paged.merge_into). CPU: the Triton interpreter (conftest sets
TRITON_INTERPRET=1); GPU: the compiled kernel."""

from __future__ import annotations

import pytest
import torch

from oomb.attention import cudnn_paged
from oomb.attention.reference import merge_window

triton_merge = pytest.importorskip("oomb.attention.triton_merge")

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _partials(dtype, B=2, H=3, L=37, D=24, seed=0):
    """Two partial attentions; some rows saw no key in one part, two rows none in either (packed documents)."""
    gen = torch.Generator().manual_seed(seed)
    out_a, out_b = (torch.randn(B, H, L, D, generator=gen).to(DEVICE, dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(B, H, L, generator=gen).mul(4).to(DEVICE) for _ in range(2))
    lse_a[0, 0, :5] = float("-inf")
    lse_b[1, 2, 7:9] = float("-inf")
    lse_a[1, 1, 20:22] = lse_b[1, 1, 20:22] = float("-inf")
    out_a[0, 0, :5] = 0  # what a part that saw no key returns
    out_b[1, 2, 7:9] = 0
    out_a[1, 1, 20:22] = out_b[1, 1, 20:22] = 0
    return out_a, lse_a, out_b, lse_b


@pytest.mark.parametrize("dtype, out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)])
def test_merge_pair_is_merge_window(dtype, out_dtype):
    """Float32 arithmetic on the inputs as they are, one rounding to the output's dtype; empty rows stay empty
    (out 0, lse -inf), a row empty on one side is the other side's."""
    parts = _partials(dtype)
    out, lse = triton_merge.merge_pair(*parts, out_dtype)
    want_out, want_lse = merge_window(*parts)
    assert out.dtype == out_dtype and out.is_contiguous() and lse.dtype == torch.float32
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    if out_dtype == torch.float32:
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    else:  # one bf16 rounding of values within a few float32 ulps: at most one bf16 ulp apart
        torch.testing.assert_close(out, want_out.to(out_dtype), rtol=2 ** -7, atol=1e-6)
    assert torch.isneginf(lse[1, 1, 20:22]).all() and not out[1, 1, 20:22].any()
    torch.testing.assert_close(out[0, 0, :5].float(), parts[2][0, 0, :5].float(), rtol=1e-6, atol=0)


def test_merge_pair_reads_strided_inputs():
    """Inputs with a contiguous last dim and other strides (the sparse path's grouped views): the same result
    as their contiguous copies."""
    out_a, lse_a, out_b, lse_b = _partials(torch.bfloat16, L=40)
    strided_a = out_a.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, L, D) with heads inside rows
    strided_lse = lse_b.transpose(1, 2).contiguous().transpose(1, 2)[..., :40]
    assert not strided_a.is_contiguous()
    got = triton_merge.merge_pair(strided_a, lse_a, out_b, lse_b.clone(), torch.bfloat16)
    want = triton_merge.merge_pair(out_a, lse_a, out_b, lse_b, torch.bfloat16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if strided_lse.stride(-1) != 1:
        with pytest.raises(ValueError, match="contiguous last dim"):
            triton_merge.merge_pair(out_a, lse_a, out_b, strided_lse, torch.bfloat16)


def test_merge_pair_refuses_what_it_cannot_merge():
    out_a, lse_a, out_b, lse_b = _partials(torch.float32)
    with pytest.raises(ValueError, match="two \\(B, H, L, D\\) outs"):
        triton_merge.merge_pair(out_a, lse_a, out_b[:, :, :-1], lse_b, torch.float32)
    with pytest.raises(TypeError, match="float32"):
        triton_merge.merge_pair(out_a, lse_a.double(), out_b, lse_b, torch.float32)


def test_merge_into_takes_the_kernel_on_cuda_only(monkeypatch):
    """cudnn_paged.merge_into: merge_window and a cast on the CPU (the same bits), the kernel for CUDA tensors."""
    parts = _partials(torch.bfloat16)
    calls = []
    monkeypatch.setattr(cudnn_paged, "_merge_kernel", lambda: lambda *a: calls.append(a) or "kernel")
    got = cudnn_paged.merge_into(*parts, torch.bfloat16)
    if DEVICE == "cpu":
        want_out, want_lse = merge_window(*parts)
        assert not calls and torch.equal(got[0], want_out.to(torch.bfloat16)) and torch.equal(got[1], want_lse)
    else:
        assert got == "kernel" and len(calls) == 1
