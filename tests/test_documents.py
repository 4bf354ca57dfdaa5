"""Packed documents (oomb/documents.py): attention and labels stop at document boundaries.

The oracles: Hugging Face's own padding-free forward (transformers >= 5 builds a block-diagonal mask
from restarting position_ids for sdpa/eager when there is no cache, hence use_cache=False), and the
sum of separate full-sequence backwards of each document, each weighted by its share of the counted
labels (the packed loss is the mean over all counted labels of all documents).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import FAMILIES, build_tiny_model, grads, random_ids, relative_error
from peft import LoraConfig, get_peft_model

import oomb
import oomb.engine
from oomb import OOMBConfig
from oomb.attention import reference
from oomb.config import OffloadConfig, PerformanceConfig
from oomb.documents import (
    ends_from_starts,
    resolve_documents,
    starts_from_cu_seqlens,
    starts_from_position_ids,
)
from oomb.kv import ChunkSpan
from oomb.kv.offload import HostSlabs, OffloadedKVStore
from oomb.kv.store import attention_windows

GRAD_RTOL = 1e-5
LOSS_RTOL = 1e-5
CPU = torch.device("cpu")

# 150 tokens, chunk 32, page 8: documents start mid-page (13, 15, 75) and mid-chunk, two one-token
# documents (13, 14), one document of 60 tokens across three chunks, a last chunk of 22 tokens.
LENGTHS = [13, 1, 1, 60, 40, 35]
# A second row with other boundaries (batch 2).
LENGTHS_2 = [70, 5, 1, 66, 8]
CONFIG = OOMBConfig(chunk_size=32, page_size=8, performance=PerformanceConfig(backend="torch", loss_chunk_tokens=50),
                    offload=OffloadConfig(stream_block_pages=1))


def _cu(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


def _hf_padding_free(model, ids: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor):
    """HF's padding-free step: restarting position_ids, no cache (else no packed mask), labels with -100
    at every document's first token (DataCollatorWithFlattening's convention)."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels, position_ids=positions, use_cache=False).loss
    loss.backward()
    return loss.detach(), grads(model)


def _per_document(model, ids: torch.Tensor, rows: list[list[int]]):
    """Sum of separate full-sequence HF backwards, one per document, weighted by its counted labels."""
    model.zero_grad(set_to_none=True)
    counted = sum(n - 1 for lengths in rows for n in lengths)
    total = 0.0
    for b, lengths in enumerate(rows):
        cu = _cu(lengths)
        for lo, hi in zip(cu[:-1], cu[1:], strict=True):
            if hi - lo < 2:
                continue  # a one-token document predicts nothing
            doc = ids[b:b + 1, lo:hi]
            loss = model(input_ids=doc, labels=doc).loss * ((hi - lo - 1) / counted)
            loss.backward()
            total += float(loss.detach())
    return torch.tensor(total), grads(model)


def _oomb(model, ids, config=CONFIG, **documents):
    model.zero_grad(set_to_none=True)
    loss = oomb.forward_backward(model, ids, None, config, **documents)
    return loss, grads(model)


# --- boundaries ----------------------------------------------------------------------------------
def test_boundaries_from_position_ids_and_cu_seqlens_agree():
    positions = _positions(LENGTHS)
    starts = starts_from_position_ids(positions, (1, 150))
    assert torch.equal(starts, starts_from_cu_seqlens(_cu(LENGTHS), (1, 150)))
    assert starts[0, :16].tolist() == [0] * 13 + [13, 14, 15]
    ends = ends_from_starts(starts)
    assert ends[0, :16].tolist() == [13] * 13 + [14, 15, 75]
    assert ends[0, -1] == 150 and starts[0, -1] == 115
    # A row may begin inside a document (positions need not start at 0).
    carried = torch.tensor([5, 6, 7, 0, 1])
    assert starts_from_position_ids(carried, (1, 5)).tolist() == [[0, 0, 0, 3, 3]]
    docs = resolve_documents(carried, None, (1, 5), CPU)
    assert docs.positions.tolist() == [[5, 6, 7, 0, 1]] and docs.end.tolist() == [[3, 3, 3, 5, 5]]
    # Per-row boundaries; one shared row of position_ids is broadcast over the batch.
    two = resolve_documents(None, [_cu(LENGTHS), _cu(LENGTHS_2)], (2, 150), CPU)
    assert two.start_cpu[1, 70:76].tolist() == [70] * 5 + [75]
    assert torch.equal(two.positions[1], _positions(LENGTHS_2))
    assert resolve_documents(positions, None, (2, 150), CPU).start.shape == (2, 150)


