"""oomb.forward_backward against an ordinary full-sequence Hugging Face backward, per model family."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from helpers import (
    FAMILIES,
    build_tiny_model,
    grads,
    hf_step,
    load_model,
    lora_model,
    random_ids,
    relative_error,
    save_tiny_model,
)
from transformers.modeling_layers import GradientCheckpointingLayer

import oomb
import oomb.engine
import oomb.models
from oomb import OOMBConfig
from oomb.config import OffloadConfig, PerformanceConfig, PrecisionConfig, SparseConfig
from oomb.kv import PagedKVStore

GRAD_RTOL = 1e-5
LOSS_RTOL = 1e-5


def _assert_empty(store):
    assert store.is_empty
    assert store.pool.num_free == store.pool.capacity
    assert all(record.ref_cnt == 0 for record in store.pool.records)


@pytest.fixture(autouse=True)
def created_stores(monkeypatch):
    """Every PagedKVStore the engine creates in a test; each must be empty when the test ends."""
    stores = []

    class RecordingStore(PagedKVStore):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            stores.append(self)

    monkeypatch.setattr(oomb.engine, "PagedKVStore", RecordingStore)
    yield stores
    for store in stores:
        _assert_empty(store)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Each family's tiny model, saved once with save_pretrained."""
    return {
        family: save_tiny_model(family, tmp_path_factory.mktemp(family), seed=seed)
        for seed, family in enumerate(FAMILIES)
    }


@pytest.fixture(scope="session")
def models(model_dirs):
    """Each family's tiny model loaded back once with attn_implementation="sdpa"; tests zero grads."""
    return {family: load_model(family, path) for family, path in model_dirs.items()}


