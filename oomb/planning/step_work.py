"""The work of a training step and the least time each part can take: FLOPs and bytes over sustained rates.

benchmarks/profile_step.py measures where a step's GPU time goes; this says what each part costs at
the least, so that measured / floor shows which part has room. Counted per step (batch B, T tokens,
L layers, chunk C, page P, Hq query heads of dimension D), 2 FLOPs per multiply-add:

    GEMM       the decoder's linear layers: stage 1's forward, stage 2's forward, the replay (with
               checkpoint_layers each layer's forward runs again in backward) and the backward: dX
               (1 forward) and dW (1 forward) of trained weights. LoRA: the frozen base needs dX only;
               the adapters cost their own forward in every pass and 2 forwards in backward.
               Mode "hf": forward, gradient checkpointing's recompute, backward.
    attention  4 D Hq FLOPs per (query, visible key) pair per forward; two forwards (stage 1, stage 2:
               the replay reuses stage 2's output; hf: forward and recompute; one with
               keep_attention_outputs, stage 2 taking stage 1's) and a backward of 2.5
               forwards (its five matmuls against the forward's two). Dense: T (T + 1) / 2 pairs per
               layer and head; sparse: each query reads sinks + budget history pages while they do not
               cover its history, and its own chunk causally. Window layers see min(t + 1, window) keys.
    scoring    stage 1 of sparse mode, chunks whose history outgrows sinks + budget: summary scores
               are matmuls of every query row (Hq x P per block) with every history page's summary
               (width 2D for minmax, D for mean, 3D for rerank's minmax_mean candidates); rerank's
               (exact's) probabilities read each candidate (history) page's keys twice and the chunk's
               own causally: a Q K^T at the attention kernels' rate.
    loss       the LM head (forward, the checkpointed slice's recompute unless recompute_logits is off,
               dX, and dW when the head trains) and the logits' memory traffic: reading the bf16 logits
               in each of those passes and writing their gradient, 8 bytes per logit; oomb's fused loss
               (fused_loss): its kernel's 6 bytes per logit, and no recompute (a frozen head needs none; a
               trained head's weight gradient is made in the forward: weight_gradient_now; 8 bytes
               with a recompute, the forward's loss-only pass, where that is switched off).
    copies     K, V written to their pages once (stage 1); with offload, pinned-host <-> device traffic
               (stage 1: the chunk's K, V out, the history it reads in; stage 2: K, V in for the forward
               and again for the backward, dK, dV in and out), each direction at the host rate.

Left out: norms, rotary, activations and residual adds (no floor), selection bookkeeping (topk, sort),
packed documents and per-layer budgets; with offload, window layers count as global ones. Dense layers of
a sparse step (``sparse.dense_layers``) count as dense: every pair, no scoring, their whole history staged.
Sparse offload counts the least that can move: every query block and KV head of a chunk reading the same
pages.

Check against an earlier estimate ("about 7.6e16 FLOPs of linear layers for stage 1, stage 2, the
replay and the backward", Qwen2.5-7B, 1M tokens, sparse, full fine-tuning): this model counts 6.84e16
for the decoder's linear layers (5 passes x 2 x 6.53e9 weights x 2^20 tokens) plus 4.57e15 for the LM
head (4 passes: stage 1 does not compute the loss), 7.30e16 in all, 4 % below. 7.6e16 is what 5 passes
x 2 FLOPs x the model's 7.62e9 parameters x 1e6 tokens give, which counts the input embedding (a
lookup, not a matmul) and the head in all five passes, and 1M as 1e6: the two agree up to that.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from ..config import OffloadConfig, OOMBConfig, SparseConfig, read_share_budget
from .model_shape import ModelShape

H200_PEAK_BF16_FLOPS = 989e12
"""Dense bf16 tensor-core peak of the H200 SXM (the H100's; /work/.library/device/H200.md: "dense bf16
about 990 TFLOP/s" by the datasheet). No kernel of the step runs there: the floors use Rates."""

PARTS = ("GEMM", "attention", "scoring", "loss", "copies")
"""The parts of a step that have a floor, named as benchmarks/profile_step.py groups kernels."""

LOGIT_BYTES = 8
"""Memory traffic per logit (token x vocabulary entry) of the loss at the least: its bf16 value read in
the forward, the recompute and the backward, and its bf16 gradient written (4 x 2 bytes)."""

FUSED_LOGIT_BYTES = 6
"""The fused loss's kernel per logit: the bf16 logits read by its two passes, their gradient written."""

ATTENTION_BACKWARD_FORWARDS = 2.5
"""A flash-attention backward's five matmuls (S = Q K^T again, dV, dP, dQ, dK) against the forward's two."""


@dataclass(frozen=True)
class Rates:
    """Sustained rates the floors divide by (H200 defaults, bf16)."""

    matmul_flops: float = 790e12
    """GEMMs: what cuBLAS sustains on random bf16 data, below the 989 TFLOP/s peak. One 8192^3 matmul ran
    at 769-798 TFLOP/s on these machines, and the step's own GEMMs about as fast: the 64K sparse profile
    (profile_sparse_cudnn_64k_h200_2026-11-30.json) spent 4.77 s on 3.7e15 FLOPs of linear layers and LM
    head, about 780 TFLOP/s. A "practical" 700 would put that part below its floor."""
    attention_flops: float = 550e12
    """Fused attention: cuDNN on the H200 ran forward 567-595 and forward+backward 512-532 TFLOP/s over
    32K-128K histories (docs/kernels.md, "The cudnn backend"). A sustained rate, not a bound: a part
    can run a little faster (measured / floor slightly below 1)."""
    memory_bytes: float = 4.3e12
    """Device memory: 4.8 TB/s by the datasheet (H200.md); a device-to-device copy moved about 4.3 TB/s
    counting reads and writes (KINDS.md)."""
    host_bytes: float = 55e9
    """Pinned host <-> device copies, each way (measured on the H200 machine)."""


H200 = Rates()


@dataclass(frozen=True)
class Work:
    """What a part of the step computes and moves."""

    matmul_flops: float = 0.0
    """At the GEMM rate."""
    attention_flops: float = 0.0
    """At the fused-attention rate (flash-style kernels)."""
    memory_bytes: float = 0.0
    """Device-memory traffic outside the FLOP-bound kernels."""
    to_device_bytes: float = 0.0
    """Host -> device (offload)."""
    to_host_bytes: float = 0.0
    """Device -> host (offload)."""

    @property
    def flops(self) -> float:
        return self.matmul_flops + self.attention_flops

    def floor_seconds(self, rates: Rates) -> float:
        """The terms in sequence (separate kernels), except the two copy directions, which overlap."""
        return (self.matmul_flops / rates.matmul_flops + self.attention_flops / rates.attention_flops
                + self.memory_bytes / rates.memory_bytes
                + max(self.to_device_bytes, self.to_host_bytes) / rates.host_bytes)


@dataclass(frozen=True)
class StepSpec:
    """One step whose work is counted: the model's shape and the step's options."""

    shape: ModelShape
    tokens: int
    mode: Literal["hf", "dense", "sparse"] = "dense"
    batch_size: int = 1
    chunk_size: int = 4096
    page_size: int = 128
    checkpoint_layers: bool = True
    """oomb: stage 2 replays each layer's forward in backward (hf always checkpoints)."""
    lora_rank: int = 0
    """0: every weight trains (dW); r > 0: PEFT "all-linear" adapters of rank r, base and head frozen."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Where the pages live: with offload.enabled, host <-> device copies; resident_layers keep theirs."""
    kv_bytes: int = 2
    grad_bytes: int = 4
    sparse: SparseConfig = field(default_factory=SparseConfig)
    """Mode "sparse": the selection counted ("auto" options resolved as the step resolves them; dense layers
    counted as dense, per-layer budgets left out)."""
    recompute_logits: bool = True
    """The loss slices' logits are recomputed in backward (hf: oomb's chunked loss, always)."""
    keep_attention_outputs: bool = False
    """oomb: stage 2 takes stage 1's attention outputs: one attention forward per step, not two."""
    fused_loss: bool = False
    """The loss is oomb's fused one (loss.py): its kernel reads the logits twice and writes their gradient
    once (FUSED_LOGIT_BYTES), and a frozen head (LoRA) recomputes nothing."""

    def __post_init__(self) -> None:
        if self.mode not in ("hf", "dense", "sparse"):
            raise ValueError(f"mode={self.mode!r} must be 'hf', 'dense' or 'sparse'")
        if self.tokens <= 0 or self.batch_size <= 0:
            raise ValueError(f"tokens={self.tokens} and batch_size={self.batch_size} must be positive")
        if self.chunk_size % self.page_size:
            raise ValueError(f"chunk_size={self.chunk_size} must be a multiple of page_size={self.page_size}")

    @classmethod
    def from_config(cls, shape: ModelShape, tokens: int, config: OOMBConfig | None, *, batch_size: int = 1,
                    lora_rank: int = 0, dtype: torch.dtype = torch.bfloat16, fused_loss: bool = False) -> StepSpec:
        """The step ``config`` runs (None: plain HF with gradient checkpointing)."""
        if config is None:
            return cls(shape, tokens, "hf", batch_size, lora_rank=lora_rank, kv_bytes=dtype.itemsize)
        return cls(shape, tokens, config.attention, batch_size, chunk_size=config.chunk_size,
                   page_size=config.page_size, checkpoint_layers=config.performance.checkpoint_layers,
                   lora_rank=lora_rank,
                   offload=config.offload, kv_bytes=dtype.itemsize, grad_bytes=config.precision.grad_dtype.itemsize,
                   sparse=config.sparse.resolved(shape.num_layers, shape.window_layer_ids()),
                   recompute_logits=config.performance.recompute_logits,
                   fused_loss=fused_loss, keep_attention_outputs=config.performance.keep_attention_outputs)

    def chunks(self) -> Iterator[tuple[int, int]]:
        """(start, length) of each chunk; hf: the whole sequence at once."""
        size = self.tokens if self.mode == "hf" else self.chunk_size
        for start in range(0, self.tokens, size):
            yield start, min(size, self.tokens - start)

    def read_pages(self, start: int) -> int | None:
        """History pages each query block of the chunk at ``start`` reads; None: all of them (dense)."""
        n_hist = start // self.page_size
        budget = read_share_budget(self.sparse.budget, self.sparse.resolved_read_share, n_hist)
        if self.mode != "sparse" or self.sparse.sink_pages + budget >= n_hist:
            return None
        return self.sparse.sink_pages + budget

    def rerank_candidates(self, start: int) -> int:
        """History pages the "rerank" score reads per query block of the chunk at ``start``: rerank_factor x the
        budget there (grown by the read share, as the step's candidate_options does), the sinks besides, at most
        the whole history: with a read share of 1 / rerank_factor or more, every history page."""
        n_hist = start // self.page_size
        budget = read_share_budget(self.sparse.budget, self.sparse.resolved_read_share, n_hist)
        return min(n_hist, self.sparse.sink_pages + self.sparse.research.rerank_factor * budget)


def linear_macs_per_token(shape: ModelShape) -> int:
    """Multiply-adds of the decoder's linear layers per token: q, k, v, o and the MLP (an MoE layer's
    router, routed experts and shared expert); biases and the LM head left out."""
    h = shape.hidden_size
    attention = 2 * h * shape.q_dim + 2 * h * shape.kv_dim
    dense_mlp = 3 * h * shape.intermediate_size
    moe_mlp = (shape.experts_per_token * 3 * h * shape.expert_intermediate_size + shape.num_experts * h
               + 3 * h * shape.shared_expert_intermediate_size)
    return shape.num_layers * attention + (shape.num_layers - shape.moe_layers) * dense_mlp + shape.moe_layers * moe_mlp


def linear_flops(spec: StepSpec) -> dict[str, float]:
    """FLOPs of the decoder's linear layers by pass (the GEMM part is their sum)."""
    tokens = spec.batch_size * spec.tokens
    base = 2.0 * tokens * linear_macs_per_token(spec.shape)
    lora = 2.0 * tokens * spec.shape.lora_params(spec.lora_rank) if spec.lora_rank else 0.0
    forward = base + lora
    backward = base * (1 if spec.lora_rank else 2) + 2 * lora  # dX (+ dW when the base trains); adapters
    if spec.mode == "hf":
        return {"forward": forward, "recompute": forward, "backward": backward}
    passes = {"stage 1": forward, "stage 2": forward}
    if spec.checkpoint_layers:
        passes["replay"] = forward
    return {**passes, "backward": backward}


def _window_pairs(tokens: int, window: int) -> int:
    """Sum over positions t < tokens of min(t + 1, window)."""
    w = min(window, tokens)
    return w * (w + 1) // 2 + (tokens - w) * w


def visible_pairs(spec: StepSpec) -> int:
    """(query, key) pairs one global layer's head computes in one forward of one sequence."""
    pairs = 0
    for start, length in spec.chunks():
        pages = spec.read_pages(start)
        history = start if pages is None else pages * spec.page_size
        pairs += length * history + length * (length + 1) // 2
    return pairs


def dense_layer_indices(spec: StepSpec) -> list[int]:
    """The global layers of a sparse step that read every page (``sparse.dense_layers``; a sliding-window layer
    reads its window whatever the setting)."""
    if spec.mode != "sparse":
        return []
    sliding = spec.shape.window_layer_ids()
    dense = spec.sparse.resolved_dense_layers(spec.shape.num_layers, sliding)
    return [layer for layer in dense if layer < spec.shape.num_layers and layer not in sliding]


def as_dense(spec: StepSpec) -> StepSpec:
    """The same step with every page read: a dense layer of a sparse step."""
    return replace(spec, mode="dense")


def attention_work(spec: StepSpec) -> Work:
    shape = spec.shape
    window_layers = shape.sliding_window_layers
    dense = len(dense_layer_indices(spec))
    pairs = ((shape.num_layers - window_layers - dense) * visible_pairs(spec)
             + (dense * visible_pairs(as_dense(spec)) if dense else 0)
             + window_layers * (_window_pairs(spec.tokens, shape.sliding_window) if window_layers else 0))
    forward = 4.0 * shape.head_dim * shape.num_heads * spec.batch_size * pairs
    forwards = 1 if spec.keep_attention_outputs and spec.mode != "hf" else 2
    return Work(attention_flops=forward * (forwards + ATTENTION_BACKWARD_FORWARDS))


def _summary_width(spec: StepSpec) -> int:
    """Columns of a query row's summary-score matmul: minmax's [relu(q), min(q, 0)] is 2D wide."""
    widths = {"minmax": 2, "mean": 1, "minmax_mean": 3}
    score = spec.sparse.resolved_score
    rule = spec.sparse.research.rerank_candidates if score == "rerank" else score
    return widths.get(rule, 0) * spec.shape.head_dim


def scoring_work(spec: StepSpec) -> Work:
    """Stage 1's selection scores of every global layer (zero outside sparse mode)."""
    if spec.mode != "sparse":
        return Work()
    shape, P, D = spec.shape, spec.page_size, spec.shape.head_dim
    matmul = probabilities = 0.0
    for start, length in spec.chunks():
        if spec.read_pages(start) is None:
            continue
        n_hist, n_blocks = start // P, -(-length // P)
        rows = shape.num_heads * n_blocks * (P + 1 if spec.sparse.leak_free else P)
        rerank = spec.sparse.resolved_score == "rerank"
        pooling = spec.sparse.resolved_candidate_pooling if rerank else spec.sparse.research.pooling
        width = 2.0 * rows * _summary_width(spec)
        if pooling == "softmax_max" and spec.sparse.leak_free:  # torch: one product over history and own pages
            matmul += width * (n_hist + n_blocks)
        else:
            matmul += width * n_hist
            if pooling == "softmax_max":  # the kernel's first pass: each row's normaliser, own pages included
                bound = spec.sparse.resolved_normaliser_pages
                counted = n_hist if bound is None else min(n_hist, spec.sparse.sink_pages + bound)
                matmul += width * (counted + n_blocks)
        if spec.sparse.resolved_score in ("rerank", "exact"):
            scored = n_hist if spec.sparse.resolved_score == "exact" else spec.rerank_candidates(start)
            passes = 2 if spec.sparse.resolved_score == "exact" else 1  # rerank keeps its listed pages' log-masses
            queries = n_blocks * (P + 1) if spec.sparse.leak_free else length
            keys = queries * passes * scored * P + length * (length + 1) // 2  # the scored pages, the chunk
            probabilities += 2.0 * D * shape.num_heads * keys
    layers = spec.batch_size * (shape.num_layers - shape.sliding_window_layers - len(dense_layer_indices(spec)))
    return Work(matmul_flops=layers * matmul, attention_flops=layers * probabilities)


def loss_work(spec: StepSpec) -> Work:
    """The LM head's matmuls and the logits' traffic (stage 2 only, every position counted)."""
    tokens = spec.batch_size * spec.tokens
    vocab = spec.shape.head_vocab
    # The engine's fused loss recomputes nothing: a frozen head needs none, a trained head's weight gradient is
    # made in the forward (chunked_cross_entropy's weight_gradient_now)
    fused = spec.fused_loss and spec.mode != "hf"
    recompute = spec.recompute_logits and not fused
    passes = 2 + recompute + (0 if spec.lora_rank else 1)  # forward, (recompute,) dX (+ dW)
    per_logit = LOGIT_BYTES
    if fused:  # its kernel; a trained head's recompute reads them once more
        per_logit = FUSED_LOGIT_BYTES + (2 if recompute and not spec.lora_rank else 0)
    return Work(matmul_flops=2.0 * tokens * spec.shape.hidden_size * vocab * passes,
                memory_bytes=float(tokens * vocab * per_logit))


def copies_work(spec: StepSpec) -> Work:
    """Page writes; with offload, the host <-> device traffic of the offloaded layers (hf: none)."""
    shape = spec.shape
    if spec.mode == "hf":
        return Work()
    per_token = 2 * shape.num_kv_heads * shape.head_dim  # K and V (or dK and dV) values per token and layer
    kv, grad = per_token * spec.kv_bytes, per_token * spec.grad_bytes
    writes = float(spec.batch_size * spec.tokens * shape.num_layers * kv)
    if not spec.offload.enabled:
        return Work(memory_bytes=writes)
    resident = min(spec.offload.resident_layers, shape.num_layers)  # the first layers keep their pages on the GPU
    offloaded_dense = sum(layer >= resident for layer in dense_layer_indices(spec))
    offloaded = shape.num_layers - resident
    sparse_device, sparse_host = _offloaded_layer_copies(spec, kv, grad)
    dense_device, dense_host = _offloaded_layer_copies(as_dense(spec), kv, grad) if offloaded_dense else (0, 0)
    sparse_layers, batch = offloaded - offloaded_dense, spec.batch_size
    return Work(memory_bytes=writes * resident / shape.num_layers,
                to_device_bytes=float(batch * (sparse_layers * sparse_device + offloaded_dense * dense_device)),
                to_host_bytes=float(batch * (sparse_layers * sparse_host + offloaded_dense * dense_host)))


def _offloaded_layer_copies(spec: StepSpec, kv: int, grad: int) -> tuple[int, int]:
    """Bytes one offloaded layer moves to the device and to the host in a step (one sequence)."""
    to_device = to_host = grad_stores = last_start = 0
    for start, length in spec.chunks():
        pages = spec.read_pages(start)
        history = start if pages is None else pages * spec.page_size  # tokens staged per call
        scoring = 0
        if pages is not None and spec.sparse.resolved_score == "rerank":  # candidates' keys, for stage 1's scores
            scoring = spec.rerank_candidates(start) * spec.page_size * kv // 2
        to_host += length * kv + history * grad  # stage 1's K, V; stage 2's dK, dV of the history
        to_device += history * kv + scoring + 2 * (history + length) * kv
        grad_stores += history
        last_start = start
    # Stage 2 loads a page's dK, dV except in the first backward that touches it; the first chunk it runs
    # (the last) touches its whole history first, later chunks at most nothing new.
    to_device += max(0, grad_stores - last_start) * grad
    return to_device, to_host


def step_work(spec: StepSpec) -> dict[str, Work]:
    """The work of each part of PARTS."""
    return {"GEMM": Work(matmul_flops=sum(linear_flops(spec).values())), "attention": attention_work(spec),
            "scoring": scoring_work(spec), "loss": loss_work(spec), "copies": copies_work(spec)}


def floors(spec: StepSpec, rates: Rates = H200) -> dict[str, float]:
    """Seconds of each part at ``rates``."""
    return {part: work.floor_seconds(rates) for part, work in step_work(spec).items()}
