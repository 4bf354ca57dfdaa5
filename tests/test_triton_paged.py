"""Triton paged attention vs the reference backend (oomb.attention.reference).

CPU: the kernels run in the Triton interpreter (conftest sets TRITON_INTERPRET=1) at tiny shapes
(head dims 16-32, pages of 8-32 tokens, a few pages): the interpreter costs ~10 ms per tile.
GPU (``-m gpu``, H200): production shapes in bfloat16, with errors bounded by the reference
backend's own error on bfloat16 inputs, and bit-exact repeat runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from oomb.attention import reference

triton_paged = pytest.importorskip("oomb.attention.triton_paged")

# The interpreter (triton 3.6 with numpy 2.x) warns on every loop bound it converts: noise only.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

# The small cases run interpreted on CPU, and as real kernels where CUDA exists.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Case:
    """Paged inputs of one chunk: B sequences of `history` cached tokens plus Lq new ones."""

    q: torch.Tensor  # (B, Hq, Lq, D), a transposed (non-contiguous) view as HF hands it over
    k_pool: torch.Tensor  # (num_pages, Hkv, P, D)
    v_pool: torch.Tensor
    page_table: torch.Tensor  # (B, n_pages + spare) int32, shuffled page ids
    dout: torch.Tensor  # (B, Hq, Lq, D)
    history: int
    scale: float

    def at(self, dtype: torch.dtype) -> Case:
        """The same case with q, k, v, dout rounded to ``dtype``."""
        return Case(self.q.to(dtype), self.k_pool.to(dtype), self.v_pool.to(dtype), self.page_table,
                    self.dout.to(dtype), self.history, self.scale)


def make_case(B, Hq, Hkv, Lq, history, D, P, dtype=torch.float32, device=DEVICE, seed=0) -> Case:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n_pages = math.ceil((history + Lq) / P)
    spare = 3  # pages no sequence uses: they must stay untouched
    num_pages = B * n_pages + spare
    k_pool = torch.randn(num_pages, Hkv, P, D, generator=gen)
    v_pool = torch.randn(num_pages, Hkv, P, D, generator=gen)
    ids = torch.randperm(num_pages, generator=gen)[: B * n_pages].reshape(B, n_pages)
    # One extra column: tables may be wider than the chunk needs.
    page_table = torch.cat([ids, ids[:, :1]], dim=1).to(torch.int32)
    q = torch.randn(B, Lq, Hq, D, generator=gen).transpose(1, 2)
    dout = torch.randn(B, Hq, Lq, D, generator=gen)
    case = Case(q, k_pool, v_pool, page_table, dout, history, D**-0.5)
    case = Case(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in vars(case).values()))
    return case.at(dtype)


def run_forward(backend, c: Case):
    return backend.paged_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale)


def run_backward(backend, c: Case, out, lse, grad_dtype=torch.float32, dk_init=None):
    if dk_init is None:
        dk = torch.zeros(c.k_pool.shape, dtype=grad_dtype, device=c.q.device)
        dv = torch.zeros_like(dk)
    else:
        dk, dv = dk_init.clone(), -dk_init
    dq = backend.paged_attention_backward(
        c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale, out, c.dout, lse, dk, dv
    )
    return dq, dk, dv


# (B, Hq, Hkv, Lq, history, D, P): GQA groups 1/2/4/7, histories of 0 and several pages (the
# reference takes page-aligned chunk starts only), partial last pages, pages larger and smaller
# than the interpreter's 16-key tile, a non-power-of-two page (12) and head dim (24), one query.
CPU_CASES = [
    pytest.param(2, 2, 2, 24, 0, 16, 16, id="G1-nohistory"),
    pytest.param(2, 4, 2, 24, 48, 16, 16, id="G2-hist48-P16"),
    pytest.param(2, 8, 2, 17, 64, 32, 32, id="G4-hist64-P32"),
    pytest.param(2, 7, 1, 13, 36, 24, 12, id="G7-D24-P12"),
    pytest.param(2, 8, 2, 20, 56, 16, 8, id="G4-P8-multipage-tiles"),
    pytest.param(2, 4, 2, 1, 48, 16, 16, id="G2-one-query"),
]
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
# dK, dV land in fp32 pools; on a GPU the fp16 kernels round P and dS to fp16 before the dots.
GRAD_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("B,Hq,Hkv,Lq,history,D,P", CPU_CASES)
def test_matches_reference(B, Hq, Hkv, Lq, history, D, P, dtype):
    c = make_case(B, Hq, Hkv, Lq, history, D, P, dtype)
    out, lse = run_forward(triton_paged, c)
    ref_out, ref_lse = run_forward(reference, c)
    assert out.dtype == dtype and out.shape == c.q.shape and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)

    # Non-zero gradient pools: the backward must add into them.
    dk_init = torch.randn(c.k_pool.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    dq, dk, dv = run_backward(triton_paged, c, ref_out, ref_lse, dk_init=dk_init)
    ref_dq, ref_dk, ref_dv = run_backward(reference, c, ref_out, ref_lse, dk_init=dk_init)
    assert dq.dtype == dtype and dq.shape == c.q.shape
    torch.testing.assert_close(dq, ref_dq, **TOL[dtype])
    torch.testing.assert_close(dk, ref_dk, **GRAD_TOL[dtype])
    torch.testing.assert_close(dv, ref_dv, **GRAD_TOL[dtype])


def test_bfloat16_small():
    """bf16 (interpreted: the upcast path, so only the output rounding differs from the reference)."""
    c = make_case(2, 8, 2, 20, 48, 16, 16, torch.bfloat16)
    out, lse = run_forward(triton_paged, c)
    ref_out, ref_lse = run_forward(reference, c)
    torch.testing.assert_close(out, ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)
    dq, dk, dv = run_backward(triton_paged, c, ref_out, ref_lse, grad_dtype=torch.bfloat16)
    ref_dq, ref_dk, ref_dv = run_backward(reference, c, ref_out, ref_lse, grad_dtype=torch.bfloat16)
    for got, want in ((dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_unused_slots_are_never_read_or_written():
    """NaN in pages outside the table and in the last page's unused slots must not leak anywhere."""
    B, Hq, Hkv, Lq, history, D, P = 2, 4, 2, 21, 32, 16, 16
    c = make_case(B, Hq, Hkv, Lq, history, D, P)
    num_keys = history + Lq
    used = c.page_table[:, : math.ceil(num_keys / P)]
    last_fill = num_keys - (used.shape[1] - 1) * P  # slots in use in each sequence's last page
    poisoned = Case(*vars(c).values())
    poisoned.k_pool, poisoned.v_pool = c.k_pool.clone(), c.v_pool.clone()
    unused = torch.ones(c.k_pool.shape[0], dtype=torch.bool, device=DEVICE)
    unused[used.flatten().long()] = False
    for pool in (poisoned.k_pool, poisoned.v_pool):
        pool[unused] = float("nan")
        pool[used[:, -1].long(), :, last_fill:] = float("nan")

    out, lse = run_forward(triton_paged, poisoned)
    ref_out, ref_lse = run_forward(reference, c)
    torch.testing.assert_close(out, ref_out, **TOL[torch.float32])
    dq, dk, dv = run_backward(triton_paged, poisoned, ref_out, ref_lse)
    ref_dq, ref_dk, ref_dv = run_backward(reference, c, ref_out, ref_lse)
    torch.testing.assert_close(dq, ref_dq, **TOL[torch.float32])
    torch.testing.assert_close(dk, ref_dk, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dv, ref_dv, atol=1e-4, rtol=1e-4)
    assert (dk[unused] == 0).all() and (dk[used[:, -1].long(), :, last_fill:] == 0).all()


