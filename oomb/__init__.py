"""oomb: train Hugging Face LLMs on million-token contexts, chunk by chunk over a paged KV cache."""

from typing import Any

from .config import OOMBConfig
from .engine import forward_backward
from .kv.offload import HostSlabs
from .train_config import TrainerConfig
from .trainer import Trainer, TrainResult

__version__ = "0.1.0"
__all__ = ["HostSlabs", "OOMBConfig", "OOMBSFTTrainer", "OOMBTrainer", "OOMBTrainerMixin", "Trainer", "TrainerConfig",
           "TrainResult", "forward_backward", "patch_trainer", "__version__"]

_HF_TRAINER_NAMES = ("OOMBSFTTrainer", "OOMBTrainer", "OOMBTrainerMixin", "patch_trainer")


def __getattr__(name: str) -> Any:
    """The Hugging Face Trainer integration loads on first use: transformers' Trainer (and TRL for
    OOMBSFTTrainer) is a heavy import that ``oomb train`` does not need."""
    if name in _HF_TRAINER_NAMES:
        from . import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