@dataclass(frozen=True)
class Case:
    tokens: int
    chunk: int
    page: int
    batch: int = 1
    checkpoint: bool = True
    ignore: tuple[tuple[int, int, int], ...] = ()
    """(row, start, end): label positions set to -100."""
    loss_slice: int = 1024
    flat: bool = False
    """Pass 1-D input_ids and labels (batch must be 1)."""

    def config(self) -> OOMBConfig:
        return OOMBConfig(chunk_size=self.chunk, page_size=self.page,
                          performance=PerformanceConfig(backend="torch", checkpoint_layers=self.checkpoint,
                                                        loss_chunk_tokens=self.loss_slice))

    def inputs(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = random_ids(self.batch, self.tokens, seed)
        labels = ids.clone()
        for row, start, end in self.ignore:
            labels[row, start:end] = -100
        return ids, labels


CASES = {
    # 333 tokens: 6 chunks, the last one 13 tokens, its last page partial.
    "ragged": Case(333, chunk=64, page=16),
    "ragged_chunk128": Case(333, chunk=128, page=32, loss_slice=50),
    "single_chunk_flat": Case(50, chunk=64, page=16, flat=True),
    "ten_chunks_no_checkpoint": Case(610, chunk=64, page=16, checkpoint=False),
    "batch2": Case(200, chunk=64, page=32, batch=2, loss_slice=7),
    # Targets are labels shifted by one: chunk 1 (tokens 64..127) has targets 65..128, all -100 in
    # both rows, and so has the last chunk (256..299). The other spans cross chunk boundaries.
    "ignored_spans": Case(
        300, chunk=64, page=16, batch=2,
        ignore=((0, 50, 140), (1, 60, 129), (1, 200, 230), (0, 250, 300), (1, 250, 300)),
    ),
    "page_equals_chunk": Case(333, chunk=32, page=32, checkpoint=False),
}


def _assert_matches_hf(model, ids, labels, config, *, flat=False):
    model.zero_grad(set_to_none=True)
    want_loss = hf_step(model, ids, labels)
    want = grads(model)
    model.zero_grad(set_to_none=True)
    if flat:
        got_loss = oomb.forward_backward(model, ids[0], labels[0], config)
    else:
        got_loss = oomb.forward_backward(model, ids, labels, config)
    got = grads(model)
    assert oomb.engine.unwrap_causal_lm(model).config._attn_implementation == "sdpa"
    assert got_loss.dtype == torch.float32 and got_loss.dim() == 0 and not got_loss.requires_grad
    torch.testing.assert_close(got_loss, want_loss, rtol=LOSS_RTOL, atol=0)
    assert relative_error(got, want) <= GRAD_RTOL
    return got


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_match_full_sequence_backward(models, family, case):
    model = models[family]
    ids, labels = case.inputs(seed=case.tokens)
    got = _assert_matches_hf(model, ids, labels, case.config(), flat=case.flat)
    assert all(g is not None for g in got.values()), "every parameter should receive a gradient"


def test_ignored_spans_case_has_chunks_without_counted_targets():
    """Guards the case above: it must really contain whole chunks with no counted target."""
    case = CASES["ignored_spans"]
    _, labels = case.inputs(seed=0)
    targets = oomb.engine.shift_labels(labels)
    no_target = [
        chunk.index for chunk in oomb.engine.split_into_chunks(case.tokens, case.chunk)
        if (targets[:, chunk.start:chunk.end] == -100).all()
    ]
    assert no_target == [1, 4]


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_gradients_match_and_base_weights_get_none(model_dirs, family):
    peft_model = lora_model(load_model(family, model_dirs[family]), ["q_proj", "k_proj", "v_proj", "o_proj"])
    ids, labels = CASES["ragged"].inputs(seed=1)
    labels[:, 100:170] = -100
    got = _assert_matches_hf(peft_model, ids, labels, CASES["ragged"].config())
    assert got and all("lora_A" in name or "lora_B" in name for name in got)
    assert all(g is not None and g.abs().sum() > 0 for g in got.values())
    base = [p for p in peft_model.parameters() if not p.requires_grad]
    assert base and all(p.grad is None for p in base)


@pytest.mark.parametrize(
    ("target_modules", "layers"),
    [(["q_proj"], [0]), (["v_proj", "gate_proj"], [1])],
    ids=["q_only_first_layer", "v_and_mlp_second_layer"],
)
def test_lora_on_some_modules(model_dirs, target_modules, layers):
    """Layers whose q, k or v need no gradient: the attention Function sees mixed requires_grad."""
    peft_model = lora_model(load_model("qwen3", model_dirs["qwen3"]), target_modules, layers_to_transform=layers)
    case = CASES["ragged"]
    ids, labels = case.inputs(seed=14)
    got = _assert_matches_hf(peft_model, ids, labels, case.config())
    assert all(g is not None and g.abs().sum() > 0 for g in got.values())


@pytest.mark.parametrize("checkpoint_layers, compile_layers", [(True, False), (False, False), (False, True)])
def test_lora_dropout_is_replayed_in_stage_two(model_dirs, monkeypatch, checkpoint_layers, compile_layers):
    """In train mode with LoRA dropout, stage 2 recomputes exactly the K, V that stage 1 stored. Compiled layers
    with an active dropout are refused (with replay their stage 2 ran eager; without, bf16 adapters split
    stage 2's graphs at the float32-gradient linears: either way other masks were drawn)."""
    peft_model = lora_model(load_model("llama", model_dirs["llama"]), ["k_proj", "v_proj"], dropout=0.3)
    peft_model.train()
    stored, compared = {}, []
    real_write, real_attention = PagedKVStore.write, oomb.models.paged_attention

    def recording_write(self, layer, chunk, k, v):
        stored[layer, chunk.index] = (k.clone(), v.clone())
        real_write(self, layer, chunk, k, v)

    def comparing_attention(q, k, v, call, *args):
        want_k, want_v = stored[call.layer, call.chunk.index]
        compared.append(torch.equal(k, want_k) and torch.equal(v, want_v))
        return real_attention(q, k, v, call, *args)

    monkeypatch.setattr(PagedKVStore, "write", recording_write)
    monkeypatch.setattr(oomb.models, "paged_attention", comparing_attention)
    case = CASES["ragged"]
    config = OOMBConfig(chunk_size=case.chunk, page_size=case.page,
                        performance=PerformanceConfig(backend="torch", checkpoint_layers=checkpoint_layers,
                                                      compile_layers=compile_layers))
    ids, _ = case.inputs(seed=15)
    if compile_layers:  # refused: with bf16 adapters compiled stage 2 drew other masks
        with pytest.raises(ValueError, match=r"compile_layers=True with an active dropout \(.*lora_dropout"):
            oomb.forward_backward(peft_model, ids, None, config)
        return
    oomb.forward_backward(peft_model, ids, None, config)
    chunks_times_layers = len(stored)
    assert chunks_times_layers == 6 * 2
    # With layer checkpointing each layer's forward runs twice in stage 2 (forward, recompute).
    assert len(compared) == chunks_times_layers * (2 if checkpoint_layers else 1)
    assert all(compared)
    # The masks really differ between draws, so the equality above is not trivial.
    with torch.no_grad():
        first = peft_model(input_ids=ids).logits
        second = peft_model(input_ids=ids).logits
    assert not torch.equal(first, second)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_two_steps_accumulate_exactly_twice(models, family):
    model = models[family]
    case = CASES["ragged"]
    ids, labels = case.inputs(seed=3)
    model.zero_grad(set_to_none=True)
    hf_step(model, ids, labels)
    hf_step(model, ids, labels)
    want_twice = grads(model)
    model.zero_grad(set_to_none=True)
    first = oomb.forward_backward(model, ids, labels, case.config())
    once = grads(model)
    second = oomb.forward_backward(model, ids, labels, case.config())
    twice = grads(model)
    assert torch.equal(first, second)
    assert relative_error(twice, want_twice) <= GRAD_RTOL
    assert relative_error(twice, {name: 2 * g for name, g in once.items()}) <= 1e-6


@pytest.mark.parametrize("checkpoint_layers", [True, False])
def test_repeated_steps_are_bitwise_identical(models, checkpoint_layers):
    model = models["qwen2"]
    config = OOMBConfig(chunk_size=64, page_size=16,
                        performance=PerformanceConfig(backend="torch", checkpoint_layers=checkpoint_layers))
    ids = random_ids(2, 260, seed=4)
    results = []
    for seed in range(2):  # the global RNG state does not matter
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        loss = oomb.forward_backward(model, ids, None, config)
        results.append((loss, grads(model)))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[name], grads_b[name]) for name in grads_a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_logits_give_the_recomputed_gradients_bitwise(dtype):
    """recompute_logits=False keeps the loss slices' log-probabilities instead of recomputing them in
    backward: the same float operations on the same values, so the same bits."""
    model = build_tiny_model("qwen2", seed=6).to(dtype)
    ids = random_ids(2, 200, seed=6)
    results = {}
    for recompute in (True, False):
        config = OOMBConfig(chunk_size=64, page_size=16,
                            performance=PerformanceConfig(backend="torch", loss_chunk_tokens=24,
                                                          recompute_logits=recompute))
        model.zero_grad(set_to_none=True)
        results[recompute] = (oomb.forward_backward(model, ids, None, config), grads(model))
    (loss_a, grads_a), (loss_b, grads_b) = results[True], results[False]
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def test_the_engine_makes_a_trained_heads_gradient_in_the_loss_forward(monkeypatch):
    """The engine's fused loss gets a gradient sink for the trained head and makes its weight gradient in the
    forward (weight_gradient_now): every slice is called so, and the step still matches the full-
    sequence backward (HF) within the usual tolerances."""
    import oomb.loss as loss_module

    model = build_tiny_model("qwen2", seed=7)
    assert not model.config.tie_word_embeddings
    ids = random_ids(2, 200, seed=7)
    calls = []
    real = loss_module._HeadCrossEntropy.apply
    monkeypatch.setattr(loss_module._HeadCrossEntropy, "apply",
                        lambda *a: calls.append((a[6] is not None, a[7])) or real(*a))
    _assert_matches_hf(model, ids, ids.clone(), OOMBConfig(chunk_size=64, page_size=16,
                                                           performance=PerformanceConfig(backend="torch",
                                                                                         loss_chunk_tokens=24)))
    assert calls and set(calls) == {(True, True)}


