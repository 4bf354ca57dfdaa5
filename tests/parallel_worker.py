"""Worker of tests/test_parallel.py: one process of a 2-rank group (gloo on the CPU, NCCL on GPUs).

Each scenario builds the same tiny model on every rank, computes the single-process reference (a
full-sequence Hugging Face backward), parallelizes a copy, runs oomb's step and reports the
relative error of the gathered gradients. Rank 0's results go to a JSON file the test reads.
``train`` runs whole ``oomb.Trainer`` runs instead (tests/test_parallel_resume.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from helpers import build_tiny_model, grads, hf_step, random_ids, relative_error, run_distributed_worker

from oomb import OOMBConfig, forward_backward
from oomb.config import PerformanceConfig
from oomb.parallel import full_tensor, setup_parallel

TOKENS = 80  # 3 chunks of 32 (the last one partial), pages of 16
CONFIG = OOMBConfig(chunk_size=32, page_size=16, performance=PerformanceConfig(backend="torch"))
OFFLOAD = CONFIG.with_options({"offload.enabled": True, "offload.stream_block_pages": 1})


def _gathered_grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else full_tensor(p.grad).detach().clone() for n, p in model.named_parameters()}


def tensor_parallel(rank: int, device: torch.device, family: str, config: OOMBConfig = CONFIG,
                    **overrides) -> dict:
    """TP=2: gradients of every parameter (gathered) against the full-sequence HF backward."""
    reference = build_tiny_model(family, **overrides).to(device)
    ids = random_ids(1, TOKENS, seed=3).to(device)
    want_loss = float(hf_step(reference, ids, ids))
    model = build_tiny_model(family, **overrides).to(device)
    setup = setup_parallel(model, tp=2)
    loss = forward_backward(model, ids, config=config, parallel=setup)
    got, want = _gathered_grads(model), grads(reference)
    probe = model.lm_head(torch.zeros(1, 3, model.config.hidden_size, device=device))  # (1, 3, V) logits of this rank
    embed = "model.embed_tokens.weight"
    return {
        "error": relative_error(got, want),
        # Wrong without the all-reduce of column-parallel layers' input gradients.
        "embedding_error": relative_error({embed: got[embed]}, {embed: want[embed]}),
        "loss": float(loss), "want_loss": want_loss,
        "local_kv_heads": setup.local_kv_heads(model.config.num_key_value_heads),
        "k_proj_local_rows": model.model.layers[0].self_attn.k_proj.weight.to_local().shape[0],
        "logits_local_vocab": probe.to_local().shape[-1] if hasattr(probe, "to_local") else probe.shape[-1],
    }


def data_parallel(rank: int, device: torch.device, family: str, config: OOMBConfig = CONFIG,
                  **overrides) -> dict:
    """DP=2: rank r trains on sequence r; the reduced gradients equal one backward over both."""
    reference = build_tiny_model(family, **overrides).to(device)
    ids = random_ids(2, TOKENS, seed=4).to(device)
    want_loss = float(hf_step(reference, ids, ids))  # mean over both sequences' tokens (equal counts)
    model = build_tiny_model(family, **overrides).to(device)
    setup = setup_parallel(model, dp=2)
    with _counting_fsdp_collectives() as calls:
        loss = forward_backward(model, ids[rank:rank + 1], config=config, parallel=setup)
    got = _gathered_grads(model)
    return {"error": relative_error(got, grads(reference)), "loss": setup.all_mean(float(loss)),
            "want_loss": want_loss, "param_type": type(model.lm_head.weight).__name__, "collectives": calls,
            # layers, the decoder's own weights, the head (one unit with the decoder's when tied)
            "fsdp_groups": model.config.num_hidden_layers + (1 if model.config.tie_word_embeddings else 2)}


def data_parallel_accumulation(rank: int, device: torch.device, family: str) -> dict:
    """DP=2 with 2 accumulated steps per rank: one reduction for both; gradients of all 4 sequences."""
    reference = build_tiny_model(family).to(device)
    ids = random_ids(4, TOKENS, seed=5).to(device)
    for i in range(4):  # each sequence's mean loss, summed: what 2 ranks x 2 accumulated steps give x 2
        loss = reference(input_ids=ids[i:i + 1], labels=ids[i:i + 1]).loss / 2
        loss.backward()
    model = build_tiny_model(family).to(device)
    setup = setup_parallel(model, dp=2)
    with _counting_fsdp_collectives() as calls:
        for micro in range(2):
            row = 2 * rank + micro
            forward_backward(model, ids[row:row + 1], config=CONFIG, parallel=setup, sync_gradients=micro == 1)
    return {"error": relative_error(_gathered_grads(model), grads(reference)), "collectives": calls,
            "fsdp_groups": model.config.num_hidden_layers + 2}


# FSDP2's collectives by torch version: torch >= 2.12 calls the *_single functions, earlier ones
# all_gather_into_tensor / reduce_scatter_tensor (torch 2.11 on the GPU machines).
_FSDP_COLLECTIVES = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
                     "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor")}


@contextlib.contextmanager
def _counting_fsdp_collectives():
    """Count FSDP2's all-gathers and reduce-scatters (it looks them up on torch.distributed per call)."""
    counts = dict.fromkeys(_FSDP_COLLECTIVES, 0)
    originals = {}
    for kind, candidates in _FSDP_COLLECTIVES.items():
        name = next(n for n in candidates if hasattr(dist, n))
        originals[name] = getattr(dist, name)

        def call(*args, _kind=kind, _original=originals[name], **kwargs):
            counts[_kind] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, call)
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


