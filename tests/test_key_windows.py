"""Key windows of the dense paged attention (reference.py's contract, ``key_range=``).

Host offload streams a layer's history through the GPU a few pages at a time, so a chunk's
attention is computed as partial attentions over disjoint key windows (history blocks, then the
chunk itself), merged by their log-sum-exp; backward runs per window with the merged statistics.
Checked for both backends (the torch reference; Triton, interpreted on CPU): merged forward and
summed backward equal the unwindowed results, also through small staging pools with their own
page tables; nothing outside a window is read; bad windows are refused.

CPU shapes are tiny (the interpreter costs ~10 ms per tile): pages of 16 (one page per 16-key
interpreter tile), 12 and 4 (tiles straddle pages and window edges: the per-key path and masked
edge tiles), GQA groups 1 and 4, head dim 32, float32. The GPU test (``-m gpu``) repeats the
equality in bfloat16 at production shapes against a float64 oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

from oomb.attention import reference

# The interpreter (triton 3.6 with numpy 2.x) warns on every loop bound it converts: noise only.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(rtol=1e-5, atol=1e-5)
"""float32: merged windows vs one pass differ only in the order of float32 sums."""
BACKENDS = ["reference", "triton"]
BACKENDS_TRITON_SLOW = ["reference", pytest.param("triton", marks=pytest.mark.slow)]  # the interpreter: ~4 s a case


def _backend(name: str):
    if name == "reference":
        return reference
    return pytest.importorskip("oomb.attention.triton_paged")


@dataclass
class Case:
    """One chunk of Lq queries after `query_start` cached keys, in shuffled pages."""

    q: torch.Tensor  # (B, Hq, Lq, D), a transposed view as HF hands it over
    k_pool: torch.Tensor  # (num_pages, Hkv, P, D)
    v_pool: torch.Tensor
    page_table: torch.Tensor  # (B, n_pages + 1) int32
    dout: torch.Tensor
    query_start: int
    scale: float

    @property
    def page(self) -> int:
        return self.k_pool.shape[2]

    @property
    def num_keys(self) -> int:
        return self.query_start + self.q.shape[2]

    def at(self, dtype: torch.dtype) -> Case:
        return replace(self, q=self.q.to(dtype), k_pool=self.k_pool.to(dtype), v_pool=self.v_pool.to(dtype),
                       dout=self.dout.to(dtype))


def make_case(B, Hq, Hkv, Lq, history_pages, D, P, device=DEVICE, seed=0) -> Case:
    gen = torch.Generator().manual_seed(seed)
    query_start = history_pages * P
    n_pages = math.ceil((query_start + Lq) / P)
    num_pages = B * n_pages + 3  # 3 pages no sequence uses
    k_pool = torch.randn(num_pages, Hkv, P, D, generator=gen)
    v_pool = torch.randn(num_pages, Hkv, P, D, generator=gen)
    ids = torch.randperm(num_pages, generator=gen)[: B * n_pages].reshape(B, n_pages)
    page_table = torch.cat([ids, ids[:, :1]], dim=1).to(torch.int32)  # one spare column
    q = torch.randn(B, Lq, Hq, D, generator=gen).transpose(1, 2)
    dout = torch.randn(B, Hq, Lq, D, generator=gen)
    c = Case(q, k_pool, v_pool, page_table, dout, query_start, D**-0.5)
    return replace(c, **{k: v.to(device) for k, v in vars(c).items() if isinstance(v, torch.Tensor)})


def key_windows(c: Case, split: tuple[int, ...]) -> list[tuple[int, int]]:
    """History windows of `split` pages each (covering [0, query_start)), then the local window."""
    assert sum(split) * c.page == c.query_start
    bounds = [0]
    for pages in split:
        bounds.append(bounds[-1] + pages * c.page)
    return [*zip(bounds[:-1], bounds[1:], strict=True), (c.query_start, c.num_keys)]


def _pages(c: Case, window: tuple[int, int]) -> tuple[int, int]:
    """Table columns [first, last) of the pages holding the window's keys."""
    return window[0] // c.page, -(-window[1] // c.page)


