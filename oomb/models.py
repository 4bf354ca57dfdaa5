"""Hugging Face integration through public seams: the attention interface and position_ids.

The step's state reaches our attention function as one keyword argument, ``oomb_step``, that
``model(...)`` forwards unchanged to every attention module. No model code is copied or patched.

Per-layer attention kinds come from what each family hands the attention interface: a
``sliding_window`` (None on global layers; key j visible to query i iff i - window < j <= i), a logit
``softcap`` (Gemma 2) and learned sink logits ``s_aux`` (gpt-oss). A window layer attends with its
window's key bounds (documents.window_bounds) instead of the step's documents, so it reads only
the pages its window overlaps; in sparse mode it reads its window densely (it is bounded) and only
global layers select pages. Softcapping and sinks specialise the step's backend for the layer
(attention/variants.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel

from .attention.backend import AttentionBackend
from .attention.function import KeptOutputs, PagedAttentionCall, fill_and_attend, paged_attention
from .attention.variants import SinkGradient, attach_sinks, layer_backend
from .config import SparseConfig
from .documents import Documents, window_bounds
from .kv import ChunkSpan, PagedKVStore
from .loss import SoftcappedHead, fused_head

COMPILED_CALL = "_compiled_call_impl"
"""The attribute nn.Module.compile sets and nn.Module.__call__ reads (torch >= 2.2)."""

ATTENTION_NAME = "oomb"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3",
                         "olmo2", "gpt_oss")
"""config.model_type of the families tested exact against a full-sequence HF backward (docs/models.md)."""

REFUSED_MODEL_TYPES = {
    "deepseek_v2": "multi-head latent attention (keys and values of different head dims from a compressed "
                   "latent; the paged store holds one head dim for K and V)",
    "deepseek_v3": "multi-head latent attention (keys and values of different head dims from a compressed "
                   "latent; the paged store holds one head dim for K and V)",
    "qwen3_next": "linear-attention hybrid layers (Gated DeltaNet keeps a recurrent state, not KV pages)",
    "qwen3_5": "linear-attention hybrid layers (Gated DeltaNet keeps a recurrent state, not KV pages)",
    "qwen3_5_moe": "linear-attention hybrid layers (Gated DeltaNet keeps a recurrent state, not KV pages)",
    "falcon_h1": "state-space (Mamba) hybrid layers, which keep a recurrent state, not KV pages",
    "granitemoehybrid": "state-space (Mamba) hybrid layers, which keep a recurrent state, not KV pages",
    "olmo_hybrid": "linear-attention hybrid layers, which keep a recurrent state, not KV pages",
    "gemma3n": "KV sharing across layers (later layers attend to earlier layers' pages) and AltUp",
    "llama4": "chunked local attention (attention_chunk_size: a block-diagonal mask, not a sliding window)",
    "gemma3": "the multimodal Gemma3ForConditionalGeneration (pass the text model, Gemma3ForCausalLM)",
    "gpt2": "learned absolute position embeddings (n_positions), which cannot reach long contexts",
}
"""model_type -> what oomb lacks for it: the refusal names it."""


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
    sparse: SparseConfig | None = None  # sparse mode's options; None: dense
    documents: Documents | None = None  # packed documents (oomb/documents.py); None: plain causal
    windows: tuple[int | None, ...] = ()  # per layer: the sliding window planned from the config (None: global)
    window_bounds: Mapping[int, Documents] = field(default_factory=dict)
    """window -> key bounds (documents.window_bounds), for the windows shorter than the step."""
    kept_outputs: KeptOutputs | None = None
    """OOMBConfig.performance.keep_attention_outputs: stage 1's (out, lse) per layer and chunk, which stage 2 takes."""

    def layer_bounds(self, layer: int, sliding_window: int | None) -> Documents | None:
        """The key bounds of ``layer``'s attention: its window's (a window layer), else the documents."""
        if self.windows and sliding_window != self.windows[layer]:
            raise RuntimeError(f"layer {layer} attends with sliding_window={sliding_window}, but the step was "
                               f"planned with {self.windows[layer]} from the model config (layer_types, "
                               "sliding_window): the config and the attention modules disagree")
        if sliding_window is None or sliding_window not in self.window_bounds:
            return self.documents  # global, or a window covering the whole step
        return self.window_bounds[sliding_window]


