"""Sparse + offload step time under each staging mode, in one process on one model (the union, stage 1 in
place, (page, KV head) rows), and whether each gives the union's loss and gradients bit for bit.

The modes are module switches (OOMB_STAGE1_IN_PLACE, OOMB_OFFLOAD_HEAD_ROWS), flipped here between steps, so
one model build and one warm-up serve every mode. An untimed union step at the full length first builds every
key length's cuDNN graph and is the reference of the bitwise check; by default the union is also timed first and
last (the drift of the machine). The bitwise check means something only on deterministic kernels
(--deterministic): on cuDNN two union steps already differ in their last bits.

    python benchmarks/offload_staging.py --modes sparse+offload --contexts 1M --backend cudnn \
        --query-block-pages 32 --kv-grad-dtype bf16 --layers 2 --out-dir benchmarks/results --name NAME
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from oomb import machine  # noqa: E402
from oomb.kv import head_rows, sparse_staging  # noqa: E402
from oomb.tools.bench import (  # noqa: E402
    add_arguments,
    build_model,
    make_step,
    options_from_args,
    token_ids,
    warmup_tokens,
)

STAGINGS = {"union": (False, False), "stage1_in_place": (True, False), "head_rows": (False, True)}
"""Name -> (OOMB_STAGE1_IN_PLACE, OOMB_OFFLOAD_HEAD_ROWS)."""


def _set_staging(in_place: bool, rows: bool) -> None:
    sparse_staging.STAGE1_IN_PLACE = in_place
    head_rows.HEAD_ROWS = rows


def _timed(step, model, ids: torch.Tensor) -> tuple[float, float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    loss = step(model, ids)
    sync()
    seconds = time.perf_counter() - start
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    return seconds, float(loss), grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--layers", type=int, help="a model of the preset's first N decoder layers")
    parser.add_argument("--stagings", nargs="+", choices=list(STAGINGS),
                        default=["union", "stage1_in_place", "head_rows", "union"],
                        help="the timed steps, in order (default: union, stage1_in_place, head_rows, union)")
    args = parser.parse_args()
    if args.quick or args.replot:
        parser.error("--quick and --replot are options of `oomb bench` only")
    options = options_from_args(args)
    if options.modes != ["sparse+offload"] or len(options.contexts) != 1:
        parser.error("give --modes sparse+offload and one --contexts length")
    mode, tokens = options.modes[0], options.contexts[0]
    if options.threads:
        torch.set_num_threads(options.threads)
    out = Path(options.out_dir) / f"{options.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.device(options.device)
    model = build_model(options.preset, tokens, device, options.dtype, options.seed, args.layers)
    step = make_step(mode, options)
    vocab = model.config.vocab_size
    step(model, token_ids(vocab, warmup_tokens(mode, options), options.seed, device))
    ids = token_ids(vocab, tokens, options.seed, device)
    if hasattr(step, "prepare"):
        step.prepare(model, ids)
    _set_staging(False, False)
    first, *reference = _timed(step, model, ids)
    print(f"first step at {tokens:,} (union, untimed in the table): {first:.2f} s", flush=True)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": machine.git_commit(), "command": "python " + " ".join(sys.argv),
              "machine": machine.machine_info(device),
              "options": {k: str(v) if v == float("inf") else v for k, v in dataclasses.asdict(options).items()},
              "layers": model.config.num_hidden_layers, "first_step_s": round(first, 3), "runs": []}
    for name in args.stagings:
        _set_staging(*STAGINGS[name])
        seconds, loss, grads = _timed(step, model, ids)
        same = loss == reference[0] and all(torch.equal(a, b) for a, b in zip(grads, reference[1], strict=True))
        report["runs"].append({"staging": name, "step_s": round(seconds, 3), "loss": loss,
                               "bitwise_equal_to_union": same})
        print(f"{name:16s} {seconds:8.2f} s  loss {loss:.6f}  bitwise equal to the union: {same}", flush=True)
        out.write_text(json.dumps(report, indent=2, default=str))
    _set_staging(False, False)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
