"""Triton sparse paged attention vs the sparse reference backend (oomb.attention.reference_sparse).

CPU: the kernels run in the Triton interpreter (conftest sets TRITON_INTERPRET=1) at tiny shapes
(a few pages of 8-16 tokens, head dims 16-24): the interpreter costs ~10 ms per tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from oomb.attention import reference_sparse
from oomb.config import PerformanceConfig, SparseConfig

triton_sparse = pytest.importorskip("oomb.attention.triton_sparse")

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Case:
    q: torch.Tensor  # (B, Hq, Lq, D), transposed view as HF hands it over
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    page_table: torch.Tensor
    selection: torch.Tensor  # (B, Hkv, n_blocks, K) int32
    dout: torch.Tensor
    history: int
    scale: float

    def args(self):
        return self.q, self.k_pool, self.v_pool, self.page_table, self.history, self.scale, self.selection


def make_case(B, Hq, Hkv, Lq, history_pages, D, P, K, dtype=torch.float32, seed=0) -> Case:
    gen = torch.Generator().manual_seed(seed)
    n_pages = history_pages + math.ceil(Lq / P)
    num_pages = B * n_pages + 3  # spare pages: never read, never written
    k_pool = torch.randn(num_pages, Hkv, P, D, generator=gen)
    v_pool = torch.randn(num_pages, Hkv, P, D, generator=gen)
    page_table = torch.randperm(num_pages, generator=gen)[: B * n_pages].reshape(B, n_pages).to(torch.int32)
    n_blocks = math.ceil(Lq / P)
    selection = torch.stack([torch.randperm(history_pages, generator=gen)[:K].sort().values
                             for _ in range(B * Hkv * n_blocks)]).reshape(B, Hkv, n_blocks, K).to(torch.int32)
    q = torch.randn(B, Lq, Hq, D, generator=gen).transpose(1, 2)
    dout = torch.randn(B, Hq, Lq, D, generator=gen)
    tensors = [t.to(DEVICE) for t in (q, k_pool, v_pool, page_table, selection, dout)]
    tensors = [t.to(dtype) if t.is_floating_point() else t for t in tensors]
    return Case(*tensors, history_pages * P, D**-0.5)


# (B, Hq, Hkv, Lq, history pages, D, P, K): GQA groups 1/2/4, pages equal to / larger than / smaller than
# the interpreter's 16-key tile and a page of 12 (tiles straddle the page end), partial last blocks,
# one query, no selected page (chunk-local attention), a page read by every block.
CASES = [
    pytest.param(2, 4, 2, 40, 5, 16, 16, 2, id="G2-P16-K2"),
    pytest.param(1, 4, 1, 20, 4, 16, 8, 3, id="G4-P8-K3"),
    pytest.param(2, 2, 2, 17, 3, 24, 32, 1, id="G1-P32-D24-K1"),
    pytest.param(1, 2, 1, 30, 4, 16, 12, 2, id="G2-P12-K2"),
    pytest.param(2, 4, 2, 1, 6, 16, 16, 3, id="one-query"),
    pytest.param(1, 4, 2, 20, 3, 16, 16, 0, id="K0"),
    pytest.param(1, 4, 2, 48, 2, 16, 16, 2, id="all-history"),
]


@pytest.mark.parametrize("B,Hq,Hkv,Lq,history_pages,D,P,K", CASES)
def test_matches_sparse_reference(B, Hq, Hkv, Lq, history_pages, D, P, K):
    c = make_case(B, Hq, Hkv, Lq, history_pages, D, P, K)
    out, lse = triton_sparse.sparse_attention_forward(*c.args())
    ref_out, ref_lse = reference_sparse.sparse_attention_forward(*c.args())
    assert out.shape == c.q.shape and out.stride() == c.q.stride() and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)

    start = torch.randn(c.k_pool.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = {}
    for name, backend in (("triton", triton_sparse), ("reference", reference_sparse)):
        dk, dv = start.clone(), -start
        dq = backend.sparse_attention_backward(*c.args(), ref_out, c.dout, ref_lse, dk, dv)
        grads[name] = (dq, dk, dv)
    for got, want in zip(grads["triton"], grads["reference"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    _, dk, _ = grads["triton"]
    read = set(c.page_table[:, history_pages:].reshape(-1).tolist())
    for b in range(B):
        read |= {int(c.page_table[b, p]) for p in c.selection[b].reshape(-1).tolist()}
    unread = [p for p in range(c.k_pool.shape[0]) if p not in read]
    assert torch.equal(dk[unread], start[unread])


def test_backward_is_bitwise_repeatable():
    c = make_case(2, 4, 2, 40, 5, 16, 16, 3, seed=2)
    out, lse = triton_sparse.sparse_attention_forward(*c.args())
    results = []
    for _ in range(2):
        dk, dv = torch.zeros_like(c.k_pool), torch.zeros_like(c.v_pool)
        dq = triton_sparse.sparse_attention_backward(*c.args(), out, c.dout, lse, dk, dv)
        results.append((dq, dk, dv))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_work_items_invert_the_selection():
    selection = torch.tensor([[[[0, 2], [2, 3], [0, 3]]]], dtype=torch.int32)  # B=1, Hkv=1, 3 blocks, K=2
    items, starts, counts, blocks = triton_sparse._history_work_items(selection, num_history=4)
    assert items.tolist() == [0, 2, 3]  # pages read by some block
    assert counts.tolist() == [2, 2, 2] and starts.tolist() == [0, 2, 4]
    assert blocks.tolist() == [0, 2, 0, 1, 1, 2]  # page 0 <- blocks 0, 2; page 2 <- 0, 1; page 3 <- 1, 2


def test_work_items_of_one_row_shared_by_every_block_need_no_sorting():
    """A selection expanded over the blocks (stride 0) inverts without a sort (no device sync) to what
    the general path gives."""
    rows = torch.tensor([[[1, 3, 4], [0, 2, 4]], [[0, 1, 2], [2, 3, 4]]], dtype=torch.int32)  # (B=2, Hkv=2, K=3)
    shared = rows[:, :, None].expand(2, 2, 3, 3)
    fast = triton_sparse._history_work_items(shared, num_history=5)
    general = triton_sparse._history_work_items(shared.contiguous(), num_history=5)
    for got, want in zip(fast, general, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_selection_is_validated():
    c = make_case(1, 2, 1, 8, 2, 16, 8, 1)
    with pytest.raises(ValueError, match=r"selection must be int32 \(B=1, Hkv=1, n_blocks=1, K\)"):
        triton_sparse.sparse_attention_forward(*c.args()[:-1], c.selection.long())
    with pytest.raises(ValueError, match="must be a multiple of the page size 8"):
        triton_sparse.sparse_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, 4, c.scale, c.selection)


def test_unselected_pages_are_never_read():
    """NaN in every (page, KV head) no block selected for that head (and in spare pages) must not leak."""
    c = make_case(2, 4, 2, 20, 8, 16, 16, 2, seed=3)
    read = torch.zeros(c.k_pool.shape[:2], dtype=torch.bool)
    read[c.page_table[:, 8:].reshape(-1).long()] = True  # the chunk's own pages
    for b in range(2):
        for h in range(2):
            read[c.page_table[b, c.selection[b, h].reshape(-1).long()].long(), h] = True
    assert (~read).sum() > 8  # many (page, head) pairs really are unselected
    poisoned = Case(*vars(c).values())
    poisoned.k_pool, poisoned.v_pool = c.k_pool.clone(), c.v_pool.clone()
    poisoned.k_pool[~read] = float("nan")
    poisoned.v_pool[~read] = float("nan")
    out, lse = triton_sparse.sparse_attention_forward(*poisoned.args())
    ref_out, ref_lse = reference_sparse.sparse_attention_forward(*c.args())
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    dk, dv = torch.zeros_like(c.k_pool), torch.zeros_like(c.v_pool)
    dq = triton_sparse.sparse_attention_backward(*poisoned.args(), ref_out, c.dout, ref_lse, dk, dv)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert (dk[~read] == 0).all() and (dv[~read] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_small(dtype):
    """Interpreted: the upcast path, so only input/output rounding differs from the reference."""
    c = make_case(1, 4, 2, 24, 4, 16, 8, 2, dtype=dtype, seed=4)
    out, lse = triton_sparse.sparse_attention_forward(*c.args())
    ref_out, ref_lse = reference_sparse.sparse_attention_forward(*c.args())
    torch.testing.assert_close(out, ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    dk, dv = torch.zeros(c.k_pool.shape, dtype=torch.bfloat16), torch.zeros(c.k_pool.shape, dtype=torch.bfloat16)
    ref_dk, ref_dv = dk.clone(), dv.clone()
    dq = triton_sparse.sparse_attention_backward(*c.args(), ref_out, c.dout, ref_lse, dk, dv)
    ref_dq = reference_sparse.sparse_attention_backward(*c.args(), ref_out, c.dout, ref_lse, ref_dk, ref_dv)
    for got, want in ((dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------
# GPU: production shapes, bfloat16 (not yet run: written without device time)
# ---------------------------------------------------------------------------------------------
def _max_err(got, want):
    return (got.float() - want.float()).abs().max().item()


def _run(backend, c: Case):
    out, lse = backend.sparse_attention_forward(*c.args())
    dk = torch.zeros(c.k_pool.shape, dtype=torch.float32, device=c.q.device)
    dv = torch.zeros_like(dk)
    dq = backend.sparse_attention_backward(*c.args(), out, c.dout, lse, dk, dv)
    return out, lse, dq, dk, dv


# (Hq, Hkv, D, P, history pages, Lq, K): GQA 4/7, D 64/128, pages 64/128.
GPU_CASES = [
    pytest.param(8, 2, 64, 64, 40, 300, 8, id="G4-D64-P64-K8"),
    pytest.param(28, 4, 128, 128, 64, 512, 16, id="G7-D128-P128-K16"),
    pytest.param(14, 2, 128, 128, 256, 4096, 65, id="G7-D128-P128-K65-chunk4K"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv,D,P,history_pages,Lq,K", GPU_CASES)
def test_gpu_bf16_error_within_twice_reference(Hq, Hkv, D, P, history_pages, Lq, K):
    """As tests/test_triton_paged.py: bf16 error vs an fp32 reference at most 2x the reference backend's."""
    exact = make_case(2, Hq, Hkv, Lq, history_pages, D, P, K)
    low = Case(*(t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                 for t in vars(exact).values()))
    want = _run(reference_sparse, exact)
    ref = _run(reference_sparse, low)
    got = _run(triton_sparse, low)
    for name, g, r, w in zip(("out", "lse", "dq", "dk", "dv"), got, ref, want, strict=True):
        ours, theirs = _max_err(g, w), _max_err(r, w)
        eps = 1e-4 * w.abs().max().item()
        assert ours <= 2 * theirs + eps, f"{name}: ours {ours:.3e} vs reference-on-bf16 {theirs:.3e}"


