"""Sparse attention's unselected history pages, attended through their mean key and value.

A sparse query block reads its selected history pages exactly and drops the rest. What it drops is
not zero: on SmolLM2 (real weights and text, 8K) a budget of 16 pages of 64 keeps ~93-96 % of the
attention mass, and the missing few percent both bias the output and inflate the weights of the
pages kept (the softmax renormalises over fewer keys). With ``sparse_unselected="page_means"`` each
unselected page still takes part, as one key: its mean key with the logit offset log(P) (P keys
that all scored like the mean would hold P times one key's weight) and its mean value::

    logits of query i, block j = i // P:
        selected pages and own chunk   q . k_t * scale                 (exact, the sparse kernels)
        unselected history page p      q . mean_k(p) * scale + log P   (here, one per page)

The two parts are one softmax: each is computed with its own log-sum-exp and merged exactly
(reference.merge_window), and backward runs both with the merged statistics, so the gradients are
those of this combined attention. A page mean's gradient reaches every key and value of its page
as 1/P of it (the mean is linear), added when the page's gradients are collected
(PagedKVStore.chunk_grads), so host offload moves no extra pages.

Cost per query: one dot product per history page (as the scoring of oomb/sparse.py), against
P per selected page. All arithmetic is float32.
"""

from __future__ import annotations

import math

import torch

TILE_ELEMENTS = 1 << 25
"""At most this many float32 logits (128 MiB) exist at a time."""


def unselected_mask(selection: torch.Tensor, num_history: int) -> torch.Tensor:
    """(B, Hkv, n_blocks, n_hist) bool: True where query block j does NOT read history page p."""
    B, Hkv, n_blocks, _ = selection.shape
    chosen = torch.zeros((B, Hkv, n_blocks, num_history), dtype=torch.bool, device=selection.device)
    chosen.scatter_(3, selection.long(), True)
    return ~chosen


def _row_tiles(Lq: int, page_size: int, per_row: int) -> list[tuple[int, int]]:
    """Query-row ranges of whole blocks, each holding at most TILE_ELEMENTS logits."""
    rows = max(page_size, (TILE_ELEMENTS // max(per_row, 1)) // page_size * page_size)
    return [(r0, min(r0 + rows, Lq)) for r0 in range(0, Lq, rows)]


def _logits(q_tile: torch.Tensor, key_mean: torch.Tensor, unselected: torch.Tensor, r0: int, page_size: int,
            scale: float) -> torch.Tensor:
    """(B, Hkv, G, R, n_hist) logits of the rows [r0, r0 + R) against the page means; -inf where the
    row's block reads the page itself."""
    R = q_tile.shape[3]
    logits = torch.einsum("bhgrd,bhpd->bhgrp", q_tile, key_mean).mul_(scale).add_(math.log(page_size))
    blocks = torch.arange(r0, r0 + R, device=q_tile.device) // page_size
    read = ~unselected[:, :, blocks]  # (B, Hkv, R, n_hist)
    return logits.masked_fill_(read[:, :, None], float("-inf"))


def page_means_forward(q: torch.Tensor, key_mean: torch.Tensor, value_mean: torch.Tensor, selection: torch.Tensor,
                       page_size: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the chunk's queries over the unselected pages' means.

    Args:
        q: (B, Hq, Lq, D) queries. key_mean, value_mean: (B, n_hist, Hkv, D) the history pages' means.
        selection: (B, Hkv, n_blocks, K) the pages each block reads exactly (oomb/sparse.py).
    Returns:
        out (B, Hq, Lq, D) float32 and lse (B, Hq, Lq) float32; rows whose block selected every page
        get out 0 and lse -inf (merge_window gives them weight 0).
    """
    B, Hq, Lq, D = q.shape
    n_hist, Hkv = key_mean.shape[1], key_mean.shape[2]
    G = Hq // Hkv
    qf = q.float().reshape(B, Hkv, G, Lq, D)
    km, vm = key_mean.float().transpose(1, 2), value_mean.float().transpose(1, 2)  # (B, Hkv, n_hist, D)
    unselected = unselected_mask(selection, n_hist)
    out = torch.empty((B, Hkv, G, Lq, D), device=q.device)
    lse = torch.empty((B, Hkv, G, Lq), device=q.device)
    for r0, r1 in _row_tiles(Lq, page_size, B * Hq * n_hist):
        logits = _logits(qf[..., r0:r1, :], km, unselected, r0, page_size, scale)
        tile_lse = torch.logsumexp(logits, dim=-1)
        shift = torch.where(tile_lse == float("-inf"), 0.0, tile_lse)
        out[..., r0:r1, :] = torch.einsum("bhgrp,bhpd->bhgrd", logits.sub_(shift[..., None]).exp_(), vm)
        lse[..., r0:r1] = tile_lse
    return out.reshape(B, Hq, Lq, D), lse.reshape(B, Hq, Lq)


def page_means_backward(q: torch.Tensor, key_mean: torch.Tensor, value_mean: torch.Tensor, selection: torch.Tensor,
                        page_size: int, scale: float, dout: torch.Tensor, delta: torch.Tensor, lse: torch.Tensor,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the page-means part of a combined attention.

    Args:
        dout: (B, Hq, Lq, D) gradient of the combined output. delta: (B, Hq, Lq) rowsum(dO * O) of the
            combined output. lse: (B, Hq, Lq) the combined log-sum-exp.
    Returns:
        dq (B, Hq, Lq, D), d key_mean and d value_mean (B, n_hist, Hkv, D), all float32.
    """
    B, Hq, Lq, D = q.shape
    n_hist, Hkv = key_mean.shape[1], key_mean.shape[2]
    G = Hq // Hkv
    qf = q.float().reshape(B, Hkv, G, Lq, D)
    do = dout.float().reshape(B, Hkv, G, Lq, D)
    delta, lse = delta.reshape(B, Hkv, G, Lq), lse.reshape(B, Hkv, G, Lq)
    km, vm = key_mean.float().transpose(1, 2), value_mean.float().transpose(1, 2)
    unselected = unselected_mask(selection, n_hist)
    dq = torch.empty_like(qf)
    dkm = torch.zeros((B, Hkv, n_hist, D), device=q.device)
    dvm = torch.zeros_like(dkm)
    for r0, r1 in _row_tiles(Lq, page_size, B * Hq * n_hist):
        q_t, do_t = qf[..., r0:r1, :], do[..., r0:r1, :]
        probs = _logits(q_t, km, unselected, r0, page_size, scale).sub_(lse[..., r0:r1, None]).exp_()
        dvm += torch.einsum("bhgrp,bhgrd->bhpd", probs, do_t)
        dlogits = probs.mul_(torch.einsum("bhgrd,bhpd->bhgrp", do_t, vm).sub_(delta[..., r0:r1, None]))
        dq[..., r0:r1, :] = torch.einsum("bhgrp,bhpd->bhgrd", dlogits, km).mul_(scale)
        dkm += torch.einsum("bhgrp,bhgrd->bhpd", dlogits, q_t).mul_(scale)
    return dq.reshape(B, Hq, Lq, D), dkm.transpose(1, 2), dvm.transpose(1, 2)
