"""A paired A/B of one switch of the dense Triton forward (``OOMB_TRITON_TMA``) in one process: the two arms
alternate round by round on attention.py's workload, so that drift of the GPU's clock or temperature falls on
both alike.

Whole ``attention.py`` runs of the same code differ by 2-3 % (attention-noise-h100): too much to judge a
change worth a few percent. Here each round times the forward with the switch off, then on (the autotuner
keeps one pick per arm: the switch is in its key), and the report gives each arm's median TFLOP/s and the
median over rounds of the paired time ratio (on / off). Both arms must give the same bits.

    python benchmarks/forward_switch_ab.py --switch tma --out ab.json          # a GPU
    python benchmarks/forward_switch_ab.py --switch tma --smoke                 # CPU: the interpreter

It also timed ``--switch persistent`` (a persistent grid, 2026-12-05, forward-persistent-ab-h100: 1.10x / 1.08x
the plain grid's time); that switch was removed with the code after the run (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

SWITCHES = {"tma": "TMA_LOADS"}
"""--switch -> the module flag of oomb.attention.triton_paged that its environment variable sets at import."""


def parse_args() -> argparse.Namespace:
    from attention import add_workload_args, shrink_for_smoke

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--switch", choices=sorted(SWITCHES), required=True)
    add_workload_args(p, [32768, 131072])
    p.add_argument("--rounds", type=int, default=15, help="alternations of the two arms")
    p.add_argument("--iters", type=int, default=5, help="timed calls per arm and round (their median)")
    p.add_argument("--out", help="write the JSON report here")
    args = p.parse_args()
    if args.smoke:
        shrink_for_smoke(args)
        args.rounds, args.iters = 2, 1
    return args


def compare_history(args: argparse.Namespace, history: int, device: torch.device, timer) -> dict:
    """Both arms at one history: bitwise agreement, per-arm median TFLOP/s, median paired time ratio."""
    from attention import paged_inputs, visible_pairs

    from oomb.attention import triton_paged

    flag = SWITCHES[args.switch]
    given = getattr(triton_paged, flag)
    q, k_pool, v_pool, page_table, _ = paged_inputs(args, history, device)
    scale = args.head_dim ** -0.5

    def forward(on: bool):
        setattr(triton_paged, flag, on)
        return triton_paged.paged_attention_forward(q, k_pool, v_pool, page_table, history, scale)

    outputs = {on: forward(on) for on in (False, True)}  # (also each arm's autotuning, outside the timing)
    same_bits = all(torch.equal(a, b) for a, b in zip(outputs[False], outputs[True], strict=True))
    del outputs
    times = {False: [], True: []}
    for _ in range(args.rounds):
        for on in (False, True):
            times[on].append(timer(lambda on=on: forward(on), 1, args.iters))
    setattr(triton_paged, flag, given)
    tflop = 4 * args.head_dim * args.heads * visible_pairs(history, args.chunk) / 1e12
    ratios = [t_on / t_off for t_off, t_on in zip(times[False], times[True], strict=True)]
    return {"history": history, "same_bits": same_bits, "fwd_tflop": tflop,
            "off_ms": times[False], "on_ms": times[True],
            "off_median_tflops": tflop / (statistics.median(times[False]) * 1e-3),
            "on_median_tflops": tflop / (statistics.median(times[True]) * 1e-3),
            "paired_time_ratios": ratios, "median_paired_time_ratio": statistics.median(ratios)}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # attention.py's workload and timer
    args = parse_args()
    from attention import Timer, chosen_configs, kernel_device, write_kernel_report

    device = kernel_device(args.smoke)
    timer = Timer(device)
    rows = []
    for history in args.histories:
        row = compare_history(args, history, device, timer)
        rows.append(row)
        print(f"history {history}: off {row['off_median_tflops']:.1f} TFLOP/s, on {row['on_median_tflops']:.1f}, "
              f"median paired time on/off {row['median_paired_time_ratio']:.4f}, same bits {row['same_bits']}",
              flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rows.append({"autotuned_configs": chosen_configs()})
    write_kernel_report(args, device, rows)


if __name__ == "__main__":
    main()
