"""Sliding windows on the cudnn backend: the band path (oomb/attention/cudnn_band.py).

CPU: the band's tiles, reversed causal squares, folded history calls, remainders and page scatters run on
the float32 stand-in kernel of test_cudnn_paged.py and are compared, per key window, with the torch
reference backend given the same window bounds (documents.window_bounds), forward (out, lse) and
backward (dQ share, dK and dV added into the pages), to 1e-5. Pages wholly before every query's window
hold NaN: reading one would show. Windows of 1 (a query sees itself), 2, 6, 17, 37 (one remainder
row), 40, 63 tokens and one longer than the context; chunks of 37 and 64 queries at 0, 48 and 96 (tiles
of W - 1 that do not divide them); GQA (4 query heads, 2 KV heads), batch 2; history as one window and
in blocks of 1 and 2 pages (as offload streams it). Sinks wrap the band; whole gemma3_text, gpt_oss and
mistral steps (dense, sparse, offloaded) through the backend's code equal the torch backend's.
GPU (``-m gpu``): the band on real cuDNN in bf16 against the reference, and bf16 steps of gemma3_text,
gpt_oss and mistral on backend "cudnn" against the torch backend's error (never run yet: pending on the
H200).
"""

from __future__ import annotations

import pytest
import torch
from test_cudnn_paged import MATH, _assert_within_twice_reference
from test_triton_paged import make_case

from oomb.attention import cudnn_band, cudnn_paged, reference
from oomb.documents import resolve_documents, window_bounds

CPU = torch.device("cpu")
P = 8
ATOL = RTOL = 1e-5
BAND = cudnn_paged.WindowedAttention(MATH.kernel, short_segment=1)
"""Every call on the stand-in kernel (which checks contiguity and non-empty inputs, as cuDNN needs)."""
MIXED = cudnn_paged.WindowedAttention(MATH.kernel, short_segment=8)
"""Calls under 8 rows or keys on the short-segment torch kernel, as SHORT_SEGMENT sends small ones."""


def _case(B, Lq, start, window, seed=0):
    """A chunk of Lq queries at ``start`` over paged keys (pages of 8, shuffled, GQA 4 / 2); the pages
    wholly before the chunk's first window are NaN. Returns the case and the window bounds."""
    c = make_case(B, 4, 2, Lq, start, 16, P, device="cpu", seed=seed)
    unread = max(0, start - window + 1) // P
    c.k_pool[c.page_table[:, :unread].long()] = float("nan")
    c.v_pool[c.page_table[:, :unread].long()] = float("nan")
    return c, window_bounds(None, window, (B, start + Lq), CPU)


def _key_windows(start: int, Lq: int, block_pages: int | None) -> list[tuple[int, int]]:
    """History in blocks of ``block_pages`` pages (None: one window) from 0, then the chunk."""
    block = max(start, 1) if block_pages is None else block_pages * P
    return [(lo, min(lo + block, start)) for lo in range(0, start, block)] + [(start, start + Lq)]


def _run(impl, c, bounds, windows):
    """Per window: forward (out, lse); then the merged forward and, per window with the merged
    statistics, backward into one dQ accumulator and pools that start non-zero."""
    args = (c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale)
    parts = [impl.paged_attention_forward(*args, key_range=w, out_dtype=torch.float32, documents=bounds)
             for w in windows]
    out, lse = reference.merge_partials(*map(list, zip(*parts, strict=True)))
    dk = torch.randn(c.k_pool.shape, generator=torch.Generator().manual_seed(5))
    dv, dq = -dk, torch.zeros(c.q.shape)
    shares = []
    for w in windows:
        before = dq.clone()
        impl.paged_attention_backward(*args, out, c.dout, lse, dk, dv, key_range=w, dq_accumulator=dq,
                                      documents=bounds)
        shares.append(dq - before)
    return parts, (out, lse), shares, (dq, dk, dv)  # the gradient pools hold no NaN: any would show


def _assert_same(got, want, what):
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


WINDOWS = [1, 2, 6, 17, 37, 40, 63, 500]
CHUNKS = [pytest.param(37, 0, id="Lq37-at0"), pytest.param(37, 48, id="Lq37-at48"),
          pytest.param(64, 96, id="Lq64-at96"), pytest.param(1, 48, id="one-query")]


