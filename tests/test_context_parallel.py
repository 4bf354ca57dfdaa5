"""Context parallelism (oomb/context_parallel.py) on the CPU: 2, 3 and 4 gloo ranks against one process,
dense and sparse, with and without host offload."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from context_parallel_worker import run
from helpers import free_port

from oomb.context_parallel import ContextShard
from oomb.kv import ChunkSpan, PagedKVStore
from oomb.kv.store import attention_windows

GRAD_RTOL = 1e-5
SCENARIOS_BY_WORLD = {
    2: ["llama_batch2", "qwen2_tied", "llama_documents", "mistral_window", "one_chunk", "refusals", "llama_offload",
        "llama_sparse", "sparse_options", "gemma2_sparse"],
    3: ["llama_batch2", "one_chunk", "llama_offload", "llama_sparse", "gemma2_sparse"],
    4: ["tp2_llama", "dp2_llama"],
}
VARIANT_SCENARIOS = ("llama_offload", "llama_sparse", "sparse_options", "gemma2_sparse")
"""Scenarios of context_parallel_worker.variants: one reference, several cp configurations each."""


def _spawn(world: int, names: list[str], out, device_type: str = "cpu") -> list[dict]:
    mp.spawn(run, args=(world, free_port(), str(out), names, device_type), nprocs=world, join=True)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for r, rank in enumerate(ranks):
        for name in names:
            assert name in rank, f"rank {r} did not reach {name}"
            assert "traceback" not in rank[name], f"rank {r}, {name}:\n{rank[name]['traceback']}"
    return ranks


@pytest.fixture(scope="module", params=[world if world == 2 else pytest.param(world, marks=pytest.mark.slow)
                                        for world in sorted(SCENARIOS_BY_WORLD)])  # 2 ranks in the fast tier
def world_results(request, tmp_path_factory) -> tuple[int, list[dict]]:
    """Every scenario of a world size, run once by that many spawned ranks: (world, per-rank results)."""
    world = request.param
    return world, _spawn(world, SCENARIOS_BY_WORLD[world], tmp_path_factory.mktemp(f"cp{world}"))


def _step_scenarios(world: int) -> list[str]:
    return [n for n in SCENARIOS_BY_WORLD[world] if n != "refusals" and n not in VARIANT_SCENARIOS]


def _variants(world_results, scenario: str) -> tuple[int, list[dict]]:
    world, ranks = world_results
    if scenario not in SCENARIOS_BY_WORLD[world]:
        pytest.skip(f"{scenario} runs with {[w for w, names in SCENARIOS_BY_WORLD.items() if scenario in names]} ranks")
    return world, [rank[scenario] for rank in ranks]


GPU_SCENARIOS = ["llama_batch2", "llama_batch2_triton", "qwen2_tied", "llama_documents", "mistral_window",
                 "one_chunk"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_nccl_context_parallel(tmp_path):
    """The 2-rank scenarios on two GPUs with NCCL (fp32; torch and triton backends): gradients within
    1e-5 of one GPU, bit-identical on both ranks."""
    ranks = _spawn(2, GPU_SCENARIOS, tmp_path, "cuda")
    for name in GPU_SCENARIOS:
        for r, rank in enumerate(ranks):
            assert rank[name]["error"] <= GRAD_RTOL, (name, r, rank[name]["error"])
            assert rank[name]["pool_pages"] == rank[name]["own_pages"], (name, r)
        assert len({rank[name]["loss"] for rank in ranks}) == 1, name
        assert len({rank[name]["digest"] for rank in ranks}) == 1, name


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_nccl_context_parallel_offload_and_sparse(tmp_path):
    """Offload (pinned, mapped host slabs, copy streams) and sparse attention under cp on two GPUs with
    NCCL (fp32, torch backend): as on the CPU, within 1e-5 of one GPU and bit-identical to cp without
    offload; sparse selections those of one GPU."""
    ranks = _spawn(2, ["llama_offload", "llama_sparse"], tmp_path, "cuda")
    _check_offload(2, [rank["llama_offload"] for rank in ranks])
    _check_sparse(2, [rank["llama_sparse"] for rank in ranks])


def test_gradients_equal_one_process(world_results):
    world, ranks = world_results
    for name in _step_scenarios(world):
        for r, rank in enumerate(ranks):
            res = rank[name]
            assert res["error"] <= GRAD_RTOL, (world, name, r, res["error"])
            if res["single_vs_hf"] is not None:  # the reference is itself HF's gradient
                assert res["single_vs_hf"] <= GRAD_RTOL, (world, name, res["single_vs_hf"])
                assert abs(res["want_loss"] - res["hf_loss"]) <= 1e-5 * res["hf_loss"]
            assert abs(res["loss"] - res["want_loss"]) <= 1e-6 * res["want_loss"], (world, name, r)


def test_every_rank_holds_the_same_loss_and_gradients(world_results):
    """Bit for bit: the ranks' merges run the same float operations, nothing rank-local leaks."""
    world, ranks = world_results
    for name in _step_scenarios(world):
        assert len({rank[name]["loss"] for rank in ranks}) == 1, (world, name, [rank[name]["loss"] for rank in ranks])
        assert len({rank[name]["digest"] for rank in ranks}) == 1, (world, name)


