"""`oomb gradcheck`: how far sparse attention's parameter gradients are from dense ones.

    oomb gradcheck                                         # tiny-qwen2, random weights, 2K synthetic tokens
    oomb gradcheck --model path/to/model --data book.txt --seq-len 32K --sparse-budget 8 32 128
    oomb gradcheck --sparse-score minmax mean --sparse-leak-free --json out.json
    oomb gradcheck --model trained/ --ids sequence.txt --seq-len 8192       # token ids, one file

For one sequence it runs one dense oomb step and one sparse step per (score rule, budget), and
prints, per decoder layer and in total, the cosine similarity and the relative error
||g_sparse - g_dense|| / ||g_dense|| of the parameter gradients (plus the losses), as a table and,
with --json, as a JSON file. Where the full sequence fits (--hf auto: up to HF_AUTO_MAX_TOKENS
tokens), it also checks dense oomb against an ordinary full-sequence Hugging Face backward.

Random weights on random tokens give diffuse attention: the worst case for sparse attention.
Trained weights on real text concentrate attention and are the meaningful measurement.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import platform
import re
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import date
from pathlib import Path

import torch
import transformers

from ..cli_options import REAL_MODEL, add_option, check_model_option, parse_share, resolve_model
from ..config import (
    CANDIDATE_POOLINGS,
    DEFAULT_BUDGET,
    NORMALISER_PAGES,
    RERANK_CANDIDATES,
    SPARSE_POOLINGS,
    SPARSE_SCORES,
    SPARSE_SELECTIONS,
    OOMBConfig,
    load_sparse_plan,
    nested_options,
    resolve_dtype,
)
from ..engine import forward_backward
from ..models import num_decoder_layers, unwrap_causal_lm, window_layer_ids
from ..real_model import english_text, stdlib_source, with_yarn
from ..sparse_fidelity import budget_for_read, history_read
from ..training import presets
from ..training.config import ModelSection
from ..units import parse_normaliser_pages
from . import dense_cache
from .plan import parse_tokens

logger = logging.getLogger(__name__)

QUICK_BUDGETS = (4, 8, 16)
"""The fixed budgets compared when no arm is asked for (a quick look at the tiny default model)."""

HF_AUTO_MAX_TOKENS = 32768
"""--hf auto runs the full-sequence HF reference up to this many tokens (it holds the whole graph)."""
_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass
class GradcheckOptions:
    model: str = presets.TINY_PRESET
    text: str | None = None
    ids: str | None = None
    seq_len: int = 2048
    # fixed budgets, one arm each; None: QUICK_BUDGETS unless reads or read_shares choose the arms
    budgets: list[int] | None = None
    # The score a default config runs (OOMBConfig().sparse.score resolved): what a user's run would check; others,
    # and "exact" (the oracle), on request.
    scores: list[str] = field(default_factory=lambda: [OOMBConfig().sparse.resolved_score])
    poolings: list[str] = field(default_factory=lambda: ["max"])
    layer_budgets: list[int] | None = None
    dense_layers: list[int] | str = "auto"
    """Layers read densely; "auto": as the step's default (the first fifth with the default budget and share)."""
    sparse_plan: str | None = None
    sink_pages: int = 1
    selection: str = "kv_head"
    leak_free: bool = False
    query_block_pages: int = 1
    rerank_factors: list[int] = field(default_factory=lambda: [4])  # score "rerank": candidates / budget
    rerank_candidates: list[str] = field(default_factory=lambda: ["minmax_mean"])  # score "rerank": who proposes them
    # score "rerank": how their rows pool; softmax_max: its normaliser's bound (None: every history page)
    candidate_poolings: list[str] = field(default_factory=lambda: ["softmax_max"])
    normaliser_pages: list[int | None] = field(default_factory=lambda: [NORMALISER_PAGES])
    chunk_size: int = 512
    page_size: int = 64
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    hf: str = "auto"
    yarn: float | None = None
    json_path: str | None = None
    dense_cache: str | None = None  # a folder keeping dense steps (dense_cache.py): a later run skips its own
    reads: list[float] = field(default_factory=list)  # shares of the history: budgets that read about as much
    read_shares: list[float] = field(default_factory=list)  # sparse_read_share arms (every block reads the share)
    warmup_steps: int = 0  # dense LoRA context-extension steps on the following text, then everything again
    warmup_lr: float = 2e-4
    offload: bool = False  # every step keeps its pages in host memory: bitwise the same, for pages the GPU cannot hold
    kv_grad_dtype: str = "float32"  # precision.kv_grad_dtype of every step (dense, sparse, warm-up)


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """Cosine similarity and relative error per parameter group (decoder layer, "other") and in total."""
    sums: dict[str, list[float]] = {}  # group -> [dot, |got|^2, |want|^2, |got - want|^2]
    for name, ref in want.items():
        match = _LAYER.search(name)
        group = f"layer {int(match.group(1))}" if match else "other"
        a, b = got[name].double(), ref.double()
        for key in (group, "total"):
            s = sums.setdefault(key, [0.0, 0.0, 0.0, 0.0])
            s[0] += float((a * b).sum())
            s[1] += float((a * a).sum())
            s[2] += float((b * b).sum())
            s[3] += float(((a - b) ** 2).sum())

    def order(key: str) -> tuple:
        return (key == "total", key == "other", int(key.split()[1]) if key.startswith("layer") else 0)

    return {
        key: {"cosine": dot / max((ga * gb) ** 0.5, 1e-300), "rel_err": (diff / max(gb, 1e-300)) ** 0.5}
        for key, (dot, ga, gb, diff) in sorted(sums.items(), key=lambda item: order(item[0]))
    }


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


