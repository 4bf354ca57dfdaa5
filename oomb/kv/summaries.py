"""Per-page key summaries: what sparse attention scores a page by, without reading the page.

For every page, layer and KV head a few D-vectors computed from the page's keys when stage 1
writes them (``PagedKVStore.write``)::

    key_min  (num_pages, Hkv, D)   elementwise min of the page's keys   } the Quest bound ("minmax")
    key_max  (num_pages, Hkv, D)   elementwise max of the page's keys   }
    key_mean (num_pages, Hkv, D)   mean key of the page                   ("mean")

They live next to the pool tensors, indexed by page id like K and V, so they are freed (reused)
with their pages. With host offload they are the part of the store that stays on the GPU: 2 x Hkv x
D values per page and layer for "minmax" (oomb.planning.memory predicts their bytes).
Only the slots of a page's written tokens count: the zero padding of a partial last page does not.
"""

from __future__ import annotations

import torch

SUMMARY_KINDS = ("key_min", "key_max", "key_mean")
SUMMARIES_OF_SCORE = {"minmax": ("key_min", "key_max"), "mean": ("key_mean",), "exact": ()}
"""Which summaries each summary score rule reads (oomb.sparse; "exact" reads the keys themselves)."""


def summaries_of(score: str, rerank_candidates: str = "minmax_mean") -> tuple[str, ...]:
    """The summaries a sparse score keeps per page: "rerank" those of the score proposing its candidates
    (then it reads the candidates' keys)."""
    if score != "rerank":
        return SUMMARIES_OF_SCORE[score]
    return tuple(kind for rule in rerank_candidates.split("_") for kind in SUMMARIES_OF_SCORE[rule])


def summarize_pages(pages: torch.Tensor, valid: int, kinds: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Summaries of a chunk's pages.

    Args:
        pages: (B, n, Hkv, P, D) keys of the chunk's n pages in every sequence, token order in a page.
        valid: tokens written in the last page (1..P); earlier pages are full.
        kinds: names out of SUMMARY_KINDS.
    Returns:
        name -> (B, n, Hkv, D) tensor in the pages' dtype (min and max are exact; the mean is taken in fp32).
    """
    n, P = pages.shape[1], pages.shape[3]
    assert 1 <= valid <= P, f"valid={valid} tokens in a page of {P}"
    slot_ok = torch.ones(n, 1, P, 1, dtype=torch.bool, device=pages.device)
    slot_ok[-1, :, valid:] = False  # padding of a partial last page: not a key
    out = {}
    if "key_min" in kinds:
        out["key_min"] = pages.masked_fill(~slot_ok, float("inf")).amin(dim=3)
    if "key_max" in kinds:
        out["key_max"] = pages.masked_fill(~slot_ok, float("-inf")).amax(dim=3)
    if "key_mean" in kinds:
        count = slot_ok.sum(dim=2).float()  # (n, 1, 1): keys per page
        out["key_mean"] = (pages.float().masked_fill(~slot_ok, 0.0).sum(dim=3) / count).to(pages.dtype)
    return out
