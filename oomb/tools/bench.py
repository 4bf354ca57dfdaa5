"""`oomb bench`: one training step (forward + backward, no optimizer) of plain HF and oomb's modes, over contexts.

    oomb bench --out-dir DIR             # the standard workload (docs/benchmarks.md) on this GPU
    oomb bench --quick --out-dir DIR     # tiny model on the CPU, 1K and 2K tokens, a few seconds
    oomb bench --replot DIR/bench.json   # redraw the table and plot of a run (e.g. where matplotlib is)

Modes: "hf" (SDPA + gradient checkpointing + oomb's chunked LM-head loss: what a savvy user runs
today), "dense", "dense+offload", "sparse", "sparse+offload". A mode this version of oomb does not
implement is reported as such, with no numbers but the planner's (labelled as predictions).

Isolation: each mode runs in its own worker process, forked from a fork server that has imported
torch and transformers but never touched a GPU or run an op (so forking is safe, and a worker costs
no second import). The worker builds the model once, runs a warm-up step (compilation, autotuning:
reported apart, excluded from the table), then the contexts in increasing order, each after
synchronising, emptying the allocator cache and resetting the peak statistics (GPU, and the host's
VmHWM). An out-of-memory error ends that mode's sweep only; a worker that dies (segfault, the
kernel's OOM killer, the time limit) is recorded and the next mode starts in a fresh process, with
a clean CUDA context and allocator. Results (JSON, markdown table, PNG plot) are rewritten after
every measurement, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import math
import multiprocessing as mp
import queue as queue_module
import shlex
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from .. import machine
from ..attention.backend import resolve_backend_name
from ..cli_options import add_option, flag_read_share, parse_read_share
from ..compiled_layers import can_compile, compile_problem, compiles
from ..config import (
    BACKENDS,
    CANDIDATE_POOLINGS,
    NORMALISER_PAGES,
    RERANK_CANDIDATES,
    SPARSE_POOLINGS,
    SPARSE_SCORES,
    OffloadConfig,
    OOMBConfig,
    PerformanceConfig,
    PrecisionConfig,
    SparseConfig,
    SparseResearch,
    resolve_dtype,
)
from ..engine import forward_backward, store_options, window_store_options
from ..kv.offload import HostSlabs, reserve_host_slabs
from ..loss import IGNORE_INDEX, chunked_cross_entropy, shift_labels
from ..models import fused_loss_possible_for_config, plain_attention, unwrap_causal_lm
from ..planning.choose import MEMORY_HEADROOM
from ..planning.memory import GIB, MODES, TrainingSetup, predict
from ..planning.model_shape import ModelShape
from ..planning.step_work import StepSpec, step_work
from ..training import presets
from ..units import parse_normaliser_pages
from .bench_choice import CHOSEN_FIELDS, chosen_for_loaded_model
from .bench_report import NOT_IMPLEMENTED, output_paths, replot, write_outputs
from .plan import Budget, format_tokens, is_implemented, largest_context, oomb_config_for, parse_tokens, preset_config

logger = logging.getLogger(__name__)

BENCH_MODES = ("hf", "dense", "dense+offload", "sparse+offload")
"""The modes of the side-by-side comparison; "sparse" (without offload) may be added."""
POLL_SECONDS = 0.5
"""How often the parent checks a silent worker for death or the time limit."""
WORKER_PRELOAD = ["oomb.tools.bench", "oomb.engine", "transformers", "transformers.models.qwen2.modeling_qwen2",
                  "transformers.models.llama.modeling_llama"]
"""Imported once by the fork server, so workers start in milliseconds."""


@dataclass
class BenchOptions:
    """One benchmark run. Defaults: the standard workload (docs/benchmarks.md) on one GPU."""

    preset: str = "qwen2.5-7b"
    contexts: list[int] = field(default_factory=lambda: [32768, 65536, 131072, 262144])
    modes: list[str] = field(default_factory=lambda: list(BENCH_MODES))
    device: str = "cuda"
    chunk_size: int = 4096
    page_size: int = 128
    kv_grad_dtype: str = "float32"
    backend: str = PerformanceConfig.backend
    """Attention kernels of the oomb modes (OOMBConfig.performance.backend); "auto" is resolved by the step for the
    model, dtype and device: cudnn for bf16 on CUDA, triton with ``deterministic`` or for logit
    softcapping (oomb/engine.py; the report names it: ``backend_for``)."""
    deterministic: bool = False
    """Bitwise-deterministic kernels (OOMBConfig.precision.deterministic): "auto" resolves to triton."""
    checkpoint_layers: bool = True
    recompute_logits: bool = True
    compile_layers: bool | None = None
    """performance.compile_layers (None: on for a CUDA step of a model without experts)."""
    keep_attention_outputs: bool = False
    """OOMBConfig.performance.keep_attention_outputs: stage 2 takes stage 1's attention outputs (with ``chosen`` and not
    given: the chooser's)."""
    offload_resident_layers: int = 0
    """Offload modes: the first this many layers keep their pages on the GPU (OOMBConfig.offload.resident_layers;
    `oomb train` chooses how many fit)."""
    fp32_grad_accumulation: bool = False
    """Off by default: both HF and oomb then leave bf16 .grad, a like-for-like comparison."""
    loss_chunk_tokens: int = 1024
    sparse_query_block_pages: int = 1
    """Sparse modes: query blocks sharing one selection (OOMBConfig.sparse.query_block_pages)."""
    sparse_budget: int = SparseConfig.budget
    """Sparse modes: history pages each query block reads besides the sinks (OOMBConfig.sparse.budget)."""
    sparse_read_share: float | str | None = "auto"
    """Sparse modes: the share of each block's history read at least (OOMBConfig.sparse.read_share)."""
    sparse_pooling: str = SparseResearch.pooling
    """Sparse modes: how a block's score rows combine (OOMBConfig.sparse.research.pooling)."""
    sparse_score: str = SparseConfig.score
    """Sparse modes: how a block scores a page (OOMBConfig.sparse.score)."""
    sparse_rerank_factor: int = SparseResearch.rerank_factor
    """Sparse modes, score "rerank": candidates per block / budget (OOMBConfig.sparse.research.rerank_factor)."""
    sparse_rerank_candidates: str = SparseResearch.rerank_candidates
    """Sparse modes, score "rerank": who proposes the candidates (OOMBConfig.sparse.research.rerank_candidates)."""
    sparse_candidate_pooling: str = SparseResearch.candidate_pooling
    """Sparse modes, score "rerank": how a block's rows pool them (OOMBConfig.sparse.research.candidate_pooling)."""
    sparse_normaliser_pages: int | str | None = SparseResearch.normaliser_pages
    """Sparse modes, pooling softmax_max: its normaliser's bound (OOMBConfig.sparse.research.normaliser_pages)."""
    warmup_tokens: int = 8192
    progress: bool = False
    """Show each oomb step's progress over its chunks (on stderr): a step stopped at the time limit
    then still tells how far it got."""
    max_seconds: float = math.inf
    """Skip a context whose step, extrapolated from the mode's last one (``expected_seconds``), would end
    past this many seconds from the start; stop a worker still running then."""
    seed: int = 0
    threads: int | None = None
    """CPU threads of a worker (torch.set_num_threads); None: torch's default."""
    out_dir: str = "bench-results"
    name: str = "bench"
    chosen: bool = False
    """oomb modes run the plan `oomb train`'s chooser picks from the memory free after the weights load
    (tools/bench_choice.py) for the step options not in ``given``."""
    given: tuple[str, ...] = ()
    """Step options set on the command line (``chosen`` keeps them)."""

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise ValueError(f"unknown mode(s) {unknown}; modes: {', '.join(MODES)}")
        if not self.contexts or min(self.contexts) <= 0:
            raise ValueError(f"contexts={self.contexts} must be positive token counts")
        self.contexts = sorted(set(self.contexts))
        self.oomb_config()  # validates chunk and page sizes early

    @property
    def dtype(self) -> torch.dtype:
        """bf16 on a GPU; fp32 on the CPU (bf16 there is 3-7x slower and tells nothing)."""
        return torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32

    def backend_for(self, shape: ModelShape) -> str:
        """The backend the oomb modes run on ``shape``: "auto" resolved for this device and dtype, and, as
        the engine resolves it, triton for a model with attention logit softcapping, which cuDNN lacks."""
        name = resolve_backend_name(self.backend, torch.device(self.device), self.dtype, self.deterministic)
        if self.backend == "auto" and name == "cudnn" and shape.logit_softcap:
            return "triton"
        return name

    def compiled_layers_for(self, shape: ModelShape) -> bool:
        """Whether oomb modes compile the decoder layers (performance.compile_layers as the step resolves it)."""
        chosen = compiles(self.oomb_config(), torch.device(self.device).type == "cuda", bool(shape.num_experts))
        return chosen and (self.compile_layers is True or (can_compile() and compile_problem() is None))

    def fused_loss_for(self) -> bool:
        """Whether oomb modes run the fused loss on the preset's model (models.fused_loss_possible_for_config)."""
        return fused_loss_possible_for_config(preset_config(self.preset), self.dtype)

    def oomb_config(self) -> OOMBConfig:
        research = SparseResearch(pooling=self.sparse_pooling, rerank_factor=self.sparse_rerank_factor,
                                  rerank_candidates=self.sparse_rerank_candidates,
                                  candidate_pooling=self.sparse_candidate_pooling,
                                  normaliser_pages=self.sparse_normaliser_pages)
        sparse = SparseConfig(budget=self.sparse_budget, read_share=self.sparse_read_share, score=self.sparse_score,
                              query_block_pages=self.sparse_query_block_pages, research=research)
        performance = PerformanceConfig(backend=self.backend, checkpoint_layers=self.checkpoint_layers,
                                        recompute_logits=self.recompute_logits, compile_layers=self.compile_layers,
                                        loss_chunk_tokens=self.loss_chunk_tokens,
                                        keep_attention_outputs=self.keep_attention_outputs)
        precision = PrecisionConfig(kv_grad_dtype=self.kv_grad_dtype, deterministic=self.deterministic,
                                    fp32_grad_accumulation=self.fp32_grad_accumulation)
        return OOMBConfig(chunk_size=self.chunk_size, page_size=self.page_size, sparse=sparse,
                          offload=OffloadConfig(resident_layers=self.offload_resident_layers),
                          performance=performance, precision=precision)



