"""One dataclass of options for an oomb training step, validated on construction."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

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
NORMALISER_PAGES = 256  # sparse_normaliser_pages="auto"
READ_SHARE_STEP = 16
"""sparse_read_share: the grown budget is a multiple of this many pages, so a long step runs a few dozen
distinct selection sizes rather than one per chunk."""


def read_share_budget(budget: int, share: float | None, history_pages: int) -> int:
    """The budget of a block with ``history_pages`` before its chunk under sparse_read_share: at least
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


@dataclass
class OOMBConfig:
    """Options of the chunk-recurrent step (docs/design.md)."""

    chunk_size: int = 4096
    """Tokens per chunk: the unit of recomputation. A multiple of page_size."""
    page_size: int = 128
    """Tokens per KV page: the unit of allocation, of sparse selection and of offload transfers."""
    attention: Literal["dense", "sparse"] = "dense"
    """Attention over the history: "dense" (exact) or "sparse" (each query block reads the
    sparse_sink_pages first pages, its top sparse_budget earlier pages and its own chunk;
    docs/sparse.md). The sparse_* options below only matter in sparse mode."""
    sparse_budget: int = 64
    """Sparse: earlier pages (besides the sinks) each query block reads, per KV head, chosen by score.
    A budget covering every earlier page is dense attention, bit for bit."""
    sparse_read_share: float | None = None
    """Sparse: read at least this share (0 < share <= 1) of each query block's history: the budget grows with
    the history to max(sparse_budget, share x history pages), rounded up to a multiple of READ_SHARE_STEP pages
    (kernels then see few distinct shapes). None: the fixed sparse_budget. A fixed budget reads a shrinking
    share of a growing history (64 pages: 12.5 % at 128K, 1.6 % at 1M), and on a real model the gradients
    left the near-dense mark as the share fell: at 128K a quarter of the history kept a cosine of 0.989-0.997
    where the defaults gave 0.87-0.97 (docs/sparse.md, "Sparse at length")."""
    sparse_sink_pages: int = 1
    """Sparse: the first pages of the sequence, always read by every query block (attention sinks)."""
    sparse_score: Literal["auto", "rerank", "minmax", "mean", "exact"] = "auto"
    """Sparse: how a query block chooses its pages. "rerank": page summaries (sparse_rerank_candidates)
    pick sparse_rerank_factor x budget candidate pages, then each query's true attention probability over
    the candidates picks the budget (keys read: the candidates'; with offload they move to the GPU in
    stage 1). "minmax": Quest's upper bound sum_d max(q_d min_d, q_d max_d) from the
    page's elementwise min and max key; "mean": q . mean key; "exact": the true attention probabilities
    from every history key (the oracle: costs more than a dense forward; no offload, not leak-free).
    "auto" (default): "rerank", or "minmax" with a sparse_pooling other than "max" (docs/sparse.md:
    rerank keeps the loss within 0.35 % of dense on a real model at a quarter of the pages, minmax 2.8 %)."""
    sparse_selection: Literal["kv_head", "shared"] = "kv_head"
    """Sparse: "kv_head": each KV head picks its own pages (shared by its query heads); "shared": one
    choice per query block for all heads (the best score of any head)."""
    sparse_leak_free: bool = False
    """Sparse: score a block's pages with the page of queries before it and its first query, so no query
    influences which pages an earlier query reads. False (default): every query of the block votes (a
    later query of a block may change which past pages an earlier one sees; docs/sparse.md)."""
    sparse_query_block_pages: int = 1
    """Sparse: consecutive query blocks (pages of queries) that share one selection. 1: every page of
    queries chooses its own pages. Larger groups read the same compute budget but select fewer
    distinct pages per chunk, so with offload far fewer pages move (a chunk's whole group: at most
    Hkv x (sinks + budget) pages per chunk)."""
    sparse_pooling: Literal["max", "softmax", "softmax_max"] = "max"
    """Sparse: how a block's score rows (its queries x the KV head's query heads) combine into one score
    per page. "max": the best row; "softmax": each row's softmax over the history pages, summed (an
    estimate of the block's attention mass on the page); "softmax_max": each row's softmax over every
    page it sees (history and own chunk), the best row's (an estimate of the largest probability any
    query puts on the page)."""
    sparse_rerank_factor: int = 4
    """Sparse, score "rerank": candidate pages per query block, as a multiple of its budget."""
    sparse_rerank_candidates: Literal["minmax", "mean", "minmax_mean"] = "minmax_mean"
    """Sparse, score "rerank": the summary score that proposes the candidates: "minmax_mean" (default:
    half the candidates by minmax, the rest by the mean key; keeps min, max and mean keys per page),
    "minmax" (Quest's bound from each page's min and max key) or "mean" (q . the page's mean key). On
    SmolLM2 minmax_mean's candidates hold the most of the oracle's pages at 8K and 32K, and its
    gradients are the closest to dense (docs/sparse.md, "Candidates")."""
    sparse_candidate_pooling: Literal["auto", "max", "softmax_max"] = "auto"
    """Sparse, score "rerank": how a query block's rows (its queries x the KV head's query heads) pool the
    candidates' summary scores. "softmax_max": each row's scores normalised first by their log-sum-exp over
    the pages it sees (the history, and the chunk's own pages up to its block), the best row's; "max": the
    best raw score; "auto" (default): softmax_max with score rerank. On SmolLM2 with a quarter of the pages
    read softmax_max met the near-dense mark at 8K (three cases: max misses two), 16K and 32K, and at 128K
    and 1M on the H200 its step takes what max's does (docs/sparse.md, "Candidate pooling"). The normaliser
    counts the sequence's first sparse_sink_pages and the last sparse_normaliser_pages history pages (other
    documents' too, in a packed sequence) and no logit softcap or attention sink: an estimate for ranking
    candidates, not the attention's."""
    sparse_normaliser_pages: int | Literal["auto"] | None = "auto"
    """Sparse, pooling "softmax_max" (sparse_candidate_pooling or sparse_pooling): the history pages each
    row's normaliser counts besides the sink pages and the chunk's own pages: the last this many. "auto"
    (default): NORMALISER_PAGES (256) where a softmax_max normaliser runs. None: every history page, a pass
    over the summaries that grows with the square of the context; a number bounds it (linear in the
    context) and equals the full normaliser while the history holds at most this many pages besides the
    sinks. At 32K (448 history pages) 256 gave the full normaliser's gradients (docs/sparse.md, "A bounded
    normaliser")."""
    sparse_layer_budgets: list[int] | None = None
    """Sparse: a budget per decoder layer (e.g. from `oomb calibrate`); None: sparse_budget everywhere."""
    sparse_dense_layers: list[int] = field(default_factory=list)
    """Sparse: decoder layers that read every earlier page (dense attention in a sparse step)."""
    kv_grad_dtype: str | torch.dtype = "float32"
    """Dtype of the in-place dK/dV page buffers. float32 keeps gradients exact; bf16 halves them."""
    backend: Literal["auto", "torch", "triton", "cudnn"] = "auto"
    """Attention kernels: "torch" (reference, any device), "triton" (CUDA), "auto" (CUDA: cudnn for
    bf16/fp16 weights, torch for float32, triton with deterministic=True, logit softcapping or sliding
    windows inside packed documents; torch off CUDA),
    "cudnn" (CUDA, bf16/fp16: cuDNN's fused attention, which HF's SDPA runs on Hopper; faster there,
    not bitwise deterministic, and each window's gradients are rounded to bf16; docs/kernels.md)."""
    offload: bool = False
    """Keep K, V, dK, dV pages in pinned host memory and stream them through the GPU (dense mode):
    GPU memory stops growing with context; gradients are bit-identical to offload=False (torch and
    triton backends; cudnn is not bitwise deterministic)."""
    offload_resident_layers: int = 0
    """Offload: the first this many layers keep their pages on the GPU (no transfers for them)."""
    stream_block_pages: int = 256
    """Dense attention reads a chunk's history in blocks of this many pages (per sequence), merged
    exactly; with offload each block is one transfer. Used with and without offload alike, so that
    both compute the same float operations."""
    stream_buffers: int = 3
    """Offload: GPU staging buffers of one block each: one computes while the next loads and the
    previous one's gradients are written back."""
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
    fp32_grad_accumulation: bool = True
    """Sum the chunks' gradients of bf16/fp16 trainable parameters in float32 (4 bytes per such
    parameter, held during stage 2) and round once at the end, as a full-sequence backward does;
    linear layers' gradients are computed with float32 results, so no chunk's is rounded either
    (oomb/fp32_linear.py). Off: each chunk adds into the low-precision .grad, one rounding per chunk."""
    compile_layers: bool | None = None
    """Compile each decoder layer with torch.compile for the step (oomb's attention stays outside the
    graph): norms, rotary, SiLU and residual adds fuse into fewer kernels, which saves time and activation
    memory (7B shape, 128K sparse step without layer replay on the H200: 23.48 s instead of 25.39 s, 57.2
    instead of 64.3 GiB). The first step compiles (about 25 s there). Gradients match the eager layers' to
    rounding, not bit for bit. Needs checkpoint_layers=False (with replay, stage 2 would run eager: other
    rounding, other dropout masks than stage 1), and is refused while a dropout is active. None: on for a
    single-process CUDA step without layer replay or active dropout of a model without experts, with
    Triton installed, unless deterministic=True; off on a CPU, where compiling costs more than it saves.
    True/False fix it."""
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
    deterministic: bool = False
    """True: bitwise-reproducible attention kernels (backend "auto" resolves to triton on CUDA; "cudnn"
    is refused). False: backend "auto" gives bf16/fp16 weights on CUDA cudnn, faster but not bitwise
    deterministic (docs/kernels.md)."""

    def __post_init__(self) -> None:
        for name in ("chunk_size", "page_size", "loss_chunk_tokens", "stream_block_pages", "stream_buffers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.chunk_size % self.page_size:
            raise ValueError(
                f"chunk_size={self.chunk_size} must be a multiple of page_size={self.page_size} "
                f"(e.g. chunk_size={max(1, self.chunk_size // self.page_size) * self.page_size})"
            )
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention={self.attention!r} is not supported; use one of: {ATTENTION_MODES}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not supported; use one of: {BACKENDS}")
        for name in ("sparse_budget", "sparse_sink_pages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an integer >= 0 (a number of pages)")
        share = self.sparse_read_share
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not 0 < share <= 1):
            raise ValueError(f"sparse_read_share={share!r} must be a share of the history in (0, 1], e.g. 0.25, "
                             f"or None for the fixed sparse_budget")
        if isinstance(self.sparse_rerank_factor, bool) or not isinstance(self.sparse_rerank_factor, int) \
                or self.sparse_rerank_factor < 1:
            raise ValueError(f"sparse_rerank_factor={self.sparse_rerank_factor!r} must be an integer >= 1")
        if isinstance(self.sparse_query_block_pages, bool) or not isinstance(self.sparse_query_block_pages, int) \
                or self.sparse_query_block_pages < 1:
            raise ValueError(f"sparse_query_block_pages={self.sparse_query_block_pages!r} must be an integer >= 1")
        if self.sparse_pooling not in SPARSE_POOLINGS:
            raise ValueError(f"sparse_pooling={self.sparse_pooling!r} is not supported; use one of: {SPARSE_POOLINGS}")
        self._check_layer_options()
        if self.sparse_score not in SPARSE_SCORES:
            raise ValueError(f"sparse_score={self.sparse_score!r} is not supported; use one of: {SPARSE_SCORES}")
        if self.sparse_score == "exact" and self.offload:
            raise ValueError("sparse_score='exact' reads every history key from the GPU pages: it cannot be "
                             "combined with offload=True (sparse_score='rerank' reads only its candidates' keys)")
        if self.sparse_score == "rerank" and self.sparse_pooling != "max":
            raise ValueError(f"sparse_score='rerank' pools a block's rows by the best row's probability: "
                             f"sparse_pooling={self.sparse_pooling!r} does not apply (use 'max')")
        if self.sparse_score == "exact" and self.sparse_leak_free:
            raise ValueError("sparse_score='exact' scores a block with its own queries: it cannot be combined with "
                             "sparse_leak_free=True (sparse_score='rerank' can)")
        if self.sparse_candidate_pooling not in ("auto", *CANDIDATE_POOLINGS):
            raise ValueError(f"sparse_candidate_pooling={self.sparse_candidate_pooling!r} is not supported; use one "
                             f"of: {('auto', *CANDIDATE_POOLINGS)}")
        if self.sparse_candidate_pooling == "softmax_max" and self.resolved_sparse_score != "rerank":
            raise ValueError(f"sparse_candidate_pooling={self.sparse_candidate_pooling!r} pools rerank's candidates: "
                             f"it does not apply to sparse_score={self.resolved_sparse_score!r}")
        if self.sparse_normaliser_pages not in ("auto", None):
            if isinstance(self.sparse_normaliser_pages, bool) or not isinstance(self.sparse_normaliser_pages, int) \
                    or self.sparse_normaliser_pages < 1:
                raise ValueError(f"sparse_normaliser_pages must be a positive number of pages, 'auto' or None (every "
                                 f"history page); got {self.sparse_normaliser_pages!r}")
            if not self._summary_normaliser_runs:
                raise ValueError("sparse_normaliser_pages bounds the softmax_max pooling's normaliser of page summary "
                                 "scores: set sparse_candidate_pooling='softmax_max' (score rerank) or "
                                 f"sparse_pooling='softmax_max' (score minmax or mean) with it; got score "
                                 f"{self.resolved_sparse_score!r}, sparse_pooling={self.sparse_pooling!r}, "
                                 f"sparse_candidate_pooling={self.sparse_candidate_pooling!r}")
        if self.sparse_rerank_candidates not in RERANK_CANDIDATES:
            raise ValueError(f"sparse_rerank_candidates={self.sparse_rerank_candidates!r} is not supported; use one "
                             f"of: {RERANK_CANDIDATES}")
        if self.sparse_selection not in SPARSE_SELECTIONS:
            raise ValueError(
                f"sparse_selection={self.sparse_selection!r} is not supported; use one of: {SPARSE_SELECTIONS}"
            )
        if isinstance(self.offload_resident_layers, bool) or not isinstance(self.offload_resident_layers, int) \
                or self.offload_resident_layers < 0:
            raise ValueError(f"offload_resident_layers={self.offload_resident_layers!r} must be an integer >= 0")
        if self.stream_buffers < 2:
            raise ValueError(f"stream_buffers={self.stream_buffers} must be at least 2 (one computes, one loads)")
        if self.deterministic is True and self.backend == "cudnn":
            raise ValueError("deterministic=True conflicts with backend='cudnn' (cuDNN's attention backward is not "
                             "bitwise deterministic): use backend='triton' or 'auto', or deterministic=False")
        for name in ("checkpoint_layers", "recompute_logits", "fp32_grad_accumulation", "sparse_leak_free", "offload",
                     "deterministic", "keep_attention_outputs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.compile_layers is not None and not isinstance(self.compile_layers, bool):
            raise ValueError(f"compile_layers={self.compile_layers!r} must be True, False or None (automatic)")
        if self.compile_layers and self.checkpoint_layers:
            raise ValueError("compile_layers=True needs checkpoint_layers=False: a replayed layer runs inside "
                             "torch.utils.checkpoint, which does not compile, so stage 2 would recompute keys, "
                             "values and dropout masks differently from the compiled stage 1")
        if self.keep_attention_outputs and self.offload:
            raise ValueError("keep_attention_outputs=True needs offload=False: the kept outputs live on the GPU, "
                             "and the offloaded stage 2 stages its pages in the attention forward it would skip")
        resolve_dtype(self.kv_grad_dtype, "kv_grad_dtype")

    def _check_layer_options(self) -> None:
        budgets = self.sparse_layer_budgets
        if budgets is not None:
            if not isinstance(budgets, (list, tuple)) or any(
                    isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in budgets):
                raise ValueError(f"sparse_layer_budgets={budgets!r} must be a list of integers >= 0, one per layer")
            self.sparse_layer_budgets = list(budgets)
        layers = self.sparse_dense_layers
        if not isinstance(layers, (list, tuple, set, frozenset)) or any(
                isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
            raise ValueError(f"sparse_dense_layers={layers!r} must be a list of layer indices >= 0")
        self.sparse_dense_layers = sorted(set(layers))

    @property
    def resolved_sparse_score(self) -> str:
        """The score rule sparse mode runs: sparse_score, with "auto" resolved (rerank; minmax with a pooling
        other than max, which rerank does not take)."""
        if self.sparse_score != "auto":
            return self.sparse_score
        return "minmax" if self.sparse_pooling != "max" else "rerank"

    @property
    def resolved_sparse_candidate_pooling(self) -> str:
        """How rerank's candidates are pooled: sparse_candidate_pooling, with "auto" resolved (softmax_max with
        score rerank; "max", unused, otherwise)."""
        if self.sparse_candidate_pooling != "auto":
            return self.sparse_candidate_pooling
        return "softmax_max" if self.resolved_sparse_score == "rerank" else "max"

    @property
    def resolved_sparse_normaliser_pages(self) -> int | None:
        """The softmax_max normaliser's history pages: sparse_normaliser_pages, with "auto" resolved
        (NORMALISER_PAGES where the normaliser runs, None where none does)."""
        if self.sparse_normaliser_pages != "auto":
            return self.sparse_normaliser_pages
        return NORMALISER_PAGES if self._summary_normaliser_runs else None

    @property
    def _summary_normaliser_runs(self) -> bool:
        """Whether a softmax_max pooling normalises page summary scores."""
        score = self.resolved_sparse_score
        return ((score == "rerank" and self.resolved_sparse_candidate_pooling == "softmax_max")
                or (score in ("minmax", "mean") and self.sparse_pooling == "softmax_max"))

    @property
    def grad_dtype(self) -> torch.dtype:
        return resolve_dtype(self.kv_grad_dtype, "kv_grad_dtype")

    @classmethod
    def from_dict(cls, options: dict) -> OOMBConfig:
        """Build from a plain dict (YAML, CLI), rejecting unknown keys with the list of valid ones.
        ``sparse_plan``: the path of a plan written by `oomb calibrate`, whose options fill in those not given."""
        if options.get("sparse_plan"):  # a plan file from `oomb calibrate`: its options, then the explicit ones
            explicit = {k: v for k, v in options.items() if k != "sparse_plan"}
            options = {**load_sparse_plan(options["sparse_plan"]), **explicit}
        options = {k: v for k, v in options.items() if k != "sparse_plan"}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown OOMBConfig option(s) {unknown}; valid options: {sorted(known)}")
        return cls(**options)


def load_sparse_plan(path: str | Path) -> dict:
    """The OOMBConfig options of a sparse plan file (YAML or JSON, as `oomb calibrate` writes it)."""
    text = Path(path).read_text()
    plan = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if not isinstance(plan, dict) or not isinstance(plan.get("oomb"), dict):
        raise ValueError(f"{path}: not a sparse plan (expected a mapping with an 'oomb' section)")
    return plan["oomb"]