def stage(c: Case, window: tuple[int, int], dk: torch.Tensor, dv: torch.Tensor):
    """Copy a history window's K, V, dK, dV into small staging pools addressed by a table of
    ceil(hi / P) columns whose entries before the window are garbage (0), as offload will."""
    first, last = _pages(c, window)
    ids = c.page_table[:, first:last].reshape(-1).long()
    table = torch.zeros(c.q.shape[0], last, dtype=torch.int32, device=c.q.device)
    table[:, first:] = torch.arange(ids.numel(), dtype=torch.int32, device=c.q.device).reshape(-1, last - first)
    return c.k_pool[ids], c.v_pool[ids], dk[ids].clone(), dv[ids].clone(), table, ids


def forward_windows(be, c: Case, windows, staged=False, out_dtype=None):
    outs, lses = [], []
    for w in windows:
        k, v, table = c.k_pool, c.v_pool, c.page_table
        if staged and w[1] <= c.query_start:
            k, v, _, _, table, _ = stage(c, w, c.k_pool, c.v_pool)
        out, lse = be.paged_attention_forward(c.q, k, v, table, c.query_start, c.scale, key_range=w,
                                              out_dtype=out_dtype)
        outs.append(out)
        lses.append(lse)
    return outs, lses


def backward_windows(be, c: Case, windows, out, lse, dk, dv, staged=False):
    """Windowed backward with one shared delta and a float32 dQ accumulator; dK, dV added into dk, dv."""
    delta = be.backward_delta(out, c.dout)
    dq = torch.zeros(c.q.shape, dtype=torch.float32, device=c.q.device)
    for w in windows:
        if staged and w[1] <= c.query_start:
            k, v, dk_s, dv_s, table, ids = stage(c, w, dk, dv)
            got = be.paged_attention_backward(c.q, k, v, table, c.query_start, c.scale, None, c.dout, lse,
                                              dk_s, dv_s, key_range=w, delta=delta, dq_accumulator=dq)
            dk[ids], dv[ids] = dk_s, dv_s
        else:
            got = be.paged_attention_backward(c.q, c.k_pool, c.v_pool, c.page_table, c.query_start, c.scale,
                                              out, c.dout, lse, dk, dv, key_range=w, delta=delta, dq_accumulator=dq)
        assert got is dq
    return dq


def full_pass(be, c: Case, dk_init: torch.Tensor):
    out, lse = be.paged_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, c.query_start, c.scale)
    dk, dv = dk_init.clone(), -dk_init
    dq = be.paged_attention_backward(c.q, c.k_pool, c.v_pool, c.page_table, c.query_start, c.scale,
                                     out, c.dout, lse, dk, dv)
    return out, lse, dq, dk, dv


# (G, Hkv, P, history pages, Lq): the history of 60 keys in pages of 12 starts the chunk mid-tile;
# pages of 4 put both edges of a window inside one tile.
SHAPES = [
    pytest.param(1, 2, 16, 4, 20, id="G1-P16"),
    pytest.param(4, 1, 16, 4, 19, id="G4-P16"),
    pytest.param(1, 2, 12, 5, 20, id="G1-P12"),
    pytest.param(4, 1, 12, 5, 13, id="G4-P12"),
    pytest.param(1, 1, 4, 13, 9, id="G1-P4"),
]
SPLITS = ["whole", "1+rest", "2+1+rest"]


def _split(name: str, history_pages: int) -> tuple[int, ...]:
    return {"whole": (history_pages,), "1+rest": (1, history_pages - 1),
            "2+1+rest": (2, 1, history_pages - 3)}[name]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("G,Hkv,P,history_pages,Lq", SHAPES)
