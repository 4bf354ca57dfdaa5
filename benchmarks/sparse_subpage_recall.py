"""Does a finer key bound pick better pages? Attention-mass recall of the minmax score computed per
page vs per sub-page (the page's score = its best sub-page's), against the oracle, per layer.

    python benchmarks/sparse_subpage_recall.py --out sparse_subpage_recall.json

SmolLM2-135M (oomb/real_model.py), the first --seq-len tokens of Python's help topics, chunk 1024,
page 64, budget --budget pages per query block plus one sink; recall as oomb/tools/sparse_recall.py
defines it (mean over the queries of chunks >= 1 of the dense attention mass on what the block reads).
Sub-page bounds cost sub x the page summaries and the scoring work. Prints a line per layer, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import date
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from oomb.kv.summaries import summarize_pages
from oomb.real_model import english_text, smollm2_dir
from oomb.sparse import SparseOptions, block_scores, selection_from_scores
from oomb.tools.sparse_recall import kept_mass, oracle_selection, page_mass, record_attention_inputs


def bounds(k: torch.Tensor, size: int, count: int) -> dict[str, torch.Tensor]:
    """minmax summaries (1, count, Hkv, D) of the first count groups of ``size`` keys of k (1, Hkv, T, D)."""
    _, Hkv, _, D = k.shape
    groups = k[:, :, :count * size].reshape(1, Hkv, count, size, D).permute(0, 2, 1, 3, 4)
    return summarize_pages(groups, size, ("key_min", "key_max"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--subs", type=int, nargs="+", default=[16, 32], help="sub-page sizes (keys)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    P, C = 64, 1024
    path = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(path)(english_text(), return_tensors="pt").input_ids[:, :args.seq_len]
    with record_attention_inputs(model) as recorded, torch.no_grad():
        model(ids)
    options = SparseOptions(args.budget, 1, "minmax", "kv_head", False)
    arms = ["page"] + [f"sub{s}" for s in args.subs] + ["oracle"]
    per_layer = []
    for layer in range(model.config.num_hidden_layers):
        inputs = recorded[layer]
        q, k = inputs.q, inputs.k
        mass = page_mass(inputs, P)
        Hkv = k.shape[1]
        kept = dict.fromkeys(arms, 0.0)
        count = 0
        for start in range(C, q.shape[2], C):
            n_hist = start // P
            if options.num_selected(n_hist) >= n_hist:
                continue
            q_chunk = q[:, :, start:start + C]
            length = q_chunk.shape[2]
            selections = {"page": selection_from_scores(
                block_scores(q_chunk, bounds(k, P, n_hist), P, options, inputs.scale), options)}
            for sub in args.subs:
                scores = block_scores(q_chunk, bounds(k, sub, n_hist * (P // sub)), P, options, inputs.scale)
                selections[f"sub{sub}"] = selection_from_scores(
                    scores.reshape(*scores.shape[:3], n_hist, P // sub).amax(-1), options)
            selections["oracle"] = oracle_selection(mass, start, length, P, Hkv, options)
            for arm, selection in selections.items():
                kept[arm] += float(kept_mass(mass, selection, start, length, P, Hkv).sum())
            count += q.shape[1] * length
        per_layer.append({arm: kept[arm] / count for arm in arms})
        print(layer, {arm: round(v, 4) for arm, v in per_layer[-1].items()}, flush=True)
    mean = {arm: sum(row[arm] for row in per_layer) / len(per_layer) for arm in arms}
    print("mean", {arm: round(v, 4) for arm, v in mean.items()})
    report = {"date": date.today().isoformat(), "machine": f"{platform.machine()}, torch {torch.__version__}",
              "command": "python benchmarks/sparse_subpage_recall.py " + " ".join(
                  f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                  for k, v in vars(args).items()),
              "model": str(path), "tokens": int(ids.shape[1]), "chunk_size": C, "page_size": P,
              "budget": args.budget, "sink_pages": 1, "mean": mean, "layers": per_layer}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
