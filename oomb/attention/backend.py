"""Choosing the attention backend: a pair of functions following reference.py's contract."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import reference

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionBackend:
    """The two functions of a backend; see oomb/attention/reference.py for their contract."""

    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., torch.Tensor]


TORCH_BACKEND = AttentionBackend(
    "torch", reference.paged_attention_forward, reference.paged_attention_backward
)


def _triton_backend() -> AttentionBackend:
    from . import triton_paged  # imported lazily: triton is an optional dependency

    return AttentionBackend("triton", triton_paged.paged_attention_forward, triton_paged.paged_attention_backward)


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """Resolve "auto" | "torch" | "triton" for tensors on ``device``."""
    if name == "torch":
        return TORCH_BACKEND
    if name == "triton":
        return _triton_backend()
    if name == "auto":
        if device.type == "cuda":
            try:
                return _triton_backend()
            except ImportError as err:
                logger.warning("triton backend unavailable (%s); using the torch reference backend", err)
        return TORCH_BACKEND
    raise ValueError(f"backend={name!r} is not supported; use 'auto', 'torch' or 'triton'")
