"""Context extension of a real model with YaRN and LoRA at any length: HF vs oomb dense vs oomb sparse.

    # tokenize the data once, on any machine (SmolLM2's tokenizer, Python's stdlib and docs)
    python benchmarks/context_extension.py prepare --out data/ctx                      # 32K sequences
    python benchmarks/context_extension.py prepare --out data/ctx128k --seq-len 128K   # 128K sequences
    # on a GPU: train every arm on the same data, seed and steps; evaluate each with dense attention
    python benchmarks/context_extension.py run --data data/ctx --model <smollm2 dir> --out out/ctx --steps 40
    # or one arm (or a few) per invocation, then merge the arm files
    python benchmarks/context_extension.py run --data data/ctx --model <smollm2 dir> --out out/ctx --arms dense
    python benchmarks/context_extension.py run --data data/ctx --model <smollm2 dir> --out out/ctx --arms sparse
    python benchmarks/context_extension.py report --inputs out/ctx/base.json out/ctx/dense.json \\
        out/ctx/sparse.json --out ctx.json --png ctx.png

Lengths. The model's native length N is its config's max_position_embeddings (8K for SmolLM2; --native-len
overrides it). A run at L tokens stretches RoPE with YaRN by --yarn (default L / N: x4 at 32K, x16 at 128K),
counts perplexity in position buckets doubling from N (oomb/perplexity.py's position_buckets: 0-8K, 8K-16K,
16K-32K at 32K; ..., 32K-64K, 64K-128K at 128K) and asks passkeys at the last three doublings up to L
(8K/16K/32K at 32K, 32K/64K/128K at 128K). With the defaults at 32K this is the experiment the results
index's `context-extension` scenario ran.

Arms: "hf" (transformers + SDPA + gradient checkpointing, one full-sequence backward; an out-of-memory
error is recorded as the arm's result), "dense" (oomb, exact) and "sparse" (oomb sparse with the settings
given by --sparse, default: OOMBConfig's sparse defaults), plus further sparse arms named by --sparse-arm.
Every trained adapter, and the untrained model, is evaluated with dense (exact) attention through oomb's
stage-1 forward (oomb/evaluate.py, what `oomb eval` runs: oomb/perplexity.py, oomb/passkey.py): held-out
perplexity by position bucket on English documentation and on code, and passkey retrieval with a fixed set
of prompts, judged teacher-forced (retrieved iff the greedy prediction at every answer token is right).

Files. `run` writes <out>/base.json (the untrained model's evaluation; skipped with --no-base-eval or when
<out>/base.json already holds it for the same data and settings) and <out>/<arm>.json per arm: losses and
seconds per step, the OOMBConfig, load, training and evaluation seconds, peak GPU memory, the evaluation,
the command, commit, machine and versions. An arm whose file is already in <out> (same data and settings)
is not run again. It then merges what it has into <out>/context_extension.json and .png, as `report` does
for files of several invocations or machines: one JSON (the arms under "arms", the untrained model under
"base_eval", as the committed 32K results), a PNG of the learning curves side by side (training loss per
step; loss relative to the dense arm's), and a table: perplexity per bucket of every arm, the sparse arms'
ratio to dense, passkeys retrieved, and the criterion's verdict, computed from the numbers: every sparse arm
within 1 % of the dense-trained model in every bucket of both held-out sets (|sparse / dense - 1| <= 0.01)
and at least as many passkeys retrieved in all.

Splitting an arm over several invocations: with --state DIR each step's LoRA weights, optimizer and
scheduler state, losses and times go to DIR/<arm>/state.pt, and an invocation with the same DIR continues
from the last step saved (the same data order and schedule, so the result is that of one run). --time-limit
MINUTES stops an invocation (state saved, no arm file yet) before a step, or the evaluation, that would end
past that many minutes from its start; --stop-at STEP stops after that many steps. The evaluation's time is
taken as 1.25 x base.json's when <out> holds it, else EVAL_RESERVE_S.

Training data: Python's standard library source (each module a document, concatenated with EOS; modules
two folders deep first, as the 32K runs used, then the rest of the library, then the installed torch
package's source where a long run needs more), cut into sequences of --seq-len tokens; held out: the last
sequences of that stream and Python's English help topics (oomb/real_model.py's english_text; where they
hold less than one sequence, followed by the standard library's English text files, ENGLISH_FILES), which
training never sees. meta.json records the sources, versions and the files' SHA-256.

128K on an H100: time estimates (estimates, not measurements). The committed 32K runs
(benchmarks/results/real_model/context_extension_*_h100_*.json, one H100) took 3.92 s a dense step and
5.95 s a sparse one (budget 64, 46 % of the history read), mean of steps 2-40 (the first: 7.5 s and 36.7 s,
compiling). Split each into attention and the rest: the dense attention of a step (stage-1 forward, the
recomputed forward and the backward, about 4.5 forwards of 2 x T^2 x 576 x 30 causal FLOPs: 167 TFLOP at
32K) at about 300 TFLOP/s is 0.56 s at 32K; the rest grows 4x to 128K, the attention 16x:

    dense   4 x (3.92 - 0.56) + 16 x 0.56                        = 22 s a step
    sparse  4 x (5.95 - 0.32) + 16 x (0.35 x 0.56 + 0.06 scoring)  = 27 s a step (a uniform 35 % read)

The steps `oomb gradcheck` timed on SmolLM2 at 128K on an H100 (full-weight gradients, chunk 4096, page 128;
benchmarks/results/real_model/gradcheck_smollm2_128k*_h100.json) took 12.8-18.3 s dense and 14.2-25.5 s at
35 % read (the longer ones first steps), so the scaling is the upper end of a warm step and the measured
warm steps (12.8 s, 14.2 s) the lower. Per arm, on an H100 (lower-upper):

    arm                          40 steps        20 steps        first step, load
    dense                        8.5-15 min      4.3-7.4 min     +0.3 min
    sparse defaults, best        9.5-18 min      4.8-9 min       +0.8 min (compiling)
    hf                           out of memory expected at the first step on an H100 (the 128K x 49152
                                 logits in bf16, their float32 copy and its gradient are about 64 GB, and
                                 cross-entropy keeps a float32 log-softmax as large): < 1 min; where it
                                 fits (an H200), about a dense arm's time
    evaluation, every model      1.5-2 min (3 held-out sequences of 128K at about 5 s, 30 passkey
                                 prompts: 10 each at 128K about 5 s, 64K 1.7 s, 32K 0.6 s)

40 steps of the three trained arms and the five evaluations are 35-60 min of device time: three sessions
of at most 30 minutes (20 steps: 22-35 min, two sessions). A session's machine keeps /tmp only while it is
held, so an arm is finished within one session; each call below ends within 9 minutes (--time-limit 8.5,
`timeout 540` as the guard; the state is saved after every step), and the next call of the session, made
while the machine is still warm, continues it.

GPU command sequence for 128K, 40 steps (<smollm2>: the model directory built on the machine; <data>: the
prepared folder inside the checkout, ignored by git and named in each call's carry, 11 MB; <sha>: the
commit; <best>: the JSON of the best sparse setting found, e.g. '{"sparse.read_share": 0.5}', the most
faithful share measured at 128K in docs/sparse.md):

    # here, once (17 s)
    python benchmarks/context_extension.py prepare --out <data> --seq-len 128K --train-sequences 40
    # every GPU call of a session runs this one command, with the session's ARMS and EXTRA:
    timeout 540 python benchmarks/context_extension.py run --data <data> --model <smollm2> --seq-len 128K \\
        --steps 40 --out /tmp/ctx128k --state /tmp/ctx128k/state --time-limit 8.5 --commit <sha> \\
        --sparse-arm sparse_best='<best>' --arms ARMS EXTRA; cp /tmp/ctx128k/*.json $OUT/
    # session 1, ARMS="dense hf", EXTRA="" (upper estimate 25 min with the machine's start):
    #   call 1: the untrained model's evaluation (1.5-2 min) -> base.json, dense steps 1 to about 16
    #   call 2: dense to about step 38
    #   call 3: dense to step 40 and its evaluation -> dense.json; hf -> hf.json (out of memory, on an H100)
    # session 2, ARMS="sparse", EXTRA="--no-base-eval" (upper estimate 25 min):
    #   calls 1-2: sparse to about step 35; call 3: to step 40 and its evaluation -> sparse.json
    # session 3, ARMS="sparse_best", EXTRA="--no-base-eval": as session 2 -> sparse_best.json
    # here: merge, table, verdict, PNG
    python benchmarks/context_extension.py report --inputs base.json hf.json dense.json sparse.json \\
        sparse_best.json --out context_extension_128k.json --png context_extension_128k.png

A call that is repeated after a session ended starts the arm again (its state was on that machine). With
20 steps (--steps 20; prepare --train-sequences 20): session 1 ARMS="dense hf" (13 min at the upper
estimates: 2 calls), session 2 ARMS="sparse sparse_best" EXTRA="--no-base-eval" (24 min: 3 calls); where
session 1's dense steps take under 15 s (the lower estimate), add sparse to its ARMS.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import shlex
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from datetime import date
from pathlib import Path

import numpy as np
import torch

from oomb.perplexity import bucket_name, position_buckets
from oomb.units import format_tokens, parse_tokens

SCRIPT = "benchmarks/context_extension.py"
PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
PASSKEYS_PER_POINT = 2  # prompts per (length, depth): 10 per length
HELDOUT_CODE = 2
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
REFERENCE_ARM = "dense"
TOLERANCE = 0.01
"""The criterion: a sparse arm's perplexity within this fraction of the dense arm's in every bucket."""
EVAL_RESERVE_S = 180.0
"""With --time-limit and no base.json to time it by: the seconds an evaluation is assumed to take."""
FIRST_STEP_RESERVE_S = 90.0
"""With --time-limit: the seconds an arm's first step in an invocation is assumed to take where no earlier
step of the arm was timed (loading, compiling)."""
ENGLISH_FILES = ("LICENSE.txt", "idlelib/NEWS.txt", "idlelib/NEWS2x.txt", "idlelib/README.txt", "idlelib/HISTORY.txt",
                 "idlelib/TODO.txt", "email/architecture.rst", "idlelib/extend.txt", "idlelib/CREDITS.txt")
"""English text files of the standard library (relative to it) that extend the held-out English, in this
order, where the help topics hold less than one sequence (128K: they are about 113K SmolLM2 tokens)."""
CODE_PACKAGES = ("torch",)
"""Installed packages whose Python source follows the standard library's in the training stream, read only
where the library holds too few tokens (at 128K, 40 sequences need 5.5M tokens; the library has about 3.4M)."""
EVAL_KEYS = ("seq_len", "native_len", "yarn", "chunk_size", "page_size", "buckets", "passkey_lengths")
"""Settings every merged file must share (the evaluation's)."""
TRAIN_KEYS = ("steps", "lr", "seed", "lora")
"""Further settings every merged file with a trained arm must share."""


# ---------------------------------------------------------------------------------------------------- prepare

def passkey_lengths(seq_len: int) -> list[int]:
    """The last three doublings up to ``seq_len``: 8K/16K/32K at 32K, 32K/64K/128K at 128K."""
    return sorted({seq_len // 4, seq_len // 2, seq_len})


def code_files() -> Iterator[tuple[str, Path]]:
    """(source, path) of the training stream's documents, in order: the standard library's modules up to
    two folders deep (test folders and test_* files left out), then its other modules, then CODE_PACKAGES'."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    seen = set()
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        if "test" in path.parts[-2:][0] or path.name.startswith("test"):
            continue
        seen.add(path)
        yield "stdlib", path
    for path in sorted(stdlib.rglob("*.py")):
        folders = path.relative_to(stdlib).parts[:-1]
        if path in seen or path.name.startswith("test") or "site-packages" in folders or any(
                "test" in folder for folder in folders):
            continue
        yield "stdlib", path
    for name in CODE_PACKAGES:
        try:
            module = __import__(name)
        except ImportError:
            continue
        root = Path(module.__file__).parent
        for path in sorted(root.rglob("*.py")):
            if any(part.startswith(("test", "_test")) or part == "testing" for part in path.relative_to(root).parts):
                continue
            yield f"{name} {getattr(module, '__version__', '')}".strip(), path


def english_heldout(tokenizer, seq_len: int, sequences: int | None) -> tuple[np.ndarray, list[str]]:
    """(sequences, seq_len) token ids of held-out English and the texts they came from: the help topics, then
    ENGLISH_FILES where the topics hold fewer than ``sequences`` (None: every whole one, at least one)."""
    from oomb.real_model import english_text

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text, sources = english_text(), ["pydoc_data.topics"]
    ids = tokenizer(text)["input_ids"]
    extra = [stdlib / name for name in ENGLISH_FILES if (stdlib / name).is_file()]
    while len(ids) < seq_len * (sequences or 1) and extra:
        path = extra.pop(0)
        text += "\n\n" + path.read_text(errors="replace")
        sources.append(str(path.relative_to(stdlib)))
        ids = tokenizer(text)["input_ids"]
    count = len(ids) // seq_len if sequences is None else sequences
    if count < 1 or len(ids) < count * seq_len:
        raise SystemExit(f"held-out English: {len(ids)} tokens, fewer than {max(count, 1)} x {seq_len}")
    return np.array(ids[: count * seq_len]).reshape(count, seq_len), sources


def token_dtype(tokenizer) -> type:
    return np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.uint32


def prepare(out: Path, seq_len: int, train_sequences: int, *, tokenizer_path: Path | None = None,
            heldout_code: int = HELDOUT_CODE, heldout_english: int | None = None,
            depths: Sequence[float] = PASSKEY_DEPTHS, per_point: int = PASSKEYS_PER_POINT) -> None:
    """Tokenize the training stream, the held-out sets and the passkey prompts into ``out``."""
    from transformers import AutoTokenizer

    from oomb.passkey import passkey_prompts
    from oomb.real_model import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or smollm2_dir())
    dtype = token_dtype(tokenizer)
    eos = tokenizer.eos_token_id
    need = (train_sequences + heldout_code) * seq_len
    stream: list[int] = []
    sources: dict[str, int] = {}
    for source, path in code_files():
        stream += tokenizer(path.read_text(errors="replace"))["input_ids"] + [eos]
        sources[source] = sources.get(source, 0) + 1
        if len(stream) >= need:
            break
    if len(stream) < need:
        raise SystemExit(f"only {len(stream)} tokens of source code, need {need}")
    code = np.array(stream[:need], dtype=dtype).reshape(train_sequences + heldout_code, seq_len)
    english, english_sources = english_heldout(tokenizer, seq_len, heldout_english)
    lengths = passkey_lengths(seq_len)
    prompts = passkey_prompts(tokenizer, lengths, depths, per_point, seed=0)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "train.npy", code[:train_sequences])
    np.save(out / "heldout_code.npy", code[train_sequences:])
    np.save(out / "heldout_english.npy", english.astype(dtype))
    np.savez_compressed(out / "passkey.npz", *[np.array(p.input_ids, dtype=dtype) for p in prompts])
    (out / "passkey.json").write_text(json.dumps([{k: v for k, v in asdict(p).items() if k != "input_ids"}
                                                  for p in prompts]))
    files = ("train.npy", "heldout_code.npy", "heldout_english.npy", "passkey.npz", "passkey.json")
    meta = {"seq_len": seq_len, "train_sequences": train_sequences, "heldout_code": heldout_code,
            "heldout_english": len(english), "passkey_lengths": lengths, "passkey_depths": list(depths),
            "passkeys_per_point": per_point, "code_sources": sources, "english_sources": english_sources,
            "tokenizer": str(tokenizer_path or "smollm2"), "stdlib": sysconfig.get_paths()["stdlib"],
            "python": platform.python_version(),
            "sha256": {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in files}}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"wrote {out}: train {code[:train_sequences].shape}, heldout code {code[train_sequences:].shape}, "
          f"english {english.shape} ({', '.join(english_sources)}), {len(prompts)} passkey prompts at "
          f"{'/'.join(format_tokens(n) for n in lengths)}; code from {sources}")


# ------------------------------------------------------------------------------------------- model, evaluation

def data_meta(data: Path) -> dict:
    """meta.json of a prepared folder (older folders: seq_len, train_sequences and the stdlib only)."""
    return json.loads((data / "meta.json").read_text())


def load_passkeys(data: Path) -> list:
    """The prepared passkey prompts (input ids from passkey.npz; older folders kept them in passkey.json)."""
    from oomb.passkey import PasskeyPrompt

    records = json.loads((data / "passkey.json").read_text())
    if (data / "passkey.npz").is_file():
        with np.load(data / "passkey.npz") as arrays:
            ids = [arrays[f"arr_{i}"].astype(np.int64).tolist() for i in range(len(records))]
        records = [{**r, "input_ids": i} for r, i in zip(records, ids, strict=True)]
    return [PasskeyPrompt(**r) for r in records]


def load_model(path: Path, native_len: int, yarn: float, device: torch.device, dtype: torch.dtype, lora: bool):
    """The model with RoPE stretched by YaRN from ``native_len`` positions by ``yarn`` (oomb.real_model's
    with_yarn), on ``device``, LoRA r=16 on q/k/v/o where asked."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from oomb.real_model import with_yarn

    config = AutoConfig.from_pretrained(path)
    config.max_position_embeddings = native_len
    with_yarn(config, yarn)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device)
    if lora:
        model = get_peft_model(model, LoraConfig(**{**LORA, "target_modules": list(LORA["target_modules"])}))
    return model


def evaluate(model, data: Path, config, native_len: int) -> dict:
    """Dense stage-1 forward (oomb.evaluate): per-bucket perplexity of each held-out set (buckets doubling from
    ``native_len``) and passkeys retrieved per length, with the seconds of each part."""
    from oomb.evaluate import token_logprobs
    from oomb.passkey import passkey_accuracy
    from oomb.perplexity import PerplexityByPosition

    device = model.get_input_embeddings().weight.device
    result: dict = {"perplexity": {}}
    start = time.perf_counter()
    for name in ("heldout_english", "heldout_code"):
        seqs = torch.from_numpy(np.load(data / f"{name}.npy").astype(np.int64))
        totals = PerplexityByPosition(seqs.shape[1], first=native_len)
        for row in seqs:
            totals.add(token_logprobs(model, row.to(device), config=config).logprobs)
        result[name] = {b["bucket"]: b["perplexity"] for b in totals.results()}
        result["perplexity"][name] = totals.results()
    middle = time.perf_counter()
    points = passkey_accuracy(model, load_passkeys(data), config)
    hits: dict[int, list[int]] = {}
    for point in points:
        hits.setdefault(point["length"], [0, 0])
        hits[point["length"]][0] += point["retrieved"]
        hits[point["length"]][1] += point["count"]
    result["passkey"] = {format_tokens(n): retrieved / count for n, (retrieved, count) in hits.items()}
    result["passkey_retrieved"] = {format_tokens(n): pair for n, pair in hits.items()}
    result["passkey_points"] = points
    end = time.perf_counter()
    result["seconds"] = {"perplexity": middle - start, "passkey": end - middle, "total": end - start}
    return result


def eval_config(args: argparse.Namespace):
    """Every arm is evaluated alike: dense (exact) attention, the run's chunk, page and backend."""
    from oomb import OOMBConfig
    from oomb.config import PerformanceConfig

    return OOMBConfig(chunk_size=args.chunk_size, page_size=args.page_size,
                      performance=PerformanceConfig(backend=args.backend))


def arm_config(arm: str, args: argparse.Namespace):
    """The OOMBConfig an oomb arm trains with; None for "hf"."""
    from oomb import OOMBConfig

    if arm == "hf":
        return None
    options = {"chunk_size": args.chunk_size, "page_size": args.page_size, "performance.backend": args.backend}
    if arm.startswith("sparse"):
        options.update(attention="sparse", **sparse_options(arm, args))
    elif arm != "dense":
        raise SystemExit(f"unknown arm {arm!r}: hf, dense, sparse or a sparse arm named by --sparse-arm")
    return OOMBConfig.from_dict(options)  # dotted keys ("sparse.budget") or the flat ones of old records


def sparse_options(arm: str, args: argparse.Namespace) -> dict:
    """The OOMBConfig options of a sparse arm: --sparse for "sparse", --sparse-arm NAME=JSON for the others."""
    if arm == "sparse":
        return json.loads(args.sparse)
    extra = dict(spec.split("=", 1) for spec in args.sparse_arm)
    if arm not in extra:
        raise SystemExit(f"arm {arm!r} needs --sparse-arm {arm}='{{...}}' (its OOMBConfig sparse options)")
    return json.loads(extra[arm])


# --------------------------------------------------------------------------------------------------- training

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def save_state(path: Path, model, optimizer, schedule, progress: dict) -> None:
    """The arm's trainable weights, optimizer and scheduler state and progress, written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    trainable = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    temporary = path.with_suffix(".tmp")
    torch.save({"params": trainable, "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                "progress": progress}, temporary)
    temporary.replace(path)


def load_state(path: Path, model, optimizer, schedule, device: torch.device) -> dict:
    """Restore what save_state wrote; returns the progress."""
    state = torch.load(path, map_location=device, weights_only=True)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(params) != set(state["params"]):
        raise SystemExit(f"{path}: its trainable parameters are not this arm's (another model or LoRA?)")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state["params"][name])
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    return state["progress"]


class Clock:
    """The invocation's deadline (--time-limit) and the evaluation's expected seconds."""

    def __init__(self, start: float, limit_s: float | None, eval_s: float) -> None:
        self.start, self.limit_s, self.eval_s = start, limit_s, eval_s

    def fits(self, seconds: float) -> bool:
        return self.limit_s is None or time.perf_counter() - self.start + seconds <= self.limit_s


def train_arm(arm: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
              clock: Clock) -> dict | None:
    """Train one arm (continuing from --state) and evaluate it: the arm's entry, or None where this invocation
    stopped first (--time-limit, --stop-at; the state is saved)."""
    from oomb import forward_backward

    load_start = time.perf_counter()
    torch.manual_seed(args.seed)
    model = load_model(args.model, args.native_len, args.yarn, device, dtype, lora=True)
    if arm == "hf":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    config = arm_config(arm, args)
    settings = {"arm": arm, "oomb_config": config.to_dict() if config is not None else None,
                "data": data_meta(args.data).get("sha256"),
                **{k: getattr(args, k) for k in ("seq_len", "native_len", "yarn", "steps", "lr", "seed")}}
    state_path = args.state / arm / "state.pt" if args.state else None
    progress = {"settings": settings, "losses": [], "step_seconds": [], "train_seconds": 0.0, "peak_gpu_gib": None,
                "error": None, "invocations": []}
    if state_path is not None and state_path.is_file():
        saved = load_state(state_path, model, optimizer, schedule, device)
        if saved.get("settings") != settings:
            raise SystemExit(f"{state_path} was saved by a run with other settings ({saved.get('settings')}, now "
                             f"{settings}): remove it or give another --state")
        progress = saved
        print(f"{arm}: continuing from {state_path} after step {len(progress['losses'])}", flush=True)
    load_seconds = time.perf_counter() - load_start
    first = len(progress["losses"])
    progress["invocations"].append({"first_step": first, "machine": machine(device), "commit": args.commit,
                                    "date": date.today().isoformat(), "load_seconds": load_seconds})
    train = torch.from_numpy(np.load(args.data / "train.npy").astype(np.int64))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.train()
    stopped = False
    for step in range(first, args.steps):
        if progress["error"]:
            break
        last = max(progress["step_seconds"][-3:], default=0.0)
        need = 1.1 * last if step > first else max(1.1 * last, FIRST_STEP_RESERVE_S)  # the first: loading too
        if (args.stop_at is not None and step >= args.stop_at) or not clock.fits(need):
            stopped = True
            break
        ids = train[step % train.shape[0]][None].to(device)
        _sync(device)
        start = time.perf_counter()
        try:
            if arm == "hf":
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            else:
                loss = forward_backward(model, ids, config=config)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
        except torch.OutOfMemoryError as err:
            loss = None
            optimizer.zero_grad(set_to_none=True)
            progress["error"] = f"out of memory at step {step}: {str(err).splitlines()[0]}"
            print(f"{arm}: {progress['error']}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            break
        seconds = time.perf_counter() - start
        progress["step_seconds"].append(seconds)
        progress["losses"].append(float(loss.detach()))
        progress["train_seconds"] += seconds
        peak = _peak_gib(device)
        if peak is not None:
            progress["peak_gpu_gib"] = max(peak, progress["peak_gpu_gib"] or 0.0)
        if state_path is not None:
            save_state(state_path, model, optimizer, schedule, progress)
        print(f"{arm} step {step} loss {progress['losses'][-1]:.4f} {seconds:.2f} s", flush=True)
    progress["invocations"][-1]["last_step"] = len(progress["losses"])
    if state_path is not None:
        save_state(state_path, model, optimizer, schedule, progress)
    done = not stopped and (len(progress["losses"]) == args.steps or progress["error"])
    if done and not progress["error"] and not clock.fits(clock.eval_s):
        print(f"{arm}: trained; its evaluation (about {clock.eval_s:.0f} s) is left for the next invocation",
              flush=True)
        done = False
    if not done:
        print(f"{arm}: stopped after step {len(progress['losses'])} of {args.steps}; the same command with "
              f"--state {args.state} continues it", flush=True)
        return None
    evaluation = None
    if not progress["error"]:
        if arm == "hf":
            model.gradient_checkpointing_disable()
        try:
            evaluation = evaluate(model, args.data, eval_config(args), args.native_len)
        except torch.OutOfMemoryError as err:
            progress["error"] = f"out of memory in the evaluation: {str(err).splitlines()[0]}"
        print(f"{arm} eval {summary_line(evaluation)}", flush=True)
    return {"losses": progress["losses"], "step_seconds": progress["step_seconds"], "eval": evaluation,
            "oomb_config": config.to_dict() if config is not None else None,
            "hf": {"gradient_checkpointing": True, "attn_implementation": "sdpa"} if arm == "hf" else None,
            "load_seconds": load_seconds, "train_seconds": progress["train_seconds"],
            "eval_seconds": evaluation["seconds"]["total"] if evaluation else None,
            "peak_gpu_gib": progress["peak_gpu_gib"], "error": progress["error"],
            "invocations": progress["invocations"], "machine": machine(device), "commit": args.commit,
            "date": date.today().isoformat(), "command": args.command}


def summary_line(evaluation: dict | None) -> str:
    if evaluation is None:
        return "none"
    parts = [f"{name.removeprefix('heldout_')} " + " ".join(f"{b} {p:.3f}" for b, p in evaluation[name].items())
             for name in ("heldout_english", "heldout_code")]
    keys = " ".join(f"{n} {r}/{c}" for n, (r, c) in evaluation["passkey_retrieved"].items())
    return "; ".join(parts) + f"; passkeys {keys}; {evaluation['seconds']['total']:.1f} s"


# -------------------------------------------------------------------------------------------------------- run

def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def header(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """What every file of a run records besides its arms: settings, data, machine, versions."""
    import peft
    import transformers

    return {"benchmark": "context_extension", "date": date.today().isoformat(), "command": args.command,
            "machine": machine(device), "commit": args.commit, "steps": args.steps, "seq_len": args.seq_len,
            "native_len": args.native_len, "yarn": args.yarn, "lr": args.lr, "seed": args.seed,
            "chunk_size": args.chunk_size, "page_size": args.page_size, "backend": args.backend,
            "dtype": str(dtype).removeprefix("torch."), "lora": LORA,
            "buckets": [bucket_name(s, e) for s, e in position_buckets(args.seq_len, args.native_len)],
            "passkey_lengths": [format_tokens(n) for n in sorted({p.length for p in load_passkeys(args.data)})],
            "data": data_meta(args.data), "eval_oomb_config": eval_config(args).to_dict(),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "peft": peft.__version__, "python": platform.python_version()},
            "arms": {}}


def _same_run(path: Path, head: dict, keys: Sequence[str]) -> bool:
    """Whether a file in --out was written for the same data and settings."""
    if not path.is_file():
        return False
    old = json.loads(path.read_text())
    return all(old.get(k) == head[k] for k in keys) and old.get("data", {}).get("sha256") == head["data"].get("sha256")


def _arm_done(path: Path, head: dict, arm: str, args: argparse.Namespace) -> bool:
    """Whether --out holds this arm's file from the same data, settings and OOMBConfig."""
    if not _same_run(path, head, EVAL_KEYS + TRAIN_KEYS):
        return False
    entry = json.loads(path.read_text())["arms"].get(arm)
    config = arm_config(arm, args)
    return entry is not None and entry.get("oomb_config") == (config.to_dict() if config is not None else None)


def run(args: argparse.Namespace) -> None:
    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "bfloat16": torch.bfloat16,
             "float32": torch.float32}[args.dtype]
    meta = data_meta(args.data)
    if args.seq_len is None:
        args.seq_len = meta["seq_len"]
    elif args.seq_len != meta["seq_len"]:
        raise SystemExit(f"--seq-len {args.seq_len} but {args.data} holds sequences of {meta['seq_len']} tokens")
    if args.steps > meta["train_sequences"]:
        print(f"note: {meta['train_sequences']} training sequences for {args.steps} steps: they repeat "
              f"(prepare --train-sequences {args.steps} makes one a step)", flush=True)
    if args.native_len is None:
        from transformers import AutoConfig

        args.native_len = AutoConfig.from_pretrained(args.model).max_position_embeddings
    if args.yarn is None:
        args.yarn = args.seq_len / args.native_len
    if args.time_limit is not None and args.state is None:
        raise SystemExit("--time-limit needs --state DIR (where a stopped arm's training is kept)")
    for arm in args.arms:
        arm_config(arm, args)  # unknown arms and missing --sparse-arm options fail before anything runs
    args.out.mkdir(parents=True, exist_ok=True)
    head = header(args, device, dtype)
    written: list[Path] = []
    base_path = args.out / "base.json"
    base_done = _same_run(base_path, head, EVAL_KEYS)
    if base_done:
        print(f"{base_path} holds the untrained model's evaluation for this data and settings", flush=True)
    elif not args.no_base_eval:
        base = load_model(args.model, args.native_len, args.yarn, device, dtype, lora=False)
        evaluation = evaluate(base, args.data, eval_config(args), args.native_len)
        print(f"base eval {summary_line(evaluation)}", flush=True)
        del base
        base_path.write_text(json.dumps({**head, "base_eval": evaluation}, indent=1))
        base_done = True
    eval_s = EVAL_RESERVE_S
    if base_done:
        written.append(base_path)
        eval_s = 1.25 * json.loads(base_path.read_text())["base_eval"]["seconds"]["total"]
    clock = Clock(args.started, None if args.time_limit is None else 60 * args.time_limit, eval_s)
    for arm in args.arms:
        path = args.out / f"{arm}.json"
        if _arm_done(path, head, arm, args):
            print(f"{arm}: {path} is done", flush=True)
            written.append(path)
            continue
        entry = train_arm(arm, args, device, dtype, clock)
        if entry is None:
            break
        path.write_text(json.dumps({**head, "arms": {arm: entry}}, indent=1))
        print(f"wrote {path}", flush=True)
        written.append(path)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if written:
        write_report([(str(p), json.loads(p.read_text())) for p in written], args.out / "context_extension.json",
                     args.out / "context_extension.png", args.command)


# ----------------------------------------------------------------------------------------------------- report

def merge(inputs: Sequence[tuple[str, dict]]) -> dict:
    """One results JSON from run files (base.json, <arm>.json, or merged ones): settings checked equal, arms
    side by side (an arm in two files is refused), the untrained model's evaluation from the first file with
    one, and the criterion."""
    for keys, files in ((EVAL_KEYS, inputs), (TRAIN_KEYS, [(n, d) for n, d in inputs if d.get("arms")])):
        for key in keys:
            values = {json.dumps(d[key], sort_keys=True): n for n, d in files if key in d}
            if len(values) > 1:
                raise SystemExit(f"the inputs differ in {key}: " + "; ".join(f"{n}: {v}" for v, n in values.items()))
    hashes = {json.dumps(d["data"]["sha256"]): n for n, d in inputs if d.get("data", {}).get("sha256")}
    if len(hashes) > 1:
        raise SystemExit(f"the inputs were run on different data: {sorted(hashes.values())}")
    merged: dict = {"benchmark": "context_extension"}
    for key, join in (("date", max), ("command", " && ".join), ("machine", " / ".join), ("commit", " / ".join)):
        values = list(dict.fromkeys(str(d[key]) for _, d in inputs if key in d))
        if values:
            merged[key] = join(values)
    for key in (*EVAL_KEYS, *TRAIN_KEYS, "backend", "dtype", "data", "eval_oomb_config", "versions"):
        value = next((d[key] for _, d in inputs if key in d), None)
        if value is not None:
            merged[key] = value
    merged["inputs"] = [{"file": Path(n).name, "arms": list(d.get("arms", {})), "base_eval": "base_eval" in d,
                         "machine": d.get("machine"), "commit": d.get("commit"), "date": d.get("date")}
                        for n, d in inputs]
    merged["arms"] = {}
    for name, data in inputs:
        for arm, entry in data.get("arms", {}).items():
            if arm in merged["arms"]:
                raise SystemExit(f"arm {arm!r} is in two inputs ({merged['arms'][arm]['file']} and {name})")
            merged["arms"][arm] = {**entry, "file": Path(name).name,
                                   **{k: entry.get(k, data.get(k)) for k in ("machine", "commit", "date", "command")}}
    bases = [(n, d["base_eval"]) for n, d in inputs if d.get("base_eval")]
    if bases:
        merged["base_eval"] = bases[0][1]
        for name, other in bases[1:]:
            if _perplexities(other) != _perplexities(bases[0][1]):
                print(f"note: {name}'s untrained evaluation differs from {bases[0][0]}'s, which is kept")
    merged["criterion"] = criterion(merged)
    return merged


def _perplexities(evaluation: dict) -> dict:
    """{held-out set: {bucket: perplexity}} of an evaluation."""
    return {k: v for k, v in evaluation.items() if k.startswith("heldout_") and isinstance(v, dict)}


def passkeys_retrieved(evaluation: dict) -> dict[str, tuple[int, int]]:
    """{length: (retrieved, prompts)}; from the accuracy where a file predates passkey_retrieved (those runs
    asked len(PASSKEY_DEPTHS) x PASSKEYS_PER_POINT prompts per length)."""
    if "passkey_retrieved" in evaluation:
        return {n: (int(r), int(c)) for n, (r, c) in evaluation["passkey_retrieved"].items()}
    count = len(PASSKEY_DEPTHS) * PASSKEYS_PER_POINT
    return {n: (round(accuracy * count), count) for n, accuracy in evaluation["passkey"].items()}


def is_sparse(entry: dict) -> bool:
    return (entry.get("oomb_config") or {}).get("attention") == "sparse"


def criterion(merged: dict, reference: str = REFERENCE_ARM, tolerance: float = TOLERANCE) -> dict:
    """Every sparse arm against the reference arm: perplexity ratio per held-out set and bucket, passkeys
    retrieved; it passes iff every |ratio - 1| <= tolerance and it retrieves at least as many passkeys in
    all. "verdict": "pass" iff every sparse arm passes, None where there is nothing to judge."""
    result: dict = {"reference": reference, "tolerance": tolerance,
                    "rule": f"every sparse arm's perplexity within {100 * tolerance:g} % of the {reference} arm's in "
                            "every bucket of every held-out set, and at least as many passkeys retrieved in all",
                    "arms": {}, "verdict": None}
    ref = merged["arms"].get(reference)
    if ref is None or not ref.get("eval"):
        result["why"] = f"no evaluated {reference!r} arm"
        return result
    ref_ppl, ref_keys = _perplexities(ref["eval"]), passkeys_retrieved(ref["eval"])
    for arm, entry in merged["arms"].items():
        if not is_sparse(entry):
            continue
        if not entry.get("eval"):
            result["arms"][arm] = {"pass": False, "why": entry.get("error") or "not evaluated"}
            continue
        ratios = {name: {b: entry["eval"][name][b] / ref_ppl[name][b] for b in buckets if b in entry["eval"][name]}
                  for name, buckets in ref_ppl.items() if name in entry["eval"]}
        deviations = [(abs(r - 1), name, b, r) for name, rs in ratios.items() for b, r in rs.items()]
        worst = max(deviations, default=(math.nan, None, None, math.nan))
        keys = passkeys_retrieved(entry["eval"])
        retrieved, ref_retrieved = sum(r for r, _ in keys.values()), sum(r for r, _ in ref_keys.values())
        within = bool(deviations) and all(d <= tolerance for d, *_ in deviations)
        result["arms"][arm] = {"ratios": ratios, "worst": {"set": worst[1], "bucket": worst[2], "ratio": worst[3]},
                               "within_tolerance": within, "passkeys": retrieved, "reference_passkeys": ref_retrieved,
                               "as_many_passkeys": retrieved >= ref_retrieved,
                               "pass": within and retrieved >= ref_retrieved}
    if result["arms"]:
        result["verdict"] = "pass" if all(a["pass"] for a in result["arms"].values()) else "fail"
    else:
        result["why"] = "no sparse arm"
    return result


def format_table(merged: dict) -> str:
    """Perplexity per bucket of the untrained model and every arm (sparse arms: ratio to the reference),
    passkeys retrieved per length, seconds per step and of the evaluation; then the criterion."""
    rows = ([("untrained", {"eval": merged["base_eval"]})] if merged.get("base_eval") else []) + list(
        merged["arms"].items())
    first = next((e["eval"] for _, e in rows if e.get("eval")), None)
    if first is None:
        return "no evaluation yet"
    crit = merged["criterion"]
    sets = list(_perplexities(first))
    columns = [(s, b) for s in sets for b in first[s]]
    lengths = list(first["passkey"])
    head = (["arm"] + [f"{s.removeprefix('heldout_')} {b}" for s, b in columns] + [f"passkey {n}" for n in lengths]
            + ["s/step", "eval s"])
    table, failed = [head], []
    for arm, entry in rows:
        evaluation = entry.get("eval")
        if not evaluation:
            failed.append(f"{arm}: {entry.get('error') or 'not evaluated'}")
            continue
        ratios = crit["arms"].get(arm, {}).get("ratios", {})
        cells = [arm]
        for s, b in columns:
            value = evaluation.get(s, {}).get(b, math.nan)
            ratio = ratios.get(s, {}).get(b)
            cells.append(f"{value:.3f}" + (f" ({100 * (ratio - 1):+.2f} %)" if ratio is not None else ""))
        keys = passkeys_retrieved(evaluation)
        cells += [f"{keys[n][0]}/{keys[n][1]}" if n in keys else "" for n in lengths]
        steps = entry.get("step_seconds") or []
        steady = steps[1:] or steps
        cells.append(f"{sum(steady) / len(steady):.2f}" if steady else "")
        seconds = evaluation.get("seconds", {}).get("total")
        cells.append(f"{seconds:.1f}" if seconds is not None else "")
        table.append(cells)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table]
    lines += failed
    lines.append(f"criterion: {crit['rule']}")
    for arm, verdict in crit["arms"].items():
        if "ratios" not in verdict:
            lines.append(f"  {arm}: FAIL ({verdict['why']})")
            continue
        worst = verdict["worst"]
        lines.append(f"  {arm}: {'PASS' if verdict['pass'] else 'FAIL'} (largest deviation "
                     f"{100 * (worst['ratio'] - 1):+.2f} % at {worst['set']} {worst['bucket']}; passkeys "
                     f"{verdict['passkeys']} vs {verdict['reference_passkeys']})")
    lines.append(f"verdict: {crit['verdict'] or 'none (' + crit.get('why', '') + ')'}")
    return "\n".join(lines)


