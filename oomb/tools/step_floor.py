"""`python -m oomb.tools.step_floor`: print a step's work and floors (oomb/planning/step_work.py)."""

from __future__ import annotations

import argparse
import dataclasses

from ..config import OffloadConfig, SparseConfig
from ..planning.step_work import H200, StepSpec, linear_flops, step_work
from ..units import format_tokens, parse_tokens
from .plan import load_model_shape


def main(argv: list[str] | None = None) -> None:
    """Print a step's work and floors: ``python -m oomb.tools.step_floor --preset qwen2.5-7b --context 1M``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", "--model", dest="model", default="qwen2.5-7b")
    parser.add_argument("--context", type=parse_tokens, default=parse_tokens("1M"))
    parser.add_argument("--mode", choices=("hf", "dense", "sparse"), default="sparse")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--no-checkpoint-layers", action="store_true")
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--sparse-budget", type=int, default=SparseConfig.budget)
    args = parser.parse_args(argv)
    spec = StepSpec(load_model_shape(args.model), args.context, args.mode, offload=OffloadConfig(enabled=args.offload),
                    checkpoint_layers=not args.no_checkpoint_layers, lora_rank=args.lora_rank,
                    sparse=SparseConfig(budget=args.sparse_budget))
    print(f"{args.model}, {format_tokens(args.context)} tokens, {args.mode}: linear layers by pass (TFLOP) "
          + ", ".join(f"{k} {v / 1e12:,.0f}" for k, v in linear_flops(spec).items()))
    print(f"{'part':<10} {'TFLOP':>12} {'bytes (GB)':>11} {'floor (s)':>10}   rates: {dataclasses.asdict(H200)}")
    for part, work in step_work(spec).items():
        moved = work.memory_bytes + work.to_device_bytes + work.to_host_bytes
        print(f"{part:<10} {work.flops / 1e12:>12,.1f} {moved / 1e9:>11,.1f} {work.floor_seconds(H200):>10.2f}")


if __name__ == "__main__":
    main()