def test_cross_document_labels_are_masked():
    docs = resolve_documents(None, [0, 3, 4, 6], (1, 6), CPU)
    labels = torch.arange(10, 16)[None]
    assert docs.mask_labels(labels).tolist() == [[10, 11, 12, -100, -100, 15]]


@pytest.mark.parametrize(("position_ids", "cu_seqlens", "match"), [
    (torch.tensor([0, 1, 2, 5, 6]), None, "jump from 2 to 5"),
    (torch.tensor([0, 1, -1, 0, 1]), None, ">= 0"),
    (torch.tensor([0, 1, 2]), None, "shape"),
    (torch.tensor([0.0, 1, 2, 3, 4]), None, "integers"),
    (None, [0, 2, 2, 5], "strictly"),
    (None, [0, 2, 4], "from 0 to"),
    (None, [[0, 5], [0, 5]], "row"),
    (torch.tensor([0, 1, 0, 1, 2]), [0, 3, 5], "disagree"),
])
def test_inconsistent_boundaries_are_refused(position_ids, cu_seqlens, match):
    with pytest.raises((ValueError, TypeError), match=match):
        resolve_documents(position_ids, cu_seqlens, (1, 5), CPU)


def test_history_windows_start_at_the_chunks_first_document():
    chunk = ChunkSpan(3, 96, 128)
    assert attention_windows(chunk, 8, 2) == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 80), (80, 96),
                                              (96, 128)]
    assert attention_windows(chunk, 8, 2, first_key=72) == [(72, 80), (80, 96), (96, 128)]
    assert attention_windows(chunk, 8, None, first_key=96) == [(96, 128)]
    with pytest.raises(ValueError, match="page-aligned"):
        attention_windows(chunk, 8, 2, first_key=75)
    docs = resolve_documents(None, [_cu(LENGTHS), _cu(LENGTHS_2)], (2, 150), CPU)
    # Chunk 3 starts at 96: row 0 is in the document from 75, row 1 in the one from 76 -> page 72.
    assert docs.history_start(96, 8) == 72
    assert docs.history_start(128, 8) == 72  # row 1's document from 76 runs to 142


