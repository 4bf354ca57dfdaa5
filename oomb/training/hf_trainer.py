"""oomb's long-context step inside a Hugging Face ``Trainer`` or TRL ``SFTTrainer``: one line changes.

    from oomb import OOMBSFTTrainer as SFTTrainer      # or OOMBTrainer, or oomb.patch_trainer(trainer)
    trainer = SFTTrainer(..., oomb_config=OOMBConfig(chunk_size=4096))

Only ``Trainer.training_step`` is replaced (not ``compute_loss``: the Trainer back-propagates what
``compute_loss`` returns, and oomb's step back-propagates chunk by chunk itself). It runs
:func:`oomb.forward_backward` on the micro-batch and returns the detached loss, scaled exactly as the
Trainer scales its own, so gradient accumulation, clipping, the optimizer, the scheduler, callbacks,
logging, checkpointing and resuming run unchanged. Evaluation keeps the Trainer's ordinary forward;
``OOMBEvalCallback`` adds oomb's evaluation at length (perplexity by position, passkeys) every N steps.

Semantics kept (each one checked against the plain Trainer in tests/test_hf_trainer.py):
- Loss scaling: with ``num_items_in_batch`` (the Trainer counts the shifted labels of all micro-batches
  of an optimizer step, over all ranks with ``average_tokens_across_devices``) the micro-batch's
  loss is its token sum over that count (times the number of ranks, which DDP's mean undoes); without
  it, the micro-batch mean over the accumulation steps. oomb's step computes a mean over the
  micro-batch's own tokens; the ratio is applied to the gradient of the LM head's output, where every
  gradient of the loss starts, so no parameter gradient is rescaled after the fact.
- DDP: the Trainer wraps non-final micro-steps in accelerate's ``no_sync`` (DDP's
  ``require_backward_grad_sync`` off). oomb's step never calls DDP's forward, so DDP's reducer stays
  idle; after a step whose sync flag is on, the gradients are averaged over the ranks here, as DDP
  would (one all-reduce per bucket).
- Padding-free batches (TRL ``padding_free``, ``DataCollatorWithFlattening``): ``position_ids`` that restart
  at each document, or ``cu_seq_lens_q``, go to forward_backward, whose attention stays inside each document.
- Right-padded batches: with causal attention a real token never sees the padding after it, so its
  loss and gradient equal the masked model's. Refused: left padding or holes in ``attention_mask``,
  and counted labels predicted from padding positions (the plain model masks padding keys there and
  oomb cannot).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainerCallback

from ..config import OOMBConfig
from ..engine import forward_backward
from ..kv.offload import HostSlabs
from ..loss import GRADIENT_SCALE, IGNORE_INDEX, shift_labels
from ..models import unwrap_causal_lm
from ..moe import ROUTER_LOSS_FACTOR
from .config import EvalSection
from .evaluation import format_evaluation, run_evaluation

logger = logging.getLogger(__name__)

USED_KEYS = frozenset({"input_ids", "labels", "attention_mask", "position_ids", "shift_labels"})
"""Batch keys oomb's step reads."""
DERIVED_KEYS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"})
"""Keys of padding-free collators that repeat what ``position_ids`` says (document starts)."""
IGNORED_KEYS = frozenset({"use_cache", "return_dict", "token_type_ids"})
"""Keys the supported decoder-only models ignore in training."""
_BUCKET_BYTES = 64 * 2**20


@contextlib.contextmanager
def scaled_loss_gradient(model: nn.Module, scale: float) -> Iterator[None]:
    """Inside, every gradient of the LM loss is ``scale`` times larger: the LM head's output (the
    logits, the only way the loss depends on the parameters) passes its gradient on scaled. The LM head
    carries the factor (loss.GRADIENT_SCALE): the fused loss builds its gradient with it, autograd's loss
    scales the logits' gradient (loss.gradient_scale)."""
    if scale == 1.0:
        yield
        return
    head = unwrap_causal_lm(model).get_output_embeddings()
    previous = getattr(head, GRADIENT_SCALE, None)  # nested: the factors multiply
    setattr(head, GRADIENT_SCALE, (1.0 if previous is None else previous) * scale)
    try:
        yield
    finally:
        if previous is None:
            delattr(head, GRADIENT_SCALE)
        else:
            setattr(head, GRADIENT_SCALE, previous)


