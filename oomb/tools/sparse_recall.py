"""How much of dense attention a sparse selection keeps: recall of attention mass, per layer and KV head.

Sparse mode's gradient error comes from the attention mass its selection drops. For one sequence
this module records every layer's post-RoPE queries and keys from an ordinary forward, computes the
dense attention mass that each query puts on each page, and measures, for any selection rule:

    recall(layer, kv head) = mean over the queries of chunks >= 1 (and the KV head's query heads) of
                             the dense attention mass on the pages the query's block reads
                             (sinks + selected history pages + its own chunk, causally)

It runs the selection code of oomb/sparse.py itself on the recorded queries and the summaries of
oomb/kv/summaries.py, so it measures exactly what a sparse step would read. The ``oracle`` rule
selects, per block, the history pages of highest true mass (summed over the block's queries and
query heads): the best any score could do at that budget. The gap between a rule and the oracle at
the same budget is scoring error; the gap between the oracle and 1 is budget error.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..kv.summaries import SUMMARY_KINDS, summarize_pages
from ..sparse import SparseConfig, block_scores, selection_from_scores

CAPTURE_NAME = "oomb_capture"


@dataclass
class LayerInputs:
    """Post-RoPE queries (1, Hq, T, D) and keys (1, Hkv, T, D) of one layer, float32, and its scale."""

    q: torch.Tensor
    k: torch.Tensor
    scale: float


@contextmanager
def record_attention_inputs(model: torch.nn.Module) -> Iterator[dict[int, LayerInputs]]:
    """While active, a forward of ``model`` (batch 1) stores every layer's queries and keys."""
    recorded: dict[int, LayerInputs] = {}

    def capture(module, query, key, value, attention_mask, scaling=None, **kwargs):
        recorded[module.layer_idx] = LayerInputs(query.detach().float(), key.detach().float(),
                                                 float(scaling if scaling is not None else query.shape[-1] ** -0.5))
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register(CAPTURE_NAME, capture)
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_NAME)
    try:
        yield recorded
    finally:
        model.set_attn_implementation(previous)


@torch.no_grad()
def page_mass(inputs: LayerInputs, page_size: int, rows: int = 1024) -> torch.Tensor:
    """(Hq, T, n_pages) float32: dense causal attention mass of every query on every page."""
    q, k = inputs.q[0], inputs.k[0]
    Hq, T, _ = q.shape
    Hkv = k.shape[0]
    G = Hq // Hkv
    n_pages = -(-T // page_size)
    out = torch.zeros(Hq, T, n_pages, device=q.device)
    key_pos = torch.arange(n_pages * page_size, device=q.device)
    kp = torch.nn.functional.pad(k, (0, 0, 0, n_pages * page_size - T))  # padding keys: masked below
    for h in range(Hq):
        kh = kp[h // G]
        for r0 in range(0, T, rows):
            r1 = min(r0 + rows, T)
            logits = (q[h, r0:r1] @ kh.T) * inputs.scale
            logits.masked_fill_(key_pos[None, :] > torch.arange(r0, r1, device=q.device)[:, None], float("-inf"))
            out[h, r0:r1] = torch.softmax(logits, dim=-1).reshape(r1 - r0, n_pages, page_size).sum(-1)
    return out


def history_summaries(k: torch.Tensor, page_size: int, n_hist: int) -> dict[str, torch.Tensor]:
    """Summaries (1, n_hist, Hkv, D) of the first n_hist (full) pages of keys (1, Hkv, T, D)."""
    _, Hkv, _, D = k.shape
    pages = k[:, :, : n_hist * page_size].reshape(1, Hkv, n_hist, page_size, D).permute(0, 2, 1, 3, 4)
    return summarize_pages(pages, page_size, SUMMARY_KINDS)


def oracle_selection(mass: torch.Tensor, chunk_start: int, chunk_len: int, page_size: int, Hkv: int,
                     options: SparseConfig, layer: int = 0) -> torch.Tensor:
    """(1, Hkv, n_blocks, K): per block, the sinks and the history pages of highest true mass."""
    n_hist = chunk_start // page_size
    Hq = mass.shape[0]
    G = Hq // Hkv
    block_mass = mass[:, chunk_start: chunk_start + chunk_len, :n_hist]  # (Hq, Lq, n_hist)
    n_blocks = -(-chunk_len // page_size)
    pad = n_blocks * page_size - chunk_len
    if pad:
        block_mass = torch.cat([block_mass, block_mass.new_zeros(Hq, pad, n_hist)], dim=1)
    scores = block_mass.reshape(Hkv, G, n_blocks, page_size, n_hist).sum(dim=(1, 3))[None]
    if options.research.selection == "shared":
        scores = scores.sum(dim=1, keepdim=True).expand(1, Hkv, n_blocks, n_hist)
    # True masses add up over a group's blocks: the summing ("softmax") grouping of oomb/sparse.py.
    summed = replace(options, leak_free=False, research=replace(options.research, pooling="softmax"))
    return selection_from_scores(scores, summed, layer)


def kept_mass(mass: torch.Tensor, selection: torch.Tensor | None, chunk_start: int, chunk_len: int,
              page_size: int, Hkv: int) -> torch.Tensor:
    """(Hq, Lq): mass each query of the chunk keeps: its block's selected pages plus its own chunk."""
    c0 = chunk_start // page_size
    rows = mass[:, chunk_start: chunk_start + chunk_len]  # (Hq, Lq, n_pages)
    own = rows[:, :, c0:].sum(-1)
    if selection is None:
        return own + rows[:, :, :c0].sum(-1)
    Hq = mass.shape[0]
    G = Hq // Hkv
    block = torch.arange(chunk_len, device=mass.device) // page_size
    sel = selection[0].long()  # (Hkv, n_blocks, K)
    per_query = sel[:, block]  # (Hkv, Lq, K)
    per_head = per_query.repeat_interleave(G, dim=0)  # (Hq, Lq, K)
    return own + rows.gather(2, per_head).sum(-1)


def layer_recall(inputs: LayerInputs, mass: torch.Tensor, chunk_size: int, page_size: int,
                 options: SparseConfig, rule: str, layer: int = 0) -> torch.Tensor:
    """(Hkv,) mean kept mass per KV head over the queries of chunks >= 1, for ``rule`` ("score":
    oomb/sparse.py's selection with ``options``; "oracle": true top mass)."""
    q, k = inputs.q, inputs.k
    T, Hkv = q.shape[2], k.shape[1]
    G = q.shape[1] // Hkv
    total = torch.zeros(Hkv, device=q.device)
    count = 0
    for start in range(chunk_size, T, chunk_size):
        length = min(chunk_size, T - start)
        n_hist = start // page_size
        if options.num_selected(n_hist, layer) >= n_hist:
            selection = None
        elif rule == "oracle":
            selection = oracle_selection(mass, start, length, page_size, Hkv, options, layer)
        else:
            q_chunk = q[:, :, start: start + length]
            previous = q[:, :, start - page_size: start] if options.leak_free else None
            scores = block_scores(q_chunk, history_summaries(k, page_size, n_hist), page_size, options,
                                  inputs.scale, previous)
            selection = selection_from_scores(scores, options, layer)
        kept = kept_mass(mass, selection, start, length, page_size, Hkv)  # (Hq, Lq)
        total += kept.reshape(Hkv, G, length).sum(dim=(1, 2))
        count += G * length
    return (total / max(count, 1)).cpu()
