"""Chunked LM-head cross-entropy: full-vocabulary logits exist for a slice of tokens at a time."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from .fp32_linear import float32_sink, matmul_float32
from .grads import Fp32GradAccumulator
from .loss_gradient import IGNORE_INDEX, logits_to_gradient_

LOSS_RANGE = "oomb.loss"
"""Profiler range around a slice's LM head and cross-entropy (also their recompute in backward):
benchmarks/profile_step.py counts its kernels, and those of the backward of what ran inside, as loss."""


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Targets aligned with positions: target[t] = labels[t + 1], IGNORE_INDEX at the end.

    Shifting once for the whole sequence keeps chunk boundaries right (Hugging Face semantics).
    """
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def _slice_loss_sum(hidden: torch.Tensor, targets: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
    with record_function(LOSS_RANGE):
        logits = lm_head(hidden).float()  # (B, S, V): softmax in fp32
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
    the backward (the forward then computes the losses alone). The gradient is made for ``scale``
    (1 / the loss's normalizer); the backward multiplies by grad_output / scale, exactly 1.0 when the
    step back-propagates the normalized loss."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor,
                recompute: bool, sink: Fp32GradAccumulator | None):
        rows = hidden.reshape(-1, hidden.shape[-1])
        targets = targets.reshape(-1)
        logits = rows @ weight.t()  # the head's own product: F.linear
        ctx.shape, ctx.trained, ctx.sink = hidden.shape, ctx.needs_input_grad[1], sink
        ctx.param = weight if sink is not None else None  # the parameter the float32 sums are keyed by
        ctx.recompute = recompute and ctx.trained
        if ctx.recompute:
            loss = logits_to_gradient_(logits, targets, scale, write_gradient=False).sum()
            ctx.save_for_backward(rows, weight, targets, scale)
            return loss
        loss = logits_to_gradient_(logits, targets, scale).sum()
        grad_hidden = logits @ weight if ctx.needs_input_grad[0] else None
        ctx.save_for_backward(grad_hidden, logits if ctx.trained else None, rows if ctx.trained else None, scale)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.recompute:
            rows, weight, targets, scale = ctx.saved_tensors
            logits_grad = rows @ weight.t()
            logits_to_gradient_(logits_grad, targets, scale)
            grad_hidden = logits_grad @ weight if ctx.needs_input_grad[0] else None
        else:
            grad_hidden, logits_grad, rows, scale = ctx.saved_tensors
        factor = grad_loss.float() / scale  # 1.0 exactly for the normalized loss's backward
        d_hidden = d_weight = None
        if grad_hidden is not None:
            d_hidden = (grad_hidden.float() * factor).to(grad_hidden.dtype).view(ctx.shape)
        if ctx.trained and ctx.sink is not None:  # float32 sums (fp32_linear.py): a float32 product, as there
            ctx.sink.add(ctx.param, matmul_float32(logits_grad.t(), rows, "LM head weight gradient").mul_(factor))
        elif ctx.trained:
            # In place: a float32 copy of a vocabulary-sized product would cost GBs. Exact for a factor of
            # 1.0; any other (a caller back-propagating a rescaled loss) rounds the product once more.
            d_weight = torch.mm(logits_grad.t(), rows).mul_(factor)
        return d_hidden, d_weight, None, None, None, None


def fused_head(lm_head: nn.Module) -> bool:
    """Whether the fused loss can stand in for calling the head: a plain bias-free ``nn.Linear`` whose
    weight is an ordinary tensor (not a tensor-parallel or FSDP DTensor), whose forward nobody replaced
    except fp32_linear.py (its float32 gradient sums the fused loss feeds too) and that no forward hook
    watches (a trainer's loss scaling, FSDP's unsharding): the others keep autograd's path."""
    from torch.nn.modules import module as module_hooks

    replaced = "forward" in vars(lm_head) and float32_sink(lm_head) is None
    return (type(lm_head) is nn.Linear and lm_head.bias is None and not isinstance(lm_head.weight, DTensor)
            and not replaced and not lm_head._forward_hooks and not lm_head._forward_pre_hooks
            and not module_hooks._global_forward_hooks and not module_hooks._global_forward_pre_hooks)


def _fused_slice_loss_sum(hidden: torch.Tensor, targets: torch.Tensor, lm_head: nn.Module,
                          scale: torch.Tensor, recompute: bool) -> torch.Tensor:
    with record_function(LOSS_RANGE):
        return _HeadCrossEntropy.apply(hidden, lm_head.weight, targets, scale, recompute, float32_sink(lm_head))


def _slices_with_labels(targets: torch.Tensor, slice_tokens: int) -> list[bool]:
    """Whether each slice of ``slice_tokens`` positions has a counted label: one read from the
    device for all slices (a device synchronisation), not one per slice."""
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
) -> torch.Tensor:
    """Sum of token cross-entropies of ``hidden`` (B, L, H) against ``targets`` (B, L), / normalizer.

    With ``recompute`` each slice's logits are recomputed in backward (checkpointed), so at most
    ``slice_tokens`` positions' logits (and their gradient) are alive at once, in forward and in
    backward. Without, autograd keeps every slice's fp32 log-probabilities for the backward (the
    whole of ``hidden``'s positions) and the head's forward runs once.

    ``fused`` (a plain linear head, under autograd; see fused_head): no float32 logits, no
    log-probabilities (_HeadCrossEntropy). A frozen head's slices need no recompute and keep nothing of
    the vocabulary's size; a trained head's keep their logits' gradient (in the model dtype) without
    ``recompute``, nothing with it.
    """
    total = hidden.new_zeros((), dtype=torch.float32)
    fused = fused and torch.is_grad_enabled() and hidden.requires_grad and fused_head(lm_head)
    scale = torch.ones((), dtype=torch.float32, device=hidden.device) / normalizer if fused else None
    for start, counted in zip(range(0, hidden.shape[1], slice_tokens), _slices_with_labels(targets, slice_tokens),
                              strict=True):
        part = slice(start, start + slice_tokens)
        if not counted:
            continue  # nothing to learn here: skip the vocabulary projection entirely
        if fused:
            total = total + _fused_slice_loss_sum(hidden[:, part], targets[:, part], lm_head, scale, recompute)
        elif torch.is_grad_enabled() and recompute:
            total = total + checkpoint(_slice_loss_sum, hidden[:, part], targets[:, part], lm_head,
                                       use_reentrant=False)
        else:
            total = total + _slice_loss_sum(hidden[:, part], targets[:, part], lm_head)
    return total / normalizer