@contextlib.contextmanager
def router_loss_factor(model: nn.Module, trainer: Trainer, num_items_in_batch, scale: float) -> Iterator[None]:
    """Inside, an MoE model's load-balancing term weighs as the Trainer weighs it. Normalized by
    ``num_items_in_batch``, the model adds the term unscaled to a loss that is a token sum over that count,
    and the Trainer then multiplies the whole loss by the ranks (average_tokens_across_devices): the term's
    weight is loss_scale with the counted tokens equal to num_items_in_batch. Otherwise the Trainer divides
    the whole loss by the accumulation steps, as the token mean's ``scale``. The step's loss is multiplied by
    ``scale`` after it returns and its gradients by ``scale`` inside (scaled_loss_gradient), so the term is
    given weight / scale here (moe.ROUTER_LOSS_FACTOR)."""
    causal_lm = unwrap_causal_lm(model)
    items = None if num_items_in_batch is None else int(num_items_in_batch)
    weight = loss_scale(trainer, items or 0, items)
    if weight == scale:
        yield
        return
    setattr(causal_lm, ROUTER_LOSS_FACTOR, weight / scale)
    try:
        yield
    finally:
        delattr(causal_lm, ROUTER_LOSS_FACTOR)


def _known_compute_losses() -> set:
    known = {Trainer.compute_loss}
    try:
        from trl import SFTTrainer
    except ImportError:
        pass
    else:
        known.add(SFTTrainer.compute_loss)
    return known


def check_trainer(trainer: Trainer) -> None:
    """Refuse, before training, the setups whose semantics oomb's step cannot reproduce."""
    args = trainer.args

    def refuse(what: str, fix: str) -> None:
        raise ValueError(f"oomb's training step does not support {what}: {fix}")

    if type(trainer).compute_loss not in _known_compute_losses():
        refuse(f"a custom compute_loss ({type(trainer).__name__}.compute_loss)",
               "oomb computes the token cross-entropy itself and would silently skip it")
    if getattr(trainer, "compute_loss_func", None) is not None:
        refuse("compute_loss_func", "oomb computes the plain token cross-entropy (mean over counted labels)")
    if getattr(args, "label_smoothing_factor", 0) or getattr(trainer, "label_smoother", None) is not None:
        refuse(f"label_smoothing_factor={args.label_smoothing_factor}", "set it to 0")
    if getattr(args, "loss_type", "nll") not in ("nll", None):
        refuse(f"loss_type={args.loss_type!r}", "use loss_type='nll'")
    check_runtime(trainer)


def check_runtime(trainer: Trainer) -> None:
    """Refuse the runtime setups no oomb step supports inside a Trainer (every oomb trainer switch checks these)."""
    args = trainer.args

    def refuse(what: str, fix: str) -> None:
        raise ValueError(f"oomb's training step does not support {what}: {fix}")

    if getattr(args, "activation_offloading", False):
        refuse("activation_offloading=True", "oomb keeps almost no activations; use "
               "OOMBConfig(offload=OffloadConfig(enabled=True)) for the KV pages")
    if getattr(args, "use_liger_kernel", False):
        refuse("use_liger_kernel=True", "oomb's step has its own chunked loss and has not been checked with Liger's "
               "patched modules")
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        refuse("DeepSpeed or FSDP through accelerate", "use DDP here, or `torchrun --nproc-per-node N -m oomb.cli "
               "train` for sharded weights (data parallel with FSDP2)")
    if args.n_gpu > 1:
        refuse(f"torch.nn.DataParallel over {args.n_gpu} GPUs", "launch one process per GPU (torchrun/accelerate)")
    for name in ("get_tp_size", "get_cp_size", "get_sp_size"):
        size = getattr(trainer, name, lambda: 1)()
        if size > 1:
            refuse(f"{name[4:6]} size {size} (tensor/context/sequence parallel through the Trainer)",
                   "use `oomb train --tp N` for tensor parallel")
    if getattr(args, "torch_compile", False):
        refuse("torch_compile=True (the Trainer compiles the whole model)", "oomb compiles each decoder layer itself "
               "for the step (OOMBConfig.performance.compile_layers); set torch_compile=False")
    if getattr(trainer.accelerator, "scaler", None) is not None:
        refuse("fp16 mixed precision (a gradient scaler)", "load the model in bfloat16 and use bf16=True")


