"""Linear layers' weight gradients with float32 results, summed over the chunks without rounding.

A full-sequence backward rounds a bf16 weight's gradient once: its GEMM sums every token in float32
and writes bf16. Stage 2 runs that GEMM once per chunk, and autograd rounds each chunk's result to
bf16 before grads.py adds it to its float32 sum: one rounding per chunk instead of one in all. Inside
:func:`float32_weight_gradients` every plain ``nn.Linear`` whose gradient the accumulator sums
computes its weight (and bias) gradient with a float32 result (on a GPU: tensor cores, exact bf16
products, float32 sums) and adds it to the accumulator directly; its input gradient is what autograd
would compute.

Without float32 sums (bf16 ``.grad``, as a full-sequence backward gives), :func:`in_place_weight_gradients`
routes the same layers' weight gradients into ``.grad`` by the product itself (``addmm_``: the GEMM reads
the sum so far and adds in float32, one rounding per chunk), where autograd writes each chunk's product and
then adds it into ``.grad`` as another pass over the weight (an estimated 0.3 s of the 7B's 128K step on the
H200, scaled from the 4-layer profile-sparse-chosen-128k, and 2.4 s at 1M; the LM head's slices, through the
fused loss, 0.09 s measured there). The engine does so for the LM head always and for the decoder's layers
where they run eager: a routed linear is a graph break inside a compiled layer (stage 2's graphs would split
where stage 1's do not, and the compiled layers' fusions and activation savings, which the planner counts,
were measured unbroken).
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Callable, Iterator

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


class Float32Sums:
    """A gradient sink that adds float32 products to an Fp32GradAccumulator (float32_weight_gradients)."""

    def __init__(self, accumulator: Fp32GradAccumulator) -> None:
        self.accumulator = accumulator

    def add_product(self, p: torch.Tensor, a: torch.Tensor, b: torch.Tensor, what: str = "matmul") -> None:
        """``a @ b`` with a float32 result, added to ``p``'s float32 sum."""
        self.accumulator.add(p, matmul_float32(a, b, what))

    def add(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        self.accumulator.add(p, grad)


class InPlaceGradients:
    """A gradient sink that adds into each parameter's own ``.grad`` (see in_place_weight_gradients)."""

    @staticmethod
    def add_product(p: torch.Tensor, a: torch.Tensor, b: torch.Tensor, what: str = "matmul") -> None:
        """``p.grad += a @ b`` by the product itself (one float32 sum, one rounding to p's dtype)."""
        if p.grad is None:
            p.grad = torch.mm(a, b)
        else:
            p.grad.addmm_(a, b)

    @staticmethod
    def add(p: torch.Tensor, grad: torch.Tensor) -> None:
        """``p.grad += grad`` (a bias's float32 sum: added in float32, rounded once)."""
        if p.grad is None:
            p.grad = grad.to(p.dtype)
        else:
            p.grad.add_(grad)


class _LinearWithGradSink(torch.autograd.Function):
    """F.linear whose weight and bias gradients go to ``sink`` (Float32Sums or InPlaceGradients) instead of
    through autograd."""

    @staticmethod
    def forward(ctx, x, weight, bias, module: nn.Linear, sink):
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.sink = module, sink
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        g = grad_out.reshape(-1, grad_out.shape[-1])
        ctx.sink.add_product(ctx.module.weight, g.t(), x.reshape(-1, x.shape[-1]), "weight gradient")
        if ctx.module.bias is not None and ctx.module.bias.requires_grad:
            ctx.sink.add(ctx.module.bias, g.sum(0, dtype=torch.float32))
        return grad_x, None, None, None, None


def _forward_with_grad_sink(sink, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return F.linear(x, module.weight, module.bias)
    return _LinearWithGradSink.apply(x, module.weight, module.bias, module, sink)


GRAD_SINK = "_oomb_grad_sink"
"""Attribute naming the sink a layer's weight gradient goes to while float32_weight_gradients or
in_place_weight_gradients holds it."""


def grad_sink(module: nn.Module) -> Float32Sums | InPlaceGradients | None:
    """The sink that takes ``module``'s weight gradient now (float32 sums or ``.grad`` in place), or None
    (autograd's path)."""
    return getattr(module, GRAD_SINK, None)


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
    return _plain_linears(model, lambda p: p in summed and p.dtype in ELIGIBLE_DTYPES and not has_grad_hooks(p))


def _plain_linears(model: nn.Module, takes: Callable[[torch.Tensor], bool]) -> list[nn.Linear]:
    """Plain nn.Linear layers (not a subclass, forward not replaced on the instance) whose weight, and bias if
    it is trained, ``takes`` accepts."""
    def eligible(m: nn.Module) -> bool:
        if type(m) is not nn.Linear or "forward" in vars(m) or not takes(m.weight):
            return False
        return m.bias is None or not m.bias.requires_grad or takes(m.bias)

    return [m for m in model.modules() if eligible(m)]


@contextlib.contextmanager
def float32_weight_gradients(model: nn.Module, accumulator: Fp32GradAccumulator,
                             enabled: bool = True) -> Iterator[list[nn.Linear]]:
    """Route the eligible linear layers' parameter gradients to ``accumulator`` in float32 while inside;
    their forward is restored on exit (also after an error). Yields the layers it changed."""
    layers = eligible_linears(model, accumulator) if enabled else []
    with _routed(layers, Float32Sums(accumulator)):
        yield layers


@contextlib.contextmanager
def _routed(layers: list[nn.Linear], sink) -> Iterator[None]:
    """The layers' parameter gradients to ``sink`` while inside; their forward restored on exit."""
    for m in layers:
        m.forward = types.MethodType(lambda self, input: _forward_with_grad_sink(sink, self, input), m)
        setattr(m, GRAD_SINK, sink)  # for code that computes the layer's product itself (loss.py)
    try:
        yield
    finally:
        for m in layers:
            del m.forward  # the instance attribute: nn.Linear.forward again
            delattr(m, GRAD_SINK)


def accumulates_in_place(param: torch.Tensor) -> bool:
    """Whether a gradient of ``param`` may be added into ``param.grad`` outside autograd: a plain leaf
    parameter that no gradient hook watches, with no ``.grad`` yet or a dense one of its own dtype, shape and
    device. The step's backward is oomb's own (the engine calls ``backward``, never ``torch.autograd.grad``),
    and data parallelism all-reduces ``.grad`` after it (training/hf_trainer.py): no hook of autograd's is
    skipped. FSDP and tensor parallelism keep autograd's path (their parameters are DTensors)."""
    if not param.is_leaf or type(param) is not nn.Parameter or has_grad_hooks(param):
        return False
    grad = param.grad
    return grad is None or (type(grad) is torch.Tensor and grad.layout == torch.strided and grad.dtype == param.dtype
                            and grad.shape == param.shape and grad.device == param.device and grad.is_contiguous())


def in_place_linears(model: nn.Module, accumulator: Fp32GradAccumulator) -> list[nn.Linear]:
    """Plain nn.Linear layers with a trained weight that the accumulator does not sum (all of them without
    float32 sums; with them, float32 parameters) and whose parameters may take their gradient in place
    (accumulates_in_place); left alone as in eligible_linears: subclasses, replaced forwards (also those
    float32_weight_gradients routed)."""
    summed = set(accumulator.params)
    return _plain_linears(model, lambda p: p.requires_grad and p not in summed and p.dtype in ELIGIBLE_DTYPES
                          and accumulates_in_place(p))


@contextlib.contextmanager
def in_place_weight_gradients(model: nn.Module, accumulator: Fp32GradAccumulator,
                              enabled: bool = True) -> Iterator[list[nn.Linear]]:
    """Route the in_place_linears' parameter gradients into their ``.grad`` by the product itself while
    inside (module docstring); their forward is restored on exit (also after an error). Yields the layers."""
    layers = in_place_linears(model, accumulator) if enabled else []
    with _routed(layers, InPlaceGradients()):
        yield layers
