"""GPU memory of `oomb train` steps: measured peak vs the trainer's own prediction.

The trainer refuses a run its prediction says will not fit (train.memory_check), so the prediction
must not be far off either way. This trains a preset (random weights, embedded corpus) for a few
steps with and without fp32 master weights and compares the peak allocated GPU memory beyond the
model's weights with ``Trainer.predicted_memory``, term by term.

    python benchmarks/trainer_memory.py --preset qwen2.5-0.5b --seq-len 32768 \
        --out benchmarks/results/trainer_memory_h200.json
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from datetime import datetime, timezone

import torch

from oomb import machine
from oomb.models import unwrap_causal_lm
from oomb.planning.memory import GIB
from oomb.training.config import TrainerConfig
from oomb.training.trainer import Trainer


def measure(preset: str, seq_len: int, steps: int, master_weights: bool, out_dir: str) -> dict:
    overrides = [f"model.preset={preset}", f"data.seq_len={seq_len}", f"train.max_steps={steps}",
                 f"optim.master_weights={str(master_weights).lower()}", f"train.output_dir={out_dir}",
                 "logging.progress=false", "checkpoint.every=0", "checkpoint.export=false"]
    trainer = Trainer(TrainerConfig.load(None, overrides))
    try:
        trainer.setup()
        weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        predicted = trainer.predicted_memory(unwrap_causal_lm(trainer.model))
        result = trainer.train()
    finally:
        trainer.close()
    row = {"master_weights": master_weights, "weights_gib": round(weights / GIB, 3),
           "measured_peak_above_weights_gib": round(result.peak_gpu_gib - weights / GIB, 3),
           "predicted_above_weights_gib": round(sum(predicted.values()) / GIB, 3),
           "predicted_terms_gib": {k: round(v / GIB, 3) for k, v in predicted.items()},
           "losses": result.losses, "tokens_per_s": round(result.tokens_per_s, 1)}
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("trainer_memory.py measures GPU memory: it needs a CUDA device")
    rows = []
    for master_weights in (True, False):
        with tempfile.TemporaryDirectory() as out_dir:
            rows.append(measure(args.preset, args.seq_len, args.steps, master_weights, out_dir))
        print(rows[-1])
    if args.out:
        result = {"command": f"python benchmarks/trainer_memory.py --preset {args.preset} --seq-len {args.seq_len} "
                             f"--steps {args.steps} --out {args.out}",
                  "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "machine": machine.machine_info(torch.device("cuda")), "versions": machine.versions(),
                  "rows": rows}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
