"""Chunked LM-head cross-entropy and label shifting."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from oomb.config import PerformanceConfig, PrecisionConfig
from oomb.loss import IGNORE_INDEX, chunked_cross_entropy, shift_labels

B, L, H, V = 2, 23, 16, 50


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    lm_head = nn.Linear(H, V, bias=True)
    hidden = torch.randn(B, L, H, generator=g)
    targets = torch.randint(0, V, (B, L), generator=g)
    targets[0, 3:9] = IGNORE_INDEX
    targets[:, 10:15] = IGNORE_INDEX  # a 5-token slice with nothing counted when slice_tokens=5
    targets[1, -1] = IGNORE_INDEX
    return lm_head, hidden, targets


def _full_loss(hidden, targets, lm_head, normalizer):
    logits = lm_head(hidden)
    total = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                            reduction="sum")
    return total / normalizer


@pytest.mark.parametrize("slice_tokens", [1, 5, 7, 23, 1024])
def test_chunked_cross_entropy_matches_full_logits(slice_tokens):
    lm_head, hidden, targets = _setup()
    counted = int((targets != IGNORE_INDEX).sum())
    normalizer = counted + 3  # the caller's normalizer, not the slice's own count

    hidden_ref = hidden.clone().requires_grad_()
    want = _full_loss(hidden_ref, targets, lm_head, normalizer)
    want.backward()
    want_grads = [hidden_ref.grad] + [p.grad.clone() for p in lm_head.parameters()]
    lm_head.zero_grad()

    hidden_got = hidden.clone().requires_grad_()
    got = chunked_cross_entropy(hidden_got, targets, lm_head, normalizer, slice_tokens)
    assert got.dtype == torch.float32 and got.dim() == 0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    got.backward()
    got_grads = [hidden_got.grad] + [p.grad for p in lm_head.parameters()]
    for g_got, g_want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-7)
    # Ignored positions get no gradient.
    assert not hidden_got.grad[targets == IGNORE_INDEX].any()

    with torch.no_grad():
        no_grad = chunked_cross_entropy(hidden, targets, lm_head, torch.tensor(normalizer), slice_tokens)
    torch.testing.assert_close(no_grad, want.detach(), rtol=1e-6, atol=0)


def test_matches_mean_cross_entropy_when_normalized_by_the_count():
    lm_head, hidden, targets = _setup(1)
    counted = int((targets != IGNORE_INDEX).sum())
    with torch.no_grad():
        got = chunked_cross_entropy(hidden, targets, lm_head, counted, 4)
        want = F.cross_entropy(lm_head(hidden).reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_all_ignored_gives_a_zero_without_graph():
    lm_head, hidden, targets = _setup()
    hidden.requires_grad_()
    loss = chunked_cross_entropy(hidden, torch.full_like(targets, IGNORE_INDEX), lm_head, 10, 4)
    assert loss.item() == 0.0
    assert not loss.requires_grad


def test_shift_labels():
    labels = torch.tensor([[1, 2, 3, 4], [5, IGNORE_INDEX, 7, 8]])
    want = torch.tensor([[2, 3, 4, IGNORE_INDEX], [IGNORE_INDEX, 7, 8, IGNORE_INDEX]])
    got = shift_labels(labels)
    assert torch.equal(got, want)
    assert got.dtype == labels.dtype
    assert torch.equal(shift_labels(torch.tensor([[9]])), torch.tensor([[IGNORE_INDEX]]))


def test_shift_then_sum_matches_hugging_face_causal_loss():
    """Shifting once and summing per-position losses gives HF's shifted mean cross-entropy."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(B, L, V, generator=g)
    labels = torch.randint(0, V, (B, L), generator=g)
    labels[1, 5:12] = IGNORE_INDEX
    targets = shift_labels(labels)
    ours = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    hf = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(ours, hf, rtol=1e-6, atol=0)


