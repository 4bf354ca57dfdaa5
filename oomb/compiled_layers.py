"""Decoder layers compiled with torch.compile, attention left out of the graph.

Most of a layer's time outside its GEMMs and attention goes to small elementwise kernels: RMSNorm's
float casts and reductions, rotary embedding, SiLU times up, residual adds, each a separate pass over
the chunk's activations (and again in the backward). Compiling the layer fuses them. oomb's attention
function is excluded (``torch.compiler.disable``): it is where the paged store, stage and sparse state
live, and it has its own kernels. ``nn.Module.compile`` keeps the module and its parameters as they
are, so checkpointing, PEFT and state dicts see the same model.
"""

from __future__ import annotations

from torch import nn


def compile_decoder_layers(decoder: nn.Module) -> int:
    """Compile each decoder layer of ``decoder`` once (in place); returns how many were compiled now."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    compiled = 0
    for module in decoder.modules():
        if isinstance(module, GradientCheckpointingLayer) and getattr(module, "_compiled_call_impl", None) is None:
            module.compile()
            compiled += 1
    return compiled