def disable_hf_checkpointing(trainer: Trainer) -> None:
    """oomb recomputes each chunk itself (and each layer with OOMBConfig.performance.checkpoint_layers): HF's
    gradient checkpointing would recompute again, so it is switched off, with a warning."""
    args = trainer.args
    flags = [name for name in ("gradient_checkpointing", "activation_checkpointing") if getattr(args, name, False)]
    model = unwrap_causal_lm(trainer.model)
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"  # the new name (transformers >= 5.2x) first: the old one warns
    enabled = bool(getattr(model, name, False))
    if not flags and not enabled:
        return
    warnings.warn(
        "gradient/activation checkpointing is replaced by oomb's own recomputation (each chunk is recomputed in "
        "stage 2; layers too with OOMBConfig.performance.checkpoint_layers="
        f"{trainer.oomb_config.performance.checkpoint_layers}): "
        "Hugging Face's is switched off", UserWarning, stacklevel=3)
    for name in flags:
        setattr(args, name, False)
    if enabled:
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()


def _to_labels(shifted: torch.Tensor) -> torch.Tensor:
    """Unshifted labels whose shift is ``shifted`` (what a collator's ``shift_labels`` holds)."""
    if (shifted[..., -1] != IGNORE_INDEX).any():
        raise ValueError("shift_labels has a counted label at the last position: no token predicts it")
    return torch.nn.functional.pad(shifted[..., :-1], (1, 0), value=IGNORE_INDEX)


def check_right_padding(attention_mask: torch.Tensor, labels: torch.Tensor) -> None:
    """Accept a mask only when oomb's causal step provably equals the masked model on every counted label."""
    mask = attention_mask.bool()
    if mask.all():
        return
    if mask.dim() != 2 or ((attention_mask != 0) & (attention_mask != 1)).any():
        raise ValueError(f"attention_mask must be a (batch, tokens) mask of 0/1, got shape {tuple(mask.shape)}")
    if (mask[:, 1:] & ~mask[:, :-1]).any():
        raise ValueError(
            "attention_mask has padding before real tokens (left padding or holes): oomb's causal step would let "
            "later tokens attend to it. Pad on the right (tokenizer.padding_side='right') or pack without padding")
    targets = shift_labels(labels)
    if ((targets != IGNORE_INDEX) & ~mask).any():
        raise ValueError(
            "labels after a padding position are counted (the loss would be predicted from padding tokens, which the "
            "plain model masks and oomb cannot): set labels to -100 on padding, as the standard collators do")


def _is_arange(position_ids: torch.Tensor) -> bool:
    expected = torch.arange(position_ids.shape[-1], device=position_ids.device)
    return bool((position_ids == expected).all())


