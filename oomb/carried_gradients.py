"""Weight gradients of compiled layers added into ``.grad`` by their own products.

Stage 2 runs every chunk's backward, and autograd adds each chunk's weight gradient into ``.grad`` with a
separate pass over the weight (a bf16 add per linear weight, chunk and layer: about 16 per layer and chunk,
0.57 s of a 2-layer 1M profile on the H200, profile-sparse-offload-chosen-1m). Eager layers route their
linears to products that add into ``.grad`` themselves (fp32_linear.py), but such a routed linear breaks a
compiled graph. Here the compiled layers' linears instead take their weight through ``_CarriedGradient``,
an identity whose backward adds the weight's ``.grad`` of before the chunk to the chunk's gradient: inside
the compiled backward that is ``prev + x^T dy``, which torch's inductor turns into one GEMM with the sum
in its epilogue (``addmm``, beta 1), and the weight's ``.grad`` is cleared before the backward so that
autograd takes the result as it is. One float32 sum and one rounding per chunk, as the routed products.
What it saves is less than the adds: ``addmm`` into a new tensor first copies ``prev`` there (seen on the
CPU: one ``copy_`` per weight and chunk where the ``add_`` was), so a pass of three tensors becomes one of
two plus the GEMM's read of ``prev``. Not timed on a GPU: it does strictly less work (one add kernel fewer
per weight and chunk, no clone), and its GPU tests pass.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .fp32_linear import accumulates_in_place, grad_sink


class _CarriedGradient(torch.autograd.Function):
    """Identity on a weight; its gradient plus ``prev`` (the weight's .grad when the chunk ran forward)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(prev)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (prev,) = ctx.saved_tensors
        return grad + prev, None


def _carried_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward, its weight carrying the gradient so far where autograd records (stage 2)."""
    weight = self.weight
    if torch.is_grad_enabled() and weight.grad is not None:
        weight = _CarriedGradient.apply(weight, weight.grad)
    return F.linear(x, weight, self.bias)


class CarriedGradients:
    """The weights whose gradient a chunk's graph carries. ``release`` before the chunk's backward (autograd
    then stores the carried sum instead of adding to it), ``restore`` after it (a weight the backward did not
    reach gets its gradient of before back). A released gradient is let go as soon as its weight's new one is
    stored (a post-accumulate hook), so that old and new gradients coexist for one layer at a time, not for
    the whole model."""

    def __init__(self, weights: list[nn.Parameter]) -> None:
        self.weights = weights
        self._released: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        self._hooks = [w.register_post_accumulate_grad_hook(self._stored) for w in weights]

    def _stored(self, weight: nn.Parameter) -> None:
        self._released.pop(id(weight), None)

    def release(self) -> None:
        self._released = {id(w): (w, w.grad) for w in self.weights if w.grad is not None}
        for w, _ in self._released.values():
            w.grad = None

    def restore(self) -> None:
        for w, prev in self._released.values():
            if w.grad is None:
                w.grad = prev
        self._released = {}

    def close(self) -> None:
        self.restore()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def carriable_linears(layers: list[nn.Module]) -> list[nn.Linear]:
    """Plain nn.Linear layers of ``layers`` with a trained weight that nothing else routes (no replaced forward,
    no gradient sink: fp32_linear.py's float32 sums or in-place products) and that may take its gradient in
    ``.grad`` (fp32_linear.accumulates_in_place). Each is assumed to be called at most once per chunk's forward
    (as decoder layers call their projections): a second call would carry the gradient so far twice."""
    return [m for layer in layers for m in layer.modules()
            if type(m) is nn.Linear and m.weight.requires_grad and "forward" not in vars(m) and grad_sink(m) is None
            and accumulates_in_place(m.weight)]


@contextlib.contextmanager
def carried_weight_gradients(layers: list[nn.Module], enabled: bool) -> Iterator[CarriedGradients]:
    """Inside the block the eligible linears of ``layers`` (carriable_linears) carry their weight gradient
    through the chunk's graph; restored afterwards."""
    linears = carriable_linears(layers) if enabled else []
    for m in linears:
        m.forward = types.MethodType(_carried_linear_forward, m)
    carried = CarriedGradients([m.weight for m in linears])
    try:
        yield carried
    finally:
        carried.close()
        for m in linears:
            del m.forward  # the instance attribute: nn.Linear.forward again
