"""checkpoint.resume with several processes: 2 gloo ranks on the CPU (tests/parallel_worker.py ``train``).

A run killed (or interrupted) after step 2 and resumed with the same layout ends bitwise like the
uninterrupted run: losses, weights, fp32 masters and AdamW state. A checkpoint resumes with another
layout too (tp=2 -> dp=2, 2 processes -> 1, 1 -> 2): the same steps up to the order of float sums.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import build_tiny_model, free_port
from parallel_worker import train

from oomb.training.checkpoint import load_checkpoint
from oomb.training.config import TrainerConfig
from oomb.training.presets import BYTE_VOCAB, byte_tokenizer
from oomb.training.trainer import Trainer

WORLD = 2
LAYOUT_ATOL = 1e-5
"""Another tp/dp layout sums the same terms in another order (row-parallel matmuls, reductions over
ranks): the two AdamW steps at lr 3e-3 after the checkpoint stay this close to the run that wrote it
(seen: <= 1.2e-7). Compared from step 1 instead, one process and tp=2 differ by up to 3e-5 after two
steps: AdamW's first update, lr * g / (|g| + eps), turns float noise of ~1e-10 in gradients that
cancel to ~1e-9 into weight changes of lr * 1e-2; so each reference run wrote the checkpoint, and
eps is 1e-3, far above that noise, so that later updates stay continuous in the gradient too."""


def _device_config(root: Path, name: str, model: dict, device: str = "cpu", **sections) -> dict:
    options = {
        "model": model,
        "data": {"paths": [str(root / "docs.jsonl")], "seq_len": 128},
        "optim": {"lr": 3e-3, "warmup_steps": 1, "eps": 1e-3},  # eps: see LAYOUT_ATOL
        "train": {"max_steps": 4, "output_dir": str(root / name), "device": device, "seed": 1, "grad_accum": 2},
        "checkpoint": {"every": 2, "keep_last": 0, "export": False},
        "logging": {"progress": False},
        "oomb": {"chunk_size": 64, "page_size": 32, "performance": {"backend": "torch"}},
    }
    for section, values in sections.items():
        options[section] = {**options.get(section, {}), **values}
    return options


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run once; rank 0's and rank 1's results of the 2-process ones, and the paths."""
    return _all_runs(tmp_path_factory.mktemp("parallel-resume"), "cpu")


