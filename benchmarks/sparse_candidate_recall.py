"""Does rerank's candidate step hold the oracle's pages when candidates are a small share of the
history? Per layer, for the last chunk of a long real sequence: how many of the pages the exact score
(the oracle, max pooling) selects are among minmax's top factor x budget candidates, and how many the
rerank and minmax selections share with the oracle's.

    python benchmarks/sparse_candidate_recall.py --seq-len 32768 --yarn 4 --budgets 16 32 --out result.json

SmolLM2-135M (oomb/real_model.py), the first --seq-len tokens of Python's help topics, queries and keys
recorded from one forward (oomb/tools/sparse_recall.py), chunk 1024, page 64, one sink; the scores are
oomb/sparse.py's own (block_scores, exact_block_scores, rerank_block_scores) on the last chunk only, so
the run stays cheap on a CPU. Overlaps are means over the chunk's query blocks and KV heads of
|A & B| / |oracle's selection| (sinks excluded). Prints a line per layer, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
from dataclasses import replace
from datetime import date
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from oomb.kv import ChunkSpan
from oomb.kv.summaries import summarize_pages
from oomb.real_model import english_text, smollm2_dir, with_yarn
from oomb.sparse import (
    SparseOptions,
    block_scores,
    candidate_options,
    exact_block_scores,
    rerank_block_scores,
    top_pages,
)
from oomb.tools.sparse_recall import record_attention_inputs


def share(selected: torch.Tensor, reference: torch.Tensor, sinks: int) -> float:
    """Mean fraction of ``reference``'s non-sink pages that ``selected`` also holds."""
    ref = reference[..., sinks:]
    hits = (ref[..., :, None] == selected[..., None, :]).any(-1).float()
    return hits.mean().item()


BIG = 1e30  # above every score: pages forced into the candidates


def _forced(scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """``scores`` with the pages of ``chosen`` (B, Hkv, n_blocks, m page positions) lifted above all others."""
    return scores.scatter_add(-1, chosen.long(), torch.full(chosen.shape, BIG, dtype=scores.dtype))


def _half_minmax_then(other: torch.Tensor, minmax: torch.Tensor, options: SparseOptions) -> torch.Tensor:
    """Half the candidates by minmax (the sinks besides), the rest by ``other``'s ranking."""
    half = top_pages(minmax, replace(options, budget=options.rerank_factor * options.budget // 2))
    return _forced(other, half)


def _local_then_minmax(minmax: torch.Tensor, pages: int) -> torch.Tensor:
    """The ``pages`` history pages just before the chunk, then minmax's ranking."""
    n_hist = minmax.shape[-1]
    local = torch.arange(max(0, n_hist - pages), n_hist).expand(*minmax.shape[:-1], -1)
    return _forced(minmax, local)


VARIANTS = {
    # the same candidate count (factor x budget): which pages minmax misses could a cheap rule catch?
    "minmax_mean": lambda mm, q, s, P, o, scale: _half_minmax_then(
        block_scores(q, s, P, replace(o, score="mean"), scale), mm, o),
    "local8_minmax": lambda mm, q, s, P, o, scale: _local_then_minmax(mm, 8),
    "mean": lambda mm, q, s, P, o, scale: block_scores(q, s, P, replace(o, score="mean"), scale),
    # twice the candidates (twice rerank's cost): the recall a larger factor buys
    "minmax_x2": lambda mm, q, s, P, o, scale: mm,
}
FACTOR_TIMES = {"minmax_x2": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--yarn", type=float, default=None, help="extend RoPE with YaRN by this factor")
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--factor", type=int, default=4, help="rerank: candidates / budget")
    parser.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS),
                        help="other candidate rules to measure at the same candidate count (oracle's pages held)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    P, C, sinks = 64, 1024, 1
    path = smollm2_dir()
    config = with_yarn(AutoConfig.from_pretrained(path), args.yarn)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(path)(english_text(), return_tensors="pt").input_ids[:, :args.seq_len]
    T = ids.shape[1] // C * C
    ids = ids[:, :T]
    with record_attention_inputs(model) as recorded, torch.no_grad():
        model(ids)
    start = T - C
    n_hist = start // P
    chunk = ChunkSpan(0, start, T)
    per_layer = []
    for layer in range(model.config.num_hidden_layers):
        inputs = recorded[layer]
        q, k = inputs.q[:, :, start:], inputs.k  # (1, Hq, C, D), (1, Hkv, T, D)
        Hkv, D = k.shape[1], k.shape[3]
        pool = k[0].reshape(Hkv, T // P, P, D).transpose(0, 1).contiguous()  # (pages, Hkv, P, D), page id = position
        table = torch.arange(T // P, dtype=torch.int32)[None]
        store = SimpleNamespace(page_size=P, page_table=table, layers=[SimpleNamespace(k=pool)])
        summaries = summarize_pages(pool[None, :n_hist], P, ("key_min", "key_max", "key_mean"))
        row = {"layer": layer}
        for budget in args.budgets:
            options = SparseOptions(budget, sinks, "rerank", "kv_head", False, rerank_factor=args.factor)
            oracle = top_pages(exact_block_scores(q, store, 0, chunk, options, inputs.scale), options)
            minmax_options = replace(options, score="minmax")
            minmax_scores = block_scores(q, summaries, P, minmax_options, inputs.scale)
            candidates = top_pages(minmax_scores, candidate_options(options, layer))
            rerank = top_pages(rerank_block_scores(q, pool, table, chunk, candidates, options, inputs.scale), options)
            minmax = top_pages(minmax_scores, minmax_options)
            row[str(budget)] = {"oracle_in_candidates": share(candidates, oracle, sinks),
                                "rerank_vs_oracle": share(rerank, oracle, sinks),
                                "minmax_vs_oracle": share(minmax, oracle, sinks)}
            for name in args.variants:
                scores = VARIANTS[name](minmax_scores, q, summaries, P, options, inputs.scale)
                more = replace(options, rerank_factor=options.rerank_factor * FACTOR_TIMES.get(name, 1))
                held = top_pages(scores, candidate_options(more, layer))
                row[str(budget)][f"oracle_in_{name}"] = share(held, oracle, sinks)
        per_layer.append(row)
        print(layer, {b: {k: round(v, 3) for k, v in row[str(b)].items()} for b in args.budgets}, flush=True)
    mean = {str(b): {key: sum(r[str(b)][key] for r in per_layer) / len(per_layer)
                     for key in per_layer[0][str(b)]} for b in args.budgets}
    print("mean", mean)
    report = {"date": date.today().isoformat(), "machine": f"{platform.machine()}, torch {torch.__version__}",
              "command": "python benchmarks/sparse_candidate_recall.py " + " ".join(
                  f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                  for k, v in vars(args).items() if v is not None),
              "model": str(path), "tokens": T, "last_chunk_history_pages": n_hist, "chunk_size": C, "page_size": P,
              "sink_pages": sinks, "rerank_factor": args.factor, "yarn": args.yarn, "mean": mean, "layers": per_layer}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
