"""The step's floor model (oomb/planning/step_work.py) on hand-counted cases, and benchmarks/profile_step.py's
grouping and its --quick run."""

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import load_script, sparse_replace
from torch.autograd import DeviceType
from torch.autograd.profiler_util import Interval

from oomb.config import OffloadConfig, OOMBConfig, PerformanceConfig, PrecisionConfig, SparseConfig, SparseResearch
from oomb.planning.model_shape import ModelShape
from oomb.planning.step_work import (
    H200,
    PARTS,
    StepSpec,
    Work,
    copies_work,
    linear_flops,
    linear_macs_per_token,
    loss_work,
    scoring_work,
    step_work,
    visible_pairs,
)
from oomb.tools.plan import load_model_shape

ROOT = Path(__file__).resolve().parents[1]
# One layer: hidden 8, MLP 16, 2 query heads and 1 KV head of dimension 4, vocabulary 10.
ONE_LAYER = ModelShape(num_layers=1, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1, head_dim=4,
                       vocab_size=10)


def _profile_script():
    return load_script("benchmarks/profile_step.py")


def test_linear_flops_of_one_layer_by_hand():
    # q 8x8 + k, v 8x4 each + o 8x8 + gate, up, down 8x16 each: 64 + 64 + 64 + 384 multiply-adds per token
    assert linear_macs_per_token(ONE_LAYER) == 576
    forward = 2 * 10 * 576
    full = linear_flops(StepSpec(ONE_LAYER, tokens=10, chunk_size=128, page_size=64))
    assert full == {"stage 1": forward, "stage 2": forward, "replay": forward, "backward": 2 * forward}
    no_replay = linear_flops(StepSpec(ONE_LAYER, 10, chunk_size=128, page_size=64, checkpoint_layers=False))
    assert list(no_replay) == ["stage 1", "stage 2", "backward"]
    hf = linear_flops(StepSpec(ONE_LAYER, 10, "hf"))
    assert hf == {"forward": forward, "recompute": forward, "backward": 2 * forward}
    # LoRA rank 2 on all seven projections: 2 x ((8+8) + 2 (8+4) + (8+8) + 2 (8+16) + (16+8)) = 256 per token;
    # the frozen base needs dX only, the adapters dX and dW.
    lora = linear_flops(StepSpec(ONE_LAYER, 10, chunk_size=128, page_size=64, lora_rank=2))
    assert lora["stage 1"] == 2 * 10 * (576 + 256)
    assert lora["backward"] == 2 * 10 * (576 + 2 * 256)


def test_dense_attention_sees_every_causal_pair_whatever_the_chunks():
    for chunk in (64, 256, 1024):
        assert visible_pairs(StepSpec(ONE_LAYER, 1000, chunk_size=chunk, page_size=64)) == 1000 * 1001 // 2
    spec = StepSpec(ONE_LAYER, 1000, chunk_size=256, page_size=64)
    # 4 D Hq per pair and forward; two forwards and a backward of 2.5
    assert step_work(spec)["attention"].attention_flops == 4 * 4 * 2 * 500500 * 4.5
    assert step_work(StepSpec(ONE_LAYER, 1000, "hf"))["attention"] == step_work(spec)["attention"]
    # keep_attention_outputs: stage 2 takes stage 1's outputs, one forward and the backward
    kept = StepSpec(ONE_LAYER, 1000, chunk_size=256, page_size=64, keep_attention_outputs=True)
    assert step_work(kept)["attention"].attention_flops == 4 * 4 * 2 * 500500 * 3.5


def test_sparse_reads_the_budget_once_the_history_outgrows_it():
    spec = StepSpec(ONE_LAYER, 512, "sparse", chunk_size=128, page_size=32, sparse=SparseConfig(budget=1, sink_pages=1))
    # chunk 0: no history; chunks 1-3 (4, 8, 12 history pages) read 2 pages = 64 keys, plus their own causally
    own = 128 * 129 // 2
    assert visible_pairs(spec) == 4 * own + 3 * 128 * 64
    assert visible_pairs(spec) < visible_pairs(StepSpec(ONE_LAYER, 512, chunk_size=128, page_size=32))
    wide = StepSpec(ONE_LAYER, 512, "sparse", chunk_size=128, page_size=32, sparse=SparseConfig(budget=11))  # all
    assert visible_pairs(wide) == 512 * 513 // 2