def step_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """The batch as forward_backward's keyword arguments, refusing what it cannot reproduce exactly."""
    unknown = sorted(set(inputs) - USED_KEYS - DERIVED_KEYS - IGNORED_KEYS)
    if unknown:
        raise ValueError(f"the batch has keys oomb's step does not use: {unknown}; it reads {sorted(USED_KEYS)} "
                         "(multimodal inputs and extra model arguments are not supported)")
    if "input_ids" not in inputs:
        raise ValueError("the batch has no input_ids (inputs_embeds is not supported)")
    input_ids = inputs["input_ids"]
    if "labels" in inputs and inputs["labels"] is not None:
        labels = inputs["labels"]
    elif "shift_labels" in inputs:
        labels = _to_labels(inputs["shift_labels"])
    else:
        raise ValueError("the batch has no labels: the plain Trainer would fail too (the model returns no loss); "
                         "use a collator that sets them, e.g. DataCollatorForLanguageModeling(tokenizer, mlm=False)")
    if "attention_mask" in inputs and inputs["attention_mask"] is not None:
        check_right_padding(inputs["attention_mask"], labels)
    kwargs: dict[str, Any] = {"input_ids": input_ids, "labels": labels}
    position_ids = inputs.get("position_ids")
    if position_ids is not None:
        if not _is_arange(position_ids):  # packed documents: attention stays inside each one
            check_document_labels(position_ids == 0, labels)
            kwargs["position_ids"] = position_ids
    elif inputs.get("cu_seq_lens_q") is not None:
        cu = inputs["cu_seq_lens_q"]
        if inputs.get("cu_seq_lens_k") is not None and not torch.equal(inputs["cu_seq_lens_k"], cu):
            raise ValueError("cu_seq_lens_k differs from cu_seq_lens_q: only self-attention over packed documents is "
                             "supported")
        starts = torch.zeros(input_ids.shape[-1], dtype=torch.bool, device=labels.device)
        starts[cu[:-1].long()] = True
        check_document_labels(starts.expand_as(labels), labels)
        kwargs["cu_seqlens"] = cu
    return kwargs


def check_document_labels(starts: torch.Tensor, labels: torch.Tensor) -> None:
    """Refuse counted labels at a document's first token (after a row's first): oomb's step never predicts
    a document from the previous one, while the plain model would count that label."""
    starts = starts.clone()
    starts[..., 0] = False
    if (starts & (labels != IGNORE_INDEX)).any():
        raise ValueError(
            "packed documents (position_ids restarting at 0) with a counted label at a document's first token: set "
            "those labels to -100, as DataCollatorWithFlattening and TRL's padding_free collator do")


def counted_targets(labels: torch.Tensor) -> int:
    """Label positions the loss counts (after the shift), as the Trainer's num_items_in_batch counts them."""
    return int((shift_labels(labels if labels.dim() == 2 else labels[None]) != IGNORE_INDEX).sum())


