"""`oomb train` (what users run) vs `oomb bench --chosen` (the step alone), on the same card, one after the other.

    python benchmarks/train_vs_bench.py --preset qwen2.5-7b --seq-len 1M --attention sparse \
        --bench-mode sparse+offload --lora --sparse-read-share none --steps 2        # one H100: ~15 min
    python benchmarks/train_vs_bench.py --preset qwen2.5-7b --seq-len 1M --attention sparse \
        --bench-mode sparse+offload --lora --sparse-read-share none --steps 2 --train-kv-grad-dtype bfloat16
    python benchmarks/train_vs_bench.py --preset qwen2.5-7b --seq-len 128K --attention dense --lora --steps 3
    python benchmarks/train_vs_bench.py --preset tiny-qwen2 --seq-len 4K --device cpu --steps 2   # the plumbing

Arm 1 is ``oomb bench --chosen``: a random-weight preset, every weight's gradient, no optimizer, one step
at --seq-len after a short warm-up step, with the plan the chooser makes for that workload. Arm 2 is
``oomb train`` on the same preset (random weights, --lora or every weight with AdamW), on its embedded
corpus (packed documents) unless --data is given, --steps steps, its plan chosen for its own workload
(optimizer and LoRA included). Both get the same --sparse-* options; --train-kv-grad-dtype bfloat16 gives
oomb train the page dtype the bench's plan takes where float32 pages do not fit it (every weight trained at
1M), so that the comparison leaves the dtype out.

Each arm starts with empty compile caches of its own (torch's inductor and Triton caches under --work-dir),
so that each first step is what a fresh machine pays, not what the other arm left compiled.

The comparison is ``train_over_bench``: oomb train's steady step (summary.json's ``steady_step_s``, the
median of the steps after the first; data, optimizer and metrics included) over the bench step. The two
plans are recorded side by side (chunk, backend, dK/dV dtype, layer replay, resident layers), so a
difference in the ratio can be traced to the option that differs. Writes the results JSON (and each
arm's log) to --out-dir ($OUT if set).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script's helpers, also when imported
from sft_trainer_vs_train import ratio, run  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PLAN_KEYS = ("chunk_size", "page_size", "attention", "performance.backend", "precision.kv_grad_dtype",
             "performance.checkpoint_layers", "performance.compile_layers", "performance.recompute_logits",
             "offload.enabled", "offload.resident_layers", "sparse.budget", "sparse.read_share",
             "sparse.query_block_pages")
"""The step options each arm's plan is compared on (dotted OOMBConfig paths)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--seq-len", default="128K", help="tokens per step, e.g. 131072, 128K, 1M")
    p.add_argument("--attention", choices=("dense", "sparse"), default="dense")
    p.add_argument("--bench-mode", help="oomb bench mode (default: the attention; e.g. sparse+offload at 1M)")
    p.add_argument("--lora", action="store_true", help="oomb train trains LoRA adapters (else every weight, AdamW)")
    p.add_argument("--steps", type=int, default=2, help="oomb train's optimizer steps (the first is reported apart)")
    p.add_argument("--data", help="oomb train's data (default: its embedded corpus, packed documents)")
    p.add_argument("--sparse-budget", help="given to both arms")
    p.add_argument("--sparse-read-share", help="given to both arms (e.g. none: the fixed budget)")
    p.add_argument("--train-kv-grad-dtype",
                   help="oomb train's dK/dV page dtype (default: its chooser's); bfloat16 compares the trainer at the "
                        "page dtype the bench's plan takes where float32 does not fit it")
    p.add_argument("--progress", action="store_true",
                   help="oomb train's progress bar in its log, with the stage and chunk of the step in progress (where "
                        "a long step's time goes: stage 1 against stage 2, chunk by chunk)")
    p.add_argument("--train-first", action="store_true",
                   help="run oomb train before the bench (when a call may end early, its arm is the one to keep)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeout", type=float, help="seconds allowed to each arm's process (default: none)")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "out/train_vs_bench")
    p.add_argument("--work-dir", default="/tmp/oomb_train_vs_bench", help="run directories")
    p.add_argument("--name", help="results file name (default train_vs_bench_PRESET_LEN_ATTENTION.json)")
    return p.parse_args(argv)