QUICK = dict(preset=presets.TINY_PRESET, contexts=[1024, 2048], device="cpu", chunk_size=512, warmup_tokens=512,
             threads=1, name="bench_quick")
"""--quick: the demo's tiny model on the CPU, all modes, in a few seconds. One thread: the tiny model
gains nothing from more, and OpenMP threads that wait on each other crawl on a busy 2-core machine."""


# ---------------------------------------------------------------------------------------------
# Worker process: one mode, all contexts
# ---------------------------------------------------------------------------------------------

def build_model(preset: str, max_tokens: int, device: torch.device, dtype: torch.dtype, seed: int,
                layers: int | None = None):
    """A model of ``preset`` with random weights, built directly on ``device`` (same weights per seed);
    ``layers``: only the first that many decoder layers (each the preset's shape)."""
    from transformers import AutoModelForCausalLM

    cfg = preset_config(preset, max_positions=max_tokens)
    if layers is not None:
        if not 1 <= layers <= cfg.num_hidden_layers:
            raise ValueError(f"layers={layers} must be in 1..{cfg.num_hidden_layers} ({preset})")
        cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:layers]
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(previous)
    return plain_attention(model).train()


def hf_step(model, ids: torch.Tensor, loss_chunk_tokens: int) -> float:
    """Plain HF with the tools a savvy user adds: SDPA, gradient checkpointing, a chunked loss."""
    enable_checkpointing(model)
    try:
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        targets = shift_labels(ids)
        # autograd's loss (oomb's fused one is oomb's own): HF baselines stay comparable across commits
        loss = chunked_cross_entropy(hidden, targets, model.lm_head, int((targets != IGNORE_INDEX).sum()),
                                     loss_chunk_tokens, fused=False)
        loss.backward()
    finally:
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    return float(loss.detach())


