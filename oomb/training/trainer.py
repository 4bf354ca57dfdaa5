"""`oomb.Trainer`: a complete long-context training run, driven by one ``TrainerConfig``.

    setup   output dir (fresh, --overwrite or --resume) -> model config checked (directory,
            architecture, context vs max positions) -> tokenizer -> data stream -> model (+ LoRA)
            -> memory check -> AdamW (fp32 masters) + schedule -> restore a checkpoint
    step    grad_accum x [next packed sequence -> oomb.forward_backward -> grads into fp32 masters]
            -> mean over sequences -> clip -> AdamW -> schedule -> masters copied into the model
    eval    every eval.every_steps steps: held-out perplexity and passkeys (evaluation.py) into the step's metrics
    after   metrics.jsonl line, progress bar; a checkpoint every checkpoint.every steps
    end     final checkpoint, export (save_pretrained) to output_dir/final, summary.json

Ctrl-C during a step drops the partial step, writes a checkpoint of the last complete one and
returns (``TrainResult.interrupted``); ``checkpoint.resume="latest"`` continues exactly there.

Several processes (torchrun): checkpoints hold whole tensors, gathered on rank 0 (which alone
writes files), and are resumed by any number of processes, any tp x dp layout
(oomb/training/checkpointing.py, with oomb/training/checkpoint.py: gather_full_state, load_full_state).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import random
import shutil
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from .. import machine
from ..compiled_layers import compile_seconds, may_compile, may_compile_config
from ..engine import forward_backward
from ..kv.offload import HostSlabs
from ..models import fused_loss_possible, fused_loss_possible_for_config, unwrap_causal_lm
from ..parallel import ParallelSetup, clip_grad_norm, full_tensor, init_distributed, setup_parallel
from ..planning.choose import (
    MEMORY_HEADROOM,
    Choice,
    NoConfigFitsError,
    Resources,
    Workload,
    choose_config,
    lora_no_replay_bytes,
)
from ..planning.memory import GIB, estimate_step_memory
from ..planning.model_shape import ModelShape
from .checkpoint import (
    DamagedCheckpointError,
    atomic_directory,
    checkpoint_step,
    latest_checkpoint,
    latest_intact_checkpoint,
    list_checkpoints,
    load_checkpoint,
)
from .checkpointing import RESUME_STATE_KEYS, Checkpointing
from .config import TrainerConfig
from .data import PackedSequences, check_records, resolve_files
from .evaluation import run_evaluation
from .optim import MasterWeights, build_optimizer, build_scheduler
from .presets import (
    TINY_PRESET,
    apply_lora,
    build_model,
    context_warning,
    count_parameters,
    load_model_config,
    load_tokenizer,
)
from .report import Reporter

logger = logging.getLogger(__name__)

DEFAULT_LR = {"tiny": 3e-3, "lora": 2e-4, "full": 1e-5}
ARTIFACTS = ("checkpoints", "superseded", "final", "final-merged", "tensorboard", "summary.json", "config.yaml")


def chooser_fixed(cfg: TrainerConfig, cuda: bool, shape: ModelShape) -> dict:
    """The oomb options the chooser must keep: those the user set, plus the Triton backend for separate
    documents in a model whose sliding windows bind on CUDA (windows inside documents: as the engine's
    "auto" takes it)."""
    fixed = {k: v for k, v in cfg.oomb.options().items() if k not in cfg.oomb_auto}
    windows = shape.sliding_window_layers and shape.sliding_window < cfg.data.seq_len
    if cuda and cfg.data.documents == "separate" and windows and "performance.backend" not in fixed:
        fixed["performance.backend"] = "triton"  # oomb/engine.py, _select_step_backend
    return fixed


def preview_choice(cfg: TrainerConfig) -> Choice | None:
    """What the chooser would pick for ``cfg``'s oomb options left ``auto`` on this machine now, from the model's
    config alone (nothing is built: ``oomb train --print-config``). The weights count against the free memory,
    the LoRA adapters are PEFT's all-linear ones, and the compiled layers and the fused loss are counted where
    the config allows them (one process, a machine that compiles, no dropout; a plain head), as the trainer
    finds them on the built model. None: nothing is left to the chooser. Raises NoConfigFitsError when
    nothing fits."""
    if not cfg.train.auto_config or not cfg.oomb_auto:
        return None
    device = _resolve_device(cfg.train.device)
    dtype = _resolve_dtype(cfg.model.dtype, device)
    cuda = device.type == "cuda"
    model_config = load_model_config(cfg.model, cfg.data.seq_len)
    shape = ModelShape.from_hf_config(model_config).per_rank(cfg.parallel.tp)
    lora = cfg.lora.r if cfg.lora.enabled else 0
    one_process = cfg.parallel.tp == 1 and cfg.parallel.cp == 1 and cfg.parallel.dp in (None, 1)
    workload = Workload(shape, cfg.data.seq_len, 1, dtype, lora, master_weights=cfg.optim.master_weights,
                        trainable_params=shape.lora_params(lora) if lora else shape.num_params(),
                        fp32_targets=cfg.optim.master_weights and not cfg.optim.offload,
                        may_compile=may_compile_config(model_config, one_process,
                                                       extra_dropout=cfg.lora.enabled and cfg.lora.dropout > 0),
                        may_fuse_loss=one_process and fused_loss_possible_for_config(model_config, dtype),
                        context_parallel=cfg.parallel.cp > 1)
    resources = Resources.free_on(device, machine.gpu_free_bytes(device) if cuda else None, host_available_bytes())
    return choose_config(workload, resources, chooser_fixed(cfg, cuda, shape), cfg.oomb)


class NotEnoughMemoryError(MemoryError):
    """The predicted memory of a step exceeds what is free; the message has the numbers and the fixes."""


@dataclass
class TrainResult:
    steps: int
    losses: list[float]
    tokens: int
    elapsed_s: float
    tokens_per_s: float
    output_dir: str
    checkpoint: str | None
    export_dir: str | None
    merged_dir: str | None
    interrupted: bool
    resumed_from: str | None
    peak_gpu_gib: float | None
    peak_host_gib: float
    first_step_s: float | None = None
    """Seconds of this session's first step: compilation and kernel autotuning included."""
    steady_step_s: float | None = None
    """Median seconds of the session's later steps (None with fewer than two steps)."""
    predicted_step_s: float | None = None
    """The step time the plan predicted (planning/step_time.py; None on a CPU), beside steady_step_s."""
    steady_step_parts_s: dict[str, float] | None = None
    """Medians of the later steps' parts: data_s (reading the batch), forward_backward_s (oomb's step, the
    loss read included), update_s (clipping, optimizer, scheduler, until the GPU is done)."""
    first_step_compile_s: float | None = None
    """Of first_step_s, the seconds torch.compile spent compiling the decoder layers (compiled_layers.compile_seconds;
    None where torch keeps no compile-time metrics)."""
    first_step_pin_s: float | None = None
    """Of first_step_s, the seconds spent allocating and page-locking the host memory of offloaded pages (None
    without offload)."""
    setup_s: float | None = None
    """Seconds before the first step: model load, plan, pinned host memory."""
    checkpoint_s: float = 0.0
    """Seconds this session spent writing checkpoints (the last one included)."""

    @property
    def first_step_overhead_s(self) -> float | None:
        """What the first step cost beyond a steady one (compilation, autotuning, allocator warm-up)."""
        if self.first_step_s is None or self.steady_step_s is None:
            return None
        return max(0.0, self.first_step_s - self.steady_step_s)

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None


