"""`oomb plan`: how much GPU and host memory a step needs, and the longest context that fits.

    oomb plan --model qwen2.5-7b --context 1M --gpu-gib 139 --host-gib 125
    oomb plan --model path/to/local/model --context 256K --lora-rank 16 --json

For every mode (plain HF, oomb dense/sparse with host offload off/on) it prints the predicted peak
GPU memory by term, the host RAM, whether the step fits the GPU and host budgets, and the largest
context that does. The numbers come from ``oomb.planning.memory.predict``; modes this version of oomb does
not implement yet are modelled from the design and labelled "planned", never "measured".

Sliding-window layers shorter than the step keep, on the GPU or with offload in host memory, only
the last W - 1 keys of every chunk before the current one plus that chunk (stage 2 runs the chunks in
reverse and needs each window's earlier K/V again; see ``oomb.planning.memory.predict``): about (W - 1) / C of
a global layer's pages, none saved when W - 1 >= C. Mixtures of experts count
every expert's weights and a chunk's top-k routed rows of activations (``oomb.planning.model_shape.ModelShape``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import machine
from ..cli_options import add_option, flag_read_share, parse_read_share, resolve_model
from ..compiled_layers import may_compile_config
from ..config import (
    ATTENTION_MODES,
    BACKENDS,
    OffloadConfig,
    OOMBConfig,
    PerformanceConfig,
    PrecisionConfig,
    SparseConfig,
    resolve_dtype,
)
from ..models import fused_loss_possible_for_config
from ..planning.choose import (
    AUTO_FIELDS,
    Choice,
    NoConfigFitsError,
    Resources,
    Workload,
    choose_config,
    fixed_from_options,
    longest_context,
)
from ..planning.fit import CUDA_CONTEXT_BYTES, SAFETY_MARGIN, Budget, largest_context
from ..planning.memory import (
    GIB,
    GPU_TERMS,
    HOST_TERMS,
    MODES,
    MemoryPrediction,
    Mode,
    TrainingSetup,
    predict,
    summary_vectors,
)
from ..planning.model_shape import ModelShape
from ..planning.step_time import GPU_MEMORY_GIB, gpu_kind
from ..training import presets
from ..training.config import LoraSection, OptimSection
from ..units import TOKEN_SUFFIXES, format_tokens, parse_tokens  # noqa: F401 - re-exported

GROWTH_TOKENS = 10_000
"""GPU memory growth is reported per this many more tokens."""
DEFAULT_CONTEXT = 131072

def preset_config(name: str, max_positions: int = DEFAULT_CONTEXT):
    """A transformers config of preset ``name`` (oomb.training.presets, shared with `oomb train`)."""
    return presets.preset_config(name, max_positions)


def model_config(model: str):
    """The transformers (text) config of a preset name or of a local model directory's config.json
    (nothing downloaded)."""
    if model in presets.PRESETS:
        return preset_config(model)
    path = Path(resolve_model(model))  # smollm2: the real model, converted once
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model!r} is neither a preset ({', '.join(presets.PRESETS)}) "
                         "nor a local directory with a config.json")
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:  # not JSON, an unknown model_type, ...
        raise ValueError(f"--model {model!r}: its config.json cannot be read: {err}") from err
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def load_model_shape(model: str) -> ModelShape:
    """The shape of a preset name or of a local model directory's config.json (nothing downloaded)."""
    return ModelShape.from_hf_config(model_config(model))


def _step_kernels(model: str, shape: ModelShape, setup: TrainingSetup) -> dict[str, bool]:
    """Workload.may_compile and may_fuse_loss as `oomb train` would find them for this model on this
    machine: one process only (tensor- or context-parallel steps keep both off, their heads being
    sharded); compiled layers where this machine compiles (a GPU planned from a machine without one is
    assumed to, Triton coming with oomb[gpu]), for a model without experts or active dropout;
    the fused loss for a plain linear head that softcaps no logits, not in float16. So the plan is the one
    training picks. A model whose config cannot be read counts neither (never less memory)."""
    try:
        cfg = model_config(model)
    except (ValueError, OSError):
        return {"may_compile": False, "may_fuse_loss": False}
    if shape.tp > 1 or setup.context_parallel > 1:
        return {"may_compile": False, "may_fuse_loss": False}
    elsewhere = not torch.cuda.is_available()  # a GPU planned from a machine without one
    compile_ok = may_compile_config(cfg, True, compiles_elsewhere=elsewhere) and not shape.num_experts
    return {"may_compile": compile_ok, "may_fuse_loss": fused_loss_possible_for_config(cfg, setup.dtype)}


