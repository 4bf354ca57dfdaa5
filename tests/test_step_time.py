"""Predicted step times: the executed FLOPs over a rate measured on the same kind of GPU."""

from __future__ import annotations

import pytest

from oomb.config import OffloadConfig, OOMBConfig, PerformanceConfig, SparseConfig
from oomb.planning.choose import NoConfigFitsError, Resources, Workload, choose_config, relative_time
from oomb.planning.model_shape import ModelShape
from oomb.planning.step_time import RATES, format_duration, gpu_kind, predict_step_time

QWEN_7B = ModelShape(num_layers=28, hidden_size=3584, intermediate_size=18944, num_heads=28, num_kv_heads=4,
                     head_dim=128, vocab_size=152064, attention_bias=True)
H100 = "NVIDIA H100 80GB HBM3"


def test_the_measured_runs_are_predicted_back():
    dense = predict_step_time(QWEN_7B, 131072, OOMBConfig(performance=PerformanceConfig(checkpoint_layers=False)),
                              gpu_name=H100)
    sparse = predict_step_time(QWEN_7B, 131072, OOMBConfig(attention="sparse", sparse=SparseConfig(read_share=None),
                                                           performance=PerformanceConfig(checkpoint_layers=False)),
                               gpu_name=H100)  # the measured run: the fixed budget of 64 pages
    assert dense.seconds == pytest.approx(43.46, rel=0.02) and sparse.seconds == pytest.approx(21.66, rel=0.02)
    assert "dense step on an H100" in dense.basis and "not measured" not in dense.basis
    # The 1M bench plan on an H100 (offload, 6 of 28 layers resident, bf16 page gradients): its own relative time
    # (1.10) is the measured plan's, not charged again on top of the rate it ran at.
    offload = OOMBConfig(attention="sparse", sparse=SparseConfig(read_share=None)).with_options({
        "offload.enabled": True, "offload.resident_layers": 6, "precision.kv_grad_dtype": "bfloat16",
        "performance.checkpoint_layers": False, "performance.recompute_logits": False})
    relative, _ = relative_time(offload, QWEN_7B.num_layers)
    measured = predict_step_time(QWEN_7B, 1 << 20, offload, gpu_name=H100, relative_time=relative)
    assert measured.seconds == pytest.approx(196.74, rel=0.02) and "sparse+offload step on an H100" in measured.basis
    more = predict_step_time(QWEN_7B, 1 << 20, offload, gpu_name=H100, relative_time=1.5 * relative)
    assert more.seconds == pytest.approx(1.5 * measured.seconds) and "x 1.50 for this plan's options" in more.basis


def test_a_longer_step_costs_its_flops_and_other_gpus_are_extrapolations():
    short = predict_step_time(QWEN_7B, 131072, OOMBConfig(), gpu_name="NVIDIA H200")
    long = predict_step_time(QWEN_7B, 1 << 20, OOMBConfig(), gpu_name="NVIDIA H200")
    assert long.seconds > 30 * short.seconds  # dense attention grows with the square of the context
    other = predict_step_time(QWEN_7B, 131072, OOMBConfig(), gpu_name="NVIDIA A100-SXM4-80GB")
    assert "is not measured" in other.basis and other.rate.gpu == "H100"
    offload = predict_step_time(QWEN_7B, 131072, OOMBConfig(offload=OffloadConfig(enabled=True)), gpu_name=H100)
    assert "no dense+offload step on an H100 is measured" in offload.basis
    assert predict_step_time(QWEN_7B, 131072, OOMBConfig(), gpu_name=None) is None
    assert gpu_kind(H100) == "H100" and gpu_kind("NVIDIA H200") == "H200" and gpu_kind("cpu") is None
    assert {r.gpu for r in RATES} == {"H100", "H200"}


def test_relative_time_scales_and_durations_read_well():
    one = predict_step_time(QWEN_7B, 131072, OOMBConfig(), gpu_name=H100)
    slower = predict_step_time(QWEN_7B, 131072, OOMBConfig(), gpu_name=H100, relative_time=1.5)
    assert slower.seconds == pytest.approx(1.5 * one.seconds) and "x 1.50" in slower.basis
    assert [format_duration(s) for s in (42, 210, 2000, 9000)] == ["42 s", "3.5 min", "33.3 min", "2.5 h"]


