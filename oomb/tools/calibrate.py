"""`oomb calibrate`: a sparse plan for your model from a sample of your data.

    oomb calibrate --model path/to/model --data sample.txt --seq-len 32K --max-read 0.25 --out plan.yaml
    oomb train config.yaml --set oomb.sparse_plan=plan.yaml        # or OOMBConfig.from_dict({"sparse_plan": ...})

A few layers of a pretrained model attend diffusely and need many pages (or all of them); most need
few (DuoAttention, MoA). One forward over the sample records every layer's queries and keys; for
each layer and candidate budget, oomb/tools/sparse_recall.py measures the dense attention mass the
selection keeps (its recall). Budgets are then handed out greedily, always to the layer whose next
step buys the most recall per page read, until the history read reaches ``max_read``; a layer
whose best step is "all pages" becomes a dense layer. The plan (per-layer budgets and dense layers,
plus the score options it was measured with) is written as YAML that OOMBConfig and `oomb train`
accept, and the per-layer table is printed.

Recall is measured at the sample's length: the same budget in pages reads a smaller share of a
longer history, so calibrate at (or near) the training length.
"""

from __future__ import annotations

import argparse
import heapq
import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from ..cli_options import REAL_MODEL, add_option, parse_share
from ..config import SPARSE_POOLINGS, SPARSE_SCORES, SparseConfig, SparseResearch
from .gradcheck import REAL_CODE, REAL_TEXT, GradcheckOptions, load_sequence
from .plan import parse_tokens
from .sparse_recall import layer_recall, page_mass, record_attention_inputs

logger = logging.getLogger(__name__)

DEFAULT_GRID = (2, 4, 8, 16, 32, 64, 128)
DENSE = -1
"""A layer's budget step meaning "every history page"."""


@dataclass
class LayerCurve:
    """Recall of one layer at each budget of the grid (DENSE: 1.0) and the pages each reads."""

    budgets: list[int]
    recall: list[float]
    worst_head: list[float]
    pages_read: list[int]


def pages_read(num_tokens: int, chunk: int, page: int, options: SparseConfig, layer: int) -> int:
    """(query block, history page) pairs one layer reads over a sequence of num_tokens."""
    read = 0
    for start in range(0, num_tokens, chunk):
        n_hist, blocks = start // page, -(-min(chunk, num_tokens - start) // page)
        read += blocks * options.num_selected(n_hist, layer)
    return read


def recall_curves(model: torch.nn.Module, input_ids: torch.Tensor, chunk_size: int, page_size: int,
                  base: SparseConfig, grid: tuple[int, ...] = DEFAULT_GRID, progress: bool = True
                  ) -> list[LayerCurve]:
    """Every layer's recall at every budget of ``grid`` (and dense) on one sequence (batch 1)."""
    T = input_ids.shape[1]
    with torch.no_grad(), record_attention_inputs(model) as recorded:
        model(input_ids=input_ids)
    curves = []
    L = len(recorded)
    for layer in tqdm(range(L), desc="calibrate: layers", disable=not progress):
        start = time.perf_counter()
        inputs = recorded.pop(layer)
        mass = page_mass(inputs, page_size)
        budgets, recall, worst, read = [], [], [], []
        history_pages = (T - 1) // page_size
        for budget in grid:
            if budget >= history_pages:
                break
            options = replace(base, budget=budget)
            per_head = layer_recall(inputs, mass, chunk_size, page_size, options, "score")
            budgets.append(budget)
            recall.append(float(per_head.mean()))
            worst.append(float(per_head.min()))
            read.append(pages_read(T, chunk_size, page_size, options, 0))
        dense = SparseConfig(budget=0, sink_pages=0, score=base.score, dense_layers=(0,),
                             research=SparseResearch(selection=base.research.selection))
        budgets.append(DENSE)
        recall.append(1.0)
        worst.append(1.0)
        read.append(pages_read(T, chunk_size, page_size, dense, 0))
        curves.append(LayerCurve(budgets, recall, worst, read))
        del mass, inputs
        steps = " ".join(f"{b}:{r:.3f}" for b, r in zip(budgets, recall, strict=True))
        logger.info("layer %d: recall %s (%.1f s)", layer, steps, time.perf_counter() - start)
    return curves


