"""Per-token activation bytes of one training step: what autograd saves for a decoder layer (dense or
mixture-of-experts MLP), the attention backward workspaces (torch SDPA's, oomb's paged), the layer
replay's cache, the chunked LM-head loss's logits slice, and one chunk's total in stage 2.

Each term is a function of a ModelShape and dtypes only (and of the step's options for a chunk's total);
the memory model (oomb/planning/memory.py: predict, estimate_step_memory) adds them to weights, gradients,
optimizer state and KV pages.
"""

from __future__ import annotations

import torch

from ..config import OOMBConfig
from .model_shape import ModelShape

FP32_BYTES = 4

LOGITS_FP32_COPIES = 3
"""fp32 copies of one logits slice alive at the peak of its checkpointed backward: the logits, their
log-softmax and their gradient (measured on the H200 with Qwen2.5-0.5B, where this term dominates:
3 copies predict the peak within 3 %, 4 would over-predict by 15-20 %)."""

MOE_ROUTED_ROW_SAVED_HIDDEN = 2
"""Hidden-size vectors autograd keeps per routed (token, expert) row of a mixture-of-experts MLP: the
expert's gathered input ``hidden_states[token_idx]`` and its output before the routing weight multiplies
it (transformers' ``Qwen3MoeExperts`` / ``GptOssExperts`` loop over the experts a chunk hits).
Assumption: each token picks ``experts_per_token`` different experts, so a chunk of T tokens runs
exactly k x T rows however they spread over the experts; the activation memory of a chunk's MLP is
that of k x T tokens' expert MLPs, independent of the routing balance and of the number of experts
(which only the weights, gradients and optimizer state count)."""

MOE_ROUTED_ROW_INDEX_BYTES = 3 * 8
"""Per routed row, three int64 token/position indices (the gather of the input, of the routing weight,
and index_add's), besides the row's routing weight in the model dtype."""

ROUTER_SAVED_FP32_PER_EXPERT = 1
"""Per token and MoE layer the router keeps an fp32 softmax over all E experts (Qwen3-MoE; gpt-oss
softmaxes only its top-k logits: an over-count of about E x 4 bytes, under 0.1 % of its MLP's
activations) and its top-k int64 indices."""


def mlp_activation_bytes_per_token(shape: ModelShape, dtype: torch.dtype, moe: bool | None = None) -> int:
    """What autograd saves for one layer's MLP per token (its input is counted with the norms): a dense
    gated MLP's gate, up, act(gate) and act(gate) x up; an MoE layer's (``moe``; default: whether the
    model is one) ``experts_per_token`` routed rows (MOE_ROUTED_ROW_*), its router
    (ROUTER_SAVED_FP32_PER_EXPERT) and a shared expert's MLP."""
    moe = shape.is_moe if moe is None else moe
    b = dtype.itemsize
    if not moe:
        return 4 * shape.intermediate_size * b
    row = ((MOE_ROUTED_ROW_SAVED_HIDDEN * shape.hidden_size
            + shape.expert_saved_intermediates * shape.expert_intermediate_size + 1) * b  # + routing weight
           + MOE_ROUTED_ROW_INDEX_BYTES)
    router = shape.num_experts * ROUTER_SAVED_FP32_PER_EXPERT * FP32_BYTES + shape.experts_per_token * 8
    return shape.experts_per_token * row + router + 4 * shape.shared_expert_intermediate_size * b


def layer_activation_bytes_per_token(shape: ModelShape, dtype: torch.dtype, moe: bool | None = None) -> int:
    """What autograd saves for one decoder layer per token: norms (fp32 upcasts), q/k/v/o, MLP (the
    MoE layer's when ``moe``, default: whether the model is an MoE; see mlp_activation_bytes_per_token)."""
    h = shape.hidden_size
    kv = 2 * shape.kv_dim
    q = shape.q_dim
    saved = 2 * h + q + kv + q + q + h  # norm outs, q, k, v (+ RoPE copies), attention out, residual
    mlp = mlp_activation_bytes_per_token(shape, dtype, moe)
    return saved * dtype.itemsize + mlp + 4 * h * 4  # two RMSNorms keep fp32 inputs and variance


def compiled_saving_bytes_per_token(shape: ModelShape, dtype: torch.dtype) -> int:
    """What a compiled dense decoder layer (oomb/compiled_layers.py) keeps less of per token than the eager
    one: the fused graph recomputes one of the gated MLP's elementwise products and both RMSNorms' float32
    upcasts of their inputs in the backward instead of saving them. Counted from the saved tensors of a
    compiled layer (tests/test_activations_compiled.py) and in line with the H200: the 7B shape's 128K and
    1M sparse steps kept 7.09 and 7.11 GiB less compiled, 66,380 bytes per token and layer at chunk 4096
    against the 66,560 counted here (compiled-layers-128k, sparse-offload-chosen-compiled-1m)."""
    return shape.intermediate_size * dtype.itemsize + 2 * shape.hidden_size * FP32_BYTES


def all_layers_activation_bytes_per_token(shape: ModelShape, dtype: torch.dtype) -> int:
    """layer_activation_bytes_per_token summed over the layers (MoE and dense MLP layers each their own)."""
    moe = shape.moe_layers
    return (moe * layer_activation_bytes_per_token(shape, dtype, True)
            + (shape.num_layers - moe) * layer_activation_bytes_per_token(shape, dtype, False))