def test_slices_with_labels_read_once_with_a_partial_last_slice():
    from oomb.loss import slices_with_labels

    targets = torch.full((2, 11), IGNORE_INDEX)
    targets[1, 4] = 3  # slice 1 of [0, 4), [4, 8), [8, 11)
    targets[0, 10] = 5  # the partial last slice
    assert slices_with_labels(targets, 4) == [False, True, True]
    assert slices_with_labels(torch.full((1, 3), IGNORE_INDEX), 4) == [False]


def test_the_step_takes_each_chunks_loss_slices_from_one_host_copy(monkeypatch):
    """Each chunk's loss slices come from one host copy of the step's targets, read once (on a GPU, reading the
    chunk's targets is a device synchronisation per chunk of stage 2); the loss and gradients are unchanged."""
    from helpers import build_tiny_model

    import oomb
    from oomb import engine

    model = build_tiny_model("qwen2", seed=7)
    ids = torch.randint(0, model.config.vocab_size, (1, 96))
    config = oomb.OOMBConfig(chunk_size=32, page_size=16,
                             performance=PerformanceConfig(backend="torch", loss_chunk_tokens=8))
    labels = ids.clone()
    labels[:, 89:] = -100  # the last slice of the last chunk predicts nothing (targets 88-95)
    plain = oomb.forward_backward(model, ids, labels, config)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    given = []

    def recording(*args, counted_slices=None, **kwargs):
        given.append(counted_slices)
        return chunked_cross_entropy(*args, counted_slices=counted_slices, **kwargs)

    monkeypatch.setattr(engine, "chunked_cross_entropy", recording)
    model.zero_grad(set_to_none=True)
    assert torch.equal(oomb.forward_backward(model, ids, labels, config), plain)
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    assert given == [[True] * 3 + [False], [True] * 4, [True] * 4]  # stage 2 runs the chunks last to first


def _saved_bytes(loss_fn) -> int:
    """Bytes of the tensors autograd saves (each storage once) while ``loss_fn`` runs."""
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn()
    return sum(storages.values())


def test_kept_logits_are_the_log_probabilities_the_planner_counts():
    """Without recompute autograd keeps every slice's fp32 log-probabilities (oomb.planning.activations.
    saved_logits_bytes: tokens x vocabulary x 4 per sequence) besides what the checkpointed slices keep."""
    from oomb.planning.activations import saved_logits_bytes
    from oomb.planning.model_shape import ModelShape

    lm_head, hidden, targets = _setup()
    hidden.requires_grad_(True)
    kept = _saved_bytes(lambda: chunked_cross_entropy(hidden, targets, lm_head, 7, 5, recompute=False))
    recomputed = _saved_bytes(lambda: chunked_cross_entropy(hidden, targets, lm_head, 7, 5, recompute=True))
    shape = ModelShape(num_layers=1, hidden_size=H, intermediate_size=H, num_heads=1, num_kv_heads=1, head_dim=H,
                       vocab_size=V)
    counted = sum(B * 5 for start in range(0, L, 5) if (targets[:, start:start + 5] != IGNORE_INDEX).any())
    assert kept - recomputed >= saved_logits_bytes(shape, counted, 1, False) == counted * V * 4
    assert kept - recomputed <= saved_logits_bytes(shape, B * L, 1, False) * 1.25  # little besides them
    assert saved_logits_bytes(shape, B * L, 1, True) == 0


# ---------------------------------------------------------------------------------------------
# The fused loss (bias-free linear heads): oomb/loss.py _HeadCrossEntropy, oomb/loss_gradient.py
# ---------------------------------------------------------------------------------------------

def _bias_free(seed: int, trained: bool, dtype=torch.float32):
    lm_head, hidden, targets = _setup(seed)
    head = nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(lm_head.weight)
    head.weight.requires_grad_(trained)
    return head.to(dtype), hidden.to(dtype), targets


