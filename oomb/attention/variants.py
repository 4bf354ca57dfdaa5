"""Per-layer attention variants as wrappers of a backend: logit softcapping and attention sinks.

A layer's attention call gets the step's backend (attention/backend.py) specialised for that layer,
so the autograd Function (attention/function.py) and the store's key windows stay unchanged:

* Logit softcapping (Gemma 2: score -> c * tanh(score / c)) is a keyword of the backend's dense and
  sparse functions (torch and triton); cudnn, whose fused attention has no cap, is refused before a
  step starts (``check_backend_supports``), as are sliding windows inside packed documents on cudnn
  (it runs documents as segments and windows alone as a band: attention/cudnn_band.py).
* Attention sinks (gpt-oss: a learned logit per query head in every softmax denominator, with no
  value) are a virtual key of the chunk's *local* key window (the chunk itself, which every dense
  call reads last and every query sees): that window's forward folds exp(sink) into its lse and
  scales its output, so the merged out and lse the Function keeps are those of the full softmax and
  the backward of every window is already right for dQ, dK, dV. The sink's own gradient,
  d loss / d sink_h = -sum_{b,i} p_sink[b, h, i] * delta[b, h, i]   (delta = rowsum(dO * O)),
  is computed by the local window's backward into a per-call ``SinkGradient`` and handed to autograd
  by ``attach_sinks``, an identity on q whose backward runs after the attention's. Every backend's
  local window is one call returning (out, lse), so this works on all three (cudnn included).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial

import torch

from .backend import AttentionBackend

SOFTCAP_BACKENDS = ("torch", "triton")
"""Backends whose dense and sparse functions take ``softcap`` (the Triton kernels as a constexpr:
attention/triton_paged.py). cuDNN's fused attention has no logit softcapping."""


def check_backend_supports(backend: str, *, softcap: bool, sinks: bool, windows: bool, family: str,
                           sparse: bool = False, documents: bool = False) -> None:
    """Refuse, before any allocation, a backend that cannot compute what a layer needs (dense or
    ``sparse`` mode: the backends that have a variant have it in both). ``windows``: the model has
    sliding-window layers shorter than the step; ``documents``: the step has packed documents. Sinks
    are backend-independent (every backend takes them)."""
    needs = []
    if softcap and backend not in SOFTCAP_BACKENDS:
        needs.append("attention logit softcapping")
    if backend == "cudnn" and windows and documents:
        needs.append("sliding-window layers within packed documents (a window cut by a document start has "
                     "a first key that is neither the band's nor the document's)")
    if not needs:
        return
    raise NotImplementedError(f"backend {backend!r} does not support {' and '.join(needs)} ({family}); "
                              "use backend='triton' or 'torch'")


@dataclass
class SinkGradient:
    """The sink gradient of one attention call, filled by its local window's backward."""

    grad: torch.Tensor | None = field(default=None)
    """(Hq,) float32, or None before the backward ran."""

    def add(self, value: torch.Tensor) -> None:
        self.grad = value if self.grad is None else self.grad + value


def layer_backend(backend: AttentionBackend, *, softcap: float | None = None, sinks: torch.Tensor | None = None,
                  sink_grad: SinkGradient | None = None) -> AttentionBackend:
    """``backend`` specialised for one layer's call: softcapped scores and/or sink logits (the
    module docstring). ``sinks`` (Hq,) is detached here; its gradient goes into ``sink_grad``."""
    if softcap is None and sinks is None:
        return backend
    forward, backward = backend.forward, backend.backward
    sparse_forward, sparse_backward = backend.sparse_forward, backend.sparse_backward
    if softcap is not None:
        forward, backward = partial(forward, softcap=softcap), partial(backward, softcap=softcap)
        sparse_forward, sparse_backward = partial(sparse_forward, softcap=softcap), partial(sparse_backward,
                                                                                            softcap=softcap)
    if sinks is not None:
        sinks = sinks.detach().float()
        forward, backward = partial(_sink_forward, forward, sinks), partial(_sink_backward, backward, sinks, sink_grad)
        sparse_forward = partial(_sink_sparse_forward, sparse_forward, sinks)
        sparse_backward = partial(_sink_sparse_backward, sparse_backward, sinks, sink_grad)
    return replace(backend, forward=forward, backward=backward, sparse_forward=sparse_forward,
                   sparse_backward=sparse_backward)