def _dense(pool: torch.Tensor, page_table: torch.Tensor, num_keys: int) -> torch.Tensor:
    """(B, Hkv, num_keys, D) view of a sequence's pages, in token order."""
    pages = pool[page_table.long()]  # (B, n, Hkv, P, D)
    B, n, Hkv, P, D = pages.shape
    return pages.permute(0, 2, 1, 3, 4).reshape(B, Hkv, n * P, D)[:, :, :num_keys]


def test_unaligned_query_start_matches_dense_autograd():
    """The kernels also take chunks that start inside a page (the reference does not): check them
    against autograd through plain dense attention."""
    B, Hq, Hkv, Lq, history, D, P = 2, 7, 1, 13, 37, 16, 16
    c = make_case(B, Hq, Hkv, Lq, history, D, P)
    num_keys = history + Lq
    table = c.page_table[:, : math.ceil(num_keys / P)]
    q = c.q.detach().clone().requires_grad_()
    k = _dense(c.k_pool, table, num_keys).detach().requires_grad_()
    v = _dense(c.v_pool, table, num_keys).detach().requires_grad_()
    want = reference.dense_causal_attention(q, k, v, c.scale)
    want.backward(c.dout)

    out, lse = run_forward(triton_paged, c)
    torch.testing.assert_close(out, want.detach(), **TOL[torch.float32])
    dq, dk, dv = run_backward(triton_paged, c, out, lse)
    torch.testing.assert_close(dq, q.grad, **TOL[torch.float32])
    torch.testing.assert_close(_dense(dk, table, num_keys), k.grad, **GRAD_TOL[torch.float32])
    torch.testing.assert_close(_dense(dv, table, num_keys), v.grad, **GRAD_TOL[torch.float32])


