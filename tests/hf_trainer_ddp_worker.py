"""Worker of tests/test_hf_trainer.py's DDP test: one rank of a 2-process gloo group under torchrun.

Trains the same tiny model with the plain ``transformers.Trainer`` and with ``OOMBTrainer`` (DDP through
accelerate, gradient accumulation 2, token counts gathered over the ranks) and writes, on rank 0, the
logged losses and the largest weight difference to the JSON file named by argv[1].
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
from helpers import build_tiny_model, end_distributed_worker
from test_hf_trainer import STEP, logged, right_padded, token_lists, training_args
from transformers import Trainer, TrainerCallback

from oomb import OOMBTrainer
from oomb.training import hf_trainer as hft


class CountDDPReductions(TrainerCallback):
    """Counts the buckets DDP's own reducer all-reduces (a communication hook on the wrapped model)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.buckets = 0

    def on_step_begin(self, args, state, control, **kwargs):
        ddp = self.trainer.model_wrapped
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and not getattr(ddp, "_counted", False):
            ddp.register_comm_hook(None, self.hook)
            ddp._counted = True

    def hook(self, state, bucket):
        self.buckets += 1
        tensor = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def main(out: str) -> None:
    warnings.filterwarnings("ignore")
    data = [{"input_ids": x} for x in token_lists(16, seed=11)]
    reductions = []
    real_reduce = hft.all_reduce_mean_gradients

    def counting_reduce(params, group):  # how often oomb syncs: once per optimizer step
        reductions.append(len(params))
        real_reduce(params, group)

    hft.all_reduce_mean_gradients = counting_reduce
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cls, extra in (("plain", Trainer, {}), ("oomb", OOMBTrainer, {"oomb_config": STEP})):
            counter = CountDDPReductions()
            trainer = cls(model=build_tiny_model("llama"), args=training_args(f"{tmp}/{name}", max_steps=2),
                          train_dataset=data, data_collator=right_padded, callbacks=[counter], **extra)
            counter.trainer = trainer
            trainer.train()
            runs[name] = trainer
            runs[name + "_buckets"] = counter.buckets
    plain, ours = runs["plain"], runs["oomb"]
    s0, s1 = plain.model.state_dict(), ours.model.state_dict()
    worst = max((s0[k] - s1[k]).abs().max().item() for k in s0)
    # the replicas must agree with each other, too
    flat = torch.cat([p.detach().reshape(-1) for p in ours.model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    result = {
        "world": dist.get_world_size(),
        "distributed_type": str(ours.accelerator.distributed_type),
        "ddp": type(ours.model_wrapped).__name__,
        "plain": [h["loss"] for h in logged(plain)],
        "oomb": [h["loss"] for h in logged(ours)],
        "plain_grad_norm": [h["grad_norm"] for h in logged(plain)],
        "oomb_grad_norm": [h["grad_norm"] for h in logged(ours)],
        "worst": worst,
        "replica_gap": (gathered[0] - gathered[1]).abs().max().item(),
        "reductions": len(reductions),
        "plain_ddp_buckets": runs["plain_buckets"],
        "oomb_ddp_buckets": runs["oomb_buckets"],
    }
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    end_distributed_worker(barrier=True)


if __name__ == "__main__":
    main(sys.argv[1])