# --- the step against HF -------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_step_equals_hf_padding_free_and_separate_documents(family):
    model = build_tiny_model(family, seed=2)
    ids = random_ids(1, 150, seed=5)
    positions = _positions(LENGTHS)[None]
    docs = resolve_documents(positions, None, (1, 150), CPU)
    want_loss, want = _hf_padding_free(model, ids, positions, docs.mask_labels(ids))
    per_doc_loss, per_doc = _per_document(model, ids, [LENGTHS])
    got_loss, got = _oomb(model, ids, position_ids=positions)
    torch.testing.assert_close(got_loss, want_loss, rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(got_loss, per_doc_loss, rtol=LOSS_RTOL, atol=0)
    assert relative_error(got, want) <= GRAD_RTOL
    assert relative_error(got, per_doc) <= GRAD_RTOL
    # Without the boundaries the gradient is really different (the test can tell).
    _, crossing = _oomb(model, ids)
    assert relative_error(crossing, per_doc) > 0.1


def test_batch_of_two_with_different_boundaries_and_cu_seqlens():
    model = build_tiny_model("qwen2", seed=3)
    ids = random_ids(2, 150, seed=6)
    positions = torch.stack([_positions(LENGTHS), _positions(LENGTHS_2)])
    docs = resolve_documents(positions, None, (2, 150), CPU)
    want_loss, want = _hf_padding_free(model, ids, positions, docs.mask_labels(ids))
    per_doc_loss, per_doc = _per_document(model, ids, [LENGTHS, LENGTHS_2])
    config = CONFIG.with_options({"offload.stream_block_pages": 2, "performance.checkpoint_layers": False})
    got_loss, got = _oomb(model, ids, config, cu_seqlens=[_cu(LENGTHS), _cu(LENGTHS_2)])
    torch.testing.assert_close(got_loss, want_loss, rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(got_loss, per_doc_loss, rtol=LOSS_RTOL, atol=0)
    assert relative_error(got, want) <= GRAD_RTOL
    assert relative_error(got, per_doc) <= GRAD_RTOL


def test_lora_step_equals_hf_padding_free():
    model = build_tiny_model("llama", seed=4)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # nonzero B, so that A gets a gradient too
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    ids = random_ids(1, 150, seed=7)
    positions = _positions(LENGTHS)[None]
    docs = resolve_documents(positions, None, (1, 150), CPU)
    want_loss, want = _hf_padding_free(peft_model, ids, positions, docs.mask_labels(ids))
    got_loss, got = _oomb(peft_model, ids, position_ids=positions)
    assert len(got) == 8  # only the LoRA matrices train
    torch.testing.assert_close(got_loss, want_loss, rtol=LOSS_RTOL, atol=0)
    assert relative_error(got, want) <= GRAD_RTOL


def test_one_document_per_row_with_positions_is_the_plain_step():
    """position_ids without restarts: plain causal attention at those positions."""
    model = build_tiny_model("llama", seed=5)
    ids = random_ids(1, 70, seed=8)
    positions = torch.arange(70)[None]
    want_loss, want = _oomb(model, ids)
    got_loss, got = _oomb(model, ids, position_ids=positions)
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(got[name], want[name]) for name in want)


# --- cost: pages of earlier documents are neither read nor staged --------------------------------
def _recording_backend(monkeypatch) -> list[tuple[int, tuple[int, int]]]:
    """(query_start, key_range) of every dense forward/backward call of the torch backend."""
    calls = []
    real = oomb.engine.select_backend

    def select(name, device, **options):
        backend = real(name, device, **options)

        def forward(q, k, v, table, query_start, scale, **kwargs):
            calls.append((query_start, kwargs["key_range"]))
            return backend.forward(q, k, v, table, query_start, scale, **kwargs)

        def backward(q, k, v, table, query_start, *args, **kwargs):
            calls.append((query_start, kwargs["key_range"]))
            return backend.backward(q, k, v, table, query_start, *args, **kwargs)

        return replace(backend, forward=forward, backward=backward)

    monkeypatch.setattr(oomb.engine, "select_backend", select)
    return calls


def test_history_before_the_chunks_documents_is_never_read(monkeypatch):
    calls = _recording_backend(monkeypatch)
    model = build_tiny_model("llama", seed=1)
    cu = _cu(LENGTHS)
    _oomb(model, random_ids(1, 150, seed=9), cu_seqlens=cu)
    docs = resolve_documents(None, cu, (1, 150), CPU)
    first_keys = {start: docs.history_start(start, 8) for start in range(0, 150, 32)}
    assert first_keys == {0: 0, 32: 8, 64: 8, 96: 72, 128: 112}
    assert min(lo - first_keys[start] for start, (lo, _) in calls) == 0  # some window starts right there
    assert calls and all(lo >= first_keys[start] for start, (lo, _) in calls)
    # Chunk 1 reads history pages 1..3 (8..32), not page 0; chunk 4 reads 112..128 only.
    assert {kr for start, kr in calls if start == 32} == {(8, 16), (16, 24), (24, 32), (32, 64)}
    assert {kr for start, kr in calls if start == 128} == {(112, 120), (120, 128), (128, 150)}


@pytest.mark.parametrize("resident", [0, 1])
def test_offload_equals_no_offload_bitwise_and_stages_only_the_documents(resident, monkeypatch):
    loaded, windows = [], {}

    class Recording(OffloadedKVStore):
        def _load(self, index, key_range, slot, grads):
            loaded.append(key_range)
            return super()._load(index, key_range, slot, grads)

        def windows(self, chunk, whole_history=False):
            windows[chunk.start] = super().windows(chunk, whole_history)
            return windows[chunk.start]

    monkeypatch.setattr(oomb.engine, "OffloadedKVStore", Recording)
    model = build_tiny_model("qwen2", seed=3)
    ids = random_ids(2, 150, seed=10)
    cu = [_cu(LENGTHS), _cu(LENGTHS_2)]
    want_loss, want = _oomb(model, ids, cu_seqlens=cu)
    offload = CONFIG.with_options({"offload.enabled": True, "offload.resident_layers": resident})
    model.zero_grad(set_to_none=True)
    got_loss = oomb.forward_backward(model, ids, None, offload, host_slabs=HostSlabs(pin=False), cu_seqlens=cu)
    got = grads(model)
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(got[name], want[name]) for name in want)
    # Both rows' documents at 96 and 128 began at 75 / 76: those chunks stage history from page 9 (72).
    assert windows[96][0] == (72, 80) and windows[128][0] == (72, 80)
    with_documents = loaded.count((0, 8))
    loaded.clear()
    oomb.forward_backward(model, ids, None, offload, host_slabs=HostSlabs(pin=False))
    # Page 0 moves for chunks 1 and 2 only, not for 3 and 4 (3 loads per chunk and offloaded layer).
    assert with_documents == 6 * (2 - resident) and loaded.count((0, 8)) == 12 * (2 - resident)