@pytest.mark.parametrize("attention, checkpoint_layers", [("dense", True), ("dense", False), ("sparse", True),
                                                         ("sparse", False)])
def test_kept_attention_outputs_give_the_recomputed_gradients_bitwise(monkeypatch, attention, checkpoint_layers):
    """keep_attention_outputs: stage 2 takes stage 1's (out, lse) instead of computing the attention forward
    again (no attention forward runs in stage 2, with or without layer replay); stage 2's queries are stage
    1's bits here (eager layers), so the loss and every gradient are the same bits, and nothing is left kept
    after the step."""
    import oomb.attention.function as function

    model = build_tiny_model("qwen2", seed=7)
    ids = random_ids(2, 200, seed=7)
    layers = model.config.num_hidden_layers
    results, forwards = {}, []
    real = function._attention_forward
    monkeypatch.setattr(function, "_attention_forward",
                        lambda q, call: forwards.append(call.chunk.index) or real(q, call))
    for keep in (False, True):
        config = OOMBConfig(chunk_size=64, page_size=16, attention=attention, sparse=SparseConfig(budget=1),
                            performance=PerformanceConfig(backend="torch", checkpoint_layers=checkpoint_layers,
                                                          keep_attention_outputs=keep))
        forwards.clear()
        model.zero_grad(set_to_none=True)
        results[keep] = (oomb.forward_backward(model, ids, None, config), grads(model))
        chunks = -(-200 // 64)
        assert len(forwards) == chunks * layers * (1 if keep else 2)  # stage 1 only, or both stages
    (loss_a, grads_a), (loss_b, grads_b) = results[False], results[True]
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def test_kept_attention_outputs_refuse_offload_and_are_counted_by_the_plan():
    """Refused with offload; `oomb bench --keep-attention-outputs` sets it; the plan counts the kept outputs."""
    from oomb import cli
    from oomb.planning.memory import ModelShape, TrainingSetup, predict
    from oomb.tools import bench
    from oomb.training.presets import preset_config

    args = cli.build_parser().parse_args(["bench", "--quick", "--keep-attention-outputs", "--modes", "hf", "sparse"])
    assert bench.options_from_args(args).oomb_config().performance.keep_attention_outputs
    with pytest.raises(SystemExit, match="runs without offload"):  # the default modes include offload
        bench.options_from_args(cli.build_parser().parse_args(["bench", "--quick", "--keep-attention-outputs"]))

    with pytest.raises(ValueError, match="keep_attention_outputs=True needs offload.enabled=False"):
        OOMBConfig(performance=PerformanceConfig(keep_attention_outputs=True), offload=OffloadConfig(enabled=True))
    shape = ModelShape.from_hf_config(preset_config("qwen2.5-7b", 131072))
    setup = TrainingSetup(optimizer="none")
    kept = predict("sparse", shape, 131072, OOMBConfig(performance=PerformanceConfig(keep_attention_outputs=True)),
                   setup).gpu
    plain = predict("sparse", shape, 131072, OOMBConfig(), setup).gpu
    assert plain["kept attention"] == 0
    assert kept["kept attention"] == 131072 * 28 * 28 * (128 * 2 + 4)  # tokens x layers x query heads x (out, lse)
    assert {k: v for k, v in kept.items() if k != "kept attention"} == {k: v for k, v in plain.items()
                                                                         if k != "kept attention"}
    with pytest.raises(ValueError, match="without offload and context parallelism"):
        predict("sparse+offload", shape, 131072,
                OOMBConfig(performance=PerformanceConfig(keep_attention_outputs=True)), setup)


def test_the_chooser_keeps_kept_attention_outputs_on_the_gpu():
    """oomb train's chooser with keep_attention_outputs set: no offload candidate (which the option refuses),
    and the kept outputs in the plan's memory."""
    from oomb.planning.choose import Resources, Workload, choose_config
    from oomb.planning.memory import ModelShape

    workload = Workload(ModelShape.from_hf_config(build_tiny_model("qwen2").config), 4096, 1, torch.float32,
                        optimizer="none")
    plan = choose_config(workload, Resources("cuda", 1 << 40, 1 << 40, weights_loaded=True),
                         {"performance.keep_attention_outputs": True})
    assert plan.config.performance.keep_attention_outputs and not plan.config.offload.enabled
    assert plan.chosen.prediction.gpu["kept attention"] > 0


@pytest.mark.parametrize("family", ["mistral"])
def test_kept_attention_outputs_with_window_layers(family):
    """A model with sliding-window layers shorter than the step (their pages are freed and refilled): the
    kept outputs give the recomputed step's bits."""
    model = build_tiny_model(family, seed=8, sliding_window=48)
    ids = random_ids(1, 200, seed=8)
    results = []
    for keep in (False, True):
        model.zero_grad(set_to_none=True)
        config = OOMBConfig(chunk_size=64, page_size=16,
                            performance=PerformanceConfig(backend="torch", keep_attention_outputs=keep))
        results.append((oomb.forward_backward(model, ids, None, config), grads(model)))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def _checkpoint_flags(model):
    return [(m.gradient_checkpointing, m.training) for m in model.modules()
            if isinstance(m, GradientCheckpointingLayer)]


@pytest.mark.parametrize("family", FAMILIES)
def test_model_is_left_as_it_was(models, family):
    model = models[family]
    ids = random_ids(1, 150, seed=5)
    flags = _checkpoint_flags(model)
    assert flags, "the decoder layers should be GradientCheckpointingLayers"
    with torch.no_grad():
        before = model(input_ids=ids).logits
    model.zero_grad(set_to_none=True)
    oomb.forward_backward(model, ids, None, OOMBConfig(chunk_size=64, page_size=16,
                                                       performance=PerformanceConfig(backend="torch")))
    assert model.config._attn_implementation == "sdpa"
    assert _checkpoint_flags(model) == flags
    assert not model.training
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)


