"""How much of the history a sparse step reads, and how close to dense the nearest measurement was.

A fixed budget of pages reads a shrinking share of a growing history (64 pages of 128 tokens: about 12 %
at 128K, 0.8 % at 1M; the defaults read about half at every length: 35 % of each block's history, the first
fifth of the layers whole), so the share read, not the
budget, is what a user must see next to a sparse plan,
with the fidelity measured nearest to it (`oomb plan`, the trainer's header). The measurements are
`oomb gradcheck` runs on a real model (docs/sparse.md gives each command and its results file).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .config import OOMBConfig
from .units import format_tokens


def history_read(num_tokens: int, config: OOMBConfig, num_layers: int, window_layers: tuple[int, ...] = ()) -> float:
    """Fraction of (layer, query block, earlier page) triples a sparse step of a model with ``num_layers``
    decoder layers (``window_layers`` of them sliding-window, counted as the selection reads) reads, dense
    layers included: 1.0 is dense. A chunk's own pages are not history and not counted."""
    sparse = config.resolved_sparse(num_layers, window_layers)
    P, C = config.page_size, config.chunk_size
    read = total = 0
    for layer in range(num_layers):
        for start in range(0, num_tokens, C):
            n_hist, blocks = start // P, -(-min(C, num_tokens - start) // P)
            read += blocks * sparse.num_selected(n_hist, layer)
            total += blocks * n_hist
    return read / total if total else 1.0