# ---------------------------------------------------------------------------------------------
# Which modes this version runs
# ---------------------------------------------------------------------------------------------

def is_implemented(mode: str | Mode) -> bool:
    """True when this version of oomb can run ``mode`` (hf always; oomb modes per OOMBConfig)."""
    mode = MODES[mode] if isinstance(mode, str) else mode
    if mode.attention == "hf":
        return True
    config_fields = {f.name for f in dataclasses.fields(OOMBConfig)}
    return mode.attention in ATTENTION_MODES and (not mode.offload or "offload" in config_fields)


def oomb_config_for(mode: str | Mode, base: OOMBConfig) -> OOMBConfig:
    """The OOMBConfig that runs oomb ``mode``: ``base`` with the mode's attention and offload.enabled."""
    mode = MODES[mode] if isinstance(mode, str) else mode
    if mode.attention == "hf":
        raise ValueError("mode 'hf' runs plain transformers, not an OOMBConfig")
    if not is_implemented(mode):
        raise NotImplementedError(f"mode {mode.name!r} is not implemented in this version of oomb")
    return base.with_options({"attention": mode.attention, "offload.enabled": mode.offload})


def mode_status(mode: str | Mode) -> str:
    return "implemented" if is_implemented(mode) else "planned"


# ---------------------------------------------------------------------------------------------
# Budgets and the search for the largest context
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModeReport:
    mode: Mode
    prediction: MemoryPrediction
    fits_gpu: bool
    fits_host: bool
    largest_context: int
    gpu_growth_per_10k: int
    """GPU bytes 10,000 more tokens would add."""

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host

    @property
    def status(self) -> str:
        return mode_status(self.mode)


@dataclass(frozen=True)
class Plan:
    model: str
    shape: ModelShape
    tokens: int
    config: OOMBConfig
    setup: TrainingSetup
    budget: Budget
    reports: list[ModeReport]
    hints: list[str]
    choice: Choice | None = None
    """oomb.planning.choose's fastest configuration that fits (the attention mode as given)."""
    choice_error: str | None = None
    """Why no configuration fits, when none does."""
    longest: dict[str, int] | None = None
    """Per attention mode, the longest sequence oomb train's chooser fits (options the user set kept)."""


def _check(prediction: MemoryPrediction, budget: Budget) -> tuple[bool, bool]:
    return prediction.gpu_total <= budget.gpu_limit, prediction.host_total <= budget.host_limit


def make_plan(
    model: str,
    shape: ModelShape,
    tokens: int,
    budget: Budget,
    config: OOMBConfig | None = None,
    setup: TrainingSetup | None = None,
    modes: list[str] | None = None,
    fixed: dict | None = None,
    gpu: str | None = None,
) -> Plan:
    """Predictions, fit and largest context of every mode in ``modes`` (default: all), and the
    configuration oomb.planning.choose chooses for ``config.attention`` keeping the options in ``fixed``
    (None: every option of ``config`` fixed but the backend: no choice beyond that). ``gpu``: the GPU's name
    for step times (e.g. "H100"); default: the detected device, none when the size is given."""
    config = config or OOMBConfig()
    setup = setup or TrainingSetup()
    modes = modes or list(MODES)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; modes: {', '.join(MODES)}")

    def run(mode: str, t: int, cfg: OOMBConfig = config, st: TrainingSetup = setup) -> MemoryPrediction:
        if cfg.performance.keep_attention_outputs and (MODES[mode].offload or st.context_parallel > 1):
            # refused there: those modes run without
            cfg = cfg.with_options({"performance.keep_attention_outputs": False})
        return predict(mode, shape, t, cfg, st)

    reports = []
    for name in modes:
        prediction = run(name, tokens)
        largest = largest_context(lambda t, name=name: all(_check(run(name, t), budget)), config.page_size)
        growth = run(name, tokens + GROWTH_TOKENS).gpu_total - prediction.gpu_total
        reports.append(ModeReport(MODES[name], prediction, *_check(prediction, budget), largest, growth))

    hints = []
    alternatives = []
    if config.precision.grad_dtype != torch.bfloat16:
        alternatives.append(("--kv-grad-dtype bfloat16", config.with_options({"precision.kv_grad_dtype": "bfloat16"}),
                             setup))
    if setup.lora_rank == 0:
        alternatives.append(("--lora-rank 16", config, dataclasses.replace(setup, lora_rank=16)))
    for report in reports:
        if report.fits:
            continue
        for flag, cfg, st in alternatives:
            prediction = run(report.mode.name, tokens, cfg, st)
            if all(_check(prediction, budget)):
                hints.append(f"{report.mode.name} fits with {flag} (GPU {prediction.gpu_total / GIB:.1f} GiB, "
                             f"host {prediction.host_total / GIB:.1f} GiB)")
                break
    hints += _speed_hints(reports, config, lambda mode, cfg: run(mode, tokens, cfg), budget)
    choice, choice_error = None, None
    if fixed is not None:
        workload = Workload(shape, tokens, setup.batch_size, setup.dtype, setup.lora_rank, setup.optimizer,
                            setup.master_weights, fp32_targets=setup.master_weights,  # as oomb train's
                            **_step_kernels(model, shape, setup))
        gpu_name = gpu or (budget.gpu_source.removeprefix("detected: ")
                           if budget.gpu_source.startswith("detected: ") else None)
        resources = Resources("cuda", budget.gpu_limit, budget.host_limit, gpu_name=gpu_name)
        try:
            choice = choose_config(workload, resources, fixed, config)
        except NoConfigFitsError as err:
            choice_error = str(err)
        longest = {mode: longest_context(workload, resources, {**fixed, "attention": mode}, config)
                   for mode in ATTENTION_MODES}
    return Plan(model, shape, tokens, config, setup, budget, reports, hints, choice, choice_error,
                longest if fixed is not None else None)