def oomb_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    oomb_step: StepState | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered with transformers as "oomb".

    ``sliding_window``: this layer's window (None: global); ``softcap``: attention logit softcapping;
    ``s_aux``: (Hq,) learned sink logits (gpt-oss)."""
    if oomb_step is None:
        raise RuntimeError(
            "attn_implementation='oomb' only works inside oomb.forward_backward; "
            "set the model's attention implementation back to 'sdpa' for ordinary forward calls"
        )
    if dropout:
        raise NotImplementedError(f"attention dropout ({dropout}) is not supported by oomb; set it to 0")
    chunk = oomb_step.chunk
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    store, layer = oomb_step.store, module.layer_idx
    bounds = oomb_step.layer_bounds(layer, sliding_window)
    # A window layer reads its (bounded) window densely, also in sparse mode.
    sparse = oomb_step.sparse if bounds is oomb_step.documents else None
    sink_grad = SinkGradient() if s_aux is not None else None
    backend = layer_backend(oomb_step.backend, softcap=softcap, sinks=s_aux, sink_grad=sink_grad)
    if s_aux is not None:
        query = attach_sinks(query, s_aux, sink_grad)
    call = PagedAttentionCall(store, layer, chunk, backend, scale, sparse, documents=bounds)
    if oomb_step.stage is Stage.FILL:
        # sparse: selects the pages and keeps the selection; keep_attention_outputs: keeps (out, lse) too
        out = fill_and_attend(query, key, value, call, oomb_step.kept_outputs)
    else:
        if sparse is not None:  # stage 2 reads exactly the pages stage 1 selected
            call = replace(call, selection=store.selection(layer, chunk))
        replay = oomb_step.recompute_cache is not None and layer in oomb_step.recompute_cache
        if not replay:  # window layers: their freed pages get the recomputed k, v back (kv/store.py)
            store.rewrite(layer, chunk, key, value)
        out = paged_attention(query, key, value, call, oomb_step.recompute_cache, oomb_step.kept_outputs)
    return out.transpose(1, 2), None  # transformers expects (B, L, Hq, D)


# Outside any torch.compile graph: compiled decoder layers (compiled_layers.py) call it as a black box.
AttentionInterface.register(ATTENTION_NAME, torch.compiler.disable(oomb_attention_forward))


def unwrap_causal_lm(model: nn.Module) -> PreTrainedModel:
    """The transformers *ForCausalLM inside a (possibly PEFT-wrapped) model; refuse unsupported ones."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(inner, PreTrainedModel):
        raise TypeError(f"expected a transformers PreTrainedModel (or a PEFT wrapper), got {type(model).__name__}")
    model_type = getattr(inner.config, "model_type", None)
    if model_type in REFUSED_MODEL_TYPES:
        raise NotImplementedError(
            f"model type {model_type!r} ({type(inner).__name__}) is not supported: oomb lacks "
            f"{REFUSED_MODEL_TYPES[model_type]}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"model type {model_type!r} ({type(inner).__name__}) is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(inner.config, "use_bidirectional_attention", False):
        raise NotImplementedError(f"{type(inner).__name__} with use_bidirectional_attention=True is not supported: "
                                  "oomb trains causal language models (keys never come from later chunks)")
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


def plain_attention(model: PreTrainedModel) -> PreTrainedModel:
    """Give ``model`` Hugging Face's SDPA attention where its family has it, else eager (transformers
    refuses SDPA for some families, e.g. gpt-oss, whose sinks SDPA cannot take). oomb's steps switch to
    their own attention either way; this is what a plain forward, or plain HF's step, runs."""
    try:
        model.set_attn_implementation("sdpa")
    except ValueError:
        model.set_attn_implementation("eager")
    return model


def layer_windows(causal_lm: PreTrainedModel) -> tuple[int | None, ...]:
    """Per layer, the sliding window its attention uses (None: global), as the families set it: from
    ``layer_types`` where the config has them (gemma2/3, gpt-oss, qwen2), else ``sliding_window`` on
    every layer (mistral, phi3, qwen3_moe)."""
    cfg = causal_lm.config
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is None:
        return (window,) * cfg.num_hidden_layers
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise NotImplementedError(f"layer types {unknown} are not supported; oomb supports full_attention and "
                                  "sliding_attention layers")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def attention_variants(causal_lm: PreTrainedModel) -> tuple[bool, bool]:
    """(softcap, sinks): whether the model's attention softcaps its logits (Gemma 2's
    attn_logit_softcapping) and has learned sink logits (gpt-oss), which backends must support."""
    cfg = causal_lm.config
    softcap = cfg.model_type == "gemma2" and getattr(cfg, "attn_logit_softcapping", None) is not None
    return softcap, cfg.model_type == "gpt_oss"


def loss_head(causal_lm: PreTrainedModel) -> nn.Module:
    """The module that turns final hidden states into the logits the loss sees: the LM head, softcapped
    where the family softcaps its final logits (Gemma 2/3 ``final_logit_softcapping``)."""
    head = causal_lm.get_output_embeddings()
    cap = final_logit_softcap(causal_lm.config)
    if cap is not None:
        return SoftcappedHead(head, cap)
    return head


def final_logit_softcap(config) -> float | None:
    """The cap a family puts on its final logits before the loss (Gemma 2/3 ``final_logit_softcapping``)."""
    cap = getattr(config, "final_logit_softcapping", None)
    return cap if config.model_type in ("gemma2", "gemma3_text") and cap is not None else None


DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout",
                  "hidden_dropout_prob", "attention_probs_dropout_prob")
"""Config fields by which families put dropout in their layers (compiled layers refuse an active one)."""