def enable_checkpointing(model) -> None:
    """HF's gradient checkpointing (non-reentrant) under its current name where transformers has it
    (``activation_checkpointing_enable``, 5.2x): the old name warns of its removal on every call."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def make_step(mode: str, options: BenchOptions):
    """The function running one step of ``mode``: (model, ids) -> loss."""
    if mode == "hf":
        return lambda model, ids: hf_step(model, ids, options.loss_chunk_tokens)
    config = oomb_config_for(mode, options.oomb_config())
    progress = options.progress
    if not config.offload.enabled:
        return lambda model, ids: float(forward_backward(model, ids, config=config, progress=progress))
    slabs = HostSlabs()  # pinned once per size, reused by every step of the sweep

    def offload_step(model, ids):
        return float(forward_backward(model, ids, config=config, host_slabs=slabs, progress=progress))

    def prepare(model, ids):
        """Pin the host memory of a step of this length before it is timed."""
        causal_lm = unwrap_causal_lm(model)
        options = store_options(causal_lm, ids.shape[0], ids.shape[1], config, ids.device)
        windows = window_store_options(causal_lm, ids.shape[1], options["context"])  # window layers' slots
        reserve_host_slabs(slabs, resident_layers=config.offload.resident_layers, chunk_size=config.chunk_size,
                           **options, **windows)

    offload_step.prepare = prepare
    return offload_step


def warmup_tokens(mode: str, options: BenchOptions) -> int:
    """The warm-up step's length: options.warmup_tokens, and in sparse modes long enough that a chunk's
    history outgrows the sinks and the budget (with rerank: its candidates, so that the score kernel tunes
    for its largest calls too; its tuning key is the scored pages' power of two), so the sparse kernels
    compile and tune before timing (on a GPU, when some context is that long)."""
    config = oomb_config_for(mode, options.oomb_config()) if mode.startswith("sparse") else None
    if config is None or torch.device(options.device).type != "cuda":
        return options.warmup_tokens
    budget = max([config.sparse.budget, *(config.sparse.layer_budgets or [])])
    factor = config.sparse.research.rerank_factor if config.sparse.resolved_score == "rerank" else 1
    for pages in dict.fromkeys((factor * budget, budget)):  # rerank's candidates if the contexts reach them
        selecting = (config.sparse.sink_pages + pages + 1) * config.page_size  # history that selects
        tokens = (-(-selecting // config.chunk_size) + 1) * config.chunk_size
        if max(options.contexts) >= tokens:
            return max(options.warmup_tokens, tokens)
    return options.warmup_tokens


def token_ids(vocab: int, tokens: int, seed: int, device: torch.device) -> torch.Tensor:
    """The same random sequence for every mode (drawn on the CPU, then moved)."""
    generator = torch.Generator().manual_seed(seed + tokens)
    return torch.randint(0, vocab, (1, tokens), generator=generator).to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(step, model, ids: torch.Tensor, device: torch.device) -> dict:
    """Time and peak memory of one step, after synchronising and resetting the peak statistics."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    _sync(device)
    rss_before = machine.current_rss_bytes() or 0
    machine.reset_peak_rss()
    start = time.perf_counter()
    loss = step(model, ids)
    _sync(device)
    seconds = time.perf_counter() - start
    host_peak = machine.peak_rss_bytes()
    row = {"seconds": round(seconds, 3), "loss": round(loss, 4),
           "host_peak_gib": round(host_peak / GIB, 4), "host_step_gib": round((host_peak - rss_before) / GIB, 4)}
    if cuda:
        row["peak_gpu_above_weights_gib"] = round((torch.cuda.max_memory_allocated(device) - base) / GIB, 3)
        row["peak_gpu_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / GIB, 3)
    model.zero_grad(set_to_none=True)
    return row


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err))  # CPU allocator


