"""Decoder layers compiled with torch.compile for the step, attention left out of the graph.

Outside its GEMMs and attention, a layer's time goes to small elementwise kernels: RMSNorm's float
casts and reductions, rotary embedding, SiLU times up, residual adds, each one pass over the chunk's
activations (and again in the backward). Compiling the layer fuses them: the 7B shape's 128K sparse
step took 23.48 s instead of 25.39 s and 7 GiB less GPU memory (H200, docs/design.md "Compiled layers").
oomb's attention function stays outside the graph (models.py registers it under
``torch.compiler.disable``): the paged store and the stage live there, and it has its own kernels.

The layers are compiled in place with ``nn.Module.compile`` only for the step and restored afterwards,
so a user's own calls of the model (generation, evaluation) run as they did. Compiled code is cached by
torch per layer class: the first step compiles (tens of seconds), later steps reuse it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

COMPILED_CALL = "_compiled_call_impl"
"""The attribute nn.Module.compile sets and nn.Module.__call__ reads (torch >= 2.2)."""


def compile_layers_by_default(config, device: torch.device, parallel, causal_lm: nn.Module) -> bool:
    """OOMBConfig.compile_layers resolved: the user's choice, else on for a single-process CUDA step of a
    model without experts that does not ask for bitwise determinism. Never with layer replay while a
    dropout is active: a compiled layer replays its checkpoint inside the graph, where dropout draws other
    masks than the stage-1 graph did (tests/test_engine.py::test_lora_dropout_is_replayed_in_stage_two)."""
    if config.compile_layers is False:
        return False
    dropout = active_dropout(causal_lm) if config.checkpoint_layers else None
    if dropout is not None:
        if config.compile_layers:
            raise ValueError(
                f"compile_layers=True with checkpoint_layers=True and an active dropout ({dropout}): "
                "compiled layers replayed in backward draw other dropout masks than stage 1 used, so stage 2 would "
                "not recompute the stored keys and values; set checkpoint_layers=False, compile_layers=False, or "
                "dropout to 0")
        return False
    if config.compile_layers:
        return True
    experts = getattr(causal_lm.config, "num_experts", None) or getattr(causal_lm.config, "num_local_experts", None)
    return (device.type == "cuda" and not config.deterministic and parallel.mesh is None and not experts
            and hasattr(nn.Module, "compile"))


def active_dropout(model: nn.Module) -> str | None:
    """The name of a dropout module of ``model`` that drops something now (training mode, p > 0), else None."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.training and module.p > 0:
            return name
    return None


def decoder_layers(decoder: nn.Module) -> list[nn.Module]:
    """The decoder's layer modules (transformers' GradientCheckpointingLayer)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in decoder.modules() if isinstance(m, GradientCheckpointingLayer)]


@contextlib.contextmanager
def compiled_layers(decoder: nn.Module, enabled: bool) -> Iterator[None]:
    """Run the decoder's layers compiled inside the block (a layer the user compiled stays as it is)."""
    compiled = []
    if enabled:
        for layer in decoder_layers(decoder):
            if getattr(layer, COMPILED_CALL, None) is None:
                layer.compile()
                compiled.append(layer)
    try:
        yield
    finally:
        for layer in compiled:
            setattr(layer, COMPILED_CALL, None)
