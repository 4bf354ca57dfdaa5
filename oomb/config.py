"""The options of an oomb training step: one dataclass of small typed sections, validated on construction."""

from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
import yaml

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
ATTENTION_MODES = ("dense", "sparse")
BACKENDS = ("auto", "torch", "triton", "cudnn")
SPARSE_SCORES = ("auto", "rerank", "minmax", "mean", "exact")
RERANK_CANDIDATES = ("minmax", "mean", "minmax_mean")
SPARSE_SELECTIONS = ("kv_head", "shared")
SPARSE_POOLINGS = ("max", "softmax", "softmax_max")
CANDIDATE_POOLINGS = ("max", "softmax_max")
NORMALISER_PAGES = 256  # sparse.research.normaliser_pages="auto"
READ_SHARE_STEP = 16
"""sparse.read_share: the grown budget is a multiple of this many pages, so a long step runs a few dozen
distinct selection sizes rather than one per chunk."""
DEFAULT_BUDGET = 64
"""sparse.budget's default: the floor of the default read share."""
DEFAULT_READ_SHARE = 0.35
"""sparse.read_share="auto" with the default budget: the smallest share measured to keep sparse near dense on a
real model at 128K both as shipped and after a context extension (gradient cosine >= 0.99, loss within 0.5 %;
docs/sparse.md, "Sparse at length")."""
DEFAULT_DENSE_LAYER_SHARE = 0.2
"""sparse.dense_layers="auto" with the default share: the first fifth of the decoder layers read every page. Their
gradients gather every later layer's attention errors: on a real model at 512K the default share alone gave
cosine 0.984, and with layers 0-5 of 30 read whole 0.9963 (docs/sparse.md, "Sparse at length")."""