def bench_row(report_file: Path, tokens: int, mode: str) -> dict:
    if not report_file.exists():
        return {}
    report = json.loads(report_file.read_text())
    rows = [r for r in report["rows"] if r["tokens"] == tokens]
    row = rows[0] if rows else {}
    ran = report["modes"].get(mode, {})
    options = {**report["workload"]["options"], **ran.get("chosen", {})}  # the plan the worker ran
    plan = {"chunk_size": options.get("chunk_size"), "page_size": options.get("page_size"),
            "attention": mode.split("+")[0], "performance.backend": options.get("backend"),
            "precision.kv_grad_dtype": options.get("kv_grad_dtype"),
            "performance.checkpoint_layers": options.get("checkpoint_layers"),
            "performance.compile_layers": ran.get("compiled_layers"),
            "performance.recompute_logits": options.get("recompute_logits"),
            "offload.enabled": mode.endswith("+offload"),
            "offload.resident_layers": options.get("offload_resident_layers"),
            "sparse.budget": options.get("sparse_budget"), "sparse.read_share": options.get("sparse_read_share"),
            "sparse.query_block_pages": options.get("sparse_query_block_pages")}
    return {"machine": report.get("machine"), "step_seconds": row.get("seconds"), "status": row.get("status"),
            "peak_gpu_above_weights_gib": row.get("peak_gpu_above_weights_gib"),
            "host_peak_gib": row.get("host_peak_gib"),
            "plan": plan, "plan_text": ran.get("plan"), "warmup_seconds": ran.get("warmup_seconds")}


def train_result(run_dir: Path) -> dict:
    summary_file, config_file = run_dir / "summary.json", run_dir / "config.yaml"
    out: dict = {}
    if summary_file.exists():
        s = json.loads(summary_file.read_text())
        out.update({k: s.get(k) for k in ("first_step_s", "steady_step_s", "predicted_step_s", "steady_step_parts_s",
                                          "setup_s", "checkpoint_s", "peak_gpu_gib", "peak_host_gib", "losses",
                                          "first_step_compile_s", "first_step_pin_s")})
        if s.get("first_step_s") is not None and s.get("steady_step_s") is not None:
            out["first_step_overhead_s"] = round(max(0.0, s["first_step_s"] - s["steady_step_s"]), 2)
    metrics_file = run_dir / "metrics.jsonl"
    if metrics_file.exists():
        out["step_seconds"] = [round(json.loads(line)["step_time_s"], 3)
                               for line in metrics_file.read_text().splitlines() if line.strip()]
    if config_file.exists():
        from oomb.config import dotted_options

        chosen = dotted_options(yaml.safe_load(config_file.read_text()).get("oomb", {}))
        out["plan"] = {k: chosen.get(k) for k in PLAN_KEYS}
    return out


def compiled_in_log(log: Path) -> bool | None:
    """Whether oomb train's header says its decoder layers were compiled (config.yaml keeps None: "auto")."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return True if "layers: compiled" in text else (False if "configuration:" in text else None)


def fresh_compile_caches(env: dict, arm_dir: Path) -> dict:
    """``env`` with torch's inductor and Triton caches in empty folders of the arm's own: its first step compiles
    and tunes everything, as on a fresh machine."""
    caches = {"TORCHINDUCTOR_CACHE_DIR": arm_dir / "inductor_cache", "TRITON_CACHE_DIR": arm_dir / "triton_cache"}
    for folder in caches.values():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    return {**env, **{name: str(folder) for name, folder in caches.items()}}


def gpu_name() -> str | None:
    """The first GPU's name from nvidia-smi (no CUDA context in this process: the arms need the memory), or None."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.splitlines()[0].strip() if done.stdout.strip() else None


