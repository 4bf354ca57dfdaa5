"""The dimensions of a decoder-only transformer that memory depends on (``ModelShape``), read from a
Hugging Face config.

Parameter counts by part (attention, dense MLP or experts and router, norms, LoRA adapters; ``num_params()`` equals the
transformers model's, tests/test_memory_moe.py), one tensor-parallel rank's share and the sliding-window
layers. Kept apart from the memory model that uses it (memory.py, activations.py) because the trainer, the
chooser (choose.py) and the tools read a model's shape too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

# Saved expert-intermediate vectors per routed row: the default of ModelShape.expert_saved_intermediates
# (the other mixture-of-experts activation terms are in oomb/planning/activations.py).
MOE_ROUTED_ROW_SAVED_INTERMEDIATE = 4
"""Expert-intermediate-size vectors kept per routed row, as for a dense gated MLP: gate and up (one
2 i output), act(gate) and act(gate) x up (qwen3_moe; measured with saved-tensor hooks in
tests/test_memory_moe.py)."""

GPT_OSS_ROUTED_ROW_SAVED_INTERMEDIATE = 7
"""gpt-oss's clamped SwiGLU keeps more i-wide tensors per row: the 2 i gate/up output, the clamped gate
and up, sigmoid(alpha gate), the gated product and up + 1 (measured as above)."""


@functools.cache
def _peft_adapts_dense_mlp_of_moe() -> bool:
    """Whether the installed PEFT adapts a dense MLP inside a qwen3_moe model (see
    ModelShape.lora_dense_mlp_of_moe); read from its version, not by importing it."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        return Version(version("peft")) >= Version("0.22")
    except PackageNotFoundError:
        return True


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
    (``target_parameters``; PEFT does for qwen3_moe: the fused gate_up_proj at rank 2 r and
    down_proj at rank r per expert, the router at rank r; not for gpt-oss)."""
    lora_dense_mlp_of_moe: bool = True
    """With ``lora_expert_adapters``, whether the dense MLP of an ``mlp_only_layers`` layer is adapted
    too: PEFT 0.22 keeps its gate, up and down projections as module targets; PEFT 0.21 turned those
    names into expert parameter targets and left the dense MLP unadapted."""
    sliding_window: int = 0
    """Window of the sliding-window layers (0: none): without offload their pages are bounded by it,
    with offload what they stage (see memory.predict)."""
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
                       lora_dense_mlp_of_moe=_peft_adapts_dense_mlp_of_moe(),
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
        backend check (oomb/attention/variants.py) refuses it: logit softcapping (cuDNN has no cap).
        Sliding windows and sinks run on cudnn; windows inside packed documents do not, and the trainer
        sends those to triton (oomb/training/trainer.py, chooser_fixed)."""
        return "attention logit softcapping" if self.logit_softcap else None

    def per_rank(self, tp: int) -> ModelShape:
        """One tensor-parallel rank's share (oomb/parallel.py): heads, KV heads and dense MLP columns
        split tp ways, an untied LM head split by vocabulary; embeddings, norms and experts stay whole."""
        if tp == 1:
            return self
        dense_mlps = self.moe_layers < self.num_layers
        def divides(n: int) -> bool:
            return not (self.num_heads % n or self.num_kv_heads % n or (dense_mlps and self.intermediate_size % n))

        if not divides(tp):
            valid = [n for n in range(1, self.num_kv_heads + 1) if divides(n)]
            raise ValueError(f"tp={tp} must divide num_attention_heads={self.num_heads}, num_key_value_heads="
                             f"{self.num_kv_heads} and intermediate_size={self.intermediate_size}; valid: "
                             f"{', '.join(map(str, valid))}")
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
            if not self.lora_dense_mlp_of_moe:
                dense = attention
        return rank * (self.moe_layers * moe + (self.num_layers - self.moe_layers) * dense)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K + V of one token in every layer: L x 2 x Hkv x D x bytes (56 KiB for Qwen2.5-7B in bf16).
        Window layers count fully: their pages are kept for the whole step (see memory.predict)."""
        return self.num_layers * 2 * self.kv_dim * dtype.itemsize
