"""Medians over repeated runs of benchmarks/attention.py: our kernels' TFLOP/s and their ratio to cuDNN's.

One run of attention.py times our kernels and cuDNN's in the same process, so each run gives a paired ratio;
runs of the same code in one call differ by 2-3 % (attention-noise-h100), so a ratio is judged by its median
over several runs, not by one.

    python benchmarks/attention_medians.py RUN1.json RUN2.json ... --out medians.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

FIELDS = ("ours_fwd_tflops", "ours_fwd_bwd_tflops", "cudnn_fwd_tflops", "cudnn_fwd_bwd_tflops")


def medians(reports: list[dict]) -> list[dict]:
    """Per history: the median of each field and of the paired ratios ours / cuDNN (forward, forward+backward),
    with every run's ratios."""
    histories = sorted({row["history"] for report in reports for row in report["results"]})
    out = []
    for history in histories:
        rows = [row for report in reports for row in report["results"] if row["history"] == history]
        missing = [f for f in FIELDS if any(f not in row for row in rows)]
        if missing:
            raise ValueError(f"history {history}: runs without {missing} (attention.py times cuDNN on a GPU only)")
        entry = {"history": history, "runs": len(rows)}
        entry.update({f"median_{f}": statistics.median(row[f] for row in rows) for f in FIELDS})
        for kind in ("fwd", "fwd_bwd"):
            ratios = [row[f"ours_{kind}_tflops"] / row[f"cudnn_{kind}_tflops"] for row in rows]
            entry[f"{kind}_ratios"] = ratios
            entry[f"median_{kind}_ratio"] = statistics.median(ratios)
        out.append(entry)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="attention.py JSON reports")
    parser.add_argument("--out", help="write the medians here")
    args = parser.parse_args()
    reports = [json.loads(Path(path).read_text()) for path in args.runs]
    rows = medians(reports)
    for row in rows:
        print(f"history {row['history']:>7}: {row['runs']} runs; forward {row['median_ours_fwd_tflops']:.1f} TFLOP/s, "
              f"{row['median_fwd_ratio']:.3f} of cuDNN (runs {', '.join(f'{r:.3f}' for r in row['fwd_ratios'])}); "
              f"forward+backward {row['median_ours_fwd_bwd_tflops']:.1f}, {row['median_fwd_bwd_ratio']:.3f} of cuDNN")
    if args.out:
        report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": "python " + " ".join(sys.argv),
                  "commits": sorted({str(r.get("commit")) for r in reports}),
                  "devices": sorted({str(r.get("gpu") or r.get("device")) for r in reports}),
                  "runs": args.runs, "results": rows}
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
