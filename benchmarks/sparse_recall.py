"""Recall of dense attention mass by each sparse selection rule, per layer and KV head, on a real model.

    python benchmarks/sparse_recall.py --seq-len 8192 --out benchmarks/results/sparse_recall_smollm2_8k.json

Records SmolLM2-135M's queries and keys on real English text (oomb/real_model.py), then measures for
each arm (score rule x pooling x budget, and the oracle at the same budget) the mean
attention mass the selection keeps (oomb/tools/sparse_recall.py). Prints a summary table and writes every
layer's and KV head's recall to JSON. Selection runs through oomb/sparse.py itself.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from oomb.real_model import english_text, smollm2_dir, with_yarn
from oomb.sparse import SparseOptions
from oomb.tools.calibrate import pages_read
from oomb.tools.sparse_recall import layer_recall, page_mass, record_attention_inputs


def history_read(T: int, chunk: int, page: int, options: SparseOptions, layers: int) -> float:
    dense = SparseOptions(0, 0, options.score, options.selection, False, dense_layers=frozenset({0}))
    read = sum(pages_read(T, chunk, page, options, layer) for layer in range(layers))
    return read / (layers * pages_read(T, chunk, page, dense, 0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--arms", nargs="+", default=["minmax/max", "mean/max", "minmax/softmax", "mean/softmax",
                                                       "oracle"])
    parser.add_argument("--leak-free", action="store_true")
    parser.add_argument("--query-block-pages", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--yarn", type=float, default=None, help="YaRN factor for RoPE (e.g. 4: 8K -> 32K)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = with_yarn(AutoConfig.from_pretrained(path), args.yarn)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval().to(args.device)
    ids = torch.tensor(tokenizer(english_text())["input_ids"][: args.seq_len])[None].to(args.device)
    start = time.perf_counter()
    with torch.no_grad(), record_attention_inputs(model) as recorded:
        loss = float(model(input_ids=ids, labels=ids).loss)
    print(f"forward {time.perf_counter() - start:.1f} s, loss {loss:.4f}", flush=True)
    L = model.config.num_hidden_layers
    masses = {layer: page_mass(recorded[layer], args.page_size) for layer in range(L)}
    print(f"page masses {time.perf_counter() - start:.1f} s", flush=True)

    results = []
    for arm, budget in itertools.product(args.arms, args.budgets):
        score, pooling = ("minmax", "max") if arm == "oracle" else arm.split("/")
        options = SparseOptions(budget, 1, score, "kv_head", args.leak_free, args.query_block_pages,
                                pooling=pooling)
        rule = "oracle" if arm == "oracle" else "score"
        per_layer = [layer_recall(recorded[layer], masses[layer], args.chunk_size, args.page_size, options, rule,
                                  layer).tolist() for layer in range(L)]
        mean = sum(sum(r) / len(r) for r in per_layer) / L
        layer_means = [sum(r) / len(r) for r in per_layer]
        worst = min(min(r) for r in per_layer)
        results.append({"arm": arm, "budget": budget, "mean_recall": mean,
                        "worst_layer": int(min(range(L), key=layer_means.__getitem__)),
                        "worst_layer_recall": min(layer_means),
                        "worst_head_recall": worst, "per_layer_head": per_layer,
                        "history_read": history_read(ids.shape[1], args.chunk_size, args.page_size, options, L)})
        print(f"{arm:>16} k={budget:<3} recall mean {mean:.4f}  worst layer {min(layer_means):.4f} "
              f"(layer {results[-1]['worst_layer']})  worst head {worst:.4f}  "
              f"read {100 * results[-1]['history_read']:.1f}%", flush=True)
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        report = {"date": date.today().isoformat(), "command": "python " + " ".join(sys.argv),
                  "machine": f"{platform.machine()}, torch {torch.__version__}, "
                             f"transformers {transformers.__version__}",
                  "commit": commit, "model": str(path.name), "tokens": ids.shape[1], "dense_loss": loss,
                  "chunk_size": args.chunk_size, "page_size": args.page_size, "leak_free": args.leak_free,
                  "query_block_pages": args.query_block_pages, "results": results}
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
