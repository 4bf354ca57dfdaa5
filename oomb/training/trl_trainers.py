"""TRL's DPOTrainer and GRPOTrainer with oomb's shared-context step: one line changes.

    from oomb import OOMBDPOTrainer as DPOTrainer      # or OOMBGRPOTrainer as GRPOTrainer
    trainer = DPOTrainer(..., oomb_config=OOMBConfig(chunk_size=4096))

Only ``training_step`` is replaced, as for OOMBSFTTrainer (hf_trainer.py): TRL builds the batch (DPO's
collator, GRPO's generation, rewards, advantages and its old/reference log-probabilities, all untouched),
then each prompt of the micro-batch runs once through :func:`oomb.shared_context_backward` with its
continuations (DPO: the pair's chosen and rejected; GRPO: the micro-batch's completions of that prompt),
under a ``loss_fn`` that is TRL's loss term for those rows, scaled as TRL scales it for gradient
accumulation. The losses are sums over rows of per-row terms (DPO's per-pair mean, GRPO's per-sequence or
per-token normalizations with batch-level constants), so the gradients add up to TRL's exactly; the
returned loss is what TRL's training step returns. Optimizer, scheduler, callbacks, logging,
checkpointing, evaluation (TRL's own forward) run unchanged.

Rows are read from TRL's padded batch: the prompt is each row's tokens before its completion mask, the
continuation its completion up to the last counted token (padding and, in GRPO, tokens after EOS are
dropped: causal attention never lets a counted label see them). Positions start at 0 in every row, as
in TRL's right-padded DPO batch; GRPO's left-padded prompts shift TRL's positions by the padding, which
rotary embeddings leave invisible (relative positions), up to float rounding.

Refused, each with the option named: the loss types and options below whose loss is not a per-row term
of the continuations' log-probabilities, or needs full logits (entropies, WPO weights); temperature
other than 1 in GRPO; vLLM's importance-sampling correction; MoE auxiliary losses; vision inputs; more
than one process.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import torch
from torch import nn

from ..config import OOMBConfig
from ..loss import IGNORE_INDEX
from ..shared_context import ContinuationLogProbs, dpo_sigmoid_loss, shared_context_backward, shared_context_logprobs
from .hf_trainer import attach_config, check_runtime, disable_hf_checkpointing, warn_mixed_precision

DPO_LOSS_TYPES = ("sigmoid",)
"""DPOTrainer loss types oomb's DPO step computes."""
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
"""GRPOTrainer loss types oomb's GRPO step computes (clipped token-level importance ratios)."""
DPO_KEYS = frozenset({"input_ids", "attention_mask", "completion_mask", "ref_chosen_logps", "ref_rejected_logps"})
"""DPO batch keys oomb's step reads."""
GRPO_KEYS = frozenset({"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                       "num_items_in_batch", "old_per_token_logps", "ref_per_token_logps", "tool_mask"})
"""GRPO batch keys oomb's step reads."""


def _refuse(trainer_name: str, what: str, fix: str) -> None:
    raise ValueError(f"{trainer_name} with oomb's step does not support {what}: {fix}")


def _check_common(trainer, name: str) -> None:
    check_runtime(trainer)
    if trainer.args.world_size > 1:
        _refuse(name, f"{trainer.args.world_size} processes", "run one process (oomb's shared-context step has not "
                "been checked under DDP yet)")
    if getattr(trainer, "_is_vlm", False) or getattr(trainer, "_is_vision_dataset", False):
        _refuse(name, "vision-language models or datasets", "use a text model and dataset")
    if getattr(trainer, "aux_loss_enabled", False):
        _refuse(name, "a MoE auxiliary loss (router_aux_loss_coef)", "set router_aux_loss_coef=0")


def _check_batch(inputs: dict[str, Any], known: frozenset, name: str) -> None:
    unknown = sorted(k for k, v in inputs.items() if k not in known and v is not None)
    if unknown:
        raise ValueError(f"{name}: the batch has keys oomb's step does not use: {unknown}; it reads {sorted(known)} "
                         "(multimodal inputs are not supported)")


def _prefix(mask: torch.Tensor, what: str) -> int:
    """Length of the leading run of ones of a 0/1 row, refusing any one after a zero."""
    n = int(mask.sum())
    if not bool(mask[:n].all()):
        raise ValueError(f"{what} is not contiguous (ones, then zeros): oomb's step reads each row as prompt, then "
                         "completion, then padding")
    return n


def _start(trainer, model: nn.Module, inputs: dict[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
    """What Trainer.training_step does before its forward: train mode, the batch prepared (GRPO: generated)."""
    model.train()
    if hasattr(trainer.optimizer, "train") and callable(trainer.optimizer.train):
        trainer.optimizer.train()
    inputs = trainer._prepare_inputs(inputs)
    unwrapped = trainer.accelerator.unwrap_model(model)
    warn_mixed_precision(trainer, unwrapped)
    return unwrapped, inputs


def _empty_cache(trainer) -> None:
    steps = trainer.args.torch_empty_cache_steps
    if steps is not None and trainer.state.global_step % steps == 0 and torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------- DPO

def check_dpo_trainer(trainer) -> None:
    """Refuse, before training, the DPOTrainer options oomb's DPO step cannot reproduce."""
    name = "DPOTrainer"
    _check_common(trainer, name)
    if list(trainer.loss_types) != ["sigmoid"]:
        _refuse(name, f"loss_type={list(trainer.loss_types)}", f"use loss_type={list(DPO_LOSS_TYPES)} (the DPO "
                "sigmoid loss), or TRL's own DPOTrainer")
    if trainer.f_divergence_type != "reverse_kl":
        _refuse(name, f"f_divergence_type={trainer.f_divergence_type!r}", "use 'reverse_kl' (standard DPO)")
    if trainer.ld_alpha is not None:
        _refuse(name, f"ld_alpha={trainer.ld_alpha}", "set ld_alpha=None")
    if trainer.use_weighting:
        _refuse(name, "use_weighting=True (WPO weights need the full logits)", "set use_weighting=False")


def preference_pairs(inputs: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(prompt, chosen, rejected) token tensors of each pair of a DPO batch (rows: the P chosen, then the P
    rejected; right-padded; completion_mask marks each completion)."""
    ids, attention, completion = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"]
    if ids.shape[0] % 2:
        raise ValueError(f"a DPO batch has an even number of rows (chosen, then rejected), got {ids.shape[0]}")
    rows = []
    for i in range(ids.shape[0]):
        length = _prefix(attention[i], "a DPO row's attention_mask")
        prompt = length - int(completion[i, :length].sum())
        _prefix(1 - completion[i, :length], "a DPO row's completion_mask")  # zeros (prompt), then ones
        rows.append((ids[i, :prompt], ids[i, prompt:length]))
    pairs = []
    half = len(rows) // 2
    for (prompt, chosen), (other, rejected) in zip(rows[:half], rows[half:], strict=True):
        if not torch.equal(prompt, other):
            raise ValueError("a pair's chosen and rejected rows have different prompts (keep_end truncation cut them "
                             "differently): use truncation_mode='keep_start' or max_length=None")
        if prompt.numel() == 0:
            raise ValueError("a DPO example has an empty prompt: oomb's step needs a context to share")
        if chosen.numel() == 0 or rejected.numel() == 0:
            raise ValueError("a DPO completion is empty after truncation: raise max_length")
        pairs.append((prompt, chosen, rejected))
    return pairs


def _dpo_reference(trainer, inputs: dict[str, Any], pairs: list) -> torch.Tensor:
    """(P, 2) the reference model's summed log-probabilities of each pair's chosen and rejected."""
    if trainer.precompute_ref_logps:
        return torch.stack([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]], 1).float()
    if trainer.ref_model is not None:
        model, adapter = trainer.accelerator.unwrap_model(trainer.ref_model), contextlib.nullcontext()
    else:  # PEFT: the reference is the base model, or the adapter's initial copy "ref" (as TRL)
        from trl.trainer.utils import use_adapter

        model = trainer.accelerator.unwrap_model(trainer.model)
        adapter = use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None)
    with adapter:
        return torch.stack([shared_context_logprobs(model, prompt, [chosen, rejected], config=trainer.oomb_config,
                                                    host_slabs=trainer._oomb_host_slabs).sums
                            for prompt, chosen, rejected in pairs])


def dpo_training_step(trainer, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
    """``DPOTrainer.training_step`` through oomb: each pair's prompt runs once for its chosen and rejected.

    TRL's loss is the mean over the P pairs of -logsigmoid(beta * margin), times the loss weight, divided by
    the gradient accumulation steps; pair p's shared-context step back-propagates its term of that sum."""
    unwrapped, inputs = _start(trainer, model, inputs)
    _check_batch(inputs, DPO_KEYS, "DPOTrainer")
    pairs = preference_pairs(inputs)
    reference = _dpo_reference(trainer, inputs, pairs)  # (P, 2)
    factor = trainer.loss_weights[0] / (len(pairs) * trainer.current_gradient_accumulation_steps)
    policy = []
    loss = torch.zeros((), dtype=torch.float32, device=reference.device)
    for (prompt, chosen, rejected), ref in zip(pairs, reference, strict=True):
        def loss_fn(logps: ContinuationLogProbs, ref=ref) -> torch.Tensor:
            policy.append(logps.sums.detach())
            return dpo_sigmoid_loss(logps, ref, trainer.beta) * factor

        loss += shared_context_backward(unwrapped, prompt, [chosen, rejected], config=trainer.oomb_config,
                                        loss_fn=loss_fn, host_slabs=trainer._oomb_host_slabs)
    _log_dpo_metrics(trainer, inputs, torch.stack(policy), reference)
    _empty_cache(trainer)
    return loss.detach()


def _log_dpo_metrics(trainer, inputs: dict[str, Any], policy: torch.Tensor, reference: torch.Tensor) -> None:
    """DPOTrainer's training metrics that need no full logits (entropy, logits/* and mean_token_accuracy do)."""
    metrics, gather = trainer._metrics["train"], trainer.accelerator.gather
    tokens = trainer.accelerator.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
    trainer._total_train_tokens += tokens // trainer._tp_size
    metrics["num_tokens"] = [trainer._total_train_tokens]
    rewards = trainer.beta * (policy - reference.to(policy.device))  # (P, 2)
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    metrics["rewards/chosen"].append(gather(chosen).mean().item())
    metrics["rewards/rejected"].append(gather(rejected).mean().item())
    metrics["rewards/accuracies"].append(gather((chosen > rejected).float()).mean().item())
    metrics["rewards/margins"].append(gather(chosen - rejected).mean().item())
    metrics["logps/chosen"].append(gather(policy[:, 0]).mean().item())
    metrics["logps/rejected"].append(gather(policy[:, 1]).mean().item())


# ---------------------------------------------------------------------------------------------------- GRPO

def check_grpo_trainer(trainer) -> None:
    """Refuse, before training, the GRPOTrainer options oomb's GRPO step cannot reproduce."""
    name, args = "GRPOTrainer", trainer.args
    _check_common(trainer, name)
    if trainer.loss_type not in GRPO_LOSS_TYPES:
        _refuse(name, f"loss_type={trainer.loss_type!r}", f"use one of {list(GRPO_LOSS_TYPES)}, or TRL's own "
                "GRPOTrainer")
    if trainer.importance_sampling_level != "token":
        _refuse(name, f"importance_sampling_level={trainer.importance_sampling_level!r}", "use 'token'")
    if trainer.temperature != 1.0:
        _refuse(name, f"temperature={trainer.temperature} (TRL divides the loss's logits by it)",
                "sample at temperature=1.0")
    if args.cast_lm_head_to_fp32:
        _refuse(name, "cast_lm_head_to_fp32=True", "load the model in float32, or set it to False")
    if trainer.use_vllm:
        _refuse(name, "use_vllm=True (vLLM generation and its importance-sampling correction)",
                "generate with transformers (use_vllm=False)")
    if trainer.top_entropy_quantile < 1.0 or trainer._entropy_bonus_enabled:
        _refuse(name, "entropy masks or bonuses (top_entropy_quantile < 1, entropy_coef, use_adaptive_entropy): the "
                "entropies need the full logits", "leave them at their defaults")
    if trainer.off_policy_mask_threshold is not None:
        _refuse(name, f"off_policy_mask_threshold={trainer.off_policy_mask_threshold}", "set it to None")


def completion_groups(inputs: dict[str, Any]) -> list[tuple[torch.Tensor, list[int], list[int]]]:
    """The micro-batch's rows grouped by prompt: (prompt tokens, row indices, each row's completion length up to
    its last counted token). Rows with no counted token are left out (their loss term is 0)."""
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_mask = inputs["completion_mask"]
    counted = _grpo_mask(inputs)
    groups: dict[tuple, tuple[torch.Tensor, list[int], list[int]]] = {}
    for i in range(prompt_ids.shape[0]):
        n = _prefix(completion_mask[i], "a GRPO completion_mask")
        nonzero = counted[i, :n].nonzero()
        if nonzero.numel() == 0:
            continue
        prompt = prompt_ids[i, prompt_mask[i].bool()]  # left padding removed
        if prompt.numel() == 0:
            raise ValueError("a GRPO prompt is empty: oomb's step needs a context to share")
        _, rows, lengths = groups.setdefault(tuple(prompt.tolist()), (prompt, [], []))
        rows.append(i)
        lengths.append(int(nonzero[-1]) + 1)
    return list(groups.values())


def _grpo_mask(inputs: dict[str, Any]) -> torch.Tensor:
    """(B, C) the counted completion tokens, as TRL's loss masks them (tool outputs excluded)."""
    mask = inputs["completion_mask"]
    return mask if inputs.get("tool_mask") is None else mask * inputs["tool_mask"]


def _grpo_normalizer(trainer, inputs: dict[str, Any]) -> tuple[bool, float]:
    """(per_sequence, N): TRL's loss is sum over rows of (per-row mean, if per_sequence, else per-row sum) / N,
    N including the division by the gradient accumulation steps."""
    accumulation = trainer.current_gradient_accumulation_steps
    rows = inputs["completion_ids"].shape[0]
    if trainer.loss_type == "grpo":
        return True, rows * accumulation
    if trainer.loss_type == "bnpo":
        return False, float(_grpo_mask(inputs).sum().clamp(min=1.0)) * accumulation
    if trainer.loss_type == "dr_grpo":
        return False, rows * trainer.max_completion_length * accumulation
    assert trainer.loss_type == "dapo", trainer.loss_type
    items = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
    return False, float(items) * accumulation / trainer.args.steps_per_generation


def grpo_rows_loss(trainer, logps: ContinuationLogProbs, inputs: dict[str, Any], rows: list[int],
                   per_sequence: bool, normalizer: float, stats: list | None = None) -> torch.Tensor:
    """TRL's GRPO loss terms of ``rows`` (GRPOTrainer._compute_loss, token-level clipped ratios, optional KL).
    ``stats``: gets (K, 5) per-row counted tokens and masked sums of low-, high-, region-clipped and KL."""
    tokens, mask = logps.tokens, logps.mask  # (K, L), L <= the batch's completion width
    width = tokens.shape[1]
    advantages = inputs["advantages"][rows].to(tokens.dtype)
    advantages = advantages[:, None] if advantages.dim() == 1 else advantages[:, :width]
    old = inputs.get("old_per_token_logps")
    old = tokens.detach() if old is None else old[rows, :width]
    coef_1 = torch.exp(tokens - old)
    if trainer.beta != 0.0:
        reference = inputs["ref_per_token_logps"][rows, :width]
        per_token_kl = torch.exp(reference - tokens) - (reference - tokens) - 1
        if trainer.args.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    coef_2 = torch.clamp(coef_1, 1 - trainer.epsilon_low, 1 + trainer.epsilon_high)
    if trainer.args.delta is not None:
        coef_1 = torch.clamp(coef_1, max=trainer.args.delta)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if trainer.beta != 0.0:
        per_token_loss = per_token_loss + trainer.beta * per_token_kl
    if stats is not None:
        with torch.no_grad():
            low = (coef_1 < 1 - trainer.epsilon_low) & (advantages < 0)
            high = (coef_1 > 1 + trainer.epsilon_high) & (advantages > 0)
            kl = per_token_kl if trainer.beta != 0.0 else torch.zeros_like(tokens)
            stats.append(torch.stack([mask.sum(-1).float(), (low & mask).sum(-1).float(), (high & mask).sum(-1).float(),
                                      ((low | high) & mask).sum(-1).float(), (kl * mask).sum(-1)], 1))
    per_row = (per_token_loss * mask).sum(-1)
    if per_sequence:
        per_row = per_row / mask.sum(-1).clamp(min=1.0)
    return per_row.sum() / normalizer


def grpo_training_step(trainer, model: nn.Module, inputs: dict[str, Any],
                       num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
    """``GRPOTrainer.training_step`` through oomb: TRL generates and scores (``_prepare_inputs``), then each
    prompt of the micro-batch runs once for its completions; returns TRL's (accumulation-scaled) loss."""
    before = time.perf_counter()
    unwrapped, inputs = _start(trainer, model, inputs)
    _check_batch(inputs, GRPO_KEYS, "GRPOTrainer")
    per_sequence, normalizer = _grpo_normalizer(trainer, inputs)
    completion_ids = inputs["completion_ids"]
    counted = _grpo_mask(inputs)
    loss = torch.zeros((), dtype=torch.float32, device=completion_ids.device)
    stats: list[torch.Tensor] = []
    for prompt, rows, lengths in completion_groups(inputs):
        continuations = [completion_ids[i, :n] for i, n in zip(rows, lengths, strict=True)]
        labels = [completion_ids[i, :n].masked_fill(counted[i, :n] == 0, IGNORE_INDEX)
                  for i, n in zip(rows, lengths, strict=True)]

        def loss_fn(logps: ContinuationLogProbs, rows=rows) -> torch.Tensor:
            return grpo_rows_loss(trainer, logps, inputs, rows, per_sequence, normalizer, stats)

        loss += shared_context_backward(unwrapped, prompt, continuations, labels, config=trainer.oomb_config,
                                        loss_fn=loss_fn, host_slabs=trainer._oomb_host_slabs)
    if stats:
        _log_grpo_metrics(trainer, torch.cat(stats))
    _empty_cache(trainer)
    # GRPOTrainer.training_step's own bookkeeping (its step counter drives generation)
    trainer._step += 1
    trainer._current_train_step_time += time.perf_counter() - before
    if trainer._step % trainer.current_gradient_accumulation_steps == 0:
        trainer._metrics["train"]["step_time"].append(trainer._current_train_step_time)
        trainer._current_train_step_time = 0.0
    return loss.detach()


def _log_grpo_metrics(trainer, stats: torch.Tensor) -> None:
    """GRPOTrainer's loss-side metrics that need no full logits (``entropy`` does): clip ratios, KL."""
    metrics = trainer._metrics["train"]
    totals = trainer.accelerator.reduce(stats.sum(0), reduction="sum")
    count = totals[0].clamp(min=1.0)
    if trainer.beta != 0.0:
        metrics["kl"].append((totals[4] / count).item())
    metrics["clip_ratio/low_mean"].append((totals[1] / count).item())
    metrics["clip_ratio/high_mean"].append((totals[2] / count).item())
    metrics["clip_ratio/region_mean"].append((totals[3] / count).item())
    per_row = stats[:, 1:3] / stats[:, :1]  # rows with no counted token are not in stats (TRL's nanmin/nanmax)
    metrics["clip_ratio/low_min"].append(trainer.accelerator.gather(per_row[:, 0]).min().item())
    metrics["clip_ratio/high_max"].append(trainer.accelerator.gather(per_row[:, 1]).max().item())


# ------------------------------------------------------------------------------------------- the classes

class _OOMBTRLMixin:
    """Put first in the bases of TRL's DPOTrainer or GRPOTrainer: its training step becomes oomb's."""

    oomb_config: OOMBConfig
    _oomb_check = staticmethod(lambda trainer: None)
    _oomb_step = staticmethod(lambda trainer, model, inputs, num_items_in_batch: None)

    def __init__(self, *args: Any, oomb_config: OOMBConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        attach_config(self, oomb_config)
        type(self)._oomb_check(self)
        disable_hf_checkpointing(self)

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        return type(self)._oomb_step(self, model, inputs, num_items_in_batch)


_TRL_MISSING = "{} needs TRL: pip install 'oomb[trl]' (or pip install trl)"


@functools.cache
def _make_trainer(name: str) -> type:
    """OOMBDPOTrainer or OOMBGRPOTrainer, built once on first use (TRL, a heavy optional import, is imported here)."""
    try:
        import trl
    except ImportError as err:
        raise ImportError(_TRL_MISSING.format(name)) from err
    if name == "OOMBDPOTrainer":
        base, check, step = trl.DPOTrainer, check_dpo_trainer, dpo_training_step
        doc = """TRL ``DPOTrainer`` whose training step is oomb's shared-context step (``oomb_config=``): each
        pair's prompt runs once for its chosen and rejected completions; loss_type "sigmoid".

        Its metrics ``entropy``, ``logits/*`` and ``mean_token_accuracy`` need full logits and are not logged
        during training; ``rewards/*``, ``logps/*`` and ``num_tokens`` are."""
    else:
        base, check, step = trl.GRPOTrainer, check_grpo_trainer, grpo_training_step
        doc = """TRL ``GRPOTrainer`` whose loss step is oomb's shared-context step (``oomb_config=``): generation,
        rewards and advantages are TRL's; each prompt runs once for its completions in the micro-batch.

        Its ``entropy`` metric needs full logits and is not logged during training; ``kl`` and ``clip_ratio/*``
        are."""
    cls = type(name, (_OOMBTRLMixin, base), {"__doc__": doc, "__module__": __name__, "__qualname__": name,
                                              "_oomb_check": staticmethod(check), "_oomb_step": staticmethod(step)})
    return cls


def __getattr__(name: str) -> Any:
    if name in ("OOMBDPOTrainer", "OOMBGRPOTrainer"):
        return _make_trainer(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