def allocate(curves: list[LayerCurve], max_read: float) -> list[int]:
    """Index into each curve's budgets: greedy by recall gained per page, within ``max_read`` of the
    dense history (counting every layer, dense ones included)."""
    dense_total = sum(c.pages_read[-1] for c in curves)
    cap = max_read * dense_total
    choice = [0] * len(curves)
    spent = sum(c.pages_read[0] for c in curves)
    if spent > cap:
        raise ValueError(f"even the smallest budget reads {spent / dense_total:.1%} of the history, above "
                         f"max_read={max_read:.0%}: lower the grid's smallest budget or raise max_read")

    def best_step(i: int) -> tuple[float, int] | None:
        """(-gain per page, next index) of the step that buys layer i the most recall per page."""
        c, j = curves[i], choice[i]
        options = [((c.recall[k] - c.recall[j]) / max(c.pages_read[k] - c.pages_read[j], 1), k)
                   for k in range(j + 1, len(c.budgets))]
        if not options:
            return None
        gain, k = max(options)
        return -gain, k

    heap = [(step[0], i, step[1]) for i in range(len(curves)) if (step := best_step(i))]
    heapq.heapify(heap)
    while heap:
        _, i, k = heapq.heappop(heap)
        cost = curves[i].pages_read[k] - curves[i].pages_read[choice[i]]
        if spent + cost <= cap:
            spent += cost
            choice[i] = k
        else:  # this step does not fit: try a smaller one of the same layer
            fitting = [m for m in range(choice[i] + 1, k)
                       if spent + curves[i].pages_read[m] - curves[i].pages_read[choice[i]] <= cap]
            if not fitting:
                continue
            m = max(fitting, key=lambda m: curves[i].recall[m])
            spent += curves[i].pages_read[m] - curves[i].pages_read[choice[i]]
            choice[i] = m
        if (step := best_step(i)) is not None:
            heapq.heappush(heap, (step[0], i, step[1]))
    return choice


def make_plan(curves: list[LayerCurve], choice: list[int], base: SparseConfig, meta: dict) -> dict:
    """The YAML-able plan: OOMBConfig's sparse options plus the measurements behind them."""
    budgets = [c.budgets[j] for c, j in zip(curves, choice, strict=True)]
    dense_layers = [i for i, b in enumerate(budgets) if b == DENSE]
    sparse_budgets = [b for b in budgets if b != DENSE]
    fill = min(sparse_budgets) if sparse_budgets else 1
    layer_budgets = [fill if b == DENSE else b for b in budgets]
    read = sum(c.pages_read[j] for c, j in zip(curves, choice, strict=True)) / sum(c.pages_read[-1] for c in curves)
    recall = sum(c.recall[j] for c, j in zip(curves, choice, strict=True)) / len(curves)
    return {
        "oomb": {"attention": "sparse",
                 "sparse": {"budget": max(layer_budgets), "layer_budgets": layer_budgets, "dense_layers": dense_layers,
                            "sink_pages": base.sink_pages, "score": base.score, "leak_free": base.leak_free,
                            "query_block_pages": base.query_block_pages,
                            "research": {"pooling": base.research.pooling}}},
        "measured": {**meta, "history_read": read, "mean_recall": recall,
                     "layers": [{"layer": i, "budget": "dense" if b == DENSE else b, "recall": c.recall[j],
                                 "worst_head": c.worst_head[j],
                                 "curve": {("dense" if bb == DENSE else str(bb)): r
                                           for bb, r in zip(c.budgets, c.recall, strict=True)}}
                                for i, (c, j, b) in enumerate(zip(curves, choice, budgets, strict=True))]},
    }


