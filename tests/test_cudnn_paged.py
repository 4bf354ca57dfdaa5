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

from oomb.attention import cudnn_paged, cudnn_sparse, reference, reference_sparse
from oomb.config import OffloadConfig, OOMBConfig, SparseConfig


def _scores(q, k, causal, scale):
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _strict(*tensors):
    """What torch's cuDNN path needs and the stand-in would not otherwise notice."""
    for t in tensors:
        assert t.is_contiguous() and t.numel() > 0, f"kernel input {tuple(t.shape)} strides {t.stride()}"


def _math_forward(q, k, v, causal, scale):
    _strict(q, k, v)
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - lse[..., None]) @ v.float()).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal, scale):
    _strict(dout, q, k, v, out, lse)
    p = torch.exp(_scores(q, k, causal, scale) - lse[..., None])
    dout = dout.float()
    ds = p * (dout @ v.float().transpose(-1, -2) - (dout * out.float()).sum(-1, keepdim=True))
    grads = (ds @ k.float()) * scale, (ds.transpose(-1, -2) @ q.float()) * scale, p.transpose(-1, -2) @ dout
    return tuple(g.to(q.dtype) for g in grads)  # as cuDNN: in the inputs' dtype


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


def _grouped_math_forward(q, k, v, causal, scale):
    """The stand-in's forward taking fewer KV heads than query heads, as cuDNN's does (repeats inside)."""
    _strict(q, k, v)
    G = q.shape[1] // k.shape[1]
    GROUPED_CALLS.append((causal, q.shape[1], k.shape[1]))
    return _math_forward(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), causal, scale)


GROUPED_CALLS: list[tuple[bool, int, int]] = []
"""(causal, query heads, KV heads) of each forward call of the grouped stand-in."""


@pytest.mark.parametrize("B,Hq,Hkv,Lq,history,D,P", [CASES[1], CASES[3]])
def test_chunk_window_passes_kv_heads_as_they_are_to_a_grouped_forward(B, Hq, Hkv, Lq, history, D, P):
    """A kernel whose forward takes grouped heads (FusedKernel.grouped_forward, cuDNN's) gets the chunk's own
    K and V without the repeat: the same out and lse; the backward still repeats them."""
    c = make_case(B, Hq, Hkv, Lq, history, D, P, device="cpu")
    declined = cudnn_paged.WindowedAttention(cudnn_paged.FusedKernel(
        _grouped_math_forward, _math_backward, (torch.float32,), grouped_forward=lambda device, dtype: False))
    GROUPED_CALLS.clear()
    declined.paged_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale)
    assert [call for call in GROUPED_CALLS if call[0]] == [(True, Hq, Hq)]  # the chunk's own window, repeated
    grouped = cudnn_paged.WindowedAttention(cudnn_paged.FusedKernel(
        _grouped_math_forward, _math_backward, (torch.float32,), grouped_forward=lambda device, dtype: True))
    GROUPED_CALLS.clear()
    out, lse = grouped.paged_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale)
    assert [call for call in GROUPED_CALLS if call[0]] == [(True, Hq, Hkv)]  # with its KV heads as they are
    want_out, want_lse = MATH.paged_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    for name, g, w in zip(("dq", "dk", "dv"), _backward(grouped, c, out, lse), _backward(MATH, c, out, lse),
                          strict=True):
        assert torch.equal(g, w), name


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


def _assert_within_twice_reference(got, ref, want) -> None:
    """(out, lse, dq, dk, dv) from bf16 inputs: ours within twice the reference backend's error on the
    same bf16 inputs against float32 on the unrounded ones, plus a margin far below bf16 resolution."""
    for name, g, r, w in zip(("out", "lse", "dq", "dk", "dv"), got, ref, want, strict=True):
        ours, theirs = _max_err(g, w), _max_err(r, w)
        eps = 1e-4 * w.abs().max().item()
        print(f"cudnn bf16 error {name}: ours {ours:.3e}, reference on bf16 inputs {theirs:.3e}")
        assert ours <= 2 * theirs + eps, f"{name}: ours {ours:.3e} vs reference-on-bf16 {theirs:.3e}"


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

    _assert_within_twice_reference(run(cudnn, low), run(reference, low), run(reference, exact))


