"""Cross-entropy rows turned into their logits' gradient in place: one pass over the vocabulary for
the log-sum-exp, one for the gradient.

    loss_rows = logits_to_gradient_(logits, targets, scale)
    # logits (N, V) now hold scale * (softmax(logits) - onehot(target)), 0 on ignored rows

Why: autograd's cross-entropy over a slice of logits casts them to float32 (a copy twice their size),
writes float32 log-probabilities, and in backward reads both again and writes a float32 gradient before
casting it back: about 0.24 s of the 7B shape's 128K step (4-layer profile: cast 61 ms,
log-softmax 77 ms forward and 81 ms backward, fills 17 ms) over GEMMs of 0.62 s. Here the logits are
read twice and written once, in their own dtype, and nothing float32 of their size exists.

The arithmetic is autograd's: float32 log-probabilities, the loss -log p[target], the gradient p * scale
- scale at the target, rounded once to the logits' dtype. The torch path calls log_softmax itself (so
on the CPU it gives autograd's bits); the kernel computes (x - max) - log(sum exp(x - max)), as torch's
CPU kernel does (CUDA's rounds x - (max + log sum) at the logits' magnitude: the kernel is the more
precise of the two on a GPU).
On CUDA a Triton kernel (attention/triton_loss_gradient.py) does it; elsewhere torch does, a block of rows
at a time so that its float32 temporaries stay small.
"""

from __future__ import annotations

import functools

import torch

IGNORE_INDEX = -100
_TORCH_ROWS = 64
"""Rows per block of the torch path: its float32 temporaries are a few (rows, V) tensors."""


def logits_to_gradient_(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor,
                        write_gradient: bool = True) -> torch.Tensor:
    """Overwrite ``logits`` (N, V), contiguous, with ``scale * (softmax - onehot(targets))`` (zero rows where
    the target is IGNORE_INDEX) and return the float32 (N,) cross-entropies (0 where ignored).
    ``scale``: a float32 scalar tensor on the logits' device. ``write_gradient=False``: the losses only,
    the logits left as they are (one pass over them)."""
    if logits.dim() != 2 or not logits.is_contiguous():
        raise ValueError(f"logits_to_gradient_ takes contiguous (N, V) logits, got {tuple(logits.shape)}")
    if targets.shape != logits.shape[:1]:
        raise ValueError(f"{logits.shape[0]} rows of logits need {logits.shape[0]} targets, got {tuple(targets.shape)}")
    if logits.shape[0] == 0:
        return logits.new_zeros(0, dtype=torch.float32)
    if logits.is_cuda:  # (the CPU tests run the kernel itself through the interpreter)
        kernel = _triton_kernel()
        if kernel is not None:
            return kernel(logits, targets, scale, write_gradient, IGNORE_INDEX)
    return _torch_rows(logits, targets, scale, write_gradient)


def _torch_rows(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor,
                write_gradient: bool = True) -> torch.Tensor:
    losses = []
    for start in range(0, logits.shape[0], _TORCH_ROWS):
        block, target = logits[start:start + _TORCH_ROWS], targets[start:start + _TORCH_ROWS]
        log_probs = torch.log_softmax(block.float(), dim=1)  # autograd's own kernel: its bits on this device
        counted = target != IGNORE_INDEX
        index = torch.where(counted, target, 0).long()[:, None]
        losses.append(torch.where(counted, -log_probs.gather(1, index)[:, 0], 0.0))
        if not write_gradient:
            continue
        grad = log_probs.exp_().mul_(scale)
        grad.scatter_(1, index, grad.gather(1, index) - scale)
        block.copy_(grad * counted[:, None])
    return torch.cat(losses)


@functools.cache
def _triton_kernel():
    """The Triton path, imported on first use (Triton is an optional dependency): None without it."""
    try:
        from .attention.triton_loss_gradient import logits_to_gradient_triton  # local: Triton is optional
    except ImportError:
        return None
    return logits_to_gradient_triton