def test_repeat_runs_are_bit_identical():
    c = make_case(2, 7, 1, 19, 45, 16, 16)
    out, lse = run_forward(triton_paged, c)
    first = run_backward(triton_paged, c, out, lse)
    out2, lse2 = run_forward(triton_paged, c)
    second = run_backward(triton_paged, c, out2, lse2)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_contiguous_and_strided_inputs_agree():
    """q/dout layouts (HF transpose view vs contiguous) must not change the result."""
    c = make_case(2, 4, 2, 18, 20, 16, 16)
    out, lse = run_forward(triton_paged, c)
    dense = Case(*vars(c).values())
    dense.q, dense.dout = c.q.contiguous(), c.dout.transpose(1, 2).contiguous().transpose(1, 2)
    out2, lse2 = run_forward(triton_paged, dense)
    torch.testing.assert_close(out, out2, atol=0, rtol=0)
    torch.testing.assert_close(run_backward(triton_paged, c, out, lse)[0],
                               run_backward(triton_paged, dense, out2, lse2)[0], atol=0, rtol=0)


def test_empty_chunk():
    c = make_case(2, 4, 2, 0, 16, 16, 16)
    out, lse = run_forward(triton_paged, c)
    assert out.shape == (2, 4, 0, 16) and lse.shape == (2, 4, 0)


def test_launchers_reject_bad_inputs():
    c = make_case(1, 4, 2, 8, 16, 16, 16)
    fwd = triton_paged.paged_attention_forward
    with pytest.raises(ValueError, match="page_table must be int32"):
        fwd(c.q, c.k_pool, c.v_pool, c.page_table.long(), c.history, c.scale)
    with pytest.raises(ValueError, match="need 2 pages"):
        fwd(c.q, c.k_pool, c.v_pool, c.page_table[:, :1], c.history, c.scale)
    with pytest.raises(ValueError, match="multiple of the 3 KV heads"):
        fwd(c.q, c.k_pool[:, :1].expand(-1, 3, -1, -1), c.v_pool[:, :1].expand(-1, 3, -1, -1),
            c.page_table, c.history, c.scale)
    with pytest.raises(TypeError, match="share a dtype"):
        fwd(c.q, c.k_pool.half(), c.v_pool.half(), c.page_table, c.history, c.scale)
    with pytest.raises(ValueError, match="head_dim"):
        fwd(c.q[..., :8], c.k_pool, c.v_pool, c.page_table, c.history, c.scale)
    with pytest.raises(ValueError, match="query_start"):
        fwd(c.q, c.k_pool, c.v_pool, c.page_table, -1, c.scale)
    out, lse = fwd(c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale)
    with pytest.raises(ValueError, match="dk_pool"):
        triton_paged.paged_attention_backward(c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale,
                                              out, c.dout, lse, c.k_pool[:1].float(), c.v_pool.float())
    with pytest.raises(ValueError, match="lse must be float32"):
        triton_paged.paged_attention_backward(c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale,
                                              out, c.dout, lse[:, :, :1], c.k_pool, c.v_pool)


