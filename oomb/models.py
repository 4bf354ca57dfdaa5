"""Hugging Face integration through public seams: the attention interface and position_ids.

The step's state reaches our attention function as one keyword argument, ``oomb_step``, that
``model(...)`` forwards unchanged to every attention module. No model code is copied or patched.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from enum import Enum
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel

from .attention.backend import AttentionBackend
from .attention.function import PagedAttentionCall, fill_and_attend, paged_attention
from .documents import Documents
from .kv import ChunkSpan, PagedKVStore
from .sparse import SparseOptions

ATTENTION_NAME = "oomb"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class Stage(Enum):
    FILL = 1  # stage 1: no grad, chunks in order, pages written
    GRAD = 2  # stage 2: with grad, chunks in reverse, pages read


@dataclass(frozen=True)
class StepState:
    """Per-call state handed down to the attention function through the forward kwargs."""

    store: PagedKVStore
    chunk: ChunkSpan
    stage: Stage
    backend: AttentionBackend
    recompute_cache: dict | None = None  # stage 2 with layer checkpointing: layer -> (out, lse)
    sparse: SparseOptions | None = None  # sparse mode's options; None: dense
    documents: Documents | None = None  # packed documents (oomb/documents.py); None: plain causal


def oomb_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    oomb_step: StepState | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered with transformers as "oomb"."""
    if oomb_step is None:
        raise RuntimeError(
            "attn_implementation='oomb' only works inside oomb.forward_backward; "
            "set the model's attention implementation back to 'sdpa' for ordinary forward calls"
        )
    if dropout:
        raise NotImplementedError(f"attention dropout ({dropout}) is not supported by oomb; set it to 0")
    chunk = oomb_step.chunk
    if sliding_window is not None and chunk.end > sliding_window:
        raise NotImplementedError(
            f"sliding-window attention (window {sliding_window}) over {chunk.end} tokens is not supported; "
            "use a model config with sliding_window=None"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    store, layer = oomb_step.store, module.layer_idx
    call = PagedAttentionCall(store, layer, chunk, oomb_step.backend, scale, oomb_step.sparse,
                              documents=oomb_step.documents)
    if oomb_step.stage is Stage.FILL:
        out = fill_and_attend(query, key, value, call)  # sparse: selects the pages and keeps the selection
    else:
        if oomb_step.sparse is not None:  # stage 2 reads exactly the pages stage 1 selected
            call = replace(call, selection=store.selection(layer, chunk))
        out = paged_attention(query, key, value, call, oomb_step.recompute_cache)
    return out.transpose(1, 2), None  # transformers expects (B, L, Hq, D)


AttentionInterface.register(ATTENTION_NAME, oomb_attention_forward)


def unwrap_causal_lm(model: nn.Module) -> PreTrainedModel:
    """The transformers *ForCausalLM inside a (possibly PEFT-wrapped) model; refuse unsupported ones."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(inner, PreTrainedModel):
        raise TypeError(f"expected a transformers PreTrainedModel (or a PEFT wrapper), got {type(model).__name__}")
    model_type = getattr(inner.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"model type {model_type!r} ({type(inner).__name__}) is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if inner.get_output_embeddings() is None:
        raise TypeError(f"{type(inner).__name__} has no LM head; pass a *ForCausalLM model")
    return inner


@contextlib.contextmanager
def oomb_attention(causal_lm: PreTrainedModel):
    """Route attention through oomb for the duration of a step, then restore the previous choice."""
    previous = causal_lm.config._attn_implementation
    causal_lm.set_attn_implementation(ATTENTION_NAME)
    try:
        yield
    finally:
        causal_lm.set_attn_implementation(previous)


def sliding_window_limit(causal_lm: PreTrainedModel) -> int | None:
    """The attention window of a model whose layers use one, else None."""
    cfg = causal_lm.config
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return window


@contextlib.contextmanager
def layer_checkpointing(decoder: nn.Module, enabled: bool):
    """Switch per-layer recomputation (transformers' GradientCheckpointingLayer) on or off for a stage.

    Only the layer modules' own flags change (their ``training`` flag too, which is what the
    checkpointing switch reads); submodules keep their train/eval state, so dropout is untouched.
    Stage 1 runs with it off: it has no backward, and a user's own checkpointing would only warn.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in decoder.modules() if isinstance(m, GradientCheckpointingLayer)]
    saved = [(m, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func"), m.training)
             for m in layers]
    checkpoint = partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    for m in layers:
        m.gradient_checkpointing = enabled
        if enabled:
            m._gradient_checkpointing_func = checkpoint
            m.training = True
    try:
        yield
    finally:
        for m, flag, func, training in saved:
            m.gradient_checkpointing = flag
            m.training = training
            if func is None:
                m.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                m._gradient_checkpointing_func = func
