"""Training checkpoints: one directory per step, written under a temporary name, then renamed.

    output_dir/checkpoints/
      step-000010/
        model.safetensors     trainable parameters by name (full fine-tuning), or
        adapter.safetensors   the LoRA adapter's parameters by name; both without the parameters
                              that have an fp32 master, which is exact where the parameter is not
        master.safetensors    fp32 master weights (bf16/fp16 parameters, or all with optimizer offload)
        optimizer.pt          AdamW state_dict
        scheduler.pt          learning-rate schedule state_dict
        rng.pt                torch CPU and CUDA, Python `random` states
        config.yaml           the run's configuration
        trainer_state.json    step, tokens, data position, losses: written last
      step-000020.tmp/        being written; never read, removed by the next save

A directory named ``step-NNNNNN`` exists only once every file in it has been written and synced
(``os.replace`` of the whole directory), so a run killed at any moment leaves either the previous
checkpoints or the new one, never a torn one. Loading is lazy where checkpoints are big: tensors are
read one at a time from the safetensors files and the optimizer state is memory-mapped, so a 7B
full fine-tuning state (~100 GB) never needs a second copy in host memory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
FULL_WEIGHTS = "model.safetensors"
ADAPTER_WEIGHTS = "adapter.safetensors"
MASTER_WEIGHTS = "master.safetensors"
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class Checkpoint:
    """What a checkpoint holds; tensors on the CPU."""

    step: int
    weights: Mapping[str, torch.Tensor]
    adapter: bool  # weights are LoRA adapter parameters (else all trainable parameters)
    master: Mapping[str, torch.Tensor]
    optimizer: dict
    scheduler: dict
    rng: dict
    state: dict  # trainer_state.json
    config_yaml: str = ""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir() and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield ``final.tmp`` to fill; on success it replaces ``final`` in one rename."""
    final = Path(final)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    yield tmp
    for path in tmp.rglob("*"):
        if path.is_file():
            _fsync(path)
    _fsync(tmp)
    old = final.with_name(final.name + ".old")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync(final.parent)
    if old.exists():
        shutil.rmtree(old)


def save_checkpoint(checkpoint: Checkpoint, root: str | Path, keep_last: int = 0) -> Path:
    """Write ``checkpoint`` as ``root/step-NNNNNN`` atomically; keep the newest ``keep_last`` (0: all)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(checkpoint.step)
    with atomic_directory(final) as tmp:
        weights_file = ADAPTER_WEIGHTS if checkpoint.adapter else FULL_WEIGHTS
        save_file(_cpu_contiguous(checkpoint.weights), tmp / weights_file)
        if checkpoint.master:
            save_file(_cpu_contiguous(checkpoint.master), tmp / MASTER_WEIGHTS)  # no copy if already on the host
        torch.save(checkpoint.optimizer, tmp / "optimizer.pt")
        torch.save(checkpoint.scheduler, tmp / "scheduler.pt")
        torch.save(checkpoint.rng, tmp / "rng.pt")
        (tmp / "config.yaml").write_text(checkpoint.config_yaml)
        state = {"step": checkpoint.step, "adapter": checkpoint.adapter, **checkpoint.state}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
    _prune(root, keep_last)
    logger.info("checkpoint written: %s", final)
    return final


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint directory written by ``save_checkpoint`` (tensors on the CPU)."""
    path = Path(path)
    if not (path / STATE_FILE).is_file():
        hint = f"; complete checkpoints there: {[p.name for p in list_checkpoints(path)]}" if path.is_dir() else ""
        raise FileNotFoundError(f"{str(path)!r} is not a complete oomb checkpoint (no {STATE_FILE}){hint}")
    state = json.loads((path / STATE_FILE).read_text())
    adapter = bool(state.pop("adapter"))
    weights = LazyTensors(path / (ADAPTER_WEIGHTS if adapter else FULL_WEIGHTS))
    master = LazyTensors(path / MASTER_WEIGHTS) if (path / MASTER_WEIGHTS).is_file() else {}

    def load(name: str):
        return torch.load(path / name, map_location="cpu", weights_only=True, mmap=True)

    config_yaml = (path / "config.yaml").read_text() if (path / "config.yaml").is_file() else ""
    return Checkpoint(step=int(state.pop("step")), weights=weights, adapter=adapter, master=master,
                      optimizer=load("optimizer.pt"), scheduler=load("scheduler.pt"), rng=load("rng.pt"),
                      state=state, config_yaml=config_yaml)


class LazyTensors(Mapping):
    """The tensors of a safetensors file, each read from disk when asked for (CPU)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = safe_open(path, "pt", device="cpu")
        self._keys = list(self._file.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._keys:
            raise KeyError(name)
        return self._file.get_tensor(name)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def capture_rng() -> dict:
    """Every random state a training step draws from."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(value):
    """random.setstate wants tuples; a round trip through torch.save may hand back lists."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list | tuple) else value


def _cpu_contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}


def _prune(root: Path, keep_last: int) -> None:
    for stale in root.glob("step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    if keep_last <= 0:
        return
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old)
        logger.info("checkpoint removed (checkpoint.keep_last=%d): %s", keep_last, old)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