def format_plan(plan: dict) -> str:
    m = plan["measured"]
    lines = [f"oomb calibrate: {m['model']}, {m['tokens']} tokens of {m['sequence']}, chunk {m['chunk_size']}, "
             f"page {m['page_size']}; history read {m['history_read']:.1%} (cap {m['max_read']:.0%}), "
             f"mean recall {m['mean_recall']:.4f}",
             f"{'layer':>5} | {'budget':>6} | {'recall':>7} | {'worst head':>10} | recall by budget"]
    for layer in m["layers"]:
        curve = " ".join(f"{b}:{r:.3f}" for b, r in layer["curve"].items())
        lines.append(f"{layer['layer']:>5} | {layer['budget']!s:>6} | {layer['recall']:>7.4f} | "
                     f"{layer['worst_head']:>10.4f} | {curve}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `oomb calibrate` (the model and data options are gradcheck's)."""
    add_option(parser, "--model", "--preset", default=REAL_MODEL,
               help=f"a local HF model directory, a preset (random weights) or {REAL_MODEL!r}")
    add_option(parser, "--data", "--text", dest="text", default=REAL_TEXT,
               help=f"a text file of your data, {REAL_TEXT!r} or {REAL_CODE!r} (as in oomb gradcheck)")
    add_option(parser, "--seq-len", "--context", type=parse_tokens, default=8192, help="tokens (e.g. 8192, 32K)")
    parser.add_argument("--chunk-size", type=parse_tokens, default=4096)
    parser.add_argument("--page-size", type=parse_tokens, default=128)
    parser.add_argument("--max-read", type=parse_share, default=0.25,
                        help="share of the history pages (all layers) the plan may read")
    add_option(parser, "--sparse-budget", "--grid", dest="grid", type=int, nargs="+", default=list(DEFAULT_GRID),
               help="candidate budgets (pages) to measure the recall of")
    add_option(parser, "--sparse-score", "--score", dest="score", choices=SPARSE_SCORES, default="minmax")
    add_option(parser, "--sparse-pooling", "--pooling", dest="pooling", choices=SPARSE_POOLINGS, default="max")
    add_option(parser, "--sparse-sink-pages", "--sink-pages", dest="sink_pages", type=int, default=1)
    add_option(parser, "--sparse-leak-free", "--leak-free", dest="leak_free", action="store_true",
               help="score blocks with earlier queries only")
    parser.add_argument("--yarn", type=float, default=None, help="YaRN factor for RoPE (e.g. 4: 8K -> 32K)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="sparse_plan.yaml", help="where to write the plan (YAML; .json: JSON)")


def main(args: argparse.Namespace) -> int:
    if args.seq_len <= args.chunk_size:
        raise ValueError(f"--seq-len {args.seq_len} fits in one chunk of --chunk-size {args.chunk_size}: a sparse plan "
                         f"chooses among earlier chunks' pages, so give at least two chunks (e.g. --seq-len "
                         f"{4 * args.chunk_size} or a smaller --chunk-size)")
    options = GradcheckOptions(model=args.model, text=args.text, seq_len=args.seq_len, chunk_size=args.chunk_size,
                               page_size=args.page_size, dtype=args.dtype, device=args.device, yarn=args.yarn)
    model, ids, model_text, source = load_sequence(options)
    model.set_attn_implementation("sdpa")
    base = SparseConfig(budget=0, sink_pages=args.sink_pages, score=args.score, leak_free=args.leak_free,
                        dense_layers=(), research=SparseResearch(pooling=args.pooling))
    curves = recall_curves(model, ids, args.chunk_size, args.page_size, base, tuple(sorted(set(args.grid))))
    choice = allocate(curves, args.max_read)
    meta = {"model": model_text, "sequence": source, "tokens": ids.shape[1], "chunk_size": args.chunk_size,
            "page_size": args.page_size, "max_read": args.max_read}
    plan = make_plan(curves, choice, base, meta)
    print(format_plan(plan))
    out = Path(args.out)
    out.write_text(json.dumps(plan, indent=1) if out.suffix == ".json" else yaml.safe_dump(plan, sort_keys=False))
    print(f"wrote {out}")
    return 0