def _loss_and_grads(head, hidden, targets, normalizer, slice_tokens, grad_scale=1.0, **kwargs):
    hidden = hidden.clone().requires_grad_()
    head.zero_grad(set_to_none=True)
    loss = chunked_cross_entropy(hidden, targets, head, normalizer, slice_tokens, **kwargs)
    (loss * grad_scale).backward()
    return loss.detach(), hidden.grad, head.weight.grad


@pytest.mark.parametrize("trained, recompute", [(False, True), (False, False), (True, True), (True, False)])
@pytest.mark.parametrize("slice_tokens", [1, 5, 23])
def test_fused_loss_equals_autograds(monkeypatch, trained, recompute, slice_tokens):
    """The fused slices give the loss and gradients of autograd's loss over full logits (the tolerances of
    test_chunked_cross_entropy_matches_full_logits), and are the path taken."""
    import oomb.loss as loss_module

    head, hidden, targets = _bias_free(3, trained)
    counted = int((targets != IGNORE_INDEX).sum())
    normalizer = torch.tensor(counted + 3)
    want = _loss_and_grads(head, hidden, targets, normalizer, slice_tokens, fused=False, recompute=recompute)
    calls = []
    real = loss_module._HeadCrossEntropy.apply
    monkeypatch.setattr(loss_module._HeadCrossEntropy, "apply", lambda *a: calls.append(a[5]) or real(*a))
    got = _loss_and_grads(head, hidden, targets, normalizer, slice_tokens, recompute=recompute)
    assert calls and set(calls) == {recompute}
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)
    assert not got[1][targets == IGNORE_INDEX].any()
    if trained:
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-7)
    else:
        assert got[2] is None


def test_fused_loss_in_bf16_equals_autograds_bits():
    """bf16 (CPU): the same float32 arithmetic rounded once to bf16, as autograd's cast back does."""
    head, hidden, targets = _bias_free(4, True, torch.bfloat16)
    counted = int((targets != IGNORE_INDEX).sum())
    want = _loss_and_grads(head, hidden, targets, counted, 7, fused=False, recompute=False)
    got = _loss_and_grads(head, hidden, targets, counted, 7, recompute=False)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_head_gradient_in_place_inside_the_engines_routing():
    """Inside fp32_linear.in_place_weight_gradients (the engine's, without float32 sums) a trained bf16 head's
    slice gradients go into .grad by the products themselves (addmm_: each slice's float32 product added to
    the sum so far before one rounding, where autograd rounds each product and then each sum): at least as
    close to the float64 gradient of the same bf16 values, and another summation. A weight with a gradient
    hook is not routed: the hook sees the gradient and the bits are autograd's."""
    from oomb.fp32_linear import in_place_weight_gradients
    from oomb.grads import Fp32GradAccumulator

    head, hidden, targets = _bias_free(4, True, torch.bfloat16)
    counted = int((targets != IGNORE_INDEX).sum())
    want = _loss_and_grads(head, hidden, targets, counted, 7, recompute=False)
    accumulator = Fp32GradAccumulator(head.parameters(), enabled=False)
    with in_place_weight_gradients(head, accumulator) as layers:
        assert layers == [head]
        got = _loss_and_grads(head, hidden, targets, counted, 7, recompute=False)
    assert torch.equal(got[1], want[1])
    exact = _loss_and_grads(head.double(), hidden.double(), targets, counted, 7, fused=False, recompute=False)[2]
    head.bfloat16()
    error_got, error_want = ((g.double() - exact).norm() for g in (got[2], want[2]))
    assert 0 < error_got <= error_want and not torch.equal(got[2], want[2])
    seen = []
    handle = head.weight.register_hook(lambda g: seen.append(g) or g)
    with in_place_weight_gradients(head, accumulator) as layers:
        assert layers == []
        hooked = _loss_and_grads(head, hidden, targets, counted, 7, recompute=False)
    handle.remove()
    assert seen and torch.equal(hooked[2], want[2])


