"""Which dtype the dK/dV page buffers should have (OOMBConfig.precision.kv_grad_dtype): bf16 vs float32, measured.

    # one H100: SmolLM2-135M on the Python standard library's source, 64 and 128 chunks (about 7 minutes: the
    # float32 reference, plain torch attention, took 73 s at 32K and 260 s at 64K; at 128K it would not finish
    # in a 10-minute call)
    python benchmarks/kv_grad_dtype.py --model smollm2 --data python-stdlib --seq-len 32K 64K --yarn 16 \
        --chunk-size 512 --page-size 64 --device cuda --out "$OUT/kv_grad_dtype.json"
    # 256 chunks at the cost of 32K: smaller chunks
    python benchmarks/kv_grad_dtype.py --model smollm2 --data python-stdlib --seq-len 32K --yarn 16 \
        --chunk-size 128 --page-size 64 --device cuda --out "$OUT/kv_grad_dtype_256.json"
    # CPU smoke: the tiny random preset, everything in float32 (arms 2 and 4 then equal the reference)
    python benchmarks/kv_grad_dtype.py --model tiny-qwen2 --seq-len 1K --chunk-size 128 --page-size 32 \
        --device cpu --dtype float32 --out /tmp/kv.json

Per sequence length, on the first that many tokens of one text (the same tokens, weights and seed for
every arm):

    reference    oomb dense, the model in float32, float32 page gradients: the exact gradient (oomb's
                 float32 dense step equals an fp32 full-sequence HF backward, tests/test_engine.py)
    kv float32   oomb dense, the model in --dtype (bf16), float32 page gradients (the default)
    kv bfloat16  oomb dense, the model in --dtype, bfloat16 page gradients
    hf           Hugging Face's own full-sequence backward of the --dtype model: SDPA, gradient
                 checkpointing, model(input_ids, labels=input_ids).loss.backward(); where its full-vocabulary
                 logits do not fit (--hf-loss auto), the same with oomb's chunked LM-head loss (what
                 `oomb bench`'s hf mode runs); null, with the reason, where neither fits

For each arm: the relative error ||g - g_ref|| / ||g_ref|| and the cosine of all trainable parameters'
gradients together (and per decoder layer), summed in float64; ``ratio_to_hf`` = the arm's error / HF's;
the loss; the step's wall time (CUDA synchronised before and after) and its peak GPU memory. The script
states numbers only; the choice (bf16 where it stays within HF's error and is faster) is the reader's.

Timing: a warm-up (``--warmup``, on by default) runs every arm once on the first two chunks, so Triton
kernels are compiled before any timed step; cuDNN still builds a graph for each attention shape it has not
seen, so the first arm on the cuDNN backend at a new length pays those builds (``--timing-repeats N``
times the bf16 arms N more times, without comparing gradients, for steady numbers).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import shlex
import sys
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

import torch

from oomb.attention.backend import resolve_backend_name
from oomb.config import OOMBConfig, PerformanceConfig, PrecisionConfig, resolve_dtype
from oomb.engine import forward_backward
from oomb.kv import split_into_chunks
from oomb.machine import detect_gpu, machine_info, versions
from oomb.tools.bench import enable_checkpointing, hf_step
from oomb.tools.gradcheck import REAL_CODE, REAL_TEXT, GradcheckOptions, compare, load_sequence
from oomb.tools.plan import parse_tokens

GIB = 1024**3
RANDOM_IDS = "random"
"""--data random: random token ids (the seed's) instead of a text."""
HF_LOSSES = ("auto", "full", "chunked")
ARMS = ("kv_float32", "kv_bfloat16", "hf")


def _log(message: str) -> None:
    print(f"kv_grad_dtype: {message}", file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    """Return what the last arm left (its pages, the HF graph) before the next one allocates."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _timed(step: Callable[[], float], model: torch.nn.Module, device: torch.device) -> dict:
    """Run ``step`` (one forward + backward leaving gradients in ``model``'s .grad) from zeroed gradients:
    its loss, wall seconds and peak GPU memory."""
    model.zero_grad(set_to_none=True)
    _free(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    start = time.perf_counter()
    loss = step()
    _sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    return {"loss": loss, "seconds": seconds, "peak_gib": peak}


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters' gradients by name, as float32 copies (the reference's: one copy of the model)."""
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _held_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The same without copying: compare() reads each one in float64 a parameter at a time."""
    return {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}


def _oomb_step(model, ids, config: OOMBConfig, progress: bool) -> Callable[[], float]:
    return lambda: float(forward_backward(model, ids, config=config, progress=progress))


def _hf_full_step(model, ids) -> Callable[[], float]:
    """Plain HF: model(input_ids, labels=input_ids).loss.backward() with SDPA and gradient checkpointing."""
    def step() -> float:
        enable_checkpointing(model)
        try:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        finally:
            (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
        return float(loss.detach())
    return step


def _hf_chunked_step(model, ids) -> Callable[[], float]:
    """HF's model body and attention, oomb's chunked LM-head loss (never the full-vocabulary logits)."""
    return lambda: hf_step(model, ids, OOMBConfig().performance.loss_chunk_tokens)


def _run_hf(model, ids, hf_loss: str, device: torch.device) -> tuple[dict | None, str | None, str | None]:
    """(timing, loss variant used, why not / why chunked) of HF's backward; None where it did not fit."""
    tried = []
    for variant in (("full", "chunked") if hf_loss == "auto" else (hf_loss,)):
        step = _hf_full_step(model, ids) if variant == "full" else _hf_chunked_step(model, ids)
        try:
            return _timed(step, model, device), variant, "; ".join(tried) or None
        except torch.OutOfMemoryError as err:
            tried.append(f"{variant} loss: out of memory ({str(err).splitlines()[0]})")
        model.zero_grad(set_to_none=True)
        _free(device)
    return None, None, "; ".join(tried)


def _scores(model, reference: dict[str, torch.Tensor]) -> dict:
    """Total relative error and cosine of ``model``'s gradients against ``reference``, and per group."""
    groups = compare(_held_gradients(model), reference)
    total = groups.pop("total")
    return {"rel_err": total["rel_err"], "cosine": total["cosine"],
            "groups": {k: {"rel_err": v["rel_err"], "cosine": v["cosine"]} for k, v in groups.items()}}


def _empty_arm(**fields) -> dict:
    return {"loss": None, "loss_gap": None, "seconds": None, "peak_gib": None, "rel_err": None, "cosine": None,
            "ratio_to_hf": None, "groups": None, "error": None, **fields}


def run(args: argparse.Namespace) -> dict:
    """Every arm at every length; returns the report (also written to --out after each length)."""
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, "--dtype")
    text = None if args.data == RANDOM_IDS else args.data
    options = GradcheckOptions(model=args.model, text=text, seq_len=max(args.seq_len), dtype="float32",
                               device=args.device, seed=args.seed, yarn=args.yarn)
    _log(f"loading {args.model} and {max(args.seq_len):,} tokens of {args.data}")
    reference_model, ids, _, source = load_sequence(options)  # (1, max seq_len) ids on the device
    # Every arm trains: HF checkpoints layers only in training mode. The models have no active dropout.
    reference_model.train()
    model = copy.deepcopy(reference_model)
    rounded = False
    with torch.no_grad():
        for ref_param, param in zip(reference_model.parameters(), model.parameters(), strict=True):
            # Only parameters change dtype: buffers (RoPE's inv_freq) stay float32, as from_pretrained(dtype=bf16)
            # keeps them. Both models then hold the same weights (a bf16 checkpoint is exact in float32; random
            # float32 weights are rounded to --dtype in the reference too), so only the step's arithmetic differs.
            param.data = param.data.to(dtype)
            rounded |= not torch.equal(param.data.float(), ref_param.data)
            ref_param.data.copy_(param.data)
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    oomb_backend = resolve_backend_name(args.backend, device, dtype)
    reference_backend = resolve_backend_name("auto", device, torch.float32)
    report = {
        "benchmark": "kv_grad_dtype", "date": date.today().isoformat(),
        "command": shlex.join(["python", "benchmarks/kv_grad_dtype.py", *args.argv]),
        "versions": versions(), "machine": machine_info(device, detect_gpu(device) if device.type == "cuda" else None),
        "model": args.model, "parameters": parameters, "sequence": source, "dtype": str(dtype).removeprefix("torch."),
        "weights_rounded_to_dtype": rounded, "chunk_size": args.chunk_size, "page_size": args.page_size,
        "yarn": args.yarn, "seed": args.seed, "hf_loss": args.hf_loss,
        "backends": {"reference": reference_backend, "oomb": oomb_backend},
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "timing": "seconds: one step, CUDA synchronised before and after; the first arm on a backend at a new "
                  "length includes cuDNN graph builds for attention shapes not seen before"
                  + ("" if args.warmup else ", and the first step of each arm its kernel compilation"),
        "lengths": [],
    }

    def configs(kv_grad: str, backend: str) -> OOMBConfig:
        return OOMBConfig(chunk_size=args.chunk_size, page_size=args.page_size,
                          precision=PrecisionConfig(kv_grad_dtype=kv_grad),
                          performance=PerformanceConfig(backend=backend))

    reference_config = configs("float32", "auto")
    arm_configs = {"kv_float32": configs("float32", args.backend), "kv_bfloat16": configs("bfloat16", args.backend)}
    progress = sys.stderr.isatty() if args.progress is None else args.progress

    def save() -> None:
        if args.out:
            path = Path(args.out)
            partial = path.with_name(path.name + ".partial")
            partial.write_text(json.dumps(report, indent=1))
            partial.replace(path)  # whole files only, also when stopped mid-write

    if args.warmup:
        short = ids[:, : min(2 * args.chunk_size, ids.shape[1])]
        start = time.perf_counter()
        _log(f"warm-up: every arm on {short.shape[1]} tokens")
        _timed(_oomb_step(reference_model, short, reference_config, False), reference_model, device)
        for config in arm_configs.values():
            _timed(_oomb_step(model, short, config, False), model, device)
        _run_hf(model, short, args.hf_loss, device)
        reference_model.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        report["warmup_seconds"] = time.perf_counter() - start

    for seq_len in args.seq_len:
        tokens = ids[:, :seq_len]
        chunks = len(split_into_chunks(seq_len, args.chunk_size))
        where = f"{seq_len:,} tokens ({chunks} chunks)"
        entry = {"seq_len": seq_len, "chunks": chunks, "pages": math.ceil(seq_len / args.page_size)}
        report["lengths"].append(entry)

        _log(f"{where}: reference (oomb dense, float32 model, float32 page gradients, {reference_backend})")
        timing = _timed(_oomb_step(reference_model, tokens, reference_config, progress), reference_model, device)
        reference = _gradients(reference_model)
        reference_model.zero_grad(set_to_none=True)
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in reference.values()))
        entry["reference"] = {**timing, "grad_norm": norm, "backend": reference_backend}
        _log(f"{where}: reference loss {timing['loss']:.6f} ({timing['seconds']:.1f} s)")
        if args.repeat_reference:
            again = _timed(_oomb_step(reference_model, tokens, reference_config, progress), reference_model, device)
            entry["reference_repeat"] = {**again, **_scores(reference_model, reference)}
            reference_model.zero_grad(set_to_none=True)
            _log(f"{where}: reference again: relative error {entry['reference_repeat']['rel_err']:.3e}")
        save()

        arms = entry["arms"] = {}
        for name, config in arm_configs.items():
            kv_grad = str(config.precision.grad_dtype).removeprefix("torch.")
            _log(f"{where}: oomb dense, {report['dtype']} model, {kv_grad} page gradients, {oomb_backend}")
            try:
                timing = _timed(_oomb_step(model, tokens, config, progress), model, device)
            except torch.OutOfMemoryError as err:
                arms[name] = _empty_arm(kv_grad_dtype=kv_grad, backend=oomb_backend,
                                        error=f"out of memory ({str(err).splitlines()[0]})")
                model.zero_grad(set_to_none=True)
                _free(device)
                continue
            arms[name] = _empty_arm(kv_grad_dtype=kv_grad, backend=oomb_backend, **timing, **_scores(model, reference))
            model.zero_grad(set_to_none=True)
            repeats = [_timed(_oomb_step(model, tokens, config, progress), model, device)["seconds"]
                       for _ in range(args.timing_repeats)]
            model.zero_grad(set_to_none=True)
            arms[name]["seconds_repeats"] = repeats
            _log(f"{where}: relative error {arms[name]['rel_err']:.3e}, loss {timing['loss']:.6f} "
                 f"({timing['seconds']:.1f} s{''.join(f', {s:.1f} s' for s in repeats)})")
            save()

        _log(f"{where}: HF full-sequence backward, {report['dtype']} model (SDPA, gradient checkpointing)")
        timing, variant, why = _run_hf(model, tokens, args.hf_loss, device)
        if timing is None:
            arms["hf"] = _empty_arm(loss_variant=None, error=why)
            _log(f"{where}: HF did not fit: {why}")
        else:
            arms["hf"] = _empty_arm(loss_variant=variant, **timing, **_scores(model, reference), error=why)
            _log(f"{where}: HF relative error {arms['hf']['rel_err']:.3e} ({timing['seconds']:.1f} s, {variant} loss)")
        model.zero_grad(set_to_none=True)
        del reference
        _free(device)

        hf_error = arms["hf"]["rel_err"]
        for name, arm in arms.items():
            if arm["loss"] is not None:
                arm["loss_gap"] = (arm["loss"] - entry["reference"]["loss"]) / entry["reference"]["loss"]
            if name != "hf" and arm["rel_err"] is not None and hf_error:
                arm["ratio_to_hf"] = arm["rel_err"] / hf_error
        save()
    return report


