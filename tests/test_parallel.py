"""Tensor and data parallel (oomb/parallel.py) on the CPU: 2 gloo ranks, gradients vs one process."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from helpers import build_tiny_model, free_port
from parallel_worker import SCENARIOS, run

from oomb.parallel import ParallelConfig, check_tp_degree, setup_parallel

GRAD_RTOL = 1e-5
WORLD = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """Every scenario of tests/parallel_worker.py, run once by two spawned ranks (rank 0's view)."""
    out = tmp_path_factory.mktemp("parallel")
    mp.spawn(run, args=(WORLD, free_port(), str(out), list(SCENARIOS)), nprocs=WORLD, join=True)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for name in SCENARIOS:
        for r, rank in enumerate(ranks):
            assert "traceback" not in rank[name], f"rank {r}, {name}:\n{rank[name].get('traceback')}"
    assert ranks[0] == ranks[1] or all(ranks[0][n]["error"] == ranks[1][n]["error"] for n in SCENARIOS)
    return ranks[0]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_nccl_tensor_and_data_parallel(tmp_path):
    """The same scenarios on two GPUs with NCCL (fp32, torch backend): gradients within 1e-5."""
    names = ["tp_llama_gqa", "dp_llama", "dp_llama_accumulation", "tp_llama_offload", "dp_llama_offload"]
    mp.spawn(run, args=(WORLD, free_port(), str(tmp_path), names, "cuda"), nprocs=WORLD, join=True)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    for name in names:
        assert "traceback" not in rank0[name], rank0[name].get("traceback")
        assert rank0[name]["error"] <= GRAD_RTOL, (name, rank0[name]["error"])


def test_tensor_parallel_gqa_gradients(results):
    r = results["tp_llama_gqa"]
    assert r["error"] <= GRAD_RTOL
    assert r["embedding_error"] <= GRAD_RTOL  # the input gradients of column-parallel layers were all-reduced
    assert abs(r["loss"] - r["want_loss"]) <= 1e-5 * r["want_loss"]
    assert r["local_kv_heads"] == 1 and r["k_proj_local_rows"] == 16  # 2 KV heads of dim 16 over 2 ranks
    assert r["logits_local_vocab"] == 80  # vocabulary-sharded head: 160 / 2, no full logits


def test_tensor_parallel_tied_head_with_biases(results):
    r = results["tp_qwen2_tied"]
    assert r["error"] <= GRAD_RTOL
    assert r["logits_local_vocab"] == 160  # a tied head stays replicated
    assert abs(r["loss"] - r["want_loss"]) <= 1e-5 * r["want_loss"]


def test_data_parallel_gradient_accumulation_reduces_once(results):
    r = results["dp_llama_accumulation"]
    assert r["error"] <= GRAD_RTOL
    # Each FSDP group gathers its weights once per step (2 steps) and reduces once for both.
    assert r["collectives"] == {"all_gather": 2 * r["fsdp_groups"], "reduce_scatter": r["fsdp_groups"]}


@pytest.mark.parametrize("name", ["tp_llama_offload", "dp_llama_offload"])
def test_parallel_with_host_offload(results, name):
    r = results[name]
    assert r["error"] <= GRAD_RTOL
    assert abs(r["loss"] - r["want_loss"]) <= 1e-5 * r["want_loss"]


@pytest.mark.parametrize("name", ["dp_llama", "dp_qwen3", "dp_qwen2_tied"])
def test_data_parallel_gradients(results, name):
    r = results[name]
    assert r["error"] <= GRAD_RTOL
    assert r["param_type"] == "DTensor"  # FSDP2-sharded
    # 3 chunks per step, but each FSDP group gathers its weights once and reduces its gradients once.
    assert r["collectives"] == {"all_gather": r["fsdp_groups"], "reduce_scatter": r["fsdp_groups"]}
    assert abs(r["loss"] - r["want_loss"]) <= 1e-5 * r["want_loss"]


@pytest.mark.parametrize("tp, bad", [(3, "num_attention_heads=4 and num_key_value_heads=2"),
                                     (4, "num_key_value_heads=2")])
def test_bad_tp_degree_is_refused(tp, bad):
    model = build_tiny_model("llama")
    with pytest.raises(ValueError, match=f"tp={tp} must divide the model's {bad}.*valid tp for this model: \\[1, 2\\]"):
        setup_parallel(model, tp=tp)
    with pytest.raises(ValueError, match="must divide"):
        check_tp_degree(model.config, tp)


def test_parallel_config_validation():
    with pytest.raises(ValueError, match="tp=0 must be an integer >= 1"):
        ParallelConfig(tp=0)
    assert ParallelConfig(tp=2, dp=3).world_size == 6


def test_parallel_run_needs_a_process_group():
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node 2"):
        setup_parallel(build_tiny_model("llama"), tp=2)


@pytest.mark.slow
def test_oomb_train_under_torchrun_matches_one_process(tmp_path):
    """`oomb train --tp 2` under torchrun (2 CPU processes) ends with the weights of a one-process run."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from oomb.cli import main as oomb_main

    # optim.eps=1e-3: AdamW's update lr * m / (sqrt(v) + eps) with the default eps of 1e-8 turns float
    # noise of ~1e-10 in gradients that nearly cancel (tp sums in another order) into weight changes
    # of up to ~lr * 1e-2 = 3e-5 (seen once every ~15 runs). With eps far above that noise, the update
    # is continuous in the gradient, and the comparison below tests the training, not that noise.
    common = ["--steps", "2", "--seq-len", "1024", "--set", "logging.progress=false", "--set", "oomb.chunk_size=256",
              "--set", "optim.eps=1e-3"]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "-m", "oomb.cli", "train", "--tp", "2", "--output-dir", str(tmp_path / "tp"), *common]
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("oomb train: done") == 1  # rank 0 alone prints
    assert oomb_main(["train", "--output-dir", str(tmp_path / "one"), *common]) == 0
    parallel, single = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("tp", "one"))
    assert parallel.keys() == single.keys()
    diffs = {name: (parallel[name] - weight).abs().max().item() for name, weight in single.items()}
    worst = max(diffs, key=diffs.get)
    print(f"largest difference: {diffs[worst]:.3g} ({worst})")
    assert diffs[worst] <= 1e-5, worst  # two AdamW steps at lr 3e-3: equal up to float reordering


def test_plan_divides_by_tp():
    from oomb.planning.model_shape import ModelShape
    from oomb.tools.plan import preset_config

    shape = ModelShape.from_hf_config(preset_config("qwen2.5-7b"))
    half = shape.per_rank(2)
    assert (half.num_heads, half.num_kv_heads, half.intermediate_size) == (14, 2, 9472)
    assert half.kv_bytes_per_token(torch.bfloat16) * 2 == shape.kv_bytes_per_token(torch.bfloat16)
    embeddings = shape.vocab_size * shape.hidden_size
    assert half.num_params() == (shape.num_params() - 2 * embeddings - shape.hidden_size) // 2 + embeddings \
        + embeddings // 2 + shape.hidden_size + shape.num_layers * shape.hidden_size  # norms stay whole
    with pytest.raises(ValueError, match="tp=3 must divide.*; valid: 1, 2, 4$"):
        shape.per_rank(3)
