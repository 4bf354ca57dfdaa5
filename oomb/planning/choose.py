"""Choose the fastest OOMBConfig that fits: offload, resident layers, dK/dV dtype, layer replay, kept or
recomputed log-probabilities, kept sparse attention outputs, chunk, backend (and, sparse with offload, one
selection per chunk).

    choice = choose_config(workload, resources, fixed={"precision.kv_grad_dtype": "float32"})
    choice.config            # an OOMBConfig; every option in ``fixed`` kept as given
    choice.gpu_bytes, choice.host_bytes, choice.reason, choice.runner_up

Memory comes from ``oomb.planning.memory.predict`` (the planner's model, calibrated on the H200). Speed comes
from SPEED_FACTS below: relative step times measured on one H200, each with the JSON file in
benchmarks/results/ it came from. The search enumerates every combination of the free options,
keeps those whose predicted GPU and host memory fit, and ranks them by:

1. exactness first: float32 dK/dV pages whenever any float32 configuration fits (bf16 pages are
   ~5 % faster but round the gradients of every page; they are chosen only to make a step fit);
2. then the predicted relative step time (the product of the factors that apply).

What the chooser never changes: options in ``fixed`` (what the user set), and the attention mode
(dense or sparse: the user's choice; sparse is an approximation). When nothing fits, NoConfigFitsError
names the smallest configuration's memory against the limits and the longest context that fits.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Literal

import torch

from .. import sparse_fidelity
from ..compiled_layers import compiles
from ..config import OOMBConfig, dotted_options, resolve_dtype
from ..units import format_tokens
from .fit import largest_context
from .memory import (
    FP32_BYTES,
    GIB,
    MODES,
    MemoryPrediction,
    TrainingSetup,
    predict,
)
from .model_shape import ModelShape
from .step_time import StepTime, predict_step_time

AUTO_FIELDS = ("performance.backend", "offload.enabled", "offload.resident_layers", "precision.kv_grad_dtype",
               "performance.checkpoint_layers", "chunk_size", "sparse.query_block_pages",
               "performance.recompute_logits", "performance.keep_attention_outputs")
"""OOMBConfig options (dotted paths) the chooser decides unless the user fixed them."""

LORA_NO_REPLAY_VALUES_PER_HIDDEN = 10
"""Without layer replay PEFT's LoRA layers keep more per token than oomb.planning.memory counts: measured on the
H200 (7B, LoRA r=16, 128K, chunk 4096, bf16) 71.79 GiB peak vs 64.7 predicted, 7.1 GiB = 18.5 bytes
per hidden unit, token and layer (with replay: 39.02 measured vs 40.1 predicted), that is 9.25 bf16
values, rounded up to 10; in the model's dtype (float32 on a CPU: 40 bytes)
(benchmarks/results/logs/autoconfig_qwen7b_lora_128k_h200_2026-12-01.log; the replay run: its
stdout in the report of that session)."""

CPU_SLOWER_ALLOWED = 1.05
"""On a CPU the step's memory is the machine's memory, shared with everything else on it: a plan up to
this factor slower than the fastest is taken when it saves at least CPU_MEMORY_SAVING of the host memory
(layer replay, typically: SPEED_FACTS replay_cpu)."""

CPU_MEMORY_SAVING = 0.25
"""Fraction of the fastest CPU plan's predicted host memory a slower plan must save (CPU_SLOWER_ALLOWED)."""

BF16_HINT = 0.95
"""Where float32 dK/dV is chosen and a fitting bf16 plan is predicted faster than this fraction of its time,
the reason says so (the choice stays float32: bf16 did not stay within HF's own error on the real model)."""

MIN_AUTO_CHUNK = 1024
"""The chooser halves the chunk (less activation memory) down to this many tokens, never below."""


@dataclass(frozen=True)
class SpeedFact:
    """One measured (or derived) relative step time and where it came from."""

    factor: float
    """Step time with the option / step time without it (> 1: the option costs time)."""
    measured: str
    """What was compared, in numbers."""
    source: str
    """The JSON file(s) in benchmarks/results/ (or 'assumed' when nothing was measured)."""


