"""The Triton kernel of oomb/loss_gradient.py: one program per row of logits, two passes over its vocabulary
(an online log-sum-exp, then the gradient written over the logits). Its torch oracle is loss_gradient.py's
torch path (rows whose target is ``ignore_index`` count nothing)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_paged import INTERPRET

_BLOCK = 128 if INTERPRET else 4096
"""Vocabulary entries per tile: 4096 float32 over 8 warps, 16 per thread."""


@triton.jit(do_not_specialize=["vocab", "stride_row"])
def _logits_to_gradient_kernel(logits_ptr, targets_ptr, scale_ptr, loss_ptr, vocab, stride_row,
                               IGNORE: tl.constexpr, WRITE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK)
    top = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < vocab, other=float("-inf")).to(tl.float32)
        new_top = tl.maximum(top, tl.max(x, axis=0))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), axis=0)
        top = new_top
    log_total = tl.log(total)
    target = tl.load(targets_ptr + row).to(tl.int64)
    counted = target != IGNORE
    valid = (target >= 0) & (target < vocab)  # an out-of-range target gives NaN, as no read may go astray
    x_target = tl.load(base + target, mask=counted & valid, other=0.0).to(tl.float32)
    loss = log_total - (x_target - top)
    tl.store(loss_ptr + row, tl.where(counted, tl.where(valid, loss, float("nan")), 0.0))
    if WRITE:
        scale = tl.where(valid | ~counted, tl.load(scale_ptr), float("nan"))
        _write_gradient(base, top, log_total, target, counted, scale, vocab, BLOCK)


@triton.jit
def _write_gradient(base, top, log_total, target, counted, scale, vocab, BLOCK: tl.constexpr):
    """The second pass: scale * (softmax - onehot) over the row, in the logits' dtype; log-probabilities as
    log-softmax makes them, (x - max) - log(sum)."""
    offs = tl.arange(0, BLOCK)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        ok = cols < vocab
        x = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
        grad = tl.exp((x - top) - log_total) * scale
        grad = tl.where(cols == target, grad - scale, grad)
        grad = tl.where(counted, grad, 0.0)
        tl.store(base + cols, grad.to(base.dtype.element_ty), mask=ok)


def logits_to_gradient_triton(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor,
                              write_gradient: bool = True, ignore_index: int = -100) -> torch.Tensor:  # -100: torch's
    """loss_gradient.logits_to_gradient_ on the Triton kernel (inputs checked there)."""
    loss = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    scale = scale.to(device=logits.device, dtype=torch.float32).reshape(1)
    _logits_to_gradient_kernel[(logits.shape[0],)](logits, targets.contiguous(), scale, loss, logits.shape[1],
                                                   logits.stride(0), IGNORE=ignore_index, WRITE=write_gradient,
                                                   BLOCK=_BLOCK, num_warps=8)
    return loss
