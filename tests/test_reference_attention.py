"""The plain-PyTorch paged attention (the oracle of the kernels) against dense float64 attention."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from oomb.attention import reference

TOL = dict(rtol=1e-5, atol=1e-5)
SPARE_COLUMNS = 2
"""Page-table columns past the ones the chunk reads; they point at garbage pages."""
SPARE_PAGES = 3
"""Pool pages no page table names at all."""


@dataclass(frozen=True)
class Case:
    groups: int  # query heads per KV head
    kv_heads: int
    head_dim: int
    page: int
    history_pages: int
    chunk: int  # queries (need not be a multiple of the page size)
    key_block: int  # key_block_tokens of the online softmax
    batch: int = 2

    @property
    def query_start(self) -> int:
        return self.history_pages * self.page


CASES = [
    Case(groups=1, kv_heads=2, head_dim=64, page=16, history_pages=0, chunk=17, key_block=32),
    Case(groups=2, kv_heads=2, head_dim=80, page=16, history_pages=1, chunk=64, key_block=16),
    Case(groups=4, kv_heads=1, head_dim=128, page=32, history_pages=22, chunk=64, key_block=64),  # 704
    Case(groups=7, kv_heads=1, head_dim=64, page=32, history_pages=1, chunk=1, key_block=8),
    Case(groups=7, kv_heads=2, head_dim=80, page=16, history_pages=44, chunk=17, key_block=128),
    Case(groups=1, kv_heads=2, head_dim=128, page=16, history_pages=0, chunk=1, key_block=1024),
    Case(groups=2, kv_heads=1, head_dim=64, page=32, history_pages=0, chunk=64, key_block=32, batch=1),
    Case(groups=4, kv_heads=2, head_dim=80, page=32, history_pages=22, chunk=1, key_block=1024),
    Case(groups=2, kv_heads=2, head_dim=128, page=16, history_pages=44, chunk=64, key_block=48),
]


def _case_id(case: Case) -> str:
    return (f"g{case.groups}-hkv{case.kv_heads}-d{case.head_dim}-p{case.page}-"
            f"hist{case.query_start}-l{case.chunk}-kb{case.key_block}-b{case.batch}")


@dataclass
class Paged:
    q: torch.Tensor  # (B, Hq, Lq, D), possibly a transposed view
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    page_table: torch.Tensor
    num_pages: int  # pages each sequence reads
    scale: float


def _paged_inputs(case: Case, transposed_q: bool, seed: int = 0) -> Paged:
    """Random pools (every slot finite garbage until named by the table), shuffled page ids."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv, D, P = case.batch, case.kv_heads, case.head_dim, case.page
    Hq = case.groups * Hkv
    num_pages = -(-(case.query_start + case.chunk) // P)
    columns = num_pages + SPARE_COLUMNS
    pool_pages = B * columns + SPARE_PAGES
    k_pool = torch.randn(pool_pages, Hkv, P, D, generator=g)
    v_pool = torch.randn(pool_pages, Hkv, P, D, generator=g)
    page_table = torch.randperm(pool_pages, generator=g)[: B * columns].reshape(B, columns).to(torch.int32)
    if transposed_q:
        q = torch.randn(B, case.chunk, Hq, D, generator=g).transpose(1, 2)
    else:
        q = torch.randn(B, Hq, case.chunk, D, generator=g)
    return Paged(q, k_pool, v_pool, page_table, num_pages, 1 / math.sqrt(D))


def _contiguous(pool: torch.Tensor, paged: Paged, num_keys: int) -> torch.Tensor:
    """The sequence's first num_keys keys (or values) as (B, Hkv, num_keys, D), read through the table."""
    pages = pool[paged.page_table[:, : paged.num_pages].long()]  # (B, n, Hkv, P, D)
    B, n, Hkv, P, D = pages.shape
    return pages.permute(0, 2, 1, 3, 4).reshape(B, Hkv, n * P, D)[:, :, :num_keys]


def _scatter(grad: torch.Tensor, paged: Paged, pool_like: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, num_keys, D) gradient placed into a zero pool by the page table (tails stay zero)."""
    B, Hkv, num_keys, D = grad.shape
    P = pool_like.shape[2]
    n = paged.num_pages
    padded = torch.nn.functional.pad(grad, (0, 0, 0, n * P - num_keys))
    per_page = padded.reshape(B, Hkv, n, P, D).permute(0, 2, 1, 3, 4).reshape(B * n, Hkv, P, D)
    out = torch.zeros_like(pool_like, dtype=grad.dtype)
    out[paged.page_table[:, :n].reshape(-1).long()] = per_page
    return out


def _dense(q, k, v, query_start: int, scale: float):
    """Float64 causal attention over contiguous K/V: (out, lse)."""
    G = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(G, dim=1)
    v = v.repeat_interleave(G, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    q_pos = torch.arange(query_start, query_start + q.shape[2])
    k_pos = torch.arange(k.shape[2])
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


def _dense_reference(paged: Paged, case: Case, dout: torch.Tensor):
    """Float64 out, lse and dQ, dK, dV (contiguous) by autograd."""
    num_keys = case.query_start + case.chunk
    q = paged.q.double().requires_grad_()
    k = _contiguous(paged.k_pool, paged, num_keys).double().requires_grad_()
    v = _contiguous(paged.v_pool, paged, num_keys).double().requires_grad_()
    out, lse = _dense(q, k, v, case.query_start, paged.scale)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.double())
    return out.detach(), lse.detach(), dq, dk, dv


@pytest.mark.parametrize("transposed_q", [False, True], ids=["q_contiguous", "q_transposed"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_and_backward_match_dense_attention(case, transposed_q):
    paged = _paged_inputs(case, transposed_q)
    assert (paged.q.stride() != torch.empty(paged.q.shape).stride()) == transposed_q
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(paged.q.shape, generator=g)
    if transposed_q:  # the gradient of a transposed output arrives as a transposed view too
        dout = dout.transpose(1, 2).contiguous().transpose(1, 2)
    want_out, want_lse, want_dq, want_dk, want_dv = _dense_reference(paged, case, dout)

    out, lse = reference.paged_attention_forward(
        paged.q, paged.k_pool, paged.v_pool, paged.page_table, case.query_start, paged.scale,
        key_block_tokens=case.key_block,
    )
    assert out.shape == paged.q.shape and out.dtype == torch.float32
    assert lse.shape == paged.q.shape[:3] and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, **TOL)
    torch.testing.assert_close(lse.double(), want_lse, **TOL)

    # The gradient buffers start with known garbage: backward must add to it.
    dk_start = torch.randn(paged.k_pool.shape, generator=g)
    dv_start = torch.randn(paged.v_pool.shape, generator=g)
    dk_pool, dv_pool = dk_start.clone(), dv_start.clone()
    dq = reference.paged_attention_backward(
        paged.q, paged.k_pool, paged.v_pool, paged.page_table, case.query_start, paged.scale,
        out, dout, lse, dk_pool, dv_pool, key_block_tokens=case.key_block,
    )
    assert dq.shape == paged.q.shape and dq.dtype == torch.float32
    torch.testing.assert_close(dq.double(), want_dq, **TOL)
    torch.testing.assert_close(dk_pool.double(), dk_start.double() + _scatter(want_dk, paged, dk_pool), **TOL)
    torch.testing.assert_close(dv_pool.double(), dv_start.double() + _scatter(want_dv, paged, dv_pool), **TOL)

    # Pages the chunk does not read are not touched at all.
    read = paged.page_table[:, : paged.num_pages].reshape(-1).long()
    unread = torch.ones(paged.k_pool.shape[0], dtype=torch.bool)
    unread[read] = False
    assert unread.sum() == case.batch * SPARE_COLUMNS + SPARE_PAGES
    assert torch.equal(dk_pool[unread], dk_start[unread])
    assert torch.equal(dv_pool[unread], dv_start[unread])


def test_last_page_tail_gets_no_gradient():
    """Slots past the last key of a partial page are masked: their gradient buffers stay as they were."""
    case = CASES[0]  # 17 keys in pages of 16: 15 tail slots in the second page
    paged = _paged_inputs(case, transposed_q=False)
    out, lse = reference.paged_attention_forward(
        paged.q, paged.k_pool, paged.v_pool, paged.page_table, case.query_start, paged.scale
    )
    dk_pool = torch.full_like(paged.k_pool, 3.0)
    dv_pool = torch.full_like(paged.v_pool, 3.0)
    reference.paged_attention_backward(
        paged.q, paged.k_pool, paged.v_pool, paged.page_table, case.query_start, paged.scale,
        out, torch.ones_like(out), lse, dk_pool, dv_pool,
    )
    last = paged.page_table[:, paged.num_pages - 1].long()
    tail = case.chunk % case.page
    assert torch.equal(dk_pool[last][:, :, tail:], torch.full_like(dk_pool[last][:, :, tail:], 3.0))
    assert torch.equal(dv_pool[last][:, :, tail:], torch.full_like(dv_pool[last][:, :, tail:], 3.0))
    assert not torch.equal(dv_pool[last][:, :, :tail], torch.full_like(dv_pool[last][:, :, :tail], 3.0))


@pytest.mark.parametrize("key_block", [16, 1024])
def test_backward_is_bitwise_repeatable(key_block):
    case = CASES[4]
    paged = _paged_inputs(case, transposed_q=True)
    out, lse = reference.paged_attention_forward(
        paged.q, paged.k_pool, paged.v_pool, paged.page_table, case.query_start, paged.scale,
        key_block_tokens=key_block,
    )
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    results = []
    for _ in range(3):
        dk_pool, dv_pool = torch.zeros_like(paged.k_pool), torch.zeros_like(paged.v_pool)
        dq = reference.paged_attention_backward(
            paged.q, paged.k_pool, paged.v_pool, paged.page_table, case.query_start, paged.scale,
            out, dout, lse, dk_pool, dv_pool, key_block_tokens=key_block,
        )
        results.append((dq, dk_pool, dv_pool))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


@pytest.mark.parametrize("groups", [1, 4])
def test_dense_causal_attention_oracle(groups):
    """reference.dense_causal_attention (bottom-right causal) agrees with the float64 oracle here."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2 * groups, 9, 16, generator=g)
    k = torch.randn(2, 2, 40, 16, generator=g)
    v = torch.randn(2, 2, 40, 16, generator=g)
    got = reference.dense_causal_attention(q, k, v, 0.25)
    want, _ = _dense(q.double(), k.double(), v.double(), 40 - 9, 0.25)
    torch.testing.assert_close(got.double(), want, **TOL)


def test_merge_window_reads_bf16_outputs_as_their_float32_casts():
    """merge_window on bf16 outputs gives bitwise what it gives on their float32 copies (the cuDNN paths
    pass bf16 and skip the copies)."""
    from oomb.attention.reference import merge_window

    g = torch.Generator().manual_seed(5)
    out, out_w = (torch.randn(2, 3, 7, 8, generator=g).bfloat16() for _ in range(2))
    lse, lse_w = (torch.randn(2, 3, 7, generator=g) for _ in range(2))
    lse[0, 0, 0] = lse_w[0, 0, 0] = float("-inf")  # a row that saw no key
    got, got_lse = merge_window(out, lse, out_w, lse_w)
    want, want_lse = merge_window(out.float(), lse, out_w.float(), lse_w)
    assert got.dtype == torch.float32 and torch.equal(got, want) and torch.equal(got_lse, want_lse)