@pytest.mark.parametrize("backend", BACKENDS_TRITON_SLOW)
def test_windows_merge_to_the_full_attention(backend, G, Hkv, P, history_pages, Lq, split):
    be = _backend(backend)
    c = make_case(2, G * Hkv, Hkv, Lq, history_pages, 32, P)
    windows = key_windows(c, _split(split, history_pages))
    dk_init = torch.randn(c.k_pool.shape, generator=torch.Generator().manual_seed(1)).to(c.q.device)
    want_out, want_lse, want_dq, want_dk, want_dv = full_pass(be, c, dk_init)

    outs, lses = forward_windows(be, c, windows)
    out, lse = reference.merge_partials(outs, lses)
    assert out.dtype == c.q.dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(lse, want_lse, **TOL)

    # Backward per window with the merged statistics: the sums are the full gradients.
    dk, dv = dk_init.clone(), -dk_init
    dq = backward_windows(be, c, windows, out, lse, dk, dv)
    torch.testing.assert_close(dq, want_dq.float(), **TOL)
    torch.testing.assert_close(dk, want_dk, **TOL)
    torch.testing.assert_close(dv, want_dv, **TOL)

    # Offload's way: each history window through its own staging pools and table. Same bits.
    staged_outs, staged_lses = forward_windows(be, c, windows, staged=True)
    for a, b in zip(outs + lses, staged_outs + staged_lses, strict=True):
        assert torch.equal(a, b)
    dk_s, dv_s = dk_init.clone(), -dk_init
    dq_s = backward_windows(be, c, windows, out, lse, dk_s, dv_s, staged=True)
    assert torch.equal(dq_s, dq) and torch.equal(dk_s, dk) and torch.equal(dv_s, dv)


def _poison(c: Case, window: tuple[int, int]) -> Case:
    """NaN in every page but the window's; table entries outside the window point at NaN pages."""
    first, last = _pages(c, window)
    keep = c.page_table[:, first:last].reshape(-1).long()
    k_pool, v_pool = torch.full_like(c.k_pool, float("nan")), torch.full_like(c.v_pool, float("nan"))
    k_pool[keep], v_pool[keep] = c.k_pool[keep], c.v_pool[keep]
    nan_pages = torch.ones(c.k_pool.shape[0], dtype=torch.bool, device=c.q.device)
    nan_pages[keep] = False
    nan_ids = nan_pages.nonzero().flatten()
    table = c.page_table.clone()
    outside = torch.ones(table.shape[1], dtype=torch.bool, device=c.q.device)
    outside[first:last] = False
    # Cycle through NaN page ids (page 0 among them, unless the window holds it).
    cols = outside.nonzero().flatten()
    table[:, cols] = nan_ids[torch.arange(cols.numel(), device=c.q.device) % nan_ids.numel()].to(torch.int32)
    return replace(c, k_pool=k_pool, v_pool=v_pool, page_table=table)


@pytest.mark.parametrize("G,Hkv,P,history_pages,Lq", [SHAPES[1], SHAPES[2]])
@pytest.mark.parametrize("backend", BACKENDS_TRITON_SLOW)
def test_nothing_outside_the_window_is_read(backend, G, Hkv, P, history_pages, Lq):
    be = _backend(backend)
    c = make_case(2, G * Hkv, Hkv, Lq, history_pages, 32, P)
    out, lse = be.paged_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, c.query_start, c.scale)
    for w in key_windows(c, (1, history_pages - 2, 1)):
        bad = _poison(c, w)
        results = []
        for case in (c, bad):
            w_out, w_lse = be.paged_attention_forward(case.q, case.k_pool, case.v_pool, case.page_table,
                                                      case.query_start, case.scale, key_range=w)
            dk, dv = torch.zeros_like(c.k_pool), torch.zeros_like(c.v_pool)
            dq = be.paged_attention_backward(case.q, case.k_pool, case.v_pool, case.page_table, case.query_start,
                                             case.scale, out, case.dout, lse, dk, dv, key_range=w)
            results.append((w_out, w_lse, dq, dk, dv))
        for a, b in zip(*results, strict=True):
            assert torch.isfinite(b).all() and torch.equal(a, b), f"window {w}"
        # Only the window's pages received gradients.
        first, last = _pages(c, w)
        untouched = torch.ones(c.k_pool.shape[0], dtype=torch.bool, device=c.q.device)
        untouched[c.page_table[:, first:last].reshape(-1).long()] = False
        assert (results[1][3][untouched] == 0).all() and (results[1][4][untouched] == 0).all()


