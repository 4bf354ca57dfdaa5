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

Several processes (tensor parallel, FSDP2 data parallel) write the same files with whole tensors:
``gather_full_state`` collects them on rank 0's CPU through torch.distributed.checkpoint's
``get_model_state_dict``/``get_optimizer_state_dict`` (full_state_dict, cpu_offload), rank 0 writes;
``load_full_state`` hands rank 0's whole tensors to every rank's shards (``broadcast_from_rank0``).
A checkpoint therefore resumes with any number of processes and any tp/dp layout. The optimizer
file keeps ``Optimizer.state_dict()``'s format (state by parameter index, in the optimizer's
order); torch.distributed.checkpoint's by-name form is converted on the way
(``optimizer_state_by_index`` / ``optimizer_state_by_name``).
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
import yaml
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


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint directory (step-NNNNNN) was written after."""
    match = _STEP_DIR.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint directory (step-NNNNNN)")
    return int(match.group(1))


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


class DamagedCheckpointError(ValueError):
    """A checkpoint directory with a file that is missing or cannot be read back (truncated, overwritten);
    the message names the directory and the file."""


STATE_KEYS = ("step", "adapter")
"""Keys of trainer_state.json that this module writes itself; the rest is ``Checkpoint.state``."""


def load_checkpoint(path: str | Path, state_keys: tuple[str, ...] = ()) -> Checkpoint:
    """Read a checkpoint directory written by ``save_checkpoint`` (tensors on the CPU).

    Every file is opened here, so a damaged one fails now (``DamagedCheckpointError``, naming it) rather than
    halfway through a restore: the safetensors headers are checked against the file sizes and the optimizer,
    scheduler and RNG archives' directories are read (their tensors stay memory-mapped). ``state_keys``:
    keys of ``Checkpoint.state`` the caller will read, missing ones making the checkpoint damaged too."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist: give a checkpoint directory "
                                "(<output_dir>/checkpoints/step-N) or 'latest' (the run's newest)")
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a complete oomb checkpoint (no {STATE_FILE}){_found_hint(path)}")
    state = _read_file(path, STATE_FILE, lambda file: _read_state(file, (*STATE_KEYS, *state_keys)))
    adapter = bool(state.pop("adapter"))
    weights = _read_file(path, ADAPTER_WEIGHTS if adapter else FULL_WEIGHTS, LazyTensors)
    master = _read_file(path, MASTER_WEIGHTS, LazyTensors) if (path / MASTER_WEIGHTS).is_file() else {}

    def load(file: Path):
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)

    config_yaml = _read_file(path, "config.yaml", _read_yaml_text) if (path / "config.yaml").is_file() else ""
    return Checkpoint(step=int(state.pop("step")), weights=weights, adapter=adapter, master=master,
                      optimizer=_read_file(path, "optimizer.pt", load),
                      scheduler=_read_file(path, "scheduler.pt", load), rng=_read_file(path, "rng.pt", load),
                      state=state, config_yaml=config_yaml)


def _found_hint(path: Path) -> str:
    """Where complete checkpoints are, from a directory that is not one (a run's directory, its checkpoints/)."""
    for root in (path, path / "checkpoints"):
        found = list_checkpoints(root)
        if found:
            return f"; the newest complete checkpoint there is {str(found[-1])!r}"
    return "; no complete checkpoint there" if path.is_dir() else ""