def max_layer_activation_bytes_per_token(shape: ModelShape, dtype: torch.dtype) -> int:
    """The largest layer's activations per token (one layer's exist at a time under checkpointing)."""
    return max(layer_activation_bytes_per_token(shape, dtype, moe) for moe in shape.layer_kinds())


def sdpa_backward_workspace_per_token(shape: ModelShape, dtype: torch.dtype) -> int:
    """Temporaries of torch SDPA's flash backward with grouped KV heads, per token: the fp32 dQ
    accumulator, dK and dV expanded to all query heads before the group sum, dQ/dK/dV outputs and
    the incoming dO. (With these the "hf" prediction meets the H200 measurements within 1 %.)"""
    b = dtype.itemsize
    return shape.q_dim * FP32_BYTES + 2 * shape.q_dim * b + (shape.q_dim + 2 * shape.kv_dim) * b + shape.q_dim * b


def paged_backward_workspace_per_token(shape: ModelShape, dtype: torch.dtype, grad_dtype: torch.dtype) -> int:
    """Temporaries of oomb's paged attention backward, per chunk token: dQ, the row sums
    rowsum(dO * O) (fp32), the chunk's dK/dV read from the gradient pages and cast to the model dtype."""
    b = dtype.itemsize
    return shape.q_dim * b + shape.num_heads * FP32_BYTES + 2 * shape.kv_dim * (grad_dtype.itemsize + b)


def recompute_cache_bytes_per_token(shape: ModelShape, dtype: torch.dtype) -> int:
    """With layer checkpointing stage 2 keeps every layer's attention output and log-sum-exp (fp32)
    for the chunk, so the replay in backward does not recompute attention (models.StepState)."""
    return shape.num_layers * shape.num_heads * (shape.head_dim * dtype.itemsize + FP32_BYTES)


def logits_slice_bytes(shape: ModelShape, tokens: int, batch_size: int, loss_chunk_tokens: int,
                       fused_dtype: torch.dtype | None = None) -> int:
    """One slice of the chunked LM-head loss at its peak: autograd's fp32 logits, log-softmax and gradient
    (LOGITS_FP32_COPIES); with the fused loss (``fused_dtype``: the model dtype; oomb/loss.py
    _HeadCrossEntropy) the logits turned into their gradient in place, plus the slice's (tokens, hidden)
    product through the head."""
    rows = min(loss_chunk_tokens, tokens) * batch_size
    if fused_dtype is not None:
        return rows * (shape.head_vocab + shape.hidden_size) * fused_dtype.itemsize
    return LOGITS_FP32_COPIES * rows * shape.head_vocab * FP32_BYTES


def saved_logits_bytes(shape: ModelShape, chunk_tokens: int, batch_size: int, recompute_logits: bool,
                       fused_dtype: torch.dtype | None = None, head_trained: bool = True,
                       weight_gradient_now: bool = False) -> int:
    """What the loss keeps from its forward to its backward for a chunk. Autograd without recompute_logits:
    the fp32 log-probabilities (log-softmax's output); with it, nothing (each slice recomputes its logits).
    The fused loss (``fused_dtype``: the model dtype) keeps a (tokens, hidden) tensor per slice (dL/dhidden,
    or with recompute the head's input), and a trained head without recompute also the logits' gradient,
    unless its weight gradient is made in the forward (``weight_gradient_now``: the engine's,
    oomb/engine.py); a frozen head (LoRA) nothing of the vocabulary's size."""
    tokens = chunk_tokens * batch_size
    if fused_dtype is None:
        return 0 if recompute_logits else tokens * shape.head_vocab * FP32_BYTES
    vocab = shape.head_vocab if head_trained and not recompute_logits and not weight_gradient_now else 0
    return tokens * (vocab + shape.hidden_size) * fused_dtype.itemsize


def chunk_activation_bytes(shape: ModelShape, chunk_tokens: int, config: OOMBConfig, dtype: torch.dtype,
                           compiled: bool = False) -> int:
    """Activations autograd holds for one chunk of ``chunk_tokens`` tokens (batch included) in stage 2;
    ``compiled``: the decoder layers run compiled; without layer replay the dense ones keep
    compiled_saving_bytes_per_token less (with replay one layer's activations exist at a time, counted whole)."""
    per_layer = max_layer_activation_bytes_per_token(shape, dtype) * chunk_tokens
    if config.performance.checkpoint_layers:
        # Layer inputs of every layer are kept, one layer's full activations exist at a time,
        # plus the attention outputs kept for the replay.
        stored = shape.num_layers * chunk_tokens * shape.hidden_size * dtype.itemsize
        activations = stored + per_layer + recompute_cache_bytes_per_token(shape, dtype) * chunk_tokens
    else:
        activations = all_layers_activation_bytes_per_token(shape, dtype) * chunk_tokens
        if compiled:
            dense_layers = shape.num_layers - shape.moe_layers
            activations -= dense_layers * compiled_saving_bytes_per_token(shape, dtype) * chunk_tokens
    return activations + paged_backward_workspace_per_token(shape, dtype, config.precision.grad_dtype) * chunk_tokens