SPEED_FACTS: dict[str, SpeedFact] = {
    "triton_vs_cudnn_dense": SpeedFact(
        68.76 / 49.37, "dense 128K, 7B, bf16: triton 68.76 s vs cudnn 49.37 s (256K: 230.82 vs 158.60 s)",
        "bench_h200_2026-11-29_offload.json, dense_cudnn_128k_h200_2026-11-30.json, step_h200_2026-11-29b.json, "
        "dense_cudnn_256k_h200_2026-11-30.json"),
    "triton_vs_cudnn_sparse": SpeedFact(
        27.55 / 27.08, "sparse 128K, one selection per chunk: triton 27.55 s vs cudnn 27.08 s",
        "sparse_groups_h200_2026-11-29.json, sparse_cudnn_128k_h200_2026-11-30.json"),
    "triton_first_step": SpeedFact(
        43.0 / 4.4, "first step (compile + autotune), bf16: triton ~43 s vs cudnn 4.4 s",
        "bench_h200_2026-11-29_offload.json (warm-up), dense_cudnn_512k_h200_2026-11-30.json (warm-up 4.33 s)"),
    "replay_sparse": SpeedFact(
        27.08 / 23.88, "sparse 128K cudnn: layer replay 27.08 s vs none 23.88 s",
        "sparse_cudnn_128k_h200_2026-11-30.json, sparse_cudnn_no_replay_128k_h200_2026-11-30.json"),
    "replay_dense": SpeedFact(
        1 + (27.08 - 23.88) / 49.37, "dense 128K cudnn: the replay's 3.2 s (sparse runs above) over 49.37 s "
        "(derived: the replay re-runs the linear layers, the same work in both modes)",
        "derived from the sparse pair and dense_cudnn_128k_h200_2026-11-30.json"),
    "offload_dense": SpeedFact(
        50.09 / 49.37, "dense 128K cudnn: offload 50.09 s vs 49.37 s (triton: 67.44 vs 68.76 s)",
        "dense_offload_cudnn_128k_h200_2026-11-30.json, dense_cudnn_128k_h200_2026-11-30.json, "
        "offload_sparse_h200_2026-11-29_128k.json"),
    "offload_sparse": SpeedFact(
        1.20, "sparse 128K triton: offload (gather + prefetch) 32.94 s = 1.20x sparse",
        "sparse_offload_gather_h200_2026-11-30_128k.json"),
    "bf16_kv_grads": SpeedFact(
        23.29 / 24.41, "sparse 128K cudnn, no replay, budget 32: bf16 dK/dV 23.29 s vs float32 24.41 s",
        "sparse_cudnn_no_replay_budget32_bf16_h200_2026-11-30.json, "
        "sparse_cudnn_no_replay_budget32_h200_2026-11-30.json"),
    "recompute_logits_sparse": SpeedFact(
        21.31 / 20.70, "sparse 128K cudnn, fast settings: log-probabilities recomputed 21.31 s vs kept 20.70 s "
        "(one run each, same machine session)",
        "sparse_fast_128k_h200_2026-12-03.json, sparse_fast_kept_logits_128k_h200_2026-12-03.json"),
    "recompute_logits_dense": SpeedFact(
        1 + (21.31 - 20.70) / 45.21, "dense 128K cudnn: the recompute's 0.61 s (sparse runs above) over 45.21 s "
        "(derived: the recompute is one LM-head forward per loss slice, the same work in both modes)",
        "derived from the sparse pair and dense_cudnn_warm_no_replay_128k_h200_2026-12-03.json"),
    "kept_attention_sparse": SpeedFact(
        20.457 / 21.747, "sparse 128K, the defaults and the chooser's plan (cudnn, no replay, compiled layers): "
        "attention outputs kept from stage 1 20.46 s vs recomputed 21.75 s (one run each, one call; HF 42.67 s)",
        "sparse_defaults_chosen_kept_128k_h200_2026-12-04.json, sparse_defaults_chosen_128k_h200_2026-12-04e.json"),
    "kept_attention_dense": SpeedFact(
        38.870 / 45.299, "dense 128K, the chooser's plan (cudnn, no replay, compiled layers): attention outputs kept "
        "from stage 1 38.87 s vs recomputed 45.30 s (one run each, one call; HF 41.89 s in the call before)",
        "dense_chosen_kept_128k_h200_2026-12-04.json, dense_chosen_128k_h200_2026-12-04.json"),
    "eager_layers": SpeedFact(
        25.386 / 23.48, "sparse 128K, 7B, every weight trained, no replay: eager decoder layers 25.39 s vs compiled "
        "23.48 s (one call, H200)",
        "eager_layers_128k_h200_2026-12-03.json, compiled_layers_128k_h200_2026-12-03.json"),
    "eager_layers_lora": SpeedFact(
        32.541 / 24.208, "dense 128K, 7B with LoRA, oomb train's steady step: eager decoder layers 32.54 s vs compiled "
        "24.21 s (one H100 machine, one after the other; PEFT's adapters add many small kernels a graph fuses)",
        "first_step/train_128k_lora_eager_h100.json, first_step/train_128k_lora_compiled_cold_h100.json"),
    "replay_cpu": SpeedFact(
        1.03, "CPU, SmolLM2-135M LoRA r=16, 8K, float32, torch backend: layer replay took 3 % more time and "
        "7.9 GiB of peak RSS against 16.5 GiB without",
        "assumed from a user's 2-core CPU run (not stored in benchmarks/results)"),
    "half_chunk": SpeedFact(
        1.05, "each halving of the chunk below 4096 (more, smaller kernel launches): not measured", "assumed"),
}
"""Relative step times on one H200 (Qwen2.5-7B shape, bf16, chunk 4096, page 128; docs/results.md).
Offload costs scale with the fraction of layers that are not resident (assumed linear)."""


class NoConfigFitsError(MemoryError):
    """No configuration of the free options fits the GPU and host memory; the message has the numbers."""


@dataclass(frozen=True)
class Workload:
    """What trains: the model's shape, the sequence, dtype and what holds gradients and optimizer state."""

    shape: ModelShape
    seq_len: int
    batch_size: int = 1
    dtype: torch.dtype = torch.bfloat16
    lora_rank: int = 0
    """0: full fine-tuning; r: LoRA of rank r on every linear layer (the planner's assumption)."""
    optimizer: Literal["adamw", "none"] = "adamw"
    master_weights: bool = False
    trainable_params: int | None = None
    """Exact count of trainable parameters (the trainer knows it); None: derived from lora_rank."""
    optimizer_bytes: int | None = None
    """Exact GPU bytes of optimizer state and master weights (the trainer knows them); None: predicted."""
    fp32_targets: bool = False
    """Chunk gradients go to the caller's fp32 tensors (master weights on the GPU): no fp32 sums."""
    may_compile: bool = False
    """The step may compile its decoder layers (compiled_layers.may_compile: one process, a machine that
    compiles, no active dropout): a candidate whose config then compiles is counted with the compiled
    layers' activations. False counts every candidate eager (never less than it uses)."""
    may_fuse_loss: bool = False
    """The step's loss may be the fused one (models.fused_loss_possible): counted so (TrainingSetup.fused_loss).
    False counts autograd's loss."""
    context_parallel: bool = False
    """The step shares its pages over context-parallel ranks, which refuse kept attention outputs."""

    def __post_init__(self) -> None:
        if self.seq_len <= 0 or self.batch_size <= 0:
            raise ValueError(f"seq_len={self.seq_len} and batch_size={self.batch_size} must be positive")

    def setup(self) -> TrainingSetup:
        return TrainingSetup(self.dtype, self.batch_size, self.optimizer, self.master_weights, self.lora_rank)


MEMORY_HEADROOM = 0.95
"""A plan may take this share of the memory free (the rest is the allocator's fragmentation and the unforeseen)."""