def _speed_hints(reports: list[ModeReport], config: OOMBConfig, run, budget: Budget) -> list[str]:
    """Faster settings that still fit: without layer checkpointing, stage 2 keeps each layer's
    activations instead of replaying the layer in backward (one forward of the linear layers less;
    25.0 vs 27.6 s for sparse at 128K on an H200, docs/results.md)."""
    if not config.performance.checkpoint_layers:
        return []
    faster = config.with_options({"performance.checkpoint_layers": False})
    hints = []
    for report in reports:
        if not report.fits or report.mode.attention == "hf":
            continue
        prediction = run(report.mode.name, faster)
        if all(_check(prediction, budget)):
            hints.append(f"{report.mode.name} also fits with --no-checkpoint-layers (GPU "
                         f"{prediction.gpu_total / GIB:.1f} GiB; oomb.performance.checkpoint_layers=false in "
                         "training): one forward of the linear layers less per step (sparse at 128K on an H200: 9% "
                         "faster)")
    return hints


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------

def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fit_text(report: ModeReport) -> str:
    if report.fits:
        return "yes"
    return "no: " + "+".join(x for x, ok in (("GPU", report.fits_gpu), ("host", report.fits_host)) if not ok)


def format_plan(plan: Plan) -> str:
    """A plain-text report: one column per mode, one row per memory term."""
    s, cfg, st, budget = plan.shape, plan.config, plan.setup, plan.budget
    training = f"LoRA rank {st.lora_rank}" if st.lora_rank else "full fine-tuning"
    fp32_moments = st.master_weights or st.lora_rank or st.dtype == torch.float32
    optimizer = {"adamw": f"AdamW ({'fp32' if fp32_moments else _dtype(st.dtype)} moments)",
                 "none": "no optimizer"}[st.optimizer]
    lines = [
        f"oomb plan: {plan.model}: {s.num_params() / 1e9:.2f} B parameters, {s.num_layers} layers, "
        f"{s.num_heads}/{s.num_kv_heads} heads x {s.head_dim}, vocab {s.vocab_size:,}"
        + (f"; MoE: {s.num_experts} experts of width {s.expert_intermediate_size}, {s.experts_per_token} per token "
           f"({s.active_params() / 1e9:.2f} B active)" if s.is_moe else "")
        + (f"; {s.sliding_window_layers} of {s.num_layers} layers slide (window {s.sliding_window:,}: their "
           "pages keep each chunk's last window - 1 keys, on the GPU or with offload on the host; they stage only "
           "their windows' pages)" if s.sliding_window_layers else "")
        + (f", per GPU of tp={s.tp}" if s.tp > 1 else "")
        + (f", pages of every {st.context_parallel}-th chunk per GPU or its host (cp={st.context_parallel})"
           if st.context_parallel > 1 else ""),
        f"step: {plan.tokens:,} tokens ({format_tokens(plan.tokens)}) x batch {st.batch_size}, {_dtype(st.dtype)}, "
        f"{training}, {optimizer}{', fp32 master weights' if st.master_weights else ''}",
        f"oomb: chunk {cfg.chunk_size}, page {cfg.page_size}, KV grads {_dtype(cfg.precision.grad_dtype)}, "
        "fp32 grad sums "
        f"{'on' if cfg.precision.fp32_grad_accumulation else 'off'}, "
        f"layer replay {'on' if cfg.performance.checkpoint_layers else 'off'}",
        f"budget: GPU {budget.gpu_bytes / GIB:.1f} GiB ({budget.gpu_source}) -> {budget.gpu_limit / GIB:.1f} GiB "
        f"usable; host {budget.host_bytes / GIB:.1f} GiB ({budget.host_source}) -> {budget.host_limit / GIB:.1f} GiB "
        f"usable ({budget.margin:.0%} margin, {CUDA_CONTEXT_BYTES / GIB:.1f} GiB CUDA context)",
        *(["host memory is this machine's, the GPU the one named: give the target machine's with --host-gib"]
          if not budget.gpu_source.startswith("detected") and budget.host_source != "given" else []),
        "",
    ]
    width = max(15, *(len(r.mode.name) + 2 for r in plan.reports))
    label_width = 22

    def row(label: str, cells: list[str]) -> str:
        return f"{label:<{label_width}}" + "".join(f"{c:>{width}}" for c in cells)

    reports = plan.reports
    lines.append(row("", [r.mode.name for r in reports]))
    lines.append(row("status", [r.status for r in reports]))
    lines.append("GPU (GiB)")
    for term in GPU_TERMS:  # terms that round to 0.00 GiB everywhere are left out (they are in --json)
        if any(r.prediction.gpu[term] >= GIB / 200 for r in reports):
            lines.append(row("  " + term, [_gib(r.prediction.gpu[term]) for r in reports]))
    lines.append(row("  total", [_gib(r.prediction.gpu_total) for r in reports]))
    lines.append("host RAM (GiB)")
    for term in HOST_TERMS:
        if any(r.prediction.host[term] >= GIB / 200 for r in reports):
            lines.append(row("  " + term, [_gib(r.prediction.host[term]) for r in reports]))
    lines.append(row("  total", [_gib(r.prediction.host_total) for r in reports]))
    lines.append(row("GPU MiB per +10K tok", [f"{r.gpu_growth_per_10k / 2**20:,.1f}" for r in reports]))
    lines.append(row(f"fits {format_tokens(plan.tokens)}", [_fit_text(r) for r in reports]))
    lines.append(row("largest context", [f"{r.largest_context:,}" for r in reports]))
    lines.append("")
    fitting = [r.mode.name + ("" if r.status == "implemented" else " (planned)") for r in reports if r.fits]
    chooser = ""
    if plan.choice is not None:
        c = plan.choice.config
        chooser = (f"; with the options oomb train's chooser picks (below), {c.attention}"
                   f"{'+offload' if c.offload.enabled else ''} fits")
    elif plan.choice_error is not None:
        chooser = "; nor with any options oomb train's chooser tries (below)"
    lines.append(f"fits at {plan.tokens:,} tokens with the options above: {', '.join(fitting) if fitting else 'none'}"
                 f"{chooser}")
    for r in reports:
        if not r.fits:
            why = []
            if not r.fits_gpu:
                why.append(f"GPU {r.prediction.gpu_total / GIB:.1f} > {budget.gpu_limit / GIB:.1f} GiB")
            if not r.fits_host:
                why.append(f"host {r.prediction.host_total / GIB:.1f} > {budget.host_limit / GIB:.1f} GiB")
            lines.append(f"does not fit with the options above: {r.mode.name}: {'; '.join(why)}")
    lines.extend(f"hint: {h}" for h in plan.hints)
    if any(r.status == "planned" for r in reports):
        o, sp = plan.config.offload, plan.config.sparse
        lines.append("planned = not in this version of oomb: predicted from the design, not measured")
        lines.append(
            f"  (offload: {o.resident_layers} resident layers + {o.stream_buffers} x {o.stream_block_pages}-page "
            f"streamed blocks; sparse: top-{sp.budget} + {sp.sink_pages} sink pages, {summary_vectors(sp)} "
            f"summary vectors per page and KV head)")
    if plan.longest:
        lines.append("longest context oomb train fits here, by its chooser: " + ", ".join(
            _longest(mode, tokens) for mode, tokens in plan.longest.items()))
    if plan.choice is not None:
        lines += ["", f"oomb train would run ({plan.choice.config.attention} attention, options you set kept):",
                  plan.choice.describe()]
    elif plan.choice_error is not None:
        lines += ["", f"oomb train would refuse: {plan.choice_error}"]
    return "\n".join(lines)