@pytest.mark.gpu
def test_gpu_cudnn_forward_takes_grouped_heads_with_the_repeated_heads_bits():
    """torch's cuDNN forward takes 4 KV heads for 28 query heads (the 7B's groups): the chunk's causal window
    gives the repeated heads' out and lse bit for bit, and the grouped path is the one taken."""
    device = torch.device("cuda")
    assert cudnn_paged._cudnn_takes_grouped_heads(device)
    gen = torch.Generator(device=device).manual_seed(3)
    q = torch.randn((1, 28, 512, 128), generator=gen, device=device).to(torch.bfloat16)
    k, v = (torch.randn((1, 4, 512, 128), generator=gen, device=device).to(torch.bfloat16) for _ in range(2))
    grouped = cudnn_paged._cudnn_forward(q, k, v, True, 128 ** -0.5)
    repeated = cudnn_paged._cudnn_forward(q, k.repeat_interleave(7, 1), v.repeat_interleave(7, 1), True, 128 ** -0.5)
    assert all(torch.equal(a, b) for a, b in zip(grouped, repeated, strict=True))


# Sparse: the selected-pages path (oomb/attention/cudnn_sparse.py) on the same stand-in kernel.
SPARSE_MATH = cudnn_sparse.SelectedPagesAttention(MATH.kernel)


def assert_step_matches_torch(monkeypatch, stand_in, model, ids, config, **step_kwargs) -> None:
    """A whole step through ``stand_in`` (the cudnn backend's code on a stand-in kernel) equals the torch
    backend's: the loss to 1e-5, the gradients to 1e-5 relative error (offload on unpinned host slabs)."""
    from helpers import grads, relative_error

    import oomb
    import oomb.engine
    from oomb.attention.backend import TORCH_BACKEND
    from oomb.kv.offload import HostSlabs

    results = {}
    for name, backend in (("torch", TORCH_BACKEND), ("stand-in", stand_in)):
        monkeypatch.setattr(oomb.engine, "select_backend", lambda *_, b=backend, **__: b)
        model.zero_grad(set_to_none=True)
        slabs = HostSlabs(pin=False) if config.offload.enabled else None
        results[name] = (oomb.forward_backward(model, ids, None, config, host_slabs=slabs, **step_kwargs),
                         grads(model))
    torch.testing.assert_close(results["stand-in"][0], results["torch"][0], rtol=1e-5, atol=0)
    assert relative_error(results["stand-in"][1], results["torch"][1]) <= 1e-5


def _grouped(selection: torch.Tensor, group: int) -> torch.Tensor:
    """Every run of ``group`` blocks takes its first block's selection, as sparse_query_block_pages does."""
    n = selection.shape[2]
    return selection[:, :, ::group].repeat_interleave(group, dim=2)[:, :, :n].contiguous()


# (B, Hq, Hkv, Lq, history pages, D, P, K, blocks per selection group): per-block selections, groups
# of 2 and 3 blocks with a partial last group and a partial last block, one group for the chunk, no
# selected page, one query.
SPARSE_CASES = [
    pytest.param(2, 4, 2, 40, 5, 16, 16, 2, 1, id="per-block"),
    pytest.param(1, 8, 2, 70, 6, 16, 8, 3, 2, id="groups-of-2"),
    pytest.param(2, 4, 1, 45, 4, 16, 8, 2, 3, id="groups-of-3-partial"),
    pytest.param(1, 4, 2, 64, 4, 16, 16, 3, 4, id="one-group"),
    pytest.param(2, 4, 2, 70, 6, 16, 8, 2, 6, id="uneven-6-3-partial"),
    pytest.param(1, 4, 2, 20, 3, 16, 16, 0, 1, id="K0"),
    pytest.param(2, 4, 2, 1, 6, 16, 16, 3, 1, id="one-query"),
]


@pytest.mark.parametrize("B,Hq,Hkv,Lq,history_pages,D,P,K,group", SPARSE_CASES)
def test_selected_pages_match_sparse_reference(B, Hq, Hkv, Lq, history_pages, D, P, K, group):
    from test_triton_sparse import make_case as make_sparse_case

    c = make_sparse_case(B, Hq, Hkv, Lq, history_pages, D, P, K)
    c.selection = _grouped(c.selection, group)
    want_out, want_lse = reference_sparse.sparse_attention_forward(*c.args())
    out, lse = SPARSE_MATH.sparse_attention_forward(*c.args())
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5)
    start = torch.randn(c.k_pool.shape, generator=torch.Generator().manual_seed(1)).to(c.q.device)
    results = {}
    for name, impl in (("ours", SPARSE_MATH), ("reference", reference_sparse)):
        dk, dv = start.clone(), -start
        dq = impl.sparse_attention_backward(*c.args(), want_out, c.dout, want_lse, dk, dv)
        results[name] = (dq, dk, dv)
    for label, g, w in zip(("dq", "dk", "dv"), results["ours"], results["reference"], strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=label)