def loss_scale(trainer: Trainer, num_counted: int, num_items_in_batch: torch.Tensor | int | None) -> float:
    """What the Trainer's loss of this micro-batch is, as a multiple of its mean token loss (see the module doc)."""
    if getattr(trainer, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None:
        scale = num_counted / float(num_items_in_batch)
        if trainer.args.average_tokens_across_devices:
            tp = getattr(trainer, "get_tp_size", lambda: 1)()
            scale *= trainer.accelerator.num_processes // tp
        return scale
    steps = getattr(trainer, "current_gradient_accumulation_steps", None) or trainer.args.gradient_accumulation_steps
    return 1.0 / steps


def _ddp(model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    return model if isinstance(model, nn.parallel.DistributedDataParallel) else None


def all_reduce_mean_gradients(params: list[nn.Parameter], group) -> None:
    """Average ``.grad`` over the ranks of ``group`` as DDP does (a missing gradient counts as zero)."""
    world = dist.get_world_size(group)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: dict[tuple, list[list[torch.Tensor]]] = {}
    for p in params:
        key = (p.grad.dtype, p.grad.device)
        bucket = buckets.setdefault(key, [[]])
        if sum(g.numel() * g.element_size() for g in bucket[-1]) >= _BUCKET_BYTES:
            bucket.append([])
        bucket[-1].append(p.grad)
    for groups in buckets.values():
        for grads in groups:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            flat.div_(world)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def _track_sft_tokens(trainer: Trainer, inputs: dict[str, Any]) -> None:
    """TRL SFTTrainer's ``num_tokens`` metric, which its compute_loss (skipped here) keeps."""
    if not hasattr(trainer, "_total_train_tokens") or not hasattr(trainer, "_metrics"):
        return
    if inputs.get("attention_mask") is not None:
        local = inputs["attention_mask"].sum()
    else:
        local = torch.tensor(inputs["input_ids"].shape[-1], device=inputs["input_ids"].device)
    total = trainer.accelerator.gather_for_metrics(local).sum().item()
    trainer._total_train_tokens += total // getattr(trainer, "_tp_size", 1)
    trainer._metrics["train"]["num_tokens"] = [trainer._total_train_tokens]


def oomb_training_step(trainer: Trainer, model: nn.Module, inputs: dict[str, Any],
                       num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
    """``Trainer.training_step`` through oomb's chunked step; returns what the plain one returns."""
    model.train()
    if hasattr(trainer.optimizer, "train") and callable(trainer.optimizer.train):
        trainer.optimizer.train()
    inputs = trainer._prepare_inputs(inputs)
    kwargs = step_inputs(inputs)
    _track_sft_tokens(trainer, inputs)
    unwrapped = trainer.accelerator.unwrap_model(model)
    num_counted = counted_targets(kwargs["labels"])
    scale = loss_scale(trainer, num_counted, num_items_in_batch)
    warn_mixed_precision(trainer, unwrapped)
    if num_counted == 0:
        if num_items_in_batch is None:
            raise ValueError("a micro-batch has no counted label (all -100 after shifting): its mean loss is "
                             "undefined")
        loss = torch.zeros((), dtype=torch.float32, device=kwargs["input_ids"].device)  # sum / N = 0, no gradient
    else:
        with scaled_loss_gradient(unwrapped, scale), router_loss_factor(unwrapped, trainer, num_items_in_batch, scale):
            loss = forward_backward(unwrapped, config=trainer.oomb_config, host_slabs=trainer._oomb_host_slabs,
                                    **kwargs) * scale
    ddp = _ddp(model)
    if ddp is not None and ddp.require_backward_grad_sync:
        all_reduce_mean_gradients([p for p in ddp.parameters() if p.requires_grad], ddp.process_group)
    steps = trainer.args.torch_empty_cache_steps
    if steps is not None and trainer.state.global_step % steps == 0 and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return loss.detach()


def warn_mixed_precision(trainer: Trainer, model: nn.Module) -> None:
    if trainer._oomb_warned_precision or trainer.accelerator.mixed_precision in (None, "no"):
        return
    dtype = unwrap_causal_lm(model).get_input_embeddings().weight.dtype
    if dtype == torch.float32:
        warnings.warn(
            f"mixed_precision={trainer.accelerator.mixed_precision!r} (accelerate's autocast of model.forward) does "
            "not apply to oomb's step, which runs in the weights' dtype (float32 here): load the model in bfloat16 "
            "(dtype=torch.bfloat16) for bf16 compute", UserWarning, stacklevel=3)
    trainer._oomb_warned_precision = True


def attach_config(trainer: Trainer, oomb_config: OOMBConfig | None) -> None:
    """Give ``trainer`` oomb's options and the state its steps keep (host slabs for offload, warnings given)."""
    if oomb_config is not None and not isinstance(oomb_config, OOMBConfig):
        raise TypeError(f"oomb_config must be an oomb.OOMBConfig, got {type(oomb_config).__name__}")
    trainer.oomb_config = oomb_config or OOMBConfig()
    trainer._oomb_host_slabs = HostSlabs() if trainer.oomb_config.offload.enabled else None
    trainer._oomb_warned_precision = False
    unwrap_causal_lm(trainer.model)  # refuse an unsupported model now, not at the first step


def _setup(trainer: Trainer, oomb_config: OOMBConfig | None) -> None:
    attach_config(trainer, oomb_config)
    check_trainer(trainer)
    disable_hf_checkpointing(trainer)


class OOMBTrainerMixin:
    """Put first in the bases of a ``transformers.Trainer`` subclass: its training step becomes oomb's.

    Args (besides the Trainer's):
        oomb_config: the chunked step's options (chunk and page size, sparse mode, offload...);
            None: OOMBConfig() defaults.
    """

    oomb_config: OOMBConfig

    def __init__(self, *args: Any, oomb_config: OOMBConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _setup(self, oomb_config)

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        return oomb_training_step(self, model, inputs, num_items_in_batch)


class OOMBTrainer(OOMBTrainerMixin, Trainer):
    """``transformers.Trainer`` whose training step is oomb's chunk-recurrent step (``oomb_config=``)."""


def patch_trainer(trainer: Trainer, oomb_config: OOMBConfig | None = None) -> Trainer:
    """Give an existing Trainer (or SFTTrainer) instance oomb's training step; returns it."""
    if not isinstance(trainer, Trainer):
        raise TypeError(f"patch_trainer expects a transformers.Trainer, got {type(trainer).__name__}")
    if isinstance(trainer, OOMBTrainerMixin):
        raise ValueError(f"{type(trainer).__name__} already runs oomb's step")
    _setup(trainer, oomb_config)
    trainer.training_step = types.MethodType(oomb_training_step, trainer)
    return trainer


class OOMBEvalCallback(TrainerCallback):
    """oomb's evaluation at length inside a Hugging Face Trainer: every ``options.every_steps`` optimizer
    steps and after the last, held-out perplexity by position and passkey accuracy through stage 1
    (oomb/training/evaluation.py), at lengths the Trainer's own evaluation (one full forward) cannot reach.
    The results join ``trainer.state.log_history`` as {"step", "oomb_eval"} and the log.

    Args:
        tokenizer: the model's tokenizer.
        options: what to evaluate and how often (``every_steps`` > 0; ``seq_len`` with ``data``).
        config: the stage-1 options; None: OOMBConfig() (dense).
    """

    def __init__(self, tokenizer, options: EvalSection, config: OOMBConfig | None = None) -> None:
        if not options.every_steps:
            raise ValueError("OOMBEvalCallback needs options.every_steps > 0 (how often to evaluate)")
        if options.data is not None and options.seq_len is None:
            raise ValueError("OOMBEvalCallback: options.seq_len is empty; set the evaluated sequences' length")
        if options.data is None and not options.passkey_lengths:
            raise ValueError("OOMBEvalCallback: nothing to evaluate; set options.data (held-out text or jsonl) "
                             "and/or options.passkey_lengths")
        self.tokenizer, self.options, self.config = tokenizer, options, config or OOMBConfig()
        self.host_slabs = HostSlabs() if self.config.offload.enabled else None

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        if args.world_size > 1:
            raise NotImplementedError("OOMBEvalCallback runs in one process: evaluate the saved model with "
                                      "`oomb eval` instead")

    def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
        step = state.global_step
        if step % self.options.every_steps and step != state.max_steps:
            return
        report = run_evaluation(model, self.tokenizer, self.options, self.config, host_slabs=self.host_slabs)
        state.log_history.append({"step": step, "oomb_eval": report})
        logger.info("oomb eval after step %d:\n%s", step, format_evaluation(report))


_TRL_MISSING = ("OOMBSFTTrainer needs TRL: pip install 'oomb[trl]' (or pip install trl); "
                "plain transformers users can use oomb.OOMBTrainer")


@functools.cache
def _make_sft_trainer() -> type:
    """The OOMBSFTTrainer class, built once on first use (TRL, an optional heavy import, is imported here)."""
    try:
        from trl import SFTTrainer
    except ImportError as err:
        raise ImportError(_TRL_MISSING) from err

    class OOMBSFTTrainer(OOMBTrainerMixin, SFTTrainer):
        """TRL ``SFTTrainer`` whose training step is oomb's chunk-recurrent step (``oomb_config=``).

        Its per-token metrics ``entropy`` and ``mean_token_accuracy`` need full logits and are not
        logged during training; ``num_tokens`` is.
        """

    OOMBSFTTrainer.__module__ = __name__
    OOMBSFTTrainer.__qualname__ = "OOMBSFTTrainer"
    return OOMBSFTTrainer


def __getattr__(name: str) -> Any:
    if name == "OOMBSFTTrainer":
        return _make_sft_trainer()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