# ---------------------------------------------------------------------------------------------
# Logit softcapping (Gemma 2): scores c * tanh(scale * q.k / c), constexpr SOFTCAP in the kernels
# ---------------------------------------------------------------------------------------------
SOFTCAP = 1.5
"""Strong enough to bend the scores of SOFTCAP_GAIN-scaled queries (a few units) hard."""
SOFTCAP_GAIN = 3.0


def capped_case(*shape, dtype=torch.float32, device=DEVICE, seed=0) -> Case:
    """make_case with queries scaled so that scores reach a few units and the cap matters."""
    c = make_case(*shape, device=device, seed=seed)
    c.q = c.q * SOFTCAP_GAIN
    return c.at(dtype)


def run_capped(backend, c: Case, softcap=SOFTCAP, grad_dtype=torch.float32, out=None, lse=None, **kwargs):
    """(out, lse, dq, dk, dv) with the cap; backward from the given (reference) out and lse when passed."""
    fwd_out, fwd_lse = backend.paged_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale,
                                                       softcap=softcap, **kwargs)
    out, lse = (fwd_out, fwd_lse) if out is None else (out, lse)
    dk = torch.zeros(c.k_pool.shape, dtype=grad_dtype, device=c.q.device)
    dv = torch.zeros_like(dk)
    dq = backend.paged_attention_backward(c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale, out, c.dout,
                                          lse, dk, dv, softcap=softcap, **kwargs)
    return fwd_out, fwd_lse, dq, dk, dv


SOFTCAP_CASES = [
    pytest.param(2, 2, 2, 24, 0, 16, 16, id="G1-nohistory"),
    pytest.param(2, 7, 1, 13, 36, 24, 12, id="G7-D24-P12"),
    pytest.param(2, 8, 2, 20, 56, 16, 8, id="G4-P8-multipage-tiles"),
]


@pytest.mark.parametrize("B,Hq,Hkv,Lq,history,D,P", SOFTCAP_CASES)
def test_softcap_matches_reference(B, Hq, Hkv, Lq, history, D, P):
    """fp32: forward and backward (dS times 1 - tanh^2) equal the torch backend's, partial last pages
    included; and the cap changes the result (the test exercises it)."""
    c = capped_case(B, Hq, Hkv, Lq, history, D, P)
    want = run_capped(reference, c)
    got = run_capped(triton_paged, c, out=want[0], lse=want[1])
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(g, w, **GRAD_TOL[torch.float32], msg=lambda m, name=name: f"{name}: {m}")
    uncapped, _ = run_forward(triton_paged, c)
    assert (uncapped - got[0]).abs().max() > 0.1


def test_softcap_bfloat16_small():
    """bf16 inputs and gradient pools (interpreted: fp32 dots, so the roundings of out and the pools differ)."""
    c = capped_case(2, 8, 2, 20, 48, 16, 16, dtype=torch.bfloat16)
    want = run_capped(reference, c, grad_dtype=torch.bfloat16)
    got = run_capped(triton_paged, c, grad_dtype=torch.bfloat16, out=want[0], lse=want[1])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
