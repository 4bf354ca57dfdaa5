"""Predicted GPU and host memory of one training step, before anything is allocated (docs/benchmarks.md,
"`oomb plan`: the memory model").

    GPU memory of a step = weights + parameter gradients (+ fp32 gradient sums) + optimizer state
                         + one chunk's activations (+ one logits slice) + KV working set
                         + page summaries + page tables
    host RAM             = the process itself + (with offload) K, V and dK, dV pages of every token
                           (window layers: of their window slots)
                           (+ sparse: the stored page selections of the offloaded layers)

Five modes are modelled: plain Hugging Face ("hf": SDPA + gradient checkpointing + chunked loss, for
comparison) and oomb's dense/sparse attention with host offload off/on. Only the pages (and, in sparse
mode, their summaries) grow with the context in oomb; in "hf" the stored layer inputs and one layer's
activations for the whole sequence do. Every assumption is a named constant or a field below.

Calibration (standard workload of docs/benchmarks.md, H200, benchmarks/results/step_h200_2026-11-29*.json):
peak GPU memory above the weights predicted vs measured, oomb dense 39.5 / 60.5 GiB vs 39.9 / 60.9 GiB
at 128K / 256K; hf 22.9 / 32.8 / 64.2 GiB vs 22.7 / 32.7 / 64.2 GiB at 32K / 64K / 128K. Qwen2.5-0.5B
shape at 8K / 16K: dense 3.5 / 3.8 GiB vs 3.6 / 3.9, hf 2.3 / 2.7 GiB vs 2.4 / 2.8.

The model's shape is a ModelShape (oomb/planning/model_shape.py); what a step's activations take per token, and the
constants those terms assume, are in oomb/planning/activations.py. Both are re-exported here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Literal

import torch

from ..config import OffloadConfig, OOMBConfig, SparseConfig, read_share_budget
from ..context_parallel import ContextShard
from ..kv import PagedKVStore, capacity
from ..kv.store import window_pages_per_sequence
from ..kv.summaries import summaries_of
from .activations import (
    FP32_BYTES,
    LOGITS_FP32_COPIES,
    MOE_ROUTED_ROW_INDEX_BYTES,
    MOE_ROUTED_ROW_SAVED_HIDDEN,
    ROUTER_SAVED_FP32_PER_EXPERT,
    all_layers_activation_bytes_per_token,
    chunk_activation_bytes,
    compiled_saving_bytes_per_token,
    layer_activation_bytes_per_token,
    logits_slice_bytes,
    max_layer_activation_bytes_per_token,
    mlp_activation_bytes_per_token,
    paged_backward_workspace_per_token,
    recompute_cache_bytes_per_token,
    saved_logits_bytes,
    sdpa_backward_workspace_per_token,
)
from .model_shape import GPT_OSS_ROUTED_ROW_SAVED_INTERMEDIATE, MOE_ROUTED_ROW_SAVED_INTERMEDIATE, ModelShape

__all__ = [
    # defined here
    "ADAMW_STATE_BYTES", "GIB", "GPU_TERMS", "HOST_PROCESS_BYTES", "HOST_TERMS", "INT32_BYTES", "LORA_PARAM_BYTES",
    "MASTER_WEIGHT_BYTES", "MIB", "MODES", "MemoryPrediction", "Mode",
    "StepMemory", "TrainingSetup", "context_parallel_tokens", "estimate_step_memory", "predict",
    # re-exported from model_shape
    "GPT_OSS_ROUTED_ROW_SAVED_INTERMEDIATE", "MOE_ROUTED_ROW_SAVED_INTERMEDIATE", "ModelShape",
    # re-exported from activations
    "FP32_BYTES", "LOGITS_FP32_COPIES", "MOE_ROUTED_ROW_INDEX_BYTES", "MOE_ROUTED_ROW_SAVED_HIDDEN",
    "ROUTER_SAVED_FP32_PER_EXPERT", "all_layers_activation_bytes_per_token", "chunk_activation_bytes",
    "compiled_saving_bytes_per_token", "layer_activation_bytes_per_token", "logits_slice_bytes",
    "max_layer_activation_bytes_per_token", "mlp_activation_bytes_per_token", "paged_backward_workspace_per_token",
    "recompute_cache_bytes_per_token", "sdpa_backward_workspace_per_token",
]

GIB = 1024**3
MIB = 1024**2

INT32_BYTES = 4

ADAMW_STATE_BYTES = 8
"""AdamW keeps two fp32 moments (exp_avg, exp_avg_sq) per fp32 parameter or master (torch.optim.AdamW
makes them in the dtype of what it steps: 2 x 2 bytes for a bf16 parameter without a master)."""

MASTER_WEIGHT_BYTES = 4
"""An fp32 master copy per trainable low-precision parameter (mixed-precision optimizers)."""

LORA_PARAM_BYTES = 4
"""PEFT creates LoRA adapters in fp32 next to bf16/fp16 base weights (``autocast_adapter_dtype=True``)."""

HOST_PROCESS_BYTES = 2 * GIB
"""Resident memory of the training process itself (Python, torch, CUDA libraries, tokenizer, data),
outside the KV pages. Weights are assumed loaded straight to the GPU."""


@dataclass(frozen=True)
class StepMemory:
    """Bytes of each term above the weights (and optimizer state, which oomb does not own)."""

    param_grads: int
    chunk_activations: int
    kv_pages: int
    logits_slice: int
    kept_attention: int = 0
    """performance.keep_attention_outputs: every layer's attention output and lse, from stage 1 to stage 2."""

    @property
    def total(self) -> int:
        return self.param_grads + self.chunk_activations + self.kv_pages + self.logits_slice + self.kept_attention

    def as_gib(self) -> dict:
        return {k: round(v / GIB, 2) for k, v in {**asdict(self), "total": self.total}.items()}