def test_scoring_by_hand():
    minmax = StepSpec(ONE_LAYER, 256, "sparse", chunk_size=128, page_size=32,
                      sparse=SparseConfig(budget=1, score="minmax"))
    # chunk 1 only (4 history pages > 1 sink + 1): 2 heads x 4 blocks x 32 rows against 4 pages, width 2D = 8
    assert scoring_work(minmax) == Work(matmul_flops=2 * 256 * 8 * 4)
    rerank = StepSpec(ONE_LAYER, 256, "sparse", chunk_size=128, page_size=32,
                      sparse=SparseConfig(budget=1, research=SparseResearch(candidate_pooling="max")))
    # minmax_mean candidates (width 3D), then min(4, 1 + 4 x 1) candidate pages read once and the chunk causally
    keys = 128 * 4 * 32 + 128 * 129 // 2
    assert scoring_work(rerank) == Work(matmul_flops=2 * 256 * 12 * 4, attention_flops=2 * 4 * 2 * keys)
    # candidates pooled by softmax_max: the rows' normalisers are a second pass of the same products over the
    # history and the chunk's 4 own pages (not leak-free, which runs torch's one pass over both)
    pooled = _sparse(rerank, candidate_pooling="softmax_max")
    assert scoring_work(pooled) == Work(matmul_flops=2 * 256 * 12 * (4 + 4 + 4), attention_flops=2 * 4 * 2 * keys)
    leak_free = _sparse(pooled, leak_free=True)  # 4 blocks x 33 rows, one pass
    assert scoring_work(leak_free).matmul_flops == 2 * 2 * 4 * 33 * 12 * (4 + 4)
    # a bounded normaliser (sparse.research.normaliser_pages): the sink and the last page of the 4
    bounded = _sparse(pooled, normaliser_pages=1)
    assert scoring_work(bounded).matmul_flops == 2 * 256 * 12 * (4 + 2 + 4)
    softmax_max = SparseResearch(candidate_pooling="softmax_max")
    pooled = SparseConfig(research=softmax_max)
    bounded = dataclasses.replace(softmax_max, normaliser_pages=7)
    assert StepSpec.from_config(ONE_LAYER, 256, OOMBConfig(attention="sparse", sparse=SparseConfig(research=bounded))
                                ).sparse.resolved_normaliser_pages == 7
    assert StepSpec.from_config(ONE_LAYER, 256, OOMBConfig(attention="sparse", sparse=pooled)
                                ).sparse.resolved_candidate_pooling == "softmax_max"
    default = StepSpec.from_config(ONE_LAYER, 256, OOMBConfig(attention="sparse"))  # "auto": softmax_max, 256
    assert (default.sparse.resolved_candidate_pooling,
            default.sparse.resolved_normaliser_pages) == ("softmax_max", 256)
    assert scoring_work(default) == scoring_work(_sparse(default, normaliser_pages=None))
    exact = StepSpec(ONE_LAYER, 256, "sparse", chunk_size=128, page_size=32, sparse=SparseConfig(budget=1,
                                                                                                 score="exact"))
    keys = 128 * 2 * 4 * 32 + 128 * 129 // 2  # every history page, in two passes
    assert scoring_work(exact).attention_flops == 2 * 4 * 2 * keys
    assert scoring_work(StepSpec(ONE_LAYER, 256, chunk_size=128, page_size=32)) == Work()


