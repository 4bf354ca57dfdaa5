"""How many queries of a block an exact page score needs: `oomb gradcheck`'s measurement with the exact
score (max pooling) computed from every ``stride``-th query of each block only (oomb/sparse.py
exact_block_scores(row_stride=)), so that a fused scoring kernel could score a few rows per block; with
``--score rerank`` the default score's exact stage over its candidates (rerank_block_scores(row_stride=)),
whose cost grows with the rows it scores.

    python benchmarks/sparse_exact_rows.py --strides 8 64 --out result.json    # SmolLM2, 8K, budget 15
    python benchmarks/sparse_exact_rows.py --score rerank --strides 1 2 4 --out result.json

Prints gradcheck's table per stride and writes one JSON (gradcheck's report per stride)."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import oomb.sparse  # noqa: E402
from oomb.tools.gradcheck import GradcheckOptions, format_report, run_gradcheck  # noqa: E402

SCORERS = {"exact": "exact_block_scores", "rerank": "rerank_block_scores"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strides", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--text", default="python-docs")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--budget", type=int, default=15)
    parser.add_argument("--score", choices=sorted(SCORERS), default="exact")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    options = GradcheckOptions(model=args.model, text=args.text, seq_len=args.seq_len, chunk_size=args.chunk_size,
                               page_size=args.page_size, budgets=[args.budget], scores=[args.score], poolings=["max"],
                               hf="off")
    reports = {}
    name = SCORERS[args.score]
    scorer = getattr(oomb.sparse, name)
    for stride in args.strides:
        setattr(oomb.sparse, name, functools.partial(scorer, row_stride=stride))
        try:
            report = run_gradcheck(options)
        finally:
            setattr(oomb.sparse, name, scorer)
        report["row_stride"] = stride
        report["command"] = "python benchmarks/sparse_exact_rows.py " + " ".join(sys.argv[1:])
        print(f"every {stride}-th query of a block:")
        print(format_report(report))
        reports[str(stride)] = report
    if args.out:
        Path(args.out).write_text(json.dumps({"command": "python benchmarks/sparse_exact_rows.py "
                                              + " ".join(sys.argv[1:]), "by_stride": reports}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