BAD_WINDOWS = [
    (8, 32),  # lo inside a page
    (16, 40),  # hi inside a page
    (32, 16), (16, 16), (-16, 16),  # empty or negative
    (0, 64),  # a history window past query_start
    (48, 60),  # not the whole chunk
    (0, 68),  # all keys: use None
    (0.0, 16), (True, 16), (0,), "ab", 16,
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_windows_are_refused(backend):
    be = _backend(backend)
    c = make_case(1, 4, 2, 20, 3, 16, 16)  # query_start 48, 68 keys
    for w in BAD_WINDOWS:
        with pytest.raises(ValueError, match="key_range"):
            be.paged_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, c.query_start, c.scale, key_range=w)
    out, lse = be.paged_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, c.query_start, c.scale)
    args = (c.q, c.k_pool, c.v_pool, c.page_table, c.query_start, c.scale, out, c.dout, lse,
            torch.zeros_like(c.k_pool), torch.zeros_like(c.v_pool))
    with pytest.raises(ValueError, match="key_range"):
        be.paged_attention_backward(*args, key_range=(8, 32))
    with pytest.raises(ValueError, match="delta"):
        be.paged_attention_backward(*args, key_range=(0, 16), delta=lse[..., :1].contiguous())
    with pytest.raises(ValueError, match="dq_accumulator"):
        be.paged_attention_backward(*args, dq_accumulator=torch.zeros_like(c.q, dtype=torch.float16))
    with pytest.raises(ValueError, match="needs out"):
        be.paged_attention_backward(*args[:6], None, *args[7:], key_range=(0, 16))


def test_merge_partials():
    g = torch.Generator().manual_seed(0)
    out = torch.randn(2, 3, 5, 8, generator=g).bfloat16()
    lse = torch.randn(2, 3, 5, generator=g)
    got_out, got_lse = reference.merge_partials([out], [lse])
    assert torch.equal(got_out, out) and got_out.dtype == out.dtype and torch.equal(got_lse, lse)

    # Two windows: the float64 formula, the first output's dtype, float32 lse.
    outs = [out, torch.randn(2, 3, 5, 8, generator=g).bfloat16()]
    lses = [lse, torch.randn(2, 3, 5, generator=g) + 3]
    got_out, got_lse = reference.merge_partials(outs, lses)
    want_lse = torch.logsumexp(torch.stack(lses).double(), 0)
    want = sum((w - want_lse).exp()[..., None] * o.double() for o, w in zip(outs, lses, strict=True))
    assert got_out.dtype == torch.bfloat16 and got_lse.dtype == torch.float32
    torch.testing.assert_close(got_lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_out.double(), want, rtol=8e-3, atol=8e-3)  # one bf16 rounding
    with pytest.raises(ValueError):
        reference.merge_partials([out], [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_delta_and_defaults(backend):
    """backward_delta matches the reference's; passing it, or key_range=None, changes nothing."""
    be = _backend(backend)
    c = make_case(2, 4, 2, 20, 3, 32, 16)
    out, lse = be.paged_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, c.query_start, c.scale)
    delta = be.backward_delta(out, c.dout)
    assert delta.shape == lse.shape and delta.dtype == torch.float32
    torch.testing.assert_close(delta, (out.double() * c.dout.double()).sum(-1).float(), **TOL)
    out2, lse2 = be.paged_attention_forward(c.q, c.k_pool, c.v_pool, c.page_table, c.query_start, c.scale,
                                            key_range=None)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    results = []
    for extra in ({}, dict(key_range=None, delta=delta)):
        dk, dv = torch.zeros_like(c.k_pool), torch.zeros_like(c.v_pool)
        dq = be.paged_attention_backward(c.q, c.k_pool, c.v_pool, c.page_table, c.query_start, c.scale,
                                         out, c.dout, lse, dk, dv, **extra)
        results.append((dq, dk, dv))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    # Without a window, dq_accumulator holds the plain backward's dQ (before rounding to q's dtype).
    acc = torch.ones(c.q.shape, device=c.q.device)
    be.paged_attention_backward(c.q, c.k_pool, c.v_pool, c.page_table, c.query_start, c.scale,
                                out, c.dout, lse, dk, dv, dq_accumulator=acc)
    torch.testing.assert_close(acc, results[0][0] + 1, **TOL)


# ---------------------------------------------------------------------------------------------
# bfloat16: windows cost no accuracy. The errors are measured against a float64 oracle; the
# windowed kernels must stay within 2x the unwindowed kernel's own error (plus a margin far below
# bf16 resolution), the criterion tests/test_triton_paged.py applies to the kernels vs the reference.
# ---------------------------------------------------------------------------------------------
def _dense(pool: torch.Tensor, page_table: torch.Tensor, num_keys: int) -> torch.Tensor:
    """(B, Hkv, num_keys, D) of a sequence's pages in token order."""
    pages = pool[page_table.long()]  # (B, n, Hkv, P, D)
    B, n, Hkv, P, D = pages.shape
    return pages.permute(0, 2, 1, 3, 4).reshape(B, Hkv, n * P, D)[:, :, :num_keys]


def _oracle(c: Case):
    """Float64 out, lse, dQ and dense dK, dV by autograd."""
    table = c.page_table[:, : math.ceil(c.num_keys / c.page)]
    q = c.q.double().requires_grad_()
    k = _dense(c.k_pool, table, c.num_keys).double().requires_grad_()
    v = _dense(c.v_pool, table, c.num_keys).double().requires_grad_()
    G = q.shape[1] // k.shape[1]
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(G, 1)) * c.scale
    q_pos = torch.arange(c.query_start, c.num_keys, device=q.device)
    k_pos = torch.arange(c.num_keys, device=q.device)
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    out = torch.softmax(scores, -1) @ v.repeat_interleave(G, 1)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), c.dout.double())
    return out.detach(), torch.logsumexp(scores, -1).detach(), dq, dk, dv