def estimate_step_memory(
    shape: ModelShape,
    num_tokens: int,
    config: OOMBConfig,
    *,
    batch_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    trainable_params: int = 0,
    fp32_targets: bool = False,
    context_parallel: int = 1,
    fused_loss: bool = False,
    head_trained: bool = True,
) -> StepMemory:
    """Predicted GPU bytes of one oomb dense step above weights and optimizer state.

    ``trainable_params`` (of ``dtype``) get gradients. When ``config.precision.fp32_grad_accumulation`` is on
    and ``dtype`` is low precision, they get fp32 sums instead, and only the parameters outside linear
    layers a low-precision ``.grad`` per chunk (a conservative count for LoRA). ``fp32_targets``: the
    caller's fp32 tensors receive the gradients (a trainer's master weights, counted by the caller):
    no sums, and the same few low-precision ``.grad``. With ``config.offload.enabled``
    the pages term is the GPU working set (resident layers, staging buffers, one chunk's pages).
    ``context_parallel``: ranks sharing the sequence; the pages of the busiest one. ``fused_loss``: the
    step's loss is the fused one (TrainingSetup.fused_loss), whose LM head is trained (``head_trained``)
    or frozen.
    """
    chunk = min(config.chunk_size, num_tokens) * batch_size
    own_tokens = context_parallel_tokens(num_tokens, config.chunk_size, config.page_size, context_parallel)
    kv = PagedKVStore.bytes_needed(
        num_layers=shape.num_layers, batch_size=batch_size, num_tokens=own_tokens,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, page_size=config.page_size,
        kv_dtype=dtype, grad_dtype=config.precision.grad_dtype,
    )
    if config.offload.enabled:
        pages = _num_pages(own_tokens, config.page_size, batch_size)
        chunk_pages = _num_pages(min(config.chunk_size, num_tokens), config.page_size, batch_size)
        kv = _dense_offload_gpu_pages(shape.num_layers, pages, chunk_pages, batch_size, config.offload)
        kv *= _page_bytes(shape, config.page_size, dtype, config.precision.grad_dtype)
    grads = trainable_params * dtype.itemsize
    if dtype.itemsize < FP32_BYTES and (config.precision.fp32_grad_accumulation or fp32_targets):
        grads = shape.low_precision_grad_params(trainable_params) * dtype.itemsize
        if not fp32_targets:
            grads += trainable_params * FP32_BYTES
    chunk_len = min(config.chunk_size, num_tokens)
    fused = dtype if fused_loss else None
    perf = config.performance
    logits = (logits_slice_bytes(shape, chunk_len, batch_size, perf.loss_chunk_tokens, fused)
              + saved_logits_bytes(shape, chunk_len, batch_size, perf.recompute_logits, fused, head_trained,
                                   weight_gradient_now=fused_loss))
    kept = kept_attention_bytes(shape, num_tokens, batch_size, dtype) if perf.keep_attention_outputs else 0
    return StepMemory(grads, chunk_activation_bytes(shape, chunk, config, dtype), kv, logits, kept)


