"""OOMBConfig validation and the errors forward_backward raises for bad input."""

from __future__ import annotations

import pytest
import torch
from helpers import VOCAB, build_tiny_model, random_ids
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaModel, OPTConfig, OPTForCausalLM

import oomb
from oomb import OOMBConfig
from oomb.attention.backend import TORCH_BACKEND, select_backend
from oomb.config import PerformanceConfig, PrecisionConfig

SMALL = OOMBConfig(chunk_size=32, page_size=16, performance=PerformanceConfig(backend="torch"))


def test_default_config_is_valid():
    config = OOMBConfig()
    assert config.chunk_size % config.page_size == 0
    assert config.precision.grad_dtype == torch.float32
    assert config.performance.checkpoint_layers is True
    assert config.attention == "dense"


def test_sparse_config():
    config = OOMBConfig.from_dict({"attention": "sparse", "sparse": {"budget": 0, "sink_pages": 0, "score": "mean",
                                                                     "research": {"selection": "shared"},
                                                                     "leak_free": True}})
    assert (config.attention, config.sparse.budget, config.sparse.sink_pages) == ("sparse", 0, 0)
    assert (config.sparse.score, config.sparse.research.selection, config.sparse.leak_free) == ("mean", "shared", True)


def test_chunk_size_must_be_a_multiple_of_page_size():
    message = r"chunk_size=3000 must be a multiple of page_size=128 \(e\.g\. chunk_size=2944\)"
    with pytest.raises(ValueError, match=message):
        OOMBConfig(chunk_size=3000, page_size=128)


@pytest.mark.parametrize(
    ("field", "value"),
    [("chunk_size", 0), ("chunk_size", -128), ("page_size", 0), ("page_size", -16),
     ("performance.loss_chunk_tokens", 0), ("chunk_size", 256.0), ("page_size", True),
     ("performance.loss_chunk_tokens", "64"), ("offload.stream_block_pages", 0)],
)
def test_sizes_must_be_positive_integers(field, value):
    with pytest.raises(ValueError, match=rf"{field}={value!r} must be a positive integer"):
        OOMBConfig.from_dict({field: value})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"performance.backend": "cuda"},
         r"performance.backend='cuda' is not supported; use one of: \('auto', 'torch', 'triton', 'cudnn'\)"),
        ({"attention": "flash"}, r"attention='flash' is not supported; use one of: \('dense', 'sparse'\)"),
        ({"sparse.budget": -1}, r"sparse.budget=-1 must be an integer >= 0 \(a number of pages\)"),
        ({"sparse.budget": 4.0}, r"sparse.budget=4\.0 must be an integer >= 0"),
        ({"sparse.query_block_pages": 0}, r"sparse.query_block_pages=0 must be an integer >= 1"),
        ({"sparse.query_block_pages": True}, r"sparse.query_block_pages=True must be an integer >= 1"),
        ({"sparse.sink_pages": True}, r"sparse.sink_pages=True must be an integer >= 0"),
        ({"sparse.score": "max"},
         r"sparse.score='max' is not supported; use one of: \('auto', 'rerank', 'minmax', 'mean', 'exact'\)"),
        ({"sparse.research.selection": "head"},
         r"sparse.research.selection='head' is not supported; use one of: \('kv_head', 'shared'\)"),
        ({"sparse.leak_free": 1}, r"sparse.leak_free=1 must be True or False"),
        ({"precision.kv_grad_dtype": "float8"},
         r"precision.kv_grad_dtype='float8' is not supported; use one of: .*bf16"),
        ({"precision.kv_grad_dtype": torch.int8}, r"precision.kv_grad_dtype=torch\.int8 is not supported"),
        ({"performance.checkpoint_layers": "yes"}, r"performance.checkpoint_layers='yes' must be True or False"),
        ({"performance.recompute_logits": "no"}, r"performance.recompute_logits='no' must be True or False"),
        ({"offload.enabled": 1}, r"offload.enabled=1 must be True or False"),
        ({"offload.stream_buffers": 1}, r"offload.stream_buffers=1 must be an integer >= 2"),
    ],
)
def test_bad_option_names(options, message):
    with pytest.raises(ValueError, match=message):
        OOMBConfig.from_dict(options)


@pytest.mark.parametrize(
    ("value", "dtype"),
    [("float32", torch.float32), ("fp32", torch.float32), ("bf16", torch.bfloat16),
     ("bfloat16", torch.bfloat16), ("fp16", torch.float16), (torch.bfloat16, torch.bfloat16)],
)
def test_kv_grad_dtype_names(value, dtype):
    assert OOMBConfig(precision=PrecisionConfig(kv_grad_dtype=value)).precision.grad_dtype == dtype


def test_from_dict():
    config = OOMBConfig.from_dict({"chunk_size": 512, "page_size": 64, "performance": {"checkpoint_layers": False}})
    assert config == OOMBConfig(chunk_size=512, page_size=64, performance=PerformanceConfig(checkpoint_layers=False))
    message = r"unknown OOMBConfig option\(s\) \['chunk', 'pages'\]; valid options: .*'chunk_size'"
    with pytest.raises(ValueError, match=message):
        OOMBConfig.from_dict({"chunk": 512, "pages": 64, "page_size": 64})
    with pytest.raises(ValueError, match="must be a multiple of page_size"):
        OOMBConfig.from_dict({"chunk_size": 100, "page_size": 64})


def test_backend_selection():
    cpu = torch.device("cpu")
    assert select_backend("torch", cpu) is TORCH_BACKEND
    assert select_backend("auto", cpu) is TORCH_BACKEND
    with pytest.raises(ValueError, match="backend='cuda' is not supported"):
        select_backend("cuda", cpu)