def _worker(mode: str, options: BenchOptions, deadline: float, out) -> None:
    """Entry point of a worker process: events go to the queue ``out``."""
    try:
        _run_mode(mode, options, deadline, out.put)
    except BaseException as err:
        out.put({"event": "error", "error": f"{type(err).__name__}: {err}"})
        raise
    finally:
        out.close()
        out.join_thread()


def expected_seconds(mode: str, last: tuple[int, float], tokens: int) -> float:
    """A step's time extrapolated from the mode's last one: dense attention makes it quadratic in the
    context; sparse attention reads a fixed budget per query, so past the budget it grows linearly."""
    growth = 1 if MODES[mode].attention == "sparse" else 2
    return last[1] * (tokens / last[0]) ** growth


def _run_mode(mode: str, options: BenchOptions, deadline: float, emit) -> None:
    device = torch.device(options.device)
    if options.threads:
        torch.set_num_threads(options.threads)
    if device.type == "cuda":
        gpu = machine.detect_gpu(device)
        emit({"event": "device", "gpu": gpu.name, "total_bytes": gpu.total_bytes, "count": torch.cuda.device_count()})
    start = time.perf_counter()
    # Longer than options.warmup_tokens, a sparse warm-up stays within the contexts, whatever the chunk.
    model = build_model(options.preset, max(options.contexts + [options.warmup_tokens]), device, options.dtype,
                        options.seed)
    _sync(device)
    emit({"event": "init", "seconds": round(time.perf_counter() - start, 2)})
    too_long: tuple[int, ...] = ()
    if options.chosen and MODES[mode].attention != "hf":
        choice = chosen_for_loaded_model(mode, options, model, device)
        options = dataclasses.replace(options, **choice.changes)
        too_long = choice.too_long
        emit({"event": "chosen", "options": choice.changes, "plan": choice.plan})
        for tokens in too_long:  # a result of the plan, as out of memory is one of a step
            emit({"event": "row", "tokens": tokens, "status": f"does not fit (the chooser): {choice.why_too_long}"})
        if len(too_long) == len(options.contexts):
            emit({"event": "done"})
            return
    warmup = warmup_tokens(mode, options)
    step = make_step(mode, options)
    vocab = model.config.vocab_size
    start = time.perf_counter()
    step(model, token_ids(vocab, warmup, options.seed, device))
    _sync(device)
    emit({"event": "warmup", "tokens": warmup, "seconds": round(time.perf_counter() - start, 2)})
    last = None  # (tokens, seconds) of the last completed step
    stopped = None
    for tokens in options.contexts:
        if tokens in too_long:
            continue
        if stopped:
            emit({"event": "row", "tokens": tokens, "status": f"skipped: {stopped}"})
            continue
        if last is not None:
            expected = expected_seconds(mode, last, tokens)
            if time.time() + expected > deadline:
                emit({"event": "row", "tokens": tokens,
                      "status": f"skipped: predicted {expected:.0f} s exceeds the time left (--max-seconds)"})
                stopped = "a shorter context was predicted past the time limit"
                continue
        ids = token_ids(vocab, tokens, options.seed, device)
        emit({"event": "start", "tokens": tokens})
        try:
            if hasattr(step, "prepare"):
                step.prepare(model, ids)
            row = {**measure(step, model, ids, device), "status": "ok"}
            last = (tokens, row["seconds"])
        except Exception as err:
            if not _is_oom(err):
                raise
            row = {"status": "out of memory"}
            stopped = "out of memory at a shorter context"
        del ids
        model.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        emit({"event": "row", "tokens": tokens, **row})
    emit({"event": "done"})


