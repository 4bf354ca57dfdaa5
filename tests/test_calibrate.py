"""Per-layer sparse budgets, dense layers, attention-mass recall and `oomb calibrate`'s plans."""

import pytest
import torch
import yaml
from helpers import build_tiny_model, random_ids

import oomb
from oomb.config import OffloadConfig, OOMBConfig, PerformanceConfig, load_sparse_plan
from oomb.sparse import SparseConfig
from oomb.tools.calibrate import DENSE, LayerCurve, allocate, make_plan, recall_curves
from oomb.tools.sparse_recall import layer_recall, page_mass, record_attention_inputs

TOKENS, CHUNK, PAGE = 320, 64, 16  # 5 chunks; up to 16 history pages


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, ids, **options):
    model.zero_grad(set_to_none=True)
    loss = oomb.forward_backward(model, ids, config=OOMBConfig(chunk_size=CHUNK, page_size=PAGE, **options,
                                                               performance=PerformanceConfig(backend="torch")))
    return loss, _grads(model)


def test_dense_layers_and_full_layer_budgets_are_dense_attention_bit_for_bit():
    model = build_tiny_model("llama", seed=3)
    ids = random_ids(1, TOKENS, seed=3)
    dense_loss, dense = _step(model, ids)
    for sparse in (SparseConfig(budget=1, dense_layers=[0, 1]), SparseConfig(budget=1, layer_budgets=[64, 64])):
        loss, grads = _step(model, ids, attention="sparse", sparse=sparse)
        assert torch.equal(loss, dense_loss)
        assert all(torch.equal(grads[n], dense[n]) for n in dense)


def test_a_dense_layer_changes_only_what_that_layer_reads():
    """Layer 1 dense, layer 0 at budget 1: layer 0's selections match an all-sparse step's, and the
    gradients differ from both the all-sparse and the dense step."""
    model = build_tiny_model("qwen2", seed=4)
    ids = random_ids(1, TOKENS, seed=4)
    _, dense = _step(model, ids)
    _, sparse = _step(model, ids, attention="sparse", sparse=SparseConfig(budget=1))
    _, mixed = _step(model, ids, attention="sparse", sparse=SparseConfig(budget=1, dense_layers=[1]))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(mixed[name], dense[name]) and not torch.equal(mixed[name], sparse[name])


def test_per_layer_budgets_read_what_they_say():
    options = SparseConfig(budget=4, sink_pages=1, score="minmax", layer_budgets=(2, 8), dense_layers=(2,)).resolved()
    assert [options.num_selected(20, layer) for layer in range(3)] == [3, 9, 20]
    assert options.num_selected(5, 1) == 5


@pytest.mark.parametrize("bad", [{"layer_budgets": [1, -1]}, {"layer_budgets": 3}, {"dense_layers": [0, "1"]},
                                 {"research": {"pooling": "mean"}}])
def test_bad_layer_options_are_refused(bad):
    with pytest.raises(ValueError):
        OOMBConfig.from_dict({"attention": "sparse", "sparse": bad})


def _recorded(seed=5):
    model = build_tiny_model("llama", seed=seed).eval()
    ids = random_ids(1, TOKENS, seed=seed)
    with torch.no_grad(), record_attention_inputs(model) as recorded:
        model(input_ids=ids)
    return model, ids, recorded


