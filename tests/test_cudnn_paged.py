"""The cudnn backend's windowing (oomb/attention/cudnn_paged.py) vs the reference backend.

CPU: the windowing, grouped-query folding, page gathers and gradient scatters run on a plain-torch
stand-in for the fused kernel (same contract: equal head counts, top-left causal, backward with the
merged out and lse), so everything but cuDNN itself is checked here in float32.
GPU (``-m gpu``): the real cuDNN kernels in bf16, against an fp32 reference with the error bound of
test_triton_paged.py.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_paged import GPU_CASES, _max_err, make_case

from oomb.attention import cudnn_paged, reference


def _scores(q, k, causal, scale):
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _math_forward(q, k, v, causal, scale):
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - lse[..., None]) @ v.float()).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal, scale):
    p = torch.exp(_scores(q, k, causal, scale) - lse[..., None])
    dout = dout.float()
    ds = p * (dout @ v.float().transpose(-1, -2) - (dout * out.float()).sum(-1, keepdim=True))
    return (ds @ k.float()) * scale, (ds.transpose(-1, -2) @ q.float()) * scale, p.transpose(-1, -2) @ dout


MATH = cudnn_paged.WindowedAttention(cudnn_paged.FusedKernel(_math_forward, _math_backward, (torch.float32,)))

# (B, Hq, Hkv, Lq, history, D, P): GQA 1/2/4/7, no history, partial last pages, one query.
CASES = [
    pytest.param(2, 2, 2, 24, 0, 16, 16, id="G1-nohistory"),
    pytest.param(2, 4, 2, 24, 48, 16, 16, id="G2-hist48"),
    pytest.param(2, 8, 2, 17, 64, 32, 32, id="G4-partial-page"),
    pytest.param(1, 7, 1, 13, 36, 24, 12, id="G7-D24-P12"),
    pytest.param(2, 4, 2, 1, 48, 16, 16, id="one-query"),
]


def _backward(impl, c, out, lse, **kw):
    """dq and the page buffers after one backward; the buffers start non-zero (they already hold
    later chunks' sums), so adding, not overwriting, is checked."""
    dk = torch.randn(c.k_pool.shape, generator=torch.Generator().manual_seed(5), device=c.q.device)
    dv = -dk
    dq = impl.paged_attention_backward(c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale, out, c.dout, lse,
                                       dk, dv, **kw)
    return dq, dk, dv


@pytest.mark.parametrize("B,Hq,Hkv,Lq,history,D,P", CASES)
def test_windowed_matches_reference(B, Hq, Hkv, Lq, history, D, P):
    c = make_case(B, Hq, Hkv, Lq, history, D, P, device="cpu")
    want_out, want_lse = reference.paged_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale)
    out, lse = MATH.paged_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale)
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5)
    got = _backward(MATH, c, want_out, want_lse)
    want = _backward(reference, c, want_out, want_lse)
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=name)


def test_key_windows_sum_to_the_whole():
    """Offload's streaming: history windows and the local window, merged in forward and each run with
    the merged statistics in backward, equal the single call."""
    c = make_case(2, 8, 2, 20, 96, 16, 16, device="cpu")
    args = (c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale)
    windows = [(0, 32), (32, 96), (96, 116)]
    out = lse = None
    for w in windows:
        o, s = MATH.paged_attention_forward(*args, key_range=w, out_dtype=torch.float32)
        out, lse = (o, s) if out is None else reference.merge_window(out, lse, o, s)
    whole_out, whole_lse = MATH.paged_attention_forward(*args)
    torch.testing.assert_close(out, whole_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, whole_lse, atol=2e-5, rtol=2e-5)
    dq = torch.zeros(c.q.shape)
    dk = torch.randn(c.k_pool.shape, generator=torch.Generator().manual_seed(5))
    dv = -dk
    for w in windows:
        MATH.paged_attention_backward(*args, whole_out, c.dout, whole_lse, dk, dv, key_range=w, dq_accumulator=dq)
    want = _backward(reference, c, whole_out, whole_lse)
    for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=name)


def test_rejects_what_the_kernel_cannot_take():
    c = make_case(1, 4, 2, 8, 16, 16, 16, device="cpu")
    args = (c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale)
    with pytest.raises(TypeError, match="one dtype"):
        cudnn_paged.WindowedAttention().paged_attention_forward(*args)  # float32: cuDNN takes bf16/fp16
    with pytest.raises(ValueError, match="key_range"):
        MATH.paged_attention_forward(*args, key_range=(0, 8))  # not on a page boundary
    out, lse = MATH.paged_attention_forward(*args)
    with pytest.raises(ValueError, match="merged out"):
        MATH.paged_attention_backward(*args, None, c.dout, lse, torch.zeros(c.k_pool.shape),
                                      torch.zeros(c.k_pool.shape), delta=reference.backward_delta(out, c.dout))


def test_select_backend_cudnn_needs_cuda():
    from oomb.attention.backend import select_backend

    with pytest.raises(ValueError, match="CUDA"):
        select_backend("cudnn", torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv,D,P,history,Lq", GPU_CASES)
def test_gpu_cudnn_bf16_error_within_twice_reference(Hq, Hkv, D, P, history, Lq):
    """The bound of test_triton_paged.py: our bf16 error at most twice the reference backend's own
    error on the same bf16 inputs (plus a margin far below bf16 resolution)."""
    exact = make_case(2, Hq, Hkv, Lq, history, D, P, torch.float32, device="cuda")
    low = exact.at(torch.bfloat16)
    cudnn = cudnn_paged.WindowedAttention()

    def run(impl, c):
        out, lse = impl.paged_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale)
        dk = torch.zeros(c.k_pool.shape, dtype=torch.float32, device="cuda")
        dv = torch.zeros_like(dk)
        dq = impl.paged_attention_backward(c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale, out, c.dout,
                                           lse, dk, dv)
        return out, lse, dq, dk, dv

    want, ref, got = run(reference, exact), run(reference, low), run(cudnn, low)
    for name, g, r, w in zip(("out", "lse", "dq", "dk", "dv"), got, ref, want, strict=True):
        ours, theirs = _max_err(g, w), _max_err(r, w)
        eps = 1e-4 * w.abs().max().item()
        print(f"cudnn bf16 error {name}: ours {ours:.3e}, reference on bf16 inputs {theirs:.3e}")
        assert ours <= 2 * theirs + eps, f"{name}: ours {ours:.3e} vs reference-on-bf16 {theirs:.3e}"
