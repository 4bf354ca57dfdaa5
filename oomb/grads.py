"""Summing parameter gradients over the chunks of stage 2 in float32.

A full-sequence backward rounds each bf16 weight gradient once (its GEMM accumulates in fp32).
Stage 2 produces one gradient per chunk; adding them into a bf16 ``.grad`` rounds N times. This
accumulator moves each chunk's gradient into an fp32 sum and writes it back once, or, for
parameters the caller gives an fp32 target (e.g. a trainer's master weights' ``.grad``), adds
every chunk straight into that target, so the sum is never rounded. Linear layers' gradients do
not even pass through the parameter's dtype: fp32_linear.py computes them with float32 results and
hands them to :meth:`Fp32GradAccumulator.add`; other parameters' chunk gradients are what autograd
produced in the parameter's dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


class Fp32GradAccumulator:
    """Collects ``.grad`` of trainable parameters after each chunk's backward.

    Args:
        params: the model's parameters.
        enabled: sum low-precision parameters' chunk gradients in fp32 (else leave ``.grad`` alone).
        targets: parameter -> tensor of the same shape (any float dtype, any device) that receives
            the step's gradient of that parameter instead of its ``.grad``, which stays untouched.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], enabled: bool = True,
                 targets: Mapping[torch.nn.Parameter, torch.Tensor] | None = None) -> None:
        self.targets = dict(targets or {})
        for p, target in self.targets.items():
            if target.shape != p.shape or not target.is_floating_point():
                raise ValueError(f"gradient target of shape {tuple(target.shape)} ({target.dtype}) does not fit a "
                                 f"parameter of shape {tuple(p.shape)}")
        params = [p for p in params if p.requires_grad]
        self.params = [p for p in params if p in self.targets or (enabled and p.dtype in LOW_PRECISION)]
        self.prior = {p: p.grad for p in self.params}  # what .backward() would accumulate onto
        self.sums: dict[torch.nn.Parameter, torch.Tensor] = {}
        for p in self.params:
            p.grad = None

    def collect(self) -> None:
        """Move the gradients of the chunk just back-propagated into the fp32 sums (or targets)."""
        for p in self.params:
            if p.grad is not None:
                self.add(p, p.grad)
                p.grad = None

    def add(self, p: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Add a gradient of ``p`` to its fp32 sum or target: a chunk's ``.grad``, or one computed outside
        autograd with a float32 result (fp32_linear.py); ``p`` must be one this accumulator sums."""
        target = self.targets.get(p)
        if target is not None:
            target.add_(grad.to(device=target.device, dtype=target.dtype))
        elif p in self.sums:
            self.sums[p].add_(grad)
        else:
            self.sums[p] = grad.float()  # a float32 grad is taken as is: its owner lets go of it

    def finish(self) -> None:
        """Write prior + sum back into ``.grad``, rounding once; targeted parameters keep their prior."""
        for p in self.params:
            total = self.sums.pop(p, None)
            prior = self.prior[p]
            if total is None:
                p.grad = prior
            else:
                p.grad = (total if prior is None else total.add_(prior)).to(p.dtype)

    def abort(self) -> None:
        """After an error: leave ``.grad`` as it was before the step (targets may hold a partial sum)."""
        for p in self.params:
            p.grad = self.prior[p]
        self.sums.clear()
