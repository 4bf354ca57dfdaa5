"""sparse_unselected="page_means": unselected history pages attended through their mean key and value.

The oracle is a full-sequence HF forward and backward whose attention is, per query, one softmax over
the keys oomb's sparse step read exactly plus one key per unselected history page (its mean key, logit
+ log P, and mean value), with the means computed differentiably from the keys and values; so the
gradients that reach the keys through the means are checked too.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import build_tiny_model, grads, random_ids, relative_error
from transformers import AttentionInterface

import oomb
from oomb import OOMBConfig
from oomb.attention.page_means import page_means_backward, page_means_forward, unselected_mask
from oomb.kv import PagedKVStore

TOKENS, CHUNK, PAGE = 333, 64, 16
GRAD_RTOL = 1e-5
ORACLE = "oomb_test_page_means_oracle"


def _config(**sparse) -> OOMBConfig:
    sparse = {"sparse_unselected": "page_means", **sparse}
    return OOMBConfig(chunk_size=CHUNK, page_size=PAGE, backend="torch", attention="sparse", **sparse)


@pytest.fixture
def selections(monkeypatch):
    kept = {}
    real_save = PagedKVStore.save_selection

    def recording_save(self, layer, chunk, selection):
        kept[layer, chunk.index] = (chunk, selection)
        real_save(self, layer, chunk, selection)

    monkeypatch.setattr(PagedKVStore, "save_selection", recording_save)
    return kept


def _masks(kept, layer, batch, kv_heads, tokens):
    """(B, Hkv, T, T) keys read exactly and (B, Hkv, T, n_pages) pages read through their means."""
    n_pages = tokens // PAGE
    exact = torch.zeros(batch, kv_heads, tokens, tokens, dtype=torch.bool)
    means = torch.zeros(batch, kv_heads, tokens, n_pages, dtype=torch.bool)
    for (sel_layer, _), (chunk, selection) in kept.items():
        if sel_layer != layer:
            continue
        s, e = chunk.start, chunk.end
        exact[:, :, s:e, s:e] = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        if selection is None:
            exact[:, :, s:e, :s] = True
            continue
        for b in range(batch):
            for h in range(kv_heads):
                for j, pages in enumerate(selection[b, h].tolist()):
                    rows = slice(s + j * PAGE, min(e, s + (j + 1) * PAGE))
                    for page in range(s // PAGE):
                        if page in pages:
                            exact[b, h, rows, page * PAGE:(page + 1) * PAGE] = True
                        else:
                            means[b, h, rows, page] = True
    return exact, means


def _oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    exact, means = kwargs["page_means_masks"][module.layer_idx]
    B, Hkv, T, D = key.shape
    G = query.shape[1] // Hkv
    n_pages = means.shape[-1]
    k_mean = key[:, :, :n_pages * PAGE].reshape(B, Hkv, n_pages, PAGE, D).mean(3)
    v_mean = value[:, :, :n_pages * PAGE].reshape(B, Hkv, n_pages, PAGE, D).mean(3)
    keys = torch.cat([key, k_mean], dim=2).repeat_interleave(G, 1)
    values = torch.cat([value, v_mean], dim=2).repeat_interleave(G, 1)
    logits = query @ keys.transpose(-1, -2) * scaling
    logits[..., T:] += math.log(PAGE)
    visible = torch.cat([exact, means], dim=-1).repeat_interleave(G, 1)
    out = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1) @ values
    return out.transpose(1, 2), None


AttentionInterface.register(ORACLE, _oracle_attention)


@pytest.mark.parametrize(
    ("family", "sparse"),
    [
        ("qwen2", dict(sparse_budget=3, sparse_sink_pages=1)),
        ("llama", dict(sparse_budget=2, sparse_sink_pages=0, sparse_score="mean", sparse_selection="shared",
                       sparse_leak_free=True)),
        ("qwen3", dict(sparse_budget=1, sparse_sink_pages=1, sparse_query_block_pages=3, sparse_pooling="softmax")),
        ("mistral", dict(sparse_budget=2, sparse_sink_pages=1, checkpoint_layers=False, sparse_dense_layers=[0])),
    ],
    ids=["minmax-kv_head", "mean-shared-leak_free", "query_groups-softmax", "no_checkpointing-dense_layer"],
)
def test_page_means_gradients_are_exact(family, sparse, selections):
    model = build_tiny_model(family, seed=41)
    ids = random_ids(2, TOKENS, seed=41)
    model.zero_grad(set_to_none=True)
    loss = oomb.forward_backward(model, ids, None, _config(**sparse))
    got = grads(model)
    assert sum(selection is not None for _, selection in selections.values()) > 0
    Hkv, L = model.config.num_key_value_heads, model.config.num_hidden_layers
    masks = [_masks(selections, layer, 2, Hkv, TOKENS) for layer in range(L)]
    assert sum(int(m.sum()) for _, m in masks) > 0  # some pages were read as means
    model.zero_grad(set_to_none=True)
    model.set_attn_implementation(ORACLE)
    try:
        want_loss = model(input_ids=ids, labels=ids, page_means_masks=masks).loss
        want_loss.backward()
    finally:
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=0)
    assert relative_error(got, grads(model)) <= GRAD_RTOL


def test_page_means_move_sparse_closer_to_dense():
    """Random weights: adding the unselected pages back as means brings loss and gradients nearer dense."""
    model = build_tiny_model("qwen2", seed=42)
    ids = random_ids(1, TOKENS, seed=42)
    results = {}
    for name, config in (("dense", OOMBConfig(chunk_size=CHUNK, page_size=PAGE, backend="torch")),
                         ("drop", _config(sparse_budget=2, sparse_unselected="drop")),
                         ("page_means", _config(sparse_budget=2))):
        model.zero_grad(set_to_none=True)
        results[name] = (oomb.forward_backward(model, ids, None, config), grads(model))
    dense_loss, dense = results["dense"]
    error = {name: relative_error(results[name][1], dense) for name in ("drop", "page_means")}
    loss_gap = {name: abs(float(results[name][0] - dense_loss)) for name in ("drop", "page_means")}
    assert error["page_means"] < error["drop"]
    assert loss_gap["page_means"] < loss_gap["drop"]


def test_page_means_of_a_fully_selected_block_are_empty():
    """A block that reads every history page exactly gets nothing from the means (lse -inf, out 0)."""
    torch.manual_seed(0)
    B, Hkv, G, Lq, D, n_hist = 1, 2, 2, 8, 4, 3
    q = torch.randn(B, Hkv * G, Lq, D)
    km, vm = torch.randn(B, n_hist, Hkv, D), torch.randn(B, n_hist, Hkv, D)
    selection = torch.tensor([[0, 1, 2], [0, 1, 2]], dtype=torch.int32)[None, :, None].expand(B, Hkv, 2, 3)
    assert not unselected_mask(selection, n_hist).any()
    out, lse = page_means_forward(q, km, vm, selection, 4, 0.5)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
    dq, dkm, dvm = page_means_backward(q, km, vm, selection, 4, 0.5, torch.randn_like(q), torch.randn(B, 4, Lq),
                                       torch.zeros(B, 4, Lq))
    assert not dq.any() and not dkm.any() and not dvm.any()


def test_page_means_tiles_give_the_same_result(monkeypatch):
    torch.manual_seed(1)
    B, Hq, Hkv, Lq, D, n_hist, P = 1, 4, 2, 32, 8, 10, 4
    q = torch.randn(B, Hq, Lq, D)
    km, vm = torch.randn(B, n_hist, Hkv, D), torch.randn(B, n_hist, Hkv, D)
    selection = torch.stack([torch.randperm(n_hist)[:3].sort().values for _ in range(B * Hkv * 8)])
    selection = selection.reshape(B, Hkv, 8, 3).to(torch.int32)
    whole = page_means_forward(q, km, vm, selection, P, 0.3)
    monkeypatch.setattr("oomb.attention.page_means.TILE_ELEMENTS", 1)  # one block of rows per tile
    tiled = page_means_forward(q, km, vm, selection, P, 0.3)
    torch.testing.assert_close(tiled[0], whole[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tiled[1], whole[1], rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cudnn"])
def test_gpu_page_means_match_the_oracle_and_offload(backend, selections):
    """On CUDA: the kernels' sparse part merged with the page means. triton float32 against the
    full-sequence oracle (<= 1e-5) and with offload bitwise; cudnn bf16 with offload: same loss."""
    dtype = torch.float32 if backend == "triton" else torch.bfloat16
    model = build_tiny_model("llama", seed=43, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    model = model.to("cuda", dtype)
    ids = random_ids(1, TOKENS, seed=43).cuda()

    def step(**options):
        model.zero_grad(set_to_none=True)
        config = OOMBConfig(chunk_size=CHUNK, page_size=PAGE, backend=backend, attention="sparse", sparse_budget=2,
                            sparse_unselected="page_means", **options)
        return oomb.forward_backward(model, ids, config=config), grads(model)

    loss, got = step()
    off_loss, off_grads = step(offload=True)
    if backend == "cudnn":
        torch.testing.assert_close(off_loss, loss, rtol=2e-3, atol=0)
        return
    assert torch.equal(off_loss, loss) and all(torch.equal(off_grads[n], got[n]) for n in got)
    masks = [tuple(m.cuda() for m in _masks(selections, layer, 1, 2, TOKENS)) for layer in range(2)]
    model.zero_grad(set_to_none=True)
    model.set_attn_implementation(ORACLE)
    try:
        want_loss = model(input_ids=ids, labels=ids, page_means_masks=masks).loss
        want_loss.backward()
    finally:
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=0)
    assert relative_error(got, grads(model)) <= GRAD_RTOL