def _all_runs(root: Path, device: str) -> dict:
    """The runs under ``root``: one process in this one, the others in 2 spawned ranks (device "cpu":
    gloo; "cuda": NCCL on two GPUs, for a GPU variant of these tests, not written yet)."""
    llama_dir = root / "tiny-llama"  # untied: tp=2 shards the LM head by vocabulary
    build_tiny_model("llama", seed=3, vocab_size=BYTE_VOCAB + 1).save_pretrained(llama_dir)
    byte_tokenizer().save_pretrained(llama_dir)
    lines = [{"text": f"Document {i}. " + "the quick brown fox jumps over the lazy dog " * (1 + i % 5)}
             for i in range(40)]
    (root / "docs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    llama = {"path": str(llama_dir)}
    qwen_bf16 = {"preset": "tiny-qwen2", "dtype": "bfloat16"}  # tied (FSDP root DecoderRoot), fp32 masters
    tp = {"tp": 2}

    def _config(*args, **sections):
        return _device_config(*args, device=device, **sections)

    # One process: its step-2 checkpoint is resumed by 2 processes below (and it is their reference).
    one = {"losses": Trainer(TrainerConfig.from_dict(_config(root, "one", llama))).train().losses}

    tp_step2 = str(root / "tp" / "checkpoints" / "step-000002")
    jobs = [
        {"name": "tp", "config": _config(root, "tp", llama, parallel=tp)},
        # Dies at the first sequence of step 3 (2 sequences per step): the step-2 checkpoint remains.
        {"name": "tp-killed", "config": _config(root, "tp-resumed", llama, parallel=tp), "kill_at": 5},
        {"name": "tp-resumed", "config": _config(root, "tp-resumed", llama, parallel=tp,
                                                 checkpoint={"resume": "latest"})},
        {"name": "dp", "config": _config(root, "dp", qwen_bf16)},
        # Ctrl-C at the second sequence of step 3: that partial step is dropped, step 2 is saved then.
        {"name": "dp-interrupted", "config": _config(root, "dp-resumed", qwen_bf16, checkpoint={"every": 0}),
         "interrupt_at": 6},
        {"name": "dp-resumed", "config": _config(root, "dp-resumed", qwen_bf16,
                                                 checkpoint={"every": 0, "resume": "latest"})},
        # Ctrl-C in step 1: a checkpoint of step 0 (no optimizer state yet), resumed, killed in step 3.
        {"name": "dp-step0", "config": _config(root, "dp-step0", qwen_bf16), "interrupt_at": 1},
        {"name": "dp-step0-resumed", "config": _config(root, "dp-step0", qwen_bf16, checkpoint={"resume": "latest"}),
         "kill_at": 5},
        # Other layouts, the same 2 sequences per step: tp=2 x grad_accum 2 -> dp=2 x grad_accum 1; 1 -> 2.
        {"name": "tp-to-dp", "config": _config(root, "tp-to-dp", llama, train={"grad_accum": 1},
                                               checkpoint={"resume": tp_step2})},
        {"name": "one-to-tp", "config": _config(root, "one-to-tp", llama, parallel=tp, checkpoint={
            "resume": str(root / "one" / "checkpoints" / "step-000002")})},
        # Refusals, raised on every rank (none waits for the others forever).
        {"name": "lora-mismatch", "config": _config(root, "lora-mismatch", llama, lora={"enabled": True},
                                                    checkpoint={"resume": tp_step2})},
        {"name": "offload", "config": _config(root, "offload", llama, parallel=tp, optim={"offload": True})},
    ]
    mp.spawn(train, args=(WORLD, free_port(), str(root), jobs, device), nprocs=WORLD, join=True)
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for job in jobs:
        for r, rank in enumerate(ranks):
            assert job["name"] in rank, f"rank {r} did not reach {job['name']}"
            assert "traceback" not in rank[job["name"]], f"rank {r}, {job['name']}:\n{rank[job['name']]['traceback']}"

    # One process resumes the 2-process tp=2 checkpoint.
    tp_to_one = Trainer(TrainerConfig.from_dict(_config(root, "tp-to-one", llama, checkpoint={"resume": tp_step2})))
    ranks[0]["tp-to-one"] = {"losses": tp_to_one.train().losses}
    ranks[0]["one"] = one
    return {"root": root, "rank0": ranks[0], "rank1": ranks[1]}


def _final(root: Path, name: str):
    return load_checkpoint(root / name / "checkpoints" / "step-000004")


def _tensors(checkpoint) -> dict[str, torch.Tensor]:
    """Weights, masters and AdamW state of a checkpoint by name."""
    out = {f"weights/{n}": checkpoint.weights[n] for n in checkpoint.weights}
    out |= {f"master/{n}": checkpoint.master[n] for n in checkpoint.master}
    for index, state in checkpoint.optimizer["state"].items():
        out |= {f"optimizer/{index}/{k}": v for k, v in state.items()}
    return out


def _assert_bitwise(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("name, stopped", [("tp", "tp-killed"), ("dp", "dp-interrupted")])
def test_resumed_run_equals_uninterrupted_bitwise(runs, name, stopped):
    """tp=2 (fp32, vocabulary-sharded head) killed in step 3; dp=2 (FSDP2, bf16 with fp32 masters, tied
    embeddings) interrupted mid-step 3. Deterministic on the CPU, so exactly equal."""
    root, rank0 = runs["root"], runs["rank0"]
    want, got = rank0[name], rank0[f"{name}-resumed"]
    if name == "tp":
        assert rank0[stopped] == {"killed_at_step": 3, "warnings": []}
    else:
        assert rank0[stopped]["interrupted"] and rank0[stopped]["steps"] == 2
        assert rank0[stopped]["checkpoint"].endswith("step-000002")  # written at the interrupt
    assert got["resumed_from"].endswith("step-000002") and got["steps"] == 4
    assert got["losses"] == want["losses"] and len(want["losses"]) == 4
    assert runs["rank1"][f"{name}-resumed"]["losses"] == want["losses"]
    assert got["warnings"] == []  # no changed setting
    assert got["checkpoint"] == runs["rank1"][f"{name}-resumed"]["checkpoint"]  # every rank knows the path
    want_state, got_state = _final(root, name), _final(root, f"{name}-resumed")
    _assert_bitwise(_tensors(got_state), _tensors(want_state))
    assert got_state.scheduler == want_state.scheduler
    assert got_state.state["data_position"] == want_state.state["data_position"]
    if name == "dp":
        assert got_state.master and not got_state.weights  # bf16 parameters: only their fp32 masters
        assert len(got_state.rng["ranks"]) == WORLD
    metrics = [json.loads(line) for line in (root / f"{name}-resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]  # rank 0 alone wrote them, the dropped step is gone


def test_checkpoint_of_step_0_resumes_exactly(runs):
    """Before the first update the optimizer has no state: resuming must not invent one (a step of zero
    gradients, as torch.distributed.checkpoint does to initialize it, would shift AdamW's bias correction)."""
    rank0 = runs["rank0"]
    assert rank0["dp-step0"]["checkpoint"].endswith("step-000000") and rank0["dp-step0"]["steps"] == 0
    assert rank0["dp-step0-resumed"]["killed_at_step"] == 3
    got = load_checkpoint(runs["root"] / "dp-step0" / "checkpoints" / "step-000002")
    want = load_checkpoint(runs["root"] / "dp" / "checkpoints" / "step-000002")
    _assert_bitwise(_tensors(got), _tensors(want))
    assert got.state["losses"] == rank0["dp"]["losses"][:2]


def test_checkpoint_format_is_the_single_process_one(runs):
    """Whole tensors under the parameter names, the optimizer state by index: as one process writes."""
    one, tp = (load_checkpoint(runs["root"] / name / "checkpoints" / "step-000002") for name in ("one", "tp"))
    assert one.weights.keys() == tp.weights.keys() and not one.master and not tp.master
    for name in one.weights:
        assert one.weights[name].shape == tp.weights[name].shape, name
    kernels = ("foreach",)  # tp mixes DTensor and plain tensors: no foreach kernels (not saved state)
    assert [{k: v for k, v in g.items() if k not in kernels} for g in one.optimizer["param_groups"]] == \
        [{k: v for k, v in g.items() if k not in kernels} for g in tp.optimizer["param_groups"]]
    assert one.optimizer["state"].keys() == tp.optimizer["state"].keys()
    assert tp.state["parallel"] == {"tp": 2, "dp": 1} and one.state["parallel"] == {"tp": 1, "dp": 1}


@pytest.mark.parametrize("name, reference", [("tp-to-dp", "tp"), ("one-to-tp", "one"), ("tp-to-one", "tp")])
def test_checkpoint_resumes_with_another_layout(runs, name, reference):
    """tp=2 -> dp=2 (2 x 1 sequences per step instead of 1 x 2), 1 process -> tp=2, tp=2 -> 1 process."""
    rank0 = runs["rank0"]
    got, want = rank0[name]["losses"], rank0[reference]["losses"]
    assert len(got) == 4
    assert got[:2] == want[:2]  # the checkpoint's losses, carried over
    assert got == pytest.approx(want, rel=1e-5)
    if name != "tp-to-one":
        assert rank0[name]["warnings"] == []  # the same sequences per step: not a changed setting
    got_state, want_state = _final(runs["root"], name), _final(runs["root"], reference)
    for key, tensor in _tensors(want_state).items():
        assert (_tensors(got_state)[key] - tensor).abs().max() <= LAYOUT_ATOL, key


def test_mismatched_checkpoint_and_offload_are_refused_on_every_rank(runs):
    for rank in ("rank0", "rank1"):
        assert runs[rank]["lora-mismatch"]["raised"].startswith("ValueError: checkpoint ")
        assert "does not match this model" in runs[rank]["lora-mismatch"]["raised"]
        assert runs[rank]["offload"]["raised"].startswith(
            "NotImplementedError: optim.offload is not supported with several processes")