@pytest.mark.parametrize("block_pages", [None, 1, 2], ids=["whole", "page", "2pages"])
@pytest.mark.parametrize("Lq,start", CHUNKS)
@pytest.mark.parametrize("window", WINDOWS)
def test_band_matches_the_reference_per_key_window(window, Lq, start, block_pages):
    c, bounds = _case(2, Lq, start, window)
    assert bounds.window == window
    windows = _key_windows(start, Lq, block_pages)
    want = _run(reference, c, bounds, windows)
    for impl in (BAND, MIXED):
        got = _run(impl, c, bounds, windows)
        for w, (o, s), (wo, ws), share, want_share in zip(windows, got[0], want[0], got[2], want[2], strict=True):
            _assert_same(o, wo, f"out of {w}")
            _assert_same(s, ws, f"lse of {w}")
            _assert_same(share, want_share, f"dq share of {w}")
        for name, g, x in zip(("out", "lse", "dq", "dk", "dv"), (*got[1], *got[3]), (*want[1], *want[3]),
                              strict=True):
            _assert_same(g, x, name)
            assert torch.isfinite(g).all(), name


@pytest.mark.parametrize("window", [6, 40])
def test_band_without_key_range_is_the_merged_windows(window):
    """key_range=None (every key, one call) equals the whole-history window plus the chunk, and the
    dense oracle with the same window."""
    c, bounds = _case(2, 37, 48, window, seed=1)
    args = (c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale)
    out, lse = BAND.paged_attention_forward(*args, documents=bounds)
    want_out, want_lse = reference.paged_attention_forward(*args, documents=bounds)
    _assert_same(out, want_out, "out")
    _assert_same(lse, want_lse, "lse")
    results = {}
    for name, impl in (("band", BAND), ("reference", reference)):
        dk = torch.zeros(c.k_pool.shape)
        dv = torch.zeros_like(dk)
        dq = impl.paged_attention_backward(*args, want_out, c.dout, want_lse, dk, dv, documents=bounds)
        results[name] = dq, dk, dv
    for name, g, w in zip(("dq", "dk", "dv"), results["band"], results["reference"], strict=True):
        _assert_same(g, w, name)


def test_band_rows_cover_what_the_window_shows():
    """_band_rows against the rule it encodes (row i sees key j iff j >= d + i), for windows reaching
    before, into and past a block of keys, and keys starting before the first row's window."""
    for first_query, rows, first_key, keys, window in [(48, 37, 31, 17, 18), (48, 37, 40, 8, 6), (48, 5, 0, 48, 500),
                                                       (48, 37, 0, 48, 17), (96, 64, 88, 8, 17), (96, 3, 40, 8, 60)]:
        f, e, skip = cudnn_band._rows(first_query, rows, first_key, keys, window)
        for i in range(rows):
            for j in range(keys):
                sees = first_key + j > first_query + i - window
                assert sees == (i < f or (f <= i < e and j >= skip + i - f)), (first_query, first_key, window, i, j)


def test_band_tiles_and_their_inverse():
    x = torch.randn(2, 3, 37, 4)
    T, n, r = cudnn_band._tiles(17, 37)
    assert (T, n, r) == (16, 2, 5) and cudnn_band._tiles(1, 37) == (1, 37, 0)
    assert cudnn_band._tiles(500, 37) == (37, 1, 0) and cudnn_band._tiles(37, 37) == (36, 1, 1)
    tiles = cudnn_band._to_tiles(x, T, n)
    assert tiles.shape == (4, 3, 16, 4) and tiles.is_contiguous() and torch.equal(tiles[1, :, 3], x[0, :, 19])
    assert torch.equal(cudnn_band._from_tiles(tiles, 2), x[:, :, :32])
    assert torch.equal(cudnn_band._from_tiles(cudnn_band._to_tiles(x[..., 0], T, n), 2), x[:, :, :32, 0])


def test_windows_inside_packed_documents_are_refused():
    """Bounds of a window cut by documents have no ``window``; the segments path refuses them (their
    first key moves inside a document) instead of computing the wrong attention."""
    docs = resolve_documents(None, [[0, 30, 85]], (1, 85), CPU)
    bounds = window_bounds(docs, 6, (1, 85), CPU)
    assert bounds.window is None
    assert window_bounds(resolve_documents(None, [[0, 85]], (1, 85), CPU), 6, (1, 85), CPU).window == 6
    c = make_case(1, 4, 2, 37, 48, 16, P, device="cpu")
    with pytest.raises(NotImplementedError, match="sliding window cut by packed documents"):
        MATH.paged_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, 48, c.scale, documents=bounds)


