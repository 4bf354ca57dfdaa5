"""Fp32GradAccumulator: chunk gradients of bf16 parameters summed in fp32, rounded once."""

import pytest
import torch

from oomb.grads import Fp32GradAccumulator


def _param(dtype=torch.bfloat16, grad=None):
    p = torch.nn.Parameter(torch.zeros(64, dtype=dtype))
    p.grad = grad
    return p


def test_sums_chunks_in_fp32_and_rounds_once():
    prior = torch.full((64,), 0.5, dtype=torch.bfloat16)
    p = _param(grad=prior.clone())
    acc = Fp32GradAccumulator([p])
    assert p.grad is None
    # A large first chunk, then small ones: each alone is below bf16's resolution at 1.5 (2**-7).
    chunks = [torch.full((64,), 1.0)] + [torch.full((64,), 2e-3)] * 8
    for g in chunks:
        p.grad = g.to(torch.bfloat16)
        acc.collect()
        assert p.grad is None
    acc.finish()
    exact = sum(g.to(torch.bfloat16).float() for g in chunks) + 0.5
    assert p.grad.dtype == torch.bfloat16
    assert torch.equal(p.grad, exact.to(torch.bfloat16))
    naive = prior.clone()
    for g in chunks:
        naive += g.to(torch.bfloat16)
    assert (naive.float() - exact).abs().max() > (p.grad.float() - exact).abs().max()


def test_leaves_fp32_and_frozen_parameters_alone():
    fp32 = _param(torch.float32)
    frozen = _param()
    frozen.requires_grad_(False)
    acc = Fp32GradAccumulator([fp32, frozen])
    assert acc.params == []


def test_abort_restores_prior_and_disabled_is_a_no_op():
    prior = torch.ones(64, dtype=torch.bfloat16)
    p = _param(grad=prior)
    acc = Fp32GradAccumulator([p])
    p.grad = torch.ones(64, dtype=torch.bfloat16)
    acc.collect()
    acc.abort()
    assert p.grad is prior
    q = _param(grad=prior)
    off = Fp32GradAccumulator([q], enabled=False)
    assert off.params == [] and q.grad is prior


def test_parameter_without_gradient_keeps_prior():
    p = _param(grad=None)
    acc = Fp32GradAccumulator([p])
    acc.collect()
    acc.finish()
    assert p.grad is None


def test_targets_receive_every_chunk_unrounded_and_grad_stays():
    prior = torch.ones(64, dtype=torch.bfloat16)
    p = _param(grad=prior)
    target = torch.zeros(64, dtype=torch.float32)
    acc = Fp32GradAccumulator([p], enabled=True, targets={p: target})
    chunks = [torch.full((64,), 1.0)] + [torch.full((64,), 2e-3)] * 8
    for g in chunks:
        p.grad = g.to(torch.bfloat16)
        acc.collect()
    acc.finish()
    assert p.grad is prior
    assert torch.equal(target, sum(g.to(torch.bfloat16).float() for g in chunks))


def test_target_of_wrong_shape_is_refused():
    p = _param()
    with pytest.raises(ValueError, match="does not fit a parameter of shape"):
        Fp32GradAccumulator([p], targets={p: torch.zeros(3)})


def test_forward_backward_adds_into_grad_targets(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import oomb

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    ids = torch.randint(0, 64, (1, 300))
    config = oomb.OOMBConfig(chunk_size=64, page_size=32)
    oomb.forward_backward(model, ids, config=config)
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    targets = {p: torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()}
    oomb.forward_backward(model, ids, config=config, grad_targets=targets)
    for name, p in model.named_parameters():
        assert p.grad is None, name
        torch.testing.assert_close(targets[p].float(), expected[name], rtol=1e-5, atol=1e-7)
