"""benchmarks/shared_context.py on the CPU: the tiny random preset, every arm, all sequences measured, so the
shared rows and the separate rows describe the same sequences (equal-length continuations: the shared mean over
every row's labels is the mean of the rows' own losses)."""

import json
from pathlib import Path

import pytest
import torch
from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--preset", "tiny-qwen2", "--device", "cpu", "--context", "1536", "--continuation-tokens", "100",
        "--continuations", "2", "1", "--set", "chunk_size=512", "--set", "page_size=32"]


@pytest.fixture()
def script():
    return load_script("benchmarks/shared_context.py")


def test_every_arm_runs_and_the_shared_loss_is_the_mean_of_the_sequences(script, tmp_path, capsys):
    report = script.main([*TINY, "--arms", "shared", "separate", "hf", "--separate-all", "--out-dir", str(tmp_path),
                          "--name", "sc.json"])
    assert json.loads((tmp_path / "sc.json").read_text()) == report and report["complete"] is True
    assert report["command"].startswith("python benchmarks/shared_context.py")
    assert report["versions"]["torch"] == torch.__version__ and report["plan"]["chosen"]
    workload = report["workload"]
    assert workload["continuations"] == [1, 2] and workload["sequence_tokens"] == 1636
    assert (workload["trunk_tokens"], workload["tail_tokens"]) == (1024, 512)
    assert report["warmup"]["context_tokens"] == 1024  # one trunk chunk and the real tail
    rows = {(r["arm"], r["continuations"]): r for r in report["rows"]}
    assert set(rows) == {(arm, k) for arm in ("shared", "separate", "hf") for k in (1, 2)}
    assert all(r["status"] == "ok" for r in rows.values())
    for k in (1, 2):
        shared, separate, hf = rows["shared", k], rows["separate", k], rows["hf", k]
        assert shared["seconds"] > 0 and shared["host_peak_gib"] > 0
        assert separate["measured_sequences"] == k and len(separate["sequence_seconds"]) == k
        assert separate["seconds"] == pytest.approx(sum(separate["sequence_seconds"]), abs=2e-3)
        assert abs(shared["loss"] - separate["loss"]) < 1e-3
        assert hf["measured_sequences"] == 1
    assert rows["hf", 1]["seconds"] > 0 and rows["hf", 2]["hf_total_estimated_s"] > 0 and "seconds" not in rows["hf", 2]
    ratios = {r["continuations"]: r for r in report["ratios"]}
    assert ratios[2]["shared_over_separate_basis"] == "measured" and ratios[2]["shared_over_separate"] > 0
    assert ratios[2]["shared_over_hf_basis"].startswith("2 x the mean of 1 measured sequence")
    assert f"wrote {tmp_path / 'sc.json'}" in capsys.readouterr().out


def test_one_separate_sequence_gives_an_estimate_and_out_of_memory_is_a_result(script, tmp_path, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 GiB")

    monkeypatch.setattr(script, "hf_sequence", out_of_memory)
    report = script.main([*TINY, "--arms", "shared", "separate", "hf", "--out-dir", str(tmp_path)])
    rows = {(r["arm"], r["continuations"]): r for r in report["rows"]}
    separate = rows["separate", 2]
    assert separate["measured_sequences"] == 1 and "seconds" not in separate
    assert separate["separate_total_estimated_s"] == pytest.approx(2 * separate["sequence_seconds"][0], abs=2e-3)
    assert rows["separate", 1]["seconds"] == separate["sequence_seconds"][0]  # K = 1: measured
    assert report["warmup"]["hf"] == {"status": "out of memory"}
    assert all(rows["hf", k]["status"] == "out of memory" for k in (1, 2))
    assert {r["continuations"]: r["shared_over_hf"] for r in report["ratios"]} == {1: None, 2: None}


def test_a_run_cut_short_keeps_what_it_measured(script, tmp_path, monkeypatch):
    """The results JSON is rewritten after each measurement: a run stopped in its second arm (a call's time
    limit) has the first arm's rows on disk, marked incomplete; arms run in the order given."""
    measured = script.measured

    def stopped_in_the_separate_arm(step, *args, **kwargs):
        if len(calls) == 2:  # the separate sequence and the first shared count measured, then the second
            raise KeyboardInterrupt
        calls.append(step)
        return measured(step, *args, **kwargs)

    calls: list = []
    monkeypatch.setattr(script, "measured", stopped_in_the_separate_arm)
    with pytest.raises(KeyboardInterrupt):
        script.main([*TINY, "--arms", "separate", "shared", "--out-dir", str(tmp_path), "--name", "cut.json"])
    saved = json.loads((tmp_path / "cut.json").read_text())
    assert saved["complete"] is False
    assert [(r["arm"], r["continuations"], r["status"]) for r in saved["rows"]] == [
        ("separate", 1, "ok"), ("separate", 2, "ok"), ("shared", 1, "ok")]
    assert all((r.get("seconds") or r["separate_total_estimated_s"]) > 0 for r in saved["rows"])
    ratios = {r["continuations"]: r["shared_over_separate"] for r in saved["ratios"]}
    assert ratios[1] > 0 and ratios[2] is None  # K = 2's shared call was not measured