def _bf16_check(c: Case, split: tuple[int, ...]) -> None:
    be = _backend("triton")
    num_keys, table = c.num_keys, c.page_table[:, : math.ceil(c.num_keys / c.page)]
    want = _oracle(c)
    low = c.at(torch.bfloat16)
    zeros = torch.zeros(c.k_pool.shape, device=c.q.device)
    plain_out, plain_lse, *plain = full_pass(be, low, zeros)  # the unwindowed kernels
    # The windowed pass as the engine runs it: float32 partial outputs, one rounding after the merge.
    windows = key_windows(low, split)
    out, lse = reference.merge_partials(*forward_windows(be, low, windows, staged=True, out_dtype=torch.float32))
    out = out.to(torch.bfloat16)
    dk, dv = zeros.clone(), zeros.clone()
    dq = backward_windows(be, low, windows, out, lse, dk, dv, staged=True).to(torch.bfloat16)
    names = ("out", "lse", "dq", "dk", "dv")
    ours = (out, lse, dq, _dense(dk, table, num_keys), _dense(dv, table, num_keys))
    theirs = (plain_out, plain_lse, plain[0], _dense(plain[1], table, num_keys), _dense(plain[2], table, num_keys))
    for name, got, base, w in zip(names, ours, theirs, want, strict=True):
        err = (got.double() - w).abs().max().item()
        base_err = (base.double() - w).abs().max().item()
        eps = 1e-4 * w.abs().max().item()  # bf16 resolution is 2**-8 = 3.9e-3 relative
        print(f"bf16 error {name}: windows {err:.3e}, one pass {base_err:.3e}")
        assert err <= 2 * base_err + eps, f"{name}: windows {err:.3e} vs one pass {base_err:.3e}"


def test_bf16_windows_small():
    """The bf16 check at interpreter size (the kernels upcast there: mostly the roundings of I/O)."""
    _bf16_check(make_case(2, 4, 1, 13, 5, 32, 12), (2, 1, 2))


# (Hq, Hkv, D, P, history pages, Lq, split): pages of 64 with 128-key tiles put window edges
# mid-tile; GQA 1/4/8, histories up to 8K.
GPU_CASES = [
    pytest.param(4, 4, 64, 64, 9, 200, (9,), id="G1-D64-P64-one-window"),
    pytest.param(8, 2, 128, 64, 37, 300, (5, 19, 13), id="G4-D128-P64-h2368"),
    pytest.param(16, 2, 128, 128, 64, 256, (1, 40, 23), id="G8-D128-P128-h8K"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv,D,P,history_pages,Lq,split", GPU_CASES)
def test_gpu_bf16_windows_as_accurate_as_one_pass(Hq, Hkv, D, P, history_pages, Lq, split):
    _bf16_check(make_case(2, Hq, Hkv, Lq, history_pages, D, P, device="cuda"), split)
