"""Tensor and data parallel (oomb/parallel.py) on the CPU: 2 gloo ranks, gradients vs one process."""

from __future__ import annotations

import json
import socket

import pytest
import torch.multiprocessing as mp
from helpers import build_tiny_model
from parallel_worker import SCENARIOS, run

from oomb.parallel import ParallelConfig, check_tp_degree, setup_parallel

GRAD_RTOL = 1e-5
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """Every scenario of tests/parallel_worker.py, run once by two spawned ranks (rank 0's view)."""
    out = tmp_path_factory.mktemp("parallel")
    mp.spawn(run, args=(WORLD, _free_port(), str(out), list(SCENARIOS)), nprocs=WORLD, join=True)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for name in SCENARIOS:
        for r, rank in enumerate(ranks):
            assert "traceback" not in rank[name], f"rank {r}, {name}:\n{rank[name].get('traceback')}"
    assert ranks[0] == ranks[1] or all(ranks[0][n]["error"] == ranks[1][n]["error"] for n in SCENARIOS)
    return ranks[0]


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


@pytest.mark.parametrize("name", ["dp_llama", "dp_qwen3"])
def test_data_parallel_gradients(results, name):
    r = results[name]
    assert r["error"] <= GRAD_RTOL
    assert r["param_type"] == "DTensor"  # FSDP2-sharded
    # 3 chunks per step, but each FSDP group gathers its weights once and reduces its gradients once.
    assert r["collectives"] == {"all_gather_single": r["fsdp_groups"], "reduce_scatter_single": r["fsdp_groups"]}
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
