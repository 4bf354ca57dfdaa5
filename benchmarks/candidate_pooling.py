"""How rerank's candidates are pooled over a block's rows: `oomb gradcheck`'s measurement with the candidate
scores (minmax's half, then the mean key's best: oomb/sparse.py propose_candidates) pooled by ``softmax_max``
(each row's summary scores normalised by their log-sum-exp over the history pages before the max over rows)
instead of ``max`` (the raw scores' maximum, the default). A row with large logits everywhere then no longer
decides the candidates alone. The results of real-model-gradients-8k-candidate-pooling came from this script
(at bfdd3da it patched the candidates itself); it now runs OOMBConfig.sparse_candidate_pooling, the same code,
one gradcheck per pooling. `oomb gradcheck --candidate-poolings max softmax_max` runs both as arms of one.

    python benchmarks/candidate_pooling.py --text python-docs --page-size 32 --budget 31 --out result.json

Prints gradcheck's table per pooling and writes one JSON (gradcheck's report per pooling)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from oomb.tools.gradcheck import GradcheckOptions, format_report, run_gradcheck  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--poolings", nargs="+", choices=["max", "softmax_max"], default=["softmax_max"])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--text", default="python-docs")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--budget", type=int, default=15)
    parser.add_argument("--rerank-factor", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    command = "python benchmarks/candidate_pooling.py " + " ".join(sys.argv[1:])
    reports = {}
    for pooling in args.poolings:
        options = GradcheckOptions(model=args.model, text=args.text, seq_len=args.seq_len,
                                   chunk_size=args.chunk_size, page_size=args.page_size, budgets=[args.budget],
                                   scores=["rerank"], poolings=["max"], rerank_factors=[args.rerank_factor],
                                   rerank_candidates=["minmax_mean"], candidate_poolings=[pooling], hf="off")
        report = run_gradcheck(options)
        report["candidate_pooling"], report["command"] = pooling, command
        print(f"candidates pooled by {pooling}:")
        print(format_report(report))
        reports[pooling] = report
    if args.out:
        Path(args.out).write_text(json.dumps({"command": command, "by_pooling": reports}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