@pytest.mark.gpu
def test_gpu_repeat_runs_are_bit_identical():
    c = make_case(2, 28, 4, 512, 64, 128, 128, 16, dtype=torch.bfloat16)
    first = _run(triton_sparse, c)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(first, _run(triton_sparse, c), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("query_block_pages", [1, 3], ids=["per-block", "one-group-expanded"])
def test_engine_with_the_triton_backend_matches_the_torch_backend(query_block_pages):
    """A sparse step through the Triton kernels (interpreted on CPU) equals the torch reference's; with
    one group per chunk the kernels read a selection with stride 0 over the blocks."""
    from helpers import build_tiny_model, grads, random_ids, relative_error

    import oomb

    model = build_tiny_model("qwen2", seed=40, num_hidden_layers=1).to(DEVICE)
    ids = random_ids(1, 72, seed=40).to(DEVICE)  # chunks of 24 in pages of 8: 3, 6 history pages
    results = {}
    for backend in ("torch", "triton"):
        model.zero_grad(set_to_none=True)
        config = oomb.OOMBConfig(chunk_size=24, page_size=8, attention="sparse",
                                 sparse=SparseConfig(budget=1, query_block_pages=query_block_pages),
                                 performance=PerformanceConfig(backend=backend, checkpoint_layers=False))
        results[backend] = (oomb.forward_backward(model, ids, None, config), grads(model))
    torch.testing.assert_close(results["triton"][0], results["torch"][0], rtol=1e-5, atol=0)
    assert relative_error(results["triton"][1], results["torch"][1]) <= 1e-5


@pytest.mark.gpu
def test_gpu_sparse_step_triton_matches_torch_and_full_budget_is_dense():
    """End to end on a GPU in fp32: the Triton sparse step equals the torch one up to rounding, and a
    budget covering every page gives the dense Triton step bit for bit."""
    from helpers import grads, relative_error
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import oomb

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    model = Qwen2ForCausalLM(cfg).cuda().float()
    ids = torch.randint(0, cfg.vocab_size, (2, 2100), device="cuda")
    results = {}
    for name, options in (("torch", dict(attention="sparse", performance=PerformanceConfig(backend="torch"),
                                         sparse=SparseConfig(budget=4))),
                          ("triton", dict(attention="sparse", performance=PerformanceConfig(backend="triton"),
                                          sparse=SparseConfig(budget=4))),
                          ("dense", dict(performance=PerformanceConfig(backend="triton"))),
                          ("full", dict(attention="sparse", performance=PerformanceConfig(backend="triton"),
                                        sparse=SparseConfig(budget=40)))):
        model.zero_grad(set_to_none=True)
        loss = oomb.forward_backward(model, ids, config=oomb.OOMBConfig(chunk_size=512, page_size=64, **options))
        results[name] = (loss, grads(model))
    assert relative_error(results["triton"][1], results["torch"][1]) <= 1e-4
    assert torch.equal(results["full"][0], results["dense"][0])
    assert all(torch.equal(results["full"][1][n], results["dense"][1][n]) for n in results["dense"][1])


@pytest.mark.parametrize("B,Hq,Hkv,Lq,history_pages,D,P,K", [
    pytest.param(2, 4, 2, 40, 5, 16, 16, 3, id="G2-P16-K3"),
    pytest.param(1, 2, 1, 30, 4, 16, 12, 2, id="G2-P12-K2"),
    pytest.param(1, 4, 2, 20, 3, 16, 8, 2, id="G2-P8-K2"),
])
def test_documents_match_sparse_reference(B, Hq, Hkv, Lq, history_pages, D, P, K):
    """Packed documents: starts inside selected history pages, inside the chunk (rows that see no
    history key at all), and one row whose document began before every history page."""
    from oomb.documents import resolve_documents

    c = make_case(B, Hq, Hkv, Lq, history_pages, D, P, K, seed=3)
    T, H = c.history + Lq, c.history
    rows = [[0, P + 3, H + 5, T], [0, T]][:B]  # row 0: a start mid-page in history and one in the chunk
    docs = resolve_documents(None, rows, (B, T), torch.device(DEVICE))
    args = (*c.args(),)
    out, lse = triton_sparse.sparse_attention_forward(*args, documents=docs)
    ref_out, ref_lse = reference_sparse.sparse_attention_forward(*args, documents=docs)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)
    plain, _ = reference_sparse.sparse_attention_forward(*args)
    assert not torch.allclose(ref_out, plain)  # the documents change the attention
    start = torch.randn(c.k_pool.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    grads = {}
    for name, backend in (("triton", triton_sparse), ("reference", reference_sparse)):
        dk, dv = start.clone(), -start
        dq = backend.sparse_attention_backward(*args, ref_out, c.dout, ref_lse, dk, dv, documents=docs)
        grads[name] = (dq, dk, dv)
    for got, want in zip(grads["triton"], grads["reference"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Logit softcapping (Gemma 2): scores c * tanh(scale * q.k / c) over the selected pages and the chunk
# ---------------------------------------------------------------------------------------------
SOFTCAP = 1.5
"""With queries scaled by 3 the scores reach a few units: the cap bends them hard."""


def _run_capped(backend, c: Case, softcap: float, out=None, lse=None, **kwargs):
    """(out, lse, dq, dk, dv); backward from the given (reference) out and lse when passed."""
    fwd_out, fwd_lse = backend.sparse_attention_forward(*c.args(), softcap=softcap, **kwargs)
    out, lse = (fwd_out, fwd_lse) if out is None else (out, lse)
    dk = torch.zeros(c.k_pool.shape, dtype=torch.float32, device=c.q.device)
    dv = torch.zeros_like(dk)
    dq = backend.sparse_attention_backward(*c.args(), out, c.dout, lse, dk, dv, softcap=softcap, **kwargs)
    return fwd_out, fwd_lse, dq, dk, dv


@pytest.mark.slow
@pytest.mark.parametrize("B,Hq,Hkv,Lq,history_pages,D,P,K,documents", [
    pytest.param(2, 4, 2, 40, 5, 16, 16, 2, False, id="G2-P16-K2"),
    pytest.param(1, 2, 1, 30, 4, 16, 12, 2, False, id="G2-P12-K2"),
    pytest.param(2, 4, 2, 40, 5, 16, 16, 3, True, id="G2-P16-K3-documents"),
])
def test_softcap_matches_sparse_reference(B, Hq, Hkv, Lq, history_pages, D, P, K, documents):
    """fp32: the capped sparse kernels (selected pages, the chunk's diagonal, the history dK/dV work
    items, the chunk's own dK/dV) equal the capped sparse reference; the cap changes the result."""
    from oomb.documents import resolve_documents

    c = make_case(B, Hq, Hkv, Lq, history_pages, D, P, K, seed=6)
    c.q = c.q * 3.0
    kwargs = {}
    if documents:
        T, H = c.history + Lq, c.history
        kwargs["documents"] = resolve_documents(None, [[0, P + 3, H + 5, T], [0, T]][:B], (B, T),
                                                torch.device(DEVICE))
    want = _run_capped(reference_sparse, c, SOFTCAP, **kwargs)
    got = _run_capped(triton_sparse, c, SOFTCAP, out=want[0], lse=want[1], **kwargs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    uncapped, _ = reference_sparse.sparse_attention_forward(*c.args(), **kwargs)
    assert (uncapped - want[0]).abs().max() > 0.1


def test_softcap_with_a_covering_selection_equals_dense():
    """Every history page selected by every block: the capped sparse reference is the capped dense one."""
    from oomb.attention import reference

    c = make_case(1, 4, 2, 24, 3, 16, 8, 3, seed=7)
    c.q = c.q * 3.0
    c.selection = torch.arange(3, dtype=torch.int32, device=DEVICE).expand(1, 2, 3, 3)
    sparse_out, sparse_lse = reference_sparse.sparse_attention_forward(*c.args(), softcap=SOFTCAP)
    dense_out, dense_lse = reference.paged_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, c.history,
                                                             c.scale, softcap=SOFTCAP)
    torch.testing.assert_close(sparse_out, dense_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sparse_lse, dense_lse, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv,D,P,history_pages,Lq,K", GPU_CASES[:2])
def test_gpu_softcap_bf16_error_within_twice_reference(Hq, Hkv, D, P, history_pages, Lq, K):
    """Gemma 2's cap of 50 with scores of tens: bf16 error at most 2x the sparse reference's on bf16 inputs."""
    exact = make_case(2, Hq, Hkv, Lq, history_pages, D, P, K)
    exact.q = exact.q * 30.0
    low = Case(*(t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                 for t in vars(exact).values()))
    want = _run_capped(reference_sparse, exact, 50.0)
    ref = _run_capped(reference_sparse, low, 50.0)
    got = _run_capped(triton_sparse, low, 50.0)
    for name, g, r, w in zip(("out", "lse", "dq", "dk", "dv"), got, ref, want, strict=True):
        ours, theirs = _max_err(g, w), _max_err(r, w)
        eps = 1e-4 * w.abs().max().item()
        print(f"sparse softcap bf16 error {name}: ours {ours:.3e}, reference on bf16 inputs {theirs:.3e}")
        assert ours <= 2 * theirs + eps, f"{name}: ours {ours:.3e} vs reference-on-bf16 {theirs:.3e}"
    again = _run_capped(triton_sparse, low, 50.0)
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