SCENARIOS = {
    "tp_llama_gqa": lambda rank, device: tensor_parallel(rank, device, "llama"),  # 4 heads, 2 KV heads
    # q/k/v biases and a tied head:
    "tp_qwen2_tied": lambda rank, device: tensor_parallel(rank, device, "qwen2", tie_word_embeddings=True),
    "dp_llama": lambda rank, device: data_parallel(rank, device, "llama"),
    "dp_qwen3": lambda rank, device: data_parallel(rank, device, "qwen3"),  # q/k norms, head_dim 32
    "dp_qwen2_tied": lambda rank, device: data_parallel(rank, device, "qwen2", tie_word_embeddings=True),
    "dp_llama_accumulation": lambda rank, device: data_parallel_accumulation(rank, device, "llama"),
    # Host offload with each rank's own KV heads (TP) or its own sequence (DP).
    "tp_llama_offload": lambda rank, device: tensor_parallel(rank, device, "llama", OFFLOAD),
    "dp_llama_offload": lambda rank, device: data_parallel(rank, device, "llama", OFFLOAD),
}


class ProcessKilledError(Exception):
    """Stands for the processes dying in a step: nothing is saved."""


def train_job(job: dict) -> dict:
    """One ``oomb.Trainer`` run of a parallel resume test. ``job``: ``config`` (TrainerConfig.from_dict),
    and optionally ``kill_at`` (the forward_backward call, counted from 1, at which every rank dies)
    or ``interrupt_at`` (... at which every rank gets a KeyboardInterrupt, as from Ctrl-C)."""
    import logging

    import oomb.training.trainer
    from oomb.training.config import TrainerConfig
    from oomb.training.trainer import Trainer

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("oomb").addHandler(handler)
    real, calls = oomb.training.trainer.forward_backward, []

    def forward_backward(*args, **kwargs):
        calls.append(1)
        if len(calls) == job.get("kill_at"):
            raise ProcessKilledError
        if len(calls) == job.get("interrupt_at"):
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    oomb.training.trainer.forward_backward = forward_backward
    trainer = Trainer(TrainerConfig.from_dict(job["config"]))
    try:
        result = trainer.train()
        return {"losses": result.losses, "steps": result.steps, "interrupted": result.interrupted,
                "resumed_from": result.resumed_from, "checkpoint": result.checkpoint, "warnings": warnings}
    except ProcessKilledError:
        return {"killed_at_step": trainer.step + 1, "warnings": warnings}
    except Exception as err:  # an expected refusal; the test checks the message on every rank
        return {"raised": f"{type(err).__name__}: {err}", "warnings": warnings}
    finally:
        oomb.training.trainer.forward_backward = real
        logging.getLogger("oomb").removeHandler(handler)


def train(rank: int, world: int, port: int, out_dir: str, jobs: list[dict], device_type: str = "cpu") -> None:
    """Entry point of torch.multiprocessing.spawn: the Trainer runs ``jobs`` in order, in one group
    (the jobs' configs say train.device=cuda on GPUs)."""
    by_name = {job["name"]: job for job in jobs}
    run_distributed_worker(rank, world, port, out_dir, list(by_name), lambda name, device: train_job(by_name[name]),
                           device_type)


def run(rank: int, world: int, port: int, out_dir: str, names: list[str], device_type: str = "cpu") -> None:
    """Entry point of torch.multiprocessing.spawn: every scenario named, each reported on its own."""
    run_distributed_worker(rank, world, port, out_dir, names, lambda name, device: SCENARIOS[name](rank, device),
                           device_type, stop_at_error=False)