# ---------------------------------------------------------------------------------------------
# Parent: the sweep, predictions, outputs
# ---------------------------------------------------------------------------------------------

def _mp_context():
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(WORKER_PRELOAD)
        return ctx
    return mp.get_context("spawn")


def _prediction(mode: str, tokens: int, shape: ModelShape, options: BenchOptions) -> dict:
    oomb = MODES[mode].attention != "hf"
    setup = TrainingSetup(options.dtype, 1, "none", compiled_layers=oomb and options.compiled_layers_for(shape),
                          fused_loss=oomb and options.fused_loss_for())
    p = predict(mode, shape, tokens, options.oomb_config(), setup)
    return {"predicted_gpu_above_weights_gib": round(p.gpu_above_weights / GIB, 3),
            "predicted_host_gib": round(p.host_total / GIB, 3)}


def _argv() -> list[str]:
    """The command line as typed: `python -m oomb.cli bench ...` shows as `oomb bench ...`."""
    return ["oomb" if Path(sys.argv[0]).name in ("cli.py", "oomb") else sys.argv[0], *sys.argv[1:]]


def new_report(options: BenchOptions, shape: ModelShape) -> dict:
    device = torch.device(options.device)
    report = {
        "tool": "oomb bench",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in _argv()),
        "machine": machine.machine_info(device),
        "versions": machine.versions(),
        "workload": {
            "preset": options.preset, "shape": dataclasses.asdict(shape), "params": shape.num_params(),
            "weights_gib": round(shape.num_params() * options.dtype.itemsize / GIB, 3),
            "dtype": str(options.dtype).removeprefix("torch."), "step": "one forward+backward, no optimizer",
            "hf": MODES["hf"].description,
            "options": {**dataclasses.asdict(options), "max_seconds": str(options.max_seconds)},
            "backend": options.backend_for(shape),
        },
        "modes": {m: {"status": "implemented" if is_implemented(m) else "planned", "description": MODES[m].description}
                  for m in options.modes},
        "rows": [],
    }
    return report


def _record_gpu(report: dict, event: dict, shape: ModelShape, options: BenchOptions) -> None:
    """A worker's description of the GPU, and the planner's longest context for it (once per run)."""
    if "gpu" in report["machine"]:
        return
    report["machine"].update(gpu=event["gpu"], gpu_memory_gib=round(event["total_bytes"] / GIB, 1),
                             gpu_count=event["count"])
    budget = Budget(event["total_bytes"], machine.host_available_bytes() or event["total_bytes"])
    setup = TrainingSetup(options.dtype, 1, "none", fused_loss=options.fused_loss_for())  # (hf: not read there)

    def fits(mode: str, tokens: int) -> bool:
        p = predict(mode, shape, tokens, options.oomb_config(), setup)
        return p.gpu_total <= budget.gpu_limit and p.host_total <= budget.host_limit

    report["planner"] = {
        "gpu_limit_gib": round(budget.gpu_limit / GIB, 2), "host_limit_gib": round(budget.host_limit / GIB, 2),
        "largest_context": {m: largest_context(lambda t, m=m: fits(m, t), options.page_size) for m in options.modes},
    }


def step_spec(mode: str, tokens: int, shape: ModelShape, options: BenchOptions) -> StepSpec:
    """The floor model's view (oomb/planning/step_work.py) of a bench step of ``mode`` (every weight trained)."""
    config = None if MODES[mode].attention == "hf" else oomb_config_for(mode, options.oomb_config())
    return StepSpec.from_config(shape, tokens, config, dtype=options.dtype,
                                fused_loss=config is not None and options.fused_loss_for())


def executed_flops(mode: str, tokens: int, shape: ModelShape, options: BenchOptions) -> float:
    """FLOPs a step of ``mode`` executes (linear layers with every recomputation and replay, attention,
    scoring, loss), as oomb/planning/step_work.py counts them for its floors."""
    return sum(work.flops for work in step_work(step_spec(mode, tokens, shape, options)).values())