def test_store_is_empty_after_a_step(models, created_stores):
    model = models["llama"]
    case = CASES["batch2"]
    ids, labels = case.inputs(seed=6)
    model.zero_grad(set_to_none=True)
    oomb.forward_backward(model, ids, labels, case.config(), progress=True)
    assert len(created_stores) == 1
    store = created_stores[0]
    assert store.pool.capacity == 2 * -(-case.tokens // case.page)
    _assert_empty(store)


def test_failure_in_stage_two_leaves_store_empty_and_model_restored(models, created_stores, monkeypatch):
    model = models["qwen3"]
    case = CASES["ragged"]
    ids, labels = case.inputs(seed=7)
    flags = _checkpoint_flags(model)
    calls = []
    real_loss = oomb.engine.chunked_cross_entropy

    def failing_loss(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure in stage 2")
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(oomb.engine, "chunked_cross_entropy", failing_loss)
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="injected failure in stage 2"):
        oomb.forward_backward(model, ids, labels, case.config())
    _assert_empty(created_stores[0])
    assert model.config._attn_implementation == "sdpa"
    assert _checkpoint_flags(model) == flags

    # The model is usable again: the next step is exact.
    monkeypatch.setattr(oomb.engine, "chunked_cross_entropy", real_loss)
    _assert_matches_hf(model, ids, labels, case.config())
    _assert_empty(created_stores[1])


def test_sliding_window_shorter_than_the_sequence(models, monkeypatch):
    """A sliding window shorter than the sequence (and than a chunk) is masked exactly (more families
    and variants in test_families.py)."""
    model = models["mistral"]
    monkeypatch.setattr(model.config, "sliding_window", 50)
    case = CASES["ragged"]
    ids, labels = case.inputs(seed=8)
    _assert_matches_hf(model, ids, labels, case.config())


def test_failure_in_stage_one_leaves_store_empty(models, created_stores, monkeypatch):
    """An error in the attention of chunk 1 (stage 1) frees every page and restores the model."""
    model = models["qwen2"]
    real_fill = oomb.models.fill_and_attend
    calls = {"n": 0}

    def failing_fill(q, k, v, call, *args):
        calls["n"] += 1
        if call.chunk.index == 1:
            raise RuntimeError("injected stage-1 failure")
        return real_fill(q, k, v, call, *args)

    monkeypatch.setattr(oomb.models, "fill_and_attend", failing_fill)
    ids = random_ids(1, 200, seed=8)
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="injected stage-1 failure"):
        oomb.forward_backward(model, ids, None, OOMBConfig(chunk_size=64, page_size=16,
                                                           performance=PerformanceConfig(backend="torch")))
    assert calls["n"] > 1
    _assert_empty(created_stores[0])
    assert model.config._attn_implementation == "sdpa"
    assert all(p.grad is None for p in model.parameters())