def test_each_rank_allocates_only_its_own_chunks(world_results):
    world, ranks = world_results
    for name in _step_scenarios(world):
        for rank in ranks:
            res = rank[name]
            assert res["pool_pages"] == res["own_pages"], (world, name, res)
        if name != "one_chunk":  # every page of the step on exactly one cp rank (per tp rank)
            tp = 2 if name.startswith("tp2") else 1
            assert sum(rank[name]["pool_pages"] for rank in ranks) == tp * ranks[0][name]["full_pages"]


def test_unsupported_combinations_are_refused(world_results):
    world, ranks = world_results
    if "refusals" not in SCENARIOS_BY_WORLD[world]:
        pytest.skip("refusals run in the 2-rank group")
    for rank in ranks:
        messages = rank["refusals"]
        assert "sparse.score='exact' and sparse.research.pooling='softmax' is not supported" in \
            messages["exact_softmax"]


def test_offload_keeps_each_ranks_pages_in_its_host_memory(world_results):
    """cp + offload (one layer on the GPU tier, one on the host; ragged: a partial chunk and page):
    gradients within 1e-5 of one process without offload and bit-identical to cp without offload;
    each rank's host slabs hold exactly its own chunks' pages (3 ranks: pages copied run by run)."""
    _check_offload(*_variants(world_results, "llama_offload"))


