"""oomb: train Hugging Face LLMs on million-token contexts, chunk by chunk over a paged KV cache."""

from .config import OOMBConfig
from .engine import forward_backward
from .kv.offload import HostSlabs
from .train_config import TrainerConfig
from .trainer import Trainer, TrainResult

__version__ = "0.1.0"
__all__ = ["HostSlabs", "OOMBConfig", "Trainer", "TrainerConfig", "TrainResult", "forward_backward", "__version__"]
