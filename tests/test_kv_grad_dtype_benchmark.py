"""benchmarks/kv_grad_dtype.py on the CPU: the tiny random preset, every arm in float32, so the arms that
round nothing must equal the reference and only bf16 page gradients may differ from it."""

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny-qwen2", "--chunk-size", "128", "--page-size", "32", "--device", "cpu", "--dtype", "float32"]


@pytest.fixture()
def script():
    return load_script("benchmarks/kv_grad_dtype.py")


def test_float32_arms_equal_the_reference_and_bf16_pages_do_not(script, tmp_path, capsys):
    out = tmp_path / "kv.json"
    assert script.main([*TINY, "--data", "python-stdlib", "--seq-len", "512", "1K", "--repeat-reference",
                        "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "kv_grad_dtype" and report["command"].startswith("python benchmarks/kv_grad_dtype.py")
    assert report["backends"] == {"reference": "torch", "oomb": "torch"} and report["dtype"] == "float32"
    assert report["versions"]["torch"] == torch.__version__ and "standard library" in report["sequence"]
    assert [(e["seq_len"], e["chunks"], e["pages"]) for e in report["lengths"]] == [(512, 4, 16), (1024, 8, 32)]
    for entry in report["lengths"]:
        assert entry["reference"]["grad_norm"] > 0 and entry["reference"]["seconds"] > 0
        assert entry["reference_repeat"]["rel_err"] == 0  # the torch backend on the CPU is deterministic
        arms = entry["arms"]
        assert list(arms) == list(script.ARMS)
        assert arms["kv_float32"]["rel_err"] < 1e-5 and arms["hf"]["rel_err"] < 1e-5
        assert arms["hf"]["loss_variant"] == "full" and arms["hf"]["error"] is None
        assert 0 < arms["kv_bfloat16"]["rel_err"] < 1e-2  # bf16 page gradients are the only rounding left
        assert set(arms["kv_bfloat16"]["groups"]) == {"layer 0", "layer 1", "other"}
        for name in ("kv_float32", "kv_bfloat16"):
            assert arms[name]["kv_grad_dtype"] == name.removeprefix("kv_")
            assert math.isclose(arms[name]["ratio_to_hf"], arms[name]["rel_err"] / arms["hf"]["rel_err"])
            assert abs(arms[name]["loss_gap"]) < 1e-5 and arms[name]["seconds"] > 0
        assert arms["hf"]["ratio_to_hf"] is None
    printed = capsys.readouterr().out
    assert "kv_bfloat16" in printed and f"wrote {out}" in printed


@pytest.mark.parametrize("chunked_fits", [True, False])
def test_hf_out_of_memory_falls_back_to_the_chunked_loss_or_records_why(script, tmp_path, monkeypatch, chunked_fits):
    def out_of_memory(model, ids):
        def step():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 GiB")
        return step

    monkeypatch.setattr(script, "_hf_full_step", out_of_memory)
    if not chunked_fits:
        monkeypatch.setattr(script, "_hf_chunked_step", out_of_memory)
    out = tmp_path / "kv.json"
    script.main([*TINY, "--data", "random", "--seq-len", "256", "--no-warmup", "--out", str(out)])
    arms = json.loads(out.read_text())["lengths"][0]["arms"]
    assert "full loss: out of memory (CUDA out of memory. Tried to allocate 24.00 GiB)" in arms["hf"]["error"]
    if chunked_fits:
        assert arms["hf"]["loss_variant"] == "chunked" and arms["hf"]["rel_err"] < 1e-5
    else:
        assert arms["hf"]["loss_variant"] is None and arms["hf"]["rel_err"] is None
        assert "chunked loss: out of memory" in arms["hf"]["error"]
        assert arms["kv_bfloat16"]["ratio_to_hf"] is None and arms["kv_bfloat16"]["rel_err"] > 0