def _add_row(report: dict, mode: str, tokens: int, row: dict, shape: ModelShape, options: BenchOptions) -> dict:
    row = {"mode": mode, "tokens": tokens, **{k: v for k, v in row.items() if k != "event"}}
    if row.get("status") == "ok" and row.get("seconds"):
        row["tokens_per_s"] = round(tokens / row["seconds"], 1)
        achieved = executed_flops(mode, tokens, shape, options) / row["seconds"] / 1e12
        row["executed_tflop_per_s"] = float(f"{achieved:.4g}")
    row.update(_prediction(mode, tokens, shape, options))
    measured, predicted = row.get("peak_gpu_above_weights_gib"), row["predicted_gpu_above_weights_gib"]
    if measured:
        row["prediction_error"] = round(predicted / measured - 1, 4)
    report["rows"].append(row)
    return row


def _print_row(row: dict) -> None:
    text = f"{row['mode']:>15} {format_tokens(row['tokens']):>6}: "
    if row["status"] == "ok":
        text += f"{row['seconds']:.2f} s"
        if "peak_gpu_above_weights_gib" in row:
            text += (f", GPU {row['peak_gpu_above_weights_gib']:.2f} GiB above weights "
                     f"(predicted {row['predicted_gpu_above_weights_gib']:.2f})")
        text += f", host peak {row['host_peak_gib']:.2f} GiB, loss {row['loss']:.4f}"
        if "tokens_per_s" in row:
            text += f", {row['tokens_per_s']:,.0f} tokens/s, {row['executed_tflop_per_s']:.3g} TFLOP/s executed"
    else:
        text += row["status"]
    print(text, flush=True)


def run_bench(options: BenchOptions) -> dict:
    """Run the sweep; write JSON, markdown and PNG into options.out_dir after every measurement."""
    shape = ModelShape.from_hf_config(preset_config(options.preset))
    report = new_report(options, shape)
    paths = output_paths(options.out_dir, options.name)
    write_outputs(report, paths, plot=False)
    started = time.time()
    deadline = started + options.max_seconds
    ctx = None
    for mode in options.modes:
        info = report["modes"][mode]
        if not is_implemented(mode):
            for tokens in options.contexts:
                _print_row(_add_row(report, mode, tokens, {"status": NOT_IMPLEMENTED}, shape, options))
            continue
        if time.time() >= deadline:
            for tokens in options.contexts:
                _add_row(report, mode, tokens, {"status": "skipped: time limit reached before this mode"},
                         shape, options)
            continue
        ctx = ctx or _mp_context()
        _sweep_mode(ctx, mode, options, deadline, report, info, shape, paths)
        write_outputs(report, paths, plot=False)
    report["seconds"] = round(time.time() - started, 1)
    write_outputs(report, paths)
    print(f"wrote {', '.join(str(p) for p in paths.values() if p.exists())}", flush=True)
    return report