REAL_TEXT = "python-docs"
"""--data python-docs: Python's English help topics (oomb/real_model.py's english_text), ~110K SmolLM2 tokens."""
REAL_CODE = "python-stdlib"
"""--data python-stdlib: the Python standard library's source (oomb/real_model.py's stdlib_source), millions of
tokens: real text for 128K-1M sequences."""
CHARS_PER_TOKEN = 5
"""python-stdlib: characters read per token asked (SmolLM2 took 3.9 on the first 2M characters of CPython 3.11's
standard library; the rest is margin)."""


def load_sequence(options: GradcheckOptions):
    """(model, input_ids, description, source) from a preset name or a local directory, and a text file or
    random ids. input_ids holds 1 + warmup_steps sequences of seq_len tokens, one per row: the measured one
    first, then the warm-up's."""
    resolved = resolve_model(options.model)
    check_model_option(options.model, resolved, presets.PRESETS)
    options = replace(options, model=resolved)
    is_preset = options.model in presets.PRESETS
    section = ModelSection(path=None if is_preset else options.model,
                           preset=options.model if is_preset else presets.TINY_PRESET)
    device = torch.device(options.device)
    dtype = resolve_dtype(options.dtype, "--dtype") if options.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    config = with_yarn(presets.load_model_config(section, options.seq_len), options.yarn)
    torch.manual_seed(options.seed)
    model = presets.build_model(section, config, dtype, device).eval()
    if options.text is not None and options.ids is not None:
        raise ValueError("give --data or --ids, not both")
    rows = 1 + options.warmup_steps
    need = rows * options.seq_len
    asked = f"--seq-len {options.seq_len}" + (f" x (1 + --warmup-steps {options.warmup_steps})" if rows > 1 else "")
    if options.ids is not None:
        path = Path(options.ids)
        if not path.is_file():
            raise FileNotFoundError(f"--ids {options.ids!r} is not a file")
        tokens = [int(t) for t in path.read_text().split()]
        if len(tokens) < need:
            raise ValueError(f"--ids {options.ids!r} has {len(tokens)} tokens, fewer than {asked}")
        ids = torch.tensor(tokens[:need]).view(rows, options.seq_len)
        source = path.name
    elif options.text is None:
        generator = torch.Generator().manual_seed(options.seed)
        ids = torch.randint(0, config.vocab_size, (rows, options.seq_len), generator=generator)
        source = "random token ids"
    else:
        if options.text == REAL_TEXT:
            text, source = english_text(), "Python's help topics"
        elif options.text == REAL_CODE:
            text = stdlib_source(CHARS_PER_TOKEN * need)
            source = f"the Python {platform.python_version()} standard library's source"
        else:
            path = Path(options.text)
            if not path.is_file():
                raise FileNotFoundError(f"--data {options.text!r} is not a file")
            text, source = path.read_text(errors="replace"), path.name
        tokens = presets.load_tokenizer(section)(text)["input_ids"]
        if len(tokens) < need:
            raise ValueError(f"--data {options.text!r} has {len(tokens)} tokens, fewer than {asked}; give a longer "
                             f"file or a shorter --seq-len")
        ids = torch.tensor(tokens[:need]).view(rows, options.seq_len)
    weights = "random weights" if is_preset else "local weights"
    return model, ids.to(device), f"{options.model} ({weights}, {str(dtype).removeprefix('torch.')}, {device})", source