class Trainer(Checkpointing):
    """Train a causal LM on long packed sequences with oomb's chunk-recurrent step.

    Args:
        config: the run's configuration (default: the embedded tiny model and corpus on this machine).
        model: an already-built transformers *ForCausalLM (optionally PEFT-wrapped) to train instead of
            loading ``config.model``; it stays on its device and dtype (``model.*`` and ``train.device``
            are not used), LoRA is added if ``lora.enabled`` and it is not PEFT-wrapped yet.
        tokenizer: the tokenizer to use with ``model``.
    """

    def __init__(self, config: TrainerConfig | None = None, *, model: nn.Module | None = None,
                 tokenizer=None) -> None:
        self.config = config or TrainerConfig()
        if (model is None) != (tokenizer is None):
            raise ValueError("pass model and tokenizer together (or neither, to load them from config.model)")
        self.model, self.tokenizer = model, tokenizer
        self.output_dir = Path(self.config.train.output_dir)
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise ValueError(f"train.output_dir {str(self.output_dir)!r} is a file: give a directory (--output-dir)")
        self.checkpoint_dir = self.output_dir / "checkpoints"
        self.step = 0
        self.tokens = 0
        self.losses: list[float] = []
        self.elapsed = 0.0  # training seconds, over all sessions of the run
        self.resumed_from: Path | None = None
        self._last_saved: Path | None = None
        self._saved_step = -1
        self._updating = False  # inside a step's optimizer update (_applying_update)
        self._ready = False
        self._last_metrics: dict | None = None
        self._peak_gpu = 0.0
        self._owns_process_group = False  # setup() joined torchrun's process group: close() leaves it
        self.choice: Choice | None = None  # what oomb.planning.choose chose for the oomb options left unset
        self._auto_refusal: str | None = None  # why the chooser found nothing that fits
        self._step_times: list[float] = []  # this session's step times (first step reported apart)
        self._step_parts: list[dict[str, float]] = []  # each step's seconds by part (metrics' *_s parts)
        self._step_compile_s: list[float | None] = []  # each step's seconds of torch.compile
        self._step_pin_s: list[float | None] = []  # each step's seconds pinning host memory (offload)
        self.setup_s: float | None = None  # seconds setup() took: model load, plan, pinned host memory
        self.checkpoint_s = 0.0  # seconds this session spent writing checkpoints
        self.parallel = ParallelSetup()

    # ---- setup ---------------------------------------------------------------------------------

    def setup(self) -> None:
        """Everything before the first step (``train`` calls it if not done yet)."""
        if self._ready:
            return
        setup_start = time.perf_counter()
        cfg = self.config
        self.device = _resolve_device(cfg.train.device)
        if self.device.type == "cpu":  # every term of a CPU step is host memory: give freed tensors back
            machine.bound_heap_retention()
        if cfg.oomb.performance.keep_attention_outputs and cfg.parallel.cp > 1:
            raise ValueError("oomb.performance.keep_attention_outputs=true is not supported with context parallelism "
                             f"(parallel.cp={cfg.parallel.cp}): set one of them off")
        joined_before = torch.distributed.is_available() and torch.distributed.is_initialized()
        world = init_distributed(self.device.type)  # torchrun: one process per GPU
        self._owns_process_group = world > 1 and not joined_before
        if world > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = _resolve_dtype(cfg.model.dtype, self.device)
        tp, cp = cfg.parallel.tp, cfg.parallel.cp
        dp = cfg.parallel.dp or max(1, world // (tp * cp))
        if tp * dp * cp != world:  # checked before anything is loaded or written, on every rank alike
            degrees = f"parallel.tp={tp} x parallel.dp={dp}" + (f" x parallel.cp={cp}" if cp > 1 else "")
            if world == 1:
                raise ValueError(f"{degrees} needs {tp * dp * cp} processes: start with "
                                 f"torchrun --nproc-per-node {tp * dp * cp} -m oomb.cli train ...")
            raise ValueError(f"{degrees} = {tp * dp * cp} processes, but {world} were "
                             "started: tp x cp must divide the number of processes (leave parallel.dp empty: "
                             "processes / (tp x cp))")
        if world > 1 and cfg.eval.every_steps:
            raise NotImplementedError("eval.every_steps is not supported with several processes: set "
                                      "eval.every_steps=0 and evaluate the exported model with `oomb eval`")
        if cfg.eval.every_steps and cfg.eval.data is not None and not Path(cfg.eval.data).is_file():
            raise FileNotFoundError(f"eval.data={cfg.eval.data!r} is not a file: give a held-out text or jsonl file")
        if world > 1 and cfg.optim.offload:
            raise NotImplementedError("optim.offload is not supported with several processes: the optimizer state "
                                      "stays on the GPUs, sharded over them (set optim.offload=false; more "
                                      "processes shard it further)")
        resume_from, stale = self._prepare_output_dir()
        torch.manual_seed(cfg.train.seed)
        random.seed(cfg.train.seed)

        if self.model is None:
            model_config = load_model_config(cfg.model, cfg.data.seq_len)
            self._check_weights_fit(model_config)  # before anything of the model's size is allocated
        else:
            model_config = unwrap_causal_lm(self.model).config
        warning = context_warning(model_config, cfg.data.seq_len)
        if warning:
            logger.warning(warning)
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(cfg.model)
        files = resolve_files(cfg.data)
        if cfg.data.check_records:
            main = world == 1 or torch.distributed.get_rank() == 0
            check_records(files, cfg.data, self.tokenizer, progress=cfg.logging.progress and main)
        self.data = PackedSequences(files, self.tokenizer, cfg.data, cfg.train.seed)
        if self.model is None:
            self.model = build_model(cfg.model, model_config, self.dtype, self.device)
        if cfg.lora.enabled and not hasattr(self.model, "peft_config"):
            self.model = apply_lora(self.model, cfg.lora)
        self.model.train()
        causal_lm = unwrap_causal_lm(self.model)
        self.trainable, self.total_params = count_parameters(self.model)  # before sharding: whole-model counts
        self.parallel = setup_parallel(self.model, tp=tp, dp=dp, cp=cp)
        self.device = causal_lm.get_input_embeddings().weight.device
        vocab = causal_lm.get_input_embeddings().num_embeddings
        if len(self.tokenizer) > vocab:
            raise ValueError(f"the tokenizer has {len(self.tokenizer)} tokens but the model embeds only {vocab}: "
                             "use the model's own tokenizer (model.tokenizer) or resize its embeddings")
        logger.info("model: %s, %.2f M parameters (%.2f M trainable), %s on %s", type(causal_lm).__name__,
                    self.total_params / 1e6, self.trainable / 1e6, self.dtype, self.device)

        self._num_masters = MasterWeights.count(self.model, cfg.optim.master_weights, cfg.optim.offload)
        self._auto_configure(causal_lm)  # the oomb options left unset, chosen for the free memory
        self._check_memory(causal_lm)  # before the masters and optimizer state exist
        self.masters = MasterWeights(self.model, cfg.optim.master_weights, cfg.optim.offload)
        self.host_slabs = HostSlabs() if cfg.oomb.offload.enabled else None  # pinned pages, reused by every step
        self.lr = cfg.optim.lr or default_lr(cfg)
        self.optimizer = build_optimizer(self.masters, cfg.optim, self.lr)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.max_steps)
        if self.parallel.is_main:
            for path in stale:  # --overwrite: deleted only now that the new run is known to start
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.yaml").write_text(cfg.to_yaml())
        self.parallel.barrier()
        if resume_from is not None:
            self._restore(resume_from)
            if self.parallel.is_main:
                self._set_aside_later_checkpoints(resume_from)
        self._data_position = self.data.position  # where the step after the last complete one starts
        self._ready = True
        self.setup_s = time.perf_counter() - setup_start

    def _prepare_output_dir(self) -> tuple[Path | None, list[Path]]:
        """The checkpoint to resume from (None: a fresh run), and the old artifacts a fresh run replaces.
        A fresh run in a directory holding another run is refused unless train.overwrite."""
        resume = self.config.checkpoint.resume
        latest = latest_checkpoint(self.checkpoint_dir)
        metrics = self.output_dir / self.config.logging.metrics_file
        artifacts = [p for p in (self.output_dir / n for n in (*ARTIFACTS, metrics.name)) if p.exists()]
        if resume == "latest" and latest is not None:
            return self._intact_checkpoint(), []
        if resume is not None and resume != "latest":
            return self._checked_resume_path(Path(resume)), []
        if resume == "latest":  # a run that died before its first checkpoint: start it again, its metrics kept
            kept = ""
            if metrics.exists() and metrics.stat().st_size and self.parallel.is_main:
                aside = self.output_dir / "superseded"
                aside.mkdir(exist_ok=True)
                metrics.rename(aside / metrics.name)
                kept = f"; the metrics of the run it replaces moved to {aside / metrics.name}"
            logger.warning("checkpoint.resume=latest: no checkpoint in %s, starting from step 0%s", self.checkpoint_dir,
                           kept)
            return None, [p for p in artifacts if p.name not in ("superseded", metrics.name)]
        recorded = metrics.exists() and metrics.stat().st_size > 0  # an empty file: a run that failed in its setup
        if (latest is not None or recorded) and not self.config.train.overwrite:
            found = latest.name if latest is not None else metrics.name
            raise ValueError(
                f"train.output_dir={str(self.output_dir)!r} already holds a run ({found}); continue it with "
                "--resume, start over with --overwrite (deletes its checkpoints and metrics), or choose "
                "another train.output_dir")
        return None, artifacts

    def _set_aside_later_checkpoints(self, resumed: Path) -> None:
        """Resumed from an earlier checkpoint than the newest: the later ones belong to the run this one replaces,
        and `--resume latest` would pick them up if this run stopped before saving past them. They move to
        output_dir/superseded (not deleted), with a warning naming them."""
        if resumed.resolve().parent != self.checkpoint_dir.resolve():
            return
        later = [p for p in list_checkpoints(self.checkpoint_dir) if checkpoint_step(p) > checkpoint_step(resumed)]
        if not later:
            return
        aside = self.output_dir / "superseded"
        aside.mkdir(exist_ok=True)
        for path in later:
            target = aside / path.name
            if target.exists():
                shutil.rmtree(target)
            path.rename(target)
        logger.warning("resumed from %s: the later checkpoints %s of the run it replaces moved to %s",
                       resumed.name, [p.name for p in later], aside)

    def _intact_checkpoint(self) -> Path:
        """The newest checkpoint whose files all read back; a damaged newer one is passed over with a warning
        naming its file, and a run with none intact is refused before anything is loaded."""
        intact, damaged = latest_intact_checkpoint(self.checkpoint_dir, RESUME_STATE_KEYS)
        if intact is None:
            raise DamagedCheckpointError(
                f"no intact checkpoint to resume from in {self.checkpoint_dir}:\n  " + "\n  ".join(damaged)
                + "\nrestore the damaged files from a copy, or start over with --overwrite (train.overwrite=true; "
                "deletes these checkpoints)")
        for message in damaged:
            logger.warning("%s: resuming from %s, the latest intact checkpoint, instead", message, intact)
        return intact

    def _checked_resume_path(self, path: Path) -> Path:
        """``path`` (checkpoint.resume) if its files read back; otherwise refused, naming the damaged file and
        the latest intact checkpoint of this run."""
        try:
            load_checkpoint(path, RESUME_STATE_KEYS)
        except DamagedCheckpointError as err:
            intact, _ = latest_intact_checkpoint(self.checkpoint_dir, RESUME_STATE_KEYS)
            fix = (f"resume from the latest intact checkpoint with --resume {intact}" if intact is not None
                   else f"no checkpoint in {self.checkpoint_dir} is intact")
            raise DamagedCheckpointError(f"{err}: {fix}, or restore the file from a copy") from err
        return path

    def _check_weights_fit(self, model_config) -> None:
        """Refuse, before the model is built, a model whose weights alone exceed the free memory of the device
        they go to: building it would die in the allocator with a traceback (a 7B preset on a small machine).
        The step's own terms are checked after the build (``_check_memory``), with the model's exact counts."""
        cfg = self.config
        if cfg.train.memory_check == "off":
            return
        shape = ModelShape.from_hf_config(model_config).per_rank(cfg.parallel.tp)
        params = shape.num_params()
        need = params * self.dtype.itemsize
        if self.device.type == "cuda":
            free, where = machine.gpu_free_bytes(self.device), f"GPU memory on {self.device}"
        else:
            free, where = host_available_bytes(), "host memory (MemAvailable)"
        if need <= MEMORY_HEADROOM * free:
            return
        source = cfg.model.path or f"preset {cfg.model.preset}"
        tips = ["a smaller model or preset", "a machine with more free memory"]
        if self.dtype.itemsize > 2:
            tips.insert(0, f"model.dtype=bfloat16 (half of {str(self.dtype).removeprefix('torch.')}'s "
                           f"{need / GIB:.1f} GiB)")
        message = (f"not enough {where} for the model: {source} has {params / 1e9:.2f} B parameters, whose weights "
                   f"alone need {need / GIB:.1f} GiB in {str(self.dtype).removeprefix('torch.')}, and "
                   f"{free / GIB:.1f} GiB are free (nothing was allocated)\noptions: " + "; ".join(tips))
        if cfg.train.memory_check == "warn":
            logger.warning("%s", message)
            return
        raise NotEnoughMemoryError(message + "\n  or set train.memory_check=warn to try anyway")

    def _check_memory(self, causal_lm) -> None:
        mode = self.config.train.memory_check
        if mode == "off":
            return
        terms = self.predicted_memory(causal_lm)
        need = sum(terms.values())
        if self.device.type == "cuda":
            free = machine.gpu_free_bytes(self.device)
            where = f"GPU memory on {self.device}"
        else:
            free = host_available_bytes()
            where = "host memory (MemAvailable)"
        problems = []
        if need > MEMORY_HEADROOM * free:
            problems.append((where, need, free, terms))
        if self.config.optim.offload and self.device.type == "cuda":
            host_need = 16 * self._num_masters
            host_free = host_available_bytes()
            if host_need > MEMORY_HEADROOM * host_free:
                problems.append(("host memory for the offloaded optimizer", host_need, host_free,
                                 {"fp32 masters, their gradients, AdamW state": host_need}))
        logger.info("predicted memory of a step beyond the loaded weights: %.2f GiB (%s)", need / GIB,
                    ", ".join(f"{k} {v / GIB:.2f}" for k, v in terms.items()))
        if not problems and self._auto_refusal is None:
            return
        if not problems:
            message = self._auto_refusal
            if mode == "warn":
                logger.warning("%s", message)
                return
            raise NotEnoughMemoryError(message + "\n  or set train.memory_check=warn to try anyway")
        message = "\n".join(
            f"not enough {w}: a step needs about {n / GIB:.1f} GiB beyond the loaded weights, {f / GIB:.1f} GiB "
            f"are free\n" + "\n".join(f"  {k}: {v / GIB:.2f} GiB" for k, v in t.items())
            for w, n, f, t in problems)
        message += "\n" + self._memory_advice(causal_lm)
        if self._auto_refusal is not None:
            message += "\n" + self._auto_refusal
        if mode == "warn":
            logger.warning("%s", message)
        else:
            raise NotEnoughMemoryError(message + "\n  or set train.memory_check=warn to try anyway")

    def _auto_configure(self, causal_lm) -> None:
        """Replace the oomb options left to the chooser (train.auto_config, TrainerConfig.oomb_auto) by
        the fastest configuration that fits the memory free now (oomb.planning.choose.choose_config).
        Several processes choose from the smallest free memory of any rank, so all choose alike."""
        cfg = self.config
        if not cfg.train.auto_config or not cfg.oomb_auto:
            return
        cuda = self.device.type == "cuda"
        # Context parallel: the chooser plans every page on one GPU (safe: a rank holds 1/cp of them) and,
        # with offload, on the host, which the cp ranks of a machine share.
        shape = ModelShape.from_hf_config(causal_lm.config).per_rank(cfg.parallel.tp)
        fixed = chooser_fixed(cfg, cuda, shape)
        gpu_free = machine.gpu_free_bytes(self.device) if cuda else 0
        host_free = host_available_bytes()
        if self.parallel.mesh is not None:  # every rank must run the same chunks and kernels
            free = torch.tensor([gpu_free, host_free], dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(free, op=torch.distributed.ReduceOp.MIN)
            gpu_free, host_free = (int(x) for x in free.tolist())
        workload = Workload(shape, cfg.data.seq_len, 1, self.dtype, cfg.lora.r if cfg.lora.enabled else 0,
                            trainable_params=self.trainable, optimizer_bytes=self._optimizer_bytes(),
                            fp32_targets=cfg.optim.master_weights and not cfg.optim.offload,
                            may_compile=may_compile(causal_lm, self.parallel.mesh is None),
                            may_fuse_loss=fused_loss_possible(causal_lm, self.parallel.mesh is None),
                            context_parallel=cfg.parallel.cp > 1)
        resources = Resources.free_on(self.device, gpu_free if cuda else None, host_free, weights_loaded=True)
        try:
            self.choice = choose_config(workload, resources, fixed, cfg.oomb)
        except NoConfigFitsError as err:  # the memory check below refuses (or warns), with these numbers
            self._auto_refusal = str(err)
            return
        cfg.oomb = self.choice.config
        cfg.oomb_auto = ()  # chosen: config.yaml records the values that ran
        logger.info("%s", self.choice.describe())

    def _optimizer_bytes(self) -> int:
        """GPU bytes of AdamW's state and the fp32 masters (0 when they live on the host)."""
        cfg = self.config
        if cfg.optim.offload:
            return 0
        unmastered = sum(2 * p.numel() * p.element_size() for p in self.model.parameters()
                         if p.requires_grad and not MasterWeights.needs_master(p, cfg.optim.master_weights, False))
        return unmastered + 16 * self._num_masters

    def predicted_memory(self, causal_lm) -> dict[str, int]:
        """Bytes a step adds to the loaded model on its device, by term (oomb.planning.memory + optimizer)."""
        cfg = self.config
        shape = ModelShape.from_hf_config(causal_lm.config).per_rank(cfg.parallel.tp)
        # With masters on the GPU, chunk gradients go straight into their fp32 .grad (counted with the
        # optimizer): no separate fp32 sums, and a low-precision .grad only outside linear layers.
        step = estimate_step_memory(shape, cfg.data.seq_len, cfg.oomb, dtype=self.dtype,
                                    trainable_params=self.trainable,
                                    fp32_targets=cfg.optim.master_weights and not cfg.optim.offload,
                                    context_parallel=cfg.parallel.cp,
                                    fused_loss=fused_loss_possible(causal_lm, self.parallel.mesh is None),
                                    head_trained=causal_lm.get_output_embeddings().weight.requires_grad)
        terms = {
            "KV and KV-gradient pages": step.kv_pages,
            "activations of one chunk": step.chunk_activations,
            "logits slice": step.logits_slice,
            "parameter gradients (+ fp32 sums over chunks)": step.param_grads,
        }
        if step.kept_attention:
            terms["kept attention outputs (stage 1 to stage 2)"] = step.kept_attention
        if cfg.lora.enabled and not cfg.oomb.performance.checkpoint_layers:
            terms["LoRA layers' saved inputs (no layer replay)"] = lora_no_replay_bytes(
                shape, min(cfg.oomb.chunk_size, cfg.data.seq_len), self.dtype)
        if not cfg.optim.offload:
            # AdamW's exp_avg and exp_avg_sq take the dtype of what it steps: an fp32 master (which
            # also holds 4 bytes of weight and 4 of gradient), else the parameter itself (bf16: 4
            # bytes in all; measured on the H200, benchmarks/results/trainer_memory_*).
            terms["optimizer state"] = self._optimizer_bytes()
        return terms

    def _memory_advice(self, causal_lm) -> str:
        cfg = self.config
        shape = ModelShape.from_hf_config(causal_lm.config)
        per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * (
            self.dtype.itemsize + cfg.oomb.precision.grad_dtype.itemsize)
        tips = [f"lower data.seq_len={cfg.data.seq_len} (KV pages cost {per_token / 1024:.0f} KiB per token)"]
        if cfg.oomb.precision.grad_dtype == torch.float32 and self.dtype != torch.float32:
            tips.append("set oomb.precision.kv_grad_dtype=bfloat16 (halves the KV-gradient pages)")
        if not cfg.lora.enabled:
            tips.append("train LoRA adapters (lora.enabled=true) instead of all weights")
            if not cfg.optim.offload and self.device.type == "cuda":
                tips.append("keep master weights and AdamW state in host memory (optim.offload=true)")
        tips.append(f"use a smaller oomb.chunk_size={cfg.oomb.chunk_size} (less activation memory)")
        return "options: " + "; ".join(tips)

    def close(self) -> None:
        """Leave the process group that setup() joined (under torchrun). Left to interpreter exit,
        the group's threads are torn down while still running, and a rank can abort after the run
        finished (SIGABRT; 1 of 25 CPU runs), which torchrun reports as a failed job.
        A group the caller initialized is left alone."""
        if self._owns_process_group:
            self._owns_process_group = False
            torch.distributed.destroy_process_group()

    # ---- the loop ------------------------------------------------------------------------------

    def train(self) -> TrainResult:
        """Run setup, then steps up to train.max_steps; checkpoint, export and summarize."""
        self.setup()
        cfg = self.config
        if self.step >= cfg.train.max_steps:
            logger.warning("resumed at step %d, already train.max_steps=%d: nothing to train (raise --steps to train "
                           "on)", self.step, cfg.train.max_steps)
        reporter = Reporter(cfg, self.output_dir, self.step, enabled=self.parallel.is_main)
        interrupted = False
        try:
            while self.step < cfg.train.max_steps:
                metrics = self.train_step(on_chunk=reporter.chunk)
                if self._evaluation_due():
                    metrics["eval"] = self.evaluate()
                reporter.log(metrics)
                every = cfg.checkpoint.every
                if every and self.step % every == 0 and self.step < cfg.train.max_steps:
                    self._timed_checkpoint()
        except KeyboardInterrupt:
            interrupted = True
            if self._last_metrics and self._last_metrics["step"] > reporter.last_step:
                reporter.log(self._last_metrics)  # Ctrl-C came during that step's update, which completed
            self.masters.zero_grads()  # the partial step is dropped; its data is read again on resume
            logger.warning("interrupted during step %d: saving the state after step %d", self.step + 1, self.step)
        except Exception as err:
            self._save_before_failing(err)
            raise
        finally:
            reporter.close()
        if self._saved_step != self.step or self._last_saved is None:
            self._timed_checkpoint()
        export_dir = merged_dir = None
        if not interrupted and cfg.checkpoint.export:
            export_dir, merged_dir = self.export()
        result = self._result(interrupted, export_dir, merged_dir)
        if self.parallel.is_main:
            (self.output_dir / "summary.json").write_text(json.dumps(asdict(result), indent=1))
        self.data.close()
        return result

    def _save_before_failing(self, err: Exception) -> None:
        """A step that failed before its update (out of memory, pages that no longer fit, a data error) leaves the
        state after the last complete step intact: checkpoint it, so that the steps since the last checkpoint are
        not lost (at 1M tokens a step takes minutes). One process only (a collective save would wait on the
        others), and not for a non-finite loss (the weights that gave it may be the fault, and the checkpoint's
        rotation would drop an earlier, good one)."""
        if (self._updating or isinstance(err, FloatingPointError) or torch.distributed.is_initialized()
                or self._saved_step == self.step or self.step == 0):
            return
        try:
            self.masters.zero_grads()  # the failed step's partial gradients
            self._timed_checkpoint()
        except Exception as save_error:  # e.g. a CUDA error leaves the device unusable: the step's error stands
            logger.warning("step %d failed and saving the state after step %d failed too (%s: %s)", self.step + 1,
                           self.step, type(save_error).__name__, save_error)
            return
        logger.warning("step %d failed (%s): saved the state after step %d to %s; continue it with --resume %s once "
                       "fixed", self.step + 1, type(err).__name__, self.step, self._last_saved, self.output_dir)

    def train_step(self, on_chunk: Callable[[int, int, int], None] | None = None) -> dict:
        """One optimizer step over train.grad_accum sequences; returns its metrics. ``on_chunk(sequence, done,
        total)``: called after each chunk of either stage (``forward_backward``'s progress callback), unless
        logging.chunk_progress shows the step's own bar."""
        cfg = self.config
        start = time.perf_counter()
        compiled_before = compile_seconds()
        pinned_before = self.host_slabs.pin_seconds if self.host_slabs is not None else None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        losses, tokens, documents, epoch = [], 0, 0, 0
        parallel = self.parallel
        data_s = 0.0
        step_sums = (self.masters.step_sums() if cfg.train.grad_accum > 1 and not parallel.fsdp
                     and cfg.oomb.precision.fp32_grad_accumulation else {})
        for micro in range(cfg.train.grad_accum):
            # Data parallel: every rank reads the same stream (so positions agree for checkpoints) and
            # trains on every dp-th sequence; tensor-parallel ranks of a group share theirs.
            fetch_start = time.perf_counter()
            samples = [next(self.data) for _ in range(parallel.dp)]
            data_s += time.perf_counter() - fetch_start
            sample = samples[parallel.dp_rank]
            boundaries = {"cu_seqlens": sample.cu_seqlens()} if cfg.data.documents == "separate" else {}
            progress = cfg.logging.progress and cfg.logging.chunk_progress and parallel.is_main
            if not progress and on_chunk is not None:
                progress = functools.partial(on_chunk, micro)
            loss = forward_backward(self.model, sample.input_ids[None], sample.labels[None], config=cfg.oomb,
                                    **boundaries, progress=progress,
                                    grad_targets=None if parallel.fsdp else {**self.masters.grad_targets(),
                                                                             **step_sums},
                                    parallel=parallel, host_slabs=self.host_slabs,
                                    sync_gradients=micro == cfg.train.grad_accum - 1)
            self.masters.collect()
            losses.append(parallel.all_mean(float(loss)))
            tokens += sum(s.input_ids.numel() for s in samples)
            documents, epoch = documents + sum(s.documents for s in samples), sample.epoch
        self.masters.finish_sums(step_sums)
        loss = sum(losses) / len(losses)  # reading the losses waited for the GPU
        update_start = time.perf_counter()
        if not math.isfinite(loss):
            raise FloatingPointError(f"the loss is {loss} at step {self.step + 1}: lower optim.lr (now "
                                     f"{self.lr}) or check the data; the last checkpoint is {self._last_saved}")
        with _sigint_deferred(), self._applying_update():  # an update is applied whole or not at all
            self.masters.scale_grads(1 / cfg.train.grad_accum)  # the mean over sequences
            clip = cfg.optim.max_grad_norm or math.inf
            if parallel.mesh is None:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.masters.optimizer_params, clip))
            else:  # DTensor gradients (and plain replicated ones under tensor parallel)
                grad_norm = clip_grad_norm(self.masters.optimizer_params, clip)
            lr = self.optimizer.param_groups[0]["lr"]  # what this step uses
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.masters.push()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the update is this step's, not the next one's
            self.step += 1
            self.tokens += tokens
            self.losses.append(loss)
            self._data_position = self.data.position
            end = time.perf_counter()
            step_time = end - start
            self.elapsed += step_time
            self._step_times.append(step_time)
            parts = {"data_s": data_s, "update_s": end - update_start}
            parts["forward_backward_s"] = step_time - parts["data_s"] - parts["update_s"]
            self._step_parts.append(parts)
            compiled_after = compile_seconds()
            metrics = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                       "tokens_total": self.tokens, "tokens_per_s": tokens / step_time, "step_time_s": step_time,
                       **parts, "elapsed_s": self.elapsed, "epoch": epoch, "documents": documents,
                       "host_rss_gib": host_rss_bytes() / GIB,
                       "compile_s": (compiled_after - compiled_before
                                     if compiled_before is not None and compiled_after is not None else None)}
            self._step_compile_s.append(metrics["compile_s"])
            if pinned_before is not None:
                metrics["pin_s"] = self.host_slabs.pin_seconds - pinned_before
            self._step_pin_s.append(metrics.get("pin_s"))
            if self.device.type == "cuda":
                metrics["gpu_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / GIB
                self._peak_gpu = max(self._peak_gpu, metrics["gpu_peak_gib"])
            self._last_metrics = metrics
        return metrics

    @contextlib.contextmanager
    def _applying_update(self):
        """Marks the update under way: a failure inside it leaves no state worth saving (_save_before_failing)."""
        self._updating = True
        yield
        self._updating = False  # (left set when the update raised)

    def _evaluation_due(self) -> bool:
        every = self.config.eval.every_steps
        return bool(every) and (self.step % every == 0 or self.step == self.config.train.max_steps)

    def evaluate(self) -> dict:
        """The eval section's evaluation of the model as it is now, with the step's oomb options (and pinned
        pages): held-out perplexity by position and passkey accuracy (oomb/training/evaluation.py)."""
        self.setup()
        cfg = self.config
        return run_evaluation(self.model, self.tokenizer, cfg.eval, cfg.oomb, seq_len=cfg.data.seq_len,
                              text_field=cfg.data.text_field,
                              progress=cfg.logging.progress and cfg.logging.chunk_progress and self.parallel.is_main,
                              host_slabs=self.host_slabs)

    def export(self) -> tuple[Path, Path | None]:
        """save_pretrained the model (LoRA: the adapter) and tokenizer to output_dir/final; with
        lora.merge_on_export also the merged model to output_dir/final-merged."""
        final = self.output_dir / "final"
        if self.parallel.mesh is not None:
            # Whole tensors gathered from the shards one at a time (every rank takes part), kept in
            # rank 0's host memory: the GPUs never hold the whole model at once; rank 0 writes them.
            state = _gathered_on_host(self.model.state_dict(), keep=self.parallel.is_main)
            if self.parallel.is_main:
                with atomic_directory(final) as tmp:
                    self.model.save_pretrained(tmp, state_dict=state)
                    self.tokenizer.save_pretrained(tmp)
            self.parallel.barrier()
            if self.config.lora.enabled and self.config.lora.merge_on_export:
                logger.warning("lora.merge_on_export is not supported with several processes: merge %s later", final)
            return final, None
        with atomic_directory(final) as tmp:
            self.model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
        merged = None
        if self.config.lora.enabled and self.config.lora.merge_on_export:
            merged = self.output_dir / "final-merged"
            with atomic_directory(merged) as tmp:
                self.model = self.model.merge_and_unload()
                self.model.save_pretrained(tmp)
                self.tokenizer.save_pretrained(tmp)
        logger.info("exported to %s%s", final, f" and {merged}" if merged else "")
        return final, merged

    def _timed_checkpoint(self) -> None:
        start = time.perf_counter()
        self.save_checkpoint()
        self.checkpoint_s += time.perf_counter() - start

    def _result(self, interrupted: bool, export_dir, merged_dir) -> TrainResult:
        gpu = self._peak_gpu if self.device.type == "cuda" else None
        return TrainResult(
            steps=self.step, losses=list(self.losses), tokens=self.tokens, elapsed_s=self.elapsed,
            tokens_per_s=self.tokens / self.elapsed if self.elapsed else 0.0, output_dir=str(self.output_dir),
            checkpoint=str(self._last_saved) if self._last_saved else None,
            export_dir=str(export_dir) if export_dir else None, merged_dir=str(merged_dir) if merged_dir else None,
            interrupted=interrupted, resumed_from=str(self.resumed_from) if self.resumed_from else None,
            peak_gpu_gib=gpu, peak_host_gib=machine.peak_rss_bytes() / GIB,
            first_step_s=self._step_times[0] if self._step_times else None,
            first_step_compile_s=self._step_compile_s[0] if self._step_compile_s else None,
            first_step_pin_s=self._step_pin_s[0] if self._step_pin_s else None,
            steady_step_s=statistics.median(self._step_times[1:]) if len(self._step_times) > 1 else None,
            predicted_step_s=(self.choice.step_time.seconds
                              if self.choice is not None and self.choice.step_time is not None else None),
            steady_step_parts_s=({k: statistics.median(p[k] for p in self._step_parts[1:]) for k in self._step_parts[1]}
                                 if len(self._step_parts) > 1 else None),
            setup_s=self.setup_s, checkpoint_s=self.checkpoint_s)


def terminate_as_interrupt(signum, frame) -> None:
    """A SIGTERM handler (`oomb train` installs it): a scheduler's or `timeout`'s stop is handled as Ctrl-C is,
    the partial step dropped and the last complete one checkpointed."""
    raise KeyboardInterrupt


@contextlib.contextmanager
def _sigint_deferred():
    """Hold Ctrl-C (and SIGTERM where terminate_as_interrupt handles it) until the block is done (main thread
    only), then raise it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    kinds = [signal.SIGINT] + ([signal.SIGTERM] if signal.getsignal(signal.SIGTERM) is terminate_as_interrupt else [])
    previous = {kind: signal.signal(kind, lambda signum, frame: received.append(signum)) for kind in kinds}
    try:
        yield
    finally:
        for kind, handler in previous.items():
            signal.signal(kind, handler)
    if received:
        raise KeyboardInterrupt


def _gathered_on_host(state: dict[str, torch.Tensor], keep: bool) -> dict[str, torch.Tensor | None]:
    """Every tensor of ``state`` whole (DTensors gathered: a collective each, in order on every rank) in
    host memory where ``keep``, else None; one whole tensor on the GPU at a time."""
    out = {}
    for name, tensor in state.items():
        whole = full_tensor(tensor)
        out[name] = whole.cpu() if keep else None
        del whole
    return out


def default_lr(config: TrainerConfig) -> float:
    """optim.lr when left empty: by what is trained (the tiny preset, LoRA adapters, every weight)."""
    if config.model.path is None and config.model.preset == TINY_PRESET:
        return DEFAULT_LR["tiny"]
    return DEFAULT_LR["lora" if config.lora.enabled else "full"]


def resolved_run_settings(config: TrainerConfig) -> dict[str, str]:
    """What the run's own settings left empty or ``auto`` resolve to on this machine (dotted keys): the learning
    rate, the device and the model dtype, for ``--print-config``."""
    device = _resolve_device(config.train.device)
    return {"optim.lr": f"{default_lr(config):g}", "train.device": str(device),
            "model.dtype": str(_resolve_dtype(config.model.dtype, device)).removeprefix("torch.")}


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device={name!r} but CUDA is not available here; use train.device=cpu")
    return device


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def host_available_bytes() -> int:
    """Memory the kernel could hand out now (MemAvailable), else free physical pages."""
    return machine.host_free_bytes()


def host_rss_bytes() -> int:
    """Current resident memory of this process."""
    rss = machine.current_rss_bytes()
    return rss if rss is not None else machine.peak_rss_bytes()
