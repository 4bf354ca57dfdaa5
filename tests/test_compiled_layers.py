"""OOMBConfig.compile_layers: decoder layers compiled for the step give the eager step's gradients (to float
rounding: fused kernels sum in another order), are restored afterwards, and the automatic choice."""

import dataclasses

import pytest
import torch
from helpers import build_tiny_model, grads
from peft import LoraConfig, get_peft_model
from torch._dynamo.utils import counters

import oomb
from oomb.compiled_layers import COMPILED_CALL, compile_layers_by_default, decoder_layers
from oomb.parallel import ParallelSetup

TOLERANCE = 1e-5
"""Relative error of each gradient, compiled against eager, in float32. Chosen before measuring: float32
rounding of sums taken in another order is ~1e-7 relative; a wrong graph (a missed residual, a stale
norm weight) is O(1)."""


def _step(model, ids, **options):
    model.zero_grad(set_to_none=True)
    config = oomb.OOMBConfig(chunk_size=128, page_size=32, **options)
    loss = oomb.forward_backward(model, ids, config=config)
    return float(loss), grads(model)


def _assert_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, g in got.items():
        rel = float((g - want[name]).norm() / want[name].norm().clamp_min(1e-30))
        assert rel <= TOLERANCE, (name, rel)


@pytest.mark.parametrize("options", [{}, {"attention": "sparse", "sparse_budget": 2}, {"checkpoint_layers": False}],
                         ids=["dense", "sparse", "no-replay"])
def test_compiled_layers_give_the_eager_gradients(options):
    model = build_tiny_model("qwen2")
    ids = torch.randint(0, model.config.vocab_size, (1, 640), generator=torch.Generator().manual_seed(0))
    eager_loss, eager = _step(model, ids, compile_layers=False, **options)
    torch._dynamo.reset()  # compile afresh, so that the counter shows it
    captured = counters["stats"]["calls_captured"]
    loss, compiled = _step(model, ids, compile_layers=True, **options)
    assert counters["stats"]["calls_captured"] > captured  # the layers ran as compiled graphs
    assert loss == pytest.approx(eager_loss, rel=1e-6)
    _assert_close(compiled, eager)
    assert all(getattr(layer, COMPILED_CALL, None) is None for layer in decoder_layers(model.model))  # restored


def test_compiled_layers_with_lora():
    model = get_peft_model(build_tiny_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                                  "down_proj"]))
    ids = torch.randint(0, model.config.vocab_size, (1, 384), generator=torch.Generator().manual_seed(1))
    _, eager = _step(model, ids, compile_layers=False)
    _, compiled = _step(model, ids, compile_layers=True)
    assert any("lora" in name for name in compiled)
    _assert_close(compiled, eager)


def test_a_layer_the_user_compiled_stays_compiled():
    model = build_tiny_model("qwen2")
    first = decoder_layers(model.model)[0]
    first.compile()
    user_compiled = getattr(first, COMPILED_CALL)
    _step(model, torch.randint(0, model.config.vocab_size, (1, 256)), compile_layers=True)
    assert getattr(first, COMPILED_CALL) is user_compiled
    assert getattr(decoder_layers(model.model)[1], COMPILED_CALL, None) is None


def test_automatic_choice():
    model = build_tiny_model("qwen2")
    auto = oomb.OOMBConfig()
    single = ParallelSetup()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compile_layers_by_default(auto, cuda, single, model) is True
    assert compile_layers_by_default(auto, cpu, single, model) is False  # compiling costs more than it saves there
    assert compile_layers_by_default(dataclasses.replace(auto, deterministic=True), cuda, single, model) is False
    assert compile_layers_by_default(dataclasses.replace(auto, compile_layers=True), cpu, single, model) is True
    assert compile_layers_by_default(dataclasses.replace(auto, compile_layers=False), cuda, single, model) is False
    sharded = ParallelSetup(mesh=object())
    assert compile_layers_by_default(auto, cuda, sharded, model) is False
    dropping = get_peft_model(build_tiny_model("llama"), LoraConfig(r=2, lora_dropout=0.1, target_modules=["v_proj"]))
    dropping.train()
    assert compile_layers_by_default(auto, cuda, single, dropping) is False  # replay would redraw the masks
    no_replay = dataclasses.replace(auto, checkpoint_layers=False)
    assert compile_layers_by_default(no_replay, cuda, single, dropping) is True
    dropping.eval()
    assert compile_layers_by_default(auto, cuda, single, dropping) is True
    moe = build_tiny_model("qwen2")
    moe.config.num_experts = 4
    assert compile_layers_by_default(auto, cuda, single, moe) is False


def test_compile_layers_must_be_a_bool_or_none():
    with pytest.raises(ValueError, match="compile_layers='yes' must be True, False or None"):
        oomb.OOMBConfig(compile_layers="yes")


@pytest.mark.gpu
def test_compiled_layers_on_the_gpu_give_the_eager_gradients():
    """The same on CUDA (Triton kernels from inductor), float32, dense and sparse."""
    model = build_tiny_model("qwen2").cuda()
    ids = torch.randint(0, model.config.vocab_size, (1, 640), generator=torch.Generator().manual_seed(0)).cuda()
    for options in ({}, {"attention": "sparse", "sparse_budget": 2}):
        _, eager = _step(model, ids, compile_layers=False, **options)
        _, compiled = _step(model, ids, compile_layers=True, **options)
        _assert_close(compiled, eager)