def test_triton_backend_on_a_cpu_is_refused_unless_interpreted(monkeypatch):
    """backend='triton' on a CPU is a one-line error naming the fix (it ended in a RuntimeError mid-step)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend='triton' needs a CUDA device; got cpu .*use backend 'torch'"):
        select_backend("triton", torch.device("cpu"))


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("llama")


def _step(model, input_ids, labels=None, config=None):
    return oomb.forward_backward(model, input_ids, labels, config or SMALL)


def _assert_untouched(model):
    assert model.config._attn_implementation == "sdpa"
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("shape", [(1, 0), (0,), (0, 5)])
def test_empty_sequence(model, shape):
    with pytest.raises(ValueError, match="input_ids is empty"):
        _step(model, torch.zeros(shape, dtype=torch.long))
    _assert_untouched(model)


def test_labels_of_another_shape(model):
    ids = random_ids(1, 10, seed=0)
    with pytest.raises(ValueError, match=r"labels shape \(1, 9\) differs from input_ids shape \(1, 10\)"):
        _step(model, ids, ids[:, :9])
    with pytest.raises(ValueError, match=r"labels shape \(2, 10\) differs from input_ids shape \(1, 10\)"):
        _step(model, ids, ids.expand(2, -1))
    _assert_untouched(model)


@pytest.mark.parametrize(("position", "value"), [(3, -1), (0, -100), (7, VOCAB), (9, VOCAB + 50)])
def test_ids_out_of_vocabulary(model, position, value):
    ids = random_ids(2, 10, seed=1)
    ids[1, position] = value
    low, high = min(int(ids.min()), value), max(int(ids.max()), value)
    with pytest.raises(ValueError, match=rf"input_ids must lie in \[0, {VOCAB}\).*found \[{low}, {high}\]"):
        _step(model, ids, ids.clamp(0, VOCAB - 1))
    _assert_untouched(model)


@pytest.mark.parametrize("value", [-1, -99, VOCAB])
def test_labels_out_of_vocabulary(model, value):
    ids = random_ids(1, 10, seed=2)
    labels = ids.clone()
    labels[0, 4] = value
    with pytest.raises(ValueError, match=rf"labels must be -100 or lie in \[0, {VOCAB}\)"):
        _step(model, ids, labels)
    _assert_untouched(model)


def test_no_counted_label(model):
    ids = random_ids(1, 40, seed=3)
    labels = torch.full_like(ids, -100)
    with pytest.raises(ValueError, match=r"labels have no counted position \(all -100 after shifting\)"):
        _step(model, ids, labels)
    labels[0, 0] = ids[0, 0]  # the first label is never a target: still nothing to count
    with pytest.raises(ValueError, match="labels have no counted position"):
        _step(model, ids, labels)
    _assert_untouched(model)


def test_input_types(model):
    ids = random_ids(1, 10, seed=4)
    with pytest.raises(TypeError, match="input_ids must be a torch.Tensor, got list"):
        _step(model, ids[0].tolist())
    with pytest.raises(TypeError, match="input_ids must be integer token ids, got dtype torch.float32"):
        _step(model, ids.float())
    with pytest.raises(ValueError, match=r"input_ids must have shape \(batch, tokens\), got \(1, 1, 10\)"):
        _step(model, ids[None])
    with pytest.raises(TypeError, match="labels must be a torch.Tensor or None, got list"):
        _step(model, ids, ids.tolist())
    _assert_untouched(model)


def test_unsupported_model_family():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=64))
    ids = random_ids(1, 10, seed=5, vocab=64)
    with pytest.raises(NotImplementedError,
                       match=r"model type 'gpt2' \(GPT2LMHeadModel\) is not supported: oomb lacks learned absolute "
                             r"position embeddings .*; supported: llama, mistral, qwen2, qwen3, qwen3_moe, gemma2"):
        _step(gpt2, ids)
    assert all(p.grad is None for p in gpt2.parameters())
    opt = OPTForCausalLM(OPTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64,
                                   vocab_size=64, word_embed_proj_dim=32))
    with pytest.raises(NotImplementedError, match=r"model type 'opt' \(OPTForCausalLM\) is not supported; "
                                                  r"supported: llama, mistral, qwen2, qwen3, "):
        _step(opt, ids)


def test_models_that_are_not_causal_lms():
    ids = random_ids(1, 10, seed=6)
    with pytest.raises(TypeError, match="expected a transformers PreTrainedModel .* got Linear"):
        _step(nn.Linear(4, 4), ids)
    bare = LlamaModel(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, vocab_size=VOCAB, intermediate_size=64))
    with pytest.raises(TypeError, match="LlamaModel has no LM head; pass a \\*ForCausalLM model"):
        _step(bare, ids)


def test_oomb_attention_outside_a_step(model):
    ids = random_ids(1, 10, seed=7)
    model.set_attn_implementation("oomb")
    try:
        with pytest.raises(RuntimeError, match="only works inside oomb.forward_backward"):
            model(input_ids=ids)
    finally:
        model.set_attn_implementation("sdpa")


def test_attention_dropout_is_refused(model, monkeypatch):
    """In train mode with attention dropout, the step refuses and leaves the model as it was."""
    monkeypatch.setattr(model.config, "attention_dropout", 0.1)
    for layer in model.model.layers:
        monkeypatch.setattr(layer.self_attn, "attention_dropout", 0.1)
    model.train()
    try:
        with pytest.raises(NotImplementedError, match=r"attention dropout \(0\.1\) is not supported"):
            _step(model, random_ids(1, 40, seed=8))
    finally:
        model.eval()
    _assert_untouched(model)