def test_fused_loss_recompute_and_kept_give_the_same_bits_and_rescaled_backward():
    head, hidden, targets = _bias_free(5, True)
    kept = _loss_and_grads(head, hidden, targets, 40, 5, recompute=False)
    recomputed = _loss_and_grads(head, hidden, targets, 40, 5, recompute=True)
    assert all(torch.equal(a, b) for a, b in zip(kept, recomputed, strict=True))
    for recompute in (False, True):  # the factor joins the kernel's scale (recompute) or the rows (kept)
        doubled = _loss_and_grads(head, hidden, targets, 40, 5, grad_scale=2.0, recompute=recompute)
        assert torch.equal(doubled[1], 2 * kept[1]) and torch.equal(doubled[2], 2 * kept[2])
        want = _loss_and_grads(head, hidden, targets, 40, 5, grad_scale=0.3, fused=False, recompute=recompute)
        got = _loss_and_grads(head, hidden, targets, 40, 5, grad_scale=0.3, recompute=recompute)
        for a, b in zip(got[1:], want[1:], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_fused_loss_keeps_no_logits_for_a_frozen_head_and_the_gradient_for_a_trained_one():
    """What the fused slices save for the backward is what the planner counts (activations.
    saved_logits_bytes): a frozen head (LoRA) (tokens, hidden) products only; a trained head without
    recompute the logits' gradient in the model dtype too (half of autograd's kept float32
    log-probabilities in bf16); with recompute nothing of the vocabulary's size."""
    from oomb.planning.activations import saved_logits_bytes
    from oomb.planning.model_shape import ModelShape

    shape = ModelShape(num_layers=1, hidden_size=H, intermediate_size=H, num_heads=1, num_kv_heads=1, head_dim=H,
                       vocab_size=V)
    for trained, recompute in ((False, False), (False, True), (True, True), (True, False)):
        head, hidden, targets = _bias_free(6, trained)
        hidden.requires_grad_(True)
        saved = _saved_bytes(lambda h=head, x=hidden, t=targets, r=recompute: chunked_cross_entropy(
            x, t, h, 7, L, recompute=r))
        want = saved_logits_bytes(shape, L, B, recompute, torch.float32, head_trained=trained)
        # besides: the targets, the scale, a trained head's weight (recompute) and its input (kept)
        extra = B * L * 8 + 4 + (V * H * 4 if trained and recompute else 0) + (B * L * H * 4 if trained else 0)
        assert want <= saved <= want + extra, (trained, recompute, saved, want)
        assert (want >= B * L * V * 4) == (trained and not recompute)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recompute", [True, False])
def test_head_weight_gradient_made_in_the_forward(dtype, recompute):
    """weight_gradient_now (the engine's) with a gradient sink: a trained head's dW is in .grad when the forward
    returns, nothing of the vocabulary's size is saved for the backward (whatever ``recompute`` says), the input
    gradient has the kept path's bits and dW its value (summed in the slices' order, not autograd's reverse
    one: float32 agrees to rounding, bf16 is no further from the float64 gradient of the same values)."""
    from oomb.fp32_linear import in_place_weight_gradients
    from oomb.grads import Fp32GradAccumulator

    head, hidden, targets = _bias_free(9, True, dtype)
    counted = int((targets != IGNORE_INDEX).sum())
    accumulator = Fp32GradAccumulator(head.parameters(), enabled=False)
    with in_place_weight_gradients(head, accumulator):
        want = _loss_and_grads(head, hidden, targets, counted, 7, recompute=recompute)
        head.zero_grad(set_to_none=True)
        x = hidden.clone().requires_grad_()
        saved = _saved_bytes(lambda: chunked_cross_entropy(x, targets, head, counted, 7, recompute=recompute,
                                                           weight_gradient_now=True))
        assert head.weight.grad is not None  # made in the forward
        assert saved <= 2 * x.numel() * x.element_size() + targets.numel() * 8 + 64  # inputs' gradient, targets
        got = _loss_and_grads(head, hidden, targets, counted, 7, recompute=recompute, weight_gradient_now=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if dtype == torch.float32:
        torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=1e-7)
    else:
        exact = _loss_and_grads(head.double(), hidden.double(), targets, counted, 7, fused=False)[2]
        error_got, error_want = ((g.double() - exact).norm() for g in (got[2], want[2]))
        assert error_got <= error_want


def test_head_weight_gradient_in_the_forward_needs_the_normalized_backward_and_a_sink():
    """A backward that scales the loss would leave the forward's dW unscaled: it is refused (on the device,
    at once on the CPU). Without a gradient sink (autograd's path) weight_gradient_now changes nothing."""
    from oomb.fp32_linear import in_place_weight_gradients
    from oomb.grads import Fp32GradAccumulator

    head, hidden, targets = _bias_free(10, True)
    plain = _loss_and_grads(head, hidden, targets, 40, 5, recompute=False)
    now = _loss_and_grads(head, hidden, targets, 40, 5, recompute=False, weight_gradient_now=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, now, strict=True))
    with in_place_weight_gradients(head, Fp32GradAccumulator(head.parameters(), enabled=False)):
        with pytest.raises(RuntimeError, match="normalized loss"):
            _loss_and_grads(head, hidden, targets, 40, 5, grad_scale=2.0, weight_gradient_now=True)


