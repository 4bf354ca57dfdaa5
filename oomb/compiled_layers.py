"""Decoder layers compiled with torch.compile for the step, attention left out of the graph.

Outside its GEMMs and attention, a layer's time goes to small elementwise kernels: RMSNorm's float
casts and reductions, rotary embedding, SiLU times up, residual adds, each one pass over the chunk's
activations (and again in the backward). Compiling the layer fuses them: the 7B shape's 128K sparse
step without layer replay took 23.48 s instead of 25.39 s and 7 GiB less GPU memory (H200,
docs/design.md "Compiled layers"). oomb's attention function stays outside the graph (models.py
registers it under ``torch.compiler.disable``): the paged store and the stage live there, and it has
its own kernels.

The first step compiles the segments of a layer around its attention call, for each stage. Float arguments
are specialised as constants (``specialize_float``): they do not change within a step, and symbolic floats
cost compile time. Measured on one H100 (7B shape, LoRA, 32K, empty caches): 26 s of
compilation, where the earlier carried weight gradients (a guard on whether ``.grad`` existed yet, two versions
of every segment) and symbolic floats took 84 s (docs/design.md, "Compile time").

With layer replay too: transformers runs a layer's checkpoint inside the layer's call (or its forward), where a
checkpoint met while tracing would run the layer eager, so for stage 2 models.layer_checkpointing sets the
layers' own compiled call aside and checkpoints a compiled call of what transformers replays instead: the forward
and the recomputation in the backward run the same compiled graphs (tests/test_compiled_layers.py, with
transformers 5.17 and newer). Not with an active dropout: with trainable bf16 linear layers (bf16 LoRA adapters), stage
2's graphs break at the float32-gradient linear layers (fp32_linear.py) and stage 1's do not, and the
masks differed (measured; see CHANGELOG.md and git history). The layers are compiled in place with
``nn.Module.compile`` only for the step and restored afterwards, so a user's own calls of the model
(generation, evaluation) run as they did. Compiled code is cached by torch per code object: the first
step compiles, later steps reuse it.

The layers compile with dynamic shapes from the start: one graph serves every chunk length. With torch's
default the first length (the chunk size) compiled a static graph and the next (a shorter last chunk) a
dynamic one, which torch then tried first for every length, so the first step's full chunks ran other
kernels than every later step's: two identical steps differed in rounding (max |diff| 7.3e-4 in a bf16
model's gradients on an H100, where static shapes throughout gave bitwise equal steps), and a resumed run
would not repeat the uninterrupted one. Dynamic shapes cost 0.85 % on the 7B shape's 128K sparse step (H200:
20.69 s against 20.52 s with static full chunks) and compile once per stage instead of twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .models import COMPILED_CALL, config_has_dropout, decoder_layers

RECOMPILE_LIMIT = 64
"""Compiled versions per code object during the step (torch's default is 8). transformers wraps every
layer's and attention module's forward in one shared decorator function, and grad mode, the last
chunk's length and the layer kind each add versions; past the limit torch would run that frame eager,
and stage 1 and stage 2 must run the same code (with a dropout, the same masks), so the step raises
instead. A float that differs from layer to layer (PEFT's per-layer ``alpha_pattern`` or ``rank_pattern``: each
LoRA layer's scaling) is a constant of the graph, so every distinct value compiles versions of its own (two per
value and stage pair on a CPU probe): the limit is at least RECOMPILES_PER_LAYER per decoder layer."""

RECOMPILES_PER_LAYER = 4
"""Compiled versions per code object allowed for each decoder layer (see RECOMPILE_LIMIT): a 36-layer LoRA model
with a distinct alpha per layer went past 64 and raised."""


def resolve_compile_layers(config, device: torch.device, parallel, causal_lm: nn.Module) -> bool:
    """OOMBConfig.performance.compile_layers resolved for this step: ``compiles(...)``; the automatic choice also needs
    no active dropout and a machine where torch can compile (``can_compile``). Raises for True where the
    step cannot keep both stages' code the same."""
    experts = getattr(causal_lm.config, "num_experts", None) or getattr(causal_lm.config, "num_local_experts", None)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1
    if not compiles(config, device.type == "cuda", bool(experts), parallel.mesh is None and not distributed):
        return False
    if config.performance.compile_layers is None:
        return may_compile(causal_lm)
    dropout = active_dropout(causal_lm)
    problem = compile_problem()
    if dropout is not None:
        raise ValueError(f"compile_layers=True with an active dropout ({dropout}): stage 2 must draw the masks "
                         "stage 1 drew, and compiled layers with trainable bf16 linear layers drew others "
                         "(measured on the H200); set compile_layers=False (or None), or the dropout to 0")
    if problem is not None:
        raise ValueError(f"compile_layers=True: {problem}")
    return True


def compiles(config, cuda: bool, experts: bool, single_process: bool = True) -> bool:
    """The rule of OOMBConfig.performance.compile_layers without the model's and the machine's checks: the user's
    choice, else on for a single-process CUDA step of a model without experts, unless bitwise determinism is
    asked for (with or without layer replay: models.layer_checkpointing runs the replayed layers compiled)."""
    if config.performance.compile_layers is not None:
        return config.performance.compile_layers
    return cuda and single_process and not experts and not config.precision.deterministic


def may_compile(causal_lm: nn.Module, single_process: bool = True) -> bool:
    """The conditions of an automatic compile beyond the config (resolve_compile_layers): one process, a
    machine where torch can compile, and no active dropout. The planner counts compiled layers' activations
    only where these hold."""
    return single_process and active_dropout(causal_lm) is None and compile_problem() is None and can_compile()


def may_compile_config(model_config, one_process: bool, extra_dropout: bool = False,
                       compiles_elsewhere: bool = False) -> bool:
    """may_compile before a model is built, from its Hugging Face config (`oomb plan`, `--print-config`): one
    process, no dropout in the config (nor ``extra_dropout``, e.g. LoRA's), and torch able to compile here, or
    ``compiles_elsewhere`` (a GPU planned from a machine without one)."""
    return (one_process and not extra_dropout and not config_has_dropout(model_config)
            and (can_compile() or compiles_elsewhere) and compile_problem() is None)


def active_dropout(model: nn.Module) -> str | None:
    """The name of a dropout module of ``model`` that drops something now (training mode, p > 0), else None."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.training and module.p > 0:
            return name
    return None


def compile_problem() -> str | None:
    """Why compiled layers cannot run safely in this process, or None."""
    dynamo_config = torch._dynamo.config
    if not all(hasattr(dynamo_config, name) for name in ("recompile_limit", "fail_on_recompile_limit_hit",
                                                          "specialize_float")):
        return f"torch {torch.__version__} lacks the compile settings the step sets (torch >= 2.7 has them)"
    if dynamo_config.suppress_errors:
        return ("torch._dynamo's suppress_errors is on: a frame that fails to compile would run eager in one stage "
                "and compiled in the other")
    return None


def can_compile() -> bool:
    """Whether torch.compile can generate GPU kernels here (dynamo supported, Triton installed)."""
    try:
        from torch.utils._triton import has_triton

        return bool(torch._dynamo.is_dynamo_supported() and has_triton() and hasattr(nn.Module, "compile"))
    except Exception:  # an older torch without these helpers: stay eager
        return False


def compile_seconds() -> float | None:
    """Seconds torch.compile has spent compiling frames in this process so far (tracing, AOTAutograd, inductor's
    code generation and kernel builds; not the kernels' runtime tuning), from torch's own compile-time metrics;
    None where this torch does not keep them."""
    try:
        from torch._dynamo.utils import compilation_time_metrics

        return float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))
    except Exception:  # a torch without these metrics: nothing to report
        return None


@contextlib.contextmanager
def layer_inputs_requiring_grad(causal_lm: nn.Module, enabled: bool) -> Iterator[None]:
    """Inside the block (stage 2 of a step with compiled layers) the input embeddings' output requires grad
    even when the embeddings are frozen (LoRA). Compiled graphs guard on their inputs' requires_grad: with a
    frozen embedding the first layer's input would not require grad and every other layer's would, and torch
    would compile stage 2's layer graphs twice. Costs the first layer's input gradient, which is dropped."""
    if not enabled:
        yield
        return

    def requiring_grad(module: nn.Module, args, output):
        if isinstance(output, torch.Tensor) and torch.is_grad_enabled() and not output.requires_grad:
            return output.detach().requires_grad_()
        return output

    hook = causal_lm.get_input_embeddings().register_forward_hook(requiring_grad)
    try:
        yield
    finally:
        hook.remove()


@contextlib.contextmanager
def compiled_layers(decoder: nn.Module, enabled: bool) -> Iterator[None]:
    """Run the decoder's layers compiled inside the block (a layer the user compiled stays as it is)."""
    if not enabled:
        yield
        return
    compiled, layers = [], decoder_layers(decoder)
    limit = max(RECOMPILE_LIMIT, RECOMPILES_PER_LAYER * len(layers))
    try:
        with torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True,
                                        specialize_float=True):
            for layer in layers:
                if getattr(layer, COMPILED_CALL, None) is None:
                    compiled.append(layer)
                    layer.compile(dynamic=True)
            yield
    finally:
        for layer in compiled:
            setattr(layer, COMPILED_CALL, None)