def plot(merged: dict, path: Path) -> bool:
    """The learning curves side by side: training loss per step, and each arm's loss relative to the reference
    arm's at the same step. False (and a note) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no {path} (draw it elsewhere with `{SCRIPT} report`)")
        return False
    fig, (ax_loss, ax_rel) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ref = merged["arms"].get(REFERENCE_ARM, {}).get("losses") or []
    for index, (arm, entry) in enumerate(merged["arms"].items()):
        losses = entry.get("losses") or []
        if not losses:
            continue
        style = {"label": arm, "alpha": 0.8, "color": colors[index % len(colors)]}
        ax_loss.plot(range(1, len(losses) + 1), losses, **style)
        if ref and arm != REFERENCE_ARM:
            n = min(len(losses), len(ref))
            ax_rel.plot(range(1, n + 1), [100 * (losses[i] / ref[i] - 1) for i in range(n)], **style)
    seq_len, native = merged.get("seq_len"), merged.get("native_len") or 8192
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel(f"training loss ({format_tokens(seq_len)} tokens)" if seq_len else "training loss")
    if ax_loss.lines:
        ax_loss.legend()
    ax_rel.axhline(0.0, color="grey", lw=0.8)
    ax_rel.set_xlabel("step")
    ax_rel.set_ylabel(f"loss vs {REFERENCE_ARM} (%)")
    if ax_rel.lines[1:]:
        ax_rel.legend()
    yarn = merged.get("yarn") or (seq_len / native if seq_len else None)
    fig.suptitle(f"{format_tokens(native)} -> {format_tokens(seq_len) if seq_len else '?'}"
                 + (f" (YaRN x{yarn:g})" if yarn else "") + f", LoRA r={merged.get('lora', LORA)['r']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(inputs: Sequence[tuple[str, dict]], out: Path, png: Path | None, command: str) -> dict:
    merged = merge(inputs)
    merged["report_command"] = command
    if png is not None and plot(merged, png):
        merged["png"] = png.name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=1))
    print(format_table(merged))
    print(f"wrote {out}" + (f" and {png}" if merged.get("png") else ""), flush=True)
    return merged


# ------------------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize the training stream, held-out sets and passkeys")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seq-len", type=parse_tokens, default=32768, help="tokens per sequence (32K, 128K, 1M)")
    p.add_argument("--train-sequences", type=int, default=40, help="training sequences: run's --steps, at least")
    p.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer directory (default: SmolLM2's)")
    p.add_argument("--heldout-code", type=int, default=HELDOUT_CODE, help="held-out code sequences")
    p.add_argument("--heldout-english", type=int, default=None,
                   help="held-out English sequences (default: every whole one the help topics hold, at least one)")
    p.add_argument("--passkey-depths", type=float, nargs="+", default=list(PASSKEY_DEPTHS))
    p.add_argument("--passkeys-per-point", type=int, default=PASSKEYS_PER_POINT, help="prompts per length and depth")
    r = sub.add_parser("run", help="train arms and evaluate them; one file per arm")
    r.add_argument("--data", type=Path, required=True)
    r.add_argument("--model", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--arms", nargs="+", default=["hf", "dense", "sparse"])
    r.add_argument("--steps", type=int, default=40)
    r.add_argument("--seq-len", type=parse_tokens, default=None, help="tokens per sequence (default: the data's)")
    r.add_argument("--native-len", type=parse_tokens, default=None,
                   help="the model's trained length (default: its max_position_embeddings); perplexity buckets "
                        "double from it")
    r.add_argument("--yarn", type=float, default=None, help="YaRN factor (default: seq-len / native-len)")
    r.add_argument("--lr", type=float, default=2e-4)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--chunk-size", type=parse_tokens, default=4096)
    r.add_argument("--page-size", type=parse_tokens, default=128)
    r.add_argument("--backend", default="cudnn")
    r.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    r.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="auto: bfloat16 on CUDA, float32 on the CPU")
    r.add_argument("--sparse", default="{}", help="JSON of OOMBConfig sparse options for the sparse arm")
    r.add_argument("--sparse-arm", action="append", default=[], metavar="NAME=JSON",
                   help="a further sparse arm (NAME starts with 'sparse', listed in --arms) and its options, "
                        "e.g. sparse_b32='{\"sparse.budget\": 32}'")
    r.add_argument("--no-base-eval", action="store_true", help="do not evaluate the untrained model")
    r.add_argument("--state", type=Path, default=None,
                   help="keep each arm's training state here after every step; continue from it")
    r.add_argument("--time-limit", type=float, default=None, metavar="MINUTES",
                   help="stop (state saved) before a step or evaluation that would end later than this")
    r.add_argument("--stop-at", type=int, default=None, metavar="STEP", help="stop after this many steps (state saved)")
    r.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD, where it works)")
    m = sub.add_parser("report", help="merge run files into one results JSON, PNG and table")
    m.add_argument("--inputs", type=Path, nargs="+", required=True)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--png", type=Path, default=None)
    args = parser.parse_args(argv)
    command = f"python {SCRIPT} " + shlex.join(argv)
    if args.cmd == "prepare":
        prepare(args.out, args.seq_len, args.train_sequences, tokenizer_path=args.tokenizer,
                heldout_code=args.heldout_code, heldout_english=args.heldout_english, depths=args.passkey_depths,
                per_point=args.passkeys_per_point)
    elif args.cmd == "run":
        args.command, args.started = command, started
        args.commit = args.commit or git_commit()
        run(args)
    else:
        write_report([(str(p), json.loads(p.read_text())) for p in args.inputs], args.out, args.png, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