def _is_local(key_range, query_start: int, num_queries: int) -> bool:
    """Whether a dense call's key window is the chunk itself (None: the call reads every key)."""
    return key_range is None or tuple(key_range) == (query_start, query_start + num_queries)


def _fold_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, dtype: torch.dtype):
    """(out, lse) of a softmax with one more logit per head, whose value is 0."""
    lse_total = torch.logaddexp(lse, sinks[None, :, None])  # (B, Hq, Lq)
    return (out.float() * torch.exp(lse - lse_total)[..., None]).to(dtype), lse_total


def _sink_grad(sinks, out, dout, lse, delta) -> torch.Tensor:
    if delta is None:
        delta = (dout.float() * out.float()).sum(-1)
    return -(torch.exp(sinks[None, :, None] - lse) * delta).sum((0, 2))


def _sink_forward(forward, sinks, q, k_pool, v_pool, page_table, query_start, scale, *args, key_range=None,
                  out_dtype=None, **kwargs):
    out, lse = forward(q, k_pool, v_pool, page_table, query_start, scale, *args, key_range=key_range,
                       out_dtype=out_dtype, **kwargs)
    if not _is_local(key_range, query_start, q.shape[2]):
        return out, lse
    return _fold_sink(out, lse, sinks, out_dtype or q.dtype)


def _sink_backward(backward, sinks, sink_grad, q, k_pool, v_pool, page_table, query_start, scale, out, dout, lse,
                   dk_pool, dv_pool, *args, key_range=None, delta=None, **kwargs):
    dq = backward(q, k_pool, v_pool, page_table, query_start, scale, out, dout, lse, dk_pool, dv_pool, *args,
                  key_range=key_range, delta=delta, **kwargs)
    if sink_grad is not None and _is_local(key_range, query_start, q.shape[2]):
        sink_grad.add(_sink_grad(sinks, out, dout, lse, delta))
    return dq


def _sink_sparse_forward(sparse_forward, sinks, q, *args, **kwargs):
    out, lse = sparse_forward(q, *args, **kwargs)
    return _fold_sink(out, lse, sinks, out.dtype)


def _sink_sparse_backward(sparse_backward, sinks, sink_grad, q, k_pool, v_pool, page_table, query_start, scale,
                          selection, out, dout, lse, *args, **kwargs):
    dq = sparse_backward(q, k_pool, v_pool, page_table, query_start, scale, selection, out, dout, lse, *args,
                         **kwargs)
    if sink_grad is not None:
        sink_grad.add(_sink_grad(sinks, out, dout, lse, None))
    return dq


class _AttachSinks(torch.autograd.Function):
    """Identity on q whose backward returns the sinks' gradient, computed by the attention's backward
    (which runs first: this function's output is the attention's input)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, sinks: torch.Tensor, sink_grad: SinkGradient):
        ctx.sink_grad = sink_grad
        ctx.sinks_dtype = sinks.dtype
        ctx.num_heads = sinks.shape[0]
        return q.view_as(q)

    @staticmethod
    def backward(ctx, dq: torch.Tensor):
        grad = ctx.sink_grad.grad
        if grad is None:  # the attention's backward never reached its local window: no sink gradient
            grad = torch.zeros(ctx.num_heads, dtype=torch.float32, device=dq.device)
        ctx.sink_grad.grad = None
        return dq, grad.to(ctx.sinks_dtype), None


def attach_sinks(q: torch.Tensor, sinks: torch.Tensor, sink_grad: SinkGradient) -> torch.Tensor:
    """q, unchanged, through which the sinks receive the gradient ``sink_grad`` collects."""
    if not sinks.requires_grad or not torch.is_grad_enabled():
        return q
    return _AttachSinks.apply(q, sinks, sink_grad)