def test_softcap_with_key_windows_and_documents():
    """The cap with everything else that masks: per-query document starts (one inside the chunk, one
    inside a page), history windows of one page (one before every document: lse -inf there) and the
    chunk's window, a partial last page; merged forward and summed backward equal the torch backend's."""
    from oomb.documents import resolve_documents

    B, Hq, Hkv, Lq, history, D, P = 2, 4, 2, 21, 32, 16, 8
    c = capped_case(B, Hq, Hkv, Lq, history, D, P, seed=5)
    T = history + Lq
    docs = resolve_documents(None, [[0, 10, 19, 40, T], [0, 27, 30, T]], (B, T), torch.device(DEVICE))
    windows = [(lo, lo + P) for lo in range(0, history, P)] + [(history, T)]
    results = []
    for backend in (reference, triton_paged):
        parts = [backend.paged_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, history, c.scale,
                                                 key_range=kr, out_dtype=torch.float32, documents=docs,
                                                 softcap=SOFTCAP) for kr in windows]
        out, lse = reference.merge_partials(*map(list, zip(*parts, strict=True)))
        dk, dv = torch.zeros_like(c.k_pool), torch.zeros_like(c.v_pool)
        dq = torch.zeros(c.q.shape, device=c.q.device)
        delta = reference.backward_delta(out, c.dout)
        for kr in windows:
            backend.paged_attention_backward(c.q, c.k_pool, c.v_pool, c.page_table, history, c.scale, None, c.dout,
                                             lse, dk, dv, key_range=kr, delta=delta, dq_accumulator=dq,
                                             documents=docs, softcap=SOFTCAP)
        results.append((out, lse, dq, dk, dv))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, **GRAD_TOL[torch.float32])


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("inf"), True, "50"])
def test_softcap_must_be_a_positive_number(softcap):
    c = make_case(1, 4, 2, 8, 16, 16, 16)
    with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
        triton_paged.paged_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, c.history, c.scale,
                                             softcap=softcap)


def test_head_dims_above_128_try_the_wide_tiles_first():
    """The pruning the GPU autotuner runs (the interpreter has one config): head dims above 128 get the
    low-spill tiles in front of the kernel's list (float32: the first whose staged tiles fit shared
    memory), head dims up to 128 exactly the kernel's list."""
    import triton

    def config(m, n, w, s):
        return triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)

    tuned, wide = [config(128, 64, 8, 3), config(64, 128, 8, 3)], [config(64, 32, 8, 2), config(32, 32, 4, 2)]
    prune = triton_paged._pruner(wide)["early_config_prune"]
    bf16 = {"q_ptr": torch.empty(1, dtype=torch.bfloat16)}
    fp32 = {"q_ptr": torch.empty(1)}
    pinned = not triton_paged.AUTOTUNE  # OOMB_TRITON_AUTOTUNE=0: the first config left
    assert prune(tuned, bf16, BLOCK_D=128) == (tuned[:1] if pinned else tuned)
    assert prune(tuned, bf16, BLOCK_D=256) == (wide[:1] if pinned else wide + tuned)
    assert prune(tuned, fp32, BLOCK_D=256) == wide[:1]  # 2 x (64 + 32) x 256 x 4 bytes fit; 128 + 64 rows do not
    assert prune(tuned, fp32, BLOCK_D=128) == tuned[:1]
    dkdv = [config(64, 128, 8, 3), config(32, 128, 4, 4), config(64, 64, 4, 3)]  # _DKDV_CONFIGS' tiles
    assert prune(dkdv, fp32, BLOCK_D=128) == dkdv[2:]  # the pinned first one needs 294,912 bytes: out of resources



# ---------------------------------------------------------------------------------------------
# GPU: production shapes, bfloat16
# ---------------------------------------------------------------------------------------------
def _max_err(got, want):
    return (got.float() - want.float()).abs().max().item()