def budget_for_read(num_tokens: int, config: OOMBConfig, read: float, num_layers: int) -> int:
    """The smallest fixed budget (no read share) whose step reads at least ``read`` of the history (history_read),
    at most dense."""
    low, high = 0, max(1, -(-num_tokens // config.page_size))
    while low < high:
        middle = (low + high) // 2
        fixed = replace(config, sparse=replace(config.sparse, budget=middle, read_share=None))
        if history_read(num_tokens, fixed, num_layers) >= read:
            high = middle
        else:
            low = middle + 1
    return low


@dataclass(frozen=True)
class FidelityPoint:
    """One measured sparse-vs-dense comparison of a whole step's parameter gradients."""

    seq_len: int
    read: float
    """Share of the history read (history_read)."""
    cosine: float
    """Total parameter-gradient cosine to the dense step."""
    loss_gap: float
    """(sparse loss - dense loss) / dense loss."""
    setting: str
    """The sparse setting and model state, e.g. "defaults, as shipped"."""
    source: str
    """The results file (benchmarks/results/) it came from."""


_128K = "real_model/gradcheck_smollm2_128k_h100.json"
_512K = "real_model/gradcheck_smollm2_512k_h100.json"
_128K_NEAR = "real_model/gradcheck_smollm2_128k_reads35_50_h100.json"
_128K_DEFAULTS = "real_model/gradcheck_smollm2_128k_read35_dense0_5_h100.json"
MEASURED: tuple[FidelityPoint, ...] = (
    FidelityPoint(32768, 0.25, 0.98591, 0.00122, "budget 31, SmolLM2-135M YaRN x4, as shipped",
                  "real_model/gradcheck_smollm2_32k_p128_k31_gpu_text_cpu_2026-12-05.json"),
    FidelityPoint(131072, 0.012, 0.52628, -0.04963, "budget 5, SmolLM2-135M YaRN x16, as shipped", _128K),
    FidelityPoint(131072, 0.031, 0.58048, -0.00668, "budget 15, SmolLM2-135M YaRN x16, as shipped", _128K),
    FidelityPoint(131072, 0.100, 0.93984, -0.00770, "budget 51, SmolLM2-135M YaRN x16, as shipped", _128K),
    FidelityPoint(131072, 0.125, 0.97002, -0.00686, "budget 64, SmolLM2-135M YaRN x16, as shipped", _128K),
    FidelityPoint(131072, 0.252, 0.99649, -0.00634, "budget 135, SmolLM2-135M YaRN x16, as shipped", _128K),
    FidelityPoint(131072, 0.125, 0.87355, 0.00763, "budget 64, SmolLM2-135M YaRN x16 after 8 dense steps at 128K",
                  _128K),
    FidelityPoint(131072, 0.252, 0.98850, -0.00008, "budget 135, SmolLM2-135M YaRN x16 after 8 dense steps at 128K",
                  _128K),
    FidelityPoint(131072, 0.351, 0.99849, -0.00480, "budget 195, SmolLM2-135M YaRN x16, as shipped", _128K_NEAR),
    FidelityPoint(131072, 0.501, 0.99962, -0.00234, "budget 295, SmolLM2-135M YaRN x16, as shipped", _128K_NEAR),
    FidelityPoint(131072, 0.351, 0.99812, -0.00039, "budget 195, SmolLM2-135M YaRN x16 after 8 dense steps at 128K",
                  _128K_NEAR),
    FidelityPoint(131072, 0.501, 0.99965, -0.00051, "budget 295, SmolLM2-135M YaRN x16 after 8 dense steps at 128K",
                  _128K_NEAR),
    FidelityPoint(524288, 0.032, 0.33537, 0.04864, "budget 64, SmolLM2-135M YaRN x64, as shipped", _512K),
    FidelityPoint(524288, 0.100, 0.88879, -0.00410, "budget 209, SmolLM2-135M YaRN x64, as shipped", _512K),
    FidelityPoint(524288, 0.354, 0.98400, 0.00123, "read share 0.35, SmolLM2-135M YaRN x64, as shipped",
                  "real_model/gradcheck_smollm2_512k_read35_h100.json"),
    FidelityPoint(524288, 0.484, 0.98871, 0.00061, "read share 0.48, SmolLM2-135M YaRN x64, as shipped",
                  "real_model/gradcheck_smollm2_512k_read48_h100.json"),
    FidelityPoint(524288, 0.483, 0.99627, 0.00094, "defaults (read share 0.35, layers 0-5 dense), SmolLM2-135M "
                  "YaRN x64, as shipped", "real_model/gradcheck_smollm2_512k_read35_dense0_5_h100.json"),
    FidelityPoint(131072, 0.497, 0.99938, -0.00090, "defaults (read share 0.35, layers 0-5 dense), SmolLM2-135M "
                  "YaRN x16, as shipped", _128K_DEFAULTS),
    FidelityPoint(131072, 0.497, 0.99921, 0.00075, "defaults (read share 0.35, layers 0-5 dense), SmolLM2-135M "
                  "YaRN x16 after 8 dense steps at 128K", _128K_DEFAULTS),
)
"""Sparse-vs-dense gradients of real models (`oomb gradcheck`, rerank with its default options; docs/sparse.md).
Where two points tie for nearest, the earlier one wins: the model as shipped before the warmed one."""

NEAR_DENSE_COSINE = 0.99
NEAR_DENSE_LOSS_GAP = 0.005
"""The near-dense mark: gradient cosine >= 0.99 and loss within 0.5 % of dense."""


READ_WEIGHT = 2.0
"""A doubling of the share read counts as much as this many doublings of the length: the share read, more than
the length, decides how close to dense a step is (docs/sparse.md, "Sparse at length")."""


def nearest(seq_len: int, read: float, points: tuple[FidelityPoint, ...] = MEASURED) -> FidelityPoint | None:
    """The measurement closest to (seq_len, read), distance in log2 of each (a doubling of the read weighing
    READ_WEIGHT doublings of the length)."""
    if not points:
        return None
    return min(points, key=lambda p: math.hypot(math.log2(p.seq_len / seq_len),
                                                READ_WEIGHT * math.log2(max(p.read, 1e-6) / max(read, 1e-6))))


def format_share(share: float) -> str:
    """A share of the history as a percentage: two significant digits below 10 % (1.6 %, 0.82 %), three above
    (12.5 %, 47 %, 100 %)."""
    percent = 100 * share
    return f"{percent:.2g} %" if percent < 10 else f"{percent:.3g} %"


def describe(seq_len: int, config: OOMBConfig, num_layers: int, window_layers: tuple[int, ...] = ()) -> str:
    """One line for a sparse plan: the share of the history it reads and the nearest measured fidelity."""
    read = history_read(seq_len, config, num_layers, window_layers)
    line = f"sparse reads {format_share(read)} of the history at {format_tokens(seq_len)} tokens"
    if read >= 1:
        return (line + ": every query block reads every earlier page, so this step is dense attention (exact, "
                "and no faster); sparse reads less at longer sequences or with a smaller sparse budget")
    point = nearest(seq_len, read)
    if point is None:
        return line + "; no fidelity measured near it"
    mark = "meets" if point.cosine >= NEAR_DENSE_COSINE and abs(point.loss_gap) <= NEAR_DENSE_LOSS_GAP else "misses"
    return (f"{line}; nearest measurement: {format_tokens(point.seq_len)} tokens reading {format_share(point.read)} "
            f"({point.setting}): gradient cosine {point.cosine:.4f}, loss {100 * point.loss_gap:+.2f} %, {mark} "
            f"the near-dense mark (docs/sparse.md)")