def kept_attention_bytes(shape: ModelShape, num_tokens: int, batch_size: int, dtype: torch.dtype) -> int:
    """GPU bytes of performance.keep_attention_outputs: every layer's attention output (``dtype``) and float32
    log-sum-exp for every token and query head, held from stage 1 until stage 2 takes them."""
    return batch_size * num_tokens * shape.num_layers * shape.num_heads * (shape.head_dim * dtype.itemsize
                                                                            + FP32_BYTES)


# ---------------------------------------------------------------------------------------------
# The planner's model: every mode, GPU and host
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Mode:
    """One way of running the step."""

    name: str
    attention: Literal["hf", "dense", "sparse"]
    offload: bool
    description: str


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("hf", "hf", False, "plain Hugging Face: SDPA + gradient checkpointing + chunked LM-head loss"),
    Mode("dense", "dense", False, "oomb dense: exact attention, all pages on the GPU"),
    Mode("dense+offload", "dense", True, "oomb dense, pages in pinned host memory streamed through the GPU"),
    Mode("sparse", "sparse", False, "oomb sparse: top-k pages per query block, all pages on the GPU"),
    Mode("sparse+offload", "sparse", True, "oomb sparse, pages on the host, only selected pages moved"),
)}


@dataclass(frozen=True)
class TrainingSetup:
    """What trains and how: everything besides the step's own options (OOMBConfig)."""

    dtype: torch.dtype = torch.bfloat16
    """Dtype of the weights, activations and K/V pages."""
    batch_size: int = 1
    """Sequences per step."""
    optimizer: Literal["adamw", "none"] = "adamw"
    """"adamw": two fp32 moments per trainable parameter; "none": a bare forward+backward (benchmarks)."""
    master_weights: bool = False
    """Keep an fp32 master copy of low-precision trainable parameters (4 bytes each)."""
    lora_rank: int = 0
    """0: full fine-tuning. r > 0: LoRA of rank r on every linear projection, base weights frozen."""
    context_parallel: int = 1
    """Ranks sharing each sequence (oomb/context_parallel.py): each holds the pages of every cp-th
    chunk (on the GPU, or with offload in its host memory); the busiest one (rank 0, which holds chunk
    0) is planned. Sparse page summaries and selections are kept for every chunk on every rank. Every
    oomb mode; not plain HF."""
    fused_loss: bool = False
    """The step's LM-head loss may be oomb's fused one (loss.fused_head: a plain bias-free linear head, one
    process): counted so (activations.logits_slice_bytes, saved_logits_bytes). False counts autograd's
    loss: never less than a step uses."""
    compiled_layers: bool = False
    """The step runs its decoder layers compiled (oomb/compiled_layers.py: OOMBConfig.performance.compile_layers as the
    step resolves it for the machine and the model); they keep fewer activations without layer replay
    (activations.compiled_saving_bytes_per_token), counted for full fine-tuning with bf16 ``.grad`` and for
    LoRA with float32 adapters (what this model assumes for LoRA), not where linear layers' gradients go to
    float32 sums (their graphs break there and keep more). False counts the eager layers: never less than
    a step uses."""

    def __post_init__(self) -> None:
        if not isinstance(self.context_parallel, int) or self.context_parallel < 1:
            raise ValueError(f"context_parallel={self.context_parallel!r} must be an integer >= 1")
        if self.batch_size <= 0:
            raise ValueError(f"batch_size={self.batch_size} must be a positive integer")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank={self.lora_rank} must be >= 0 (0 = full fine-tuning)")
        if self.optimizer not in ("adamw", "none"):
            raise ValueError(f"optimizer={self.optimizer!r} is not supported; use 'adamw' or 'none'")