@dataclass(frozen=True)
class Resources:
    """Where it runs and how much memory a step may take."""

    device: Literal["cuda", "cpu"] = "cuda"
    gpu_limit: int | None = None
    """Bytes the predicted GPU total may reach (margin and CUDA context already taken off). On a
    CPU: None (the step lives in host memory)."""
    host_limit: int | None = None
    """Bytes of host memory the step may take (pinned pages with offload, everything on a CPU)."""
    weights_loaded: bool = False
    """The weights are already on the GPU and outside gpu_limit (the trainer measures free memory
    after loading): they are not counted against it."""
    gpu_name: str | None = None
    """The CUDA device's name (the step-time prediction uses its measured rate); None on a CPU."""

    @classmethod
    def free_on(cls, device: torch.device, gpu_free: int | None, host_free: int, *,
                weights_loaded: bool = False) -> Resources:
        """A step's limits on ``device`` from the bytes free there: MEMORY_HEADROOM of each (``gpu_free`` is
        ignored on a CPU), with the CUDA device's name."""
        if device.type != "cuda":
            return cls("cpu", None, int(MEMORY_HEADROOM * host_free), weights_loaded=weights_loaded)
        if gpu_free is None:
            raise ValueError("a CUDA step needs the free GPU memory to choose a plan")
        return cls("cuda", int(MEMORY_HEADROOM * gpu_free), int(MEMORY_HEADROOM * host_free),
                   weights_loaded=weights_loaded, gpu_name=torch.cuda.get_device_name(device))

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device={self.device!r} must be 'cuda' or 'cpu'")
        if self.device == "cuda" and self.gpu_limit is None:
            raise ValueError("a CUDA device needs gpu_limit (bytes a step may take on the GPU)")


@dataclass(frozen=True)
class Candidate:
    """One configuration with its predicted memory and relative step time."""

    config: OOMBConfig
    gpu_bytes: int
    """Predicted GPU peak, weights included."""
    gpu_counted: int
    """The part of gpu_bytes checked against Resources.gpu_limit (without loaded weights)."""
    host_bytes: int
    relative_time: float
    factors: tuple[str, ...]
    """Keys of SPEED_FACTS that apply."""
    prediction: MemoryPrediction
    fused_loss: bool = False
    """The step's loss is counted fused (TrainingSetup.fused_loss)."""
    head_trained: bool = True
    device: Literal["cuda", "cpu"] = "cuda"
    """Resources.device: on a CPU the "GPU" terms (activations, logits, pages) are host memory too."""

    @property
    def host_counted(self) -> int:
        """Host bytes checked against Resources.host_limit: on a CPU every term (without loaded weights), else
        host_bytes."""
        return self.gpu_counted + self.host_bytes if self.device == "cpu" else self.host_bytes

    def memory_words(self) -> str:
        """'GPU 9.6 GiB, host 2.0 GiB'; on a CPU the one memory there is."""
        if self.device == "cpu":
            weights = "beyond the loaded weights" if self.gpu_counted < self.gpu_bytes else "with the weights"
            return f"host {self.host_counted / GIB:.1f} GiB ({weights}: activations, logits, pages, process)"
        return f"GPU {self.gpu_bytes / GIB:.1f} GiB, host {self.host_bytes / GIB:.1f} GiB"

    @property
    def loss_keeps_nothing(self) -> bool:
        """The fused loss keeps nothing of the vocabulary's size and recomputes nothing (loss_keeps_nothing)."""
        return loss_keeps_nothing(self.fused_loss)

    def loss_words(self) -> str:
        """What the loss keeps for its backward, in words."""
        kept = "recomputed" if self.config.performance.recompute_logits else "kept"
        if not self.fused_loss:
            return f"log-probabilities {kept}"
        if not self.head_trained:
            return "loss fused (frozen head: nothing kept)"
        return "loss fused (head's gradient made in the forward: nothing kept)"

    def summary(self, num_layers: int) -> str:
        c = self.config
        if c.offload.enabled and self.device != "cuda":
            where = "offload (on a CPU every page is in host memory either way)"
        elif c.offload.enabled:
            where = f"offload ({c.offload.resident_layers} of {num_layers} layers resident on the GPU)"
        else:
            where = "pages on the GPU" if self.device == "cuda" else "pages in host memory"
        grouping = (f", one sparse selection per {c.sparse.query_block_pages} query blocks"
                    if c.attention == "sparse" and c.sparse.query_block_pages > 1 else "")
        kept = ", attention outputs kept" if c.performance.keep_attention_outputs else ""
        replay = "on" if c.performance.checkpoint_layers else "off"
        return (f"{where}, dK/dV {_dtype_name(c.precision.grad_dtype)}, layer replay {replay}, "
                f"{self.loss_words()}{kept}, chunk {c.chunk_size}, "
                f"backend {c.performance.backend}{grouping}")


@dataclass(frozen=True)
class Choice:
    """The chosen configuration, what it is predicted to take, why, and the next best one."""

    config: OOMBConfig
    gpu_bytes: int
    host_bytes: int
    reason: str
    runner_up: Candidate | None
    chosen: Candidate
    fixed: dict = field(default_factory=dict)
    num_layers: int = 0
    compiled_layers: bool = False
    """Whether the step compiles its decoder layers (OOMBConfig.performance.compile_layers as a CUDA step
    resolves it; whether Triton is installed is checked by the step, not here)."""
    seq_len: int = 0
    """Tokens per sequence the choice was made for (a sparse plan's share of the history read depends on it)."""
    step_time: StepTime | None = None
    """The predicted step time (planning/step_time.py); None on a CPU."""
    other_mode_time: StepTime | None = None
    """The step time of the other attention mode's own plan (dense <-> sparse, the same fixed options), for
    comparison; None where nothing is predicted."""
    window_layers: tuple[int, ...] = ()
    """The model's sliding-window layers (what sparse.dense_layers="auto" leaves out)."""
    other_mode_fits: bool = True
    """Whether the other attention mode has a plan that fits (False: its step time is not given)."""

    def describe(self) -> str:
        """Lines for a CLI: the plan, memory, why, and the runner-up."""
        num_layers = self.num_layers
        lines = [f"configuration: {self.chosen.summary(num_layers)}",
                 f"  predicted: {self.chosen.memory_words()}, relative step time {self.chosen.relative_time:.2f}",
                 f"  why: {self.reason}"]
        if self.step_time is not None:
            other = "sparse" if self.config.attention == "dense" else "dense"
            also = (f"; {other} attention (its own plan): {self.other_mode_time}" if self.other_mode_time is not None
                    else f"; {other} attention: nothing fits" if not self.other_mode_fits else "")
            lines.append(f"  predicted step time: {self.step_time}{also}")
        if self.config.attention == "sparse" and self.seq_len:
            lines.append(f"  {sparse_fidelity.describe(self.seq_len, self.config, num_layers, self.window_layers)}")
        if self.compiled_layers:
            lines.append("  layers: compiled for the step (on one process, without an active "
                         "dropout; the first step compiles them: about 30 s for a 7B model on a fresh H100, less "
                         "with torch's compile caches)")
        if self.runner_up is not None:
            r = self.runner_up
            ahead = ("; estimated faster only by keeping outputs the choice has no room for, a trade against "
                     "its other decisions that is not measured" if _rank(r) < _rank(self.chosen) else "")
            lines.append(f"  runner-up: {r.summary(num_layers)} ({r.memory_words()}, relative step time "
                         f"{r.relative_time:.2f}{ahead})")
        return "\n".join(lines)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# Backend
