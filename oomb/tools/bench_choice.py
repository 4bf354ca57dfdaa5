"""`oomb bench --chosen`: a mode runs the step options `oomb train`'s chooser picks, not the flags' defaults.

The chooser (oomb/planning/choose.py) decides the options a user leaves unset from the memory free
when the step starts. A benchmark of "what users get" must run that plan, not a hand-copied list of
flags that goes stale when the chooser learns a new decision. Here the bench step's workload (every
weight trained, no optimizer: not the plan of a run with an optimizer or LoRA) is planned for the
sweep's longest context that some configuration fits, which fits every shorter one too (memory grows
with the context); longer contexts are reported as not fitting. The mode fixes the attention and
offload, and every option given on the command line (or by --quick) stays as given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import machine
from ..compiled_layers import may_compile
from ..models import fused_loss_possible
from ..planning.choose import NoConfigFitsError, Resources, Workload, choose_config
from ..planning.memory import GIB
from ..planning.model_shape import ModelShape
from .plan import oomb_config_for

CHOSEN_FIELDS = {
    "chunk_size": "chunk_size",
    "kv_grad_dtype": "precision.kv_grad_dtype",
    "backend": "performance.backend",
    "checkpoint_layers": "performance.checkpoint_layers",
    "recompute_logits": "performance.recompute_logits",
    "keep_attention_outputs": "performance.keep_attention_outputs",
    "offload_resident_layers": "offload.resident_layers",
    "sparse_query_block_pages": "sparse.query_block_pages",
}
"""The chooser's OOMBConfig options (dotted paths) by the BenchOptions field that carries each (offload.enabled
is the mode's)."""


@dataclass(frozen=True)
class BenchChoice:
    """A mode's plan: the BenchOptions fields to replace, its description, and the contexts too long for
    any configuration (with the chooser's reason, one line)."""

    changes: dict
    plan: str
    too_long: tuple[int, ...] = ()
    why_too_long: str = ""


def chosen_options(mode: str, options, shape: ModelShape, gpu_free: int | None, host_free: int,
                   compile_possible: bool = False, fuse_possible: bool = False) -> BenchChoice:
    """The plan of ``mode`` (``options``: a BenchOptions whose ``given`` names the fields set on the command
    line) for ``gpu_free`` / ``host_free`` bytes free after the weights were loaded (``gpu_free`` None on a
    CPU), made for the longest context some configuration fits; no changes when none fits.
    ``compile_possible``: Workload.may_compile; ``fuse_possible``: Workload.may_fuse_loss."""
    base = oomb_config_for(mode, options.oomb_config())
    fixed = {path: base.option(path) for name, path in CHOSEN_FIELDS.items() if name in options.given}
    fixed.update({"attention": base.attention, "offload.enabled": base.offload.enabled,
                  "precision.deterministic": base.precision.deterministic})
    resources = Resources.free_on(torch.device(options.device), gpu_free, host_free, weights_loaded=True)
    cuda = resources.device == "cuda"
    too_long, why = [], ""
    for tokens in sorted(options.contexts, reverse=True):
        try:
            workload = Workload(shape, tokens, 1, options.dtype, optimizer="none", may_compile=compile_possible,
                                may_fuse_loss=fuse_possible)
            choice = choose_config(workload, resources, fixed, base)
        except NoConfigFitsError as err:
            too_long.append(tokens)
            lines = [line.strip() for line in str(err).splitlines()]
            why = why or lines[0].rstrip(":") + (f" ({lines[1]})" if len(lines) > 1 else "")
            continue
        config = choice.config
        changes = {name: config.option(path) for name, path in CHOSEN_FIELDS.items()}
        changes["kv_grad_dtype"] = str(config.precision.grad_dtype).removeprefix("torch.")
        gpu = f"GPU {gpu_free / GIB:.1f} GiB and " if cuda else ""
        plan = (f"{choice.describe()}\n  planned at {tokens:,} tokens for {gpu}host {host_free / GIB:.1f} GiB free"
                f"{' (longer contexts: nothing fits)' if too_long else ''}")
        return BenchChoice(changes, plan, tuple(sorted(too_long)), why)
    return BenchChoice({}, "nothing fits any context", tuple(sorted(too_long)), why)


def chosen_for_loaded_model(mode: str, options, model, device: torch.device) -> BenchChoice:
    """``chosen_options`` for ``model`` once its weights are on ``device``: from the GPU memory free now (None
    on a CPU) and the host memory free now."""
    gpu_free = machine.gpu_free_bytes(device) if device.type == "cuda" else None
    return chosen_options(mode, options, ModelShape.from_hf_config(model.config), gpu_free, machine.host_free_bytes(),
                          may_compile(model), fused_loss_possible(model))