def sparse_pages_read(sparse: SparseConfig, tokens: int, page_size: int) -> int:
    """Pages a query block reads besides its chunk (sinks + budget) at the longest history of ``tokens``:
    with a read share the budget grows with the history, and memory is sized for its largest."""
    return read_share_budget(sparse.budget, sparse.resolved_read_share, -(-tokens // page_size)) + sparse.sink_pages


@lru_cache(maxsize=4096)  # the chooser asks the same few (config, length) pairs for thousands of candidates
def selection_bytes(sparse: SparseConfig, tokens: int, chunk_size: int, page_size: int, batch: int, kv_heads: int,
                    layer: int = 0) -> int:
    """Bytes of ``layer``'s stage-1 selections over a step of ``tokens``, all kept until stage 2 (oomb/sparse.py):
    a chunk whose history the sinks and budget cover reads it densely (no selection); any other keeps, per
    sequence and KV head, one row of int32 pages per query block, or a single row when one group of
    query_block_pages covers the chunk (a stride-0 view over its blocks). The budget is the chunk's own
    (sparse.read_share grows it with the history)."""
    chunk_pages = -(-chunk_size // page_size)
    shared = sparse.query_block_pages >= chunk_pages
    entries = 0
    for start in range(0, tokens, chunk_size):
        history = start // page_size
        selected = sparse.num_selected(history, layer)
        if selected < history:
            blocks = -(-min(chunk_size, tokens - start) // page_size)
            entries += (1 if shared else blocks) * selected
    return entries * batch * kv_heads * INT32_BYTES


def summary_vectors(sparse: SparseConfig) -> int:
    """Vectors summarising a page per KV head and layer for ``sparse``'s score (2 for Quest's min/max key)."""
    return len(summaries_of(sparse.resolved_score, sparse.research.rerank_candidates))


@dataclass(frozen=True)
class MemoryPrediction:
    """Predicted peak bytes of one step, by term."""

    mode: str
    tokens: int
    gpu: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    @property
    def gpu_above_weights(self) -> int:
        return self.gpu_total - self.gpu["weights"]

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


GPU_TERMS = ("weights", "param grads", "fp32 grad sums", "optimizer", "activations", "kept attention",
             "KV working set", "page summaries", "page tables")
HOST_TERMS = ("process", "KV pages", "KV grad pages", "selections")


def context_parallel_tokens(tokens: int, chunk_size: int, page_size: int, cp: int) -> int:
    """Token slots (whole pages) of a sequence whose pages the busiest of ``cp`` context-parallel ranks
    holds: rank 0, with chunks 0, cp, 2 cp, ... (``tokens`` itself when cp is 1)."""
    if cp == 1:
        return tokens
    return ContextShard(0, cp, chunk_size).owned_pages(tokens, page_size) * page_size


def _num_pages(tokens: int, page_size: int, batch_size: int) -> int:
    return batch_size * -(-tokens // page_size)


def _dense_offload_gpu_pages(num_layers: int, pages: int, chunk_pages: int, batch_size: int,
                             offload: OffloadConfig, history_pages: int | None = None) -> int:
    """Pages dense offload keeps on the GPU (kv/offload.py): the resident layers' pools, the staging
    slots (a block or a chunk per sequence each) and one chunk's own K, V (stage 1) or dK, dV (stage 2).
    ``history_pages``: the most history pages per sequence one window stages, when fewer than a block
    (every layer slides: its window's pages; OffloadedKVStore.history_block_pages)."""
    slots = _staging_slot_pages(chunk_pages, batch_size, offload, history_pages)
    return min(offload.resident_layers, num_layers) * pages + slots + 2 * chunk_pages


def _staging_slot_pages(chunk_pages: int, batch_size: int, offload: OffloadConfig,
                        history_pages: int | None = None) -> int:
    """Pages of OffloadedKVStore's GPU staging slots (each a streamed block, or a chunk, per sequence),
    allocated in dense and sparse mode alike: sparse chunks whose budget covers their history stream as
    dense ones do."""
    block = offload.stream_block_pages if history_pages is None else min(offload.stream_block_pages, history_pages)
    return offload.stream_buffers * batch_size * max(block, chunk_pages // batch_size)


def _page_bytes(shape: ModelShape, page_size: int, dtype: torch.dtype, grad_dtype: torch.dtype) -> int:
    """K, V, dK, dV of one page in one layer."""
    return 2 * shape.kv_dim * page_size * (dtype.itemsize + grad_dtype.itemsize)


def _hf_activations(shape: ModelShape, tokens: int, setup: TrainingSetup, config: OOMBConfig,
                    layer_grad: int, head_grad: int, all_grads: int) -> int:
    """Peak bytes of a plain HF step beyond the full parameter gradients (never below zero).

    With gradient checkpointing each layer's input (T x hidden) is stored in forward; in backward,
    layer j recomputes its activations for all T tokens while layers > j already hold their
    gradients and layers <= j still hold their inputs. The peak is at the first or the last layer's
    backward (the profile is linear in j), or at the loss.
    """
    t = tokens * setup.batch_size
    b = setup.dtype.itemsize
    stored = t * shape.hidden_size * b  # one layer's checkpointed input
    layer = (max_layer_activation_bytes_per_token(shape, setup.dtype)
             + sdpa_backward_workspace_per_token(shape, setup.dtype)) * t
    flow = 2 * stored  # the residual stream's gradient entering and leaving the layer
    L = shape.num_layers
    first_layer_backward = head_grad + layer_grad + L * stored + layer + flow
    last_layer_backward = head_grad + L * layer_grad + stored + layer + flow
    loss = head_grad + L * stored + flow + logits_slice_bytes(shape, tokens, setup.batch_size,
                                                              config.performance.loss_chunk_tokens)
    return max(0, max(first_layer_backward, last_layer_backward, loss) - all_grads)


def predict(
    mode: str | Mode,
    shape: ModelShape,
    tokens: int,
    config: OOMBConfig | None = None,
    setup: TrainingSetup | None = None,
) -> MemoryPrediction:
    """Predicted peak GPU bytes and host bytes of one step of ``mode`` on ``tokens`` tokens per sequence.

    Args:
        mode: a name of MODES ("hf", "dense", "dense+offload", "sparse", "sparse+offload").
        shape: the model's dimensions.
        tokens: context length T (tokens per sequence).
        config: oomb's step options (chunk, page, KV gradient dtype, checkpointing, loss slice, the sparse
            section the sparse modes are sized by and the offload section the offloaded modes are: resident
            layers, streamed blocks; its ``enabled`` is not read, ``mode`` says where the pages live).
        setup: dtype, batch, optimizer, LoRA.
    Returns:
        A MemoryPrediction with the GPU_TERMS and HOST_TERMS in bytes.

    Sliding-window layers (Gemma 2/3, gpt-oss, Mistral; ``shape.sliding_window_layers``) with a window
    W shorter than the step have their own pages without offload and context parallelism (kv/store.py):
    at most the tails of the chunks before the current one (their last W - 1 keys, which later chunks'
    windows read in both stages, rounded up to pages and at most the chunk) plus the current chunk, so
    a window layer costs about (W - 1) / C of a global layer's pages per token (no saving when W - 1 >= C),
    and no page summaries. With offload the offloaded window layers keep the same count of pages in
    host slots (kv/window_slots.py; resident window layers keep every page on the GPU, like global
    ones), stage only the ceil((W - 1) / P) pages before a chunk that its window overlaps (kv/offload.py;
    when every layer slides the staging slots shrink to that, or to a chunk), and keep no page summaries
    either. Under context parallelism they are global layers.
    (oomb's speed estimates do not count attention FLOPs, so windows change no speed prediction.)

    Mixtures of experts (``shape.num_experts``): weights, gradients and optimizer state count every
    expert; a chunk's activations count its tokens' top-k routed expert rows (MOE_ROUTED_ROW_*).
    With fp32 gradient sums the experts and routers keep a low-precision ``.grad`` during stage 2
    (they are not nn.Linear: ModelShape.non_linear_params).
    """
    mode = MODES[mode] if isinstance(mode, str) else mode
    config = config or OOMBConfig()
    setup = setup or TrainingSetup()
    offload = config.offload
    sparse = config.sparse.resolved(shape.num_layers, shape.window_layer_ids())
    if tokens <= 0:
        raise ValueError(f"tokens={tokens} must be a positive integer")
    if setup.context_parallel > 1 and mode.attention == "hf":
        raise ValueError(f"mode {mode.name!r} with context parallelism (cp={setup.context_parallel}) is not "
                         "supported: context parallelism is oomb's (dense or sparse, with or without offload)")
    b = setup.dtype.itemsize
    B, P, L = setup.batch_size, config.page_size, shape.num_layers
    low_precision = b < FP32_BYTES

    # Parameters, gradients, optimizer.
    if setup.lora_rank:
        trainable = shape.lora_params(setup.lora_rank)
        weights = shape.num_params() * b + trainable * LORA_PARAM_BYTES
        grad_bytes, trainable_low_precision = LORA_PARAM_BYTES, False
        layer_grad = trainable // L * grad_bytes
        head_grad = 0
    else:
        trainable = shape.num_params()
        weights = trainable * b
        grad_bytes, trainable_low_precision = b, low_precision
        layer_grad = max(shape.layer_params(moe) for moe in shape.layer_kinds()) * b
        head_grad = shape.head_vocab * shape.hidden_size * b
    grads = trainable * grad_bytes
    optimizer = 0
    if setup.optimizer == "adamw":
        # Its two moments take the dtype of what it steps: fp32 masters, else the parameters.
        mastered = setup.master_weights or not trainable_low_precision
        optimizer += trainable * (ADAMW_STATE_BYTES if mastered else 2 * grad_bytes)
    if setup.master_weights and trainable_low_precision:
        optimizer += trainable * MASTER_WEIGHT_BYTES
    gpu = dict.fromkeys(GPU_TERMS, 0)
    gpu.update({"weights": weights, "param grads": grads, "optimizer": optimizer})
    host = dict.fromkeys(HOST_TERMS, 0)
    host["process"] = HOST_PROCESS_BYTES

    if mode.attention == "hf":
        gpu["activations"] = _hf_activations(shape, tokens, setup, config, layer_grad, head_grad, grads)
        return MemoryPrediction(mode.name, tokens, gpu, host)

    # oomb: one chunk's activations and logits slice, whatever the context.
    chunk_len = min(config.chunk_size, tokens)
    if config.precision.fp32_grad_accumulation and trainable_low_precision:
        # Linear layers' gradients go to the fp32 sums directly (oomb/fp32_linear.py, not under TP):
        # during stage 2 only the embedding's and norms' gradients pass through a low-precision .grad.
        gpu["fp32 grad sums"] = trainable * FP32_BYTES
        gpu["param grads"] = shape.low_precision_grad_params(trainable) * grad_bytes
    # Linear layers whose gradients go to float32 sums (fp32_linear.py) break the compiled graphs: the MLP's
    # product is then saved after all, so nothing of the compiled saving is counted there.
    compiled = setup.compiled_layers and not (config.precision.fp32_grad_accumulation and trainable_low_precision)
    if compiled:  # a compiled backward returns its layer's weight gradients together, before autograd adds them
        gpu["param grads"] += layer_grad
    fused = setup.dtype if setup.fused_loss else None
    gpu["activations"] = (chunk_activation_bytes(shape, chunk_len * B, config, setup.dtype, compiled)
                          + logits_slice_bytes(shape, chunk_len, B, config.performance.loss_chunk_tokens, fused)
                          + saved_logits_bytes(shape, chunk_len, B, config.performance.recompute_logits, fused,
                                               head_trained=not setup.lora_rank,
                                               weight_gradient_now=setup.fused_loss))
    pages = _num_pages(tokens, P, B)  # pages of one layer
    # Context parallel: the pages of the busiest rank's chunks (all of them without it).
    own_tokens = context_parallel_tokens(tokens, config.chunk_size, P, setup.context_parallel)
    own_pages = _num_pages(own_tokens, P, B)
    page_bytes = _page_bytes(shape, P, setup.dtype, config.precision.grad_dtype)  # K, V, dK, dV, one layer
    gpu["page tables"] = pages * INT32_BYTES
    if config.performance.keep_attention_outputs:  # every layer's (out, lse) of the step's tokens, from stage 1 on
        if mode.offload or setup.context_parallel > 1:
            raise ValueError("performance.keep_attention_outputs=True runs without offload and context parallelism")
        gpu["kept attention"] = kept_attention_bytes(shape, tokens, B, setup.dtype)
    # Window layers shorter than the step (not under context parallelism) read, keep summaries of and,
    # without offload, keep pages of their windows only (kv/store.py, kv/offload.py).
    windowed = shape.sliding_window_layers and shape.sliding_window < tokens and setup.context_parallel == 1
    window_layers = shape.sliding_window_layers if windowed else 0

    if mode.offload:
        chunk_pages = _num_pages(chunk_len, P, B)
        resident = min(offload.resident_layers, L)
        # Every (offloaded) layer slides: a window's history, ceil((W - 1) / P) pages, fills a slot.
        history = -(-(shape.sliding_window - 1) // P) if window_layers >= L else None
        if mode.attention == "dense":
            gpu["KV working set"] = _dense_offload_gpu_pages(L, own_pages, chunk_pages, B, offload,
                                                             history) * page_bytes
        else:  # the union of every block's and KV head's selection, staged at once (an upper bound),
            # for this call and, in stage 2, the next one (prefetched); plus the chunk's own gradients
            selections = -(-(chunk_pages // B) // sparse.query_block_pages)  # distinct selections per chunk
            union = selections * shape.num_kv_heads * sparse_pages_read(sparse, tokens, P)
            staged = B * min(own_pages // B, union) + chunk_pages
            slots = _staging_slot_pages(chunk_pages, B, offload, history) if resident < L else 0
            gpu["KV working set"] = (resident * own_pages + 2 * staged + chunk_pages + slots) * page_bytes
        # Host: K, V, dK, dV of every token (context parallel: of the rank's chunks) of the offloaded
        # global layers, and of the window slots of the offloaded window layers (their chunk tails and
        # one chunk, kv/window_slots.py), pinned: the footprint the engine checks before allocating.
        page_shape = capacity.PageShape(L, B, own_tokens, shape.num_kv_heads, shape.head_dim, setup.dtype,
                                        shape.window_layer_ids() if windowed else (), shape.sliding_window)
        offload_config = replace(config, offload=replace(offload, enabled=True, resident_layers=resident))
        host["KV pages"], host["KV grad pages"] = capacity.host_page_bytes(page_shape, offload_config)
    else:
        # Window layers shorter than the step have their own pages without offload (kv/store.py):
        # the last W - 1 keys of every chunk before the current one, plus that chunk.
        window_pages = B * window_pages_per_sequence(tokens, config.chunk_size, P, shape.sliding_window) \
            if windowed else 0
        gpu["KV working set"] = ((L - window_layers) * own_pages + window_layers * window_pages) * page_bytes
        gpu["page tables"] += pages * INT32_BYTES if windowed else 0

    if mode.attention == "sparse":
        # Every page's, on every context-parallel rank too (each scores the whole history, kv/store.py).
        # Window layers keep none (they read their window densely), with or without offload.
        summaries = (L - window_layers) * pages * summary_vectors(sparse) * shape.kv_dim * b
        # Stage 1's selections, kept for stage 2; offloaded layers (all but the first `resident`) keep theirs
        # in host memory until stage 2.
        resident = min(offload.resident_layers, L) if mode.offload else L
        # Layers that read alike keep alike: one count per dense flag and budget, not per layer.
        kept: dict[tuple[bool, int], int] = {}
        selection = []
        for layer in range(L):
            alike = (layer in sparse.dense_layers, sparse.budget_of(layer))
            if alike not in kept:
                kept[alike] = selection_bytes(sparse, tokens, config.chunk_size, P, B, shape.num_kv_heads, layer)
            selection.append(kept[alike])
        if mode.offload:
            host["selections"] = sum(selection[resident:])
        gpu["page summaries"] = summaries + sum(selection[:resident])
    return MemoryPrediction(mode.name, tokens, gpu, host)