def plan_to_dict(plan: Plan) -> dict:
    """The plan as plain JSON-able data (bytes as integers, totals also in GiB)."""
    def clean(obj) -> dict:
        return {k: (_dtype(v) if isinstance(v, torch.dtype) else v) for k, v in dataclasses.asdict(obj).items()}

    return {
        "model": plan.model,
        "shape": dataclasses.asdict(plan.shape),
        "params": plan.shape.num_params(),
        "tokens": plan.tokens,
        "config": plan.config.to_dict(),
        "setup": clean(plan.setup),
        "budget": {**clean(plan.budget), "gpu_limit": plan.budget.gpu_limit, "host_limit": plan.budget.host_limit,
                   "cuda_context_bytes": CUDA_CONTEXT_BYTES},
        "modes": [
            {
                "mode": r.mode.name,
                "status": r.status,
                "description": r.mode.description,
                "gpu_bytes": r.prediction.gpu,
                "gpu_total_gib": round(r.prediction.gpu_total / GIB, 3),
                "gpu_above_weights_gib": round(r.prediction.gpu_above_weights / GIB, 3),
                "host_bytes": r.prediction.host,
                "host_total_gib": round(r.prediction.host_total / GIB, 3),
                "fits": r.fits,
                "fits_gpu": r.fits_gpu,
                "fits_host": r.fits_host,
                "largest_context": r.largest_context,
                "gpu_growth_per_10k_tokens_bytes": r.gpu_growth_per_10k,
            }
            for r in plan.reports
        ],
        "hints": plan.hints,
        "choice": _choice_to_dict(plan.choice) if plan.choice is not None else None,
        "choice_error": plan.choice_error,
        "longest_context": plan.longest,
    }


