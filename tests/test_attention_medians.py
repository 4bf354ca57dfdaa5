"""benchmarks/attention_medians.py: medians of repeated attention.py runs and of their paired ratios to cuDNN."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_medians import medians  # noqa: E402


def _run(fwd: float, cudnn: float, fb: float = 300.0, cudnn_fb: float = 500.0) -> dict:
    row = {"ours_fwd_tflops": fwd, "cudnn_fwd_tflops": cudnn,
           "ours_fwd_bwd_tflops": fb, "cudnn_fwd_bwd_tflops": cudnn_fb}
    return {"commit": "abc", "gpu": "test", "results": [{"history": 32768, **row}, {"history": 131072, **row}]}


def test_ratios_are_paired_within_a_run_then_the_median_is_taken():
    # paired ratios 0.9, 0.8, 0.85 -> median 0.85; the ratio of the medians (500 / 600) would be 0.833
    rows = medians([_run(540, 600), _run(480, 600), _run(500, 588.2352941176471)])
    assert [row["history"] for row in rows] == [32768, 131072]
    assert rows[0]["runs"] == 3 and rows[0]["median_ours_fwd_tflops"] == 500
    assert rows[0]["fwd_ratios"] == pytest.approx([0.9, 0.8, 0.85])
    assert rows[0]["median_fwd_ratio"] == pytest.approx(0.85)
    assert rows[0]["median_fwd_bwd_ratio"] == pytest.approx(0.6)


def test_runs_without_cudnn_are_refused():
    report = _run(500, 600)
    del report["results"][0]["cudnn_fwd_tflops"]
    with pytest.raises(ValueError, match="cudnn_fwd_tflops"):
        medians([report])


def test_the_command_writes_its_report(tmp_path):
    paths = []
    for i, fwd in enumerate((510, 490, 500)):
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(_run(fwd, 600)))
        paths.append(str(path))
    out = tmp_path / "medians.json"
    script = ROOT / "benchmarks" / "attention_medians.py"
    done = subprocess.run([sys.executable, str(script), *paths, "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["runs"] == paths and report["commits"] == ["abc"]
    assert report["results"][1]["median_ours_fwd_tflops"] == 500
