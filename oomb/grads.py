"""Summing parameter gradients over the chunks of stage 2 in float32.

A full-sequence backward rounds each bf16 weight gradient once (its GEMM accumulates in fp32).
Stage 2 produces one gradient per chunk; adding them into a bf16 ``.grad`` rounds N times. This
accumulator moves each chunk's gradient into an fp32 buffer and writes the sum back once.
"""

from __future__ import annotations

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


class Fp32GradAccumulator:
    """Collects ``.grad`` of low-precision trainable parameters after each chunk's backward."""

    def __init__(self, params, enabled: bool = True) -> None:
        self.params = [p for p in params if p.requires_grad and p.dtype in LOW_PRECISION] if enabled else []
        self.prior = {p: p.grad for p in self.params}  # what .backward() would accumulate onto
        self.sums: dict[torch.nn.Parameter, torch.Tensor] = {}
        for p in self.params:
            p.grad = None

    def collect(self) -> None:
        """Move the gradients of the chunk just back-propagated into the fp32 sums."""
        for p in self.params:
            if p.grad is None:
                continue
            if p in self.sums:
                self.sums[p].add_(p.grad)
            else:
                self.sums[p] = p.grad.float()
            p.grad = None

    def finish(self) -> None:
        """Write prior + sum back into ``.grad``, rounding once."""
        for p in self.params:
            total = self.sums.pop(p, None)
            prior = self.prior[p]
            if total is None:
                p.grad = prior
            else:
                p.grad = (total if prior is None else total.add_(prior)).to(p.dtype)

    def abort(self) -> None:
        """After an error: leave ``.grad`` as it was before the step."""
        for p in self.params:
            p.grad = self.prior[p]
        self.sums.clear()