def test_selection_groups():
    sel = torch.tensor([[[[0, 1], [0, 1], [2, 3], [2, 3], [2, 3]]]], dtype=torch.int32)  # (1, 1, 5, 2)
    assert cudnn_sparse._groups(sel) == [(0, 2), (2, 5)]
    other_head = torch.cat([sel, sel.flip(2)], dim=1)  # groups must agree across heads
    assert cudnn_sparse._groups(other_head) == [(0, 2), (2, 3), (3, 5)]
    assert cudnn_sparse._by_length([(0, 2), (2, 3), (3, 5), (5, 6)]) == [[(0, 2), (3, 5)], [(2, 3), (5, 6)]]


def test_one_selection_expanded_over_the_blocks_is_one_group_unread(monkeypatch):
    """A stride-0 selection (one group covers the chunk) is one group; its values are never compared
    (on a GPU that comparison is a device synchronisation per call)."""
    sel = torch.tensor([[[[0, 3]]]], dtype=torch.int32).expand(1, 1, 5, 2)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("the selection was read"))
    assert cudnn_sparse._groups(sel) == [(0, 5)]


def test_one_group_of_the_whole_chunk_is_a_reshape():
    """One selection per chunk (one group of exactly the chunk's queries) skips the padding and gathers:
    the same layout as the general path."""
    x = torch.randn(2, 6, 64, 8)  # (B, Hq, Lq, D), 3 KV heads
    whole = cudnn_sparse._Layout([(0, 4)], 64, 16, x.device)
    general = cudnn_sparse._Layout([(0, 4)], 64, 16, x.device)
    general.whole = False
    assert whole.whole and not cudnn_sparse._Layout([(0, 4)], 60, 16, x.device).whole
    for t in (x, x[..., 0]):
        grouped = whole.to_groups(t, 3)
        torch.testing.assert_close(grouped, general.to_groups(t, 3), rtol=0, atol=0)
        torch.testing.assert_close(whole.from_groups(grouped, 2, 6), general.from_groups(grouped, 2, 6), rtol=0, atol=0)


@pytest.mark.parametrize("query_block_pages, offload, batch", [(1, False, 2), (2, False, 2), (2, True, 2),
                                                                 (4, True, 1), (4, False, 2)])
def test_sparse_engine_on_the_stand_in_matches_the_torch_backend(monkeypatch, query_block_pages, offload, batch):
    """A whole sparse step through the cudnn backend's code (stand-in kernel) equals the torch backend's."""
    from helpers import build_tiny_model, random_ids

    from oomb.attention.backend import AttentionBackend

    model = build_tiny_model("qwen2", seed=41, num_hidden_layers=2)
    ids = random_ids(batch, 96, seed=41)  # chunks of 32 in pages of 8: 4, 8 history pages, budget 2 + 1 sink
    stand_in = AttentionBackend("stand-in", MATH.paged_attention_forward, MATH.paged_attention_backward,
                                cudnn_paged.no_delta, SPARSE_MATH.sparse_attention_forward,
                                SPARSE_MATH.sparse_attention_backward)
    config = OOMBConfig(chunk_size=32, page_size=8, attention="sparse",
                        sparse=SparseConfig(budget=2, query_block_pages=query_block_pages),
                        offload=OffloadConfig(enabled=offload))
    assert_step_matches_torch(monkeypatch, stand_in, model, ids, config)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 8], ids=["per-block", "one-group"])
def test_gpu_cudnn_sparse_bf16_error_within_twice_reference(group):
    """cuDNN's selected-pages attention in bf16 vs the float32 sparse reference, bounded as above."""
    from test_triton_sparse import make_case as make_sparse_case

    exact = make_sparse_case(1, 28, 4, 1024, 64, 128, 128, 17)  # 8 query blocks, 17 of 64 pages
    exact = type(exact)(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in vars(exact).values()))
    exact.selection = _grouped(exact.selection, group)
    low = type(exact)(*(t.bfloat16() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                        for t in vars(exact).values()))
    cudnn = cudnn_sparse.SelectedPagesAttention()

    def run(impl, c):
        out, lse = impl.sparse_attention_forward(*c.args())
        dk = torch.zeros(c.k_pool.shape, dtype=torch.float32, device="cuda")
        dv = torch.zeros_like(dk)
        dq = impl.sparse_attention_backward(*c.args(), out, c.dout, lse, dk, dv)
        return out, lse, dq, dk, dv

    _assert_within_twice_reference(run(cudnn, low), run(reference_sparse, low), run(reference_sparse, exact))