def _sweep_mode(ctx, mode, options, deadline, report, info, shape, paths) -> None:
    """Run one mode's worker, turning its events into rows; record its death or the time limit."""
    events = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(mode, options, deadline, events), name=f"oomb-bench-{mode}")
    proc.start()
    pending = list(options.contexts)  # contexts without a row yet
    in_flight = None
    failure = None
    timed_out = False
    while pending:
        try:
            event = events.get(timeout=POLL_SECONDS)
        except queue_module.Empty:
            if not proc.is_alive():
                failure = failure or f"worker died (exit code {proc.exitcode})"
                break
            if time.time() > deadline:
                proc.kill()
                failure, timed_out = "time limit (--max-seconds) reached", True
                break
            continue
        kind = event["event"]
        if kind == "chosen":  # the rows' predictions and FLOPs follow the plan that runs
            options = dataclasses.replace(options, **event["options"])
            info.update(chosen=event["options"], plan=event["plan"])
            print(f"{mode:>15} plan: {event['plan']}", flush=True)
        elif kind == "device":
            _record_gpu(report, event, shape, options)
        elif kind in ("init", "warmup"):
            info[f"{kind}_seconds"] = event["seconds"]
            if kind == "warmup":
                info["warmup_tokens"] = event["tokens"]
                if MODES[mode].attention != "hf":  # as the step resolves performance.compile_layers
                    info["compiled_layers"] = options.compiled_layers_for(shape)
            print(f"{mode:>15} {kind}: {event['seconds']:.1f} s", flush=True)
        elif kind == "start":
            in_flight = event["tokens"]
        elif kind == "row":
            in_flight = None
            pending.remove(event["tokens"])
            _print_row(_add_row(report, mode, event["tokens"], event, shape, options))
            write_outputs(report, paths, plot=event["status"] == "ok" and options.device != "cpu")
        elif kind == "error":
            failure = f"error: {event['error']}"
        elif kind == "done":
            break
    proc.join(timeout=60)
    if proc.is_alive():
        proc.kill()
        proc.join()
    info["worker_exit_code"] = proc.exitcode
    if pending:
        failure = failure or f"worker ended early (exit code {proc.exitcode})"
        where = f"at {format_tokens(in_flight)}" if in_flight else "before its first measurement"
        info["stopped" if timed_out else "failure"] = f"{failure} {where}"
        for tokens in list(pending):
            if tokens == in_flight:
                status = f"stopped: {failure}" if timed_out else failure
            else:
                status = f"skipped: {failure} {where}"
            _print_row(_add_row(report, mode, tokens, {"status": status}, shape, options))


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `oomb bench`; defaults are the standard workload, --quick the CPU smoke run."""
    d = BenchOptions()
    parser.add_argument("--quick", action="store_true",
                        help="tiny model on the CPU, contexts 1K 2K (overridable by the options below)")
    parser.add_argument("--replot", metavar="JSON", help="only redraw the table and plot of a finished run")
    parser.add_argument("--preset", "--model", dest="preset", choices=list(presets.PRESETS))
    parser.add_argument("--contexts", "--context", "--seq-len", dest="contexts", type=parse_tokens, nargs="+",
                        help="e.g. 32K 64K 128K 256K")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), help=f"default: {' '.join(BENCH_MODES)}")
    parser.add_argument("--device", help="cuda (default) or cpu")
    parser.add_argument("--chunk-size", type=parse_tokens)
    parser.add_argument("--page-size", type=parse_tokens)
    parser.add_argument("--kv-grad-dtype", help=f"default {d.kv_grad_dtype}")
    parser.add_argument("--fp32-grad-accumulation", action=argparse.BooleanOptionalAction, default=None,
                        help="oomb's fp32 sum of chunk gradients (+4 bytes/parameter); off (the default here): bf16 "
                             ".grad like HF")
    parser.add_argument("--backend", choices=BACKENDS,
                        help=f"attention kernels (default {d.backend}: cudnn for bf16 on CUDA, triton with "
                             "--deterministic, torch on a CPU)")
    parser.add_argument("--deterministic", action="store_true", default=None,
                        help="bitwise-deterministic kernels: backend auto resolves to triton")
    parser.add_argument("--checkpoint-layers", action=argparse.BooleanOptionalAction,
                        help="layer replay in backward (default on; with --chosen unset: the chooser's)")
    parser.add_argument("--recompute-logits", action=argparse.BooleanOptionalAction,
                        help="--no-recompute-logits keeps the chunk's log-probabilities for the backward instead of "
                             "recomputing each loss slice's logits (more memory: chunk x vocabulary x 4 bytes; one "
                             "LM-head forward less); default on; with --chosen unset: the chooser's")
    parser.add_argument("--compile-layers", action=argparse.BooleanOptionalAction,
                        help="oomb modes: compile each decoder layer (fused norms, rotary, SiLU, adds; attention "
                             "outside the graph; implies --no-checkpoint-layers); default: on for a CUDA step "
                             "without layer replay (models without experts, not --deterministic)")
    parser.add_argument("--keep-attention-outputs", action=argparse.BooleanOptionalAction,
                        help="oomb modes without offload: stage 1 keeps every layer's attention output for stage 2, "
                             "which skips recomputing attention (GPU memory: (head dim x 2 + 4) bytes per token, "
                             "query head and layer); default off; with --chosen unset: the chooser's (steps "
                             "without offload keep them where they fit)")
    parser.add_argument("--resident-layers", dest="offload_resident_layers", type=int,
                        help="offload modes: the first N layers keep their pages on the GPU (default 0; "
                             "`oomb plan` prints how many `oomb train` would keep)")
    add_option(parser, "--sparse-query-block-pages", "--query-block-pages", dest="sparse_query_block_pages", type=int,
               help="sparse modes: query blocks sharing one selection (default 1)")
    parser.add_argument("--sparse-budget", type=int,
                        help=f"sparse modes: history pages per query block, besides the sinks "
                             f"(default {d.sparse_budget})")
    parser.add_argument("--sparse-read-share", type=parse_read_share, metavar="SHARE",
                        help="sparse modes: the share of each block's history read at least, 'none' for the fixed "
                             "budget (default: 0.35 over the default budget; none, the fixed budget, where "
                             "--sparse-budget is given)")
    parser.add_argument("--sparse-pooling", choices=SPARSE_POOLINGS, help=f"default {d.sparse_pooling}")
    parser.add_argument("--sparse-score", choices=SPARSE_SCORES, help=f"default {d.sparse_score}")
    parser.add_argument("--sparse-rerank-factor", type=int,
                        help=f"score rerank: candidate pages / budget (default {d.sparse_rerank_factor})")
    parser.add_argument("--sparse-rerank-candidates", choices=RERANK_CANDIDATES,
                        help=f"score rerank: the summary score proposing the candidates "
                             f"(default {d.sparse_rerank_candidates})")
    parser.add_argument("--sparse-candidate-pooling", choices=("auto", *CANDIDATE_POOLINGS),
                        help=f"score rerank: how a block's rows pool the candidates' summary scores "
                             f"(default {d.sparse_candidate_pooling})")
    parser.add_argument("--sparse-normaliser-pages", type=parse_normaliser_pages, default=argparse.SUPPRESS,
                        help="softmax_max pooling: history pages its normaliser counts besides the sinks, or "
                             f"'all' (default {d.sparse_normaliser_pages}: {NORMALISER_PAGES} where it runs)")
    parser.add_argument("--chosen", action="store_true",
                        help="oomb modes run what `oomb train`'s chooser picks for the longest context from the "
                             "memory free after the weights load (every weight trained, no optimizer), for the "
                             "step options not given here; the mode fixes attention and offload")
    parser.add_argument("--warmup-tokens", type=parse_tokens)
    parser.add_argument("--progress", action="store_true", default=None,
                        help="show each oomb step's progress over its chunks (stderr)")
    parser.add_argument("--max-seconds", type=float, help="time budget of the whole sweep (default: none)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--threads", type=int, help="CPU threads per worker (default: torch's; 1 with --quick)")
    parser.add_argument("--out-dir", help=f"where NAME.json, NAME.md, NAME.png go (default {d.out_dir})")
    parser.add_argument("--name", help="file name stem (default bench, or bench_quick with --quick)")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    values = dict(QUICK) if args.quick else {}
    for name in ("preset", "contexts", "modes", "device", "chunk_size", "page_size", "kv_grad_dtype", "backend",
                 "deterministic", "fp32_grad_accumulation", "keep_attention_outputs", "offload_resident_layers",
                 "sparse_query_block_pages",
                 "sparse_budget", "sparse_read_share",
                 "sparse_pooling", "sparse_score", "sparse_rerank_factor", "sparse_rerank_candidates",
                 "sparse_candidate_pooling", "warmup_tokens", "progress",
                 "max_seconds", "seed", "threads", "out_dir", "name"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    for name in ("checkpoint_layers", "recompute_logits", "compile_layers"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.sparse_read_share is not None or args.sparse_budget is not None:
        values["sparse_read_share"] = flag_read_share(args.sparse_read_share, args.sparse_budget)
    if hasattr(args, "sparse_normaliser_pages"):  # given ('all' is None: every history page)
        values["sparse_normaliser_pages"] = args.sparse_normaliser_pages
    if values.get("keep_attention_outputs") and any(MODES[m].offload for m in values.get("modes", BENCH_MODES)):
        raise SystemExit("--keep-attention-outputs runs without offload: give --modes without the offload modes "
                         "(e.g. --modes hf dense sparse)")
    if args.chosen:
        values.update(chosen=True, given=tuple(name for name in CHOSEN_FIELDS if name in values))
    if "kv_grad_dtype" in values:
        resolve_dtype(values["kv_grad_dtype"], "kv_grad_dtype")
    options = BenchOptions(**values)
    if torch.device(options.device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError("no CUDA device on this machine: use --quick, or --device cpu with a small preset "
                         f"(--preset {presets.TINY_PRESET})")
    if torch.device(options.device).type == "cpu":
        check_weights_fit_host(options)
    return options


def check_weights_fit_host(options: BenchOptions) -> None:
    """A CPU bench of a preset whose weights alone exceed the available host memory is refused before its worker
    builds the model: the kernel would kill the worker (and maybe other processes) instead."""
    need = ModelShape.from_hf_config(preset_config(options.preset)).num_params() * options.dtype.itemsize
    available = machine.host_free_bytes()
    if need > MEMORY_HEADROOM * available:
        raise ValueError(f"the {options.preset} preset's weights alone need {need / GIB:.1f} GiB in "
                         f"{str(options.dtype).removeprefix('torch.')} on this CPU, and {available / GIB:.1f} GiB of "
                         f"host memory are available: give a small preset (--preset {presets.TINY_PRESET}) or --quick")


def main(args: argparse.Namespace) -> int:
    """Run `oomb bench`; exit code 1 when a worker died or raised (out of memory is a result, not a failure)."""
    if args.replot:
        paths = replot(args.replot, args.out_dir)
        print(f"wrote {', '.join(str(p) for p in paths.values() if p.exists())}")
        return 0
    report = run_bench(options_from_args(args))
    return 1 if any(i.get("failure") for i in report["modes"].values()) else 0
