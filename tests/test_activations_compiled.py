"""The memory model's count of what compiled decoder layers keep less of (activations.compiled_saving_bytes_per_token),
checked against the tensors autograd saves for one layer, eager and compiled (torch.compile on the CPU), and the
planner's use of it."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, Qwen2Config, Qwen2ForCausalLM

import oomb
from oomb.config import PerformanceConfig, PrecisionConfig
from oomb.fp32_linear import float32_weight_gradients
from oomb.grads import Fp32GradAccumulator
from oomb.planning.activations import chunk_activation_bytes, compiled_saving_bytes_per_token
from oomb.planning.memory import TrainingSetup, predict
from oomb.planning.model_shape import ModelShape
from oomb.tools.plan import preset_config

TOKENS = 256


@torch.compiler.disable
def _attention_outside_the_graph(module, q, k, v, mask, **kwargs):
    """Causal attention left out of the compiled graph, as oomb's attention is (oomb/models.py)."""
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         is_causal=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("oomb_test_uncompiled", _attention_outside_the_graph)


def _saved_bytes(layer, x, position_embeddings) -> int:
    """Bytes of the distinct storages autograd saves for the layer's backward."""
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, position_embeddings=position_embeddings, attention_mask=None)
    return sum(storages.values())


def _saving_per_token(fp32_linear_grads: bool) -> tuple[int, ModelShape]:
    """Bytes per token a compiled layer saves less than the eager one (hidden 256, intermediate 768, so that
    the MLP's and the norms' terms differ; bf16), with the linear layers' gradients going to float32 sums
    (fp32_linear.py) or to .grad."""
    config = Qwen2Config(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=64, attn_implementation="oomb_test_uncompiled")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    layer = model.model.layers[0]
    x = torch.randn(1, TOKENS, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    position_embeddings = model.model.rotary_emb(x, torch.arange(TOKENS)[None])
    routed = float32_weight_gradients(model, Fp32GradAccumulator(model.parameters(), fp32_linear_grads))
    with routed as layers:
        assert bool(layers) == fp32_linear_grads
        eager = _saved_bytes(layer, x, position_embeddings)
        torch._dynamo.reset()
        layer.compile()
        try:
            compiled = _saved_bytes(layer, x, position_embeddings)
        finally:
            torch._dynamo.reset()
    return (eager - compiled) // TOKENS, ModelShape.from_hf_config(config)


@pytest.mark.slow
def test_compiled_layer_saves_what_the_memory_model_counts():
    """The compiled layer saves exactly compiled_saving_bytes_per_token less per token than the eager one."""
    saving, shape = _saving_per_token(fp32_linear_grads=False)
    assert saving == compiled_saving_bytes_per_token(shape, torch.bfloat16)


@pytest.mark.slow
def test_float32_linear_gradients_are_not_counted():
    """Where the linear layers' gradients go to float32 sums the compiled graphs break at them and save more
    (the MLP's product): the compiled layer still saves something, less than the formula, and the memory
    model counts nothing of it there (never less memory than the step takes)."""
    saving, shape = _saving_per_token(fp32_linear_grads=True)
    assert 0 < saving < compiled_saving_bytes_per_token(shape, torch.bfloat16)
    config = oomb.OOMBConfig(performance=PerformanceConfig(checkpoint_layers=False),
                             precision=PrecisionConfig(fp32_grad_accumulation=True))
    setup = TrainingSetup(optimizer="none")
    eager = predict("dense", shape, 4096, config, setup).gpu["activations"]
    assert predict("dense", shape, 4096, config, dataclasses.replace(setup, compiled_layers=True)).gpu[
        "activations"] == eager


@pytest.mark.parametrize("replay", [False, True])
def test_chunk_activations_count_compiled_layers_without_replay(replay):
    """Without layer replay compiled layers keep the saving per dense layer and token; with replay one layer's
    activations exist at a time and are counted whole."""
    shape = ModelShape.from_hf_config(preset_config("qwen2.5-7b"))
    config = oomb.OOMBConfig(performance=PerformanceConfig(checkpoint_layers=replay))
    eager = chunk_activation_bytes(shape, 4096, config, torch.bfloat16)
    compiled = chunk_activation_bytes(shape, 4096, config, torch.bfloat16, compiled=True)
    saving = 0 if replay else shape.num_layers * 4096 * compiled_saving_bytes_per_token(shape, torch.bfloat16)
    assert eager - compiled == saving
    if not replay:  # the 7B shape at chunk 4096: within 0.3 % of the 7.09-7.11 GiB the H200 measured
        assert saving / 1024**3 == pytest.approx(7.10, rel=0.003)


def test_predict_and_planner_follow_compiled_layers():
    """predict's activations term takes TrainingSetup.compiled_layers (bf16 .grad, as oomb bench runs); the
    planner counts compiled layers only for a candidate that compiles where Workload.may_compile says the
    machine and model allow it, and not with float32 gradient targets."""
    from oomb.planning.choose import Resources, Workload, predict_candidate

    shape = ModelShape.from_hf_config(preset_config("qwen2.5-7b"))
    config = oomb.OOMBConfig(attention="sparse", performance=PerformanceConfig(checkpoint_layers=False),
                             precision=PrecisionConfig(fp32_grad_accumulation=False))
    setup = TrainingSetup(optimizer="none")
    eager = predict("sparse", shape, 131072, config, setup).gpu["activations"]
    compiled = predict("sparse", shape, 131072, config, dataclasses.replace(setup, compiled_layers=True))
    assert eager - compiled.gpu["activations"] == chunk_activation_bytes(shape, 4096, config, torch.bfloat16) \
        - chunk_activation_bytes(shape, 4096, config, torch.bfloat16, compiled=True)
    gpu = Resources("cuda", gpu_limit=200 * 1024**3, host_limit=200 * 1024**3, weights_loaded=True)
    workload = Workload(shape, 131072, optimizer="none")
    may = dataclasses.replace(workload, may_compile=True)
    assert predict_candidate(may, gpu, config).gpu_bytes < predict_candidate(workload, gpu, config).gpu_bytes
    replay = config.with_options({"performance.checkpoint_layers": True})  # compiled too, one layer's weight grads
    assert predict_candidate(may, gpu, replay).gpu_bytes > predict_candidate(workload, gpu, replay).gpu_bytes
    assert (predict_candidate(may, gpu, replay).prediction.gpu["activations"]
            == predict_candidate(workload, gpu, replay).prediction.gpu["activations"])
    cpu = Resources("cpu", host_limit=200 * 1024**3)  # compiled layers are a CUDA default
    assert predict_candidate(may, cpu, config).gpu_bytes == predict_candidate(workload, cpu, config).gpu_bytes
    targets = dataclasses.replace(workload, fp32_targets=True)  # master weights: float32 linear gradients
    assert predict_candidate(dataclasses.replace(targets, may_compile=True), gpu, config).gpu_bytes \
        == predict_candidate(targets, gpu, config).gpu_bytes


def test_the_choice_says_compiled_only_where_the_step_compiles():
    """The chooser's summary (Choice.compiled_layers, `oomb plan`'s "layers: compiled" line) follows the workload:
    a step that may not compile (several processes, an active dropout) is not reported compiled."""
    from oomb.planning.choose import Resources, Workload, choose_config

    shape = ModelShape.from_hf_config(preset_config("qwen2.5-7b"))
    gpu = Resources("cuda", gpu_limit=200 * 1024**3, host_limit=200 * 1024**3, weights_loaded=True)
    workload = Workload(shape, 131072, lora_rank=16)
    assert choose_config(dataclasses.replace(workload, may_compile=True), gpu).compiled_layers
    assert not choose_config(workload, gpu).compiled_layers