def test_dense_offload_stages_history_from_the_chunks_first_document(monkeypatch):
    """The staged-pages counter: per call (stage 1, stage 2's forward and backward; 2 layers) each
    chunk moves the history pages from its first query's document on, not the earlier ones."""
    stores = []

    class Recording(OffloadedKVStore):
        def __init__(self, **options):
            super().__init__(**options)
            stores.append(self)

    monkeypatch.setattr(oomb.engine, "OffloadedKVStore", Recording)
    model = build_tiny_model("llama", seed=1)
    ids = random_ids(1, 150, seed=9)
    offload = CONFIG.with_options({"offload.enabled": True})
    for boundaries in ({"cu_seqlens": _cu(LENGTHS)}, {}):
        oomb.forward_backward(model, ids, None, offload, host_slabs=HostSlabs(pin=False), **boundaries)
    first_keys = {0: 0, 32: 8, 64: 8, 96: 72, 128: 112}  # as test_history_before_the_chunks_documents...
    calls = 3 * model.config.num_hidden_layers
    assert stores[0].staged_history_pages == calls * sum((s - f) // 8 for s, f in first_keys.items())  # 15
    assert stores[1].staged_history_pages == calls * sum(s // 8 for s in first_keys)  # 40 without documents


def _kernel_case(seed: int = 0):
    """A chunk of 24 queries at 16 over 40 keys (pages of 8), two rows with different documents; the V
    pages wholly before every query's document start are NaN, so reading one would show."""
    g = torch.Generator().manual_seed(seed)
    B, Hq, Hkv, D, P, qs, Lq = 2, 4, 2, 16, 8, 16, 24
    pages = B * (qs + Lq) // P
    k = torch.randn(pages, Hkv, P, D, generator=g)
    v = torch.randn(pages, Hkv, P, D, generator=g)
    table = torch.randperm(pages, generator=g).to(torch.int32).reshape(B, -1)
    q = torch.randn(B, Hq, Lq, D, generator=g)
    docs = resolve_documents(None, [[0, 9, 21, 22, 33, 40], [0, 11, 12, 37, 40]], (B, qs + Lq), CPU)
    v_poisoned = v.clone()
    v_poisoned[table[:, 0].long()] = float("nan")  # keys 0..7: every query's document starts at >= 9
    return q, k, v, v_poisoned, table, qs, docs


def _dense_documents_oracle(q, k, v, table, qs, docs, scale):
    """Autograd through plain masked softmax attention over the gathered keys."""
    T = qs + q.shape[2]
    G = q.shape[1] // k.shape[1]
    kk = reference._gather_block(k, table, 0, T // k.shape[2]).repeat_interleave(G, 1)
    vv = reference._gather_block(v, table, 0, T // k.shape[2]).repeat_interleave(G, 1)
    q_pos, k_pos = torch.arange(qs, T), torch.arange(T)
    visible = (k_pos[None, None] <= q_pos[None, :, None]) & (k_pos[None, None] >= docs.start_cpu[:, qs:, None])
    scores = (torch.einsum("bhqd,bhkd->bhqk", q, kk) * scale).masked_fill(~visible[:, None], float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), vv)


def _check_backend(module, q, k, v, v_poisoned, table, qs, docs, **tiles):
    scale = 0.3
    want = _dense_documents_oracle(q, k, v, table, qs, docs, scale)
    out, lse = module.paged_attention_forward(q, k, v_poisoned, table, qs, scale, documents=docs, **tiles)
    torch.testing.assert_close(out, want, rtol=0, atol=2e-6)
    # Windows: history pages 0 and 1 (page 0 is before every document: lse -inf), then the chunk.
    outs, lses = zip(*(module.paged_attention_forward(q, k, v_poisoned, table, qs, scale, key_range=kr,
                                                       documents=docs, out_dtype=torch.float32, **tiles)
                       for kr in [(0, 8), (8, 16), (16, 40)]), strict=True)
    assert bool(torch.isinf(lses[0]).any())  # rows that see no key of a window: lse -inf, merged as empty
    merged, merged_lse = reference.merge_partials(list(outs), list(lses))
    torch.testing.assert_close(merged, want, rtol=0, atol=2e-6)
    torch.testing.assert_close(merged_lse, lse, rtol=0, atol=2e-6)
    # Backward against autograd of the oracle, with the NaN pages in place.
    q_ = q.clone().requires_grad_()
    k_ = k.clone().requires_grad_()
    v_ = v.clone().requires_grad_()
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    _dense_documents_oracle(q_, k_, v_, table, qs, docs, scale).backward(dout)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dq = module.paged_attention_backward(q, k, v_poisoned, table, qs, scale, out, dout, lse, dk, dv,
                                         documents=docs, **tiles)
    torch.testing.assert_close(dq, q_.grad, rtol=0, atol=5e-6)
    torch.testing.assert_close(dk, k_.grad, rtol=0, atol=5e-6)
    # dV of the skipped (NaN) pages is untouched: exactly zero, as their keys' true gradient.
    torch.testing.assert_close(dv, v_.grad, rtol=0, atol=5e-6)


def test_torch_backend_masks_documents_and_skips_earlier_pages():
    q, k, v, v_poisoned, table, qs, docs = _kernel_case()
    _check_backend(reference, q, k, v, v_poisoned, table, qs, docs, key_block_tokens=8, query_block_tokens=8)


def test_triton_kernels_mask_documents_and_skip_earlier_pages():
    """Through the interpreter on CPU (tiles of 32 rows x 16 keys): several row tiles, masked and
    unmasked key tiles, per-row document starts."""
    pytest.importorskip("triton")
    from oomb.attention import triton_paged

    q, k, v, v_poisoned, table, qs, docs = _kernel_case(seed=1)
    _check_backend(triton_paged, q, k, v, v_poisoned, table, qs, docs)


@pytest.mark.slow
def test_triton_step_with_documents_equals_torch_step():
    """The whole step through the Triton interpreter (tiny: 40 tokens, chunks of 16, pages of 8, two rows
    with different documents, one window per history page)."""
    pytest.importorskip("triton")
    model = build_tiny_model("llama", seed=1)
    ids = random_ids(2, 40, seed=2)
    cu = [[0, 5, 6, 23, 40], [0, 17, 40]]
    config = OOMBConfig(chunk_size=16, page_size=8, performance=PerformanceConfig(backend="torch"),
                        offload=OffloadConfig(stream_block_pages=1))
    want_loss, want = _oomb(model, ids, config, cu_seqlens=cu)
    got_loss, got = _oomb(model, ids, config.with_options({"performance.backend": "triton"}), cu_seqlens=cu)
    torch.testing.assert_close(got_loss, want_loss, rtol=LOSS_RTOL, atol=0)
    assert relative_error(got, want) <= GRAD_RTOL


# --- which backend documents take ------------------------------------------------------------------
def test_packed_documents_take_cudnn_unless_sliding_windows_bind(monkeypatch):
    """"auto" on CUDA for a bf16 model: packed documents run on cudnn in both modes (per-document segments;
    tests/test_cudnn_paged.py and tests/test_cudnn_sparse.py on a stand-in kernel, the GPU tests below);
    only sliding windows inside documents, which cuDNN runs neither as segments nor as a band, take triton."""
    asked = []
    monkeypatch.setattr(oomb.engine, "select_backend", lambda name, device, **kw: asked.append(kw["dtype"]))
    model = build_tiny_model("llama", seed=2).to(torch.bfloat16)
    cuda = torch.device("cuda")
    for attention in ("dense", "sparse"):
        oomb.engine._select_step_backend(model, replace(CONFIG, attention=attention), cuda, False)
    oomb.engine._select_step_backend(model, CONFIG, cuda, True)
    assert asked == [torch.bfloat16, torch.bfloat16, None]  # the dtype picks cudnn; None: triton
    monkeypatch.undo()
    docs = resolve_documents(None, [0, 20, 40], (1, 40), CPU)
    one = resolve_documents(None, [0, 40], (1, 40), CPU)  # one document: plain causal attention
    assert oomb.engine.attention_setup(model.float(), CONFIG, CPU, 40, docs)[1] is docs
    assert oomb.engine.attention_setup(model, CONFIG, CPU, 40, one)[1] is None


# --- GPU (H200) ------------------------------------------------------------------------------------
def _gpu_model(family: str = "llama"):
    return build_tiny_model(family, seed=2).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("offload", [False, True])
def test_gpu_triton_step_with_documents_equals_torch_backend_and_hf(offload):
    """fp32 on the GPU: the Triton kernels (IEEE dots) against oomb's torch backend on the same device and,
    where this transformers builds packed masks from position_ids, HF's padding-free step."""
    from transformers import masking_utils

    model = _gpu_model()
    ids = random_ids(2, 1000, seed=11).cuda()
    rows = [[100, 1, 300, 77, 1, 521], [640, 3, 357]]
    positions = torch.stack([_positions(r) for r in rows]).cuda()
    base = OOMBConfig(chunk_size=256, page_size=64, performance=PerformanceConfig(backend="torch"),
                      offload=OffloadConfig(stream_block_pages=2))
    want_loss, want = _oomb(model, ids, base, position_ids=positions)
    config = base.with_options({"performance.backend": "triton", "offload.enabled": offload})
    got_loss, got = _oomb(model, ids, config, position_ids=positions)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=0)
    assert relative_error(got, want) <= 1e-5
    if hasattr(masking_utils, "find_packed_sequence_indices"):
        docs = resolve_documents(positions, None, (2, 1000), ids.device)
        hf_loss, hf = _hf_padding_free(model, ids, positions, docs.mask_labels(ids))
        torch.testing.assert_close(got_loss, hf_loss, rtol=1e-4, atol=0)
        assert relative_error(got, hf) <= 1e-4  # HF: SDPA and cuBLAS, other summation orders


@pytest.mark.gpu
@pytest.mark.parametrize("offload", [False, True])
def test_gpu_cudnn_step_with_documents_within_twice_triton_bf16_error(offload):
    """bf16 on the GPU: the cudnn backend's document segments against the float32 Triton step with the
    same documents, their error at most twice the bf16 Triton step's (cuDNN rounds each segment's
    dQ, dK, dV to bf16; Triton accumulates in float32). Head dim 64; one-token documents and segments
    shorter than cudnn_paged.SHORT_SEGMENT (which leave cuDNN) as well as longer ones."""
    model = build_tiny_model("llama", seed=2, hidden_size=256, num_attention_heads=4).cuda()
    ids = random_ids(2, 1000, seed=12).cuda()
    rows = [[100, 1, 300, 77, 1, 521], [640, 3, 357]]
    positions = torch.stack([_positions(r) for r in rows]).cuda()
    base = OOMBConfig(chunk_size=256, page_size=64, performance=PerformanceConfig(backend="triton"))
    _, want = _oomb(model, ids, base, position_ids=positions)
    model.to(torch.bfloat16)
    _, triton = _oomb(model, ids, base, position_ids=positions)
    _, cudnn = _oomb(model, ids, base.with_options({"performance.backend": "cudnn",
                                                    "offload.enabled": offload}), position_ids=positions)
    ours, theirs = relative_error(cudnn, want), relative_error(triton, want)
    print(f"bf16 gradient error with documents: cudnn {ours:.3e}, triton {theirs:.3e}")
    assert ours <= 2 * theirs


# --- oomb train: data.documents ------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["separate", "loss_only", "joined"])
def test_packed_sequences_carry_document_boundaries(tmp_path, mode):
    from oomb.training.config import DataSection
    from oomb.training.data import PackedSequences, resolve_files
    from oomb.training.presets import byte_tokenizer

    path = tmp_path / "d.jsonl"
    path.write_text("".join(f'{{"text": "doc {i} {"x" * i}"}}\n' for i in range(6)))
    options = DataSection(paths=[str(path)], seq_len=16, shuffle=False, documents=mode)
    first, second = (next(s) for s in [PackedSequences(resolve_files(options), byte_tokenizer(), options, 0)] * 2)
    # "doc 0 " + EOS = 7 tokens, "doc 1 x" + EOS = 8: documents start at 0, 7, 15 of the first sequence;
    # the second begins inside "doc 2 xx" and its next document starts at 8.
    assert first.cu_seqlens() == [0, 7, 15, 16] and second.cu_seqlens() == [0, 8, 16]
    masked = (first.labels == -100).nonzero().flatten().tolist()
    assert masked == ([0, 7, 15] if mode == "loss_only" else [])  # separate: the step masks them itself


def test_the_data_sections_contradictions_are_refused():
    from oomb.training.config import DataSection, _check_section

    with pytest.raises(ValueError, match="contradicts"):
        _check_section(DataSection(documents="joined", mask_document_boundaries=True), "data")