def config_has_dropout(config) -> bool:
    """Whether a model built from ``config`` drops anything in training (any of DROPOUT_FIELDS above 0)."""
    rates = [getattr(config, name, None) for name in DROPOUT_FIELDS]
    return any(isinstance(p, (int, float)) and p > 0 for p in rates)


def fused_loss_possible_for_config(config, dtype: torch.dtype) -> bool:
    """fused_loss_possible before a model is loaded, from its config (`oomb plan`, `oomb bench`): one
    process, a plain linear head, which Hugging Face builds unless the family softcaps its final logits;
    not float16."""
    return dtype != torch.float16 and final_logit_softcap(config) is None


def fused_loss_possible(causal_lm: PreTrainedModel, single_process: bool = True) -> bool:
    """Whether the step's loss can be the fused one (loss.fused_head of its loss head) on one process, not
    in float16; tensor-parallel and FSDP heads are DTensors, which keep autograd's loss. The planner counts the fused
    loss's memory only where this holds."""
    return single_process and causal_lm.dtype != torch.float16 and fused_head(loss_head(causal_lm))


def step_window_bounds(windows: tuple[int | None, ...], documents: Documents | None, shape: tuple[int, int],
                       device: torch.device) -> dict[int, Documents]:
    """window -> key bounds for every layer window shorter than the step's ``shape[1]`` tokens (longer
    ones are plain causal attention)."""
    return {w: window_bounds(documents, w, shape, device) for w in sorted({w for w in windows if w is not None})
            if w < shape[1]}


def history_start(chunk: ChunkSpan, windows: tuple[int | None, ...], bounds: Mapping[int, Documents],
                  documents: Documents | None, page_size: int) -> int:
    """The first (page-aligned) history key any layer's query of ``chunk`` sees: pages before it are
    neither read nor staged by any layer (a store keeps one such bound per chunk, for all layers)."""
    starts = [(bounds.get(w) if w is not None else None) or documents for w in windows]
    return min(0 if b is None else b.history_start(chunk.start, page_size) for b in starts)


def decoder_layers(decoder: nn.Module) -> list[nn.Module]:
    """The decoder's layer modules (transformers' GradientCheckpointingLayer)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in decoder.modules() if isinstance(m, GradientCheckpointingLayer)]


def num_decoder_layers(causal_lm: nn.Module) -> int:
    """How many decoder layers ``causal_lm`` runs (what layer-indexed options such as sparse.dense_layers count)."""
    return len(decoder_layers(causal_lm.get_decoder()))


def window_layer_ids(causal_lm: nn.Module) -> tuple[int, ...]:
    """The decoder layers with a sliding window (layer_windows)."""
    return tuple(i for i, window in enumerate(layer_windows(causal_lm)) if window)


def resolved_sparse(config, causal_lm: nn.Module):
    """The sparse options a step of ``causal_lm`` runs (OOMBConfig.resolved_sparse over its decoder layers and
    their sliding windows); None in dense mode."""
    return config.resolved_sparse(num_decoder_layers(causal_lm), window_layer_ids(causal_lm))


def _run_replayed(function, *args):
    """What a compiled replay traces: transformers' replayed layer function on its inputs. One function for every
    layer and step, so torch keeps one cache of graphs for them (the layers share their guards)."""
    return function(*args)


@contextlib.contextmanager
def layer_checkpointing(decoder: nn.Module, enabled: bool, compiled: bool = False):
    """Switch per-layer recomputation (transformers' GradientCheckpointingLayer) on or off for a stage.

    Only the layer modules' own flags change (their ``training`` flag too, which is what the
    checkpointing switch reads); submodules keep their train/eval state, so dropout is untouched.
    Stage 1 runs with it off: it has no backward, and a user's own checkpointing would only warn.

    ``compiled`` (layers compiled for the step, compiled_layers.py): the replayed function runs compiled
    inside the checkpoint, forward and recomputation alike. The layers' own compiled call is set aside
    meanwhile: transformers puts the checkpoint inside the layer's call (or its forward), and a
    checkpoint met while tracing runs what it wraps eager.
    """
    layers = decoder_layers(decoder)
    saved = [(m, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func"), m.training,
              m.__dict__.get(COMPILED_CALL)) for m in layers]
    checkpoint = partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    if enabled and compiled:
        compiled_call = torch.compile(_run_replayed, dynamic=True)
        checkpoint = partial(torch.utils.checkpoint.checkpoint, compiled_call, use_reentrant=False)
    for m in layers:
        m.gradient_checkpointing = enabled
        if enabled:
            m._gradient_checkpointing_func = checkpoint
            m.training = True
            if compiled:
                setattr(m, COMPILED_CALL, None)
    try:
        yield
    finally:
        for m, flag, func, training, compiled_call in saved:
            m.gradient_checkpointing = flag
            m.training = training
            if func is None:
                m.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                m._gradient_checkpointing_func = func
            if compiled_call is not None:
                setattr(m, COMPILED_CALL, compiled_call)