def is_default_sparse(config: OOMBConfig, num_layers: int, window_layers: tuple[int, ...] = ()) -> bool:
    """Whether ``config``'s sparse settings (and page size) are what OOMBConfig(attention="sparse") runs in a
    model of ``num_layers`` decoder layers (``window_layers`` of them sliding-window)."""
    default = OOMBConfig(attention="sparse", chunk_size=config.chunk_size)
    return (config.page_size == default.page_size
            and config.resolved_sparse(num_layers, window_layers) == default.resolved_sparse(num_layers, window_layers))


def _dense_step(model, ids, base: OOMBConfig, options: GradcheckOptions, progress: bool) -> tuple[dict, dict]:
    """(gradients, report entry) of the dense oomb step, from the dense cache when it holds this one."""
    key = (dense_cache.dense_key(model, ids, base.chunk_size, base.page_size, base.precision.kv_grad_dtype)
           if options.dense_cache else None)
    kept = dense_cache.load_dense(options.dense_cache, key, ids.device) if key else None
    if kept is not None:
        return kept["gradients"], {"loss": kept["loss"], "seconds": kept["seconds"], "kept": kept["path"],
                                   "kept_date": kept["date"]}
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = float(forward_backward(model, ids, config=base, progress=progress))
    gradients = _gradients(model)
    entry = {"loss": loss, "seconds": time.perf_counter() - start}
    if key:
        entry["kept"] = str(dense_cache.save_dense(options.dense_cache, key, loss, entry["seconds"],
                                                   date.today().isoformat(), gradients))
    return gradients, entry


def _arms(options: GradcheckOptions, base: OOMBConfig, num_tokens: int, num_layers: int) -> list[dict]:
    """One OOMBConfig override dict per sparse arm (score x pooling x budget x rerank options), named."""
    plan = nested_options(load_sparse_plan(options.sparse_plan)).get("sparse", {}) if options.sparse_plan else {}
    layer_budgets = plan.get("layer_budgets", options.layer_budgets)
    dense_layers = plan.get("dense_layers", options.dense_layers)
    common = {"attention": "sparse", "sparse.sink_pages": options.sink_pages,
              "sparse.research.selection": options.selection, "sparse.leak_free": options.leak_free,
              "sparse.query_block_pages": options.query_block_pages, "sparse.layer_budgets": layer_budgets,
              "sparse.dense_layers": dense_layers}
    probe = base.with_options(common)
    reads = {budget_for_read(num_tokens, probe, read, num_layers): read for read in options.reads}
    # (budget label, the fixed budget, read share, target read): the budgets asked and found for --reads, then
    # the --read-shares arms over the default budget as their floor (--read-shares 0.35: the defaults)
    if layer_budgets is not None:
        sizes = [("per layer", max(layer_budgets), None, None)]
    else:
        budgets = options.budgets if options.budgets is not None else (
            [] if options.reads or options.read_shares else list(QUICK_BUDGETS))
        sizes = [(b, b, None, reads.get(b)) for b in dict.fromkeys([*budgets, *reads])]
    sizes += [(f"share {share}", DEFAULT_BUDGET, share, share) for share in options.read_shares]
    arms = []
    for score, pooling, (label, budget, share, target) in itertools.product(options.scores, options.poolings, sizes):
        rerank = score == "rerank"
        for factor, proposer, pooled in itertools.product(
                options.rerank_factors if rerank else [None], options.rerank_candidates if rerank else [None],
                options.candidate_poolings if rerank else [None]):
            if score == "auto":  # the defaults: every rerank option as OOMBConfig resolves it
                bounds: list = ["auto"]
            elif "softmax_max" in (pooling, pooled):
                bounds = options.normaliser_pages
            else:
                bounds = [None]
            for bound in bounds:
                extra = ({"sparse.research.rerank_factor": factor, "sparse.research.rerank_candidates": proposer,
                          "sparse.research.candidate_pooling": pooled} if factor is not None else {})
                if score == "auto":
                    name = "defaults"
                elif factor is None:
                    name = score + ("" if bound is None else f"/{bound}")
                else:
                    name = _rerank_name(factor, proposer, pooled, bound)
                arms.append({"name": name, "pooling": pooling, "budget": label, "target_read": target,
                             "config": {**common, **extra, "sparse.score": score, "sparse.research.pooling": pooling,
                                        "sparse.research.normaliser_pages": bound, "sparse.budget": budget,
                                        "sparse.read_share": share}})
    return arms


