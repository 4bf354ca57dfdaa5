"""K continuations of one long context: ``oomb.shared_context_backward`` against each sequence on its own.

    python benchmarks/shared_context.py --context 128K --continuations 2 8 32 --arms shared separate hf
    python benchmarks/shared_context.py --context 1M --continuations 2 8 32 --arms separate shared \\
        --attention sparse --offload --set sparse.read_share=null --set precision.kv_grad_dtype=bfloat16
    python benchmarks/shared_context.py --preset tiny-qwen2 --context 4K --continuations 2 4 \\
        --continuation-tokens 256 --device cpu --set chunk_size=1024                     # the plumbing, seconds

The standard workload, on one GPU: the 7B shape (the default preset), a 128K and a 1M shared context, 2, 8
and 32 continuations of 2K tokens (the defaults), step time and peak memory against running each sequence on
its own. On one H100 the 128K run should take about 7 min (the chooser plans ~47 s a sequence there; the
shared calls then cost about one sequence plus ~4 s a continuation) and the 1M run about 17 min (~3.5 min a
sequence). Where one command may not run that long, run it detached and collect it later (the results JSON is
rewritten after each measurement; --arms separate shared measures the baseline first), or split it
(--continuations 2 8, then --continuations 32 --arms shared, ...). At 1M, sparse.read_share=null is the fixed
budget of 64 pages, as in the standard 1M result; the default share (0.35 of the history) reads far more
(~19 min a sequence with LoRA predicted on an H100).

The model is a preset shape with random weights built as `oomb bench` builds it (oomb.tools.bench.build_model:
bf16 on CUDA, float32 on a CPU); every weight is trained (no optimizer), or with --lora PEFT adapters as
`oomb train --lora` makes them (oomb.training.presets.apply_lora: r 16, alpha 32, all linear layers). The
context is --context random tokens; the continuations are --continuation-tokens random tokens each, the same
first K for every count K. The labels are the continuations' tokens (the context is not a target), so each
sequence context + continuation i counts --continuation-tokens labels, and the shared loss (the mean over
every row's labels) is the mean of the separate sequences' losses.

Arms, each timed with perf_counter between torch.cuda.synchronize() calls, after the gradients were set to
None, the allocator's cache emptied and the peak statistics reset (oomb.tools.bench.measure):

* shared: one ``shared_context_backward(model, context, continuations[:K], config=config)`` per count K.
* separate: ``oomb.forward_backward`` of context + continuation i with the same config, i.e. what the shared
  call replaces. Every sequence has the same length, so every one does the same work: by default ONE is
  measured and the K-sequence total is reported as ``separate_total_estimated_s = K x measured``
  (``measured_sequences: 1``); --separate-all measures max(K) sequences one by one and sums the first K.
* hf: plain transformers on context + continuation 0 (SDPA, gradient checkpointing, oomb's chunked LM-head
  loss over the continuation's labels: `oomb bench`'s "hf"), one sequence measured, the total estimated as
  for separate; out of memory is recorded as the result (at 128K + 2K on the 7B shape it is not expected to
  fit an 80 GB card: HF's peak at 128K was 78.4 GiB with the weights, measured on an H200).

The oomb options: unless --no-chosen, the chooser `oomb train` runs (oomb.planning.choose.choose_config)
plans them for one sequence of context + continuation tokens (the shared step keeps the trunk's pages and
one row's, the same pages), from the memory free once the weights are loaded, every weight trained (or LoRA)
and no optimizer, keeping --attention, --offload and every --set KEY=VALUE (a dotted OOMBConfig path, value
in YAML: chunk_size=8192, sparse.read_share=null, precision.kv_grad_dtype=bfloat16, offload.resident_layers=20).
Both oomb arms run that one plan. At 1M: sparse attention with --offload; sparse.read_share=null is the fixed
budget of 64 pages (see above).

Warm-up (not timed, its seconds recorded): each arm once on a short context with the real tail and
continuation lengths (one trunk chunk plus the real context's last, partial or full chunk; sparse: enough
chunks that the page selection runs), so compilation, autotuning and cuDNN plans of the real chunk shapes
are done before timing. With offload, the host pages of a full-length sequence are pinned before timing.
--repeats R times each measurement; the first is reported apart and ``seconds`` is the median of the rest.

Peak memory: torch.cuda.max_memory_allocated (``peak_gpu_gib`` with the weights, ``peak_gpu_above_weights_gib``
without); on a CPU the process's peak resident size (VmHWM, reset before each measurement: ``host_peak_gib``).
Writes the results JSON (date, machine, versions, command, workload, plan, rows, ratios) to --out-dir ($OUT
if set) after each measurement, ``complete`` false until the last, so a run cut short keeps what it measured;
prints a table at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from oomb import OOMBConfig, forward_backward, machine, shared_context_backward  # noqa: E402
from oomb.compiled_layers import may_compile  # noqa: E402
from oomb.engine import store_options, window_store_options  # noqa: E402
from oomb.kv.offload import HostSlabs, reserve_host_slabs  # noqa: E402
from oomb.loss import IGNORE_INDEX, chunked_cross_entropy, shift_labels  # noqa: E402
from oomb.models import fused_loss_possible, loss_head, resolved_sparse, unwrap_causal_lm  # noqa: E402
from oomb.planning.choose import Resources, Workload, choose_config  # noqa: E402
from oomb.planning.memory import GIB  # noqa: E402
from oomb.planning.model_shape import ModelShape  # noqa: E402
from oomb.tools.bench import build_model, enable_checkpointing, measure, token_ids  # noqa: E402
from oomb.training.config import LoraSection  # noqa: E402
from oomb.training.presets import PRESETS, apply_lora, count_parameters  # noqa: E402
from oomb.units import coerce_tokens, format_tokens, parse_tokens  # noqa: E402

ARMS = ("shared", "separate", "hf")
TOKEN_OPTIONS = ("chunk_size", "page_size", "performance.loss_chunk_tokens")
"""--set keys that take a token count ('8K')."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2.5-7b", choices=list(PRESETS))
    p.add_argument("--context", type=parse_tokens, default=parse_tokens("128K"), help="context tokens (128K, 1M)")
    p.add_argument("--continuations", type=int, nargs="+", default=[2, 8, 32], help="counts K of continuations")
    p.add_argument("--continuation-tokens", type=parse_tokens, default=parse_tokens("2K"),
                   help="tokens of each continuation")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=["shared", "separate"],
                   help="measured in this order (warmed up in it too)")
    p.add_argument("--attention", choices=("dense", "sparse"), default="dense")
    p.add_argument("--offload", action=argparse.BooleanOptionalAction, default=False,
                   help="KV pages in pinned host memory (offload.enabled)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="an OOMBConfig option by dotted path, value in YAML (repeatable); the chooser keeps it")
    p.add_argument("--chosen", action=argparse.BooleanOptionalAction, default=True,
                   help="the chooser plans the options not set (default); --no-chosen: OOMBConfig's defaults")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (oomb train --lora's) instead of "
                   "every weight")
    p.add_argument("--separate-all", action="store_true",
                   help="measure max(K) separate sequences instead of one (the totals are then measured sums)")
    p.add_argument("--repeats", type=int, default=1,
                   help="measurements of each shared call and of a lone measured sequence (--separate-all: each once)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "out/shared_context")
    p.add_argument("--name", help="results file name (default shared_context_PRESET_CONTEXT_MODE_DEVICE_DATE.json)")
    args = p.parse_args(argv)
    if min(args.continuations) < 1 or args.repeats < 1:
        p.error("--continuations and --repeats must be positive")
    args.continuations = sorted(set(args.continuations))
    return args


def config_options(sets: list[str]) -> dict:
    """--set KEY=VALUE items as {dotted path: value}, values parsed as YAML (token counts where they are some)."""
    options = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE (e.g. sparse.read_share=null)")
        key = key.strip()
        parsed = yaml.safe_load(value)
        options[key] = coerce_tokens(parsed, key) if key in TOKEN_OPTIONS else parsed
    return options


def plan(args: argparse.Namespace, model: torch.nn.Module, sequence: int, trainable: int) -> tuple[OOMBConfig, dict]:
    """The step's OOMBConfig for one sequence of ``sequence`` tokens, and how it was made."""
    fixed = {"attention": args.attention, "offload.enabled": args.offload, **config_options(args.sets)}
    base = OOMBConfig().with_options(fixed)
    if not args.chosen:
        return base, {"chosen": False, "fixed": fixed}
    device = torch.device(args.device)
    causal_lm = unwrap_causal_lm(model)
    cuda = device.type == "cuda"
    shape = ModelShape.from_hf_config(causal_lm.config)
    lora_rank = LoraSection().r if args.lora else 0
    workload = Workload(shape, sequence, 1, causal_lm.dtype, lora_rank, optimizer="none", trainable_params=trainable,
                        may_compile=may_compile(causal_lm), may_fuse_loss=fused_loss_possible(causal_lm))
    gpu_free = machine.gpu_free_bytes(device) if cuda else None
    host_free = machine.host_available_bytes() or machine.host_free_bytes()
    resources = Resources.free_on(device, gpu_free, host_free, weights_loaded=True)
    choice = choose_config(workload, resources, fixed, base)
    return choice.config, {"chosen": True, "fixed": fixed, "planned_tokens": sequence,
                           "gpu_free_gib": round(gpu_free / GIB, 2) if cuda else None,
                           "host_free_gib": round(host_free / GIB, 2), "description": choice.describe(),
                           "predicted_sequence_step": str(choice.step_time) if choice.step_time else None}


def warmup_context(config: OOMBConfig, context: int) -> int:
    """A short context whose rows have the real ones' chunk shapes: trunk chunks, then the real context's last
    chunk (the tail, 1 to chunk_size tokens); sparse: enough trunk chunks that the history outgrows the sinks
    and the pages read (rerank: its candidates), so that the selection kernels run and tune."""
    chunk = config.chunk_size
    tail = context - (context - 1) // chunk * chunk
    trunk_chunks = 1
    if config.attention == "sparse":
        sparse = config.sparse
        pages = max([sparse.budget, *(sparse.layer_budgets or [])])
        pages *= sparse.research.rerank_factor if sparse.resolved_score == "rerank" else 1
        trunk_chunks = -(-(sparse.sink_pages + pages + 1) * config.page_size // chunk)
    return min(context, trunk_chunks * chunk + tail)


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError)
                                                       and "can't allocate memory" in str(err))  # CPU allocator


def free_memory(model: torch.nn.Module, device: torch.device) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def hf_sequence(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, slice_tokens: int) -> float:
    """Plain transformers on one sequence: SDPA, gradient checkpointing, autograd's chunked LM-head loss over the
    counted labels (`oomb bench`'s "hf" step, with the continuation's labels)."""
    causal_lm = unwrap_causal_lm(model)
    enable_checkpointing(causal_lm)
    try:
        hidden = causal_lm.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        targets = shift_labels(labels)
        loss = chunked_cross_entropy(hidden, targets, loss_head(causal_lm), int((targets != IGNORE_INDEX).sum()),
                                     slice_tokens, fused=False)
        loss.backward()
    finally:
        (getattr(causal_lm, "activation_checkpointing_disable", None) or causal_lm.gradient_checkpointing_disable)()
    return float(loss.detach())


def measured(step: Callable[[], float], model: torch.nn.Module, device: torch.device, repeats: int) -> dict:
    """``repeats`` measurements of ``step`` (oomb.tools.bench.measure); out of memory is a result."""
    calls = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        row = None
        try:
            row = measure(lambda model, ids: step(), model, None, device)
        except Exception as err:
            if not is_oom(err):
                raise
        if row is None:  # out of memory: freed once the exception (its traceback holds the step's tensors) is gone
            free_memory(model, device)
            return {"status": "out of memory", "calls": calls}
        if device.type == "cuda":
            row["peak_gpu_gib"] = round(row["peak_gpu_above_weights_gib"] + weights / GIB, 3)
        calls.append(row)
    out = {"status": "ok", "calls": calls, "seconds": calls[0]["seconds"], "loss": calls[0]["loss"],
           **{k: max(c[k] for c in calls) for k in ("peak_gpu_gib", "peak_gpu_above_weights_gib", "host_peak_gib")
              if k in calls[0]}}
    if repeats > 1:
        out.update(first_seconds=calls[0]["seconds"],
                   seconds=round(statistics.median(c["seconds"] for c in calls[1:]), 3))
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


def sequence_rows(arm: str, result: dict, counts: list[int]) -> list[dict]:
    """Per K, the K-sequence total of an arm that ran sequences one by one: the measured sum of the first K, or
    K x the one measured sequence (an estimate: every sequence has the same length)."""
    rows = []
    for k in counts:
        measured_ = [r for r in result["sequences"][:k] if r["status"] == "ok"]
        row = {"arm": arm, "continuations": k, "status": result["status"], "measured_sequences": len(measured_)}
        if result["status"] == "ok":
            seconds = [r["seconds"] for r in measured_]
            row.update(sequence_seconds=seconds, loss=round(statistics.mean(r["loss"] for r in measured_), 4),
                       **{key: max(r[key] for r in measured_) for key in ("peak_gpu_gib", "peak_gpu_above_weights_gib",
                                                                          "host_peak_gib") if key in measured_[0]})
            if len(measured_) >= k:
                row["seconds"] = round(sum(seconds), 3)
            else:
                row[f"{arm}_total_estimated_s"] = round(k * statistics.mean(seconds), 3)
                row["estimate"] = f"{k} x the mean of {len(measured_)} measured sequence(s) of the same length"
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: use --device cpu")
    if not cuda:
        machine.bound_heap_retention()  # as oomb train on a CPU: freed tensors leave the heap
    dtype = torch.bfloat16 if cuda else torch.float32
    context_tokens, n = args.context, args.continuation_tokens
    sequence = context_tokens + n
    start = time.perf_counter()
    model = build_model(args.preset, sequence, device, dtype, args.seed)
    if args.lora:
        model = apply_lora(model, LoraSection(enabled=True))
    trainable, parameters = count_parameters(model)
    init_seconds = round(time.perf_counter() - start, 2)
    config, how = plan(args, model, sequence, trainable)
    print(how.get("description") or f"configuration: {config.options()}", flush=True)
    trunk = (context_tokens - 1) // config.chunk_size * config.chunk_size  # shared_context.py's S
    if trunk == 0:
        print(f"note: the context fits one chunk ({config.chunk_size} tokens): nothing is shared, every row runs "
              "it all (give a longer --context or --set chunk_size=...)", flush=True)

    vocab = unwrap_causal_lm(model).config.vocab_size
    context = token_ids(vocab, context_tokens, args.seed, device)[0]
    generator = torch.Generator().manual_seed(args.seed + 1)
    pool = [torch.randint(0, vocab, (n,), generator=generator).to(device) for _ in range(max(args.continuations))]
    slabs = HostSlabs() if config.offload.enabled else None

    def shared(ctx: torch.Tensor, k: int) -> Callable[[], float]:
        return lambda: float(shared_context_backward(model, ctx, pool[:k], config=config, host_slabs=slabs))

    def one_sequence(arm: str, ctx: torch.Tensor, i: int) -> Callable[[], float]:
        ids = torch.cat([ctx, pool[i]])[None]
        labels = ids.clone()
        labels[:, : ctx.shape[0]] = IGNORE_INDEX  # the continuation's tokens are the labels, as in the shared call
        if arm == "hf":
            return lambda: hf_sequence(model, ids, labels, config.performance.loss_chunk_tokens)
        return lambda: float(forward_backward(model, ids, labels, config, host_slabs=slabs))

    warmup_tokens = warmup_context(config, context_tokens)
    warmup = {"context_tokens": warmup_tokens}
    for arm in args.arms:  # compilation, autotuning and cuDNN plans of the real chunk shapes, not timed
        step = shared(context[:warmup_tokens], min(2, max(args.continuations))) if arm == "shared" else \
            one_sequence(arm, context[:warmup_tokens], 0)
        start = time.perf_counter()
        warmup[arm] = {"status": "out of memory"}
        try:
            step()
            warmup[arm] = {"seconds": round(time.perf_counter() - start, 2)}
        except Exception as err:
            if not is_oom(err):
                raise
        free_memory(model, device)
        print(f"warm-up {arm} ({format_tokens(warmup_tokens)} context): {warmup[arm]}", flush=True)
    if slabs is not None:  # pin a full-length step's host pages outside the timing
        causal_lm = unwrap_causal_lm(model)
        sparse = resolved_sparse(config, causal_lm)
        options = store_options(causal_lm, 1, sequence, config, device, sparse)
        reserve_host_slabs(slabs, resident_layers=config.offload.resident_layers, chunk_size=config.chunk_size,
                           **options, **window_store_options(causal_lm, sequence, options["context"]))

    rows: list[dict] = []
    gpu = machine.detect_gpu(device) if cuda else None
    mode = args.attention + ("_offload" if config.offload.enabled else "") + ("_lora" if args.lora else "")
    tag = "cpu" if not cuda else ("h200" if "H200" in gpu.name else "h100" if "H100" in gpu.name else "cuda")
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    path = Path(args.out_dir) / (args.name or f"shared_context_{args.preset}_{format_tokens(context_tokens).lower()}_"
                                 f"{mode}_{tag}_{date[:10]}.json")
    path.parent.mkdir(parents=True, exist_ok=True)

    header = {  # what does not change between measurements: read once
        "benchmark": "shared_context", "date": date,
        "machine": machine.machine_info(device, gpu),
        "versions": machine.versions(),
        "command": shlex.join(["python", "benchmarks/shared_context.py", *(sys.argv[1:] if argv is None else argv)]),
        "workload": {"preset": args.preset, "dtype": str(dtype).removeprefix("torch."),
                     "trained": "LoRA r 16, alpha 32, all linear layers (oomb train --lora)" if args.lora
                     else "every weight", "trainable_parameters": trainable, "parameters": parameters,
                     "optimizer": "none", "context_tokens": context_tokens, "continuation_tokens": n,
                     "continuations": args.continuations, "sequence_tokens": sequence,
                     "trunk_tokens": trunk, "tail_tokens": context_tokens - trunk,
                     "labels": "each continuation's tokens; the context is not a target",
                     "data": "random token ids (seeded)", "arms": args.arms, "repeats": args.repeats,
                     "separate_all": args.separate_all},
        "timing": "perf_counter between torch.cuda.synchronize() calls (oomb.tools.bench.measure), gradients set to "
                  "None before each measurement, after a warm-up of each arm on a short context; with --repeats "
                  "the first call is reported apart (first_seconds) and seconds is the median of the rest. "
                  "Peak: max_memory_allocated (peak_gpu_gib with the weights), on a CPU VmHWM (host_peak_gib).",
        "plan": {**how, "config": config.to_dict()},
        "init_seconds": init_seconds, "warmup": warmup,
    }

    def save(complete: bool) -> dict:
        """The results JSON so far: rewritten after each measurement, so a run cut short keeps what it measured."""
        result = {**header, "complete": complete, "rows": rows,
                  "ratios": shared_ratios(rows, args.continuations, cuda)}
        path.write_text(json.dumps(result, indent=1) + "\n")
        return result

    for arm in args.arms:  # in the order given: a run that may be cut short measures first what it needs most
        if arm == "shared":
            for k in args.continuations:
                result = measured(shared(context, k), model, device, args.repeats)
                rows.append({"arm": "shared", "continuations": k, **result})
                print(f"shared K={k}: {result['status']}, {result.get('seconds')} s", flush=True)
                save(complete=False)
            continue
        count = max(args.continuations) if arm == "separate" and args.separate_all else 1
        repeats = 1 if count > 1 else args.repeats
        sequences = []
        for i in range(count):
            sequences.append(measured(one_sequence(arm, context, i), model, device, repeats))
            print(f"{arm} sequence {i}: {sequences[-1]['status']}, {sequences[-1].get('seconds')} s", flush=True)
            if sequences[-1]["status"] != "ok":
                break
        status = "ok" if all(s["status"] == "ok" for s in sequences) else sequences[-1]["status"]
        rows += sequence_rows(arm, {"status": status, "sequences": sequences}, args.continuations)
        save(complete=False)
    result = save(complete=True)
    ratios = result["ratios"]
    print_table(rows, ratios, cuda)
    print(f"wrote {path}")
    return result


def shared_ratios(rows: list[dict], continuations: list[int], cuda: bool) -> list[dict]:
    """Per count K: the shared call's seconds and peak over each other arm's (measured, or K x one sequence)."""
    ratios = []
    by = {(r["arm"], r["continuations"]): r for r in rows}
    for k in continuations:
        s = by.get(("shared", k), {})
        entry = {"continuations": k}
        for arm in ("separate", "hf"):
            other = by.get((arm, k))
            if other is None:
                continue
            other_seconds = other.get("seconds") or other.get(f"{arm}_total_estimated_s")
            entry[f"shared_over_{arm}"] = ratio(s.get("seconds"), other_seconds)
            entry[f"shared_over_{arm}_basis"] = ("measured" if "seconds" in other else other.get("estimate")
                                                 or other["status"])
            peak = "peak_gpu_gib" if cuda else "host_peak_gib"
            entry[f"shared_over_{arm}_{peak}"] = ratio(s.get(peak), other.get(peak))
        ratios.append(entry)
    return ratios


def print_table(rows: list[dict], ratios: list[dict], cuda: bool) -> None:
    peak = "peak_gpu_gib" if cuda else "host_peak_gib"
    print(f"\n{'arm':>9} {'K':>3} {'seconds':>20} {peak:>14} {'loss':>8}  status")
    for r in rows:
        seconds = r.get("seconds")
        text = f"{seconds:.2f}" if seconds is not None else ""
        estimated = [v for key, v in r.items() if key.endswith("_total_estimated_s")]
        if estimated:
            text = f"~{estimated[0]:.2f} (est.)"
        value = r.get(peak)
        print(f"{r['arm']:>9} {r['continuations']:>3} {text:>20} {value if value is not None else '':>14} "
              f"{r.get('loss', ''):>8}  {r['status']}")
    for entry in ratios:
        parts = [f"{key} {value}" for key, value in entry.items() if key != "continuations" and value is not None]
        print(f"K={entry['continuations']}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
