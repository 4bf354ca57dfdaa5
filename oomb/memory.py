"""Predicted GPU memory of an oomb step (DESIGN.md section 3), before anything is allocated.

    GPU memory of a step = weights + parameter gradients + optimizer state
                         + one chunk's activations + KV (and KV-gradient) pages + logits slice

Only the pages grow with the context. The activation term is an estimate of what autograd keeps
for one chunk; `benchmarks/step.py` prints it next to the measured peak.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .config import OOMBConfig
from .kv import PagedKVStore

GIB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_hf_config(cls, cfg) -> ModelShape:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                   cfg.num_key_value_heads, head_dim, cfg.vocab_size)


@dataclass(frozen=True)
class StepMemory:
    """Bytes of each term above the weights (and optimizer state, which oomb does not own)."""

    param_grads: int
    chunk_activations: int
    kv_pages: int
    logits_slice: int

    @property
    def total(self) -> int:
        return self.param_grads + self.chunk_activations + self.kv_pages + self.logits_slice

    def as_gib(self) -> dict:
        return {k: round(v / GIB, 2) for k, v in {**asdict(self), "total": self.total}.items()}


def layer_activation_bytes_per_token(shape: ModelShape, dtype: torch.dtype) -> int:
    """What autograd saves for one decoder layer per token: norms (fp32 upcasts), q/k/v/o, MLP."""
    h, i = shape.hidden_size, shape.intermediate_size
    kv = 2 * shape.num_kv_heads * shape.head_dim
    q = shape.num_heads * shape.head_dim
    saved = 2 * h + q + kv + q + q + h  # norm outs, q, k, v (+ RoPE copies), attention out, residual
    saved += 4 * i  # gate, up, act(gate), act * up
    return saved * dtype.itemsize + 4 * h * 4  # two RMSNorms keep fp32 inputs and variance


def estimate_step_memory(
    shape: ModelShape,
    num_tokens: int,
    config: OOMBConfig,
    *,
    batch_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    trainable_params: int = 0,
) -> StepMemory:
    """Predicted GPU bytes of one oomb dense step (no offload) above weights and optimizer state."""
    chunk = min(config.chunk_size, num_tokens) * batch_size
    per_layer = layer_activation_bytes_per_token(shape, dtype) * chunk
    if config.checkpoint_layers:
        # Layer inputs of every layer are kept, one layer's full activations exist at a time.
        activations = shape.num_layers * chunk * shape.hidden_size * dtype.itemsize + per_layer
    else:
        activations = shape.num_layers * per_layer
    kv = PagedKVStore.bytes_needed(
        num_layers=shape.num_layers, batch_size=batch_size, num_tokens=num_tokens,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, page_size=config.page_size,
        kv_dtype=dtype, grad_dtype=config.grad_dtype,
    )
    # fp32 logits, their softmax and gradient for one slice of the chunked loss.
    logits = 3 * min(config.loss_chunk_tokens, chunk) * shape.vocab_size * 4
    return StepMemory(trainable_params * dtype.itemsize, activations, kv, logits)