# ---------------------------------------------------------------------------------------------

def choose_backend(device: str, dtype: torch.dtype, deterministic: bool,
                   cudnn_refuses: str | None = None) -> tuple[str, str]:
    """(backend, why) for ``backend="auto"``: cudnn for bf16/fp16 on CUDA (faster in every measured
    case), torch for float32 on CUDA (cuDNN has no float32 path; Triton's float32 kernels take minutes
    to compile), triton when bitwise determinism is asked for or the model has attention cuDNN cannot
    run (``cudnn_refuses``, ModelShape.cudnn_refuses: logit softcapping; sliding windows and sinks run
    on cudnn), torch on a CPU."""
    if device != "cuda":
        return "torch", "on a CPU only the torch reference kernels run"
    if deterministic:
        return "triton", ("precision.deterministic=True: Triton's kernels are bitwise deterministic (cuDNN's backward "
                          "is not)")
    if cudnn_refuses and dtype in (torch.bfloat16, torch.float16):
        return "triton", f"triton: the model has {cudnn_refuses}, which the cudnn backend cannot run"
    if dtype in (torch.bfloat16, torch.float16):
        f = SPEED_FACTS["triton_vs_cudnn_dense"]
        return "cudnn", (f"cudnn for {_dtype_name(dtype)} on CUDA: triton takes {f.factor:.2f}x as long "
                         f"({f.measured}); precision.deterministic=true would pick triton")
    return "torch", ("float32 on CUDA: cuDNN's fused attention has no float32 path, and the torch kernels start "
                     "in 1.1 s where Triton's float32 kernels compile for 184 s (2 layers, head_dim 128, 8K: "
                     "fp32_first_step_h200_2026-12-02.json)")


# ---------------------------------------------------------------------------------------------
# Memory and time of one candidate
# ---------------------------------------------------------------------------------------------

def _runs_compiled(workload: Workload, resources: Resources, config: OOMBConfig) -> bool:
    """Whether the step of ``config`` compiles its decoder layers for this workload (never under several
    processes or an active dropout: Workload.may_compile, unless compile_layers is set on)."""
    fp32_linear = workload.fp32_targets and not workload.lora_rank and workload.dtype.itemsize < FP32_BYTES
    return (compiles(config, resources.device == "cuda", bool(workload.shape.num_experts))
            and (config.performance.compile_layers is True or workload.may_compile) and not fp32_linear)


def predict_candidate(workload: Workload, resources: Resources, config: OOMBConfig) -> Candidate:
    """Predicted memory (oomb.planning.memory.predict, with the workload's exact counts where given) and the
    relative step time of ``config``."""
    mode = MODES[f"{config.attention}{'+offload' if config.offload.enabled else ''}"]
    compiled = _runs_compiled(workload, resources, config)
    setup = dataclasses.replace(workload.setup(), compiled_layers=compiled, fused_loss=workload.may_fuse_loss)
    p = predict(mode, workload.shape, workload.seq_len, config, setup)
    gpu = dict(p.gpu)
    if workload.trainable_params is not None:
        gpu["param grads"], gpu["fp32 grad sums"] = _grad_bytes(workload, config)
    if workload.optimizer_bytes is not None:
        gpu["optimizer"] = workload.optimizer_bytes
    if workload.lora_rank and not config.performance.checkpoint_layers:
        shape, chunk = workload.shape, min(config.chunk_size, workload.seq_len) * workload.batch_size
        gpu["activations"] += lora_no_replay_bytes(shape, chunk, workload.dtype)
    gpu_bytes = sum(gpu.values())
    counted = gpu_bytes - (gpu["weights"] if resources.weights_loaded else 0)
    host_bytes = p.host_total
    time, factors = relative_time(config, workload.shape.num_layers,
                                  not loss_keeps_nothing(setup.fused_loss), resources.device, compiled=compiled,
                                  lora=bool(workload.lora_rank))
    prediction = MemoryPrediction(p.mode, p.tokens, gpu, dict(p.host))
    return Candidate(config, gpu_bytes, counted, host_bytes, time, factors, prediction, setup.fused_loss,
                     head_trained=not workload.lora_rank, device=resources.device)


def lora_no_replay_bytes(shape: ModelShape, chunk_tokens: int, dtype: torch.dtype) -> int:
    """What PEFT's LoRA layers keep of a chunk (batch included) beyond oomb.planning.memory's count, without layer
    replay (LORA_NO_REPLAY_VALUES_PER_HIDDEN)."""
    return LORA_NO_REPLAY_VALUES_PER_HIDDEN * dtype.itemsize * shape.hidden_size * shape.num_layers * chunk_tokens


def loss_keeps_nothing(fused_loss: bool) -> bool:
    """The step's fused loss keeps nothing of the vocabulary's size and recomputes nothing, whatever
    recompute_logits says: a frozen head needs nothing, and a trained one's weight gradient the engine makes in
    the forward (chunked_cross_entropy's weight_gradient_now)."""
    return fused_loss


def _grad_bytes(workload: Workload, config: OOMBConfig) -> tuple[int, int]:
    """(low-precision .grad bytes, fp32 sum bytes) for an exact trainable count (as
    memory.estimate_step_memory counts them)."""
    trainable, b = workload.trainable_params, workload.dtype.itemsize
    if workload.lora_rank:  # PEFT's adapters are fp32: plain fp32 gradients
        return trainable * FP32_BYTES, 0
    if b < FP32_BYTES and (config.precision.fp32_grad_accumulation or workload.fp32_targets):
        low = workload.shape.low_precision_grad_params(trainable) * b
        return low, 0 if workload.fp32_targets else trainable * FP32_BYTES
    return trainable * b, 0


