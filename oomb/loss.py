"""Chunked LM-head cross-entropy: full-vocabulary logits exist for a slice of tokens at a time."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
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
) -> torch.Tensor:
    """Sum of token cross-entropies of ``hidden`` (B, L, H) against ``targets`` (B, L), / normalizer.

    With ``recompute`` each slice's logits are recomputed in backward (checkpointed), so at most
    ``slice_tokens`` positions' logits (and their gradient) are alive at once, in forward and in
    backward. Without, autograd keeps every slice's fp32 log-probabilities for the backward (the
    whole of ``hidden``'s positions) and the head's forward runs once.
    """
    total = hidden.new_zeros((), dtype=torch.float32)
    for start, counted in zip(range(0, hidden.shape[1], slice_tokens), _slices_with_labels(targets, slice_tokens),
                              strict=True):
        part = slice(start, start + slice_tokens)
        if not counted:
            continue  # nothing to learn here: skip the vocabulary projection entirely
        if torch.is_grad_enabled() and recompute:
            total = total + checkpoint(_slice_loss_sum, hidden[:, part], targets[:, part], lm_head,
                                       use_reentrant=False)
        else:
            total = total + _slice_loss_sum(hidden[:, part], targets[:, part], lm_head)
    return total / normalizer
