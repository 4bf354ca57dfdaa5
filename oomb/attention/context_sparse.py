"""Sparse attention over one context-parallel rank's share of the keys: reference_sparse.py with a ``share``.

Under context parallelism (oomb/context_parallel.py) every rank runs the same sparse call with the
same selection (oomb/sparse.py: each rank scores the whole history from summaries it holds for
every chunk), and reads only the keys it holds::

    query block j, KV head h:   selected pages  p0   p1   p2   p3  |  chunk's own keys (causal)
    rank r reads:               those on r       x         x       |  all, if r owns the chunk

Each rank returns its partial (out, lse) in float32 (a row with no key here: out 0, lse -inf, an
empty window); ``ContextShard.merge`` folds them in rank order, as the dense path merges key
windows. Backward takes the merged (out, lse), adds dK, dV into the rank's own pages only and
returns its float32 share of dQ, which ``ContextShard.sum`` adds up. Pages of other ranks are never
read (reference_sparse.py's ``share``). Packed documents and logit softcapping work as there.

Why torch rather than the Triton / cuDNN sparse kernels: those read every selected page and the
chunk itself; reading a subset needs a per-page mask and an "own chunk" switch in the kernels (not
there yet). The engine therefore runs sparse calls under cp with these functions on every device
(dense calls keep the step's backend: engine.attention_setup).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

import torch

from ..documents import Documents
from . import reference_sparse
from .backend import AttentionBackend
from .reference_sparse import KeyShare

__all__ = ["KeyShare", "share_backend", "sparse_attention_backward", "sparse_attention_forward"]

logger = logging.getLogger(__name__)


def share_backend(backend: AttentionBackend) -> AttentionBackend:
    """``backend`` with its sparse functions replaced by this module's (dense ones unchanged)."""
    if backend.name != "torch":
        _warn_kernels(backend.name)
    return replace(backend, sparse_forward=sparse_attention_forward, sparse_backward=sparse_attention_backward,
                   sparse_block_group=False)


@functools.cache
def _warn_kernels(backend: str) -> None:
    logger.warning("context-parallel sparse attention runs in torch (oomb/attention/context_sparse.py): the %s "
                   "sparse kernels cannot read only one rank's pages yet; dense calls keep %s", backend, backend)


def sparse_attention_forward(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor, query_start: int,
    scale: float, selection: torch.Tensor, documents: Documents | None = None, softcap: float | None = None, *,
    share: KeyShare,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's partial attention of each query block over its share of the block's keys.

    Returns:
        out (B, Hq, Lq, D) float32 (0 where a row sees no key here) and lse (B, Hq, Lq) float32 (-inf there).
    """
    return reference_sparse.sparse_attention_forward(q, k_pool, v_pool, page_table, query_start, scale, selection,
                                                     documents, softcap, share)


def sparse_attention_backward(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor, query_start: int,
    scale: float, selection: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
    dk_pool: torch.Tensor, dv_pool: torch.Tensor, documents: Documents | None = None,
    softcap: float | None = None, *, share: KeyShare,
) -> torch.Tensor:
    """Add dK, dV of this rank's share of the keys into its pages; return its float32 share of dQ
    (``out`` and ``lse``: the merged ones, every rank's keys)."""
    return reference_sparse.sparse_attention_backward(q, k_pool, v_pool, page_table, query_start, scale, selection,
                                                      out, dout, lse, dk_pool, dv_pool, documents, softcap, share)
