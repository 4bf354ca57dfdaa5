"""The router's load-balancing loss of mixture-of-experts families, chunk by chunk and exact.

Hugging Face adds ``router_aux_loss_coef * aux`` to the loss of Qwen3-MoE and gpt-oss when
``output_router_logits`` is on (``load_balancing_loss_func``): over the R = layers x batch x tokens
router rows of the whole sequence,

    aux = E * sum_e (count_e / R) * (prob_sum_e / R)

with count_e the top-k assignments to expert e (not differentiated) and prob_sum_e the sum of the
router's softmax probabilities. It is a product of two whole-sequence means, so it does not split
into per-chunk losses by itself; but the counts are fixed numbers: stage 1 (which runs every chunk
anyway) counts them for the whole sequence, and stage 2 adds to each chunk's loss its share of the
probability sums, coef * E * sum_e (count_e / R) * (chunk's prob_sum_e / R). Summed over chunks
that is coef * aux, and each share's gradient is the exact gradient of the full-sequence term.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

ROUTER_LOSS_MODEL_TYPES = ("qwen3_moe", "gpt_oss")
"""Families whose HF loss adds the load-balancing loss above when output_router_logits is on."""


ROUTER_LOSS_FACTOR = "_oomb_router_loss_factor"
"""Attribute of a causal LM: a factor on the load-balancing term of the step's loss, value and gradient
(training/hf_trainer.py sets it where the Trainer weighs that term unlike the token loss)."""


class RouterBalanceLoss:
    """The load-balancing loss of one step: ``observe`` every chunk in stage 1, then ``chunk_loss``
    per chunk in stage 2."""

    def __init__(self, coef: float, num_experts: int, top_k: int) -> None:
        self.coef, self.num_experts, self.top_k = coef, num_experts, top_k
        self.counts: torch.Tensor | None = None  # (E,) float32 top-k assignments over the sequence
        self.rows = 0  # router rows over the sequence (all layers)

    @classmethod
    def of(cls, causal_lm: PreTrainedModel) -> RouterBalanceLoss | None:
        """The model's load-balancing loss, or None when its HF loss has none (output_router_logits off)."""
        cfg = causal_lm.config
        if cfg.model_type not in ROUTER_LOSS_MODEL_TYPES or not getattr(cfg, "output_router_logits", False):
            return None
        num_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
        return cls(cfg.router_aux_loss_coef, num_experts, cfg.num_experts_per_tok)

    def observe(self, router_logits: tuple[torch.Tensor, ...]) -> None:
        """Stage 1: count the chunk's top-k assignments, (rows, E) logits per MoE layer."""
        for logits in router_logits:
            selected = torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1).indices
            counts = torch.zeros(self.num_experts, dtype=torch.float32, device=logits.device)
            counts.scatter_add_(0, selected.reshape(-1), torch.ones(selected.numel(), device=logits.device))
            self.counts = counts if self.counts is None else self.counts + counts
            self.rows += logits.shape[0]

    def chunk_loss(self, router_logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Stage 2: the chunk's share of coef * aux (differentiable in the router logits)."""
        if self.counts is None or not self.rows:
            raise RuntimeError("the load-balancing loss needs stage 1's counts of every chunk first")
        prob_sum = sum(torch.softmax(logits.float(), dim=-1).sum(0) for logits in router_logits)
        return self.coef * self.num_experts * (self.counts / self.rows * prob_sum / self.rows).sum()