def _check_offload(world: int, ranks: list[dict]) -> None:
    for res in ranks:
        assert res["cp_offload"]["error"] <= GRAD_RTOL, (world, res["cp_offload"]["error"])
        assert res["cp_offload"]["digest"] == res["cp"]["digest"], world
        assert res["cp_offload"]["host_pages"] == res["cp_offload"]["own_host_pages"], (world, res["cp_offload"])
        assert res["cp_offload"]["pool_pages"] == res["cp_offload"]["own_pages"]  # the GPU tier's layer
    assert sum(res["cp_offload"]["host_pages"] for res in ranks) == -(-75 // 8)  # per sequence, over the ranks
    assert len({res["cp_offload"]["digest"] for res in ranks}) == 1


def test_sparse_selects_as_one_process_and_offload_changes_nothing(world_results):
    """Sparse (rerank: minmax candidates on every rank, exact probabilities normalised over the
    candidates of all ranks): the selections of one process, gradients within 1e-5 of it, with
    offload bit-identical to without, the same on every rank."""
    _check_sparse(*_variants(world_results, "llama_sparse"))


def _check_sparse(world: int, ranks: list[dict]) -> None:
    for res in ranks:
        assert res["reference"]["sparse_calls"] > 0
        for name in ("cp", "cp_offload"):
            assert res[name]["error"] <= GRAD_RTOL, (world, name, res[name]["error"])
            assert res[name]["selections"] == res["reference"]["selections"], (world, name)
        assert res["cp_offload"]["digest"] == res["cp"]["digest"], world
        assert res["cp_offload"]["host_pages"] == res["cp_offload"]["own_host_pages"]
    assert len({res["cp"]["digest"] for res in ranks}) == 1


def test_sparse_scores_and_options_under_cp(world_results):
    """minmax leak-free, shared groups of two blocks, packed documents, with offload; rerank leak-free with
    offload; the exact score; a budget covering the history (every call dense: the gradients of one dense
    process)."""
    world, ranks = _variants(world_results, "sparse_options")
    for res in ranks:
        for score in ("minmax", "rerank", "exact"):
            got, want = res[f"{score}_cp"], res[f"{score}_reference"]
            assert got["error"] <= GRAD_RTOL, (score, got["error"])
            assert want["sparse_calls"] > 0 and got["selections"] == want["selections"], score
        assert res["full_cp"]["error"] <= GRAD_RTOL and res["full_cp"]["sparse_calls"] == 0
    for name in ("minmax_cp", "rerank_cp", "exact_cp", "full_cp"):
        assert len({res[name]["digest"] for res in ranks}) == 1, name


def test_sparse_with_logit_softcapping_under_cp(world_results):
    """gemma2 (attention logit softcapping, queries scaled so that the cap bends the scores; a window
    layer read densely, a global one sparsely): the selections of one process, gradients within 1e-5
    of it, the same on every rank."""
    world, ranks = _variants(world_results, "gemma2_sparse")
    for res in ranks:
        assert res["reference"]["sparse_calls"] > 0
        assert res["cp"]["error"] <= GRAD_RTOL, (world, res["cp"]["error"])
        assert res["cp"]["selections"] == res["reference"]["selections"], world
    assert len({res["cp"]["digest"] for res in ranks}) == 1


# ---- ownership, without processes -----------------------------------------------------------------

def test_owned_pages_partition_the_sequence():
    for size in (1, 2, 3, 5):
        for tokens in (1, 16, 75, 200):
            shards = [ContextShard(r, size, chunk_size=16) for r in range(size)]
            assert sum(s.owned_pages(tokens, 8) for s in shards) == -(-tokens // 8)


def test_own_windows_are_the_ranks_share_of_every_window():
    """The windows of all ranks cover the chunk's windows exactly once, each inside one window and in
    chunks its rank owns; one rank keeps the windows as they are (the one-process calls)."""
    chunk = ChunkSpan(5, 80, 96)
    for block_pages in (None, 1, 3):
        windows = attention_windows(chunk, 8, block_pages, first_key=16)
        shards = [ContextShard(r, 3, chunk_size=16) for r in range(3)]
        pieces = sorted(w for s in shards for w in s.own_windows(windows, chunk.index))
        covered = [k for lo, hi in pieces for k in range(lo, hi)]
        assert covered == list(range(16, 96))
        for shard in shards:
            for lo, hi in shard.own_windows(windows, chunk.index):
                assert all(shard.owns(c) for c in range(lo // 16, (hi - 1) // 16 + 1)) and lo % 8 == 0
                assert any(w_lo <= lo and hi <= w_hi for w_lo, w_hi in windows)
        assert ContextShard(0, 1, 16).own_windows(windows, chunk.index) == windows
    assert ContextShard(2, 3, 16).own_windows([(0, 80), (80, 96)], 5)[-1] == (80, 96)  # 5 % 3: the owner
    assert ContextShard(0, 3, 16).own_windows([(0, 80), (80, 96)], 5) == [(0, 16), (48, 64)]


def test_store_of_a_rank_holds_only_its_chunks():
    shard = ContextShard(1, 2, chunk_size=16)
    store = PagedKVStore(num_layers=1, batch_size=2, num_tokens=75, num_kv_heads=2, head_dim=4, page_size=8,
                         kv_dtype=torch.float32, grad_dtype=torch.float32, device="cpu", context=shard)
    assert store.pool.capacity == 2 * 4  # chunks 1 and 3: two pages each, per sequence
    chunks = [ChunkSpan(i, 16 * i, min(16 * i + 16, 75)) for i in range(5)]
    for chunk in chunks:
        store.allocate(chunk)
        store.write(0, chunk, torch.randn(2, 2, chunk.length, 4), torch.randn(2, 2, chunk.length, 4))
    assert store.pool.num_free == 0
    dk, dv = store.chunk_grads(0, chunks[2])  # not ours: zeros of the chunk's shape (the owner's are broadcast)
    assert dk.shape == (2, 2, 16, 4) and not dk.any() and not dv.any()
    for chunk in reversed(chunks):
        store.free(chunk)
    assert store.is_empty


@pytest.mark.parametrize("softcap", [None, 1.5])
def test_ranks_sparse_shares_merge_into_the_sparse_attention(softcap):
    """attention/context_sparse.py without processes: each rank's partial attention over its selected
    pages (and the chunk, on its owner), merged in rank order, is reference_sparse's attention; the dQ
    shares sum to its dQ and the ranks' dK/dV to its, with and without logit softcapping. Pages a rank
    does not hold are NaN in its pools: never read, never written."""
    from oomb.attention import context_sparse, reference_sparse
    from oomb.attention.reference import merge_window

    gen = torch.Generator().manual_seed(3)
    B, Hq, Hkv, D, P, chunk_size = 2, 4, 2, 8, 4, 8
    chunk = ChunkSpan(4, 32, 39)  # 7 queries: two blocks, the last partial
    n_pages = -(-chunk.end // P)
    table = torch.randperm(B * n_pages, generator=gen).reshape(B, n_pages).to(torch.int32)
    k_pool, v_pool = (torch.randn(B * n_pages, Hkv, P, D, generator=gen) for _ in range(2))
    q = torch.randn(B, Hq, chunk.length, D, generator=gen)
    dout = torch.randn(B, Hq, chunk.length, D, generator=gen)
    selection = torch.stack([torch.randperm(8, generator=gen)[:3].sort().values for _ in range(B * Hkv * 2)])
    selection = selection.reshape(B, Hkv, 2, 3).to(torch.int32)
    scale = D ** -0.5
    want, want_lse = reference_sparse.sparse_attention_forward(q, k_pool, v_pool, table, chunk.start, scale, selection,
                                                               softcap=softcap)
    want_dk, want_dv = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
    want_dq = reference_sparse.sparse_attention_backward(q, k_pool, v_pool, table, chunk.start, scale, selection,
                                                         want, dout, want_lse, want_dk, want_dv, softcap=softcap)
    for size in (2, 3):
        shards = [ContextShard(r, size, chunk_size) for r in range(size)]
        pools, shares = [], []
        for shard in shards:
            held = shard.owned_positions(torch.arange(n_pages), P)
            k_r, v_r = k_pool.clone(), v_pool.clone()
            for pool in (k_r, v_r):
                pool[table[:, ~held].flatten().long()] = float("nan")
            pools.append((k_r, v_r))
            shares.append(context_sparse.KeyShare(shard.owned_positions(selection, P), shard.owns(chunk.index)))
        parts = [context_sparse.sparse_attention_forward(q, k_r, v_r, table, chunk.start, scale, selection,
                                                         softcap=softcap, share=share)
                 for (k_r, v_r), share in zip(pools, shares, strict=True)]
        out, lse = parts[0]
        for part in parts[1:]:
            out, lse = merge_window(out, lse, *part)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-6)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k_pool), torch.zeros_like(v_pool)
        for (k_r, v_r), share in zip(pools, shares, strict=True):
            dk_r, dv_r = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
            dq += context_sparse.sparse_attention_backward(q, k_r, v_r, table, chunk.start, scale, selection, out,
                                                           dout, lse, dk_r, dv_r, softcap=softcap, share=share)
            assert not dk_r.isnan().any() and not dv_r.isnan().any()
            dk, dv = dk + dk_r, dv + dv_r
        for got, expected in ((dq, want_dq), (dk, want_dk), (dv, want_dv)):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_bad_shard_is_refused():
    with pytest.raises(ValueError, match="rank 2 of 2 ranks"):
        ContextShard(2, 2, 16)


# ---- trainer and planner ----------------------------------------------------------------------------

@pytest.mark.slow
def test_oomb_train_with_cp_under_torchrun_matches_one_process(tmp_path):
    """`oomb train --cp 2` under torchrun (2 CPU processes) ends with the weights of a one-process run."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from oomb.cli import main as oomb_main

    # 1000 tokens, chunks of 256: 4 chunks (the last one partial), two on each rank. optim.eps=1e-3 as in
    # tests/test_parallel.py: AdamW's update stays continuous in gradients that nearly cancel.
    common = ["--steps", "2", "--seq-len", "1000", "--set", "logging.progress=false", "--set", "oomb.chunk_size=256",
              "--set", "optim.eps=1e-3", "--no-auto-config"]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "-m", "oomb.cli", "train", "--cp", "2", "--output-dir", str(tmp_path / "cp"), *common]
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("oomb train: done") == 1  # rank 0 alone prints
    assert "cp=2" in done.stdout
    assert oomb_main(["train", "--output-dir", str(tmp_path / "one"), *common]) == 0
    parallel, single = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("cp", "one"))
    assert parallel.keys() == single.keys()
    diffs = {name: (parallel[name] - weight).abs().max().item() for name, weight in single.items()}
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= 1e-5, (worst, diffs[worst])


def test_plan_with_cp_divides_the_pages():
    import argparse

    from oomb.planning.memory import MODES, TrainingSetup, context_parallel_tokens, predict
    from oomb.tools.plan import add_arguments, load_model_shape, plan_from_args

    shape = load_model_shape("qwen2.5-7b")
    tokens = 1 << 20  # 256 chunks of 4096: 64 on each of 4 ranks
    one = predict("dense", shape, tokens)
    four = predict("dense", shape, tokens, setup=TrainingSetup(context_parallel=4))
    assert one.gpu["KV working set"] == 4 * four.gpu["KV working set"]
    assert one.gpu["activations"] == four.gpu["activations"]
    # Ragged: 5 chunks of 16 tokens over 2 ranks (page 8), the last one 11 tokens: rank 0 holds 3.
    assert context_parallel_tokens(75, 16, 8, 2) == 16 + 16 + 16
    # Offload: each rank pins the host pages of its own chunks; sparse: page summaries of every chunk.
    for mode in ("dense+offload", "sparse+offload"):
        one, four = (predict(mode, shape, tokens, setup=TrainingSetup(context_parallel=cp)) for cp in (1, 4))
        assert one.host["KV pages"] == 4 * four.host["KV pages"] > 0, mode
        assert one.host["KV grad pages"] == 4 * four.host["KV grad pages"], mode
    one, four = (predict("sparse", shape, tokens, setup=TrainingSetup(context_parallel=cp)) for cp in (1, 4))
    assert one.gpu["KV working set"] == 4 * four.gpu["KV working set"]
    assert one.gpu["page summaries"] == four.gpu["page summaries"] > 0
    with pytest.raises(ValueError, match="plain HF has no context parallelism|context parallelism is oomb's"):
        predict("hf", shape, tokens, setup=TrainingSetup(context_parallel=2))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    plan = plan_from_args(parser.parse_args(["--model", "qwen2.5-7b", "--context", "1M", "--gpu-gib", "139",
                                             "--host-gib", "125", "--cp", "4", "--no-master-weights"]))
    assert [r.mode.name for r in plan.reports] == [m for m in MODES if m != "hf"]
    dense = next(r for r in plan.reports if r.mode.name == "dense")
    assert dense.fits and dense.prediction.gpu["KV working set"] == predict(
        "dense", shape, tokens, setup=TrainingSetup(context_parallel=4)).gpu["KV working set"]
    with pytest.raises(ValueError, match="--cp 2 plans oomb's modes"):
        plan_from_args(parser.parse_args(["--model", "qwen2.5-7b", "--cp", "2", "--modes", "hf", "dense",
                                          "--gpu-gib", "139", "--host-gib", "125"]))