def test_cudnn_errors_name_the_shapes_and_the_way_out():
    """On this CPU torch the cuDNN op itself refuses; the message says what was asked and what to use."""
    q = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"(?s)forward refused q \(1, 2, 8, 16\).*backend='triton'"):
        cudnn_paged.CUDNN_KERNEL.forward(q, q, q, False, 0.25)


def test_out_of_memory_inside_cudnn_stays_out_of_memory():
    """`oomb bench` reports an out-of-memory step as a result; the error must keep its type."""
    q = torch.zeros(1, 1, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(torch.OutOfMemoryError), cudnn_paged._explained("forward", q, q):
        raise torch.OutOfMemoryError("CUDA out of memory")


def test_empty_inputs_never_reach_cudnn():
    q = torch.zeros(1, 2, 0, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="empty"):
        cudnn_paged.CUDNN_KERNEL.forward(q, q, q, True, 0.25)
    c = make_case(1, 4, 2, 8, 16, 16, 16, device="cpu")
    empty_q = c.q[:, :, :0]
    sel = torch.zeros((1, 2, 0, 1), dtype=torch.int32)
    out, lse = SPARSE_MATH.sparse_attention_forward(empty_q, c.k_pool, c.v_pool, c.page_table, 16, c.scale, sel)
    assert out.shape == empty_q.shape and lse.shape == (1, 4, 0)


# --- packed documents: segments of plain causal attention ------------------------------------------
# Segments shorter than 2 (one-token documents) take the short-segment kernel (plain torch), the others
# the stand-in, as calls under cudnn_paged.SHORT_SEGMENT leave cuDNN.
DOC_MATH = cudnn_paged.WindowedAttention(MATH.kernel, short_segment=2)

def test_document_segments_cut_the_chunk_at_document_starts():
    from oomb.documents import resolve_documents

    docs = resolve_documents(None, [[0, 9, 21, 22, 33, 40], [0, 11, 12, 37, 40]], (2, 40), torch.device("cpu"))
    assert cudnn_paged.document_segments(docs, 16, 24) == [
        [(0, 5, 9), (5, 6, 21), (6, 17, 22), (17, 24, 33)],  # the first document began before the chunk
        [(0, 21, 12), (21, 24, 37)],
    ]


def test_windowed_documents_match_the_oracle_and_read_no_earlier_page():
    """Per-row segments on the stand-in kernel vs autograd through masked attention: forward, key
    windows (one before every document: lse -inf), dQ, dK, dV; the V pages before every document are
    NaN, so reading one would show."""
    from test_documents import _check_backend, _kernel_case

    _check_backend(DOC_MATH, *_kernel_case(seed=2))
    _check_backend(MATH, *_kernel_case(seed=2))  # every segment of this case on the short-segment kernel


@pytest.mark.parametrize("steps", [(1, 1), (3, 5), (4, 8), (16, 16)])
def test_documents_padded_and_cut_to_few_shapes_are_exact(steps):
    """Segments and history queries padded with zeros to a multiple of shape_step, history keys cut at the next
    multiples of shape_step and history_step (page-aligned or not): the oracle's forward, dQ, dK, dV, and no
    earlier page read; the stand-in kernel sees only query and key lengths that are multiples of shape_step."""
    from test_documents import _check_backend, _kernel_case

    shape_step, history_step = steps
    seen = []

    def forward(q, k, v, causal, scale):
        seen.append((q.shape[2], k.shape[2], causal))
        return MATH.kernel.forward(q, k, v, causal, scale)

    kernel = cudnn_paged.FusedKernel(forward, MATH.kernel.backward, (torch.float32,))
    module = cudnn_paged.WindowedAttention(kernel, short_segment=2, shape_step=shape_step, history_step=history_step)
    _check_backend(module, *_kernel_case(seed=2))
    assert seen and all(q % shape_step == 0 for q, _, _ in seen)  # folded rows: a multiple of the padded length
    assert all(k % shape_step == 0 for _, k, _ in seen)  # a piece under shape_step keys runs on the short kernel


@pytest.mark.parametrize("offload", [False, True])
def test_documents_engine_on_the_stand_in_matches_the_torch_backend(monkeypatch, offload):
    """A whole dense step with packed documents (two rows, other boundaries; documents starting inside
    pages and chunks, one-token documents) through the cudnn backend's code equals the torch backend's."""
    from helpers import build_tiny_model, random_ids

    from oomb.attention.backend import AttentionBackend

    model = build_tiny_model("qwen2", seed=42)
    ids = random_ids(2, 150, seed=42)
    cu = [[0, 13, 14, 15, 75, 115, 150], [0, 70, 75, 76, 142, 150]]
    cut = cudnn_paged.WindowedAttention(MATH.kernel, short_segment=2, shape_step=4, history_step=16)
    stand_in = AttentionBackend("stand-in", cut.paged_attention_forward, cut.paged_attention_backward,
                                cudnn_paged.no_delta, whole_history=True)
    config = OOMBConfig(chunk_size=32, page_size=8, offload=OffloadConfig(stream_block_pages=2, enabled=offload))
    assert_step_matches_torch(monkeypatch, stand_in, model, ids, config, cu_seqlens=cu)


@pytest.mark.parametrize("offload", [False, True])
def test_sparse_documents_engine_on_the_stand_in_matches_the_torch_backend(monkeypatch, offload):
    """A whole sparse step with packed documents and one selection per chunk through the cudnn backend's code
    equals the torch backend's: documents shorter than the selection (read whole, unscored), longer ones (their
    first page a sink; with offload staged as (page, head) rows numbered from it), documents starting inside
    pages and chunks."""
    from helpers import build_tiny_model, random_ids

    from oomb.attention.backend import AttentionBackend
    from oomb.kv.offload import OffloadedKVStore

    model = build_tiny_model("qwen2", seed=43)
    ids = random_ids(2, 200, seed=43)
    cu = [[0, 13, 14, 84, 128, 200], [0, 100, 109, 200]]
    windowed = cudnn_paged.WindowedAttention(MATH.kernel, short_kernel=MATH.kernel)
    selected = cudnn_sparse.SelectedPagesAttention(MATH.kernel, windowed)
    stand_in = AttentionBackend("stand-in", windowed.paged_attention_forward, windowed.paged_attention_backward,
                                cudnn_paged.no_delta, selected.sparse_attention_forward,
                                selected.sparse_attention_backward, whole_history=True, sparse_block_group=True)
    config = OOMBConfig(chunk_size=32, page_size=8, attention="sparse",
                        sparse=SparseConfig(budget=2, sink_pages=1, read_share=None, query_block_pages=4),
                        offload=OffloadConfig(enabled=offload))
    numbered = []
    real = OffloadedKVStore._head_row_layout

    def recording(self, index, layer, chunk, pages, first_pages=None):
        numbered.append(first_pages is not None)
        return real(self, index, layer, chunk, pages, first_pages)

    monkeypatch.setattr(OffloadedKVStore, "_head_row_layout", recording)
    assert_step_matches_torch(monkeypatch, stand_in, model, ids, config, cu_seqlens=cu)
    assert any(numbered) == offload


@pytest.mark.gpu
def test_gpu_cudnn_documents_bf16_error_within_twice_reference():
    """The segments on cuDNN in bf16 (documents starting inside pages and before the chunk, a one-token
    document, rows with other boundaries) within twice the reference backend's bf16 error."""
    from oomb.documents import resolve_documents

    exact = make_case(2, 8, 2, 300, 256, 128, 64, torch.float32, device="cuda")
    low = exact.at(torch.bfloat16)
    docs = resolve_documents(None, [[0, 100, 301, 302, 420, 556], [0, 250, 251, 556]], (2, 556),
                             torch.device("cuda"))
    cudnn = cudnn_paged.WindowedAttention()

    def run(impl, c):
        out, lse = impl.paged_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale,
                                                documents=docs)
        dk = torch.zeros(c.k_pool.shape, dtype=torch.float32, device="cuda")
        dv = torch.zeros_like(dk)
        dq = impl.paged_attention_backward(c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale, out, c.dout,
                                           lse, dk, dv, documents=docs)
        return out, lse, dq, dk, dv

    _assert_within_twice_reference(run(cudnn, low), run(reference, low), run(reference, exact))


def test_selected_pages_gather_whole_rows_as_advanced_indexing_does():
    """The row gather of a contiguous pool and advanced indexing of any pool give the same layout."""
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(9, 3, 4, 5, generator=g)  # (pages, Hkv, P, D)
    ids = torch.randint(0, 9, (2, 3, 4, 6), generator=g)  # (B, Hkv, n_groups, K), repeats allowed
    heads = torch.arange(3).reshape(1, 3, 1, 1).expand_as(ids)
    fast = cudnn_sparse.SelectedPagesAttention._selected(pool, ids, heads)
    strided = torch.randn(9, 4, 3, 5, generator=g).transpose(1, 2)  # not contiguous: advanced indexing
    strided.copy_(pool)
    assert not strided.is_contiguous()
    want = pool[ids, heads].transpose(1, 2).reshape(2 * 4, 3, 6 * 4, 5)
    assert fast.is_contiguous() and torch.equal(fast, want)
    assert torch.equal(cudnn_sparse.SelectedPagesAttention._selected(strided, ids, heads), want)