@pytest.mark.parametrize("window", [6, 40])
def test_sinks_wrap_the_band_as_the_reference(window):
    """gpt-oss's sinks (attention/variants.py) wrap the band unchanged: folded into the local window's
    (out, lse), their gradient from the merged statistics; per page window, equal to the torch backend."""
    from oomb.attention.backend import TORCH_BACKEND, AttentionBackend
    from oomb.attention.variants import SinkGradient, layer_backend

    c, bounds = _case(2, 37, 48, window, seed=3)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(4))
    band = AttentionBackend("cudnn", BAND.paged_attention_forward, BAND.paged_attention_backward,
                            cudnn_paged.no_delta)
    windows = _key_windows(48, 37, 1)
    results = []
    for base in (TORCH_BACKEND, band):
        sink_grad = SinkGradient()
        backend = layer_backend(base, sinks=sinks, sink_grad=sink_grad)
        args = (c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale)
        out = lse = None
        for w in windows:
            o, s = backend.forward(*args, key_range=w, out_dtype=torch.float32, documents=bounds)
            out, lse = (o, s) if out is None else reference.merge_window(out, lse, o, s)
        dk, dv, dq = torch.zeros(c.k_pool.shape), torch.zeros(c.k_pool.shape), torch.zeros(c.q.shape)
        for w in windows:
            backend.backward(*args, out, c.dout, lse, dk, dv, key_range=w, delta=base.backward_delta(out, c.dout),
                             dq_accumulator=dq, documents=bounds)
        results.append((out, lse, dq, dk, dv, sink_grad.grad))
    assert float(results[0][-1].abs().sum()) > 0
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv", "sinks"), results[1], results[0], strict=True):
        _assert_same(got, want, name)


# --- engine: whole steps through the cudnn backend's code on the stand-in kernel ---------------------
def _stand_in(name: str = "cudnn"):
    from test_cudnn_paged import SPARSE_MATH

    from oomb.attention.backend import AttentionBackend

    return AttentionBackend(name, MIXED.paged_attention_forward, MIXED.paged_attention_backward,
                            cudnn_paged.no_delta, SPARSE_MATH.sparse_attention_forward,
                            SPARSE_MATH.sparse_attention_backward, whole_history=True, sparse_block_group=True)


@pytest.mark.parametrize(("family", "window", "options"), [
    ("gemma3_text", 17, {}),
    ("gpt_oss", 40, {"performance.checkpoint_layers": True}),  # sinks
    # every layer slides, streamed history blocks
    ("mistral", 6, {"offload.stream_block_pages": 2, "offload.enabled": True}),
    ("gemma3_text", 63, {"attention": "sparse", "sparse.budget": 3}),  # windows dense, global layers sparse
    ("gpt_oss", 17, {"attention": "sparse", "sparse.budget": 3, "offload.enabled": True}),
])
def test_window_families_on_the_cudnn_code_equal_the_torch_backend(monkeypatch, family, window, options):
    """A whole step of a window family with the cudnn backend's code (named "cudnn": the engine's checks
    see it as such; the stand-in kernel in place of cuDNN) equals the torch backend's step."""
    from helpers import grads, random_ids, relative_error
    from test_families import CONFIG, build

    import oomb
    import oomb.engine
    from oomb.attention.backend import TORCH_BACKEND
    from oomb.kv.offload import HostSlabs

    model = build(family, seed=21, sliding_window=window)
    ids = random_ids(2, 150, seed=21)
    config = CONFIG.with_options(options)
    results = {}
    for backend in (TORCH_BACKEND, _stand_in()):
        monkeypatch.setattr(oomb.engine, "select_backend", lambda *_, b=backend, **__: b)
        model.zero_grad(set_to_none=True)
        slabs = HostSlabs(pin=False) if config.offload.enabled else None
        results[backend.name] = oomb.forward_backward(model, ids, None, config, host_slabs=slabs), grads(model)
    torch.testing.assert_close(results["cudnn"][0], results["torch"][0], rtol=1e-5, atol=0)
    assert relative_error(results["cudnn"][1], results["torch"][1]) <= 1e-5


