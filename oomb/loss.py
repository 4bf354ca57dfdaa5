"""Chunked LM-head cross-entropy: full-vocabulary logits exist for a slice of tokens at a time."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from .fp32_linear import Float32Sums, InPlaceGradients, grad_sink
from .loss_gradient import IGNORE_INDEX, logits_to_gradient_

GRADIENT_SCALE = "_oomb_loss_gradient_scale"
"""Attribute of an LM head (get_output_embeddings): a factor on every gradient of the LM loss, which the
fused loss builds its gradient with and autograd's loss applies to the logits' gradient
(training/hf_trainer.py scaled_loss_gradient sets it)."""

FACTOR_TOLERANCE = 1e-6
"""How far from 1.0 the backward's factor (grad_output x normalizer) may be where a trained head's weight gradient
was made in the forward (_HeadCrossEntropy's weight_gradient_now): rounding, not a scaled loss."""

LOSS_RANGE = "oomb.loss"
"""Profiler range around a slice's LM head and cross-entropy (also their recompute in backward):
benchmarks/profile_step.py counts its kernels, and those of the backward of what ran inside, as loss."""


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Targets aligned with positions: target[t] = labels[t + 1], IGNORE_INDEX at the end.

    Shifting once for the whole sequence keeps chunk boundaries right (Hugging Face semantics).
    """
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def gradient_scale(lm_head: nn.Module) -> float:
    """The GRADIENT_SCALE factor on the loss's gradients through ``lm_head`` (or the head a softcap wraps)."""
    inner = lm_head.head if isinstance(lm_head, SoftcappedHead) else lm_head
    return getattr(inner, GRADIENT_SCALE, 1.0)


class ScaledGradient(torch.autograd.Function):
    """Identity forward; the gradient times ``factor`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def _slice_loss_sum(hidden: torch.Tensor, targets: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
    with record_function(LOSS_RANGE):
        logits = lm_head(hidden)
        factor = gradient_scale(lm_head)
        if factor != 1.0 and torch.is_grad_enabled():
            logits = ScaledGradient.apply(logits, factor)
        logits = logits.float()  # (B, S, V): softmax in fp32
        # A tensor-parallel head returns vocabulary-sharded DTensor logits; inside loss_parallel (the engine
        # enters it for forward and backward) cross_entropy reduces over the shards and returns a
        # replicated DTensor, so the full-vocabulary logits are never gathered.
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return loss.full_tensor() if isinstance(loss, DTensor) else loss


class SoftcappedHead(nn.Module):
    """An LM head whose logits are softcapped, cap * tanh(logits / cap), as Gemma 2 and 3 do with
    final_logit_softcapping before their loss (in the head's dtype, as Hugging Face does)."""

    def __init__(self, head: nn.Module, cap: float) -> None:
        super().__init__()
        self.head, self.cap = head, cap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.head(hidden) / self.cap) * self.cap


class _HeadCrossEntropy(torch.autograd.Function):
    """Sum of a slice's cross-entropies through a plain linear head, without autograd's float32 logits.

    The logits are turned into their own gradient in place (loss_gradient.py). A frozen head's input
    gradient is made at once (one (tokens, hidden) product kept, no logits). A trained head keeps the
    logits' gradient for dW, or with ``recompute`` keeps nothing and makes logits and gradient again in
    the backward (the forward then computes the losses alone). With ``weight_gradient_now`` (the engine's,
    whose backward is always that of the normalized loss) and a gradient sink, a trained head's dW goes to
    the sink in the forward, from the gradient already made: nothing of the vocabulary's size is kept and
    nothing recomputed, as for a frozen head. The gradient is made for ``scale`` (1 / the loss's
    normalizer); the backward applies grad_output / scale, exactly 1.0 when the step back-propagates the
    normalized loss: in the kernel's scale when it recomputes, else to the kept input gradient and to the
    hidden rows of dW (``_weight_gradient``); a weight gradient made in the forward asserts it is 1.0
    (on the device: no synchronisation)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor,
                gradient_scale: torch.Tensor, recompute: bool, sink: Float32Sums | InPlaceGradients | None,
                weight_gradient_now: bool = False):
        rows = hidden.reshape(-1, hidden.shape[-1])
        targets = targets.reshape(-1)
        logits = rows @ weight.t()  # the head's own product: F.linear
        ctx.shape, ctx.trained, ctx.sink = hidden.shape, ctx.needs_input_grad[1], sink
        ctx.param = weight  # the parameter the float32 sums are keyed by, or whose .grad takes dW in place
        ctx.now = weight_gradient_now and ctx.trained and sink is not None
        ctx.recompute = recompute and ctx.trained and not ctx.now
        if ctx.recompute:
            loss = logits_to_gradient_(logits, targets, gradient_scale, write_gradient=False).sum()
            ctx.save_for_backward(hidden, weight, targets, scale, gradient_scale)
            return loss
        loss = logits_to_gradient_(logits, targets, gradient_scale).sum()
        grad_hidden = logits @ weight if ctx.needs_input_grad[0] else None
        if ctx.now:  # dW from the gradient at hand: nothing of the vocabulary's size is kept
            sink.add_product(weight, logits.t(), rows, "LM head weight gradient")
            ctx.save_for_backward(grad_hidden, scale)
            return loss
        # The input itself, not ``rows`` (a copy when the slice is not contiguous, batch > 1).
        ctx.save_for_backward(grad_hidden, logits if ctx.trained else None, hidden if ctx.trained else None, scale)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.now:
            grad_hidden, scale = ctx.saved_tensors
            # dW went to the sink with a factor of 1.0: any other backward would make it wrong. The factor is
            # 1.0 exactly for the engine's backward; a few float32 steps are allowed, should another kernel
            # round 1 / normalizer differently (dW then off by as much, far below bf16's resolution).
            torch._assert_async((grad_loss.float() / scale - 1.0).abs() <= FACTOR_TOLERANCE,
                                "the LM head's weight gradient was made in the forward for the normalized loss's "
                                "backward; this backward scales the loss")
            d_hidden = grad_hidden.view(ctx.shape) if grad_hidden is not None else None
            return d_hidden, None, None, None, None, None, None, None
        if ctx.recompute:
            hidden, weight, targets, scale, gradient_scale = ctx.saved_tensors
            # The backward's factor joins the kernel's scale: nothing vocabulary-sized is multiplied again.
            factor = grad_loss.float() / scale
            rows = hidden.reshape(-1, hidden.shape[-1])
            logits_grad = rows @ weight.t()
            logits_to_gradient_(logits_grad, targets, gradient_scale * factor)
            grad_hidden = (logits_grad @ weight).view(ctx.shape) if ctx.needs_input_grad[0] else None
            return grad_hidden, _weight_gradient(ctx, logits_grad, rows, None), None, None, None, None, None, None
        grad_hidden, logits_grad, hidden, scale = ctx.saved_tensors
        rows = hidden.reshape(-1, hidden.shape[-1]) if hidden is not None else None
        factor = grad_loss.float() / scale  # 1.0 exactly for the normalized loss's backward (GRADIENT_SCALE is in)
        d_hidden = None
        if grad_hidden is not None:
            d_hidden = (grad_hidden.float() * factor).to(grad_hidden.dtype).view(ctx.shape)
        return d_hidden, _weight_gradient(ctx, logits_grad, rows, factor), None, None, None, None, None, None


def _weight_gradient(ctx, logits_grad: torch.Tensor, rows: torch.Tensor, factor: torch.Tensor | None
                     ) -> torch.Tensor | None:
    """The head weight's gradient, logits_grad.T @ rows, times ``factor`` (None: already in logits_grad);
    with float32 sums, or in the engine's in-place gradients (fp32_linear.py), it goes to the head's sink and
    None is returned: in place, each slice's product is added into ``.grad`` by the GEMM itself (``addmm_``,
    one float32 sum and one rounding per slice), where autograd adds a chunk's slices and then the chunk into
    ``.grad`` as separate passes over a vocabulary-sized tensor (0.09 s of the 7B's 128K step on the H200,
    profile-sparse-chosen-128k).
    The factor scales the (tokens, hidden) rows, not the (vocabulary, hidden) product: a multiply of the
    product cost 2.3 s of a 1M-token step's 10.3 s of loss on the H200 (profile-sparse-offload-chosen-1m).
    Exact for a factor of 1.0 (the normalized loss's backward); any other rounds the scaled rows once."""
    if not ctx.trained:
        return None
    if factor is not None:  # in float32: a bf16 tensor times a 0-dim CUDA tensor would round the factor to bf16
        rows = (rows.float() * factor).to(rows.dtype)
    if ctx.sink is not None:  # float32 sums, or .grad in place, as the linear layers' (fp32_linear.py)
        ctx.sink.add_product(ctx.param, logits_grad.t(), rows, "LM head weight gradient")
        return None
    return torch.mm(logits_grad.t(), rows)


def fused_head(lm_head: nn.Module) -> bool:
    """Whether the fused loss can stand in for calling the head: a plain bias-free ``nn.Linear`` whose
    weight is an ordinary tensor (not a tensor-parallel or FSDP DTensor), whose forward nobody replaced
    except fp32_linear.py (its float32 gradient sums the fused loss feeds too) and that no forward hook
    or backward hook watches (FSDP's unsharding, a user's): the others keep autograd's path. Not float16
    either (chunked_cross_entropy): its gradient, made already divided by the token count, would
    underflow before a loss scaler's factor reaches it."""
    replaced = "forward" in vars(lm_head) and grad_sink(lm_head) is None
    return (type(lm_head) is nn.Linear and lm_head.bias is None and not isinstance(lm_head.weight, DTensor)
            and not replaced and not _hooked(lm_head))


def _hooked(module: nn.Module) -> bool:
    """Forward or backward hooks on ``module`` or on every module: they expect the module to be called."""
    from torch.nn.modules import module as hooks

    return any((module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks,
                hooks._global_forward_hooks, hooks._global_forward_pre_hooks, hooks._global_backward_hooks,
                hooks._global_backward_pre_hooks))


def _fused_slice_loss_sum(hidden: torch.Tensor, targets: torch.Tensor, lm_head: nn.Module,
                          scale: torch.Tensor, gradient: torch.Tensor, recompute: bool,
                          weight_gradient_now: bool) -> torch.Tensor:
    with record_function(LOSS_RANGE):
        return _HeadCrossEntropy.apply(hidden, lm_head.weight, targets, scale, gradient, recompute,
                                       grad_sink(lm_head), weight_gradient_now)


def slices_with_labels(targets: torch.Tensor, slice_tokens: int) -> list[bool]:
    """Whether each slice of ``slice_tokens`` positions has a counted label: one read of ``targets`` for all
    slices (on a GPU a device synchronisation: a step reads its targets' host copy once instead)."""
    B, L = targets.shape
    n = -(-L // slice_tokens)
    counted = F.pad(targets != IGNORE_INDEX, (0, n * slice_tokens - L))
    return counted.reshape(B, n, slice_tokens).any(dim=2).any(dim=0).tolist()


def chunked_cross_entropy(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    lm_head: nn.Module,
    normalizer: int | torch.Tensor,
    slice_tokens: int,
    recompute: bool = True,
    fused: bool = True,
    weight_gradient_now: bool = False,
    counted_slices: Sequence[bool] | None = None,
) -> torch.Tensor:
    """Sum of token cross-entropies of ``hidden`` (B, L, H) against ``targets`` (B, L), / normalizer.

    With ``recompute`` each slice's logits are recomputed in backward (checkpointed), so at most
    ``slice_tokens`` positions' logits (and their gradient) are alive at once, in forward and in
    backward. Without, autograd keeps every slice's fp32 log-probabilities for the backward (the
    whole of ``hidden``'s positions) and the head's forward runs once.

    ``fused`` (a plain linear head, under autograd; see fused_head; False: autograd's loss, the tests' and
    benchmarks' comparison): no float32 logits, no
    log-probabilities (_HeadCrossEntropy). A frozen head's slices need no recompute and keep nothing of
    the vocabulary's size; a trained head's keep their logits' gradient (in the model dtype) without
    ``recompute``, nothing with it. ``weight_gradient_now`` (the engine's: only for a backward of the
    returned loss itself, unscaled) makes a trained head's weight gradient in the forward where the head has
    a gradient sink (fp32_linear.py), which then keeps no more than a frozen head's and recomputes nothing.
    ``counted_slices``: slices_with_labels of ``targets``, where the caller has them without reading the device.
    """
    total = hidden.new_zeros((), dtype=torch.float32)
    fused = (fused and torch.is_grad_enabled() and hidden.dtype != torch.float16 and fused_head(lm_head)
             and (hidden.requires_grad or lm_head.weight.requires_grad))
    if fused:  # float32: 1 / normalizer, and the gradient's factor (GRADIENT_SCALE in) before it rounds
        scale = torch.ones((), dtype=torch.float32, device=hidden.device) / normalizer
        gradient = scale * gradient_scale(lm_head)
    if counted_slices is None:
        counted_slices = slices_with_labels(targets, slice_tokens)
    for start, counted in zip(range(0, hidden.shape[1], slice_tokens), counted_slices, strict=True):
        part = slice(start, start + slice_tokens)
        if not counted:
            continue  # nothing to learn here: skip the vocabulary projection entirely
        if fused:
            total = total + _fused_slice_loss_sum(hidden[:, part], targets[:, part], lm_head, scale, gradient,
                                                  recompute, weight_gradient_now)
        elif torch.is_grad_enabled() and recompute:
            total = total + checkpoint(_slice_loss_sum, hidden[:, part], targets[:, part], lm_head,
                                       use_reentrant=False)
        else:
            total = total + _slice_loss_sum(hidden[:, part], targets[:, part], lm_head)
    return total / normalizer
