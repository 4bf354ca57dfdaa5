"""oomb: train Hugging Face LLMs on million-token contexts, chunk by chunk over a paged KV cache.

Layers, each importing only those above it in this list (tests/test_layers.py; docs/design.md, "Layout"):

    base         units.py, version.py, config.py (OOMBConfig), documents.py, machine.py, grads.py, fp32_linear.py
    attention/   the kernels (Triton, cuDNN), their torch oracles (reference*.py), the backends
    kv/          the paged store and its host tier; context_parallel.py
    sparse.py    page selection
    the step     attention/function.py, models.py, loss.py, loss_gradient.py, moe.py, compiled_layers.py,
                 parallel.py
    engine.py    forward_backward; shared_context.py (many continuations of one context, the context once);
                 evaluate.py (stage 1 alone: per-token log-probabilities) with
                 perplexity.py and passkey.py; sparse_fidelity.py (the share of the history a sparse step reads)
    planning/    the memory model, whether a step fits, the chooser of the fastest OOMBConfig that fits
    training/    the training run around the step: Trainer, TrainerConfig, `oomb train`, optimizer,
                 checkpoints, data, presets, the Hugging Face Trainer/TRL integration (SFT, DPO, GRPO);
                 real_model.py (the small real model) and cli_options.py (the commands' shared option names) sit
                 with it
    tools/       `oomb bench`, `oomb plan`, `oomb gradcheck`, `oomb eval`, `oomb demo`, `oomb calibrate`
    cli.py       the `oomb` command: dispatches to each command's module
"""

from typing import Any

from .config import OffloadConfig, OOMBConfig, PerformanceConfig, PrecisionConfig, SparseConfig, SparseResearch
from .engine import forward_backward
from .kv.offload import HostSlabs
from .shared_context import ContinuationLogProbs, shared_context_backward, shared_context_logprobs
from .training.config import EvalSection, TrainerConfig
from .training.trainer import Trainer, TrainResult
from .version import __version__

__all__ = ["ContinuationLogProbs", "EvalSection", "HostSlabs", "OffloadConfig", "OOMBConfig", "OOMBDPOTrainer",
           "OOMBEvalCallback", "OOMBGRPOTrainer", "OOMBSFTTrainer", "OOMBTrainer", "OOMBTrainerMixin",
           "PerformanceConfig", "PrecisionConfig", "SparseConfig", "SparseResearch", "Trainer", "TrainerConfig",
           "TrainResult", "forward_backward", "patch_trainer", "shared_context_backward", "shared_context_logprobs",
           "__version__"]

_HF_TRAINER_NAMES = ("OOMBEvalCallback", "OOMBSFTTrainer", "OOMBTrainer", "OOMBTrainerMixin", "patch_trainer")
_TRL_TRAINER_NAMES = ("OOMBDPOTrainer", "OOMBGRPOTrainer")


def __getattr__(name: str) -> Any:
    """The Hugging Face Trainer integration loads on first use (a local import: transformers' Trainer, and TRL
    for OOMBSFTTrainer, OOMBDPOTrainer and OOMBGRPOTrainer, are heavy imports that ``oomb train`` does not need)."""
    if name in _HF_TRAINER_NAMES:
        from .training import hf_trainer

        return getattr(hf_trainer, name)
    if name in _TRL_TRAINER_NAMES:
        from .training import trl_trainers

        return getattr(trl_trainers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