def _choice_to_dict(choice: Choice) -> dict:
    def candidate(c) -> dict:
        cfg = c.config
        chosen = {path: cfg.option(path) for path in ("attention", *AUTO_FIELDS)}
        return {**chosen, "precision.kv_grad_dtype": _dtype(cfg.precision.grad_dtype),
                "gpu_bytes": c.gpu_bytes, "host_bytes": c.host_bytes, "relative_step_time": round(c.relative_time, 4),
                "speed_factors": list(c.factors)}

    return {**candidate(choice.chosen), "reason": choice.reason,
            "runner_up": candidate(choice.runner_up) if choice.runner_up is not None else None}


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `oomb plan`."""
    defaults, setup = OOMBConfig(), TrainingSetup()
    offload, sparse = defaults.offload, defaults.sparse
    parser.add_argument("--model", "--preset", dest="model", required=True,
                        help=f"a local model directory or a preset: {', '.join(presets.PRESETS)}")
    parser.add_argument("--context", "--seq-len", dest="context", type=parse_tokens, default=DEFAULT_CONTEXT,
                        help="tokens per sequence, e.g. 131072, 128K, 1M (default 128K)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="plan a GPU step or a CPU one (every term in host memory; the chooser's plan as `oomb "
                             "train` runs it there); auto: cuda where --gpu or --gpu-gib is given or a CUDA device is "
                             "found")
    parser.add_argument("--gpu-gib", type=float, help="GPU size in GiB (default: this machine's CUDA device)")
    parser.add_argument("--gpu", default=None, metavar="NAME",
                        help="the GPU kind planned for: its step times and, without --gpu-gib, its size (H100: the "
                             "80GB card, H200); default: this machine's")
    parser.add_argument("--host-gib", type=float, help="host RAM for the step in GiB (default: MemAvailable)")
    parser.add_argument("--margin", type=float, default=SAFETY_MARGIN, help="fraction of each memory kept free")
    group = parser.add_argument_group("training")
    group.add_argument("--batch-size", type=int, default=setup.batch_size)
    group.add_argument("--dtype", help="weights, activations and K/V pages (default: bfloat16 on a GPU, float32 on a "
                                       "CPU, as `oomb train`)")
    group.add_argument("--optimizer", choices=["adamw", "none"], default=setup.optimizer)
    group.add_argument("--master-weights", action=argparse.BooleanOptionalAction,
                       default=OptimSection().master_weights,
                       help="fp32 master copy of trainable weights (default as oomb train: optim.master_weights)")
    group.add_argument("--tp", type=int, default=1,
                       help="tensor-parallel degree: predict one GPU's share of weights, KV heads and activations")
    group.add_argument("--cp", type=int, default=1,
                       help="context-parallel GPUs per sequence: page memory per GPU (host memory with offload) "
                            "divided by about cp; --host-gib is then one rank's share of the host")
    group.add_argument("--lora-rank", type=int, default=0, help="LoRA on all linear layers (0: full fine-tuning)")
    group.add_argument("--lora", dest="lora_rank", action="store_const", const=LoraSection.r,
                       help=f"LoRA at oomb train's default rank ({LoraSection.r}), as `oomb train --lora`")
    group = parser.add_argument_group("oomb step (OOMBConfig; the chosen configuration keeps what is given here)")
    group.add_argument("--attention", choices=ATTENTION_MODES, default=defaults.attention,
                       help="mode of the chosen configuration (default dense; the table shows every mode)")
    group.add_argument("--chunk-size", type=parse_tokens, help=f"default {defaults.chunk_size}")
    group.add_argument("--page-size", type=parse_tokens, default=defaults.page_size)
    group.add_argument("--kv-grad-dtype", help="default float32")
    group.add_argument("--backend", choices=BACKENDS, help="default: cudnn for bf16 (triton with --deterministic)")
    group.add_argument("--deterministic", action="store_true", help="bitwise-deterministic kernels (triton)")
    group.add_argument("--offload", action=argparse.BooleanOptionalAction, help="fix offload on or off")
    group.add_argument("--loss-chunk-tokens", type=parse_tokens, default=defaults.performance.loss_chunk_tokens)
    group.add_argument("--checkpoint-layers", action=argparse.BooleanOptionalAction,
                       help="layer replay in backward (default on in the table)")
    group.add_argument("--recompute-logits", action=argparse.BooleanOptionalAction,
                       help="recompute the loss slices' log-probabilities in backward (default on in the table; "
                            "unset, the chooser keeps them where they fit)")
    group.add_argument("--keep-attention-outputs", action=argparse.BooleanOptionalAction,
                       help="keep stage 1's attention outputs for stage 2 (default off in the table, where the modes "
                            "without offload then count them; unset, the chooser keeps them for steps with "
                            "every page on the GPU where they fit)")
    group.add_argument("--fp32-grad-accumulation", action=argparse.BooleanOptionalAction,
                       default=defaults.precision.fp32_grad_accumulation,
                       help="sum low-precision parameters' chunk gradients in float32 (default on)")
    group = parser.add_argument_group("planned modes (assumptions)")
    add_option(group, "--sparse-budget", "--top-k-pages", dest="top_k_pages", type=int,
               help=f"sparse: history pages each query block reads besides the sinks (default {sparse.budget}; a "
                    "budget given here stays fixed unless --sparse-read-share is given too)")
    group.add_argument("--sparse-read-share", dest="read_share", type=parse_read_share, metavar="SHARE",
                       help="sparse: the share of each block's history read at least, 'none' for the fixed budget "
                            "(default: 0.35 over the default budget; none, the fixed budget, where --sparse-budget "
                            "is given)")
    add_option(group, "--sparse-sink-pages", "--sink-pages", dest="sink_pages", type=int, default=sparse.sink_pages)
    add_option(group, "--sparse-query-block-pages", "--query-block-pages", dest="query_block_pages", type=int,
                       help=f"sparse: query blocks sharing one selection (fewer pages staged with offload; table "
                            f"default {sparse.query_block_pages}; unset, `oomb train` takes one per chunk with "
                            "offload)")
    group.add_argument("--resident-layers", "--offload-resident-layers", dest="resident_layers", type=int,
                       help=f"offload: layers whose pages stay on the GPU (table default {offload.resident_layers})")
    group.add_argument("--stream-block-pages", type=int, default=offload.stream_block_pages)
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="print JSON instead of the table; with a PATH, write it there and print the table")


def _fixed_from_args(args: argparse.Namespace) -> dict:
    """The OOMBConfig options the command line sets, which the chooser keeps."""
    given = {"chunk_size": args.chunk_size, "precision.kv_grad_dtype": args.kv_grad_dtype,
             "performance.backend": args.backend, "offload.enabled": args.offload,
             "offload.resident_layers": args.resident_layers,
             "performance.checkpoint_layers": args.checkpoint_layers,
             "sparse.query_block_pages": args.query_block_pages,
             "performance.recompute_logits": args.recompute_logits,
             "performance.keep_attention_outputs": args.keep_attention_outputs}
    fixed = {k: v for k, v in given.items() if v is not None}
    fixed.update({"attention": args.attention, "precision.deterministic": args.deterministic,
                  "page_size": args.page_size, "performance.loss_chunk_tokens": args.loss_chunk_tokens,
                  "precision.fp32_grad_accumulation": args.fp32_grad_accumulation,
                  "sparse.budget": _budget(args), "sparse.sink_pages": args.sink_pages,
                  "sparse.read_share": flag_read_share(args.read_share, args.top_k_pages)})
    return fixed_from_options(fixed)


def _budget(args: argparse.Namespace) -> int:
    return SparseConfig.budget if args.top_k_pages is None else args.top_k_pages


def plan_from_args(args: argparse.Namespace) -> Plan:
    defaults = OOMBConfig()
    fixed = _fixed_from_args(args)
    query_block_pages = args.query_block_pages or defaults.sparse.query_block_pages
    sparse = SparseConfig(budget=_budget(args), sink_pages=args.sink_pages, query_block_pages=query_block_pages,
                          read_share=flag_read_share(args.read_share, args.top_k_pages))
    # The table's offloaded modes: these resident layers and blocks (the chooser decides its own, unless given).
    offload = OffloadConfig(resident_layers=args.resident_layers or 0, stream_block_pages=args.stream_block_pages)
    performance = PerformanceConfig(checkpoint_layers=args.checkpoint_layers is not False,
                                    recompute_logits=args.recompute_logits is not False,
                                    loss_chunk_tokens=args.loss_chunk_tokens,
                                    keep_attention_outputs=bool(args.keep_attention_outputs))
    precision = PrecisionConfig(kv_grad_dtype=args.kv_grad_dtype or defaults.precision.kv_grad_dtype,
                                fp32_grad_accumulation=args.fp32_grad_accumulation, deterministic=args.deterministic)
    config = OOMBConfig(chunk_size=args.chunk_size or defaults.chunk_size, page_size=args.page_size,
                        attention=args.attention, sparse=sparse, offload=offload, performance=performance,
                        precision=precision)
    setup = TrainingSetup(resolve_dtype(args.dtype or "bfloat16", "dtype"), args.batch_size, args.optimizer,
                          args.master_weights, args.lora_rank, context_parallel=args.cp)
    modes = args.modes
    if args.cp > 1:  # context parallelism is oomb's (every mode but plain HF); the chooser does not plan it yet
        if "hf" in args.modes and args.modes != list(MODES):
            raise ValueError(f"--cp {args.cp} plans oomb's modes (plain HF has no context parallelism); got "
                             f"--modes {' '.join(args.modes)}")
        modes, fixed = [m for m in args.modes if m != "hf"], None
    budget = Budget.detect(planned_gpu_gib(args), args.host_gib, args.margin)
    if args.gpu_gib is None and args.gpu is not None and gpu_kind(args.gpu) is not None:
        budget = dataclasses.replace(budget, gpu_source=f"{gpu_kind(args.gpu)}'s size, --gpu")
    shape = load_model_shape(args.model).per_rank(args.tp)
    return make_plan(args.model, shape, args.context, budget, config, setup, modes, fixed, args.gpu)


def planned_gpu_gib(args: argparse.Namespace) -> float | None:
    """--gpu-gib, or the size of the kind --gpu names (an H100 planned on a laptop); None: this machine's GPU."""
    if args.gpu_gib is not None or args.gpu is None:
        return args.gpu_gib
    kind = gpu_kind(args.gpu)
    if kind is None:
        if machine.detect_gpu() is not None:
            return None
        raise ValueError(f"--gpu {args.gpu}: its size is not known here; give it with --gpu-gib "
                         f"(known: {', '.join(GPU_MEMORY_GIB)})")
    return GPU_MEMORY_GIB[kind]


