"""One chunk's LM-head loss, forward and backward: autograd's float32 cross-entropy (each slice checkpointed, or
its log-probabilities kept) against oomb's fused loss (oomb/loss.py _HeadCrossEntropy), frozen and trained head;
for the trained head also as the engine runs it: dW added into .grad by its products, kept or made in the forward
(weight_gradient_now).

Workload: the 7B shape's head (vocabulary 152,064, hidden 3,584, bf16), one chunk of 4096 tokens in slices of
1024 (OOMBConfig's defaults), every token counted. CUDA events, median of ``--iters`` after warm-up; the
peak memory each variant allocates above its inputs (torch.cuda.max_memory_allocated); the largest
difference of dL/dhidden (and dW) against autograd's recomputing path.

    python benchmarks/loss_speed.py --out loss_speed.json
    python benchmarks/loss_speed.py --smoke      # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--slice", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=3584)
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--out", help="write the JSON report here")
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.slice, args.hidden, args.vocab, args.warmup, args.iters = 64, 16, 32, 300, 0, 1
    return args


def _run(head, hidden, targets, slice_tokens, fused, recompute, sink=None):
    """One forward and backward; ``sink`` "in place" or "now": the head's dW added into .grad by its products
    as in the engine (fp32_linear.in_place_weight_gradients), "now" also made in the loss's forward."""
    import contextlib

    from oomb.fp32_linear import in_place_weight_gradients
    from oomb.grads import Fp32GradAccumulator
    from oomb.loss import chunked_cross_entropy

    x = hidden.detach().requires_grad_()
    head.zero_grad(set_to_none=True)
    routed = (in_place_weight_gradients(head, Fp32GradAccumulator(head.parameters(), enabled=False)) if sink
              else contextlib.nullcontext())
    with routed:
        loss = chunked_cross_entropy(x, targets, head, targets.numel(), slice_tokens, recompute, fused=fused,
                                     weight_gradient_now=sink == "now")
        loss.backward()
    return x.grad, head.weight.grad


def _time(fn, cuda: bool, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    from oomb.machine import git_commit

    gen = torch.Generator(device=device).manual_seed(0)
    head = nn.Linear(args.hidden, args.vocab, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        head.weight.normal_(0, args.hidden ** -0.5, generator=gen)
    hidden = torch.randn(1, args.tokens, args.hidden, device=device, dtype=dtype, generator=gen)
    targets = torch.randint(0, args.vocab, (1, args.tokens), device=device, generator=gen)
    rows = []
    for trained in (False, True):
        head.weight.requires_grad_(trained)
        reference = _run(head, hidden, targets, args.slice, False, True)
        variants = [("autograd, recompute", False, True, None), ("autograd, kept", False, False, None),
                    ("fused, recompute", True, True, None), ("fused, kept", True, False, None)]
        if trained:  # the engine's: dW into .grad by its products, kept or made in the forward
            variants += [("fused, kept, dW in place", True, False, "in place"),
                         ("fused, dW in the forward", True, True, "now")]
        for name, fused, recompute, sink in variants:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            grads = _run(head, hidden, targets, args.slice, fused, recompute, sink)
            row = {"head": "trained" if trained else "frozen", "loss": name}
            if cuda:
                row["peak_gib_above_inputs"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
            row["max_abs_diff_dhidden"] = (grads[0].float() - reference[0].float()).abs().max().item()
            if trained:
                row["max_abs_diff_dweight"] = (grads[1].float() - reference[1].float()).abs().max().item()
            del grads
            row["ms"] = _time(lambda f=fused, r=recompute, k=sink: _run(head, hidden, targets, args.slice, f, r, k),
                              cuda, args.warmup, args.iters)
            rows.append(row)
            print(json.dumps(row), flush=True)
    report = {"date": datetime.date.today().isoformat(), "commit": git_commit(),
              "device": torch.cuda.get_device_name() if cuda else "cpu", "command": " ".join(sys.argv),
              "workload": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        print("wrote", args.out)


if __name__ == "__main__":
    main()
