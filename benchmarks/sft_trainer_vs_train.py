"""OOMBSFTTrainer (TRL's SFTTrainer with the one-line switch) vs `oomb train`, on the same settings.

    python benchmarks/sft_trainer_vs_train.py --preset qwen2.5-7b --seq-len 131072 --steps 3   # one H200
    python benchmarks/sft_trainer_vs_train.py --preset tiny-qwen2 --seq-len 2048 --train-set oomb.chunk_size=512

Both arms train a preset shape with random weights (bf16 on CUDA, float32 on a CPU), LoRA r=16 / alpha 32 /
no dropout on all linear layers, batch 1, one sequence of exactly --seq-len tokens per optimizer step,
--steps steps, AdamW at --lr, in two processes one after the other:

1. ``oomb train`` (``python -m oomb train``) on a jsonl of identical text rows (Python's documentation
   prose, oomb.real_model.english_text, each row longer than --seq-len), packed without shuffling as one
   continuous text (data.documents=joined: dense causal attention over the whole sequence, as the SFT arm
   has). The oomb options are left to its chooser (train.auto_config), except any --train-set oomb.KEY=V.
2. ``examples/sft_trainer.py`` (OOMBSFTTrainer) on the same rows: TRL truncates each to --seq-len, so every
   step sees the same tokens as the first step of arm 1, and with --oomb-from the step options that arm 1
   chose (its config.yaml), so both run the same chunk, page, backend, dK/dV dtype, layer replay and offload.

Step times: arm 1, its metrics.jsonl's step_time_s (time.perf_counter from the start of Trainer.train_step,
the data fetch included, to after the optimizer step; reading the loss and the gradient norm synchronizes
the GPU); arm 2, a TrainerCallback (time.perf_counter from on_step_begin to on_step_end, after
torch.cuda.synchronize() at both: the training step, clipping, optimizer and scheduler; the batch is
collated before on_step_begin). The first step (cuDNN plans, Triton autotuning, allocator warm-up) is
reported apart; the comparison is the ratio of the medians of the later steps. Peak GPU memory:
torch.cuda.max_memory_allocated, reset at the start of every step, weights included, in both arms.

Writes to --out-dir ($OUT if set): the results JSON (benchmarks/results/ format: date, machine, versions
with the commit from $OOMB_GIT_COMMIT, command, workload, per-arm rows, ratios) and each arm's log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--seq-len", type=int, default=131072, help="tokens per sequence (one sequence per step)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per arm")
    p.add_argument("--lr", type=float, default=2e-4, help="AdamW learning rate (oomb train's LoRA default)")
    p.add_argument("--train-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra `oomb train --set` (e.g. oomb.chunk_size=512); arm 2 takes the oomb options arm 1 ran")
    p.add_argument("--arms", default="train,sft", help="comma-separated, in order: train, sft, plain (TRL's own "
                   "SFTTrainer with gradient checkpointing; at 128K on a 7B it runs out of memory)")
    p.add_argument("--timeout", type=float, help="seconds allowed to each arm's process (default: none)")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "out/sft_vs_train")
    p.add_argument("--work-dir", default="/tmp/oomb_sft_vs_train", help="data, run directories, caches")
    p.add_argument("--name", help="results file name (default sft_trainer_vs_train_PRESET_LEN_MACHINE_DATE.json)")
    return p.parse_args(argv)


def write_data(path: Path, seq_len: int, rows: int) -> None:
    """``rows`` identical {"text": ...} rows of more than ``seq_len`` bytes (the byte tokenizer: one token each)."""
    from oomb.real_model import english_text

    text = english_text()
    text = text * (1 + (seq_len + 1024) // len(text))
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": text[: seq_len + 1024]}) + "\n")


def run(name: str, cmd: list[str], log: Path, env: dict, timeout: float | None) -> dict:
    print(f"== {name}: {shlex.join(cmd)}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        try:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                  timeout=timeout).returncode
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout:.0f} s"
    seconds = time.perf_counter() - start
    print(f"   {status}, {seconds:.1f} s; log {log}", flush=True)
    if status != "ok":
        print("   " + "\n   ".join(log.read_text(errors="replace").splitlines()[-15:]), flush=True)
    return {"status": status, "process_seconds": round(seconds, 1), "log": log.name}


def timing(times: list[float]) -> dict:
    return {"step_seconds": [round(t, 3) for t in times],
            "first_step_seconds": round(times[0], 3) if times else None,
            "median_later_step_seconds": round(statistics.median(times[1:]), 3) if len(times) > 1 else None}


def train_row(run_dir: Path, log: Path) -> dict:
    metrics_file = run_dir / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    peaks = [m["gpu_peak_gib"] for m in metrics if "gpu_peak_gib" in m]
    text = log.read_text(errors="replace") if log.exists() else ""
    chosen = re.search(r"^\s*configuration: (.*)$", text, re.M)
    return {**timing([m["step_time_s"] for m in metrics]),
            "step_peak_gpu_gib": [round(p, 2) for p in peaks], "peak_gpu_gib": round(max(peaks), 2) if peaks else None,
            "losses": [m["loss"] for m in metrics], "grad_norms": [m["grad_norm"] for m in metrics],
            "tokens_per_step": [m["tokens"] for m in metrics],
            "chosen": chosen.group(1) if chosen else None}


def sft_row(summary: Path) -> dict:
    if not summary.exists():
        return {}
    s = json.loads(summary.read_text())
    return {**timing(s["step_seconds"]), "step_peak_gpu_gib": s["step_peak_gpu_gib"], "peak_gpu_gib": s["peak_gpu_gib"],
            "losses": s["losses"], "grad_norms": s["grad_norms"], "tokens_per_step": s["tokens_per_step"],
            "setup_seconds": s["setup_seconds"], "trainable_parameters": s["trainable_parameters"],
            "oomb_config": s["oomb_config"]}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(arms) - {"train", "sft", "plain"}
    if unknown:
        raise SystemExit(f"--arms: unknown {sorted(unknown)}; choose from train, sft, plain")
    out, work = Path(args.out_dir), Path(args.work_dir)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HUB_DISABLE_TELEMETRY="1", HF_DATASETS_CACHE=str(work / "hf_datasets"),
               TOKENIZERS_PARALLELISM="false")
    data = work / "rows.jsonl"
    write_data(data, args.seq_len, args.steps)
    py = sys.executable
    train_dir = work / "train"
    common_sft = [py, "examples/sft_trainer.py", "--preset", args.preset, "--data", str(data), "--seq-len",
                  str(args.seq_len), "--lora", "--max-steps", str(args.steps), "--lr", str(args.lr), "--no-save"]
    rows = []
    for arm in arms:
        log = out / f"{arm}.log"
        if arm == "train":
            (train_dir / "config.yaml").unlink(missing_ok=True)  # arm 2 reads the one this run writes
            cmd = [py, "-m", "oomb", "train", "--set", f"model.preset={args.preset}", "--lora", "--data", str(data),
                   "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--output-dir", str(train_dir),
                   "--overwrite", "--set", "data.documents=joined", "--set", "data.shuffle=false",
                   "--set", f"optim.lr={args.lr}", "--set", "logging.progress=false",
                   "--set", "checkpoint.export=false", "--set", "checkpoint.every=0"]
            for item in args.train_set:
                cmd += ["--set", item]
            row = {"arm": "oomb train", "command": shlex.join(cmd[1:]), **run(arm, cmd, log, env, args.timeout)}
            row.update(train_row(train_dir, log))
        else:
            summary = work / f"{arm}_summary.json"
            summary.unlink(missing_ok=True)
            cmd = [*common_sft, "--output-dir", str(work / arm), "--summary", str(summary)]
            if arm == "plain":
                cmd.append("--plain")
            elif (train_dir / "config.yaml").exists() and "train" in arms:
                cmd += ["--oomb-from", str(train_dir / "config.yaml")]  # the options oomb train chose
            name = "SFTTrainer (plain TRL)" if arm == "plain" else "OOMBSFTTrainer"
            row = {"arm": name, "command": shlex.join(cmd[1:]), **run(arm, cmd, log, env, args.timeout)}
            row.update(sft_row(summary))
        rows.append(row)

    import torch

    from oomb import machine

    cuda = torch.cuda.is_available()
    gpu = machine.detect_gpu() if cuda else None
    by_arm = {r["arm"]: r for r in rows}
    train, sft = by_arm.get("oomb train", {}), by_arm.get("OOMBSFTTrainer", {})
    train_config = (train_dir / "config.yaml")
    same = None
    if train_config.exists() and sft.get("oomb_config"):
        import yaml

        chosen = yaml.safe_load(train_config.read_text())["oomb"]
        same = all(str(sft["oomb_config"].get(k)) == str(v) for k, v in chosen.items())
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine.machine_info(torch.device("cuda" if cuda else "cpu"), gpu),
        "versions": {**machine.versions(), **{p: machine._version(p) for p in ("trl", "datasets", "accelerate")}},
        "command": os.environ.get("OOMB_BENCH_COMMAND") or shlex.join(["python", "benchmarks/sft_trainer_vs_train.py",
                                                                         *(sys.argv[1:] if argv is None else argv)]),
        "workload": {"preset": args.preset, "seq_len": args.seq_len, "steps": args.steps, "batch_size": 1,
                     "dtype": "bfloat16" if cuda else "float32", "lora": LORA, "lr": args.lr,
                     "data": "identical rows of oomb.real_model.english_text(), byte tokenizer; every SFT step and "
                             "oomb train's first step see the same first seq_len tokens; all tokens count in the loss"},
        "timing": "oomb train: metrics.jsonl step_time_s (perf_counter around Trainer.train_step: data fetch, "
                  "oomb.forward_backward, clipping, AdamW; loss and grad-norm reads synchronize). OOMBSFTTrainer: "
                  "TrainerCallback, perf_counter from on_step_begin to on_step_end with torch.cuda.synchronize() at "
                  "both. Peak GPU: max_memory_allocated reset at each step's start, weights included.",
        "same_oomb_config": same,
        "rows": rows,
        "ratio_sft_over_train_median_later_step": ratio(sft.get("median_later_step_seconds"),
                                                        train.get("median_later_step_seconds")),
        "ratio_sft_over_train_first_step": ratio(sft.get("first_step_seconds"), train.get("first_step_seconds")),
        "ratio_sft_over_train_peak_gpu": ratio(sft.get("peak_gpu_gib"), train.get("peak_gpu_gib")),
    }
    tag = "h200" if gpu is not None and "H200" in gpu.name else ("cuda" if cuda else "cpu")
    length = f"{args.seq_len // 1024}k" if args.seq_len % 1024 == 0 else str(args.seq_len)
    name = args.name or f"sft_trainer_vs_train_{args.preset}_{length}_{tag}_{result['date'][:10]}.json"
    (out / name).write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(f"{r['arm']}: {r['status']}; steps {r.get('step_seconds')} s, first {r.get('first_step_seconds')} s, "
              f"median later {r.get('median_later_step_seconds')} s; peak GPU {r.get('peak_gpu_gib')} GiB; "
              f"losses {r.get('losses')}")
    print("ratio (OOMBSFTTrainer / oomb train), median later step: "
          f"{result['ratio_sft_over_train_median_later_step']}; same oomb options: {same}")
    print(f"wrote {out / name}")
    return result


if __name__ == "__main__":
    main()