def latest_intact_checkpoint(root: str | Path, state_keys: tuple[str, ...] = ()) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under ``root`` whose files all read back (``load_checkpoint``; None if none), and
    why each newer one was passed over (one ``DamagedCheckpointError`` message each, newest first)."""
    damaged = []
    for path in reversed(list_checkpoints(root)):
        try:
            load_checkpoint(path, state_keys)
        except DamagedCheckpointError as err:
            damaged.append(str(err))
            continue
        return path, damaged
    return None, damaged


def _read_file(directory: Path, name: str, reader):
    """``reader(directory / name)``, any failure to read it raised as a ``DamagedCheckpointError`` naming it."""
    file = directory / name
    if not file.is_file():
        raise DamagedCheckpointError(f"checkpoint {directory}: {name} is missing")
    try:
        return reader(file)
    except Exception as err:  # truncated or overwritten files fail in each reader's own way
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DamagedCheckpointError(f"checkpoint {directory}: {name} is damaged ({file.stat().st_size:,} bytes; "
                                     f"{reason})") from err


def _read_state(file: Path, keys: tuple[str, ...]) -> dict:
    state = json.loads(file.read_text())
    if not isinstance(state, dict) or any(key not in state for key in keys):
        have = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"expected the keys {list(keys)}, found {have}")
    return state


def _read_yaml_text(file: Path) -> str:
    text = file.read_text()
    yaml.safe_load(text)  # parsed again on resume, to compare the settings
    return text


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

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, without reading it."""
        return tuple(self._file.get_slice(name).get_shape())

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def tensor_shape(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """Shape of ``tensors[name]`` (read from the file's header for LazyTensors)."""
    return tensors.shape(name) if isinstance(tensors, LazyTensors) else tuple(tensors[name].shape)


def optimizer_state_by_index(state: dict) -> dict:
    """torch.distributed.checkpoint's optimizer state (keyed by parameter name) in ``Optimizer.state_dict()``'s
    format: parameters numbered in the order of the param groups, as ``Optimizer.state_dict()`` numbers them."""
    index: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        ids = [index.setdefault(name, len(index)) for name in group["params"]]
        groups.append({**group, "params": ids})
    return {"state": {index[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def optimizer_state_by_name(state: dict, names: list[list[str]]) -> dict:
    """The inverse of ``optimizer_state_by_index`` for an optimizer whose param groups hold parameters
    named ``names`` (one list per group); refuses a state of other groups or parameters."""
    saved = [len(g["params"]) for g in state["param_groups"]]
    if saved != [len(group) for group in names]:
        raise ValueError(f"the optimizer state has param groups of {saved} parameters, this run's optimizer "
                         f"{[len(group) for group in names]}: was it written for another model or other "
                         "lora/optim settings?")
    by_index = {i: name for saved_group, group in zip(state["param_groups"], names, strict=True)
                for i, name in zip(saved_group["params"], group, strict=True)}
    missing = [name for i, name in by_index.items() if i not in state["state"]]
    if state["state"] and missing:
        raise ValueError(f"the optimizer state has no entry for {len(missing)} trainable parameter(s) (e.g. "
                         f"{missing[:2]}), which never had a gradient; resuming such a checkpoint needs one process")
    groups = [{**saved_group, "params": list(group)} for saved_group, group in zip(state["param_groups"], names,
                                                                                  strict=True)]
    return {"state": {by_index[i]: value for i, value in state["state"].items()}, "param_groups": groups}


IMPLEMENTATION_OPTIONS = ("foreach", "fused", "capturable", "differentiable")
"""Param-group keys of an optimizer that choose its kernels for this run's devices and layout (tensor
parallel mixes DTensor and plain tensors: no foreach), not part of the training state."""


def with_implementation_options(state: dict, optimizer: torch.optim.Optimizer) -> dict:
    """``state`` (``Optimizer.state_dict()``'s format) with ``optimizer``'s kernel choices in its param groups, so
    a checkpoint of another device or tp/dp layout loads (and its step counters go where these kernels want them)."""
    if len(state["param_groups"]) != len(optimizer.param_groups):
        return state  # refused by the load, with its own message
    groups = [{**saved, **{k: group[k] for k in IMPLEMENTATION_OPTIONS if k in group}}
              for saved, group in zip(state["param_groups"], optimizer.param_groups, strict=True)]
    return {**state, "param_groups": groups}


def gather_full_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Whole tensors of ``module``'s parameters (DTensor shards or replicated tensors) and of the
    optimizer's state, on rank 0's CPU; every rank must call it, the others get two empty dicts. The
    optimizer state is in ``Optimizer.state_dict()``'s format."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    tensors = get_model_state_dict(module, options=options)
    if not optimizer.state:  # before the first step: nothing to gather (and get_optimizer_state_dict
        return tensors, optimizer.state_dict()  # would create the state with a step of zero gradients)
    state = get_optimizer_state_dict(module, optimizer, options=options)
    return tensors, optimizer_state_by_index(state) if dist.get_rank() == 0 else {}


def load_full_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor],
                    optimizer_state: dict | None) -> None:
    """Rank 0's whole tensors into every rank's shards of ``module``'s parameters and the optimizer's
    state (``broadcast_from_rank0``). Every rank must call it. On rank 0, ``tensors`` holds every
    parameter of ``module`` by name and ``optimizer_state`` is by parameter name
    (``optimizer_state_by_name``); the other ranks' are not read. ``optimizer_state=None`` on every
    rank leaves the optimizer alone."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(module, dict(tensors.items()), options=options)  # LazyTensors: read from disk here
    if optimizer_state is not None:
        set_optimizer_state_dict(module, optimizer, optimizer_state, options=options)


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
