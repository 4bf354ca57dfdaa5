"""Choosing the attention backend: dense functions following reference.py's contract and sparse ones
following reference_sparse.py's."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import cudnn_paged, cudnn_sparse, reference, reference_sparse

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionBackend:
    """The functions of a backend: dense (oomb/attention/reference.py's contract) and sparse
    (oomb/attention/reference_sparse.py's: the same plus a per-block page selection)."""

    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., torch.Tensor]
    backward_delta: Callable[..., torch.Tensor | None]
    sparse_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] = reference_sparse.sparse_attention_forward
    sparse_backward: Callable[..., torch.Tensor] = reference_sparse.sparse_attention_backward
    whole_history: bool = False
    """Read a chunk's GPU-resident history as one key window instead of blocks of stream_block_pages.
    For kernels that round each window's partial output and dQ to the input dtype (cuDNN's): the dQ
    shares of several windows largely cancel, so rounding each one costs accuracy (measured on the
    H200 on one sequence: 1.123x HF's gradient error with up to 8 windows of 2 pages, 1.018x reading
    the same history as one window; pooled over 8 sequences, streamed offload blocks, which cannot
    merge, measure 1.0066x)."""
    sparse_block_group: bool = False
    """The sparse functions take ``block_group`` (the step's sparse_query_block_pages: runs of that many
    query blocks share one selection), so they need not read the selection to find its groups."""


TORCH_BACKEND = AttentionBackend(
    "torch", reference.paged_attention_forward, reference.paged_attention_backward, reference.backward_delta
)


def _triton_backend() -> AttentionBackend:
    from . import triton_paged, triton_sparse  # imported lazily: triton is an optional dependency

    return AttentionBackend("triton", triton_paged.paged_attention_forward, triton_paged.paged_attention_backward,
                            triton_paged.backward_delta, triton_sparse.sparse_attention_forward,
                            triton_sparse.sparse_attention_backward)


def _cudnn_backend() -> AttentionBackend:
    """Dense key windows (cudnn_paged.py) and sparse selected pages (cudnn_sparse.py) on cuDNN's fused
    attention."""
    windowed, selected = cudnn_paged.WindowedAttention(), cudnn_sparse.SelectedPagesAttention()
    return AttentionBackend("cudnn", windowed.paged_attention_forward, windowed.paged_attention_backward,
                            cudnn_paged.no_delta, selected.sparse_attention_forward,
                            selected.sparse_attention_backward, whole_history=True, sparse_block_group=True)


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype | None = None,
                         deterministic: bool = False) -> str:
    """The concrete backend for ``name`` ("auto" | "torch" | "triton" | "cudnn").

    "auto": torch off CUDA; on CUDA cudnn for bf16/fp16 (faster in every measured case, not bitwise
    deterministic), torch for float32 (cuDNN's fused attention has no float32 path, and compiling
    Triton's IEEE-float32 kernels took 184 s of a first step that the torch kernels start in 1.1 s,
    fp32_first_step_h200_2026-12-02.json), triton when ``deterministic``. Without ``dtype`` (a caller
    that does not know it) "auto" on CUDA stays triton, as before dtype-aware selection.
    """
    if name not in ("auto", "torch", "triton", "cudnn"):
        raise ValueError(f"backend={name!r} is not supported; use 'auto', 'torch', 'triton' or 'cudnn'")
    if name == "cudnn" and deterministic:
        raise ValueError("backend='cudnn' is not bitwise deterministic: with deterministic=True use 'triton' or 'auto'")
    if name != "auto":
        return name
    if device.type != "cuda":
        return "torch"
    if dtype in (torch.bfloat16, torch.float16) and not deterministic:
        return "cudnn"
    if dtype == torch.float32 and not deterministic:
        return "torch"
    return "triton"


def select_backend(name: str, device: torch.device, *, dtype: torch.dtype | None = None,
                   deterministic: bool = False) -> AttentionBackend:
    """Resolve "auto" | "torch" | "triton" | "cudnn" for tensors of ``dtype`` on ``device``
    (resolve_backend_name) and build it; "auto" falls back to torch when triton is missing."""
    resolved = resolve_backend_name(name, device, dtype, deterministic)
    if resolved == "torch":
        return TORCH_BACKEND
    if resolved == "cudnn":
        if device.type != "cuda":
            raise ValueError(f"backend='cudnn' needs a CUDA device; got {device}")
        return _cudnn_backend()
    if name == "auto":
        try:
            return _triton_backend()
        except ImportError as err:
            logger.warning("triton backend unavailable (%s); using the torch reference backend", err)
            return TORCH_BACKEND
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(f"backend='triton' needs a CUDA device; got {device} (its kernels run on a CPU only under "
                         "TRITON_INTERPRET=1, for tests): use backend 'torch' or 'auto' there")
    return _triton_backend()