def plan_device(args: argparse.Namespace) -> str:
    """"cuda" or "cpu": --device, or for auto cuda where a GPU is named or sized or a CUDA device is found."""
    if args.device != "auto":
        return args.device
    named = args.gpu_gib is not None or args.gpu is not None
    return "cuda" if named or machine.detect_gpu() is not None else "cpu"


def cpu_plan(args: argparse.Namespace) -> tuple[str, dict, bool]:
    """A CPU step as `oomb train` runs it there (text, JSON, fits): the chooser's plan with every term of the
    step in host memory (no offload, no GPU), and the longest context per attention mode."""
    if args.tp > 1 or args.cp > 1:
        raise ValueError("--tp and --cp plan several GPUs: a CPU step runs in one process (use --device cuda)")
    shape = load_model_shape(args.model)
    dtype = resolve_dtype(args.dtype or "float32", "dtype")
    if args.host_gib is not None:
        host_bytes, source = int(args.host_gib * GIB), "given"
    else:
        host_bytes, source = machine.host_available_bytes(), "detected: MemAvailable"
        if host_bytes is None:
            raise ValueError("cannot read MemAvailable from /proc/meminfo: give the host RAM with --host-gib")
    host_limit = int(host_bytes * (1 - args.margin))
    setup = TrainingSetup(dtype, args.batch_size, args.optimizer, args.master_weights, args.lora_rank)
    kernels = dict(_step_kernels(args.model, shape, setup), may_compile=False)  # compiled layers: CUDA only
    workload = Workload(shape, args.context, args.batch_size, dtype, args.lora_rank, args.optimizer,
                        args.master_weights, fp32_targets=args.master_weights, **kernels)
    resources = Resources("cpu", None, host_limit)
    fixed = _fixed_from_args(args)
    training = f"LoRA rank {args.lora_rank}" if args.lora_rank else "full fine-tuning"
    lines = [f"oomb plan: {args.model}: {shape.num_params() / 1e9:.2f} B parameters, {shape.num_layers} layers",
             f"step on this CPU: {args.context:,} tokens ({format_tokens(args.context)}) x batch {args.batch_size}, "
             f"{_dtype(dtype)}, {training}, {args.optimizer}; every term of the step is host memory",
             f"budget: host {host_bytes / GIB:.1f} GiB ({source}) -> {host_limit / GIB:.1f} GiB usable "
             f"({args.margin:.0%} margin)", ""]
    report: dict = {"device": "cpu", "model": args.model, "tokens": args.context, "host_limit": host_limit}
    try:
        choice = choose_config(workload, resources, fixed)
        lines += [f"oomb train would run ({args.attention} attention, options you set kept):", choice.describe()]
        report["choice"] = _choice_to_dict(choice)
    except NoConfigFitsError as err:
        choice = None
        lines.append(f"nothing fits: {err}")
        report["choice_error"] = str(err)
    longest = {mode: longest_context(workload, resources, {**fixed, "attention": mode}) for mode in ATTENTION_MODES}
    lines.append("longest context oomb train fits here, by its chooser: " + ", ".join(
        _longest(mode, tokens) for mode, tokens in longest.items()))
    report["longest"] = longest
    return "\n".join(lines), report, choice is not None


def _longest(mode: str, tokens: int) -> str:
    """'dense 1,061,632 tokens (~1.01M)', or 'sparse: none fits' where not even a page of tokens does."""
    return f"{mode} {tokens:,} tokens (~{tokens / 2**20:.2f}M)" if tokens > 0 else f"{mode}: none fits"


def main(args: argparse.Namespace) -> int:
    """Print the plan; exit code 0 when `oomb train` can run the step (its chooser's plan, or an implemented
    mode with the options given, fits), 1 otherwise."""
    if plan_device(args) == "cpu":
        text, report, fits = cpu_plan(args)
        _report(args.json, text, report)
        return 0 if fits else 1
    plan = plan_from_args(args)
    _report(args.json, format_plan(plan), plan_to_dict(plan))
    runs = plan.choice is not None or any(r.fits and r.status == "implemented" for r in plan.reports)
    return 0 if runs else 1


def _report(json_path: str | None, text: str, report: dict) -> None:
    """The table, or the JSON for ``--json`` ("-": printed instead of the table; a path: written there as well)."""
    if json_path == "-":
        print(json.dumps(report, indent=2))
        return
    print(text)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {json_path}")
