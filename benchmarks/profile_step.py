"""Where a step's time goes: one oomb (or HF) step under torch.profiler, by part, against its floor.

The dense step is 1.6x HF at 128K on the H200 although it does about the same attention FLOPs and
one extra forward of the linear layers (docs/results.md): this script finds the rest. It runs a
warm-up step, then profiles one step and sums the device time of its kernels by part:

    GEMM        linear layers (cuBLAS: nvjet, xmma, gemm, cutlass), outside the ranges below
    attention   oomb's Triton kernels (triton_paged.py, triton_sparse.py) and cuDNN/SDPA/flash kernels
    scoring     sparse selection: triton_scores.py's kernel and whatever runs inside the "oomb.scoring"
                range (oomb/attention/function.py: summary-score matmuls, rerank, top-k)
    loss        whatever runs inside the "oomb.loss" range (oomb/loss.py: LM head, log-softmax, NLL) and
                the backward of what ran there (autograd nodes matched to their forward by sequence number)
    copies      memcpy, memset, index_select / index_copy / indexing (page gathers, offload), casts, cat
    other       the rest: norms, rotary, SiLU, residual adds
    host gaps   step wall time minus the union of the kernels' intervals: the GPU waiting on the host
                (the profiler slows the host; the JSON also has the step timed again without it, after the
                profiled one, and that time minus the busy time: host_gaps_without_profiler_s)

A kernel is inside a range when the host call that launched it (its cudaLaunchKernel, found by correlation id)
ran inside an op inside the range: by time on the call's thread, not by the cpu_parent tree.

Each part is set beside its floor (oomb/planning/step_work.py: its FLOPs and bytes at the H200's
sustained rates) and measured / floor. The JSON keeps the table, the top kernels and the top launching ops
(``top_by_launching_op``: the op that launched the kernels, its input shapes and its two enclosing ops, by
part), which say which code a part's time comes from; the largest are printed.

    python benchmarks/profile_step.py --contexts 32K --modes dense hf --name profile_32k      # H200
    python benchmarks/profile_step.py --quick --modes sparse --out-dir /tmp --name p             # CPU smoke

It takes `oomb bench`'s options (backend, budget, chunk size, ...). ``--layers N`` profiles the preset's
first N decoder layers: each layer's parts scale with N, the loss and the embedding do not (their floors
too: the table's floors are for the model profiled). At 128K a profile of all 28 layers of the 7B shape
did not finish within 280 s on an H200 (the plain step takes 22-50 s): the profiler's
millions of events. On the CPU "device time" is the self time of the aten ops (the torch backend's
attention is plain matmuls there: GEMM and other), and
the floors are left out unless a rate flag (--gemm-tflops, ...) is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from oomb import machine  # noqa: E402
from oomb.attention.function import SCORING_RANGE  # noqa: E402
from oomb.loss import LOSS_RANGE  # noqa: E402
from oomb.planning.model_shape import ModelShape  # noqa: E402
from oomb.planning.step_work import H200, PARTS, Rates, StepSpec, linear_flops, step_work  # noqa: E402
from oomb.tools.bench import (  # noqa: E402
    MODES,
    BenchOptions,
    add_arguments,
    build_model,
    make_step,
    options_from_args,
    step_spec,
    token_ids,
    warmup_tokens,
)
from oomb.tools.bench_choice import chosen_for_loaded_model  # noqa: E402

ROWS = PARTS + ("other", "host gaps")
"""The table's rows: the parts with a floor, then the rest of the device time and the host's gaps."""

# Kernel and op names (lowercase substrings), tried in the order of part_of.
ATTENTION_NAMES = ("_fwd_kernel", "_dkdv_kernel", "_dq_kernel", "_delta_kernel",  # oomb Triton
                   "cudnn", "sdpa", "flash", "fmha", "scaled_dot_product")
SCORING_NAMES = ("_exact_scores_kernel",)  # oomb/attention/triton_scores.py
MOVE_NAMES = ("memcpy", "index_select", "indexselect", "index_copy", "indexcopy", "gpu_index_kernel", "aten::index")
"""Page movement (gathers, offload, write-back): copies wherever it runs."""
GEMM_NAMES = ("gemm", "cutlass", "xmma", "nvjet", "aten::addmm", "aten::mm", "aten::bmm", "aten::matmul",
              "aten::linear", "aten::einsum")
COPY_NAMES = ("memset", "copy", "cat", "gather", "scatter", "fill", "zero", "clone", "indexfunc")
RANGES = {SCORING_RANGE: "scoring", LOSS_RANGE: "loss"}
BACKWARD_FUNCTION = 1
"""FunctionEvent.scope of autograd's backward nodes (RecordScope::BACKWARD_FUNCTION)."""
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
"""The engine's event around a node's backward (scope 0, the node's sequence number)."""
DEVICE_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")
"""Device events that occupy the GPU (not the GPU-side copies of record_function ranges)."""