def comparison(args: argparse.Namespace, argv: list[str] | None, tokens: int, mode: str, bench: dict,
               train: dict) -> dict:
    """The results JSON of the arms run so far (an arm not run yet has only its command)."""
    differ = {k: {"bench": bench.get("plan", {}).get(k), "train": train.get("plan", {}).get(k)} for k in PLAN_KEYS
              if str(bench.get("plan", {}).get(k)) != str(train.get("plan", {}).get(k))}
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": bench.get("machine") or {"gpu": gpu_name()},
        "commit": os.environ.get("OOMB_GIT_COMMIT"),
        "command": shlex.join(["python", "benchmarks/train_vs_bench.py", *(sys.argv[1:] if argv is None else argv)]),
        "workload": {"preset": args.preset, "seq_len": tokens, "attention": args.attention, "bench_mode": mode,
                     "lora": args.lora, "steps": args.steps, "data": args.data or "embedded corpus (packed documents)",
                     "train_kv_grad_dtype": args.train_kv_grad_dtype or "chosen"},
        "timing": "each arm with empty compile caches of its own. bench: one step after a warm-up step, perf_counter "
                  "with synchronisation, every weight's gradient, "
                  "no optimizer. train: summary.json steady_step_s (median of the steps after the first; data, "
                  "LoRA or full AdamW, metrics included); the first step reported apart.",
        "bench": bench, "train": train, "plans_differ": differ,
        "train_over_bench": ratio(train.get("steady_step_s"), bench.get("step_seconds")),
        "first_train_step_over_bench": ratio(train.get("first_step_s"), bench.get("step_seconds")),
    }


def arm_commands(args: argparse.Namespace, tokens: int, mode: str, work: Path) -> tuple[list[str], list[str]]:
    """The bench's and oomb train's command lines (this Python, ``-m oomb``)."""
    sparse = []
    for flag in ("sparse_budget", "sparse_read_share"):
        if getattr(args, flag) is not None:
            sparse += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    py = sys.executable
    bench_cmd = [py, "-m", "oomb", "bench", "--chosen", "--preset", args.preset, "--contexts", str(tokens),
                 "--modes", mode, "--device", args.device, "--out-dir", str(work / "bench"), "--name", "bench", *sparse]
    train_cmd = [py, "-m", "oomb", "train", "--preset", args.preset, "--seq-len", str(tokens), "--attention",
                 args.attention, "--steps", str(args.steps), "--device", args.device, "--output-dir",
                 str(work / "train"), "--overwrite", *sparse]
    train_cmd += ["--set", f"logging.progress={str(args.progress).lower()}"]
    train_cmd += ["--lora"] if args.lora else []
    train_cmd += ["--data", args.data] if args.data else []
    train_cmd += ["--kv-grad-dtype", args.train_kv_grad_dtype] if args.train_kv_grad_dtype else []
    return bench_cmd, train_cmd


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from oomb.units import parse_tokens

    tokens = parse_tokens(args.seq_len)
    out, work = Path(args.out_dir), Path(args.work_dir)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    mode = args.bench_mode or args.attention
    bench_cmd, train_cmd = arm_commands(args, tokens, mode, work)
    train_dir = work / "train"
    bench = {"arm": "oomb bench --chosen", "command": shlex.join(bench_cmd[1:])}
    train = {"arm": "oomb train", "command": shlex.join(train_cmd[1:])}

    def run_bench() -> None:
        (work / "bench" / "bench.json").unlink(missing_ok=True)
        bench.update(run("bench", bench_cmd, out / "bench.log", fresh_compile_caches(env, work / "bench"),
                         args.timeout))
        bench.update(bench_row(work / "bench" / "bench.json", tokens, mode))

    def run_train() -> None:
        train.update(run("train", train_cmd, out / "train.log", fresh_compile_caches(env, work / "train_caches"),
                         args.timeout))
        train.update(train_result(train_dir))
        if train.get("plan", {}).get("performance.compile_layers") is None and "plan" in train:
            train["plan"]["performance.compile_layers"] = compiled_in_log(out / "train.log")

    length = f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)
    path = out / (args.name or f"train_vs_bench_{args.preset}_{length}_{args.attention}.json")
    for arm in ((run_train, run_bench) if args.train_first else (run_bench, run_train)):
        arm()
        result = comparison(args, argv, tokens, mode, bench, train)
        path.write_text(json.dumps(result, indent=1) + "\n")  # after each arm: a call cut short keeps the first
    print(f"bench {bench.get('status')}: {bench.get('step_seconds')} s; train {train.get('status')}: steps "
          f"{train.get('step_seconds')} s (steady {train.get('steady_step_s')}, "
          f"predicted {train.get('predicted_step_s')})")
    differ = sorted(result["plans_differ"]) or "nothing"
    print(f"train_over_bench {result['train_over_bench']}; plans differ in {differ}")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