def relative_time(config: OOMBConfig, num_layers: int, loss_may_recompute: bool = True,
                  device: Literal["cuda", "cpu"] = "cuda", *, compiled: bool = True,
                  lora: bool = False) -> tuple[float, tuple[str, ...]]:
    """Product of the SPEED_FACTS that apply to ``config`` (1.0: pages on the GPU, no replay, compiled decoder
    layers, log-probabilities kept, attention outputs recomputed, float32 dK/dV, chunk >= 4096, cudnn).
    ``loss_may_recompute`` False: the loss recomputes nothing whatever recompute_logits says
    (Candidate.loss_keeps_nothing). ``compiled`` False on a GPU (a step that may not compile):
    eager layers cost what they were measured to cost, more with LoRA (``lora``). On a CPU layer replay costs
    what it was measured to cost there (replay_cpu), and nothing compiles."""
    sparse = config.attention == "sparse"
    time, factors = 1.0, []
    if device == "cuda" and not compiled:
        key = "eager_layers_lora" if lora else "eager_layers"
        time *= SPEED_FACTS[key].factor
        factors.append(key)
    if config.performance.backend == "triton":
        key = "triton_vs_cudnn_sparse" if sparse else "triton_vs_cudnn_dense"
        time *= SPEED_FACTS[key].factor
        factors.append(key)
    if config.performance.checkpoint_layers:
        key = "replay_cpu" if device == "cpu" else "replay_sparse" if sparse else "replay_dense"
        time *= SPEED_FACTS[key].factor
        factors.append(key)
    if config.performance.recompute_logits and loss_may_recompute:
        key = "recompute_logits_sparse" if sparse else "recompute_logits_dense"
        time *= SPEED_FACTS[key].factor
        factors.append(key)
    if config.performance.keep_attention_outputs:
        key = "kept_attention_sparse" if sparse else "kept_attention_dense"
        time *= SPEED_FACTS[key].factor
        factors.append(key)
    if config.offload.enabled:
        key = "offload_sparse" if sparse else "offload_dense"
        offloaded = (num_layers - min(config.offload.resident_layers, num_layers)) / num_layers
        time *= 1 + (SPEED_FACTS[key].factor - 1) * offloaded
        factors.append(key)
    if config.precision.grad_dtype != torch.float32:
        time *= SPEED_FACTS["bf16_kv_grads"].factor
        factors.append("bf16_kv_grads")
    halvings, chunk = 0, config.chunk_size
    while chunk < 4096:
        chunk, halvings = chunk * 2, halvings + 1
    if halvings:
        time *= SPEED_FACTS["half_chunk"].factor ** halvings
        factors.append("half_chunk")
    return time, tuple(factors)


def _fits(c: Candidate, resources: Resources) -> bool:
    if resources.device == "cpu":  # everything lives in host memory
        return resources.host_limit is None or c.host_counted <= resources.host_limit
    host_ok = resources.host_limit is None or c.host_bytes <= resources.host_limit
    return c.gpu_counted <= resources.gpu_limit and host_ok


# ---------------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------------

def _options(name: str, base: OOMBConfig, fixed: dict, workload: Workload, resources: Resources) -> list:
    if name in fixed:
        return [base.option(name)]
    if name == "offload.enabled":  # kept attention outputs live on the GPU (performance.keep_attention_outputs)
        return [False, True] if resources.device == "cuda" and not base.performance.keep_attention_outputs else [False]
    if name == "precision.kv_grad_dtype":
        return ["float32", "bfloat16"]
    if name == "performance.checkpoint_layers":
        return [False, True]
    if name == "chunk_size":
        sizes, size = [], base.chunk_size
        while size >= max(MIN_AUTO_CHUNK, base.page_size) and size % base.page_size == 0:
            sizes.append(size)
            size //= 2
        return sizes or [base.chunk_size]
    raise AssertionError(name)


def _resident_layers(workload: Workload, resources: Resources, config: OOMBConfig, free: bool) -> list[Candidate]:
    """With offload: the candidate with the most resident layers that fits (fewer transfers; GPU use
    grows and host use shrinks with them), or the fixed count; without offload the config as is."""
    if not config.offload.enabled or not free:
        return [predict_candidate(workload, resources, config)]
    layers = workload.shape.num_layers
    lo, hi = 0, layers - 1  # all layers resident is offload.enabled=False
    # GPU bytes grow with resident layers: find the largest count that fits the GPU, then check host.
    first = predict_candidate(workload, resources, config.with_options({"offload.resident_layers": 0}))
    if not _fits_gpu(first, resources):
        return [first]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits_gpu(predict_candidate(workload, resources, config.with_options({"offload.resident_layers": mid})),
                     resources):
            lo = mid
        else:
            hi = mid - 1
    best = predict_candidate(workload, resources, config.with_options({"offload.resident_layers": lo}))
    return [best]


def _fits_gpu(c: Candidate, resources: Resources) -> bool:
    return resources.device == "cpu" or c.gpu_counted <= resources.gpu_limit


def candidates(workload: Workload, resources: Resources, base: OOMBConfig, fixed: dict) -> list[Candidate]:
    """Every combination of the free options (resident layers: the most that fit), predicted."""
    out = []
    grid = [_options(n, base, fixed, workload, resources)
            for n in ("offload.enabled", "precision.kv_grad_dtype", "performance.checkpoint_layers", "chunk_size")]
    resident_free = "offload.resident_layers" not in fixed
    for offload, grad, replay, chunk in itertools.product(*grid):
        config = base.with_options({"offload.enabled": offload, "precision.kv_grad_dtype": grad,
                                    "performance.checkpoint_layers": replay, "chunk_size": chunk})
        out += _resident_layers(workload, resources, _sparse_grouping(config, fixed), resident_free)
    return out