def test_float32_gradient_sums_take_the_forwards_head_gradient():
    """The float32 sums take the forward's dW as they take the backward's: the same float32 products, added in
    the slices' order instead of the reverse one, rounded once to bf16 (at most one bf16 step apart)."""
    from oomb.fp32_linear import float32_weight_gradients
    from oomb.grads import Fp32GradAccumulator

    head, hidden, targets = _bias_free(11, True, torch.bfloat16)
    results = []
    for now in (False, True):
        head.zero_grad(set_to_none=True)
        accumulator = Fp32GradAccumulator([head.weight])
        with float32_weight_gradients(head, accumulator):
            got = _loss_and_grads(head, hidden, targets, 40, 7, recompute=False, weight_gradient_now=now)
        accumulator.collect()
        accumulator.finish()
        results.append((got[1], head.weight.grad.float()))
    (dx_kept, dw_kept), (dx_now, dw_now) = results
    assert torch.equal(dx_kept, dx_now)
    assert ((dw_now - dw_kept).abs() <= dw_kept.abs() * 2.0**-7).all()


@pytest.mark.parametrize("recompute", [True, False])
def test_fused_loss_feeds_the_float32_gradient_sums(recompute):
    """Inside fp32_linear.float32_weight_gradients a trained bf16 head's weight gradient goes to the
    accumulator's float32 sums, as the replaced forward's does: the fused loss gives the same sums."""
    from oomb.fp32_linear import float32_weight_gradients
    from oomb.grads import Fp32GradAccumulator
    from oomb.loss import fused_head

    head, hidden, targets = _bias_free(8, True, torch.bfloat16)
    sums = {}
    for fused in (False, True):
        head.zero_grad(set_to_none=True)  # before the accumulator takes .grad as its prior
        accumulator = Fp32GradAccumulator([head.weight])
        with float32_weight_gradients(head, accumulator) as layers:
            assert layers == [head] and fused_head(head)
            got = _loss_and_grads(head, hidden, targets, 40, 7, fused=fused, recompute=recompute)
        accumulator.collect()
        accumulator.finish()
        assert got[2] is None  # nothing in .grad during the step
        sums[fused] = (got[1], head.weight.grad.clone())
    assert head.weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(sums[True][0], sums[False][0], rtol=0, atol=0)
    torch.testing.assert_close(sums[True][1], sums[False][1], rtol=0, atol=0)
    assert "forward" not in vars(head) and fused_head(head)