def format_report(report: dict) -> str:
    """One table row per (length, arm)."""
    lines = [f"kv_grad_dtype: {report['model']} ({report['parameters']:,} parameters, {report['dtype']}), "
             f"{report['sequence']}, chunk {report['chunk_size']}, page {report['page_size']}, "
             f"backends: reference {report['backends']['reference']}, oomb {report['backends']['oomb']}"]
    header = f"{'tokens':>9} {'chunks':>6}  {'arm':<12} {'loss':>9} {'rel err':>10} {'cosine':>11} " \
             f"{'x HF err':>8} {'seconds':>8} {'peak GiB':>8}"
    lines += [header, "-" * len(header)]

    def cell(value, spec: str, width: int) -> str:
        return f"{value:>{width}{spec}}" if value is not None else f"{'-':>{width}}"

    for entry in report["lengths"]:
        ref = entry["reference"]
        rows = [("reference", {**ref, "rel_err": None, "cosine": None, "ratio_to_hf": None})]
        rows += [(name, arm) for name, arm in entry.get("arms", {}).items()]
        for name, row in rows:
            lines.append(f"{entry['seq_len']:>9,} {entry['chunks']:>6}  {name:<12} {cell(row['loss'], '.5f', 9)} "
                         f"{cell(row['rel_err'], '.3e', 10)} {cell(row['cosine'], '.8f', 11)} "
                         f"{cell(row['ratio_to_hf'], '.3f', 8)} {cell(row['seconds'], '.1f', 8)} "
                         f"{cell(row['peak_gib'], '.1f', 8)}")
            if row.get("error"):
                lines.append(f"{'':>18}{name}: {row['error']}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 (the real SmolLM2-135M-Instruct, oomb/real_model.py), a preset (random "
                             "weights, e.g. tiny-qwen2) or a local HF model directory")
    parser.add_argument("--data", default=REAL_CODE,
                        help=f"{REAL_CODE!r} (the Python standard library's source), {REAL_TEXT!r} (Python's English "
                             f"docs, ~110K SmolLM2 tokens), a text file, or {RANDOM_IDS!r} (random ids)")
    parser.add_argument("--seq-len", type=parse_tokens, nargs="+", default=[32768, 131072],
                        help="sequence lengths, each the first that many tokens of the same text (e.g. 32K 128K)")
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--yarn", type=float, default=None,
                        help="extend the model's RoPE with YaRN by this factor (SmolLM2 has 8K positions: 16 for 128K)")
    parser.add_argument("--dtype", default="bfloat16",
                        help="the model dtype of the kv_float32, kv_bfloat16 and hf arms (float32: a test of the "
                             "tool, where kv_float32 and hf must equal the reference)")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "triton", "cudnn"),
                        help="oomb's attention backend in the kv_float32 and kv_bfloat16 arms (the reference runs "
                             "'auto': torch for float32)")
    parser.add_argument("--hf-loss", choices=HF_LOSSES, default="auto",
                        help="HF arm: full (HF's own loss over full-vocabulary logits), chunked (oomb's chunked "
                             "LM-head loss after HF's model body), auto (full, chunked where full is out of memory)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0, help="random weights (presets) and random ids")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="run every arm once on the first two chunks before the timed steps")
    parser.add_argument("--timing-repeats", type=int, default=0,
                        help="time each oomb bf16 arm this many more times per length (gradients not compared)")
    parser.add_argument("--repeat-reference", action="store_true",
                        help="run the reference twice per length and report the second against the first "
                             "(the reference's own reproducibility)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar over each step's chunks (default: when stderr is a terminal)")
    parser.add_argument("--out", default=None, help="write the report as JSON here (rewritten after each arm)")
    args = parser.parse_args(argv)
    for value in args.seq_len:
        if value < 2:
            parser.error(f"--seq-len {value}: a sequence needs at least 2 tokens (one label)")
    if args.timing_repeats < 0:
        parser.error(f"--timing-repeats {args.timing_repeats} must be >= 0")
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    report = run(args)
    print(format_report(report))
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
