"""Forward only: stage 1 of the step (oomb/engine.py), for evaluating a model the way it trains.

A long sequence runs chunk by chunk over the paged store with the step's attention (dense, exact, by
default; or sparse with the same selection rules), under no_grad, and the pages are freed at the end.
Each chunk's final hidden states go to the caller as they come out, so nothing of the sequence's
length is kept but what the caller keeps:

    forward_hidden   the final hidden states of the whole sequence, (B, T, hidden): for short checks
    token_logprobs   per token, log p(token | the tokens before it), 4 bytes a token, and the greedy
                     prediction at asked positions: the LM head and its softmax run on slices of
                     loss_chunk_tokens tokens of one chunk, the only full-vocabulary logits that exist

With ``offload.enabled`` the pages live in host memory as in training, so a model evaluates
at any length its step trains at. The store is a training step's (it holds page gradient buffers that
stage 1 never writes), so evaluation needs the memory of the step's pages, no more.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .config import OOMBConfig
from .engine import attention_setup, make_step_store, set_history_starts, validated_inputs
from .kv import ChunkSpan, split_into_chunks
from .kv.offload import HostSlabs
from .loss import IGNORE_INDEX, shift_labels
from .models import (
    Stage,
    StepState,
    layer_checkpointing,
    loss_head,
    oomb_attention,
    resolved_sparse,
    step_window_bounds,
    unwrap_causal_lm,
)

ChunkCallback = Callable[[ChunkSpan, torch.Tensor], None]
"""Called with each chunk's span and its final hidden states (B, chunk length, hidden), in order."""


@torch.no_grad()
def run_stage_one(model: torch.nn.Module, input_ids: torch.Tensor, on_chunk: ChunkCallback,
                  config: OOMBConfig | None = None, *, progress: bool = False,
                  host_slabs: HostSlabs | None = None) -> None:
    """Stage 1 of the step over ``input_ids``: every chunk fills its pages and hands ``on_chunk`` its
    final hidden states, which are dropped once the callback returns.

    Args:
        model: a supported transformers *ForCausalLM, optionally PEFT-wrapped (in eval mode for no dropout).
        input_ids: (B, T) or (T,) token ids.
        on_chunk: receives (chunk span, hidden states) per chunk.
        config: attention mode, chunk and page size, backend, offload; defaults to OOMBConfig() (dense).
        progress: a progress bar over the chunks.
        host_slabs: with ``config.offload.enabled``, pinned host memory to reuse (None: a new one).
    """
    config = config or OOMBConfig()
    causal_lm = unwrap_causal_lm(model)
    device = causal_lm.get_input_embeddings().weight.device
    input_ids, _ = validated_inputs(causal_lm, input_ids, None, device)
    batch, num_tokens = input_ids.shape
    sparse = resolved_sparse(config, causal_lm)
    backend, _, windows = attention_setup(causal_lm, config, device, num_tokens, None)
    store = make_step_store(causal_lm, batch, num_tokens, config, device, sparse, host_slabs)
    chunks = split_into_chunks(num_tokens, config.chunk_size)
    bounds = step_window_bounds(windows, None, (batch, num_tokens), device)
    set_history_starts(store, chunks, windows, bounds, None)
    decoder = causal_lm.get_decoder()
    bar = tqdm(total=len(chunks), desc="oomb eval", unit="chunk", disable=not progress, leave=False)
    try:
        with oomb_attention(causal_lm), layer_checkpointing(decoder, False):
            for chunk in chunks:
                store.allocate(chunk)
                out = decoder(
                    input_ids=input_ids[:, chunk.start:chunk.end],
                    position_ids=torch.arange(chunk.start, chunk.end, device=device).expand(batch, -1),
                    use_cache=False,
                    oomb_step=StepState(store, chunk, Stage.FILL, backend, None, sparse, None, windows, bounds),
                )
                store.finish_fill(chunk)  # window layers: free the pages no later chunk reads
                on_chunk(chunk, out.last_hidden_state)
                bar.update()
    finally:
        bar.close()
        store.free_all()


def forward_hidden(model: torch.nn.Module, input_ids: torch.Tensor, config: OOMBConfig | None = None) -> torch.Tensor:
    """The decoder's final hidden states, (B, T, hidden), computed chunk by chunk like stage 1.

    Args:
        model: a supported transformers *ForCausalLM, optionally PEFT-wrapped (set eval() for no dropout).
        input_ids: (B, T) or (T,) token ids.
        config: options (attention mode, chunk and page size, backend); defaults to OOMBConfig().
    Returns:
        (B, T, hidden) in the model's dtype; apply ``model.get_output_embeddings()`` for logits.
    """
    hidden: list[torch.Tensor] = []
    run_stage_one(model, input_ids, lambda chunk, out: hidden.append(out), config)
    return torch.cat(hidden, dim=1)


