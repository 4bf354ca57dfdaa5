"""oomb: train Hugging Face LLMs on million-token contexts, chunk by chunk over a paged KV cache.

The package has two layers and the tools:

    the step (here)  engine.py (forward_backward), config.py (OOMBConfig), models.py, loss.py, grads.py,
                     fp32_linear.py, sparse.py, memory.py (with model_shape.py, activations.py), documents.py,
                     parallel.py, evaluate.py, attention/ (the kernels), kv/ (the paged store and its offload)
    training/        the training run around the step: Trainer, TrainerConfig, `oomb train`, optimizer,
                     checkpoints, data, presets, the Hugging Face Trainer/TRL integration
    tools/           `oomb bench`, `oomb plan`, `oomb gradcheck`, `oomb demo`, `oomb calibrate`
    cli.py           the `oomb` command: dispatches to each command's module

plus machine.py (this machine's memory and versions), units.py (token counts) and real_model.py
(the small real model the tests and benchmarks use).
"""

from typing import Any

from .config import OOMBConfig
from .engine import forward_backward
from .kv.offload import HostSlabs
from .training.config import TrainerConfig
from .training.trainer import Trainer, TrainResult
from .version import __version__

__all__ = ["HostSlabs", "OOMBConfig", "OOMBSFTTrainer", "OOMBTrainer", "OOMBTrainerMixin", "Trainer", "TrainerConfig",
           "TrainResult", "forward_backward", "patch_trainer", "__version__"]

_HF_TRAINER_NAMES = ("OOMBSFTTrainer", "OOMBTrainer", "OOMBTrainerMixin", "patch_trainer")


def __getattr__(name: str) -> Any:
    """The Hugging Face Trainer integration loads on first use: transformers' Trainer (and TRL for
    OOMBSFTTrainer) is a heavy import that ``oomb train`` does not need."""
    if name in _HF_TRAINER_NAMES:
        from .training import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
