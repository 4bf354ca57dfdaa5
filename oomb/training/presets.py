"""Where a training run's model and tokenizer come from.

Either a local Hugging Face directory (``from_pretrained``, never a download), or a preset shape
with random weights plus oomb's built-in byte-level tokenizer: the embedded default that lets
``oomb train`` run with no arguments and nothing on disk. LoRA adapters are added through PEFT.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from ..models import SUPPORTED_MODEL_TYPES, plain_attention
from .config import LoraSection, ModelSection
from .preset_shapes import BYTE_VOCAB, PRESET_SOURCES, PRESETS, TINY_PRESET  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""A plain chat template for the byte tokenizer: role markers are ordinary text."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def byte_tokenizer():
    """oomb's built-in tokenizer: one token per UTF-8 byte (ids 0-255) and <|endoftext|> (id 256).

    A `tokenizers` byte-level BPE without merges, wrapped as a PreTrainedTokenizerFast, so it
    saves with ``save_pretrained`` and loads back with ``AutoTokenizer``. It has a simple chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_to_char = bytes_to_unicode()  # the ByteLevel pre-tokenizer's printable alias of each byte
    backend = Tokenizer(models.BPE(vocab={byte_to_char[b]: b for b in range(BYTE_VOCAB)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    tokenizer.chat_template = BYTE_CHAT_TEMPLATE
    return tokenizer


def preset_config(name: str, seq_len: int) -> PretrainedConfig:
    """The preset's HF config; the tiny preset's max_position_embeddings follows the context."""
    if name not in PRESETS:
        raise ValueError(f"model.preset={name!r} is unknown; presets: {list(PRESETS)}")
    model_type, options = PRESETS[name]
    options = {"max_position_embeddings": max(seq_len, 4096), **options}
    return AutoConfig.for_model(model_type, **options)


def load_model_config(section: ModelSection, seq_len: int) -> PretrainedConfig:
    """The model's config, checked (directory, architecture) before any weight is read."""
    if section.path is None:
        config = preset_config(section.preset, seq_len)
    else:
        path = Path(section.path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"model.path={section.path!r} is not a directory; give a local Hugging Face model directory "
                "(config.json + *.safetensors, as written by save_pretrained), or leave model.path empty to "
                "train a preset with random weights")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model.path={section.path!r} has no config.json: not a Hugging Face model directory "
                "(write one with model.save_pretrained(dir))")
        if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
            raise FileNotFoundError(
                f"model.path={section.path!r} has a config.json but no weights (*.safetensors or "
                "pytorch_model*.bin)")
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except (ValueError, KeyError, OSError) as err:
            raise ValueError(f"model.path={section.path!r}: config.json cannot be read: {err}") from err
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"model type {model_type!r} (from {section.path or section.preset}) is not supported by oomb; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if section.rope_scaling:
        current = dict(getattr(config, "rope_parameters", None) or {})
        config.rope_parameters = {**current, **section.rope_scaling}
    if section.max_position_embeddings is not None:
        config.max_position_embeddings = section.max_position_embeddings
    return config


def context_warning(config: PretrainedConfig, seq_len: int) -> str | None:
    """A warning when the context exceeds the positions the model was built for, naming the fix."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None or seq_len <= limit:
        return None
    factor = -(-seq_len // limit)
    return (f"data.seq_len={seq_len} exceeds the model's max_position_embeddings={limit}: positions beyond "
            f"{limit} are outside what it was trained on. Stretch RoPE with model.rope_scaling, e.g. "
            f"--set 'model.rope_scaling={{rope_type: yarn, factor: {factor}.0, original_max_position_embeddings: "
            f"{limit}}}' --set model.max_position_embeddings={limit * factor}")


def load_tokenizer(section: ModelSection):
    """The run's tokenizer: `tokenizer`, else `path`, else (preset) the built-in byte tokenizer."""
    source = section.tokenizer or section.path
    if source is None:
        return byte_tokenizer()
    path = Path(source).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {source!r} does not exist; set model.tokenizer to a local "
                                "directory written by tokenizer.save_pretrained")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"{source!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); set "
                                "model.tokenizer to the directory of the model's tokenizer (tokenizer.save_pretrained)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise FileNotFoundError(f"no usable tokenizer in {source!r} ({err}); set model.tokenizer to a directory "
                                "with tokenizer.json / tokenizer_config.json") from err
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {source!r} has no eos_token: documents are joined with EOS; "
                         "set eos_token in its tokenizer_config.json")
    return tokenizer


def build_model(section: ModelSection, config: PretrainedConfig, dtype: torch.dtype,
                device: torch.device) -> PreTrainedModel:
    """Load the local model (or build the preset with random weights from the current RNG) on ``device``."""
    if section.path is None:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            Path(section.path).expanduser(), config=config, dtype=dtype, local_files_only=True).to(device)
    plain_attention(model).train()
    return model


def apply_lora(model: PreTrainedModel, section: LoraSection) -> nn.Module:
    """Wrap in PEFT LoRA adapters (the base is frozen; adapters stay float32 on a bf16 base)."""
    from peft import LoraConfig, get_peft_model

    peft_config = LoraConfig(r=section.r, lora_alpha=section.alpha, lora_dropout=section.dropout,
                             target_modules=section.target_modules, task_type="CAUSAL_LM")
    try:
        with warnings.catch_warnings():
            # PEFT reads transformers' deprecated ``is_gradient_checkpointing`` property, which warns on every real
            # model's run; the property's answer is right and the warning is about PEFT's code, not the user's.
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning)
            return get_peft_model(model, peft_config)
    except ValueError as err:
        raise ValueError(f"lora.target_modules={section.target_modules!r}: {err}") from err


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())
