"""A Trainer's checkpoints: the state after a step, written and read back, with one or several processes.

``Trainer`` (oomb/training/trainer.py) inherits these methods; the file format and the distributed gathering
are oomb/training/checkpoint.py's. With several processes the shards are gathered into whole tensors on rank
0, which writes what a single process writes; resuming reads them on rank 0 and sends every rank its
shards, so a checkpoint resumes under any tensor/data-parallel layout.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import pickle
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from ..config import nested_options
from .checkpoint import (
    Checkpoint,
    capture_rng,
    gather_full_state,
    load_checkpoint,
    load_full_state,
    optimizer_state_by_name,
    restore_rng,
    tensor_shape,
    with_implementation_options,
)
from .checkpoint import save_checkpoint as write_checkpoint
from .data import DataPosition
from .optim import lr_factor
from .report import truncate_metrics

logger = logging.getLogger(__name__)

RESUME_STATE_KEYS = ("tokens", "elapsed_s", "data_position", "losses")
"""Keys of ``Checkpoint.state`` (trainer_state.json) that ``save_checkpoint`` writes and a resume reads."""


class Checkpointing:
    """Save and restore the state of a Trainer: weights, fp32 masters, optimizer, scheduler, RNG, data
    position and counters (a mixin: it reads and sets the trainer's own attributes)."""

    def save_checkpoint(self) -> Path:
        """Write the state after the last complete step to output_dir/checkpoints/step-NNNNNN.

        Several processes: every rank must call it. The shards are gathered into whole tensors on rank
        0's CPU (torch.distributed.checkpoint), rank 0 writes the files a single process writes, with
        every rank's RNG state; every rank returns the path."""
        state = {
            "tokens": self.tokens,
            "elapsed_s": self.elapsed,
            "data_position": self._data_position.to_dict(),
            "data_files": [str(f.path) for f in self.data.files],
            "losses": self.losses,
            "parallel": {"tp": self.parallel.tp, "dp": self.parallel.dp},
        }
        mastered = set(self.masters.state_dict())
        if self.parallel.mesh is None:
            params = dict(self.model.named_parameters())
            weights = {n: params[n] for n in self.masters.unmastered_names}  # the rest: in the masters
            master, optimizer, rng = self.masters.state_dict(), self.optimizer.state_dict(), capture_rng()
        else:
            tensors, optimizer = gather_full_state(self.masters.module(), self.optimizer)  # rank 0; others: {}
            rngs = [None] * dist.get_world_size() if self.parallel.is_main else None
            dist.gather_object(capture_rng(), rngs, dst=0)
            weights = {n: tensors[n] for n in tensors if n not in mastered}
            master = {n: tensors[n] for n in tensors if n in mastered}
            rng = {**rngs[0], "ranks": rngs} if self.parallel.is_main else {}  # top level: rank 0's, as one process
        checkpoint = Checkpoint(step=self.step, weights=weights, adapter=self.config.lora.enabled, master=master,
                                optimizer=optimizer, scheduler=self.scheduler.state_dict(), rng=rng, state=state,
                                config_yaml=self.config.to_yaml())
        self._last_saved = self._on_main(lambda: write_checkpoint(checkpoint, self.checkpoint_dir,
                                                                  self.config.checkpoint.keep_last))
        self._saved_step = self.step
        return self._last_saved

    def _on_main(self, fn):
        """``fn()`` on rank 0 alone and its result on every rank; an exception it raises is raised on every
        rank (so none waits for the others forever). One process: just ``fn()``."""
        if self.parallel.mesh is None:
            return fn()
        box, error = [None], None
        if self.parallel.is_main:
            try:
                box[0] = (True, fn())
            except Exception as err:
                error = err
                box[0] = (False, err if _picklable(err) else RuntimeError(f"{type(err).__name__}: {err}"))
        dist.broadcast_object_list(box, src=0)
        if error is not None:
            raise error
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def _check_checkpoint(self, checkpoint: Checkpoint, path: Path) -> None:
        """Refuse a checkpoint of other trainable parameters than this run's (names, masters, whole shapes)."""
        expected = set(self.masters.unmastered_names)
        if set(checkpoint.weights) != expected or checkpoint.adapter != self.config.lora.enabled:
            missing = sorted(expected - set(checkpoint.weights))
            raise ValueError(
                f"checkpoint {path} does not match this model: {len(missing)} trainable parameter(s) missing "
                f"(e.g. {missing[:2]}), {len(set(checkpoint.weights) - expected)} unexpected; was it written "
                "with other model, lora or optim.master_weights/offload settings?")
        mastered = set(self.masters.state_dict())
        if set(checkpoint.master) != mastered:
            missing, extra = sorted(mastered - set(checkpoint.master)), sorted(set(checkpoint.master) - mastered)
            raise ValueError(f"checkpoint {path}: master weights do not match the model (missing {missing[:3]}, "
                             f"unexpected {extra[:3]}): was it written with other optim.master_weights/offload "
                             "or model settings?")
        for name, tensor in zip(self.masters.names, self.masters.optimizer_params, strict=True):
            saved = tensor_shape(checkpoint.master if name in mastered else checkpoint.weights, name)
            if saved != tuple(tensor.shape):  # DTensor: the whole shape
                raise ValueError(f"checkpoint {path} does not match this model: {name} has shape {list(saved)} "
                                 f"there, {list(tensor.shape)} here")

    def _optimizer_names(self) -> list[list[str]]:
        """Parameter names of each of the optimizer's param groups, in its order."""
        name = {id(t): n for n, t in zip(self.masters.names, self.masters.optimizer_params, strict=True)}
        return [[name[id(t)] for t in group["params"]] for group in self.optimizer.param_groups]

    def _restore(self, path: Path) -> None:
        if self.parallel.mesh is None:
            checkpoint = load_checkpoint(path, RESUME_STATE_KEYS)
            self._check_checkpoint(checkpoint, path)
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for name in checkpoint.weights:  # one tensor in host memory at a time
                    params[name].copy_(checkpoint.weights[name])
            if checkpoint.master or self.masters.state_dict():
                self.masters.load_state_dict(checkpoint.master)
            self.optimizer.load_state_dict(with_implementation_options(checkpoint.optimizer, self.optimizer))
            rng = checkpoint.rng
        else:
            checkpoint, rng = self._restore_shards(path)
        self.scheduler.load_state_dict(checkpoint.scheduler)
        self._apply_optim_settings()
        restore_rng(rng)
        state = checkpoint.state
        cfg = self.config
        old = yaml.safe_load(checkpoint.config_yaml or "{}") or {}
        if isinstance(old.get("oomb"), dict):  # a checkpoint of an earlier version: its flat sparse keys, mapped
            old["oomb"] = nested_options(old["oomb"])
        changed = _changed_keys(old, cfg.to_dict())
        saved = state.get("parallel", {"tp": 1, "dp": 1})
        # Sequences per step: dp x grad_accum; the same sum over other ranks or accumulation steps is the same step.
        before = int(old.get("train", {}).get("grad_accum", cfg.train.grad_accum)) * saved["dp"]
        after = cfg.train.grad_accum * self.parallel.dp
        if before != after:
            changed.append(f"sequences per step (train.grad_accum x data-parallel processes) {before} -> {after}")
        if changed:
            logger.warning("resuming %s with changed settings %s: the run continues, but not as the "
                           "checkpointed run would have", path, changed)
        if (saved["tp"], saved["dp"]) != (self.parallel.tp, self.parallel.dp):
            logger.info("resuming %s, written with tp=%d x dp=%d, with tp=%d x dp=%d: the same steps up to the "
                        "order of floating-point sums", path, saved["tp"], saved["dp"], self.parallel.tp,
                        self.parallel.dp)
        if state.get("data_files") != [str(f.path) for f in self.data.files]:
            logger.warning("the data files differ from those of checkpoint %s: the data position may not "
                           "mean the same", path)
        self.data.seek(DataPosition.from_dict(state["data_position"]))
        self.step, self.tokens = checkpoint.step, int(state["tokens"])
        self.losses, self.elapsed = [float(x) for x in state["losses"]], float(state["elapsed_s"])
        self.resumed_from, self._last_saved, self._saved_step = path, path, checkpoint.step
        if self.parallel.is_main:
            truncate_metrics(self.output_dir / cfg.logging.metrics_file, self.step)
        logger.info("resumed from %s (step %d, %d tokens seen)", path, self.step, self.tokens)

    def _apply_optim_settings(self) -> None:
        """The current config's optimizer settings over the restored state: the optimizer's and the scheduler's
        state dicts carry the checkpointed run's peak lr, betas, eps and weight decay, and the lr its schedule
        set last, so a resumed run with another lr or max_steps would run the old schedule (and its first step
        the old last lr). Unchanged settings give the very values the uninterrupted run holds."""
        optim = self.config.optim
        self.scheduler.base_lrs = [self.lr] * len(self.optimizer.param_groups)
        lr = self.lr * lr_factor(self.scheduler.last_epoch, optim, self.config.train.max_steps)  # as LambdaLR
        for group in self.optimizer.param_groups:
            matrices = all(t.dim() >= 2 for t in group["params"])  # build_optimizer's decayed group
            group.update(initial_lr=self.lr, lr=lr, betas=tuple(optim.betas), eps=optim.eps,
                         weight_decay=optim.weight_decay if matrices else 0.0)

    def _restore_shards(self, path: Path) -> tuple[Checkpoint, dict]:
        """Several processes: rank 0 reads and checks the checkpoint; its whole tensors go to every rank's
        shards (torch.distributed.checkpoint, broadcast from rank 0), the rest to every rank as objects.
        Returns the checkpoint without tensors and this rank's RNG state."""
        names = self._optimizer_names()
        local = {}

        def read() -> Checkpoint:
            checkpoint = load_checkpoint(path, RESUME_STATE_KEYS)
            self._check_checkpoint(checkpoint, path)
            optimizer = with_implementation_options(checkpoint.optimizer, self.optimizer)
            by_name = optimizer_state_by_name(optimizer, names)  # checks the groups first
            started = bool(optimizer["state"])
            local.update(tensors=collections.ChainMap(checkpoint.master, checkpoint.weights),  # read when sent
                         optimizer=by_name if started else None)
            return dataclasses.replace(checkpoint, weights={}, master={}, optimizer=None if started else optimizer)

        meta = self._on_main(read)
        started = meta.optimizer is None
        load_full_state(self.masters.module(), self.optimizer, local.get("tensors", {}),
                        (local.get("optimizer") or {}) if started else None)
        if not started:  # a checkpoint before the first step: only param groups, the same on every rank
            self.optimizer.load_state_dict(meta.optimizer)
        self.masters.push()
        ranks = meta.rng.get("ranks")
        rng = ranks[self.parallel.rank] if ranks and len(ranks) == dist.get_world_size() else meta.rng
        return meta, rng


RESUME_SENSITIVE = ("model", "lora", "data", "oomb", "train.seed", "optim.master_weights", "optim.offload")
# train.grad_accum: compared as sequences per step (with the data-parallel degree) in Checkpointing._restore


def _changed_keys(old: dict, new: dict) -> list[str]:
    """Settings that make a resumed run differ from the checkpointed one (max_steps, lr... may change)."""
    changed = []
    for key in RESUME_SENSITIVE:
        section, _, name = key.partition(".")
        before, after = old.get(section, {}), new.get(section, {})
        names = [name] if name else sorted(set(before) | set(after))
        changed += [path for n in names for path in _differences(f"{section}.{n}", before.get(n), after.get(n))]
    return changed


def _differences(path: str, before, after) -> list[str]:
    """The dotted paths under ``path`` where two config values differ (mappings compared key by key)."""
    if isinstance(before, dict) and isinstance(after, dict):
        return [p for key in sorted(set(before) | set(after))
                for p in _differences(f"{path}.{key}", before.get(key), after.get(key))]
    return [path] if before != after else []


def _picklable(obj) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True