def test_page_mass_is_the_dense_attention_summed_per_page():
    _, _, recorded = _recorded()
    inputs = recorded[0]
    mass = page_mass(inputs, PAGE)
    q, k = inputs.q[0], inputs.k[0]
    G = q.shape[0] // k.shape[0]
    logits = torch.einsum("htd,hsd->hts", q, k.repeat_interleave(G, 0)) * inputs.scale
    logits.masked_fill_(torch.ones(TOKENS, TOKENS, dtype=torch.bool).triu(1), float("-inf"))
    want = logits.softmax(-1).reshape(q.shape[0], TOKENS, TOKENS // PAGE, PAGE).sum(-1)
    torch.testing.assert_close(mass, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mass.sum(-1), torch.ones(q.shape[0], TOKENS))


@pytest.mark.parametrize("leak_free", [False, True])
def test_oracle_recall_bounds_the_score_and_a_full_budget_keeps_everything(leak_free):
    _, _, recorded = _recorded()
    for layer, inputs in recorded.items():
        mass = page_mass(inputs, PAGE)
        for budget in (1, 3):
            options = SparseConfig(budget=budget, sink_pages=1, score="minmax", leak_free=leak_free).resolved()
            rule = layer_recall(inputs, mass, CHUNK, PAGE, options, "score", layer)
            best = layer_recall(inputs, mass, CHUNK, PAGE, options, "oracle", layer)
            assert (best >= rule - 1e-6).all() and (best <= 1 + 1e-6).all() and (rule > 0).all()
        every = SparseConfig(budget=TOKENS, sink_pages=1, score="minmax", leak_free=leak_free).resolved()
        full = layer_recall(inputs, mass, CHUNK, PAGE, every, "score", layer)
        torch.testing.assert_close(full, torch.ones_like(full))


def test_allocate_spends_pages_where_they_buy_the_most_recall():
    flat = LayerCurve([2, 4, DENSE], [0.98, 0.99, 1.0], [0.97, 0.98, 1.0], [10, 20, 100])
    diffuse = LayerCurve([2, 4, DENSE], [0.50, 0.60, 1.0], [0.4, 0.5, 1.0], [10, 20, 100])
    # 110 of 200 pages: the diffuse layer goes dense (0.4 recall for 90 pages beats the flat layer's
    # 0.01 for 10); the flat one keeps its smallest budget. 120 pages: the flat one's step fits too.
    assert allocate([flat, diffuse], max_read=0.55) == [0, 2]
    assert allocate([flat, diffuse], max_read=0.6) == [1, 2]
    assert allocate([flat, diffuse], max_read=0.1) == [0, 0]
    with pytest.raises(ValueError, match="smallest budget"):
        allocate([flat, diffuse], max_read=0.05)


def test_calibrated_plan_round_trips_into_a_sparse_step(tmp_path):
    model, ids, _ = _recorded(seed=6)
    base = SparseConfig(budget=0, sink_pages=1, score="minmax")  # unresolved, as `oomb calibrate` builds it
    curves = recall_curves(model, ids, CHUNK, PAGE, base, grid=(1, 2, 4), progress=False)
    assert len(curves) == model.config.num_hidden_layers
    assert all(c.budgets[-1] == DENSE and c.recall[-1] == 1.0 for c in curves)
    assert all(a <= b + 1e-6 for c in curves for a, b in zip(c.recall, c.recall[1:], strict=False))
    plan = make_plan(curves, allocate(curves, 0.5), base, {"model": "tiny"})
    assert plan["measured"]["history_read"] <= 0.5 + 1e-9
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    assert load_sparse_plan(path) == plan["oomb"]  # gradcheck --sparse-plan reads the same options
    config = OOMBConfig.from_dict({"sparse_plan": str(path), "chunk_size": CHUNK, "page_size": PAGE,
                                   "performance": {"backend": "torch"}})
    assert config.attention == "sparse" and list(config.sparse.layer_budgets) == plan["oomb"]["sparse"]["layer_budgets"]
    model.train()
    loss = oomb.forward_backward(model, ids, config=config)
    assert torch.isfinite(loss)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cudnn"])
def test_gpu_per_layer_budgets_and_dense_layers(backend):
    """On CUDA (bf16): a sparse step whose layers are all dense equals the dense step bit for bit;
    per-layer budgets run, and with offload give the same loss and gradients as without (triton:
    bitwise)."""
    model = build_tiny_model("llama", seed=7, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    model = model.to("cuda", torch.bfloat16)
    ids = random_ids(1, 1024, seed=7).cuda()

    def step(**options):
        model.zero_grad(set_to_none=True)
        config = OOMBConfig(chunk_size=256, page_size=64, **options, performance=PerformanceConfig(backend=backend))
        return oomb.forward_backward(model, ids, config=config), _grads(model)

    dense_loss, dense = step()
    loss, grads = step(attention="sparse", sparse=SparseConfig(budget=1, dense_layers=[0, 1]))
    if backend == "triton":
        assert torch.equal(loss, dense_loss) and all(torch.equal(grads[n], dense[n]) for n in dense)
    else:
        torch.testing.assert_close(loss, dense_loss, rtol=2e-3, atol=0)
    per_layer = dict(attention="sparse", sparse=SparseConfig(budget=2, layer_budgets=[1, 2], dense_layers=[1]))
    loss, grads = step(**per_layer)
    off_loss, off_grads = step(offload=OffloadConfig(enabled=True), **per_layer)
    assert torch.isfinite(loss)
    if backend == "triton":
        assert torch.equal(loss, off_loss) and all(torch.equal(grads[n], off_grads[n]) for n in grads)
