"""Predicted GPU and host memory of one training step (DESIGN.md section 3), before anything is allocated.

    GPU memory of a step = weights + parameter gradients (+ fp32 gradient sums) + optimizer state
                         + one chunk's activations (+ one logits slice) + KV working set
                         + page summaries + page tables
    host RAM             = the process itself + (with offload) K, V and dK, dV pages of every token
                           (window layers: of their window slots)
                           (+ sparse: the stored page selections of the offloaded layers)

Five modes are modelled: plain Hugging Face ("hf": SDPA + gradient checkpointing + chunked loss, for
comparison) and oomb's dense/sparse attention with host offload off/on. Only the pages (and, in sparse
mode, their summaries) grow with the context in oomb; in "hf" the stored layer inputs and one layer's
activations for the whole sequence do. Every assumption is a named constant or a field below.

Calibration (standard workload, DESIGN.md section 6, H200, benchmarks/results/step_h200_2026-11-29*.json):
peak GPU memory above the weights predicted vs measured, oomb dense 39.5 / 60.5 GiB vs 39.9 / 60.9 GiB
at 128K / 256K; hf 22.9 / 32.8 / 64.2 GiB vs 22.7 / 32.7 / 64.2 GiB at 32K / 64K / 128K. Qwen2.5-0.5B
shape at 8K / 16K: dense 3.5 / 3.8 GiB vs 3.6 / 3.9, hf 2.3 / 2.7 GiB vs 2.4 / 2.8.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Literal

import torch

from .config import OOMBConfig
from .kv import PagedKVStore, capacity
from .kv.store import window_pages_per_sequence

GIB = 1024**3
MIB = 1024**2

FP32_BYTES = 4
INT32_BYTES = 4

LOGITS_FP32_COPIES = 3
"""fp32 copies of one logits slice alive at the peak of its checkpointed backward: the logits, their
log-softmax and their gradient (measured on the H200 with Qwen2.5-0.5B, where this term dominates:
3 copies predict the peak within 3 %, 4 would over-predict by 15-20 %)."""

ADAMW_STATE_BYTES = 8
"""AdamW keeps two fp32 moments (exp_avg, exp_avg_sq) per fp32 parameter or master (torch.optim.AdamW
makes them in the dtype of what it steps: 2 x 2 bytes for a bf16 parameter without a master)."""

MASTER_WEIGHT_BYTES = 4
"""An fp32 master copy per trainable low-precision parameter (mixed-precision optimizers)."""

LORA_PARAM_BYTES = 4
"""PEFT creates LoRA adapters in fp32 next to bf16/fp16 base weights (``autocast_adapter_dtype=True``)."""

HOST_PROCESS_BYTES = 2 * GIB
"""Resident memory of the training process itself (Python, torch, CUDA libraries, tokenizer, data),
outside the KV pages. Weights are assumed loaded straight to the GPU."""


MOE_ROUTED_ROW_SAVED_HIDDEN = 2
"""Hidden-size vectors autograd keeps per routed (token, expert) row of a mixture-of-experts MLP: the
expert's gathered input ``hidden_states[token_idx]`` and its output before the routing weight multiplies
it (transformers' ``Qwen3MoeExperts`` / ``GptOssExperts`` loop over the experts a chunk hits).
Assumption: each token picks ``experts_per_token`` different experts, so a chunk of T tokens runs
exactly k x T rows however they spread over the experts; the activation memory of a chunk's MLP is
that of k x T tokens' expert MLPs, independent of the routing balance and of the number of experts
(which only the weights, gradients and optimizer state count)."""

MOE_ROUTED_ROW_SAVED_INTERMEDIATE = 4
"""Expert-intermediate-size vectors kept per routed row, as for a dense gated MLP: gate and up (one
2 i output), act(gate) and act(gate) x up (qwen3_moe; measured with saved-tensor hooks in
tests/test_memory_moe.py)."""

GPT_OSS_ROUTED_ROW_SAVED_INTERMEDIATE = 7
"""gpt-oss's clamped SwiGLU keeps more i-wide tensors per row: the 2 i gate/up output, the clamped gate
and up, sigmoid(alpha gate), the gated product and up + 1 (measured as above)."""

MOE_ROUTED_ROW_INDEX_BYTES = 3 * 8
"""Per routed row, three int64 token/position indices (the gather of the input, of the routing weight,
and index_add's), besides the row's routing weight in the model dtype."""

ROUTER_SAVED_FP32_PER_EXPERT = 1
"""Per token and MoE layer the router keeps an fp32 softmax over all E experts (Qwen3-MoE; gpt-oss
softmaxes only its top-k logits: an over-count of about E x 4 bytes, under 0.1 % of its MLP's
activations) and its top-k int64 indices."""


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer that memory depends on.

    Dense models use ``intermediate_size``; a mixture of experts (``num_experts`` > 0) replaces the
    MLP of its MoE layers by ``num_experts`` gated experts of width ``expert_intermediate_size``
    (all of them count for weights, gradients and optimizer state), of which each token runs
    ``experts_per_token`` (activations), plus a router (``num_experts`` x hidden weights).
    ``num_params()`` equals ``sum(p.numel())`` of the transformers model of every supported family
    (tests/test_memory_moe.py).
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix (one V x hidden matrix instead of two)."""
    attention_bias: bool = False
    """q, k, v projections have biases (Qwen2)."""
    tp: int = 1
    """Tensor-parallel degree: the shape is one rank's share (see per_rank)."""
    output_bias: bool = False
    """The attention output projection has a bias too (``attention_bias`` in llama, qwen3, gpt-oss)."""
    norms_per_layer: int = 2
    """RMSNorms of hidden size per layer: 2 (pre-attention, pre-MLP; olmo2's two post-norms), 4 in
    gemma2/3 (pre- and post-norms around both)."""
    qk_norm_params: int = 0
    """Weights of the query/key norms per layer: 2 x head_dim (qwen3, qwen3_moe, gemma3: one norm per
    head, shared over heads), q_dim + kv_dim (olmo2: over the full projections), 0 without."""
    attention_sinks: bool = False
    """A learned sink logit per query head and layer (gpt-oss)."""
    logit_softcap: bool = False
    """Attention logits are softcapped, c * tanh(s / c) (Gemma 2)."""
    num_experts: int = 0
    """Experts of each MoE layer (0: a dense model)."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k)."""
    expert_intermediate_size: int = 0
    """Intermediate size of one expert's gated MLP (qwen3_moe ``moe_intermediate_size``; gpt-oss
    ``intermediate_size``)."""
    moe_bias: bool = False
    """The router and the experts' projections have biases (gpt-oss)."""
    shared_expert_intermediate_size: int = 0
    """Width of an always-active shared-expert MLP in every MoE layer (Qwen2-MoE's
    ``shared_expert_intermediate_size``, DeepSeek's ``n_shared_experts`` x ``moe_intermediate_size``;
    none in qwen3_moe and gpt-oss). Qwen2-MoE's one-column shared-expert gate is not counted."""
    dense_mlp_layers: int = 0
    """Layers of an MoE model that keep a dense MLP of ``intermediate_size`` (qwen3_moe
    ``mlp_only_layers`` and ``decoder_sparse_step``)."""
    expert_saved_intermediates: int = MOE_ROUTED_ROW_SAVED_INTERMEDIATE
    """Expert-intermediate-size vectors autograd keeps per routed row (GPT_OSS_ROUTED_ROW_SAVED_INTERMEDIATE
    for gpt-oss)."""
    lora_expert_adapters: bool = False
    """PEFT's "all-linear" also adapts the MoE experts and router through its parameter targets
    (``target_parameters``; PEFT 0.21 does for qwen3_moe: the fused gate_up_proj at rank 2 r and
    down_proj at rank r per expert, the router at rank r, and then of the linear layers only q, k, v, o;
    not for gpt-oss)."""
    sliding_window: int = 0
    """Window of the sliding-window layers (0: none): without offload their pages are bounded by it,
    with offload what they stage (see predict)."""
    sliding_window_layers: int = 0
    """Layers that attend within ``sliding_window`` (the rest are global)."""
    sliding_layer_ids: tuple[int, ...] = ()
    """Which layers slide (from ``layer_types``; mistral, phi3: all). With offload, which of them stay
    resident matters (see window_layer_ids)."""

    @classmethod
    def from_hf_config(cls, cfg) -> ModelShape:
        model_type = getattr(cfg, "model_type", None)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        bias = model_type == "qwen2" or attention_bias
        L = cfg.num_hidden_layers
        qk_norm = {"qwen3": 2 * head_dim, "qwen3_moe": 2 * head_dim, "gemma3_text": 2 * head_dim,
                   "olmo2": (cfg.num_attention_heads + cfg.num_key_value_heads) * head_dim}.get(model_type, 0)
        experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 0
        moe = {}
        if experts:
            sparse_step = getattr(cfg, "decoder_sparse_step", 1) or 1
            mlp_only = set(getattr(cfg, "mlp_only_layers", None) or ())
            moe_layers = sum(1 for i in range(L) if i not in mlp_only and (i + 1) % sparse_step == 0)
            shared = getattr(cfg, "shared_expert_intermediate_size", None) or (
                (getattr(cfg, "n_shared_experts", None) or 0) * (getattr(cfg, "moe_intermediate_size", None) or 0))
            moe = dict(num_experts=experts, experts_per_token=cfg.num_experts_per_tok,
                       expert_intermediate_size=getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size,
                       moe_bias=model_type == "gpt_oss", shared_expert_intermediate_size=shared,
                       dense_mlp_layers=L - moe_layers, lora_expert_adapters=model_type == "qwen3_moe",
                       expert_saved_intermediates=GPT_OSS_ROUTED_ROW_SAVED_INTERMEDIATE if model_type == "gpt_oss"
                       else MOE_ROUTED_ROW_SAVED_INTERMEDIATE)
        window = getattr(cfg, "sliding_window", None) or 0
        layer_types = getattr(cfg, "layer_types", None)
        if not window:
            sliding = ()
        elif layer_types is not None:
            sliding = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
        else:  # mistral, phi3: every layer slides when sliding_window is set
            sliding = tuple(range(L)) if getattr(cfg, "use_sliding_window", True) else ()
        window_layers = len(sliding)
        return cls(L, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                   cfg.num_key_value_heads, head_dim, cfg.vocab_size,
                   bool(getattr(cfg, "tie_word_embeddings", False)), bias,
                   output_bias=attention_bias and model_type != "qwen2",
                   norms_per_layer=4 if model_type in ("gemma2", "gemma3_text") else 2,
                   qk_norm_params=qk_norm, attention_sinks=model_type == "gpt_oss",
                   logit_softcap=bool(getattr(cfg, "attn_logit_softcapping", None)),
                   sliding_window=window if window_layers else 0, sliding_window_layers=window_layers,
                   sliding_layer_ids=sliding, **moe)

    def window_layer_ids(self) -> tuple[int, ...]:
        """The sliding layers: ``sliding_layer_ids`` when it names ``sliding_window_layers`` layers, else
        (a count alone) the first that many, which with resident layers offloads the fewest of them."""
        if len(self.sliding_layer_ids) == self.sliding_window_layers:
            return self.sliding_layer_ids
        return tuple(range(self.sliding_window_layers))

    @property
    def cudnn_refuses(self) -> str | None:
        """What of this model's attention the cudnn backend cannot run (None: nothing), as the engine's
        backend check (oomb/attention/variants.py) refuses it."""
        needs = [what for what, present in (("sliding-window layers", self.sliding_window_layers > 0),
                                             ("attention logit softcapping", self.logit_softcap),
                                             ("attention sinks", self.attention_sinks)) if present]
        return " and ".join(needs) or None

    def per_rank(self, tp: int) -> ModelShape:
        """One tensor-parallel rank's share (oomb/parallel.py): heads, KV heads and dense MLP columns
        split tp ways, an untied LM head split by vocabulary; embeddings, norms and experts stay whole."""
        if tp == 1:
            return self
        dense_mlps = self.moe_layers < self.num_layers
        if self.num_heads % tp or self.num_kv_heads % tp or (dense_mlps and self.intermediate_size % tp):
            raise ValueError(f"tp={tp} must divide num_attention_heads={self.num_heads}, num_key_value_heads="
                             f"{self.num_kv_heads} and intermediate_size={self.intermediate_size}")
        # MoE layers: parallel.py's plan names mlp.gate_proj/up_proj/down_proj, which experts lack
        # (torch's parallelize_module skips such keys): experts and routers stay whole on every rank.
        return replace(self, num_heads=self.num_heads // tp, num_kv_heads=self.num_kv_heads // tp,
                       intermediate_size=self.intermediate_size // tp if dense_mlps else self.intermediate_size,
                       tp=self.tp * tp)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layers(self) -> int:
        """Layers with a mixture-of-experts MLP (the rest have a dense one)."""
        return self.num_layers - self.dense_mlp_layers if self.is_moe else 0

    def layer_kinds(self) -> tuple[bool, ...]:
        """The kinds of layer the model has: True for MoE MLP layers, False for dense ones."""
        return ((True,) if self.moe_layers else ()) + ((False,) if self.moe_layers < self.num_layers else ())

    @property
    def head_vocab(self) -> int:
        """LM-head rows (logit columns) on this rank: the vocabulary, split when the head is sharded."""
        return self.vocab_size if self.tie_word_embeddings else self.vocab_size // self.tp

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def attention_params(self) -> int:
        """q/k/v/o projections (with their biases), query/key norms and sinks of one layer."""
        h = self.hidden_size
        attention = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.attention_bias:
            attention += self.q_dim + 2 * self.kv_dim
        if self.output_bias:
            attention += h
        return attention + self.qk_norm_params + (self.num_heads if self.attention_sinks else 0)

    def expert_params(self) -> int:
        """One expert's gated MLP: gate and up (h x i each), down (i x h), with gpt-oss's biases."""
        h, i = self.hidden_size, self.expert_intermediate_size
        return 3 * h * i + ((2 * i + h) if self.moe_bias else 0)

    def router_params(self) -> int:
        """One MoE layer's router: an E x hidden weight (and gpt-oss's E biases)."""
        return self.num_experts * (self.hidden_size + (1 if self.moe_bias else 0))

    def mlp_params(self, moe: bool | None = None) -> int:
        """The MLP of one layer: dense (3 h i), or (``moe``; default: whether the model is an MoE) every
        expert, the router and the shared expert."""
        moe = self.is_moe if moe is None else moe
        if not moe:
            return 3 * self.hidden_size * self.intermediate_size
        shared = 3 * self.hidden_size * self.shared_expert_intermediate_size
        return self.num_experts * self.expert_params() + self.router_params() + shared

    def layer_params(self, moe: bool | None = None) -> int:
        """Parameters of one decoder layer: attention, MLP (all experts of an MoE layer; ``moe`` as in
        mlp_params), norms."""
        return self.attention_params() + self.mlp_params(moe) + self.norms_per_layer * self.hidden_size

    def num_params(self) -> int:
        embeddings = self.vocab_size * self.hidden_size + (0 if self.tie_word_embeddings else
                                                           self.head_vocab * self.hidden_size)
        layers = (self.moe_layers * self.layer_params(True)
                  + (self.num_layers - self.moe_layers) * self.layer_params(False))
        return layers + embeddings + self.hidden_size  # + final norm

    def active_params(self) -> int:
        """Parameters one token runs through: num_params with only ``experts_per_token`` experts of
        each MoE layer (num_params for a dense model)."""
        idle = self.moe_layers * (self.num_experts - self.experts_per_token) * self.expert_params()
        return self.num_params() - idle

    def non_linear_params(self) -> int:
        """Parameters outside nn.Linear layers: the input embedding (also the LM head's weight when
        tied), the norms, sinks, and in MoE layers the experts and routers (transformers keeps them as
        3-D / plain parameters, not nn.Linear). During stage 2 only these get a low-precision
        ``.grad`` when fp32 gradient sums are on; linear layers add their gradients to the sums
        directly (oomb/fp32_linear.py)."""
        per_layer = (self.norms_per_layer * self.hidden_size + self.qk_norm_params
                     + (self.num_heads if self.attention_sinks else 0))
        experts = self.moe_layers * (self.num_experts * self.expert_params() + self.router_params())
        return self.vocab_size * self.hidden_size + self.num_layers * per_layer + self.hidden_size + experts

    def low_precision_grad_params(self, trainable: int) -> int:
        """How many of ``trainable`` parameters hold a low-precision ``.grad`` during stage 2 when their
        gradients are summed in fp32 (sums or fp32 targets): linear layers add theirs to the sums
        directly (oomb/fp32_linear.py), except under tensor parallelism, where that path is off."""
        return min(trainable, self.non_linear_params()) if self.tp == 1 else trainable

    def lora_params(self, rank: int) -> int:
        """LoRA parameters of rank ``rank`` that PEFT's "all-linear" adds: every linear projection (q, k,
        v, o, gate, up, down; a shared expert's too); in MoE layers the experts and router only where
        ``lora_expert_adapters`` (they are not nn.Linear)."""
        h, i, s = self.hidden_size, self.intermediate_size, self.shared_expert_intermediate_size
        attention = (h + self.q_dim) + 2 * (h + self.kv_dim) + (self.q_dim + h)
        dense = attention + 2 * (h + i) + (i + h)
        moe = attention + (2 * (h + s) + (s + h) if s else 0)
        if self.lora_expert_adapters:  # fused gate_up at rank 2r, down at rank r, for every expert
            e, ie = self.num_experts, self.expert_intermediate_size
            moe += e * 2 * (h + 2 * ie) + e * (ie + h) + (h + e)
            dense = attention  # PEFT's fixed qwen3_moe list: q, k, v, o (a dense layer's MLP unadapted)
        return rank * (self.moe_layers * moe + (self.num_layers - self.moe_layers) * dense)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K + V of one token in every layer: L x 2 x Hkv x D x bytes (56 KiB for Qwen2.5-7B in bf16).
        Window layers count fully: their pages are kept for the whole step (see predict)."""
        return self.num_layers * 2 * self.kv_dim * dtype.itemsize


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


# ---------------------------------------------------------------------------------------------
# Per-token activation terms
# ---------------------------------------------------------------------------------------------

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


def logits_slice_bytes(shape: ModelShape, tokens: int, batch_size: int, loss_chunk_tokens: int) -> int:
    """fp32 logits (and their gradients) of one slice of the chunked LM-head loss."""
    return LOGITS_FP32_COPIES * min(loss_chunk_tokens, tokens) * batch_size * shape.head_vocab * FP32_BYTES


def chunk_activation_bytes(shape: ModelShape, chunk_tokens: int, config: OOMBConfig, dtype: torch.dtype) -> int:
    """Activations autograd holds for one chunk of ``chunk_tokens`` tokens (batch included) in stage 2."""
    per_layer = max_layer_activation_bytes_per_token(shape, dtype) * chunk_tokens
    if config.checkpoint_layers:
        # Layer inputs of every layer are kept, one layer's full activations exist at a time,
        # plus the attention outputs kept for the replay.
        stored = shape.num_layers * chunk_tokens * shape.hidden_size * dtype.itemsize
        activations = stored + per_layer + recompute_cache_bytes_per_token(shape, dtype) * chunk_tokens
    else:
        activations = all_layers_activation_bytes_per_token(shape, dtype) * chunk_tokens
    return activations + paged_backward_workspace_per_token(shape, dtype, config.grad_dtype) * chunk_tokens


def estimate_step_memory(
    shape: ModelShape,
    num_tokens: int,
    config: OOMBConfig,
    *,
    batch_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    trainable_params: int = 0,
    fp32_targets: bool = False,
    context_parallel: int = 1,
) -> StepMemory:
    """Predicted GPU bytes of one oomb dense step above weights and optimizer state.

    ``trainable_params`` (of ``dtype``) get gradients. When ``config.fp32_grad_accumulation`` is on
    and ``dtype`` is low precision, they get fp32 sums instead, and only the parameters outside linear
    layers a low-precision ``.grad`` per chunk (a conservative count for LoRA). ``fp32_targets``: the
    caller's fp32 tensors receive the gradients (a trainer's master weights, counted by the caller):
    no sums, and the same few low-precision ``.grad``. With ``config.offload``
    the pages term is the GPU working set (resident layers, staging buffers, one chunk's pages).
    ``context_parallel``: ranks sharing the sequence; the pages of the busiest one.
    """
    chunk = min(config.chunk_size, num_tokens) * batch_size
    own_tokens = context_parallel_tokens(num_tokens, config.chunk_size, config.page_size, context_parallel)
    kv = PagedKVStore.bytes_needed(
        num_layers=shape.num_layers, batch_size=batch_size, num_tokens=own_tokens,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, page_size=config.page_size,
        kv_dtype=dtype, grad_dtype=config.grad_dtype,
    )
    if config.offload:
        pages = _num_pages(own_tokens, config.page_size, batch_size)
        chunk_pages = _num_pages(min(config.chunk_size, num_tokens), config.page_size, batch_size)
        kv = _dense_offload_gpu_pages(shape.num_layers, pages, chunk_pages, batch_size, OffloadAssumptions(
            config.offload_resident_layers, config.stream_block_pages, config.stream_buffers))
        kv *= _page_bytes(shape, config.page_size, dtype, config.grad_dtype)
    grads = trainable_params * dtype.itemsize
    if dtype.itemsize < FP32_BYTES and (config.fp32_grad_accumulation or fp32_targets):
        grads = shape.low_precision_grad_params(trainable_params) * dtype.itemsize
        if not fp32_targets:
            grads += trainable_params * FP32_BYTES
    logits = logits_slice_bytes(shape, min(config.chunk_size, num_tokens), batch_size, config.loss_chunk_tokens)
    return StepMemory(grads, chunk_activation_bytes(shape, chunk, config, dtype), kv, logits)


# ---------------------------------------------------------------------------------------------
# The planner's model: every mode, GPU and host
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Mode:
    """One way of running the step."""

    name: str
    attention: Literal["hf", "dense", "sparse"]
    offload: bool
    description: str


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("hf", "hf", False, "plain Hugging Face: SDPA + gradient checkpointing + chunked LM-head loss"),
    Mode("dense", "dense", False, "oomb dense: exact attention, all pages on the GPU"),
    Mode("dense+offload", "dense", True, "oomb dense, pages in pinned host memory streamed through the GPU"),
    Mode("sparse", "sparse", False, "oomb sparse: top-k pages per query block, all pages on the GPU"),
    Mode("sparse+offload", "sparse", True, "oomb sparse, pages on the host, only selected pages moved"),
)}


@dataclass(frozen=True)
class TrainingSetup:
    """What trains and how: everything besides the step's own options (OOMBConfig)."""

    dtype: torch.dtype = torch.bfloat16
    """Dtype of the weights, activations and K/V pages."""
    batch_size: int = 1
    """Sequences per step."""
    optimizer: Literal["adamw", "none"] = "adamw"
    """"adamw": two fp32 moments per trainable parameter; "none": a bare forward+backward (benchmarks)."""
    master_weights: bool = False
    """Keep an fp32 master copy of low-precision trainable parameters (4 bytes each)."""
    lora_rank: int = 0
    """0: full fine-tuning. r > 0: LoRA of rank r on every linear projection, base weights frozen."""
    context_parallel: int = 1
    """Ranks sharing each sequence (oomb/context_parallel.py): each holds the pages of every cp-th
    chunk (on the GPU, or with offload in its host memory); the busiest one (rank 0, which holds chunk
    0) is planned. Sparse page summaries and selections are kept for every chunk on every rank. Every
    oomb mode; not plain HF."""

    def __post_init__(self) -> None:
        if not isinstance(self.context_parallel, int) or self.context_parallel < 1:
            raise ValueError(f"context_parallel={self.context_parallel!r} must be an integer >= 1")
        if self.batch_size <= 0:
            raise ValueError(f"batch_size={self.batch_size} must be a positive integer")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank={self.lora_rank} must be >= 0 (0 = full fine-tuning)")
        if self.optimizer not in ("adamw", "none"):
            raise ValueError(f"optimizer={self.optimizer!r} is not supported; use 'adamw' or 'none'")


@dataclass(frozen=True)
class OffloadAssumptions:
    """The GPU working set of host offload (kv/offload.py; the OOMBConfig fields of the same names)."""

    resident_layers: int = 0
    """Layers whose pages stay on the GPU (OOMBConfig.offload_resident_layers)."""
    stream_block_pages: int = 256
    """History pages per streamed block (OOMBConfig.stream_block_pages): each layer's earlier pages pass
    through the GPU in blocks of this many pages per sequence, K, V (and dK, dV) in, dK, dV out."""
    stream_buffers: int = 3
    """GPU staging buffers of one block each (OOMBConfig.stream_buffers)."""


@dataclass(frozen=True)
class SparseAssumptions:
    """Sparse attention's budget and bookkeeping (DESIGN.md section 2, "Sparse mode")."""

    top_k_pages: int = 64
    """Earlier pages each query block attends to, chosen by score against the page summaries."""
    sink_pages: int = 1
    """First pages of the sequence every query block attends to, besides the top-k."""
    query_block_pages: int = 1
    """Consecutive query blocks sharing one selection (OOMBConfig.sparse_query_block_pages)."""
    summary_vectors: int = 2
    """Vectors summarising a page per KV head and layer: 2 for a Quest-style min/max key bound."""
    store_selection: bool = True
    """Keep stage 1's selection (int32 page ids per query block, layer and KV head) for stage 2;
    False: recompute it deterministically in stage 2 (no memory)."""

    @classmethod
    def from_config(cls, config) -> SparseAssumptions:
        """The assumptions of an OOMBConfig's sparse options (its score decides the summaries kept)."""
        from .kv.summaries import summaries_of

        return cls(top_k_pages=config.sparse_budget, sink_pages=config.sparse_sink_pages,
                   query_block_pages=config.sparse_query_block_pages,
                   summary_vectors=len(summaries_of(config.resolved_sparse_score, config.sparse_rerank_candidates)))


@dataclass(frozen=True)
class MemoryPrediction:
    """Predicted peak bytes of one step, by term."""

    mode: str
    tokens: int
    gpu: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    @property
    def gpu_above_weights(self) -> int:
        return self.gpu_total - self.gpu["weights"]

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


GPU_TERMS = ("weights", "param grads", "fp32 grad sums", "optimizer", "activations", "KV working set",
             "page summaries", "page tables")
HOST_TERMS = ("process", "KV pages", "KV grad pages", "selections")


def context_parallel_tokens(tokens: int, chunk_size: int, page_size: int, cp: int) -> int:
    """Token slots (whole pages) of a sequence whose pages the busiest of ``cp`` context-parallel ranks
    holds: rank 0, with chunks 0, cp, 2 cp, ... (``tokens`` itself when cp is 1)."""
    if cp == 1:
        return tokens
    from .context_parallel import ContextShard

    return ContextShard(0, cp, chunk_size).owned_pages(tokens, page_size) * page_size


def _num_pages(tokens: int, page_size: int, batch_size: int) -> int:
    return batch_size * -(-tokens // page_size)


def _dense_offload_gpu_pages(num_layers: int, pages: int, chunk_pages: int, batch_size: int,
                             offload: OffloadAssumptions, history_pages: int | None = None) -> int:
    """Pages dense offload keeps on the GPU (kv/offload.py): the resident layers' pools, the staging
    slots (a block or a chunk per sequence each) and one chunk's own K, V (stage 1) or dK, dV (stage 2).
    ``history_pages``: the most history pages per sequence one window stages, when fewer than a block
    (every layer slides: its window's pages; OffloadedKVStore.history_block_pages)."""
    slots = _staging_slot_pages(chunk_pages, batch_size, offload, history_pages)
    return min(offload.resident_layers, num_layers) * pages + slots + 2 * chunk_pages


def _staging_slot_pages(chunk_pages: int, batch_size: int, offload: OffloadAssumptions,
                        history_pages: int | None = None) -> int:
    """Pages of OffloadedKVStore's GPU staging slots (each a streamed block, or a chunk, per sequence),
    allocated in dense and sparse mode alike: sparse chunks whose budget covers their history stream as
    dense ones do."""
    block = offload.stream_block_pages if history_pages is None else min(offload.stream_block_pages, history_pages)
    return offload.stream_buffers * batch_size * max(block, chunk_pages // batch_size)


def _page_bytes(shape: ModelShape, page_size: int, dtype: torch.dtype, grad_dtype: torch.dtype) -> int:
    """K, V, dK, dV of one page in one layer."""
    return 2 * shape.kv_dim * page_size * (dtype.itemsize + grad_dtype.itemsize)


def _hf_activations(shape: ModelShape, tokens: int, setup: TrainingSetup, config: OOMBConfig,
                    layer_grad: int, head_grad: int, all_grads: int) -> int:
    """Peak bytes of a plain HF step beyond the full parameter gradients (never below zero).

    With gradient checkpointing each layer's input (T x hidden) is stored in forward; in backward,
    layer j recomputes its activations for all T tokens while layers > j already hold their
    gradients and layers <= j still hold their inputs. The peak is at the first or the last layer's
    backward (the profile is linear in j), or at the loss.
    """
    t = tokens * setup.batch_size
    b = setup.dtype.itemsize
    stored = t * shape.hidden_size * b  # one layer's checkpointed input
    layer = (max_layer_activation_bytes_per_token(shape, setup.dtype)
             + sdpa_backward_workspace_per_token(shape, setup.dtype)) * t
    flow = 2 * stored  # the residual stream's gradient entering and leaving the layer
    L = shape.num_layers
    first_layer_backward = head_grad + layer_grad + L * stored + layer + flow
    last_layer_backward = head_grad + L * layer_grad + stored + layer + flow
    loss = head_grad + L * stored + flow + logits_slice_bytes(shape, tokens, setup.batch_size,
                                                              config.loss_chunk_tokens)
    return max(0, max(first_layer_backward, last_layer_backward, loss) - all_grads)


def predict(
    mode: str | Mode,
    shape: ModelShape,
    tokens: int,
    config: OOMBConfig | None = None,
    setup: TrainingSetup | None = None,
    *,
    offload: OffloadAssumptions | None = None,
    sparse: SparseAssumptions | None = None,
) -> MemoryPrediction:
    """Predicted peak GPU bytes and host bytes of one step of ``mode`` on ``tokens`` tokens per sequence.

    Args:
        mode: a name of MODES ("hf", "dense", "dense+offload", "sparse", "sparse+offload").
        shape: the model's dimensions.
        tokens: context length T (tokens per sequence).
        config: oomb's step options (chunk, page, KV gradient dtype, checkpointing, loss slice).
        setup: dtype, batch, optimizer, LoRA.
        offload, sparse: assumptions of the planned modes.
    Returns:
        A MemoryPrediction with the GPU_TERMS and HOST_TERMS in bytes.

    Sliding-window layers (Gemma 2/3, gpt-oss, Mistral; ``shape.sliding_window_layers``) with a window
    W shorter than the step have their own pages without offload and context parallelism (kv/store.py):
    at most the tails of the chunks before the current one (their last W - 1 keys, which later chunks'
    windows read in both stages, rounded up to pages and at most the chunk) plus the current chunk, so
    a window layer costs about (W - 1) / C of a global layer's pages per token (no saving when W - 1 >= C),
    and no page summaries. With offload the offloaded window layers keep the same count of pages in
    host slots (kv/window_slots.py; resident window layers keep every page on the GPU, like global
    ones), stage only the ceil((W - 1) / P) pages before a chunk that its window overlaps (kv/offload.py;
    when every layer slides the staging slots shrink to that, or to a chunk), and keep no page summaries
    either. Under context parallelism they are global layers.
    (oomb's speed estimates do not count attention FLOPs, so windows change no speed prediction.)

    Mixtures of experts (``shape.num_experts``): weights, gradients and optimizer state count every
    expert; a chunk's activations count its tokens' top-k routed expert rows (MOE_ROUTED_ROW_*).
    With fp32 gradient sums the experts and routers keep a low-precision ``.grad`` during stage 2
    (they are not nn.Linear: ModelShape.non_linear_params).
    """
    mode = MODES[mode] if isinstance(mode, str) else mode
    config = config or OOMBConfig()
    setup = setup or TrainingSetup()
    offload = offload or OffloadAssumptions()
    sparse = sparse or SparseAssumptions()
    if tokens <= 0:
        raise ValueError(f"tokens={tokens} must be a positive integer")
    if setup.context_parallel > 1 and mode.attention == "hf":
        raise ValueError(f"mode {mode.name!r} with context parallelism (cp={setup.context_parallel}) is not "
                         "supported: context parallelism is oomb's (dense or sparse, with or without offload)")
    b = setup.dtype.itemsize
    B, P, L = setup.batch_size, config.page_size, shape.num_layers
    low_precision = b < FP32_BYTES

    # Parameters, gradients, optimizer.
    if setup.lora_rank:
        trainable = shape.lora_params(setup.lora_rank)
        weights = shape.num_params() * b + trainable * LORA_PARAM_BYTES
        grad_bytes, trainable_low_precision = LORA_PARAM_BYTES, False
        layer_grad = trainable // L * grad_bytes
        head_grad = 0
    else:
        trainable = shape.num_params()
        weights = trainable * b
        grad_bytes, trainable_low_precision = b, low_precision
        layer_grad = max(shape.layer_params(moe) for moe in shape.layer_kinds()) * b
        head_grad = shape.head_vocab * shape.hidden_size * b
    grads = trainable * grad_bytes
    optimizer = 0
    if setup.optimizer == "adamw":
        # Its two moments take the dtype of what it steps: fp32 masters, else the parameters.
        mastered = setup.master_weights or not trainable_low_precision
        optimizer += trainable * (ADAMW_STATE_BYTES if mastered else 2 * grad_bytes)
    if setup.master_weights and trainable_low_precision:
        optimizer += trainable * MASTER_WEIGHT_BYTES
    gpu = dict.fromkeys(GPU_TERMS, 0)
    gpu.update({"weights": weights, "param grads": grads, "optimizer": optimizer})
    host = dict.fromkeys(HOST_TERMS, 0)
    host["process"] = HOST_PROCESS_BYTES

    if mode.attention == "hf":
        gpu["activations"] = _hf_activations(shape, tokens, setup, config, layer_grad, head_grad, grads)
        return MemoryPrediction(mode.name, tokens, gpu, host)

    # oomb: one chunk's activations and logits slice, whatever the context.
    chunk_len = min(config.chunk_size, tokens)
    if config.fp32_grad_accumulation and trainable_low_precision:
        # Linear layers' gradients go to the fp32 sums directly (oomb/fp32_linear.py, not under TP):
        # during stage 2 only the embedding's and norms' gradients pass through a low-precision .grad.
        gpu["fp32 grad sums"] = trainable * FP32_BYTES
        gpu["param grads"] = shape.low_precision_grad_params(trainable) * grad_bytes
    gpu["activations"] = (chunk_activation_bytes(shape, chunk_len * B, config, setup.dtype)
                          + logits_slice_bytes(shape, chunk_len, B, config.loss_chunk_tokens))
    pages = _num_pages(tokens, P, B)  # pages of one layer
    # Context parallel: the pages of the busiest rank's chunks (all of them without it).
    own_tokens = context_parallel_tokens(tokens, config.chunk_size, P, setup.context_parallel)
    own_pages = _num_pages(own_tokens, P, B)
    page_bytes = _page_bytes(shape, P, setup.dtype, config.grad_dtype)  # K, V, dK, dV, one layer
    gpu["page tables"] = pages * INT32_BYTES
    # Window layers shorter than the step (not under context parallelism) read, keep summaries of and,
    # without offload, keep pages of their windows only (kv/store.py, kv/offload.py).
    windowed = shape.sliding_window_layers and shape.sliding_window < tokens and setup.context_parallel == 1
    window_layers = shape.sliding_window_layers if windowed else 0

    if mode.offload:
        chunk_pages = _num_pages(chunk_len, P, B)
        resident = min(offload.resident_layers, L)
        # Every (offloaded) layer slides: a window's history, ceil((W - 1) / P) pages, fills a slot.
        history = -(-(shape.sliding_window - 1) // P) if window_layers >= L else None
        if mode.attention == "dense":
            gpu["KV working set"] = _dense_offload_gpu_pages(L, own_pages, chunk_pages, B, offload,
                                                             history) * page_bytes
        else:  # the union of every block's and KV head's selection, staged at once (an upper bound),
            # for this call and, in stage 2, the next one (prefetched); plus the chunk's own gradients
            selections = -(-(chunk_pages // B) // sparse.query_block_pages)  # distinct selections per chunk
            union = selections * shape.num_kv_heads * (sparse.top_k_pages + sparse.sink_pages)
            staged = B * min(own_pages // B, union) + chunk_pages
            slots = _staging_slot_pages(chunk_pages, B, offload, history) if resident < L else 0
            gpu["KV working set"] = (resident * own_pages + 2 * staged + chunk_pages + slots) * page_bytes
        # Host: K, V, dK, dV of every token (context parallel: of the rank's chunks) of the offloaded
        # global layers, and of the window slots of the offloaded window layers (their chunk tails and
        # one chunk, kv/window_slots.py), pinned: the footprint the engine checks before allocating.
        page_shape = capacity.PageShape(L, B, own_tokens, shape.num_kv_heads, shape.head_dim, setup.dtype,
                                        shape.window_layer_ids() if windowed else (), shape.sliding_window)
        offload_config = replace(config, offload=True, offload_resident_layers=resident)
        host["KV pages"], host["KV grad pages"] = capacity.host_page_bytes(page_shape, offload_config)
    else:
        # Window layers shorter than the step have their own pages without offload (kv/store.py):
        # the last W - 1 keys of every chunk before the current one, plus that chunk.
        window_pages = B * window_pages_per_sequence(tokens, config.chunk_size, P, shape.sliding_window) \
            if windowed else 0
        gpu["KV working set"] = ((L - window_layers) * own_pages + window_layers * window_pages) * page_bytes
        gpu["page tables"] += pages * INT32_BYTES if windowed else 0

    if mode.attention == "sparse":
        # Every page's, on every context-parallel rank too (each scores the whole history, kv/store.py).
        # Window layers keep none (they read their window densely), with or without offload.
        summaries = (L - window_layers) * pages * sparse.summary_vectors * shape.kv_dim * b
        selection = 0
        if sparse.store_selection:  # one selection per query block (page) per layer and KV head
            selection = L * pages * shape.num_kv_heads * (sparse.top_k_pages + sparse.sink_pages) * INT32_BYTES
        if mode.offload:  # offloaded layers keep their selections in host memory until stage 2
            host["selections"] = selection * (L - resident) // L
            selection -= host["selections"]
        gpu["page summaries"] = summaries + selection
    return MemoryPrediction(mode.name, tokens, gpu, host)