def _sparse_grouping(config: OOMBConfig, fixed: dict) -> OOMBConfig:
    """Sparse with offload: one selection per chunk (sparse.query_block_pages = chunk / page) unless the
    user set it. Each offloaded call stages the union of its query blocks' selections: one per block,
    that is up to 32 x Hkv x (budget + 1) pages of a 4096-token chunk (most of the history below about
    1M tokens; about 2 GiB of K and V per call on the 7B shape), one per chunk at most Hkv x (budget +
    1). The offload_sparse speed fact was measured so (one selection per 32 blocks)."""
    if config.attention != "sparse" or not config.offload.enabled or "sparse.query_block_pages" in fixed:
        return config
    one_per_chunk = max(1, config.chunk_size // config.page_size)
    return config.with_options({"sparse.query_block_pages": one_per_chunk})


def _keep_logits(best: Candidate, workload: Workload, resources: Resources, fixed: dict) -> Candidate:
    """The chosen plan with the loss slices' log-probabilities kept (no LM-head recompute) when they fit
    next to it. Decided last, so that it never changes a weightier choice (offload, resident layers,
    dK/dV dtype, replay, chunk) for its small gain (SPEED_FACTS recompute_logits_*)."""
    if "performance.recompute_logits" in fixed or not best.config.performance.recompute_logits:
        return best  # (a fused loss that keeps nothing fits either way: turned off too, as the layouts without it)
    kept = predict_candidate(workload, resources, best.config.with_options({"performance.recompute_logits": False}))
    return kept if _fits(kept, resources) else best


def _keep_attention(best: Candidate, workload: Workload, resources: Resources, fixed: dict) -> Candidate:
    """The chosen plan with stage 1's attention outputs kept for stage 2 (performance.keep_attention_outputs)
    when they fit next to it: steps with every page on the GPU (SPEED_FACTS kept_attention_sparse and
    kept_attention_dense). Decided after the weightier choices, like ``_keep_logits``, and before it: the larger
    gain takes the memory first."""
    c = best.config
    if ("performance.keep_attention_outputs" in fixed or c.performance.keep_attention_outputs
            or resources.device != "cuda" or c.offload.enabled or workload.context_parallel):
        return best
    kept = predict_candidate(workload, resources, c.with_options({"performance.keep_attention_outputs": True}))
    return kept if _fits(kept, resources) else best


def _decided_last(best: Candidate, workload: Workload, resources: Resources, fixed: dict) -> Candidate:
    """The two recomputations turned off where they fit, after the search: attention outputs, then logits."""
    return _keep_logits(_keep_attention(best, workload, resources, fixed), workload, resources, fixed)


def _rank(c: Candidate) -> tuple:
    return (c.config.precision.grad_dtype != torch.float32, round(c.relative_time, 6), -c.config.chunk_size)


def choose_config(workload: Workload, resources: Resources, fixed: dict | None = None,
                  base: OOMBConfig | None = None, *, other_mode: bool = True) -> Choice:
    """The fastest configuration that fits, keeping every option in ``fixed``; with ``other_mode``, the other
    attention mode's own plan is chosen too, for its step time (Choice.other_mode_time).

    Args:
        workload: model shape, sequence length, dtype, what trains.
        resources: device and memory limits.
        fixed: OOMBConfig options the user set (never changed), by dotted path, e.g.
            {"precision.kv_grad_dtype": "float32"} (flat keys of earlier versions are mapped, with a warning).
            ``precision.deterministic`` and ``attention`` come from here too (default: False, "dense").
        base: the OOMBConfig whose other options (page size, sparse settings, ...) are kept; default
            OOMBConfig(). Its values of AUTO_FIELDS are replaced unless fixed.
    Raises:
        NoConfigFitsError: nothing fits; the message gives the smallest configuration's memory and
            the longest context that fits with it.
    """
    given_fixed, given_base = fixed, base
    fixed = dotted_options(fixed or {})
    unknown = sorted(set(fixed) - set(OOMBConfig().options()))
    if unknown:
        raise ValueError(f"unknown OOMBConfig option(s) {unknown} in fixed")
    base = (base or OOMBConfig()).with_options(fixed)
    if "performance.recompute_logits" not in fixed:  # decided last (_keep_logits): the search recomputes them
        base = base.with_options({"performance.recompute_logits": True})
    if "performance.keep_attention_outputs" not in fixed:  # decided last too (_keep_attention)
        base = base.with_options({"performance.keep_attention_outputs": False})
    if fixed.get("performance.backend", "auto") != "auto":
        backend = fixed["performance.backend"]
        backend_why = f"performance.backend={backend!r} as set"
    else:
        backend, backend_why = choose_backend(resources.device, workload.dtype, base.precision.deterministic,
                                              workload.shape.cudnn_refuses)
    base = base.with_options({"performance.backend": backend})
    options = candidates(workload, resources, base, fixed)
    fitting = sorted((c for c in options if _fits(c, resources)), key=_rank)
    if not fitting:
        raise NoConfigFitsError(_refusal(workload, resources, base, fixed, options))
    # The search's headline decisions stand; what the last decisions keep never reorders them (their trades
    # against replay, offload or smaller chunks are not measured together).
    best = _decided_last(_lean_on_cpu(fitting, resources), workload, resources, fixed)
    # The runner-up differs in a headline decision; offload is never faster, so it is not shown as an
    # alternative to a step that keeps every page on the GPU.
    runner_up = next((c for c in fitting[1:] if _headline(c) != _headline(best)
                      and (best.config.offload.enabled or not c.config.offload.enabled)), None)
    if runner_up is not None:  # comparable with the choice: the same last decisions (it may then rank ahead)
        runner_up = _decided_last(runner_up, workload, resources, fixed)
    reason = _reason(best, runner_up, fitting, options, resources, workload, backend_why, fixed)
    compiled = _runs_compiled(workload, resources, best.config)
    gpu_name = (resources.gpu_name or "unknown GPU") if resources.device == "cuda" else None
    step_time = other_time = None
    other_fits = True
    if gpu_name is not None:
        step_time = predict_step_time(workload.shape, workload.seq_len, best.config, gpu_name=gpu_name,
                                      lora_rank=workload.lora_rank, dtype=workload.dtype,
                                      batch_size=workload.batch_size, fused_loss=best.fused_loss,
                                      relative_time=best.relative_time)
        if other_mode:  # the other attention mode's own plan: it may fit other options (replay, offload, dtype)
            flipped = {**dotted_options(given_fixed or {}),
                       "attention": "sparse" if best.config.attention == "dense" else "dense"}
            try:
                other_time = choose_config(workload, resources, flipped, given_base, other_mode=False).step_time
            except NoConfigFitsError:
                other_fits = False
    return Choice(best.config, best.gpu_bytes, best.host_bytes, reason, runner_up, best, fixed,
                  workload.shape.num_layers, compiled, workload.seq_len, step_time, other_time,
                  window_layers=workload.shape.window_layer_ids(), other_mode_fits=other_fits)


def _lean_on_cpu(fitting: list[Candidate], resources: Resources) -> Candidate:
    """The fastest fitting plan; on a CPU the leanest one at most CPU_SLOWER_ALLOWED slower, with the same dK/dV
    dtype (exactness still comes first), if it saves at least CPU_MEMORY_SAVING of the fastest one's memory."""
    fastest = fitting[0]
    if resources.device != "cpu":
        return fastest
    near = [c for c in fitting if c.config.precision.grad_dtype == fastest.config.precision.grad_dtype
            and c.relative_time <= fastest.relative_time * CPU_SLOWER_ALLOWED * (1 + 1e-9)]
    lean = min(near, key=lambda c: (c.host_counted, _rank(c)))
    return lean if lean.host_counted <= (1 - CPU_MEMORY_SAVING) * fastest.host_counted else fastest


def _headline(c: Candidate) -> tuple:
    cfg = c.config
    return cfg.offload.enabled, cfg.precision.grad_dtype, cfg.performance.checkpoint_layers


def _reason(best: Candidate, runner_up: Candidate | None, fitting: list[Candidate], options: list[Candidate],
            resources: Resources, workload: Workload, backend_why: str, fixed: dict) -> str:
    cfg, parts = best.config, []
    limit = resources.gpu_limit if resources.device == "cuda" else resources.host_limit
    where = "GPU" if resources.device == "cuda" else "host"
    if "offload.enabled" in fixed:
        parts.append(f"offload.enabled={cfg.offload.enabled} as set")
    elif cfg.offload.enabled:
        on_gpu = [c for c in options
                  if not c.config.offload.enabled and c.config.precision.grad_dtype == cfg.precision.grad_dtype]
        need = min((c.gpu_counted for c in on_gpu), default=None)
        parts.append(f"offload: the pages do not fit the {where} ({need / GIB:.1f} GiB needed with every page on "
                     f"it, {limit / GIB:.1f} GiB usable)" if need is not None else "offload")
        if "offload.resident_layers" not in fixed:
            parts.append(f"{cfg.offload.resident_layers} layers resident: the most whose pages fit the GPU next to "
                         "the rest (fewer transfers)")
    else:
        parts.append("all pages on the GPU (no transfers)" if resources.device == "cuda" else "no offload on a CPU")
    if cfg.attention == "sparse" and cfg.offload.enabled and "sparse.query_block_pages" not in fixed:
        parts.append(f"one sparse selection per chunk (sparse.query_block_pages={cfg.sparse.query_block_pages}): "
                     "offloaded calls then stage at most one selection's pages, not every query block's")
    if "precision.kv_grad_dtype" in fixed:
        parts.append(f"precision.kv_grad_dtype={_dtype_name(cfg.precision.grad_dtype)} as set")
    elif cfg.precision.grad_dtype == torch.float32:
        text = "float32 dK/dV (exact; bf16 is chosen only when float32 does not fit)"
        bf16 = min((c for c in fitting if c.config.precision.grad_dtype != torch.float32),
                   key=lambda c: c.relative_time, default=None)
        if bf16 is not None and bf16.relative_time < BF16_HINT * best.relative_time:
            text += (f"; the fastest bf16 dK/dV plan would take {bf16.relative_time / best.relative_time:.2f}x this "
                     "step's time (precision.kv_grad_dtype=bfloat16 chooses it; on SmolLM2 over 64 and 128 chunks its "
                     "gradient error was no larger than float32's, over 256 chunks on a CPU 1.03x float32's, and from "
                     "128 chunks on neither stayed within HF's own bf16 error: kv-grad-dtype in docs/results.md)")
        parts.append(text)
    else:
        parts.append("bf16 dK/dV: no float32 configuration fits")
    # Two recomputations the chooser turns off where memory allows: (field, SPEED_FACTS key, why off, why on).
    # What a trained head's loss keeps is the logits' gradient when the loss is fused (oomb/loss.py).
    kept, them, fit = (("the logits' gradient", "it", "it fits") if best.fused_loss
                       else ("log-probabilities", "them", "they fit"))
    replay_on = "layer replay on: without it a chunk's activations do not fit"
    without = [c for c in fitting if not c.config.performance.checkpoint_layers
               and c.config.precision.grad_dtype == cfg.precision.grad_dtype]
    if resources.device == "cpu" and without:  # _lean_on_cpu chose it over a faster plan
        fastest = _decided_last(min(without, key=_rank), workload, resources, fixed)  # as it would have run
        replay_on = (f"layer replay on: on a CPU it takes {SPEED_FACTS['replay_cpu'].factor:.2f}x the time and the "
                     f"step {best.host_counted / GIB:.1f} GiB of host memory instead of "
                     f"{fastest.host_counted / GIB:.1f} GiB")
    for name, fact, off, on in (
            ("performance.checkpoint_layers", "replay",
             "no layer replay: a chunk's activations fit (replay takes {:.2f}x)", replay_on),
            ("performance.recompute_logits", "recompute_logits",
             f"{kept} kept: {fit} (recomputing {them} takes {{:.3f}}x)",
             f"{kept} recomputed: keeping {them} does not fit next to the rest")):
        value = cfg.option(name)
        if name == "performance.recompute_logits" and best.loss_keeps_nothing:
            parts.append("loss fused: the frozen head's slices keep nothing and recompute nothing"
                         if not best.head_trained else
                         "loss fused: the head's weight gradient is made in the forward, so its slices keep "
                         "nothing of the vocabulary's size and recompute nothing")
        elif name in fixed:
            parts.append(f"{name}={value} as set")
        elif not value:
            kind = "cpu" if fact == "replay" and resources.device == "cpu" else (
                "sparse" if cfg.attention == "sparse" else "dense")
            parts.append(off.format(SPEED_FACTS[f"{fact}_{kind}"].factor))
        else:
            parts.append(on)
    if "performance.keep_attention_outputs" in fixed:
        parts.append(f"performance.keep_attention_outputs={cfg.performance.keep_attention_outputs} as set")
    elif cfg.performance.keep_attention_outputs:
        kind = "sparse" if cfg.attention == "sparse" else "dense"
        parts.append(f"{kind} attention outputs kept for stage 2: they fit (recomputing them takes "
                     f"{1 / SPEED_FACTS[f'kept_attention_{kind}'].factor:.3f}x)")
    elif not cfg.offload.enabled and resources.device == "cuda":
        parts.append("attention outputs recomputed in stage 2: " + (
            "context parallelism refuses keeping them" if workload.context_parallel
            else "keeping them does not fit next to the rest"))
    if "chunk_size" not in fixed and cfg.chunk_size < max(c.config.chunk_size for c in options):
        parts.append(f"chunk {cfg.chunk_size}: larger chunks do not fit")
    parts.append(backend_why)
    return "; ".join(parts)


def _refusal(workload: Workload, resources: Resources, base: OOMBConfig, fixed: dict,
             options: list[Candidate]) -> str:
    """Why nothing fits, with numbers, and what would."""
    smallest = min(options, key=lambda c: (not _fits_gpu(c, resources), c.gpu_counted + c.host_bytes))
    tokens = workload.seq_len
    lines = [f"no configuration fits {workload.batch_size} x {tokens:,} tokens ({format_tokens(tokens)}) on "
             f"{resources.gpu_name or resources.device}:"]
    lines.append(f"  the closest to fitting ({smallest.summary(workload.shape.num_layers)}) needs "
                 + _against(smallest, resources))
    longest = _longest_fitting(workload, resources, base, fixed)
    if longest:
        lines.append(f"  up to {longest:,} tokens ({_approx_tokens(longest)}) fit, by the same search")
    else:
        lora = "" if workload.lora_rank else "train LoRA adapters, "
        bf16 = "bfloat16 weights (--dtype bfloat16), " if workload.dtype == torch.float32 else ""
        fixes = (f"{lora}{bf16}a smaller model or a machine with more memory"
                 if resources.device == "cpu" else f"{lora}offload the optimizer, or use a larger GPU")
        lines.append("  not even one page of tokens fits: the weights, gradients and optimizer state alone are too "
                     f"large ({fixes})")
    if fixed:
        free = {k: v for k, v in fixed.items() if k in AUTO_FIELDS}
        if free:
            try:
                other = choose_config(workload, resources, {k: v for k, v in fixed.items() if k not in free},
                                      base.with_options({k: OOMBConfig().option(k) for k in free}), other_mode=False)
                lines.append(f"  without the options you set ({', '.join(f'{k}={v!r}' for k, v in free.items())}) "
                             f"it fits: {other.chosen.summary(workload.shape.num_layers)} (GPU "
                             f"{other.gpu_bytes / GIB:.1f} GiB, host {other.host_bytes / GIB:.1f} GiB)")
            except NoConfigFitsError:
                pass
    lines += _fixed_budget_hint(workload, resources, base, fixed)
    return "\n".join(lines)


def _fixed_budget_hint(workload: Workload, resources: Resources, base: OOMBConfig, fixed: dict) -> list[str]:
    """For a sparse step whose read share grows the budget: whether the fixed budget alone would fit, and what
    share of the history it then reads (a user's trade of fidelity for length, never made silently)."""
    share = base.sparse.resolved_read_share
    if base.attention != "sparse" or share is None:
        return []
    fixed_budget = base.with_options({"sparse.read_share": None})
    try:
        other = choose_config(workload, resources, {k: v for k, v in fixed.items() if k != "sparse.read_share"},
                              fixed_budget, other_mode=False)
    except NoConfigFitsError:
        return []
    tokens, layers, windows = workload.seq_len, workload.shape.num_layers, workload.shape.window_layer_ids()
    read = sparse_fidelity.history_read(tokens, fixed_budget, layers, windows)
    wanted = sparse_fidelity.history_read(tokens, base, layers, windows)
    return [f"  with the fixed budget (--sparse-read-share none: {fixed_budget.sparse.budget} pages per query block, "
            f"{read:.1%} of the history at {format_tokens(tokens)} instead of {wanted:.1%}) it fits: "
            f"{other.chosen.summary(workload.shape.num_layers)} (GPU {other.gpu_bytes / GIB:.1f} GiB, host "
            f"{other.host_bytes / GIB:.1f} GiB); docs/sparse.md gives the fidelity measured at each share"]


def _approx_tokens(tokens: int) -> str:
    return f"{tokens / 2**20:.2f}M" if tokens >= 2**20 else f"{tokens / 1024:.1f}K"


def _against(c: Candidate, resources: Resources) -> str:
    if resources.device == "cpu":
        return f"{c.host_counted / GIB:.1f} GiB of host memory, {(resources.host_limit or 0) / GIB:.1f} GiB usable"
    text = f"GPU {c.gpu_counted / GIB:.1f} GiB of {resources.gpu_limit / GIB:.1f} usable"
    if resources.host_limit is not None:
        text += f", host {c.host_bytes / GIB:.1f} GiB of {resources.host_limit / GIB:.1f} usable"
    return text


def longest_context(workload: Workload, resources: Resources, fixed: dict | None = None,
                    base: OOMBConfig | None = None, limit: int = 1 << 26) -> int:
    """The longest sequence (a multiple of the page size, at most ``limit`` tokens) for which some
    configuration the chooser tries fits, keeping ``fixed``; 0 if none does."""
    fixed = dotted_options(fixed or {})
    base = (base or OOMBConfig()).with_options(fixed)  # the candidates read fixed options from the base
    return _longest_fitting(dataclasses.replace(workload, seq_len=limit), resources, base, fixed)


def _longest_fitting(workload: Workload, resources: Resources, base: OOMBConfig, fixed: dict) -> int:
    """The largest multiple of the page size below the asked length for which some configuration of
    the free options fits (memory grows with the context, so the search is monotone)."""
    def fits(tokens: int) -> bool:
        w = dataclasses.replace(workload, seq_len=tokens)
        return any(_fits(c, resources) for c in candidates(w, resources, base, fixed))

    return largest_context(fits, base.page_size, limit=workload.seq_len)


def fixed_from_options(options: dict) -> dict:
    """The options a user set (by dotted path; flat keys of earlier versions mapped, with a warning), as
    ``fixed`` for choose_config ("auto" values are left to the chooser; dtype names normalised)."""
    fixed = {}
    for key, value in dotted_options(options).items():
        if value == "auto" and key in AUTO_FIELDS:
            continue
        if key == "precision.kv_grad_dtype":
            value = _dtype_name(resolve_dtype(value, key))
        fixed[key] = value
    return fixed