def part_of(name: str, label: str | None) -> str:
    """The part of a kernel or op ``name`` launched inside range ``label`` (a part, or None)."""
    lowered = name.lower()

    def named(keys: tuple[str, ...]) -> bool:
        return any(key in lowered for key in keys)

    for part, keys in (("attention", ATTENTION_NAMES), ("scoring", SCORING_NAMES), ("copies", MOVE_NAMES)):
        if named(keys):
            return part
    if label is not None:
        return label
    for part, keys in (("GEMM", GEMM_NAMES), ("copies", COPY_NAMES)):
        if named(keys):
            return part
    return "other"


def range_labels(events) -> dict[int, str | None]:
    """id(event) -> the part of the innermost range in RANGES around each CPU event. An autograd
    backward node takes the range of the forward op that made it: the last op to record its sequence
    number before it (the op that creates node n is the last to see n as the next number)."""
    cpu = sorted((e for e in events if e.device_type == DeviceType.CPU and not e.is_async),
                 key=lambda e: (e.time_range.start, -e.time_range.end))
    labels: dict[int, tuple[str | None, bool]] = {}  # id -> (label, inside a backward node)
    forward: dict[tuple[int, int], str | None] = {}
    for e in cpu:  # parents before children, forward ops before their nodes' backward
        label, backward = labels.get(id(e.cpu_parent), (None, False))
        if e.name in RANGES:
            label = RANGES[e.name]
        elif e.scope == BACKWARD_FUNCTION or e.name.startswith(BACKWARD_PREFIX):
            label, backward = forward.get((e.sequence_nr, e.fwd_thread)), True
        elif e.sequence_nr >= 0 and not backward:
            forward[(e.sequence_nr, e.thread)] = label
        labels[id(e)] = (label, backward)
    return {key: label for key, (label, _) in labels.items()}


def is_device_work(e) -> bool:
    if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
        return False
    activity = getattr(e, "activity_type", None)
    return activity is None or activity in DEVICE_ACTIVITIES


def is_runtime_call(e) -> bool:
    """A host call into the CUDA runtime or driver (cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, ...):
    by its activity type where the FunctionEvent has one, else by its name (torch's ops have a "::")."""
    activity = getattr(e, "activity_type", None)
    if activity is not None:
        return "runtime" in activity or "driver" in activity
    return e.name.startswith(("cu", "hip")) and "::" not in e.name


def launch_events(events, work) -> list:
    """The host event that launched each device event of ``work`` (None where none is found): the op that its
    linked_correlation_id names (torch 2.13's FunctionEvent has it; older ones lack it), else the runtime call
    that shares its own correlation id (CUPTI's: a kernel and its cudaLaunchKernel). Ops and runtime calls are
    looked up apart: torch's op ids and CUPTI's ids are two counters, and they collide (pytorch#124388)."""
    ops: dict[int, object] = {}
    calls: dict[int, object] = {}
    for e in events:
        if e.device_type != DeviceType.CPU:
            continue
        if is_runtime_call(e):
            calls[e.id] = e
        elif not getattr(e, "linked_correlation_id", 0):
            ops[e.id] = e
    launches = []
    for e in work:
        linked = getattr(e, "linked_correlation_id", 0)
        launch = ops.get(linked, calls.get(linked)) if linked else None
        launches.append(calls.get(e.id) if launch is None else launch)
    return launches


