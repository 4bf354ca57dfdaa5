"""One training step (forward + backward, no optimizer) of plain HF vs oomb dense: a thin wrapper over
`oomb bench` (oomb/tools/bench.py), kept for the commands recorded with earlier results.

Standard workload: Qwen2.5-7B shape with random weights, bf16, chunk 4096,
page 128. Plain HF = SDPA + gradient checkpointing + oomb's chunked LM-head loss. Each mode runs in
its own process; steps are timed after a warm-up step, with synchronisation and peak statistics
reset; memory is the peak above the weights. Results are written after every measurement.

    python benchmarks/step.py --contexts 32768 65536 131072 262144 --out benchmarks/results/step_h200.json
    python benchmarks/step.py --preset tiny-qwen2 --contexts 2048 4096 --device cpu   # smoke test

Writes OUT (JSON) and, next to it, the markdown table and plot of `oomb bench`.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from oomb.tools.bench import BenchOptions, run_bench
from oomb.training.presets import PRESETS

MODE_NAMES = {"hf": "hf", "oomb": "dense"}  # this script's names -> oomb bench's


def main() -> None:
    parser = argparse.ArgumentParser(description="plain HF vs oomb dense: one training step")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-7b")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536, 131072, 262144, 524288])
    parser.add_argument("--modes", nargs="+", choices=sorted(MODE_NAMES), default=["hf", "oomb"])
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--kv-grad-dtype", default="float32")
    parser.add_argument("--no-checkpoint-layers", action="store_true")
    parser.add_argument("--fp32-grad-accumulation", action="store_true",
                        help="oomb's fp32 sum of chunk gradients (+4 bytes/parameter); off: bf16 .grad like HF")
    parser.add_argument("--warmup-tokens", type=int, default=8192)
    parser.add_argument("--max-seconds", type=float, default=math.inf,
                        help="skip a context whose predicted step time (quadratic from the last) exceeds what is left")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="benchmarks/results/step.json")
    args = parser.parse_args()
    out = Path(args.out)
    run_bench(BenchOptions(
        preset=args.preset, contexts=args.contexts, modes=[MODE_NAMES[m] for m in args.modes], device=args.device,
        chunk_size=args.chunk_size, page_size=args.page_size, kv_grad_dtype=args.kv_grad_dtype,
        checkpoint_layers=not args.no_checkpoint_layers, fp32_grad_accumulation=args.fp32_grad_accumulation,
        warmup_tokens=args.warmup_tokens, max_seconds=args.max_seconds, out_dir=str(out.parent), name=out.stem,
    ))


if __name__ == "__main__":
    main()