# (Hq, Hkv, D, P, history, Lq): GQA 1/4/7/8, head dims 64/128, pages 64/128, histories 0..64K.
GPU_CASES = [
    pytest.param(4, 4, 64, 64, 0, 300, id="G1-D64-P64-h0"),
    pytest.param(4, 4, 64, 64, 1024, 300, id="G1-D64-P64-h1024"),
    pytest.param(8, 2, 128, 128, 8192, 256, id="G4-D128-P128-h8K"),
    pytest.param(14, 2, 128, 128, 65536, 256, id="G7-D128-P128-h64K"),
    pytest.param(14, 2, 128, 128, 2944, 333, id="G7-D128-P128-h2944"),
    pytest.param(16, 2, 128, 64, 4160, 200, id="G8-D128-P64-h4160"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv,D,P,history,Lq", GPU_CASES)
def test_gpu_bf16_error_within_twice_reference(Hq, Hkv, D, P, history, Lq):
    """Against an fp32 reference on the unrounded inputs, our bf16 error is at most twice the
    reference backend's own error on the same bf16 inputs (its arithmetic is fp32, so that error is
    what bf16 inputs and bf16 outputs alone cost), plus a margin far below bf16 resolution."""
    exact = make_case(2, Hq, Hkv, Lq, history, D, P, torch.float32, device="cuda")
    low = exact.at(torch.bfloat16)
    want_out, want_lse = run_forward(reference, exact)
    want = run_backward(reference, exact, want_out, want_lse)
    ref_out, ref_lse = run_forward(reference, low)
    ref = run_backward(reference, low, ref_out, ref_lse)
    out, lse = run_forward(triton_paged, low)
    got = run_backward(triton_paged, low, out, lse)
    names = ("out", "lse", "dq", "dk", "dv")
    triples = zip((out, lse, *got), (ref_out, ref_lse, *ref), (want_out, want_lse, *want), strict=True)
    for name, (g, r, w) in zip(names, triples, strict=True):
        ours, theirs = _max_err(g, w), _max_err(r, w)
        eps = 1e-4 * w.abs().max().item()  # bf16 resolution is 2**-8 = 3.9e-3 relative
        print(f"bf16 error {name}: ours {ours:.3e}, reference on bf16 inputs {theirs:.3e}")
        assert ours <= 2 * theirs + eps, f"{name}: ours {ours:.3e} vs reference-on-bf16 {theirs:.3e}"


@pytest.mark.gpu
def test_gpu_fp16_and_bf16_pools():
    """fp16 inputs and bf16 gradient pools (one rounding per slot, as the reference)."""
    c = make_case(2, 8, 2, 256, 2048, 128, 128, torch.float16, device="cuda")
    out, lse = run_forward(triton_paged, c)
    ref_out, ref_lse = run_forward(reference, c)
    torch.testing.assert_close(out, ref_out, atol=2e-3, rtol=2e-3)
    got = run_backward(triton_paged, c, ref_out, ref_lse, grad_dtype=torch.bfloat16)
    ref = run_backward(reference, c, ref_out, ref_lse, grad_dtype=torch.bfloat16)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g.float(), r.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_repeat_runs_are_bit_identical():
    c = make_case(2, 28, 4, 512, 16384, 128, 128, torch.bfloat16, device="cuda")
    out, lse = run_forward(triton_paged, c)
    first = run_backward(triton_paged, c, out, lse)
    for _ in range(3):
        out2, lse2 = run_forward(triton_paged, c)
        again = run_backward(triton_paged, c, out2, lse2)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv,D,P,history,Lq", [GPU_CASES[2], GPU_CASES[4], GPU_CASES[5]])
def test_gpu_softcap_bf16_error_within_twice_reference(Hq, Hkv, D, P, history, Lq):
    """As test_gpu_bf16_error_within_twice_reference with Gemma 2's cap (50, reached by queries scaled to
    scores of tens): the softcapped kernels' bf16 error stays within twice the torch backend's own."""
    exact = make_case(2, Hq, Hkv, Lq, history, D, P, torch.float32, device="cuda")
    exact.q = exact.q * 30.0  # scores of tens (std about 30): the cap of 50 bends them
    low = exact.at(torch.bfloat16)
    want = run_capped(reference, exact, softcap=50.0)
    ref = run_capped(reference, low, softcap=50.0)
    got = run_capped(triton_paged, low, softcap=50.0)
    for name, g, r, w in zip(("out", "lse", "dq", "dk", "dv"), got, ref, want, strict=True):
        ours, theirs = _max_err(g, w), _max_err(r, w)
        eps = 1e-4 * w.abs().max().item()
        print(f"softcap bf16 error {name}: ours {ours:.3e}, reference on bf16 inputs {theirs:.3e}")
        assert ours <= 2 * theirs + eps, f"{name}: ours {ours:.3e} vs reference-on-bf16 {theirs:.3e}"


@pytest.mark.gpu
def test_gpu_softcap_fp32_matches_reference_and_repeats_bitwise():
    """fp32 (IEEE dots) at a production shape: the softcapped kernels equal the torch backend to float32
    rounding, and two runs are bit-identical (no atomics were added)."""
    c = capped_case(2, 28, 4, 512, 8192, 128, 128, device="cuda")
    want = run_capped(reference, c, softcap=5.0)
    got = run_capped(triton_paged, c, softcap=5.0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    low = c.at(torch.bfloat16)
    first = run_capped(triton_paged, low, softcap=5.0)
    again = run_capped(triton_paged, low, softcap=5.0)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


MARKER = -777777
"""A page id no table holds: put where a kernel must not read (past a table's width, before its window)."""


@pytest.mark.skipif(DEVICE != "cpu", reason="instruments the Triton interpreter's loads")
@pytest.mark.parametrize("P,Lq,key_range", [(8, 20, (0, 8)), (8, 20, (24, 32)), (16, 20, (16, 32)), (8, 5, None)],
                         ids=["P8-first-window", "P8-last-window", "P16-window", "P8-short-chunk"])
def test_forward_reads_no_page_table_entry_it_does_not_need(P, Lq, key_range, monkeypatch):
    """The forward looks each tile's pages up a tile ahead; a call that visits no tile (an empty range, as
    windows and short chunks make) must still read no table entry outside its window or past the table's
    width (offload's window tables are exactly that wide). Every int32 load the interpreter makes is checked
    for MARKER."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if not hasattr(builder, "create_masked_load"):
        pytest.skip("this Triton's interpreter has no create_masked_load to instrument")
    seen = []
    original = builder.create_masked_load

    def recording_load(self, ptrs, mask, other, *args, **kwargs):
        loaded = original(self, ptrs, mask, other, *args, **kwargs)
        if loaded.data.dtype == np.int32:
            seen.append(bool(np.any((loaded.data == MARKER) & np.broadcast_to(mask.data, loaded.data.shape))))
        return loaded

    monkeypatch.setattr(builder, "create_masked_load", recording_load)
    B, Hq, Hkv, D, history = 1, 2, 1, 16, 32 if key_range else 0
    gen = torch.Generator().manual_seed(7)
    pages = (history + Lq + P - 1) // P
    k_pool, v_pool = (torch.randn(pages + 2, Hkv, P, D, generator=gen) for _ in range(2))
    ids = torch.randperm(pages + 2, generator=gen)[:pages].reshape(B, pages).to(torch.int32)
    q = torch.randn(B, Hq, Lq, D, generator=gen)
    lo, hi = key_range or (0, history + Lq)
    width = -(-hi // P)
    padded = torch.full((B, width + 4), MARKER, dtype=torch.int32)  # past the width: MARKER
    padded[:, :width] = ids[:, :width]
    padded[:, :lo // P] = MARKER  # before the window: MARKER
    kwargs = dict(key_range=key_range, out_dtype=torch.float32) if key_range else {}
    got = triton_paged.paged_attention_forward(q, k_pool, v_pool, padded[:, :width], history, D ** -0.5, **kwargs)
    want = reference.paged_attention_forward(q, k_pool, v_pool, ids, history, D ** -0.5, **kwargs)
    assert seen and not any(seen)
    torch.testing.assert_close(got[0], want[0], rtol=2e-5, atol=2e-5)