def test_cudnn_refuses_windows_with_packed_documents_before_allocating(monkeypatch):
    from helpers import random_ids
    from test_families import CONFIG, build

    import oomb
    import oomb.engine

    monkeypatch.setattr(oomb.engine, "select_backend", lambda *args, **kwargs: _stand_in())
    model = build("gemma3_text", seed=22)
    with pytest.raises(NotImplementedError, match="sliding-window layers within packed documents"):
        oomb.forward_backward(model, random_ids(1, 150, seed=22), None, CONFIG, cu_seqlens=[0, 70, 150])


# --- GPU (H200) ------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("window", [2, 100, 129, 1000, 1024, 5000])
def test_gpu_band_bf16_error_within_twice_reference(window):
    """The band on cuDNN in bf16 (tiles under and over SHORT_SEGMENT, remainders, one remainder row
    (W = the chunk), a window longer than the chunk and than the context) within twice the reference
    backend's bf16 error: history as one window and in blocks of 8 pages (as offload streams it),
    merged, then backward per window with the merged statistics."""
    start, Lq, P_gpu = 2048, 1000, 64
    exact = make_case(2, 8, 2, Lq, start, 128, P_gpu, torch.float32, device="cuda")
    low = exact.at(torch.bfloat16)
    bounds = window_bounds(None, window, (2, start + Lq), torch.device("cuda"))
    cudnn = cudnn_paged.WindowedAttention()

    def run(impl, c, windows):
        args = (c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale)
        parts = [impl.paged_attention_forward(*args, key_range=w, out_dtype=torch.float32, documents=bounds)
                 for w in windows]
        out, lse = reference.merge_partials(*map(list, zip(*parts, strict=True)))
        dk = torch.zeros(c.k_pool.shape, dtype=torch.float32, device="cuda")
        dv = torch.zeros_like(dk)
        dq = torch.zeros(c.q.shape, dtype=torch.float32, device="cuda")
        for w in windows:
            impl.paged_attention_backward(*args, out.to(c.q.dtype), c.dout, lse, dk, dv, key_range=w,
                                          dq_accumulator=dq, documents=bounds)
        return out, lse, dq, dk, dv

    for block in (start, 8 * P_gpu):
        windows = [(lo, min(lo + block, start)) for lo in range(0, start, block)] + [(start, start + Lq)]
        _assert_within_twice_reference(run(cudnn, low, windows), run(reference, low, windows),
                                       run(reference, exact, windows))


@pytest.mark.gpu
@pytest.mark.parametrize("window", [100, 300])
@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss", "mistral"])
@pytest.mark.parametrize("attention", ["dense", "sparse"])
def test_gpu_window_family_on_cudnn_within_twice_torch_backend_error(family, attention, window):
    """bf16 steps of window families on cuDNN (1100 tokens in chunks of 256, pages of 64, head dim 64;
    windows of 100: tiles of 99 and remainders inside a chunk, of 300: longer than a chunk; sparse: the
    global layers select 4 pages) against the same step in fp32 on the torch backend: the gradient error
    at most twice the torch backend's in bf16, the rule of test_families.py's bf16 GPU test. The fp32
    dense step equals HF's, as in test_families.py's GPU family test."""
    from helpers import random_ids, relative_error
    from test_families import GPU_CONFIG, GPU_TOKENS, build, hf_step, oomb_step

    model = build(family, seed=23, sliding_window=window, head_dim=64).cuda()
    ids = random_ids(2, GPU_TOKENS, seed=23).cuda()
    config = GPU_CONFIG.with_options({"attention": attention, "sparse.budget": 4})
    exact_loss, exact = oomb_step(model, ids, config)
    if attention == "dense":
        hf_loss, hf = hf_step(model, ids)
        torch.testing.assert_close(exact_loss, hf_loss, rtol=1e-4, atol=0)
        assert relative_error(exact, hf) <= 1e-4
    model.to(torch.bfloat16)
    ref_loss, ref = oomb_step(model, ids, config)
    got_loss, got = oomb_step(model, ids, config.with_options({"performance.backend": "cudnn"}))
    ours, theirs = relative_error(got, exact), relative_error(ref, exact)
    print(f"{family} W={window} bf16 {attention} gradient error: cudnn {ours:.3e}, torch backend {theirs:.3e}")
    assert ours <= 2 * theirs
    loss_error, ref_loss_error = abs(float(got_loss - exact_loss)), abs(float(ref_loss - exact_loss))
    assert loss_error <= 2 * ref_loss_error + 1e-3 * abs(float(exact_loss))