def _warm_up(model, rows: torch.Tensor, base: OOMBConfig, lr: float, progress: bool,
             log: Callable[[str], None]) -> tuple[torch.nn.Module, list[float]]:
    """A short dense context extension: LoRA adapters (rank 16 on the attention projections, float32) trained
    with AdamW, one oomb dense step per row of ``rows``; then every parameter requires grad again, so the
    comparison after it covers the base weights and the adapters. Returns the wrapped model and the losses."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    losses = []
    for step, row in enumerate(rows):
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(forward_backward(model, row[None], config=base, progress=progress)))
        optimizer.step()
        log(f"warm-up step {step + 1} of {len(rows)}: loss {losses[-1]:.6f}")
    optimizer.zero_grad(set_to_none=True)
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    return model, losses


def run_gradcheck(options: GradcheckOptions, progress: bool = False,
                  on_step: Callable[[dict, str], None] | None = None) -> dict:
    """Dense vs sparse (and dense vs HF) gradients of one sequence; returns the JSON-able report.

    Each sparse row carries ``seq_len``, ``cosine`` (total parameter gradient against dense), ``loss_gap``
    ((sparse loss - dense loss) / dense loss), ``history_read`` and ``defaults`` (true where the arm runs
    OOMBConfig's sparse defaults), with per-group cosines under ``groups``. With ``warmup_steps``, every
    comparison runs twice: ``model_state`` "as shipped", then after that many dense LoRA steps at the length.

    ``progress``: a progress bar over each step's chunks. ``on_step(report, done)`` is called after each
    step with the report so far and what finished, so that a long run can show and save results as they come."""
    model, rows, model_text, source = load_sequence(options)
    ids = rows[:1]
    base = OOMBConfig(chunk_size=options.chunk_size, page_size=options.page_size).with_options(
        {"offload.enabled": options.offload, "precision.kv_grad_dtype": options.kv_grad_dtype})
    causal_lm = unwrap_causal_lm(model)
    num_layers, windows = num_decoder_layers(causal_lm), window_layer_ids(causal_lm)
    report = {"date": date.today().isoformat(),
              "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
                         f"transformers {transformers.__version__}, Python {platform.python_version()}"
                         + (f", {torch.cuda.get_device_name()}" if ids.device.type == "cuda" else ""),
              "model": model_text, "sequence": source, "tokens": ids.shape[1], "options": asdict(options),
              "config": {k: v for k, v in base.to_dict().items() if k != "sparse"},
              "sparse": []}
    notify = (lambda done: on_step(report, done)) if on_step is not None else (lambda done: None)
    arms = _arms(options, base, ids.shape[1], num_layers)
    states = ["as shipped"] + ([f"after {options.warmup_steps} dense warm-up steps"] if options.warmup_steps else [])
    for phase, state in enumerate(states):
        if phase:
            model, losses = _warm_up(model, rows[1:], base, options.warmup_lr, progress, notify)
            report["warmup"] = {"steps": options.warmup_steps, "lr": options.warmup_lr, "losses": losses,
                                "adapters": "LoRA r=16, alpha 32, q/k/v/o projections, float32"}
        dense, entry = _dense_step(model, ids, base, replace(options, dense_cache=None) if phase else options,
                                   progress)
        report.setdefault("dense_steps", []).append({"model_state": state, **entry})
        report["dense"] = entry
        dense_loss = entry["loss"]
        tag = f", model {state}" if options.warmup_steps else ""
        notify(f"dense step: loss {dense_loss:.6f} ({entry['seconds']:.1f} s{tag})")
        run_hf = options.hf == "on" or (options.hf == "auto" and ids.shape[1] <= HF_AUTO_MAX_TOKENS)
        if run_hf and not phase:
            model.zero_grad(set_to_none=True)
            try:
                hf_loss = model(input_ids=ids, labels=ids).loss
                hf_loss.backward()
                report["hf"] = {"loss": float(hf_loss.detach()), **compare(dense, _gradients(model))["total"]}
            except torch.OutOfMemoryError:
                report["hf"] = {"error": "out of memory"}
        for number, arm in enumerate(arms, 1):
            config = base.with_options(arm["config"])
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            loss = float(forward_backward(model, ids, config=config, progress=progress))
            groups = compare(_gradients(model), dense)
            run = {"model_state": state, "seq_len": ids.shape[1], "score": arm["name"], "pooling": arm["pooling"],
                   "budget": arm["budget"],
                   "target_read": arm["target_read"],
                   "history_read": history_read(ids.shape[1], config, num_layers, windows),
                   "dense_layers": list(config.resolved_sparse(num_layers, windows).dense_layers),
                   "defaults": is_default_sparse(config, num_layers, windows), "cosine": groups["total"]["cosine"],
                   "loss": loss, "dense_loss": dense_loss, "loss_gap": (loss - dense_loss) / dense_loss,
                   "normaliser_pages": config.sparse.resolved_normaliser_pages,
                   "seconds": time.perf_counter() - start, "groups": groups}
            report["sparse"].append(run)
            notify(f"sparse {run['score']}/{run['pooling']} k={run['budget']} ({number} of {len(arms)}{tag}): "
                   f"cosine {run['cosine']:.5f}, loss gap {100 * run['loss_gap']:+.3f} %, "
                   f"{100 * run['history_read']:.1f} % read ({run['seconds']:.1f} s)")
    model.zero_grad(set_to_none=True)
    return report


def _rerank_name(factor: int, proposer: str, pooled: str = "max", bound: int | None = None) -> str:
    """An arm's name: "rerank x4" (minmax candidates, the names of earlier results), "rerank x4 mean", and
    " softmax_max" after it for candidates pooled that way (" softmax_max/256": its normaliser bounded to the
    sinks and the last 256 history pages)."""
    return (f"rerank x{factor}" + ("" if proposer == "minmax" else f" {proposer}")
            + ("" if pooled == "max" else f" {pooled}") + ("" if bound is None else f"/{bound}"))

def format_report(report: dict) -> str:
    opts = report["options"]
    group = opts.get("query_block_pages", 1)
    lines = [
        f"oomb gradcheck: {report['model']}, {report['tokens']} tokens of {report['sequence']}, "
        f"chunk {opts['chunk_size']}, page {opts['page_size']}, {opts['sink_pages']} sink page(s), "
        f"selection {opts['selection']}{', leak-free' if opts['leak_free'] else ''}"
        f"{f', one selection per {group} query blocks' if group > 1 else ''}",
        f"dense oomb loss {report['dense']['loss']:.6f} ({report['dense']['seconds']:.1f} s)",
    ]
    hf = report.get("hf")
    if hf is None:
        lines.append("dense vs full-sequence HF: not run (--hf off, or longer than --hf auto's limit)")
    elif "error" in hf:
        lines.append(f"dense vs full-sequence HF: {hf['error']}")
    else:
        lines.append(f"dense vs full-sequence HF: loss {hf['loss']:.6f}, gradient cosine {hf['cosine']:.8f}, "
                     f"relative error {hf['rel_err']:.2e}")
    for state in dict.fromkeys(r.get("model_state", "as shipped") for r in report["sparse"]):
        runs = [r for r in report["sparse"] if r.get("model_state", "as shipped") == state]
        dense = next((d for d in report.get("dense_steps", []) if d["model_state"] == state), report["dense"])
        lines.append(f"sparse vs dense parameter gradients, model {state} (dense loss {dense['loss']:.6f}; "
                     f"cosine / relative error):")
        headers = [f"{r['score']}/{r.get('pooling', 'max')} k={r['budget']}" for r in runs]
        width = max(18, *(len(h) for h in headers))
        lines.append(f"{'':<12}" + "".join(f" | {h:>{width}}" for h in headers))
        lines.append("-" * 12 + ("-+-" + "-" * width) * len(runs))
        for group in runs[0]["groups"]:
            cells = [f"{r['groups'][group]['cosine']:.5f} / {r['groups'][group]['rel_err']:.2e}" for r in runs]
            lines.append(f"{group:<12}" + "".join(f" | {c:>{width}}" for c in cells))
        lines.append(f"{'loss':<12}" + "".join(f" | {r['loss']:>{width}.6f}" for r in runs))
        lines.append(f"{'loss gap':<12}" + "".join(
            f" | {100 * (r['loss'] - dense['loss']) / dense['loss']:>{width - 1}.3f}%" for r in runs))
        lines.append(f"{'pages read':<12}" + "".join(f" | {100 * r['history_read']:>{width - 1}.1f}%" for r in runs))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `oomb gradcheck`."""
    d = GradcheckOptions()
    add_option(parser, "--model", "--preset", default=d.model,
                        help=f"a preset ({', '.join(presets.PRESETS)}; random weights), a local HF model directory, "
                             f"or {REAL_MODEL!r} (the real SmolLM2-135M-Instruct, converted once)")
    add_option(parser, "--data", "--text", dest="text", default=None,
                        help=f"text file to tokenize (model's tokenizer; bytes for a preset), {REAL_TEXT!r} "
                             f"(Python's English docs, ~110K tokens) or {REAL_CODE!r} (the standard library's source, "
                             "millions of tokens); default: random ids")
    parser.add_argument("--ids", default=None, help="file of whitespace-separated token ids (instead of --data)")
    add_option(parser, "--seq-len", "--context", type=parse_tokens, default=d.seq_len, help="tokens (e.g. 2048, 32K)")
    add_option(parser, "--sparse-budget", "--budgets", dest="budgets", type=int, nargs="+", default=d.budgets,
               help=f"fixed sparse budgets (pages), one arm each (default: {' '.join(map(str, QUICK_BUDGETS))}, "
                    "unless --reads or --read-shares choose the arms)")
    add_option(parser, "--sparse-score", "--scores", dest="scores", nargs="+", choices=SPARSE_SCORES,
               default=d.scores, help="score rules to compare (default: the one OOMBConfig() runs)")
    add_option(parser, "--sparse-pooling", "--poolings", dest="poolings", nargs="+", choices=SPARSE_POOLINGS,
               default=d.poolings, help="how a block's rows combine into a page score (max, softmax, softmax_max)")
    add_option(parser, "--sparse-layer-budgets", "--layer-budgets", dest="layer_budgets", type=int, nargs="+",
               default=None, help="a budget per layer")
    add_option(parser, "--sparse-dense-layers", "--dense-layers", dest="dense_layers", type=int, nargs="*",
               default=None, help="layers read densely (default: as the step's sparse.dense_layers='auto', the "
               "first fifth of the layers with the default budget and share; the option alone: none)")
    parser.add_argument("--sparse-plan", default=None, help="a plan from `oomb calibrate` (per-layer budgets)")
    add_option(parser, "--sparse-sink-pages", "--sink-pages", dest="sink_pages", type=int, default=d.sink_pages)
    add_option(parser, "--sparse-selection", "--selection", dest="selection", choices=SPARSE_SELECTIONS,
               default=d.selection)
    add_option(parser, "--sparse-leak-free", "--leak-free", dest="leak_free", action="store_true",
               help="score each block with the page of queries before it and its first query")
    add_option(parser, "--sparse-query-block-pages", "--query-block-pages", dest="query_block_pages", type=int,
               default=d.query_block_pages, help="consecutive query blocks (pages of queries) sharing one selection")
    add_option(parser, "--sparse-rerank-factor", "--rerank-factors", dest="rerank_factors", type=int, nargs="+",
               default=d.rerank_factors, help="score rerank: candidate pages per block as multiples of the budget")
    add_option(parser, "--sparse-rerank-candidates", "--rerank-candidates", dest="rerank_candidates", nargs="+",
               choices=RERANK_CANDIDATES, default=d.rerank_candidates,
               help="score rerank: the summary scores proposing the candidates")
    add_option(parser, "--sparse-candidate-pooling", "--candidate-poolings", dest="candidate_poolings", nargs="+",
               choices=CANDIDATE_POOLINGS, default=d.candidate_poolings,
               help="score rerank: how a block's rows pool the candidates' summary scores")
    add_option(parser, "--sparse-normaliser-pages", "--normaliser-pages", dest="normaliser_pages", nargs="+",
               type=parse_normaliser_pages, default=d.normaliser_pages,
               help="softmax_max pooling: history pages its normaliser counts besides the sinks, one arm "
                             "each ('all': every page)")
    parser.add_argument("--chunk-size", type=parse_tokens, default=d.chunk_size)
    parser.add_argument("--page-size", type=parse_tokens, default=d.page_size)
    parser.add_argument("--dtype", default=d.dtype, help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16")
    parser.add_argument("--device", default=d.device, help="cpu or cuda")
    parser.add_argument("--seed", type=int, default=d.seed, help="random weights and random ids")
    parser.add_argument("--hf", choices=("auto", "on", "off"), default=d.hf,
                        help=f"also check dense vs full-sequence HF (auto: up to {HF_AUTO_MAX_TOKENS} tokens)")
    parser.add_argument("--yarn", type=float, default=None,
                        help="extend the model's RoPE with YaRN by this factor (e.g. 4: 8K -> 32K)")
    parser.add_argument("--reads", type=parse_share, nargs="+", default=d.reads, metavar="SHARE",
                        help="also run, per score, the budget that reads about this share of the history "
                             "(e.g. 0.01 0.03 0.1 0.25); with --sparse-score auto exact: the defaults and the oracle "
                             "at equal reads")
    parser.add_argument("--read-shares", type=parse_share, nargs="+", default=d.read_shares, metavar="SHARE",
                        help="also run, per score, sparse.read_share at these shares over the default budget (every "
                             "query block reads the share of its history; 0.35 is the defaults): against --reads' "
                             "and --sparse-budget's fixed budgets at equal reads")
    parser.add_argument("--offload", action="store_true",
                        help="offload.enabled for every step: pages in host memory, the same gradients bit for bit "
                             "(for lengths whose pages do not fit the GPU; not with --sparse-score exact)")
    parser.add_argument("--kv-grad-dtype", choices=("float32", "bfloat16"), default=d.kv_grad_dtype,
                        help="precision.kv_grad_dtype of every step: the page gradients' dtype (bfloat16 halves "
                             "their memory)")
    parser.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                        help="after the comparisons, train this many dense LoRA steps on the text that follows "
                             "the measured sequence (a short context extension at --seq-len), then compare again")
    parser.add_argument("--warmup-lr", type=float, default=d.warmup_lr, help="the warm-up's AdamW learning rate")
    parser.add_argument("--dense-cache", default=None, metavar="DIR",
                        help="keep the dense step's loss and gradients in DIR, and take them from there when a "
                             "run of the same model, tokens, chunk and page sizes and machine kept them")
    parser.add_argument("--json", dest="json_path", default=None,
                        help="also write the report as JSON here (rewritten after each step: a stopped run keeps "
                             "what finished)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar over each step's chunks and a line per finished step on stderr "
                             "(default: when stderr is a terminal; the lines are always printed)")


def main(args: argparse.Namespace) -> int:
    names = {f for f in GradcheckOptions.__dataclass_fields__}
    given = {k: v for k, v in vars(args).items() if k in names}
    if given.get("dense_layers", "") is None:  # the option not given: the step's default
        del given["dense_layers"]
    options = GradcheckOptions(**given)
    command = "oomb " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["gradcheck"] else None
    progress = args.progress if getattr(args, "progress", None) is not None else sys.stderr.isatty()

    def save(report: dict, done: str | None = None) -> None:
        if done is not None:
            print(f"gradcheck: {done}", file=sys.stderr, flush=True)
        if options.json_path:
            path = Path(options.json_path)
            partial = path.with_name(path.name + ".partial")
            partial.write_text(json.dumps({**report, "command": command}, indent=2))
            partial.replace(path)  # whole files only, also when stopped mid-write

    report = run_gradcheck(options, progress=progress, on_step=save)
    report["command"] = command
    print(format_report(report))
    if options.json_path:
        save(report)
        print(f"wrote {options.json_path}")
    return 0