def test_heads_the_fused_loss_leaves_to_autograd():
    """Bias, a replaced forward (fp32_linear.py's float32 weight gradients), forward hooks (a trainer's loss
    scaling): the head is called as it is."""
    from oomb.loss import fused_head

    head, _, _ = _bias_free(0, True)
    assert fused_head(head)
    assert not fused_head(nn.Linear(H, V, bias=True))
    patched = nn.Linear(H, V, bias=False)
    patched.forward = lambda x: x
    assert not fused_head(patched)
    for register in (head.register_forward_hook, head.register_forward_pre_hook, head.register_full_backward_hook):
        handle = register(lambda *args: None)
        assert not fused_head(head)
        handle.remove()
    handle = torch.nn.modules.module.register_module_full_backward_hook(lambda *args: None)
    assert not fused_head(head)
    handle.remove()
    assert fused_head(head)


def test_fused_loss_cases_beside_the_engines():
    """Only the head trained (the body frozen: hidden needs no gradient), a float16 head (autograd's path:
    a gradient already divided by the count would underflow before a loss scaler's factor), and an
    out-of-range target in the kernel (NaN, never a read elsewhere; the torch path raises)."""
    import oomb.loss as loss_module
    from oomb.loss import SoftcappedHead

    calls = []
    real = loss_module._HeadCrossEntropy.apply
    head, hidden, targets = _bias_free(9, True)
    want = chunked_cross_entropy(hidden, targets, head, 50, 7, fused=False)
    want.backward()
    want_grad = head.weight.grad.clone()
    head.zero_grad(set_to_none=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loss_module._HeadCrossEntropy, "apply", lambda *a: calls.append(1) or real(*a))
        got = chunked_cross_entropy(hidden, targets, head, 50, 7)
        assert calls and got.requires_grad  # fused, the hidden states needing no gradient
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        torch.testing.assert_close(head.weight.grad, want_grad, rtol=1e-5, atol=1e-7)
        calls.clear()
        capped = SoftcappedHead(head, 30.0)  # no .weight of its own: autograd's path, trained head
        chunked_cross_entropy(hidden, targets, capped, 50, 7).backward()
        half, x16, _ = _bias_free(9, True, torch.float16)
        chunked_cross_entropy(x16.requires_grad_(), targets, half, 50, 7).backward()
    assert not calls
    kernel_module = pytest.importorskip("oomb.attention.triton_loss_gradient")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernel in the interpreter
    logits = torch.randn(3, 40, device=device)
    targets = torch.tensor([1, 40, IGNORE_INDEX], device=device)
    loss = kernel_module.logits_to_gradient_triton(logits, targets, torch.ones(()))
    assert loss[0].isfinite() and loss[1].isnan() and loss[2] == 0
    assert logits[0].isfinite().all() and logits[1].isnan().all() and not logits[2].any()


@pytest.mark.parametrize("fused", [True, False])
def test_the_gradient_scale_attribute_scales_both_paths(fused):
    """loss.GRADIENT_SCALE on the head (hf_trainer.scaled_loss_gradient) multiplies every gradient, in the
    fused loss and in autograd's, and leaves the loss as it is."""
    from oomb.loss import GRADIENT_SCALE

    head, hidden, targets = _bias_free(10, True)
    plain = _loss_and_grads(head, hidden, targets, 40, 7, fused=fused)
    setattr(head, GRADIENT_SCALE, 0.25)
    scaled = _loss_and_grads(head, hidden, targets, 40, 7, fused=fused)
    delattr(head, GRADIENT_SCALE)
    assert torch.equal(scaled[0], plain[0])
    assert torch.equal(scaled[1], plain[1] * 0.25) and torch.equal(scaled[2], plain[2] * 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_kernel_equals_the_torch_rows(dtype):
    """The Triton kernel (interpreter on CPU, which rounds to bf16 by truncation: within one bf16 step
    there) against the torch path: the losses, the gradient in place, ignored rows zero, and the
    losses-only pass that leaves the logits as they were."""
    lg = pytest.importorskip("oomb.loss_gradient")
    kernel_module = pytest.importorskip("oomb.attention.triton_loss_gradient")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(9, 300, generator=g) * 4).to(device, dtype)  # several vocabulary tiles on CPU
    targets = torch.randint(0, 300, (9,), generator=g).to(device)
    targets[2] = IGNORE_INDEX
    scale = torch.ones((), device=device) / 8
    want_logits = logits.clone()
    want = lg._torch_rows(want_logits, targets, scale)
    got_logits = logits.clone()
    got = kernel_module.logits_to_gradient_triton(got_logits, targets, scale)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    step = 2 ** -8 / 8 if dtype == torch.bfloat16 else 1e-7  # |gradient| <= 1 / 8
    assert (got_logits.float() - want_logits.float()).abs().max().item() <= step
    assert not got_logits[2].any()
    untouched = logits.clone()
    torch.testing.assert_close(kernel_module.logits_to_gradient_triton(untouched, targets, scale, False), want,
                               rtol=1e-6, atol=1e-6)
    assert torch.equal(untouched, logits)


