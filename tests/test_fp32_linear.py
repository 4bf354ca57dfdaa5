"""Linear layers' weight gradients with float32 results, or in place (oomb/fp32_linear.py)."""

import contextlib

import pytest
import torch
from torch import nn

from oomb.config import PrecisionConfig
from oomb.fp32_linear import (
    eligible_linears,
    float32_weight_gradients,
    in_place_linears,
    in_place_weight_gradients,
    matmul_float32,
)
from oomb.grads import Fp32GradAccumulator


def _linear(dtype=torch.bfloat16, bias=True, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(48, 24, bias=bias).to(dtype)


def _chunks(n=3, tokens=40, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(2, tokens, 48, generator=g).to(dtype), torch.randn(2, tokens, 24, generator=g).to(dtype))
            for _ in range(n)]


def test_chunk_gradients_are_summed_unrounded():
    """Three chunks' weight gradients: the float32 sum of float32 GEMMs (what one full-sequence GEMM
    sums before its single rounding), never rounded per chunk; input gradients as autograd's."""
    layer = _linear()
    acc = Fp32GradAccumulator(layer.parameters(), enabled=True)
    chunks = _chunks()
    with float32_weight_gradients(layer, acc) as changed:
        assert changed == [layer]
        for x, grad_out in chunks:
            x = x.clone().requires_grad_()
            layer(x).backward(grad_out)
            assert layer.weight.grad is None  # went to the accumulator, not through bf16
            want_dx = grad_out @ layer.weight
            assert torch.equal(x.grad, want_dx)
            acc.collect()
    xs = torch.cat([x for x, _ in chunks], dim=1).reshape(-1, 48).float()
    gs = torch.cat([g for _, g in chunks], dim=1).reshape(-1, 24).float()
    torch.testing.assert_close(acc.sums[layer.weight], gs.t() @ xs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(acc.sums[layer.bias], gs.sum(0), rtol=1e-5, atol=1e-5)
    exact = (gs.double().t() @ xs.double()).float()
    per_chunk = sum((g.reshape(-1, 24).t() @ x.reshape(-1, 48)).float() for x, g in chunks)  # rounded per chunk
    assert (acc.sums[layer.weight] - exact).abs().max() < (per_chunk - exact).abs().max() / 10
    total = acc.sums[layer.weight].clone()
    acc.finish()
    assert layer.weight.grad.dtype == torch.bfloat16 and torch.equal(layer.weight.grad, total.bfloat16())


def test_targets_receive_the_float32_gradient():
    layer = _linear(dtype=torch.float32)
    targets = {p: torch.zeros_like(p, dtype=torch.float64) for p in layer.parameters()}
    acc = Fp32GradAccumulator(layer.parameters(), enabled=True, targets=targets)
    (x, grad_out), = _chunks(1, dtype=torch.float32)
    with float32_weight_gradients(layer, acc):
        layer(x).backward(grad_out)
    acc.finish()
    assert layer.weight.grad is None
    g2, x2 = grad_out.reshape(-1, 24), x.reshape(-1, 48)
    torch.testing.assert_close(targets[layer.weight].float(), g2.t() @ x2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(targets[layer.bias].float(), g2.sum(0), rtol=1e-5, atol=1e-5)


def test_only_plain_summed_linears_change_and_all_are_restored():
    class Quantised(nn.Linear):  # a subclass may compute differently: left alone
        pass

    model = nn.Sequential(_linear(), _linear(seed=1), Quantised(48, 24).bfloat16(), _linear(dtype=torch.float32),
                          _linear(seed=2))
    model[1].weight.requires_grad_(False)  # frozen (e.g. a LoRA base layer)
    model[4].bias.requires_grad_(False)  # trained weight, frozen bias: still eligible
    acc = Fp32GradAccumulator(model.parameters(), enabled=True)  # fp32 parameters are not summed
    assert eligible_linears(model, acc) == [model[0], model[4]]
    with pytest.raises(RuntimeError, match="boom"), float32_weight_gradients(model, acc):
        assert "forward" in vars(model[0])
        raise RuntimeError("boom")
    assert all("forward" not in vars(m) for m in model)
    with float32_weight_gradients(model, acc, enabled=False) as changed:
        assert changed == []


def test_layers_something_else_hooked_keep_autograd_and_their_hooks():
    """Left alone: a forward already replaced on the instance (accelerate's hooks do that), a weight
    with a gradient hook (it must see the gradient), float64 weights (float32 would round them)."""
    hooked_forward, grad_hooked, double, plain = _linear(), _linear(seed=1), _linear(torch.float64), _linear(seed=2)
    original = hooked_forward.forward
    hooked_forward.forward = lambda x: original(x) * 2
    seen = []
    grad_hooked.weight.register_hook(lambda g: seen.append(g))
    model = nn.Sequential(hooked_forward, grad_hooked, double, plain)
    targets = {p: torch.zeros_like(p, dtype=torch.float64) for p in double.parameters()}
    acc = Fp32GradAccumulator(model.parameters(), enabled=True, targets=targets)
    assert eligible_linears(model, acc) == [plain]
    with float32_weight_gradients(model, acc):
        x = torch.randn(3, 48).bfloat16()
        grad_hooked(x).sum().backward()
        assert len(seen) == 1 and seen[0] is not None
        assert torch.equal(plain(input=x), nn.functional.linear(x, plain.weight, plain.bias))  # keyword call
    assert hooked_forward.forward(x).equal(original(x) * 2)  # the other forward is still there


def test_no_grad_forward_is_plain():
    layer = _linear()
    acc = Fp32GradAccumulator(layer.parameters(), enabled=True)
    x = torch.randn(3, 48).bfloat16()
    with float32_weight_gradients(layer, acc), torch.no_grad():
        out = layer(x)
    assert torch.equal(out, nn.functional.linear(x, layer.weight, layer.bias)) and out.grad_fn is None


def test_matmul_float32_on_cpu_multiplies_float32_copies():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(7, 5, generator=g).bfloat16(), torch.randn(5, 4, generator=g).bfloat16()
    got = matmul_float32(a, b)
    assert got.dtype == torch.float32 and torch.equal(got, a.float() @ b.float())


@pytest.mark.gpu
def test_gpu_tensor_cores_give_the_float32_products():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator().manual_seed(4)
    a, b = (torch.randn(shape, generator=g).bfloat16().cuda() for shape in ((3000, 256), (256, 688)))
    torch.testing.assert_close(matmul_float32(a, b), a.double() @ b.double(), rtol=1e-5, atol=1e-4,
                               check_dtype=False)


def _bf16_model_and_float32_gradients():
    """A 2-layer Qwen2 in bf16, 1536 token ids, and the float32 copy's full-sequence gradients of them."""
    from helpers import grads
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    fp32 = Qwen2ForCausalLM(cfg).float()
    fp32.set_attn_implementation("sdpa")
    ids = torch.randint(0, cfg.vocab_size, (1, 1536))
    fp32(input_ids=ids, labels=ids).loss.backward()
    bf16 = Qwen2ForCausalLM(cfg).bfloat16()
    bf16.load_state_dict(fp32.state_dict())
    bf16.set_attn_implementation("sdpa")
    return bf16, ids, grads(fp32)


def test_bf16_step_is_closer_to_float32_with_float32_weight_gradients(monkeypatch):
    """A bf16 step of 6 chunks against a float32 full-sequence backward: with the linear layers'
    gradients summed unrounded the error is lower than with each chunk's gradient rounded to bf16
    first, and no worse than HF's own bf16 backward."""
    from helpers import grads
    from helpers import relative_error as rel_err

    import oomb
    import oomb.engine

    bf16, ids, reference = _bf16_model_and_float32_gradients()
    bf16(input_ids=ids, labels=ids).loss.backward()
    errors = {"hf": rel_err(grads(bf16), reference)}
    config = oomb.OOMBConfig(chunk_size=256, page_size=64)
    for name, enabled in (("float32", True), ("per_chunk", False)):
        monkeypatch.setattr(oomb.engine, "float32_weight_gradients",
                            lambda model, acc, enabled=True, on=enabled: float32_weight_gradients(model, acc, on))
        bf16.zero_grad(set_to_none=True)
        oomb.forward_backward(bf16, ids, config=config)
        errors[name] = rel_err(grads(bf16), reference)
    assert errors["float32"] < errors["per_chunk"] and errors["float32"] <= errors["hf"], errors


# In place (no float32 sums): in_place_weight_gradients, the engine's default for bf16 .grad


def test_in_place_gradients_sum_the_chunks_by_the_products_themselves():
    """Without float32 sums: each chunk's weight gradient goes into .grad by addmm_ (the sum so far read by
    the GEMM, one rounding per chunk), the bias's in float32 then rounded; input gradients as autograd's. The
    result is at least as close to the exact sum as autograd's (each chunk's product rounded, then added)."""
    layer = _linear()
    acc = Fp32GradAccumulator(layer.parameters(), enabled=False)  # bf16 .grad, as a full-sequence backward
    assert acc.params == []
    chunks = _chunks()
    with in_place_weight_gradients(layer, acc) as changed:
        assert changed == [layer]
        for x, grad_out in chunks:
            x = x.clone().requires_grad_()
            layer(x).backward(grad_out)
            assert torch.equal(x.grad, grad_out @ layer.weight)
    assert "forward" not in vars(layer)
    in_place = layer.weight.grad.clone()
    layer.zero_grad(set_to_none=True)
    for x, grad_out in chunks:  # autograd's own
        layer(x).backward(grad_out)
    xs = torch.cat([x for x, _ in chunks], dim=1).reshape(-1, 48).double()
    gs = torch.cat([g for _, g in chunks], dim=1).reshape(-1, 24).double()
    exact = gs.t() @ xs
    assert (in_place.double() - exact).norm() <= (layer.weight.grad.double() - exact).norm()
    assert not torch.equal(in_place, layer.weight.grad)  # the path taken


def test_in_place_leaves_summed_hooked_and_other_layers_to_their_paths():
    """Not routed in place: parameters the float32 sums take (float32_weight_gradients routes them), hooked
    weights, subclasses, frozen weights, layers whose forward something replaced; all restored after."""
    class Quantised(nn.Linear):
        pass

    summed, hooked, plain, frozen = _linear(), _linear(seed=1), _linear(seed=2), _linear(seed=3)
    frozen.weight.requires_grad_(False)
    hooked.weight.register_hook(lambda g: g)
    model = nn.Sequential(summed, hooked, plain, frozen, Quantised(48, 24).bfloat16())
    acc = Fp32GradAccumulator(summed.parameters(), enabled=True)
    assert in_place_linears(model, acc) == [plain]
    with float32_weight_gradients(model, acc), in_place_weight_gradients(model, acc) as changed:
        assert changed == [plain] and "forward" in vars(summed)
    assert all("forward" not in vars(m) for m in model)
    with in_place_weight_gradients(model, acc, enabled=False) as changed:
        assert changed == []


def test_bf16_step_in_place_is_no_worse_than_autograds_adds(monkeypatch):
    """A bf16 step of 6 chunks without float32 sums (oomb bench's standard workload), against a float32
    full-sequence backward: the linear layers' gradients summed in place are no further from it than with
    autograd's per-chunk products and adds (the routing switched off here)."""
    from helpers import grads
    from helpers import relative_error as rel_err

    import oomb
    import oomb.engine

    bf16, ids, reference = _bf16_model_and_float32_gradients()
    config = oomb.OOMBConfig(chunk_size=256, page_size=64, precision=PrecisionConfig(fp32_grad_accumulation=False))
    errors, routed, on = {}, [], [True]
    real = oomb.engine.in_place_weight_gradients

    @contextlib.contextmanager
    def spy(model, accumulator, enabled=True):
        with real(model, accumulator, enabled=enabled and on[0]) as layers:  # off: autograd's adds
            routed.append(len(layers))
            yield layers

    monkeypatch.setattr(oomb.engine, "in_place_weight_gradients", spy)
    for name, on[0] in (("in_place", True), ("autograd", False)):
        bf16.zero_grad(set_to_none=True)
        oomb.forward_backward(bf16, ids, config=config)
        errors[name] = rel_err(grads(bf16), reference)
    assert routed == [7 * 2 + 1, 0]  # every decoder linear and the head, then none
    assert errors["in_place"] <= errors["autograd"], errors