def test_rerank_candidates_grow_with_the_read_share():
    """With a read share the step's candidates are rerank_factor x the grown budget (sparse.candidate_options):
    at a quarter of the history or more that is every history page, so stage 1 reads every history key
    (and, with offload, stages them), as the counts must say."""
    share = StepSpec(ONE_LAYER, 2048, "sparse", chunk_size=128, page_size=32,
                     sparse=SparseConfig(budget=1, read_share=0.25, research=SparseResearch(candidate_pooling="max")))
    fixed = _sparse(share, read_share=None)
    starts = [start for start, _ in share.chunks() if share.read_pages(start) is not None]
    assert starts and all(share.rerank_candidates(start) == start // 32 for start in starts)
    assert all(fixed.rerank_candidates(start) == min(start // 32, 1 + 4 * 1) for start, _ in fixed.chunks())
    keys = sum(128 * (start // 32) * 32 + 128 * 129 // 2 for start in starts)
    assert scoring_work(share).attention_flops == 2 * 4 * 2 * keys
    offloaded = dataclasses.replace(share, offload=OffloadConfig(enabled=True))
    unstaged = _sparse(offloaded, score="minmax")  # the same reads, no candidate keys staged
    keys_bytes = 1 * 4 * 2  # one KV head's keys of dimension 4, bf16: half of K and V
    staged = copies_work(offloaded).to_device_bytes - copies_work(unstaged).to_device_bytes
    assert staged == sum((start // 32) * 32 * keys_bytes for start in starts)


def _sparse(spec: StepSpec, **changes) -> StepSpec:
    """``spec`` with its sparse options changed (research ones by name too)."""
    return dataclasses.replace(spec, sparse=sparse_replace(spec.sparse, **changes))


def test_loss_counts_the_head_and_the_logits():
    full = loss_work(StepSpec(ONE_LAYER, 100, chunk_size=128, page_size=64))
    assert full == Work(matmul_flops=2 * 100 * 8 * 10 * 4, memory_bytes=100 * 10 * 8)
    lora = loss_work(StepSpec(ONE_LAYER, 100, chunk_size=128, page_size=64, lora_rank=4))  # frozen head: no dW
    assert lora.matmul_flops == 2 * 100 * 8 * 10 * 3
    kept = loss_work(StepSpec(ONE_LAYER, 100, chunk_size=128, page_size=64, recompute_logits=False))
    assert kept.matmul_flops == 2 * 100 * 8 * 10 * 3  # no recompute of the head's forward


def test_dense_offload_bytes_by_hand():
    # K, V of a token and layer: 2 x 1 head x 4 x 2 bytes = 16; dK, dV in float32: 32
    spec = StepSpec(ONE_LAYER, 384, "dense", chunk_size=128, page_size=32, offload=OffloadConfig(enabled=True))
    work = copies_work(spec)
    # stage 1 sends each chunk's K, V out and its history in; stage 2 stages history + own twice, stores the
    # history's dK, dV and loads them except in the first backward touching them (chunk 2's: 256 tokens)
    to_host = 384 * 16 + (0 + 128 + 256) * 32
    to_device = (0 + 128 + 256) * 16 + 2 * (128 + 256 + 384) * 16 + (384 - 256) * 32
    assert (work.to_host_bytes, work.to_device_bytes, work.memory_bytes) == (to_host, to_device, 0)
    assert copies_work(StepSpec(ONE_LAYER, 384, chunk_size=128, page_size=32)) == Work(memory_bytes=384 * 16)
    sparse = copies_work(StepSpec(ONE_LAYER, 384, "sparse", chunk_size=128, page_size=32,
                                  offload=OffloadConfig(enabled=True), sparse=SparseConfig(budget=1, score="minmax")))
    assert sparse.to_device_bytes < work.to_device_bytes


def test_issue_estimate_for_the_7b_shape_at_1m():
    """Issue 23: about 7.6e16 FLOPs of linear layers for stage 1, stage 2, the replay and the backward."""
    spec = StepSpec(load_model_shape("qwen2.5-7b"), 1 << 20, "sparse")
    work = step_work(spec)
    assert work["GEMM"].matmul_flops == pytest.approx(6.84e16, rel=1e-3)  # 5 x 2 x 6.53e9 weights x 2^20
    linear = work["GEMM"].matmul_flops + work["loss"].matmul_flops  # with the LM head: 7.30e16
    assert linear == pytest.approx(7.6e16, rel=0.05)
    assert set(work) == set(PARTS) and all(work[p].floor_seconds(H200) >= 0 for p in PARTS)


def test_spec_from_config():
    shape = load_model_shape("qwen2.5-7b")
    config = OOMBConfig(attention="sparse", sparse=SparseConfig(budget=32),
                        performance=PerformanceConfig(checkpoint_layers=False),
                        precision=PrecisionConfig(kv_grad_dtype="bfloat16"))
    spec = StepSpec.from_config(shape, 65536, config)
    assert (spec.mode, spec.sparse.budget, spec.checkpoint_layers, spec.grad_bytes) == ("sparse", 32, False, 2)
    assert spec.sparse.dense_layers == () and spec.sparse.read_share is None  # budget 32: fixed, every layer sparse
    default = StepSpec.from_config(shape, 65536, OOMBConfig(attention="sparse"))
    assert default.sparse.dense_layers == (0, 1, 2, 3, 4) and default.sparse.read_share == 0.35  # 5 of 28 whole
    assert StepSpec.from_config(shape, 65536, None).mode == "hf"
    kept = config.with_options({"performance.keep_attention_outputs": True})
    assert StepSpec.from_config(shape, 65536, kept) \
        .keep_attention_outputs and not spec.keep_attention_outputs


def test_parts_of_h200_kernel_names():
    part_of = _profile_script().part_of
    gemm = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT"
    assert part_of(gemm, None) == "GEMM" and part_of(gemm, "loss") == "loss" and part_of(gemm, "scoring") == "scoring"
    for name in ("_history_dkdv_kernel", "_fwd_kernel", "_dq_kernel", "cudnn_generated_fort_native_sdpa_sm90_flash",
                 "void cudnn::fusion::compute_dot_do_o_specialized<true, 128>"):
        assert part_of(name, None) == "attention"
    assert part_of("_exact_scores_kernel", None) == "scoring"
    for name in ("Memcpy HtoD (Pinned -> Device)", "void at::native::indexSelectLargeIndex<c10::BFloat16>",
                 "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<>>"):
        assert part_of(name, "scoring") == "copies"
    softmax = "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>"
    assert part_of(softmax, "loss") == "loss" and part_of(softmax, None) == "other"
    cast = "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda>"
    assert part_of(cast, None) == "copies" and part_of(cast, "loss") == "loss"


def test_busy_time_is_the_union_of_kernels_without_annotations():
    busy_seconds = _profile_script().busy_seconds

    def event(start, end, annotation=False):
        return SimpleNamespace(device_type=DeviceType.CUDA, is_user_annotation=annotation, activity_type=None,
                               time_range=SimpleNamespace(start=start, end=end))

    events = [event(0, 10), event(5, 15), event(20, 30), event(0, 100, annotation=True)]
    assert busy_seconds(events) == pytest.approx(25e-6)


def _event(name, id, start, end, *, thread=1, parent=None, activity="cpu_op", linked=0, seq=-1, scope=0,
           fwd_thread=0, device=DeviceType.CPU):
    """A FunctionEvent's fields that profile_step.py reads."""
    return SimpleNamespace(name=name, id=id, device_type=device, is_async=False, time_range=Interval(start, end),
                           linked_correlation_id=linked, thread=thread, fwd_thread=fwd_thread, sequence_nr=seq,
                           scope=scope, cpu_parent=parent, activity_type=activity,
                           is_user_annotation=activity.endswith("user_annotation"))


def test_kernels_take_the_range_their_launch_ran_in():
    """A CUDA profile: a kernel takes the range around its launch, whether it names its op (linked_correlation_id)
    or only shares its correlation id with its cudaLaunchKernel (torch <= 2.11), and whether or not that call is
    in the cpu_parent tree; the backward of what ran in oomb.loss is loss."""
    script = _profile_script()
    gemm, softmax, softmax_grad = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "cunn_SoftMaxForward", \
        "cunn_SoftMaxBackward"
    loss = _event(script.LOSS_RANGE, 1, 0, 100, activity="user_annotation")
    head = _event("aten::mm", 2, 10, 40, parent=loss, seq=7)
    log_softmax = _event("aten::_log_softmax", 3, 50, 80, parent=loss, seq=8)
    outside = _event("aten::mm", 4, 200, 240, seq=9)
    node = _event(script.BACKWARD_PREFIX + "LogSoftmaxBackward0", 5, 300, 400, thread=2, seq=8, fwd_thread=1)
    backward = _event("LogSoftmaxBackward0", 6, 305, 395, thread=2, parent=node, seq=8, fwd_thread=1,
                      scope=script.BACKWARD_FUNCTION)
    grad = _event("aten::_log_softmax_backward_data", 7, 310, 390, thread=2, parent=backward)
    cpu = [loss, head, log_softmax, outside, node, backward, grad,
           _event("aten::empty", 501, 500, 510),  # a torch op id equal to a CUPTI correlation id below
           # the launches: left out of the cpu_parent tree, linked to their op or not
           _event("cudaLaunchKernel", 501, 20, 25, activity="cuda_runtime"),
           _event("cudaLaunchKernel", 502, 60, 65, activity="cuda_runtime"),
           _event("cudaLaunchKernel", 503, 210, 215, activity="cuda_runtime", linked=4),
           _event("cudaLaunchKernel", 504, 320, 325, thread=2, activity="cuda_runtime", linked=7)]
    device = [_event(gemm, 501, 1000, 1100, device=DeviceType.CUDA, activity="kernel"),
              _event(softmax, 502, 1100, 1150, device=DeviceType.CUDA, activity="kernel"),
              _event(gemm, 503, 1200, 1300, device=DeviceType.CUDA, activity="kernel", linked=4),
              _event(softmax_grad, 504, 1300, 1320, device=DeviceType.CUDA, activity="kernel"),
              _event(script.LOSS_RANGE, 9, 1000, 1150, device=DeviceType.CUDA, activity="gpu_user_annotation")]
    by_op: dict = {}
    rows = script.device_rows(cpu + device, by_op)
    parts = {(r["name"], r["part"]): (r["calls"], r["ms"]) for r in rows}
    assert parts == {(gemm, "loss"): (1, pytest.approx(0.1)), (softmax, "loss"): (1, pytest.approx(0.05)),
                     (gemm, "GEMM"): (1, pytest.approx(0.1)), (softmax_grad, "loss"): (1, pytest.approx(0.02))}
    # each kernel's launching op, with its enclosing ops: the op found by time for an unlinked launch
    assert {key: (r["calls"], r["ms"]) for key, r in by_op.items()} == {
        ("loss", "aten::mm < " + script.LOSS_RANGE): (1, pytest.approx(0.1)),
        ("loss", "aten::_log_softmax < " + script.LOSS_RANGE): (1, pytest.approx(0.05)),
        ("GEMM", "aten::mm"): (1, pytest.approx(0.1)),
        ("loss", "aten::_log_softmax_backward_data < LogSoftmaxBackward0 < " + script.BACKWARD_PREFIX
         + "LogSoftmaxBackward0"): (1, pytest.approx(0.02))}


def _quick_profile(script, tmp_path, monkeypatch, *extra: str) -> dict:
    """Run profile_step.py --quick on the tiny preset's sparse step (1K tokens); its first run's JSON."""
    argv = ["profile_step.py", "--quick", "--modes", "sparse", "--contexts", "1K", "--chunk-size", "256",
            "--page-size", "64", "--sparse-budget", "1", *extra, "--out-dir", str(tmp_path), "--name", "p"]
    monkeypatch.setattr(sys, "argv", argv)
    threads = torch.get_num_threads()
    try:
        script.main()
    finally:
        torch.set_num_threads(threads)
    return json.loads((tmp_path / "p.json").read_text())["runs"][0]


@pytest.mark.slow
def test_quick_profile_groups_and_floors(tmp_path, monkeypatch, capsys):
    script = _profile_script()
    run = _quick_profile(script, tmp_path, monkeypatch)
    assert "measured/floor" in capsys.readouterr().out
    parts = {row["part"]: row for row in run["parts"]}
    assert list(parts) == list(script.ROWS)
    for part in ("GEMM", "scoring", "loss", "copies", "other"):  # the ranges caught the scoring and the loss
        assert parts[part]["measured_s"] > 0, part
    assert parts["GEMM"]["flop"] == pytest.approx(sum(linear_flops(StepSpec.from_config(
        ModelShape.from_hf_config(_tiny_config()), 1024, _quick_config(), dtype=torch.float32)).values()))
    assert parts["GEMM"]["floor_s"] is None  # the CPU: no rates unless a flag gives one
    assert {r["part"] for r in run["top"]} <= set(script.ROWS)


def _tiny_config():
    from oomb.training import presets

    return presets.preset_config(presets.TINY_PRESET, 1024)


def _quick_config() -> OOMBConfig:
    return OOMBConfig(attention="sparse", chunk_size=256, page_size=64, sparse=SparseConfig(budget=1))


def test_profile_of_the_first_layers_only(tmp_path, monkeypatch):
    """--layers 1: a model of the preset's first decoder layer, and floors counted for that model."""
    script = _profile_script()
    run = _quick_profile(script, tmp_path, monkeypatch, "--layers", "1")
    config = _tiny_config()
    assert config.num_hidden_layers > 1 and run["layers"] == 1
    config.num_hidden_layers = 1
    gemm = {row["part"]: row for row in run["parts"]}["GEMM"]
    assert gemm["flop"] == pytest.approx(sum(linear_flops(StepSpec.from_config(
        ModelShape.from_hf_config(config), 1024, _quick_config(), dtype=torch.float32)).values()))
    with pytest.raises(ValueError, match="layers=0"):
        _quick_profile(script, tmp_path, monkeypatch, "--layers", "0")


@pytest.mark.slow
def test_profile_with_the_choosers_plan(tmp_path, monkeypatch):
    """--chosen: the profiled step runs the plan `oomb train`'s chooser makes (not the flags' defaults, which
    replay layers), and the JSON keeps the plan; without it the plan is None."""
    script = _profile_script()
    plain = _quick_profile(script, tmp_path, monkeypatch)
    assert plain["plan"] is None and plain["step_spec"]["checkpoint_layers"] is True
    chosen = _quick_profile(script, tmp_path, monkeypatch, "--chosen")
    assert "layer replay off" in chosen["plan"]  # a 1K step of the tiny model fits without replay
    assert chosen["step_spec"]["checkpoint_layers"] is False
    assert chosen["step_spec"]["chunk_size"] == 256  # a flag the user gave stays


def test_fused_loss_floor():
    """oomb's fused loss: 6 bytes of kernel traffic per logit, and no recompute whatever recompute_logits says:
    a frozen head (LoRA) needs none, a trained head's weight gradient is made in the forward (forward, dX, dW)."""
    from oomb.planning.step_work import FUSED_LOGIT_BYTES, LOGIT_BYTES, loss_work

    shape = load_model_shape("qwen2.5-7b")
    lora = StepSpec(shape, 131072, "sparse", lora_rank=16)
    fused_lora = StepSpec(shape, 131072, "sparse", lora_rank=16, fused_loss=True)
    assert loss_work(fused_lora).matmul_flops == loss_work(lora).matmul_flops * 2 / 3  # forward, dX: no recompute
    assert loss_work(fused_lora).memory_bytes == loss_work(lora).memory_bytes * FUSED_LOGIT_BYTES / LOGIT_BYTES
    full, fused_full = StepSpec(shape, 131072, "sparse"), StepSpec(shape, 131072, "sparse", fused_loss=True)
    assert loss_work(fused_full).matmul_flops == loss_work(full).matmul_flops * 3 / 4  # autograd's: + recompute
    assert loss_work(fused_full).memory_bytes == loss_work(full).memory_bytes * FUSED_LOGIT_BYTES / LOGIT_BYTES
    kept = StepSpec(shape, 131072, "sparse", recompute_logits=False, fused_loss=True)
    assert loss_work(kept) == loss_work(fused_full)


def test_dense_layers_of_a_sparse_step_count_as_dense():
    """sparse.dense_layers: those layers see every pair, score nothing and stage their whole history; resident
    ones (the first offload.resident_layers) move nothing."""
    shape = dataclasses.replace(ONE_LAYER, num_layers=4)
    options = dict(chunk_size=128, page_size=32)
    few = SparseConfig(budget=1, sink_pages=1, score="minmax")
    sparse = StepSpec(shape, 512, "sparse", sparse=few, **options)
    dense = StepSpec(shape, 512, "dense", **options)
    every = StepSpec(shape, 512, "sparse", sparse=dataclasses.replace(few, dense_layers=(0, 1, 2, 3)), **options)
    assert step_work(every)["attention"] == step_work(dense)["attention"]
    assert step_work(every)["scoring"] == Work() != step_work(sparse)["scoring"]
    two = StepSpec(shape, 512, "sparse", sparse=dataclasses.replace(few, dense_layers=(0, 1)), **options)
    attention = {name: step_work(s)["attention"].attention_flops for name, s in
                 (("sparse", sparse), ("dense", dense), ("two", two))}
    assert attention["two"] == (attention["sparse"] + attention["dense"]) / 2
    assert step_work(two)["scoring"].matmul_flops == step_work(sparse)["scoring"].matmul_flops / 2

    def offloaded(spec, resident):
        return copies_work(dataclasses.replace(spec, offload=OffloadConfig(enabled=True, resident_layers=resident)))

    assert offloaded(two, 2) == offloaded(sparse, 2)  # layers 0 and 1 keep their pages on the GPU
    per_layer = {name: offloaded(s, 3).to_device_bytes for name, s in (("sparse", sparse), ("dense", dense))}
    assert offloaded(dataclasses.replace(two, sparse=dataclasses.replace(few, dense_layers=(3,))), 2).to_device_bytes \
        == per_layer["sparse"] + per_layer["dense"]


def test_a_dense_layer_that_slides_still_reads_its_window():
    shape = dataclasses.replace(ONE_LAYER, num_layers=4, sliding_window=64, sliding_window_layers=2,
                                sliding_layer_ids=(0, 2))
    few = SparseConfig(budget=1, sink_pages=1, score="minmax")

    def attention(dense_layers):
        spec = StepSpec(shape, 512, "sparse", chunk_size=128, page_size=32,
                        sparse=dataclasses.replace(few, dense_layers=dense_layers))
        return step_work(spec)["attention"].attention_flops

    assert attention((0,)) == attention(()) < attention((1,))