def read_share_budget(budget: int, share: float | None, history_pages: int) -> int:
    """The budget of a block with ``history_pages`` before its chunk under sparse.read_share: at least
    ``share`` of them, rounded up to a multiple of READ_SHARE_STEP, never below ``budget``."""
    if share is None:
        return budget
    wanted = -(-round(share * history_pages * 1_000_000) // 1_000_000)  # ceil, without float noise
    return max(budget, -(-wanted // READ_SHARE_STEP) * READ_SHARE_STEP)


def resolve_dtype(value: str | torch.dtype, field_name: str) -> torch.dtype:
    """Map a dtype name ('float32', 'bf16', ...) or a torch.dtype to a torch.dtype."""
    if isinstance(value, torch.dtype):
        if value in _DTYPES.values():
            return value
    elif isinstance(value, str) and value in _DTYPES:
        return _DTYPES[value]
    allowed = ", ".join(sorted(set(_DTYPES)))
    raise ValueError(f"{field_name}={value!r} is not supported; use one of: {allowed}")


def _check_int(name: str, value: object, minimum: int, unit: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}{unit}")


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def _check_choice(name: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; use one of: {choices}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")


@dataclass(frozen=True)
class SparseResearch:
    """Sparse options kept for experiments (`oomb gradcheck`, `oomb bench`, `oomb calibrate` compare them); the
    defaults are the measured choices (docs/sparse.md), and a training run has no reason to change them."""

    selection: Literal["kv_head", "shared"] = "kv_head"
    """"kv_head": each KV head picks its own pages (shared by its query heads); "shared": one choice per query
    block for all heads (the best score of any head)."""
    pooling: Literal["max", "softmax", "softmax_max"] = "max"
    """How a block's score rows (its queries x the KV head's query heads) combine into one score per page
    (scores minmax and mean). "max": the best row; "softmax": each row's softmax over the history pages,
    summed (an estimate of the block's attention mass on the page); "softmax_max": each row's softmax over
    every page it sees (history and own chunk), the best row's."""
    rerank_factor: int = 4
    """Score "rerank": candidate pages per query block, as a multiple of its budget."""
    rerank_candidates: Literal["minmax", "mean", "minmax_mean"] = "minmax_mean"
    """Score "rerank": the summary score that proposes the candidates: "minmax_mean" (half by minmax, the rest
    by the mean key; keeps min, max and mean keys per page), "minmax" (Quest's bound) or "mean" (q . mean key).
    On SmolLM2 minmax_mean's candidates hold the most of the oracle's pages at 8K and 32K, and its gradients
    are the closest to dense (docs/sparse.md, "Candidates")."""
    candidate_pooling: Literal["auto", "max", "softmax_max"] = "auto"
    """Score "rerank": how a block's rows pool the candidates' summary scores. "softmax_max": each row's scores
    normalised first by their log-sum-exp over the pages it sees, the best row's; "max": the best raw score;
    "auto": softmax_max with score rerank. On SmolLM2 with a quarter of the pages read softmax_max met the
    near-dense mark at 8K to 32K where max missed two cases (docs/sparse.md, "Candidate pooling"). The
    normaliser counts the sink pages and the last normaliser_pages history pages, and no logit softcap or
    attention sink: an estimate for ranking candidates, not the attention's."""
    normaliser_pages: int | Literal["auto"] | None = "auto"
    """Pooling "softmax_max": the history pages each row's normaliser counts besides the sink pages and the
    chunk's own pages: the last this many. "auto": NORMALISER_PAGES where a softmax_max normaliser runs.
    None: every history page (a pass that grows with the square of the context); a number bounds it (linear
    in the context). At 32K 256 gave the full normaliser's gradients (docs/sparse.md, "A bounded
    normaliser")."""

    def __post_init__(self) -> None:
        _check_choice("sparse.research.selection", self.selection, SPARSE_SELECTIONS)
        _check_choice("sparse.research.pooling", self.pooling, SPARSE_POOLINGS)
        _check_int("sparse.research.rerank_factor", self.rerank_factor, 1)
        _check_choice("sparse.research.rerank_candidates", self.rerank_candidates, RERANK_CANDIDATES)
        _check_choice("sparse.research.candidate_pooling", self.candidate_pooling, ("auto", *CANDIDATE_POOLINGS))
        if self.normaliser_pages not in ("auto", None):
            if isinstance(self.normaliser_pages, bool) or not isinstance(self.normaliser_pages, int) \
                    or self.normaliser_pages < 1:
                raise ValueError(f"sparse.research.normaliser_pages must be a positive number of pages, 'auto' or "
                                 f"None (every history page); got {self.normaliser_pages!r}")


@dataclass(frozen=True)
class SparseConfig:
    """Sparse attention (docs/sparse.md): each query block reads the sink_pages first pages, its top budget
    earlier pages by score and its own chunk. One type for the step, the planner and the chooser; in dense
    mode it is ignored. Frozen and hashable: the step's state holds it; change it with dataclasses.replace."""

    budget: int = DEFAULT_BUDGET
    """Earlier pages (besides the sinks) each query block reads, per KV head, chosen by score, at least. A budget
    covering every earlier page is dense attention, bit for bit."""
    read_share: float | None | Literal["auto"] = "auto"
    """Read at least this share (0 < share <= 1) of each query block's history: the budget grows to
    max(budget, share x history pages), rounded up to a multiple of READ_SHARE_STEP pages. None: the fixed
    budget, which reads a shrinking share of a growing history (64 pages: 12.5 % at 128K, 0.8 % at 1M: cosine
    0.87-0.97 at 128K on a real model, 0.34 at 512K). "auto": DEFAULT_READ_SHARE (0.35) with the default budget
    as its floor, the fixed budget with any other (a budget set on purpose stays what it says);
    docs/sparse.md, "Sparse at length"."""
    sink_pages: int = 1
    """The first pages of the sequence, always read by every query block (attention sinks)."""
    query_block_pages: int = 1
    """Consecutive query blocks (pages of queries) that share one selection. Larger groups read the same
    compute budget but select fewer distinct pages per chunk, so with offload far fewer pages move."""
    layer_budgets: tuple[int, ...] | None = None
    """A budget per decoder layer (e.g. from `oomb calibrate`); None: budget everywhere."""
    dense_layers: tuple[int, ...] | Literal["auto"] = "auto"
    """Decoder layers that read every earlier page (dense attention in a sparse step). "auto": the first
    DEFAULT_DENSE_LAYER_SHARE of the layers (rounded down; sliding-window layers among them left out) with the
    default budget and read share (35 %, written or "auto"), none with any other budget, share or layer_budgets
    (resolved against the model's layers: resolved_dense_layers). () reads every layer sparsely."""
    score: Literal["auto", "rerank", "minmax", "mean", "exact"] = "auto"
    """How a query block chooses its pages. "rerank": page summaries propose research.rerank_factor x budget
    candidates, then each query's true attention probability over them picks the budget (with offload the
    candidates' keys move to the GPU in stage 1). "minmax": Quest's bound sum_d max(q_d min_d, q_d max_d)
    from each page's min and max key; "mean": q . mean key; "exact": the true attention probabilities from
    every history key (the oracle of `oomb gradcheck`: costs more than a dense forward; no offload, not
    leak-free). "auto": "rerank", or "minmax" with a research.pooling other than "max" (on a real model
    rerank keeps the loss within 0.35 % of dense at a quarter of the pages, minmax 2.8 %)."""
    leak_free: bool = False
    """Score a block's pages with the page of queries before it and its first query, so no query influences
    which pages an earlier query reads. False: every query of the block votes (a later query may change
    which past pages an earlier one of its block sees; docs/sparse.md)."""
    research: SparseResearch = field(default_factory=SparseResearch)
    """Options for experiments only."""

    def __post_init__(self) -> None:
        if isinstance(self.research, dict):  # from a YAML mapping
            object.__setattr__(self, "research", _section(SparseResearch, self.research, "sparse.research"))
        for name in ("budget", "sink_pages"):
            _check_int(f"sparse.{name}", getattr(self, name), 0, " (a number of pages)")
        _check_int("sparse.query_block_pages", self.query_block_pages, 1)
        share = self.read_share
        if share not in (None, "auto") and (isinstance(share, bool) or not isinstance(share, (int, float))
                                            or not 0 < share <= 1):
            raise ValueError(f"sparse.read_share={share!r} must be a share of the history in (0, 1], e.g. 0.35, "
                             f"None for the fixed sparse.budget, or 'auto'")
        budgets = self.layer_budgets
        if budgets is not None:
            if not isinstance(budgets, (list, tuple)) or any(
                    isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in budgets):
                raise ValueError(f"sparse.layer_budgets={budgets!r} must be a list of integers >= 0, one per layer")
            object.__setattr__(self, "layer_budgets", tuple(budgets))
        layers = self.dense_layers
        if layers != "auto":
            if not isinstance(layers, (list, tuple, set, frozenset)) or any(
                    isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
                raise ValueError(f"sparse.dense_layers={layers!r} must be a list of layer indices >= 0, or 'auto'")
            object.__setattr__(self, "dense_layers", tuple(sorted(set(layers))))
        _check_choice("sparse.score", self.score, SPARSE_SCORES)
        _check_bool("sparse.leak_free", self.leak_free)
        if not isinstance(self.research, SparseResearch):
            raise TypeError(f"sparse.research must be a SparseResearch, got {type(self.research).__name__}")
        pooling = self.research.pooling
        if self.score == "rerank" and pooling != "max":
            raise ValueError(f"sparse.score='rerank' pools a block's rows by the best row's probability: "
                             f"sparse.research.pooling={pooling!r} does not apply (use 'max')")
        if self.score == "exact" and self.leak_free:
            raise ValueError("sparse.score='exact' scores a block with its own queries: it cannot be combined with "
                             "sparse.leak_free=True (sparse.score='rerank' can)")
        if self.research.candidate_pooling == "softmax_max" and self.resolved_score != "rerank":
            raise ValueError(f"sparse.research.candidate_pooling='softmax_max' pools rerank's candidates: it does "
                             f"not apply to sparse.score={self.resolved_score!r}")
        if self.research.normaliser_pages not in ("auto", None) and not self._summary_normaliser_runs:
            raise ValueError("sparse.research.normaliser_pages bounds the softmax_max pooling's normaliser of page "
                             "summary scores: set sparse.research.candidate_pooling='softmax_max' (score rerank) or "
                             f"sparse.research.pooling='softmax_max' (score minmax or mean) with it; got score "
                             f"{self.resolved_score!r}, pooling={pooling!r}, "
                             f"candidate_pooling={self.research.candidate_pooling!r}")

    @property
    def resolved_read_share(self) -> float | None:
        """The read share that runs: read_share, with "auto" resolved (DEFAULT_READ_SHARE over the default
        budget; None, the fixed budget, over any other)."""
        if self.read_share != "auto":
            return self.read_share
        return DEFAULT_READ_SHARE if self.budget == DEFAULT_BUDGET else None

    @property
    def resolved_score(self) -> str:
        """The score rule that runs: score, with "auto" resolved (rerank; minmax with a pooling other than max,
        which rerank does not take)."""
        if self.score != "auto":
            return self.score
        return "minmax" if self.research.pooling != "max" else "rerank"

    @property
    def resolved_candidate_pooling(self) -> str:
        """How rerank's candidates are pooled, "auto" resolved (softmax_max with score rerank; "max", unused,
        otherwise)."""
        if self.research.candidate_pooling != "auto":
            return self.research.candidate_pooling
        return "softmax_max" if self.resolved_score == "rerank" else "max"

    @property
    def resolved_normaliser_pages(self) -> int | None:
        """The softmax_max normaliser's history pages, "auto" resolved (NORMALISER_PAGES where the normaliser
        runs, None where none does)."""
        if self.research.normaliser_pages != "auto":
            return self.research.normaliser_pages
        return NORMALISER_PAGES if self._summary_normaliser_runs else None

    @property
    def _summary_normaliser_runs(self) -> bool:
        """Whether a softmax_max pooling normalises page summary scores."""
        score = self.resolved_score
        return ((score == "rerank" and self.resolved_candidate_pooling == "softmax_max")
                or (score in ("minmax", "mean") and self.research.pooling == "softmax_max"))

    def resolved_dense_layers(self, num_layers: int | None, window_layers: tuple[int, ...] = ()) -> tuple[int, ...]:
        """The layers that read every page in a model of ``num_layers`` decoder layers: dense_layers, with
        "auto" resolved (the first DEFAULT_DENSE_LAYER_SHARE of them with the default budget and read share,
        else none; sliding-window layers, ``window_layers``, left out: they read their window densely
        anyway). ``num_layers`` may be None only where the answer does not depend on it."""
        if self.dense_layers != "auto":
            return self.dense_layers
        if not (self.resolved_read_share == DEFAULT_READ_SHARE and self.budget == DEFAULT_BUDGET
                and self.layer_budgets is None):
            return ()
        if num_layers is None:
            raise ValueError("sparse.dense_layers='auto' with the default read share depends on the model's number "
                             "of decoder layers: pass num_layers")
        first = int(round(num_layers * DEFAULT_DENSE_LAYER_SHARE, 6))
        return tuple(layer for layer in range(first) if layer not in window_layers)

    def resolved(self, num_layers: int | None = None, window_layers: tuple[int, ...] = ()) -> SparseConfig:
        """The same options with every "auto" replaced by what runs in a model of ``num_layers`` decoder
        layers, ``window_layers`` of them sliding-window: what the selection reads (as in
        resolved_dense_layers)."""
        research = replace(self.research, candidate_pooling=self.resolved_candidate_pooling,
                           normaliser_pages=self.resolved_normaliser_pages)
        return replace(self, score=self.resolved_score, read_share=self.resolved_read_share, research=research,
                       dense_layers=self.resolved_dense_layers(num_layers, window_layers))

    def budget_of(self, layer: int = 0, history_pages: int = 0) -> int:
        """Top-scored pages a block of ``layer`` reads besides the sinks, with ``history_pages`` before its chunk:
        the layer's budget, grown to read_share of the history where set."""
        if self.layer_budgets is not None and layer < len(self.layer_budgets):
            budget = self.layer_budgets[layer]
        else:
            budget = self.budget
        return read_share_budget(budget, self.resolved_read_share, history_pages)

    def num_selected(self, history_pages: int, layer: int = 0) -> int:
        """Pages of the history each block of ``layer`` reads: the sinks plus the budget, at most all (dense_layers
        "auto" with the default budget and share needs the model's layers: read SparseConfig.resolved(...)'s)."""
        if layer in self.resolved_dense_layers(None):
            return history_pages
        return min(history_pages, self.sink_pages + self.budget_of(layer, history_pages))


@dataclass(frozen=True)
class OffloadConfig:
    """Where the KV pages live and how a chunk's history streams through the GPU. Has no truth value: read
    ``offload.enabled`` (``if config.offload:`` of earlier versions raises a TypeError rather than being always
    true)."""

    enabled: bool = False
    """Keep K, V, dK, dV pages in pinned host memory and stream them through the GPU (dense mode): GPU memory
    stops growing with context; gradients are bit-identical to enabled=False (torch and triton backends; cudnn
    is not bitwise deterministic)."""
    resident_layers: int = 0
    """With offload, the first this many layers keep their pages on the GPU (no transfers for them)."""
    stream_block_pages: int = 256
    """Dense attention reads a chunk's history in blocks of this many pages (per sequence), merged exactly;
    with offload each block is one transfer. Used with and without offload alike, so that both compute the
    same float operations."""
    stream_buffers: int = 3
    """With offload, GPU staging buffers of one block each: one computes while the next loads and the
    previous one's gradients are written back."""

    def __post_init__(self) -> None:
        _check_bool("offload.enabled", self.enabled)
        _check_int("offload.resident_layers", self.resident_layers, 0)
        _check_positive("offload.stream_block_pages", self.stream_block_pages)
        if isinstance(self.stream_buffers, bool) or not isinstance(self.stream_buffers, int) \
                or self.stream_buffers < 2:
            raise ValueError(f"offload.stream_buffers={self.stream_buffers!r} must be an integer >= 2 (one "
                             f"computes, one loads)")

    def __bool__(self) -> bool:
        raise TypeError("OffloadConfig has no truth value: read offload.enabled (e.g. config.offload.enabled)")


@dataclass(frozen=True)
class PerformanceConfig:
    """Speed against memory: which kernels run, what is recomputed and what is kept. None of these changes
    what is computed beyond float rounding (compile_layers, backend "cudnn") and dropout masks."""

    backend: Literal["auto", "torch", "triton", "cudnn"] = "auto"
    """Attention kernels: "torch" (reference, any device), "triton" (CUDA), "auto" (CUDA: cudnn for
    bf16/fp16 weights, torch for float32, triton with precision.deterministic=True, logit softcapping or
    sliding windows inside packed documents; torch off CUDA),
    "cudnn" (CUDA, bf16/fp16: cuDNN's fused attention, which HF's SDPA runs on Hopper; faster there,
    not bitwise deterministic, and each window's gradients are rounded to bf16; docs/kernels.md)."""
    checkpoint_layers: bool = True
    """Recompute each decoder layer inside a chunk during its backward (activation checkpointing)."""
    loss_chunk_tokens: int = 1024
    """The LM-head loss runs over slices of this many tokens: their full-vocabulary logits are computed
    (and, with recompute_logits, the only ones that exist) at a time."""
    recompute_logits: bool = True
    """Recompute each loss slice's logits in backward (at most loss_chunk_tokens tokens' logits alive).
    False: autograd keeps the chunk's log-probabilities (chunk_size x vocabulary x 4 bytes per sequence,
    2.3 GiB for Qwen2.5-7B at chunk 4096) until the chunk's backward, and the LM head's forward GEMM and
    log-softmax run once per slice instead of twice; gradients are bitwise the same. The fused loss (a plain
    linear head: docs/design.md) recomputes nothing and keeps nothing of the vocabulary's size either way: the
    engine makes a trained head's weight gradient in the loss's forward."""
    compile_layers: bool | None = None
    """Compile each decoder layer with torch.compile for the step (oomb's attention stays outside the
    graph): norms, rotary, SiLU and residual adds fuse into fewer kernels, which saves time and activation
    memory (7B shape, 128K sparse step without layer replay on the H200: 23.48 s instead of 25.39 s, 57.2
    instead of 64.3 GiB). The first step compiles (about 25 s there). Gradients match the eager layers' to
    rounding, not bit for bit; two identical steps give the same gradients bit for bit (one dynamic-shape graph
    for every chunk length: oomb/compiled_layers.py). With layer replay the replayed layers run compiled too,
    forward and recomputation. Refused while a dropout is active. None: on for a single-process CUDA step without
    active dropout of a model without experts, with Triton installed, unless precision.deterministic=True; off on
    a CPU, where compiling costs more than it saves. True/False fix it."""
    keep_attention_outputs: bool = False
    """Stage 1 keeps every layer's attention output and log-sum-exp for stage 2, which then skips recomputing
    the attention forward (for sparse attention also its page gathers): (head dim x dtype bytes + 4) bytes
    per token, query head and layer on the GPU, 24.9 GiB for the 7B shape at 128K, counted by oomb plan.
    The 7B shape's 128K sparse step took 0.941x the time without it (kept-attention-outputs-128k), so oomb
    train's chooser turns it on for steps with every page on the GPU where it fits (dense at 128K: 0.858x,
    kept-attention-outputs-dense-128k). Not with offload or context parallelism. With compiled layers
    stage 2's queries can differ from stage 1's by float rounding (compiled-layers-stage-consistency), and
    the backward then pairs stage 2's queries with stage 1's output (bf16 gradient error still HF's own:
    bf16-gradient-error-kept-attention)."""

    def __post_init__(self) -> None:
        _check_choice("performance.backend", self.backend, BACKENDS)
        _check_positive("performance.loss_chunk_tokens", self.loss_chunk_tokens)
        for name in ("checkpoint_layers", "recompute_logits", "keep_attention_outputs"):
            _check_bool(f"performance.{name}", getattr(self, name))
        if self.compile_layers is not None and not isinstance(self.compile_layers, bool):
            raise ValueError(f"performance.compile_layers={self.compile_layers!r} must be True, False or None "
                             f"(automatic)")


@dataclass(frozen=True)
class PrecisionConfig:
    """What is rounded, and whether the kernels are bitwise reproducible."""

    kv_grad_dtype: str | torch.dtype = "float32"
    """Dtype of the in-place dK/dV page buffers. float32 keeps gradients exact; bf16 halves them."""
    fp32_grad_accumulation: bool = True
    """Sum the chunks' gradients of bf16/fp16 trainable parameters in float32 (4 bytes per such
    parameter, held during stage 2) and round once at the end, as a full-sequence backward does;
    linear layers' gradients are computed with float32 results, so no chunk's is rounded either
    (oomb/fp32_linear.py). Off: each chunk adds into the low-precision .grad, one rounding per chunk."""
    deterministic: bool = False
    """True: bitwise-reproducible attention kernels (performance.backend "auto" resolves to triton on CUDA;
    "cudnn" is refused). False: backend "auto" gives bf16/fp16 weights on CUDA cudnn, faster but not bitwise
    deterministic (docs/kernels.md)."""

    def __post_init__(self) -> None:
        resolve_dtype(self.kv_grad_dtype, "precision.kv_grad_dtype")
        _check_bool("precision.fp32_grad_accumulation", self.fp32_grad_accumulation)
        _check_bool("precision.deterministic", self.deterministic)

    @property
    def grad_dtype(self) -> torch.dtype:
        """kv_grad_dtype as a torch.dtype."""
        return resolve_dtype(self.kv_grad_dtype, "precision.kv_grad_dtype")


SECTIONS = {"sparse": SparseConfig, "offload": OffloadConfig, "performance": PerformanceConfig,
            "precision": PrecisionConfig}
"""OOMBConfig's sections: field name -> type (SparseConfig nests SparseResearch as "research")."""

FLAT_KEYS = {
    "sparse_budget": "sparse.budget",
    "sparse_read_share": "sparse.read_share",
    "sparse_sink_pages": "sparse.sink_pages",
    "sparse_query_block_pages": "sparse.query_block_pages",
    "sparse_layer_budgets": "sparse.layer_budgets",
    "sparse_dense_layers": "sparse.dense_layers",
    "sparse_score": "sparse.score",
    "sparse_leak_free": "sparse.leak_free",
    "sparse_selection": "sparse.research.selection",
    "sparse_pooling": "sparse.research.pooling",
    "sparse_rerank_factor": "sparse.research.rerank_factor",
    "sparse_rerank_candidates": "sparse.research.rerank_candidates",
    "sparse_candidate_pooling": "sparse.research.candidate_pooling",
    "sparse_normaliser_pages": "sparse.research.normaliser_pages",
    "offload": "offload.enabled",
    "offload_resident_layers": "offload.resident_layers",
    "stream_block_pages": "offload.stream_block_pages",
    "stream_buffers": "offload.stream_buffers",
    "backend": "performance.backend",
    "checkpoint_layers": "performance.checkpoint_layers",
    "loss_chunk_tokens": "performance.loss_chunk_tokens",
    "recompute_logits": "performance.recompute_logits",
    "compile_layers": "performance.compile_layers",
    "keep_attention_outputs": "performance.keep_attention_outputs",
    "kv_grad_dtype": "precision.kv_grad_dtype",
    "fp32_grad_accumulation": "precision.fp32_grad_accumulation",
    "deterministic": "precision.deterministic",
}
"""The flat keys that earlier versions wrote (YAML files, checkpoints, keyword arguments) -> the dotted path
of the same option now. Each is still read, with one DeprecatedConfigKey warning. "offload" is both: a
mapping (or an OffloadConfig) is the section, any other value the old flag, offload.enabled."""


def is_flat_key(key: str, value: Any) -> bool:
    """Whether ``key: value`` is an option of an earlier version's flat config (FLAT_KEYS), not a section."""
    return key in FLAT_KEYS and not (key in SECTIONS and isinstance(value, (dict, SECTIONS[key])))


class DeprecatedConfigKey(FutureWarning):
    """A flat OOMBConfig key of an earlier version was read; its dotted path is named in the message."""


def _warn_flat(old: list[str], stacklevel: int = 4) -> None:
    if old:
        moved = ", ".join(f"{key} -> {FLAT_KEYS[key]}" for key in old)
        warnings.warn(f"flat OOMBConfig keys are deprecated, use the sections: {moved}", DeprecatedConfigKey,
                      stacklevel=stacklevel)


def _section(cls: type, values: dict, where: str) -> Any:
    """``cls(**values)``, rejecting unknown keys with the list of valid ones."""
    if not isinstance(values, dict):
        raise ValueError(f"{where} must be a mapping of options, got {values!r}")
    valid = [f.name for f in fields(cls)]
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ValueError(f"unknown option(s) {[f'{where}.{k}' for k in unknown]}; valid options: {valid}")
    return cls(**values)


def nested_options(options: dict) -> dict:
    """A mapping of OOMBConfig options with its flat keys (warned) and dotted keys moved into nested
    section: {"sparse_budget": 32, "sparse.score": "minmax"} -> {"sparse": {"budget": 32, "score": "minmax"}}."""
    out: dict = {}
    old = [key for key, value in options.items() if is_flat_key(key, value)]
    _warn_flat(old, stacklevel=5)
    for key, value in options.items():
        if key in old:
            key = FLAT_KEYS[key]
        *path, name = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"OOMBConfig option {key!r}: {part!r} is given twice, as a value and a section")
        if isinstance(value, dict):  # a copy: later dotted keys go into it, never into the caller's mapping
            value = _copied(value)
        if isinstance(value, dict) and isinstance(node.get(name), dict):
            node[name] = {**node[name], **value}
        else:
            node[name] = value
    return out


def _copied(mapping: dict) -> dict:
    return {k: _copied(v) if isinstance(v, dict) else v for k, v in mapping.items()}


def dotted_options(options: dict) -> dict:
    """A mapping of OOMBConfig options by dotted path, with its flat keys (warned) mapped and nested sections
    flattened: {"offload": True, "sparse": {"budget": 32}} -> {"offload.enabled": True, "sparse.budget": 32}."""
    def leaves(node: dict, prefix: str):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    return dict(leaves(nested_options(options), ""))


def _merged(section: Any, values: Any, cls: type, where: str) -> Any:
    """``section`` (a section object, or None for the defaults) updated with a mapping of its options."""
    if not isinstance(values, dict):
        return values
    current = {f.name: getattr(section, f.name) for f in fields(cls)} if section is not None else {}
    unknown = sorted(set(values) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"unknown option(s) {[f'{where}.{k}' for k in unknown]}; valid options: "
                         f"{[f.name for f in fields(cls)]}")
    if cls is SparseConfig and isinstance(values.get("research"), dict):
        values = {**values, "research": _merged(current.get("research"), values["research"], SparseResearch,
                                                f"{where}.research")}
    return cls(**{**current, **values})


@dataclass
class OOMBConfig:
    """Options of the chunk-recurrent step (docs/design.md): chunking and pages at the top, then one small
    section each for sparse attention, offload, performance and precision,
    ``OOMBConfig(attention="sparse", sparse=SparseConfig(budget=32), offload=OffloadConfig(enabled=True))``;
    ``from_dict`` reads the nested mapping of a YAML file. The flat keywords of earlier versions
    (``sparse_budget=32``, ``offload=True``, ``kv_grad_dtype="bf16"``) are still accepted, with a
    DeprecatedConfigKey warning naming the new path (FLAT_KEYS)."""

    chunk_size: int = 4096
    """Tokens per chunk: the unit of recomputation. A multiple of page_size."""
    page_size: int = 128
    """Tokens per KV page: the unit of allocation, of sparse selection and of offload transfers."""
    attention: Literal["dense", "sparse"] = "dense"
    """Attention over the history: "dense" (exact) or "sparse" (the sparse section; docs/sparse.md)."""
    sparse: SparseConfig = field(default_factory=SparseConfig)
    """Sparse attention's options; they only matter with attention="sparse"."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Where the KV pages live (offload.enabled: pinned host memory) and how a chunk's history streams."""
    performance: PerformanceConfig = field(default_factory=PerformanceConfig)
    """Kernels, recomputation and what is kept: speed against memory."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """dK/dV dtype, float32 gradient sums, bitwise-reproducible kernels."""

    def __post_init__(self) -> None:
        for name in ("chunk_size", "page_size"):
            _check_positive(name, getattr(self, name))
        if self.chunk_size % self.page_size:
            raise ValueError(
                f"chunk_size={self.chunk_size} must be a multiple of page_size={self.page_size} "
                f"(e.g. chunk_size={max(1, self.chunk_size // self.page_size) * self.page_size})"
            )
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention={self.attention!r} is not supported; use one of: {ATTENTION_MODES}")
        for name, cls in SECTIONS.items():
            if isinstance(getattr(self, name), dict):  # a mapping (YAML) becomes the section
                setattr(self, name, _merged(None, getattr(self, name), cls, name))
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"OOMBConfig.{name} must be a {cls.__name__} (or a mapping of its options), got "
                                f"{getattr(self, name)!r}")
        if self.sparse.score == "exact" and self.offload.enabled:
            raise ValueError("sparse.score='exact' reads every history key from the GPU pages: it cannot be "
                             "combined with offload.enabled=True (sparse.score='rerank' reads only its candidates' "
                             "keys)")
        if self.precision.deterministic and self.performance.backend == "cudnn":
            raise ValueError("precision.deterministic=True conflicts with performance.backend='cudnn' (cuDNN's "
                             "attention backward is not bitwise deterministic): use backend 'triton' or 'auto', or "
                             "precision.deterministic=False")
        if self.performance.keep_attention_outputs and self.offload.enabled:
            raise ValueError("performance.keep_attention_outputs=True needs offload.enabled=False: the kept outputs "
                             "live on the GPU, and the offloaded stage 2 stages its pages in the attention forward "
                             "it would skip")

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not attributes: the flat options of earlier versions, read-only.
        if name in FLAT_KEYS:
            _warn_flat([name], stacklevel=3)
            return self.option(FLAT_KEYS[name])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def resolved_sparse(self, num_layers: int | None, window_layers: tuple[int, ...] = ()) -> SparseConfig | None:
        """The sparse options a step of a model with ``num_layers`` decoder layers (``window_layers`` of them
        sliding-window) runs (SparseConfig.resolved); None in dense mode."""
        return self.sparse.resolved(num_layers, window_layers) if self.attention == "sparse" else None

    def option(self, path: str) -> Any:
        """The value of a dotted option path: config.option("sparse.budget") is config.sparse.budget."""
        value: Any = self
        for part in path.split("."):
            value = getattr(value, part)
        return value

    def options(self) -> dict[str, Any]:
        """Every option by dotted path: {"chunk_size": 4096, ..., "sparse.budget": 64, ...}."""
        def leaves(obj: Any, prefix: str):
            for f in fields(obj):
                value = getattr(obj, f.name)
                if is_dataclass(value):
                    yield from leaves(value, f"{prefix}{f.name}.")
                else:
                    yield f"{prefix}{f.name}", value

        return dict(leaves(self, ""))

    def with_options(self, changes: dict[str, Any]) -> OOMBConfig:
        """A copy with options changed, by dotted path: ``{"sparse.budget": 32, "offload.enabled": True}``
        (flat keys of earlier versions are mapped, with a warning)."""
        changes = nested_options(changes)
        top = {k: v for k, v in changes.items() if k not in SECTIONS}
        sections = {name: _merged(getattr(self, name), changes[name], cls, name)
                    for name, cls in SECTIONS.items() if name in changes}
        return replace(self, **top, **sections)

    def to_dict(self) -> dict:
        """A plain nested mapping (YAML/JSON-safe: tuples as lists, dtypes as names): from_dict's inverse."""
        def plain(value: Any) -> Any:
            if isinstance(value, torch.dtype):
                return str(value).removeprefix("torch.")
            if isinstance(value, tuple):
                return list(value)
            return value

        def section(obj: Any) -> dict:
            return {f.name: section(getattr(obj, f.name)) if is_dataclass(getattr(obj, f.name))
                    else plain(getattr(obj, f.name)) for f in fields(obj)}

        return section(self)

    @classmethod
    def from_dict(cls, options: dict) -> OOMBConfig:
        """Build from a plain nested mapping (YAML, CLI), rejecting unknown keys with the list of valid ones.
        Flat keys of earlier versions are mapped (FLAT_KEYS), with a DeprecatedConfigKey warning.
        ``sparse_plan``: the path of a plan written by `oomb calibrate`, whose options fill in those not given."""
        options = dict(options)
        plan = options.pop("sparse_plan", None)
        nested = nested_options(options)
        if plan:  # a plan file from `oomb calibrate`: its options, then the explicit ones
            from_plan = nested_options(load_sparse_plan(plan))
            nested = {**from_plan, **nested,
                      **{k: {**from_plan[k], **nested[k]} for k in SECTIONS if k in from_plan and k in nested}}
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(nested) - set(known))
        if unknown:
            raise ValueError(f"unknown OOMBConfig option(s) {unknown}; valid options: {known} (sections: "
                             f"{list(SECTIONS)})")
        return cls(**nested)


def _accept_flat_keywords(dataclass_init):
    """OOMBConfig's __init__, also taking the flat keywords of earlier versions (FLAT_KEYS, warned), applied
    over the sections given (as dataclasses.replace passes them)."""
    @functools.wraps(dataclass_init)
    def init(self, *args, **kwargs):
        flat = {k: kwargs.pop(k) for k in list(kwargs) if is_flat_key(k, kwargs[k])}
        if flat:
            for name, values in nested_options(flat).items():
                cls = SECTIONS[name]
                base = kwargs.get(name)
                if isinstance(base, dict):
                    base = _merged(None, base, cls, name)
                kwargs[name] = _merged(base, values, cls, name)
        dataclass_init(self, *args, **kwargs)

    return init


OOMBConfig.__init__ = _accept_flat_keywords(OOMBConfig.__init__)


def load_sparse_plan(path: str | Path) -> dict:
    """The OOMBConfig options of a sparse plan file (YAML or JSON, as `oomb calibrate` writes it)."""
    text = Path(path).read_text()
    plan = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if not isinstance(plan, dict) or not isinstance(plan.get("oomb"), dict):
        raise ValueError(f"{path}: not a sparse plan (expected a mapping with an 'oomb' section)")
    return plan["oomb"]