@dataclass(frozen=True)
class TokenLogprobs:
    """What ``token_logprobs`` keeps of a sequence: 4 bytes a token, plus the asked predictions."""

    logprobs: torch.Tensor
    """(B, T) float32: log p(labels[b, t] | input_ids[b, :t]); NaN at t = 0 and where labels[b, t] is -100."""
    predictions: torch.Tensor | None
    """(B, K) int64: the model's greedy (argmax) token for position ``predict_at[b, k]``, made from the tokens
    before it; None when no position was asked."""


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    config: OOMBConfig | None = None,
    *,
    predict_at: torch.Tensor | None = None,
    progress: bool = False,
    host_slabs: HostSlabs | None = None,
) -> TokenLogprobs:
    """Per-token log-probabilities of a long sequence through stage 1, in eval mode (no dropout).

    Equal to ``model(input_ids).logits.float().log_softmax(-1)`` gathered at the next tokens, up to
    float rounding (dense attention; sparse reads what the step reads), without ever holding more than
    ``config.performance.loss_chunk_tokens`` positions' full-vocabulary logits: each chunk's hidden states go
    through the LM head (softcapped where the family softcaps its logits, as the loss sees them) slice
    by slice as they come out, and only the labelled tokens' log-probabilities are kept. Slices with no
    label and no asked position skip the head.

    Args:
        model: a supported transformers *ForCausalLM, optionally PEFT-wrapped; its train/eval modes are
            restored afterwards.
        input_ids: (B, T) or (T,) token ids.
        labels: the tokens to score, same shape (-100: not scored); defaults to input_ids.
        config: as for the step; defaults to OOMBConfig() (dense, exact).
        predict_at: (K,) or (B, K) positions t in [1, T): the argmax token for t from the tokens before it
            (passkeys: the answer's positions).
        progress: a progress bar over the chunks.
        host_slabs: with ``config.offload.enabled``, pinned host memory to reuse.
    Returns:
        TokenLogprobs, on the model's device.
    """
    config = config or OOMBConfig()
    causal_lm = unwrap_causal_lm(model)
    device = causal_lm.get_input_embeddings().weight.device
    input_ids, labels = validated_inputs(causal_lm, input_ids, labels, device)
    batch, num_tokens = input_ids.shape
    targets = shift_labels(labels)  # (B, T): position p predicts targets[:, p] = labels[:, p + 1]
    scored = (targets != IGNORE_INDEX).any(dim=0).cpu()  # (T,) on the host: which slices need the head
    sources = None
    if predict_at is not None:
        sources = _prediction_sources(predict_at, batch, num_tokens).to(device)  # (B, K): positions that predict
        scored[sources.flatten().cpu()] = True
    head = loss_head(causal_lm)
    slice_tokens = config.performance.loss_chunk_tokens
    by_position = torch.full((batch, num_tokens), math.nan, dtype=torch.float32, device=device)
    predictions = None if sources is None else torch.zeros(sources.shape, dtype=torch.long, device=device)

    def on_chunk(chunk: ChunkSpan, hidden: torch.Tensor) -> None:
        for start in range(chunk.start, chunk.end, slice_tokens):
            end = min(start + slice_tokens, chunk.end)
            if not bool(scored[start:end].any()):
                continue  # nothing to score here: skip the vocabulary projection
            logits = head(hidden[:, start - chunk.start:end - chunk.start]).float()  # (B, S, V)
            part = targets[:, start:end]
            counted = part != IGNORE_INDEX
            picked = logits.gather(-1, part.clamp_min(0)[..., None])[..., 0]
            # log-softmax at the target only (logit - logsumexp): no (B, S, V) log-probabilities kept
            by_position[:, start:end] = torch.where(counted, picked - logits.logsumexp(-1), math.nan)
            if sources is not None:
                rows, ks = ((sources >= start) & (sources < end)).nonzero(as_tuple=True)
                predictions[rows, ks] = logits[rows, sources[rows, ks] - start].argmax(-1)

    with eval_mode(model):
        run_stage_one(model, input_ids, on_chunk, config, progress=progress, host_slabs=host_slabs)
    # Position p's score belongs to token p + 1; position T - 1 predicts nothing (NaN) and rolls to token 0.
    return TokenLogprobs(by_position.roll(1, dims=1), predictions)


def _prediction_sources(predict_at: torch.Tensor, batch: int, num_tokens: int) -> torch.Tensor:
    """(B, K) positions whose hidden states predict the asked ones (one before each), checked."""
    if not isinstance(predict_at, torch.Tensor) or predict_at.dtype not in (torch.int64, torch.int32):
        raise TypeError("predict_at must be an integer tensor of positions")
    if predict_at.dim() == 1:
        predict_at = predict_at[None].expand(batch, -1)
    if predict_at.dim() != 2 or predict_at.shape[0] != batch:
        raise ValueError(f"predict_at must have shape (K,) or ({batch}, K), got {tuple(predict_at.shape)}")
    if predict_at.numel() and (int(predict_at.min()) < 1 or int(predict_at.max()) >= num_tokens):
        raise ValueError(f"predict_at must lie in [1, {num_tokens}) (position 0 has nothing before it), found "
                         f"[{int(predict_at.min())}, {int(predict_at.max())}]")
    return predict_at.long() - 1


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Every module in eval mode (no dropout) inside the block, each module's own mode restored after."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