def test_the_plan_states_its_step_time_and_the_other_modes():
    workload = Workload(QWEN_7B, 1 << 20, lora_rank=16)
    resources = Resources("cuda", gpu_limit=74 * 2**30, host_limit=118 * 2**30, gpu_name=H100)
    choice = choose_config(workload, resources, {"attention": "sparse"})  # the defaults: 35 %, 5 of 28 layers whole
    # 47 % read, and rerank's 4 x 35 % candidates are every history key in stage 1: about two thirds of the time of
    # dense's own plan (0.67x: the sparse plan's options cost 1.56x, dense's 1.47x)
    assert choice.step_time is not None and choice.other_mode_time.seconds > 1.4 * choice.step_time.seconds
    text = choice.describe()
    assert "step time: ~" in text and "dense attention (its own plan): ~" in text
    assert "sparse reads 46.8 % of the history" in text
    fixed = choose_config(workload, resources, {"attention": "sparse", "sparse.read_share": None})
    assert fixed.other_mode_time.seconds > 5 * fixed.step_time.seconds
    # The other mode's time is its own plan's (here dense: other options than the sparse plan's), not this plan's
    # options priced for the other mode.
    dense = choose_config(workload, resources, {"attention": "dense", "sparse.read_share": None})
    assert fixed.other_mode_time.seconds == pytest.approx(dense.step_time.seconds)
    assert dense.other_mode_time.seconds == pytest.approx(fixed.step_time.seconds)
    assert "dense attention (its own plan): ~" in fixed.describe()
    # 60 GiB of host memory: dense fits, sparse at a fixed budget does not
    small = Resources("cuda", gpu_limit=74 * 2**30, host_limit=60 * 2**30, gpu_name=H100)
    with pytest.raises(NoConfigFitsError):
        choose_config(workload, small, {"attention": "sparse", "sparse.read_share": None})
    dense_only = choose_config(workload, small, {"attention": "dense", "sparse.read_share": None})
    assert dense_only.other_mode_time is None and "sparse attention: nothing fits" in dense_only.describe()
    assert "sparse reads 1.6 % of the history" in fixed.describe()
    cpu = choose_config(Workload(QWEN_7B, 8192, lora_rank=16), Resources("cpu", host_limit=2**40))
    assert cpu.step_time is None and "step time: ~" not in cpu.describe()


def test_oomb_plan_prints_step_times_for_the_named_gpu_and_the_longest_context_per_mode(capsys):
    from oomb import cli

    rc = cli.main(["plan", "--model", "qwen2.5-7b", "--context", "1M", "--gpu-gib", "78", "--host-gib", "125",
                   "--lora-rank", "16", "--attention", "sparse", "--gpu", "H100"])
    out = capsys.readouterr().out
    assert rc in (0, 1) and "step time: ~" in out and "on an H100" in out and "unknown GPU" not in out
    line = next(x for x in out.splitlines() if x.startswith("longest context oomb train fits here"))
    longest = {part.split()[0]: int(part.split()[1].replace(",", "")) for part in line.split(": ")[1].split(", ")}
    assert set(longest) == {"dense", "sparse"} and all(tokens >= 1 << 20 for tokens in longest.values())


def test_the_longest_context_is_searched_per_attention_mode():
    """A mode given in ``fixed`` is the mode searched (the candidates read fixed options from the base config):
    on an H200 with 125 GiB of host memory the default share's pages stop sparse before dense."""
    from oomb.planning.choose import longest_context

    workload = Workload(QWEN_7B, 1 << 20, lora_rank=16)
    resources = Resources("cuda", gpu_limit=int(131.8 * 2**30), host_limit=int(118.8 * 2**30), gpu_name="NVIDIA H200")
    dense = longest_context(workload, resources, {"attention": "dense"})
    sparse = longest_context(workload, resources, {"attention": "sparse"})
    assert sparse == longest_context(workload, resources, {}, OOMBConfig(attention="sparse"))
    assert dense == longest_context(workload, resources, {}, OOMBConfig(attention="dense"))
    assert 0 < sparse < dense
