"""Outputs of `oomb bench`: the JSON report, a markdown table and a PNG plot (log-log axes).

Everything is rendered from the report dict alone, so a finished run can be redrawn anywhere
(``oomb bench --replot run.json``), e.g. on a machine that has matplotlib when the GPU machine has not.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ..planning.memory import GIB, MIB, MODES
from .plan import format_tokens

logger = logging.getLogger(__name__)

NOT_IMPLEMENTED = "not implemented in this version"
TOKENS_PER_GROWTH = 10_000
"""Memory growth is reported per this many tokens."""
MODE_COLORS = {"hf": "tab:gray", "dense": "tab:blue", "dense+offload": "tab:green", "sparse": "tab:purple",
               "sparse+offload": "tab:orange"}



def output_paths(out_dir: str | Path, name: str) -> dict[str, Path]:
    out = Path(out_dir)
    return {ext: out / f"{name}.{ext}" for ext in ("json", "md", "png")}


def summarize(report: dict) -> dict:
    """Memory growth per 10K tokens (least squares over a mode's measured contexts) and its longest step."""
    gpu = report["machine"]["device"] == "cuda"
    key = "peak_gpu_above_weights_gib" if gpu else "host_step_gib"
    growth, longest = {}, {}
    for mode in report["modes"]:
        points = [(r["tokens"], r[key]) for r in report["rows"] if r["mode"] == mode and r["status"] == "ok"]
        if points:
            longest[mode] = max(t for t, _ in points)
        if len(points) >= 2:
            mean_t = sum(t for t, _ in points) / len(points)
            mean_m = sum(m for _, m in points) / len(points)
            var = sum((t - mean_t) ** 2 for t, _ in points)
            slope = sum((t - mean_t) * (m - mean_m) for t, m in points) / var if var else 0.0
            growth[mode] = round(slope * TOKENS_PER_GROWTH * GIB / MIB, 1)
    return {"memory": "GPU peak above weights" if gpu else "host RSS growth during the step",
            "memory_growth_per_10k_tokens_mib": growth, "longest_measured_context": longest}


def write_outputs(report: dict, paths: dict[str, Path], plot: bool = True) -> None:
    """(Re)write JSON, markdown and, with ``plot`` and matplotlib installed, the PNG."""
    paths["json"].parent.mkdir(parents=True, exist_ok=True)
    report["rows"].sort(key=lambda r: (r["tokens"], list(MODES).index(r["mode"])))
    report["summary"] = summarize(report)
    if plot:
        try:
            report["plot"] = str(paths["png"].name) if render_plot(report, paths["png"]) else None
        except Exception as err:  # a plot must never cost the measurements
            logger.warning("plot failed: %s", err)
            report["plot"] = None
    _atomic_write(paths["json"], json.dumps(report, indent=2) + "\n")
    _atomic_write(paths["md"], render_markdown(report))


def _atomic_write(path: Path, text: str) -> None:
    """Write, then rename: a run killed mid-write keeps the previous complete file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _memory_unit(report: dict) -> tuple[str, str, float]:
    """(row key, label, scale to the unit) of the memory that is plotted and tabulated."""
    if report["machine"]["device"] == "cuda":
        return "peak_gpu_above_weights_gib", "peak GPU memory above weights (GiB)", 1.0
    return "host_step_gib", "host RSS growth during the step (MiB)", GIB / MIB


def render_markdown(report: dict) -> str:
    m, v, w = report["machine"], report["versions"], report["workload"]
    o = w["options"]
    gpu = m["device"] == "cuda"
    where = f"{m.get('gpu', 'GPU')} ({m.get('gpu_memory_gib', '?')} GiB)" if gpu else f"CPU: {m['cpu']}"
    lines = [
        f"# oomb bench: {w['preset']} on {where}",
        "",
        f"{report['date']}; oomb {v['oomb']} ({v.get('git_commit') or 'no git'}), torch {v['torch']}, "
        f"transformers {v['transformers']}, triton {v.get('triton')}, CUDA {v.get('cuda')}, Python {v['python']}; "
        f"{m['cpu_count']} CPUs, host {m['host_memory_gib']} GiB.",
        "",
        f"Workload: {w['preset']} ({w['params'] / 1e9:.2f} B parameters, random weights, {w['weights_gib']} GiB), "
        f"{w['dtype']}, {w['step']}, chunk {o['chunk_size']}, page {o['page_size']}, KV gradients "
        f"{o['kv_grad_dtype']}, fp32 gradient sums {'on' if o['fp32_grad_accumulation'] else 'off'}. "
        f"hf = {w['hf']}. Warm-up excluded. Command: `{report['command']}`",
        "",
    ]
    key, label, scale = _memory_unit(report)
    if gpu:
        lines += ["| context | mode | step time | peak GPU above weights | planner prediction | peak host RSS | "
                  "loss | status |", "|---|---|---|---|---|---|---|---|"]
    else:
        lines += ["| context | mode | step time | host RSS growth | loss | status |", "|---|---|---|---|---|---|"]
    missing = [mode for mode, i in report["modes"].items() if i["status"] != "implemented"]
    for r in report["rows"]:
        if r["mode"] in missing:
            continue
        ok = r["status"] == "ok"
        time_cell = f"{r['seconds']:.2f} s" if ok else "-"
        loss = f"{r['loss']:.4f}" if ok else "-"
        if gpu:
            pred = f"{r['predicted_gpu_above_weights_gib']:.2f} GiB"
            if "prediction_error" in r:
                pred += f" ({r['prediction_error']:+.1%})"
            mem = f"{r[key]:.2f} GiB" if ok else "-"
            host = f"{r['host_peak_gib']:.1f} GiB" if ok else "-"
            lines.append(f"| {format_tokens(r['tokens'])} | {r['mode']} | {time_cell} | {mem} | {pred} | {host} | "
                         f"{loss} | {r['status']} |")
        else:
            mem = f"{r[key] * scale:.1f} MiB" if ok else "-"
            lines.append(f"| {format_tokens(r['tokens'])} | {r['mode']} | {time_cell} | {mem} | {loss} | "
                         f"{r['status']} |")
    s = report.get("summary", {})
    growth = s.get("memory_growth_per_10k_tokens_mib", {})
    if growth:
        lines += ["", f"{s['memory']} grows per {TOKENS_PER_GROWTH:,} tokens (least squares over the measured "
                  "contexts): " + ", ".join(f"{k} {g:,.1f} MiB" for k, g in growth.items()) + "."]
    setup = [f"{k} model init {i.get('init_seconds', '?')} s, warm-up {i['warmup_seconds']} s "
             f"({format_tokens(i['warmup_tokens'])} tokens)"
             for k, i in report["modes"].items() if "warmup_seconds" in i]
    if setup:
        lines += ["", "Excluded from the table: " + "; ".join(setup) + "."]
    plans = [f"{k}: {i['plan'].splitlines()[0].removeprefix('configuration: ')}"
             for k, i in report["modes"].items() if i.get("plan")]
    if plans:  # --chosen: what ran, where it differs from the workload line's options
        lines += ["", "The chooser's plans (`--chosen`; the workload line gives the flags): " + "; ".join(plans) + "."]
    if missing:
        lines += ["", f"{NOT_IMPLEMENTED.capitalize()} of oomb (nothing measured): {', '.join(missing)}. "
                  "The JSON holds the planner's predictions for them (`predicted_*`, mode status \"planned\")."]
    failures = [f"{k}: {i['failure']}" for k, i in report["modes"].items() if i.get("failure")]
    if failures:
        lines += ["", "Failures: " + "; ".join(failures) + "."]
    stopped = [f"{k}: {i['stopped']}" for k, i in report["modes"].items() if i.get("stopped")]
    if stopped:
        lines += ["", "Cut short: " + "; ".join(stopped) + "."]
    if report.get("plot"):
        lines += ["", f"![step time and memory vs context]({report['plot']})"]
    return "\n".join(lines) + "\n"


def render_plot(report: dict, path: Path) -> bool:
    """Step time and memory vs context (log-log), one line per measured mode, OOM marked. False
    (and a warning) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedFormatter, FixedLocator, FuncFormatter, NullFormatter, NullLocator
    except ImportError:
        logger.warning("matplotlib is not installed: no plot (redraw later with `oomb bench --replot %s`)",
                       path.with_suffix(".json"))
        return False
    key, label, scale = _memory_unit(report)
    gpu = report["machine"]["device"] == "cuda"
    contexts = sorted({r["tokens"] for r in report["rows"]})
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.6))
    for mode, info in report["modes"].items():
        if info["status"] != "implemented":
            continue
        rows = [r for r in report["rows"] if r["mode"] == mode]
        ok = [r for r in rows if r["status"] == "ok"]
        color = MODE_COLORS.get(mode)
        if ok:
            xs = [r["tokens"] for r in ok]
            ax_time.plot(xs, [r["seconds"] for r in ok], "o-", color=color, label=mode)
            ax_mem.plot(xs, [max(r[key] * scale, 1e-3) for r in ok], "o-", color=color, label=mode)
        if gpu:
            ax_mem.plot([r["tokens"] for r in rows], [r["predicted_gpu_above_weights_gib"] for r in rows], ":",
                        color=color, alpha=0.7, label=f"{mode} (planner)")
        for r in rows:
            if r["status"] == "out of memory":
                for ax in (ax_time, ax_mem):  # at the bottom of the axes: an OOM has no value
                    ax.plot(r["tokens"], 0.05, "x", color="red", markersize=10, mew=2,
                            transform=ax.get_xaxis_transform())
                    ax.annotate(f"{mode}: out of memory", (r["tokens"], 0.05), xycoords=ax.get_xaxis_transform(),
                                textcoords="offset points", xytext=(-10, -3), fontsize=8, color="red", ha="right")
    if gpu and report["machine"].get("gpu_memory_gib"):
        ax_mem.axhline(report["machine"]["gpu_memory_gib"] - report["workload"]["weights_gib"], color="black",
                       linestyle="--", linewidth=0.8, label="GPU memory - weights")
    for ax, ylabel in ((ax_time, "step time (s)"), (ax_mem, label)):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(contexts))
        ax.xaxis.set_major_formatter(FixedFormatter([format_tokens(c) for c in contexts]))
        ax.xaxis.set_minor_locator(NullLocator())
        plain = FuncFormatter(lambda y, _: f"{y:.3g}")  # 20 and 0.3, not 2 x 10^1 and 3e-01
        low, high = ax.get_ylim()
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain if high / low < 20 else NullFormatter())  # label 2..9 in short ranges
        if len(contexts) == 1:
            ax.set_xlim(contexts[0] / 1.5, contexts[0] * 1.5)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    m, v = report["machine"], report["versions"]
    where = m.get("gpu", "GPU") if gpu else f"CPU ({m['cpu_count']} cores)"
    fig.suptitle(f"oomb bench: {report['workload']['preset']}, one forward+backward, {where}")
    missing = [k for k, i in report["modes"].items() if i["status"] != "implemented"]
    footer = (f"{report['date'][:10]}; oomb {v['oomb']}, torch {v['torch']}, transformers {v['transformers']}, "
              f"triton {v.get('triton')}; warm-up excluded")
    if missing:
        footer += f"; {NOT_IMPLEMENTED}: {', '.join(missing)}"
    fig.text(0.01, 0.01, footer, fontsize=7, color="dimgray")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    tmp = path.with_name(path.stem + ".tmp.png")  # never leave half a PNG if the run is killed
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return True


def replot(json_path: str | Path, out_dir: str | Path | None = None) -> dict[str, Path]:
    """Redraw the markdown table and PNG of a finished run from its JSON."""
    json_path = Path(json_path)
    report = json.loads(json_path.read_text())
    paths = output_paths(out_dir or json_path.parent, json_path.stem)
    write_outputs(report, paths)
    return paths