def launch_ops(events, launches: list) -> list:
    """The op behind each launch (None for None): the launch itself where it is an op; for a runtime call, the
    innermost op (CPU, not async, not a runtime call) on its thread whose interval holds the call's start, so
    that a call left out of the cpu_parent tree still finds its op. One sweep per thread over its ops, sorted
    by (start, -end), and the calls' start times (ops first at equal times), with a stack of open ops."""
    found: list = [None] * len(launches)
    points: dict[int, list[tuple[float, int]]] = {}
    for i, launch in enumerate(launches):
        if launch is None:
            continue
        if not is_runtime_call(launch):
            found[i] = launch
        else:
            points.setdefault(launch.thread, []).append((launch.time_range.start, i))
    if not points:
        return found
    ops: dict[int, list] = {}
    for e in events:
        if e.device_type == DeviceType.CPU and not e.is_async and e.thread in points and not is_runtime_call(e):
            ops.setdefault(e.thread, []).append(e)
    for thread, starts in points.items():
        spans = ops.get(thread, [])
        sweep = sorted([(e.time_range.start, 0, -e.time_range.end, k) for k, e in enumerate(spans)]
                       + [(start, 1, 0, i) for start, i in starts])
        stack: list[tuple[float, object]] = []  # (end, op) of the ops open, innermost last
        for at, is_launch, neg_end, k in sweep:
            while stack and stack[-1][0] < at:
                stack.pop()
            if is_launch:
                found[k] = stack[-1][1] if stack else None
            else:
                stack.append((-neg_end, spans[k]))
    return found


def op_key(op) -> str:
    """An op, its input shapes (when the profiler recorded them) and its two enclosing ops, as one string:
    which code launched a kernel (``aten::copy_ [[4096, 28, 128], ...] < aten::_to_copy < aten::to``)."""
    if op is None:
        return "(no op found)"
    shapes = getattr(op, "input_shapes", None)
    text = op.name + (f" {[s for s in shapes if s]}" if shapes else "")
    parent = op.cpu_parent
    for _ in range(2):
        if parent is None:
            break
        text += f" < {parent.name}"
        parent = parent.cpu_parent
    return text


