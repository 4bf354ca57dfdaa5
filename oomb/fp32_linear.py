"""Linear layers' weight gradients with float32 results, summed over the chunks without rounding.

A full-sequence backward rounds a bf16 weight's gradient once: its GEMM sums every token in float32
and writes bf16. Stage 2 runs that GEMM once per chunk, and autograd rounds each chunk's result to
bf16 before grads.py adds it to its float32 sum: one rounding per chunk instead of one in all. Inside
:func:`float32_weight_gradients` every plain ``nn.Linear`` whose gradient the accumulator sums
computes its weight (and bias) gradient with a float32 result (on a GPU: tensor cores, exact bf16
products, float32 sums) and adds it to the accumulator directly; its input gradient is what autograd
would compute.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .grads import LOW_PRECISION, Fp32GradAccumulator


def tensor_cores_give_float32(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a @ b`` can run on tensor cores with a float32 result: low-precision CUDA tensors of
    one dtype, torch >= 2.8 (``out_dtype``)."""
    return a.is_cuda and a.dtype in LOW_PRECISION and b.dtype == a.dtype and torch.__version__ >= (2, 8)


def matmul_float32(a: torch.Tensor, b: torch.Tensor, what: str = "matmul") -> torch.Tensor:
    """``a @ b`` (2-D, or batched 3-D) with a float32 result. Where tensor cores can give one, the
    bf16/fp16 products are exact in float32 and the sums float32; elsewhere (CPU, older torch, or a
    library that refuses) float32 copies are multiplied: the same values up to the order of the sums."""
    if tensor_cores_give_float32(a, b):
        try:
            return (torch.bmm if a.dim() == 3 else torch.mm)(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError) as err:
            warnings.warn(f"{what} in float32: {a.dtype} matmul with float32 results failed ({err})", stacklevel=2)
    return torch.matmul(a.float(), b.float())


class _LinearWithFloat32Grads(torch.autograd.Function):
    """F.linear whose weight and bias gradients go, in float32, to ``sink.add`` instead of ``.grad``."""

    @staticmethod
    def forward(ctx, x, weight, bias, module: nn.Linear, sink: Fp32GradAccumulator):
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.sink = module, sink
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        g = grad_out.reshape(-1, grad_out.shape[-1])
        ctx.sink.add(ctx.module.weight, matmul_float32(g.t(), x.reshape(-1, x.shape[-1]), "weight gradient"))
        if ctx.module.bias is not None and ctx.module.bias.requires_grad:
            ctx.sink.add(ctx.module.bias, g.sum(0, dtype=torch.float32))
        return grad_x, None, None, None, None


def _forward_with_float32_grads(sink: Fp32GradAccumulator, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return F.linear(x, module.weight, module.bias)
    return _LinearWithFloat32Grads.apply(x, module.weight, module.bias, module, sink)


FLOAT32_SINK = "_oomb_float32_sink"
"""Attribute naming the accumulator a layer's weight gradient goes to while float32_weight_gradients holds it."""


def float32_sink(module: nn.Module) -> Fp32GradAccumulator | None:
    """The accumulator that takes ``module``'s weight gradient in float32 now, or None (autograd's .grad)."""
    return getattr(module, FLOAT32_SINK, None)


ELIGIBLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Weight dtypes whose gradient a float32 result holds at least as precisely (not float64)."""


def has_grad_hooks(p: torch.Tensor) -> bool:
    """Hooks on a parameter's gradient expect to see it: such a parameter keeps autograd's path."""
    return bool(getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None))


def eligible_linears(model: nn.Module, accumulator: Fp32GradAccumulator) -> list[nn.Linear]:
    """Plain nn.Linear layers whose weight, and bias if it is trained, the accumulator sums. Left alone:
    subclasses (e.g. quantised layers), layers whose forward something else already replaced on the
    instance (e.g. accelerate's device-map hooks), float64 weights, and parameters with gradient hooks."""
    summed = set(accumulator.params)

    def summed_plainly(p: torch.Tensor) -> bool:
        return p in summed and p.dtype in ELIGIBLE_DTYPES and not has_grad_hooks(p)

    def eligible(m: nn.Module) -> bool:
        if type(m) is not nn.Linear or "forward" in vars(m) or not summed_plainly(m.weight):
            return False
        return m.bias is None or not m.bias.requires_grad or summed_plainly(m.bias)

    return [m for m in model.modules() if eligible(m)]


@contextlib.contextmanager
def float32_weight_gradients(model: nn.Module, accumulator: Fp32GradAccumulator,
                             enabled: bool = True) -> Iterator[list[nn.Linear]]:
    """Route the eligible linear layers' parameter gradients to ``accumulator`` in float32 while inside;
    their forward is restored on exit (also after an error). Yields the layers it changed."""
    layers = eligible_linears(model, accumulator) if enabled else []
    for m in layers:
        m.forward = types.MethodType(lambda self, input: _forward_with_float32_grads(accumulator, self, input), m)
        setattr(m, FLOAT32_SINK, accumulator)  # for code that computes the layer's product itself (loss.py)
    try:
        yield layers
    finally:
        for m in layers:
            del m.forward  # the instance attribute: nn.Linear.forward again
            delattr(m, FLOAT32_SINK)