def test_tied_embeddings():
    """Small Qwen models tie the LM head to the embeddings: both uses add into one gradient."""
    model = build_tiny_model("qwen2", seed=11, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    case = CASES["batch2"]
    ids, labels = case.inputs(seed=9)
    _assert_matches_hf(model, ids, labels, case.config())


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True:UserWarning")
@pytest.mark.parametrize("checkpoint_layers", [True, False])
def test_user_enabled_gradient_checkpointing_in_train_mode(model_dirs, checkpoint_layers):
    """A model prepared for HF training (reentrant checkpointing, train mode) still gets exact grads."""
    model = load_model("llama", model_dirs["llama"])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    flags = _checkpoint_flags(model)
    funcs = [m._gradient_checkpointing_func for m in model.modules()
             if isinstance(m, GradientCheckpointingLayer)]
    case = CASES["ragged"]
    ids, labels = case.inputs(seed=10)
    config = OOMBConfig(chunk_size=64, page_size=16,
                        performance=PerformanceConfig(backend="torch", checkpoint_layers=checkpoint_layers))
    _assert_matches_hf(model, ids, labels, config)
    assert _checkpoint_flags(model) == flags
    assert funcs == [m._gradient_checkpointing_func for m in model.modules()
                     if isinstance(m, GradientCheckpointingLayer)]
    assert model.training


def test_bfloat16_page_gradients_are_close(models):
    """kv_grad_dtype="bf16" rounds the page gradients: close to, not equal to, the exact gradient."""
    model = models["llama"]
    ids, labels = CASES["ragged"].inputs(seed=12)
    model.zero_grad(set_to_none=True)
    hf_step(model, ids, labels)
    want = grads(model)
    model.zero_grad(set_to_none=True)
    oomb.forward_backward(model, ids, labels,
                          OOMBConfig(chunk_size=64, page_size=16, performance=PerformanceConfig(backend="torch"),
                                     precision=PrecisionConfig(kv_grad_dtype="bf16")))
    assert GRAD_RTOL < relative_error(grads(model), want) <= 1e-2


def test_sliding_window_covering_the_sequence(models, monkeypatch):
    """A sliding window as long as the sequence is plain causal attention: allowed and exact."""
    model = models["mistral"]
    case = CASES["ragged"]
    monkeypatch.setattr(model.config, "sliding_window", case.tokens)
    ids, labels = case.inputs(seed=13)
    _assert_matches_hf(model, ids, labels, case.config())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bfloat16_model_is_as_close_as_hugging_face(family):
    """In bf16 oomb's gradient error (against fp32) is within 2x that of HF's own bf16 backward."""
    model = build_tiny_model(family, seed=16)
    ids = random_ids(2, 333, seed=16)
    config = OOMBConfig(chunk_size=64, page_size=16, performance=PerformanceConfig(backend="torch"))
    hf_step(model, ids, ids)
    exact = grads(model)
    model.to(torch.bfloat16)
    model.zero_grad(set_to_none=True)
    hf_loss = hf_step(model, ids, ids)
    hf_error = relative_error(grads(model), exact)
    model.zero_grad(set_to_none=True)
    loss = oomb.forward_backward(model, ids, None, config)
    assert loss.dtype == torch.float32
    assert abs(float(loss) - float(hf_loss)) <= 1e-2 * float(hf_loss)
    assert 0 < hf_error < 0.05
    assert relative_error(grads(model), exact) <= 2 * hf_error


def test_frozen_model_gives_the_loss_and_no_gradient(model_dirs):
    model = load_model("qwen2", model_dirs["qwen2"]).requires_grad_(False)
    case = CASES["ignored_spans"]
    ids, labels = case.inputs(seed=17)
    with torch.no_grad():
        want = model(input_ids=ids, labels=labels).loss
    got = oomb.forward_backward(model, ids, labels, case.config())
    torch.testing.assert_close(got, want, rtol=LOSS_RTOL, atol=0)
    assert all(p.grad is None for p in model.parameters())


def test_other_attention_implementation_is_restored():
    model = build_tiny_model("llama", seed=18)
    model.set_attn_implementation("eager")
    ids = random_ids(1, 100, seed=18)
    oomb.forward_backward(model, ids, None, OOMBConfig(chunk_size=64, page_size=16,
                                                       performance=PerformanceConfig(backend="torch")))
    assert model.config._attn_implementation == "eager"


def test_checkpoint_replay_reuses_attention_forward(models, monkeypatch):
    """With layer checkpointing, stage 2 computes each layer's attention once, not twice."""
    from oomb.attention import reference
    from oomb.attention.backend import AttentionBackend

    calls = {"forward": 0}

    def counting_forward(*args, **kwargs):
        key_range, query_start = kwargs.get("key_range"), args[4]
        calls["forward"] += key_range is None or key_range[0] == query_start  # one local window per call
        return reference.paged_attention_forward(*args, **kwargs)

    backend = AttentionBackend("counting", counting_forward, reference.paged_attention_backward,
                               reference.backward_delta)
    monkeypatch.setattr(oomb.engine, "select_backend", lambda name, device, **_: backend)
    model = models["qwen2"]
    ids = random_ids(1, 200, seed=21)
    model.zero_grad(set_to_none=True)
    oomb.forward_backward(model, ids, None, OOMBConfig(chunk_size=64, page_size=16,
                                                       performance=PerformanceConfig(checkpoint_layers=True)))
    num_chunks, num_layers = 4, model.config.num_hidden_layers
    assert calls["forward"] == 2 * num_chunks * num_layers  # stage 1 + stage 2, no replay
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("stream_block_pages, offload, case, whole_history", [
    (256, False, "batch2", False), (2, False, "batch2", False), (2, False, "batch2", True), (2, True, "batch2", True),
    (2, True, "ragged", True),
], ids=["one-history-window", "many-windows", "whole-history", "offload", "offload-batch1"])
def test_windowed_fused_backend_matches_full_sequence_backward(models, monkeypatch, stream_block_pages, offload,
                                                               case, whole_history):
    """The cudnn backend's windowing (cudnn_paged.py) on a plain-torch stand-in for cuDNN, through the
    whole engine, with offload's staging pools too: gradients equal a full-sequence backward. Asking
    for the whole history (as cudnn does) gives one history window where the pages are on the GPU;
    streamed pages keep their blocks."""
    from test_cudnn_paged import MATH

    from oomb.attention import cudnn_paged
    from oomb.attention.backend import AttentionBackend

    history_windows = []

    def recording_forward(q, k_pool, v_pool, page_table, query_start, scale, *, key_range=None, out_dtype=None):
        if key_range is not None and key_range[0] < query_start:
            history_windows.append(key_range)
        return MATH.paged_attention_forward(q, k_pool, v_pool, page_table, query_start, scale, key_range=key_range,
                                            out_dtype=out_dtype)

    backend = AttentionBackend("windowed-math", recording_forward, MATH.paged_attention_backward,
                               cudnn_paged.no_delta, whole_history=whole_history)
    monkeypatch.setattr(oomb.engine, "select_backend", lambda name, device, **_: backend)
    ids, labels = CASES[case].inputs(seed=200)
    config = OOMBConfig(chunk_size=64, page_size=16,
                        offload=OffloadConfig(stream_block_pages=stream_block_pages, enabled=offload))
    _assert_matches_hf(models["qwen2"], ids, labels, config)
    assert history_windows
    if stream_block_pages == 2:  # histories of up to 12 blocks of 2 pages
        one_window_per_history = all(lo == 0 for lo, _ in history_windows)
        assert one_window_per_history == (whole_history and not offload)
