"""AdamW with float32 master weights, and the warmup + cosine learning-rate schedule.

Where trainable parameters are bfloat16/float16 (``optim.master_weights``), AdamW never sees them:

    model parameter p (bf16, device)  --.grad after each sequence, summed in fp32-->  master.grad
    AdamW.step() on the fp32 masters (so exp_avg, exp_avg_sq are fp32 too)
    master  --rounded copy-->  p

Small updates then accumulate in fp32 instead of vanishing in bf16 rounding. float32 parameters
(CPU runs, LoRA adapters, which PEFT keeps in fp32) are stepped directly. With ``optim.offload``
every trainable parameter gets a master in host memory and AdamW steps on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .config import OptimSection

LOW_PRECISION = (torch.bfloat16, torch.float16)


class MasterWeights:
    """The tensors AdamW updates: an fp32 master per low-precision (or offloaded) trainable parameter,
    else the parameter itself."""

    def __init__(self, model: nn.Module, enabled: bool, offload: bool) -> None:
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.masters: list[torch.Tensor | None] = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            master = None
            if self.needs_master(p, enabled, offload):
                device = torch.device("cpu") if offload else p.device
                master = p.detach().to(device=device, dtype=torch.float32, copy=True)
                if offload and p.is_cuda:
                    master = master.pin_memory()  # faster copies both ways
                # A Parameter (of no autograd graph: nothing computes with it) so that module() can
                # register it; requires_grad marks it trainable for torch.distributed.checkpoint.
                master = nn.Parameter(master, requires_grad=True)
            self.names.append(name)
            self.params.append(p)
            self.masters.append(master)

    @staticmethod
    def needs_master(p: torch.Tensor, enabled: bool, offload: bool) -> bool:
        return offload or (enabled and p.dtype in LOW_PRECISION)

    @classmethod
    def count(cls, model: nn.Module, enabled: bool, offload: bool) -> int:
        """Elements the masters of ``model`` would hold, without allocating them."""
        return sum(p.numel() for p in model.parameters() if p.requires_grad and cls.needs_master(p, enabled, offload))

    @property
    def optimizer_params(self) -> list[torch.Tensor]:
        return [p if m is None else m for p, m in zip(self.params, self.masters, strict=True)]

    @property
    def unmastered_names(self) -> list[str]:
        """Trainable parameters stepped directly (no master)."""
        return [n for n, m in zip(self.names, self.masters, strict=True) if m is None]

    @property
    def num_masters(self) -> int:
        return sum(m.numel() for m in self.masters if m is not None)

    def grad_targets(self) -> dict[nn.Parameter, torch.Tensor]:
        """Masters' fp32 .grad buffers on their parameter's device, for ``forward_backward(grad_targets=)``:
        every chunk's gradient is added there, the sum stays fp32, and no bf16 .grad or fp32 sum is kept besides."""
        targets = {}
        for p, m in zip(self.params, self.masters, strict=True):
            if m is not None and m.device == p.device:
                if m.grad is None:
                    m.grad = torch.zeros_like(m)
                targets[p] = m.grad
        return targets

    def step_sums(self) -> dict[nn.Parameter, torch.Tensor]:
        """float32 zeros for the low-precision parameters stepped directly (no master; plain tensors): given
        to every sequence of a step as gradient targets, they sum its sequences' gradients in float32 where a
        low-precision ``.grad`` would otherwise be rounded after each sequence and kept beside the next one's
        float32 sums (the weights' size again, which the memory check does not count). ``finish_sums``
        writes them into ``.grad`` once."""
        return {p: torch.zeros_like(p, dtype=torch.float32) for p, m in zip(self.params, self.masters, strict=True)
                if m is None and p.dtype in LOW_PRECISION and not isinstance(p, DTensor)}

    @staticmethod
    def finish_sums(sums: Mapping[nn.Parameter, torch.Tensor]) -> None:
        """Each parameter's step sum (step_sums), plus what its ``.grad`` held, rounded once into ``.grad``."""
        for p, total in sums.items():
            p.grad = (total if p.grad is None else total.add_(p.grad)).to(p.dtype)

    def collect(self) -> None:
        """After a sequence's backward: move the remaining gradients (host masters) into the masters' .grad."""
        for p, m in zip(self.params, self.masters, strict=True):
            if m is None or p.grad is None:
                continue
            grad = p.grad.to(device=m.device, dtype=torch.float32)
            if m.grad is None:
                m.grad = grad  # p.grad itself when already fp32 on the master's device: p lets go of it below
            else:
                m.grad.add_(grad)
            p.grad = None

    def scale_grads(self, factor: float) -> None:
        for t in self.optimizer_params:
            if t.grad is not None:
                t.grad.mul_(factor)

    def zero_grads(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            p.grad = None
            if m is not None:
                m.grad = None

    @torch.no_grad()
    def push(self) -> None:
        """Copy the updated masters into the model's parameters (rounding to their dtype)."""
        for p, m in zip(self.params, self.masters, strict=True):
            if m is not None:
                p.copy_(m, non_blocking=True)
        if any(p.is_cuda for p in self.params):
            torch.cuda.synchronize()  # pinned sources must not change before the copies finish

    def module(self) -> nn.Module:
        """The tensors AdamW updates (fp32 masters, else the parameters themselves) as the parameters
        of a module, under the model's names. With several processes, checkpoints go through
        torch.distributed.checkpoint's get/set_model_state_dict and get/set_optimizer_state_dict,
        which find an optimizer's tensors among a module's parameters: given the model, they would
        miss the masters (and save bf16 weights where fp32 ones are stepped)."""
        root = nn.Module()
        for name, tensor in zip(self.names, self.optimizer_params, strict=True):
            *path, leaf = name.split(".")
            module = root
            for part in path:  # plain modules along the model's path (its names are valid attributes)
                if part not in module._modules:
                    module.add_module(part, nn.Module())
                module = module._modules[part]
            module.register_parameter(leaf, tensor)
        return root

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: m for n, m in zip(self.names, self.masters, strict=True) if m is not None}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy masters in (``state`` may read each tensor lazily), then into the model."""
        expected = set(self.state_dict())
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ValueError(f"master weights do not match the model (missing {missing[:3]}, unexpected "
                             f"{extra[:3]}): was the checkpoint written with other optim.master_weights/offload "
                             "or model settings?")
        for n, m in zip(self.names, self.masters, strict=True):
            if m is not None:
                m.copy_(state[n])
        self.push()


def build_optimizer(masters: MasterWeights, options: OptimSection, lr: float) -> torch.optim.AdamW:
    """AdamW over the masters; matrices decay, vectors (biases, norms) do not. Fused on CUDA by default."""
    params = masters.optimizer_params
    decay = [t for t in params if t.dim() >= 2]
    no_decay = [t for t in params if t.dim() < 2]
    groups = [g for g in ({"params": decay, "weight_decay": options.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    if not groups:
        raise ValueError("the model has no trainable parameter: enable LoRA or unfreeze parameters")
    on_cuda = all(t.is_cuda for t in params)
    fused = options.fused if options.fused is not None else on_cuda
    kinds = {isinstance(t, DTensor) for t in params}
    if len(kinds) > 1:  # tensor parallel: sharded DTensors next to replicated plain tensors (norms, embeddings)
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(options.betas), eps=options.eps, foreach=False)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(options.betas), eps=options.eps, fused=fused or None)


def lr_factor(step: int, options: OptimSection, max_steps: int) -> float:
    """Multiplier of the peak lr before optimizer step ``step`` (0-based): linear warmup, then
    cosine down to ``min_lr_ratio`` at ``max_steps`` (or constant)."""
    warmup = options.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if options.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return options.min_lr_ratio + (1 - options.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, options: OptimSection,
                    max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:  # a plain function: LambdaLR's state_dict then holds only counters
        return lr_factor(step, options, max_steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