def device_rows(events, by_op: dict | None = None) -> list[dict]:
    """(name, part) -> calls and milliseconds: kernels and copies on the GPU; aten ops' self time on the CPU.
    ``by_op``: also filled with (part, op_key of the launching op) -> calls and milliseconds (GPU only)."""
    labels = range_labels(events)
    work = [e for e in events if is_device_work(e)]
    rows: dict[tuple[str, str], dict] = {}
    if work:
        ops = launch_ops(events, launch_events(events, work))
        in_range = [None if op is None else labels.get(id(op)) for op in ops]
        timed = [(e, e.time_range.elapsed_us(), label) for e, label in zip(work, in_range, strict=True)]
    else:  # the CPU: aten ops
        ops = []
        timed = [(e, e.self_cpu_time_total, labels.get(id(e))) for e in events
                 if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
    for i, (e, us, label) in enumerate(timed):
        if us <= 0:
            continue
        part = part_of(e.name, label)
        row = rows.setdefault((e.name, part), {"name": e.name, "part": part, "calls": 0, "ms": 0.0})
        row["calls"] += 1
        row["ms"] += us / 1000
        if by_op is not None and ops:
            key = (part, op_key(ops[i]))
            op_row = by_op.setdefault(key, {"part": part, "op": key[1], "calls": 0, "ms": 0.0})
            op_row["calls"] += 1
            op_row["ms"] += us / 1000
    return sorted(rows.values(), key=lambda r: -r["ms"])


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")
"""Host-side events that wait for the GPU (an .item(), .tolist(), bool() of a CUDA tensor, ...)."""


def busy_seconds(events) -> float:
    """Seconds in which at least one kernel or copy ran: the union of their intervals."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if is_device_work(e))
    busy, end = 0.0, -math.inf
    for start, stop in spans:
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy / 1e6


def rates_from_args(args: argparse.Namespace, device: torch.device) -> Rates | None:
    """H200 rates with the flags' overrides; on the CPU none (no floors) unless a flag is given."""
    given = {name: getattr(args, flag) * scale for name, flag, scale in (
        ("matmul_flops", "gemm_tflops", 1e12), ("attention_flops", "attention_tflops", 1e12),
        ("memory_bytes", "memory_gbs", 1e9), ("host_bytes", "host_gbs", 1e9)) if getattr(args, flag) is not None}
    if device.type != "cuda" and not given:
        return None
    return dataclasses.replace(H200, **given)


def parts_table(rows: list[dict], spec: StepSpec, rates: Rates | None, step_seconds: float,
                busy: float | None) -> list[dict]:
    """One row per part: measured seconds, share of the step, FLOPs, floor and measured / floor."""
    measured = dict.fromkeys(ROWS[:-1], 0.0)
    for r in rows:
        measured[r["part"]] += r["ms"] / 1000
    measured["host gaps"] = max(0.0, step_seconds - (busy if busy is not None else sum(measured.values())))
    work = step_work(spec)
    table = []
    for part in ROWS:
        floor = 0.0 if part == "host gaps" else (
            work[part].floor_seconds(rates) if part in work and rates is not None else None)
        seconds = measured[part]
        table.append({"part": part, "measured_s": round(seconds, 4),
                      "share": round(seconds / step_seconds, 4) if step_seconds else None,
                      "flop": work[part].flops if part in work else None,
                      "floor_s": None if floor is None else round(floor, 4),
                      "measured_over_floor": round(seconds / floor, 2) if floor else None})
    return table


def format_table(table: list[dict]) -> str:
    """The parts as text: part | measured | share | FLOP | floor | measured / floor."""
    def cell(value, fmt: str, unit: str = "") -> str:
        return "-" if value is None else format(value, fmt) + unit

    lines = [f"  {'part':<10} {'measured':>10} {'share':>7} {'FLOP':>9} {'floor':>10} {'measured/floor':>15}"]
    for r in table:
        share = None if r["share"] is None else 100 * r["share"]
        lines.append(f"  {r['part']:<10} {cell(r['measured_s'], '.3f', ' s'):>10} {cell(share, '.1f', ' %'):>7}"
                     f" {cell(r['flop'] or None, '.2e'):>9} {cell(r['floor_s'], '.3f', ' s'):>10}"
                     f" {cell(r['measured_over_floor'], '.2f'):>15}")
    return "\n".join(lines)


def _timed_step(step, model, ids: torch.Tensor, device: torch.device) -> float:
    """Seconds of one step without the profiler."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step(model, ids)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _planned(mode: str, options: BenchOptions, tokens: int, model, device: torch.device
             ) -> tuple[BenchOptions, str | None]:
    """With ``--chosen``, the options of the plan `oomb train`'s chooser makes for the model profiled (its N
    layers, as `oomb bench --chosen` does for the whole model) from the memory free once it is loaded."""
    if not options.chosen or MODES[mode].attention == "hf":
        return options, None
    choice = chosen_for_loaded_model(mode, dataclasses.replace(options, contexts=[tokens]), model, device)
    if choice.too_long:
        raise SystemExit(f"{mode} at {tokens:,} tokens does not fit (the chooser): {choice.why_too_long}")
    return dataclasses.replace(options, **choice.changes), choice.plan


def profile_step(mode: str, options: BenchOptions, tokens: int, rates: Rates | None,
                 layers: int | None = None) -> dict:
    device = torch.device(options.device)
    warmup = warmup_tokens(mode, options)
    model = build_model(options.preset, max(tokens, warmup), device, options.dtype, options.seed, layers)
    options, plan = _planned(mode, options, tokens, model, device)
    step = make_step(mode, options)
    vocab = model.config.vocab_size
    step(model, token_ids(vocab, warmup, options.seed, device))  # compile, autotune
    ids = token_ids(vocab, tokens, options.seed, device)
    if hasattr(step, "prepare"):
        step.prepare(model, ids)
    model.zero_grad(set_to_none=True)
    use_device = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_device else [])
    start = time.perf_counter()
    with profile(activities=activities, record_shapes=True) as prof:
        step(model, ids)
        if use_device:
            torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    # The profiler's own overhead lengthens the host gaps: the step again without it, after the profiled one
    # so that it finds every cache warm (cuDNN builds a graph for each new key length on the way).
    model.zero_grad(set_to_none=True)
    plain = _timed_step(step, model, ids, device)
    events = prof.events()
    by_op: dict = {}
    rows = device_rows(events, by_op)
    busy = busy_seconds(events) if use_device else None
    spec = step_spec(mode, tokens, ModelShape.from_hf_config(model.config), options)
    table = parts_table(rows, spec, rates, seconds, busy)
    syncs = {e.key: {"calls": e.count, "host_ms": round(e.cpu_time_total / 1000, 1)}
             for e in prof.key_averages() if e.key in SYNC_CALLS}
    total = sum(r["ms"] for r in rows) or 1.0
    groups = {r["part"]: round(r["measured_s"] * 1000, 1) for r in table if r["part"] != "host gaps"}
    launched = sorted(by_op.values(), key=lambda r: -r["ms"])[:60]
    for r in rows + launched:
        r["ms"] = round(r["ms"], 3)
    return {"mode": mode, "tokens": tokens, "layers": model.config.num_hidden_layers,
            "step_seconds_under_profiler": round(seconds, 3), "step_seconds_without_profiler": round(plain, 3),
            "host_gaps_without_profiler_s": None if busy is None else round(max(0.0, plain - busy), 3),
            "gpu_busy_seconds": None if busy is None else round(busy, 3), "host_waits": syncs,
            "time_kind": "device (kernels)" if use_device else "CPU self time (aten ops)",
            "parts": table, "rates": None if rates is None else dataclasses.asdict(rates),
            "linear_tflop_by_pass": {k: round(v / 1e12, 3) for k, v in linear_flops(spec).items()},
            "step_spec": {k: v for k, v in dataclasses.asdict(spec).items() if k != "shape"}, "plan": plan,
            "groups_ms": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
            "groups_share": {k: round(v / total, 4) for k, v in groups.items()}, "top": rows[:40],
            "top_by_launching_op": launched}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    for flag, what in (("--gemm-tflops", f"GEMMs (default {H200.matmul_flops / 1e12:.0f} on a GPU)"),
                       ("--attention-tflops", f"attention kernels (default {H200.attention_flops / 1e12:.0f})"),
                       ("--memory-gbs", f"device memory, GB/s (default {H200.memory_bytes / 1e9:.0f})"),
                       ("--host-gbs", f"host <-> device copies, GB/s (default {H200.host_bytes / 1e9:.0f})")):
        parser.add_argument(flag, type=float, help=f"floor rate of {what}; on the CPU any of these turns floors on")
    parser.add_argument("--layers", type=int, help="profile a model of the preset's first N decoder layers (the "
                        "profiler's post-processing of all 28 layers at 128K outlasts a 10-minute call)")
    args = parser.parse_args()
    if args.replot:
        parser.error("--replot is an option of `oomb bench` only")
    options = options_from_args(args)
    if options.threads:
        torch.set_num_threads(options.threads)
    out = Path(options.out_dir) / f"{options.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.device(options.device)
    rates = rates_from_args(args, device)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": machine.git_commit(), "command": "python " + " ".join(sys.argv),
              "machine": machine.machine_info(device),
              "options": dataclasses.asdict(options), "runs": []}
    for tokens in options.contexts:
        for mode in options.modes:
            run = profile_step(mode, options, tokens, rates, args.layers)
            report["runs"].append(run)
            busy = "" if run["gpu_busy_seconds"] is None else f", GPU busy {run['gpu_busy_seconds']} s"
            if run["plan"]:
                print(f"{mode} plan: {run['plan']}")
            print(f"{mode} {tokens:,}, {run['layers']} layers: {run['step_seconds_under_profiler']} s under the "
                  f"profiler, {run['step_seconds_without_profiler']} s without{busy} "
                  f"({run['time_kind']})\n{format_table(run['parts'])}")
            for r in run["top_by_launching_op"][:15]:
                print(f"  {r['part']:<10} {r['ms']:9.1f} ms {r['calls']:6} calls  {r['op'][:150]}")
            out.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