def test_predict_and_planner_follow_the_fused_loss():
    """predict counts the fused loss where TrainingSetup.fused_loss says so, the planner where
    Workload.may_fuse_loss does; models.fused_loss_possible asks the model's loss head."""
    import dataclasses

    from helpers import build_tiny_model

    import oomb
    from oomb.models import fused_loss_possible
    from oomb.planning.choose import Resources, Workload, predict_candidate
    from oomb.planning.memory import TrainingSetup, predict
    from oomb.planning.model_shape import ModelShape
    from oomb.tools.plan import preset_config

    shape = ModelShape.from_hf_config(preset_config("qwen2.5-7b"))
    vocab, slice_rows = shape.head_vocab, 1024
    for lora, recompute in ((16, True), (16, False), (0, True), (0, False)):
        config = oomb.OOMBConfig(attention="sparse",
                                 performance=PerformanceConfig(recompute_logits=recompute,
                                                               loss_chunk_tokens=slice_rows),
                                 precision=PrecisionConfig(fp32_grad_accumulation=False))
        setup = TrainingSetup(optimizer="none", lora_rank=lora)
        autograd = predict("sparse", shape, 131072, config, setup).gpu["activations"]
        fused = predict("sparse", shape, 131072, config, dataclasses.replace(setup, fused_loss=True)).gpu["activations"]
        kept = 0 if recompute else 4096 * vocab * 4  # autograd's float32 log-probabilities
        # the engine's fused loss keeps a (tokens, hidden) tensor and nothing of the vocabulary's size: a frozen
        # head needs none, a trained head's weight gradient is made in the forward (weight_gradient_now)
        kept_fused = 4096 * shape.hidden_size * 2
        assert autograd - fused == (3 * slice_rows * vocab * 4 + kept) - (slice_rows * (vocab + shape.hidden_size) * 2
                                                                           + kept_fused), (lora, recompute)
    gpu = Resources("cuda", gpu_limit=200 * 1024**3, host_limit=200 * 1024**3, weights_loaded=True)
    config = oomb.OOMBConfig(attention="sparse")
    workload = Workload(shape, 131072, optimizer="none")
    may = dataclasses.replace(workload, may_fuse_loss=True)
    assert predict_candidate(may, gpu, config).gpu_bytes < predict_candidate(workload, gpu, config).gpu_bytes
    targets = dataclasses.replace(workload, fp32_targets=True)  # master weights: float32 linear gradients, fused too
    assert predict_candidate(dataclasses.replace(targets, may_fuse_loss=True), gpu, config).gpu_bytes \
        < predict_candidate(targets, gpu, config).gpu_bytes
    model = build_tiny_model("llama")
    assert fused_loss_possible(model) and not fused_loss_possible(model, single_process=False)
    handle = model.lm_head.register_forward_hook(lambda module, args, out: out)
    assert not fused_loss_possible(model)
    handle.remove()


