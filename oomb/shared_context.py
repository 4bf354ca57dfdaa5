"""Many continuations over one long context at the cost of one: the shared-context step (SFT, DPO, GRPO).

Row i is the sequence context + continuation i, chunked from 0 as ``forward_backward`` chunks it. Its
chunks before S, the start of the context's last chunk (the *trunk*), are the same in every row: they
run once. The rest of row i, the context's last chunk (its *tail*, 1 to chunk_size tokens) and the
continuation, runs as row i's own chunks m, m + 1, ...::

    context      [ trunk: chunks 0 .. m-1 (pages shared by every row)  | tail )
    row i        [ trunk                                               | tail  continuation i ]
                 0                                                     S = m * chunk_size

    stage 1, trunk chunks 0..m-1             fill the trunk's pages, once
    for each continuation i, one row at a time (store.branch()):
        stage 1, row i's chunks m..          pages after the trunk's; attend to the trunk's and their own
        stage 2, row i's chunks ..m          recompute with grad; attention backward adds dK/dV into the
                                             trunk's page gradients, which accumulate over the rows;
                                             parameter gradients accumulate; row i's pages are freed
    stage 2, trunk chunks m-1..0             each receives its dK/dV summed over every row

Each row's chunks compute exactly what ``forward_backward`` computes on that row (the same chunks and
pages; in sparse mode the same page selections), and the trunk's backward receives the sum of every
row's contributions: the gradient is the sum of the rows' gradients. Cost: the context once, plus per
continuation its own tokens and the context's tail; memory: the trunk's pages plus one row's.

Losses. The default is the mean token cross-entropy over the counted labels of every row, as Hugging
Face computes it on the batch of rows (right-padded, padding labels -100); context labels, if given,
are the rows' own and so count once per continuation (the trunk's chunks take their loss K times).
With ``loss_fn``, any loss of the continuations' per-token log-probabilities (DPO, GRPO): a first
pass of stage 1 over every row gives the log-probabilities (no grad, 4 bytes a token); autograd on
those small tensors gives each token's weight w_t = dL/dlogp_t; then every row runs stage 1 again and
its stage 2 backpropagates sum_t w_t logp_t. The gradient is L's exactly; the price is a second stage 1
over each row's own chunks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from .attention.function import KeptOutputs
from .compiled_layers import compiled_layers, resolve_compile_layers
from .config import OOMBConfig
from .documents import Documents, resolve_documents
from .engine import (
    attention_setup,
    gradient_routing,
    make_step_store,
    rng_state,
    set_history_starts,
    set_rng_state,
    step_gradient_sums,
    validated_inputs,
)
from .kv import ChunkSpan, split_into_chunks
from .kv.offload import HostSlabs
from .loss import IGNORE_INDEX, ScaledGradient, chunked_cross_entropy, gradient_scale, shift_labels, slices_with_labels
from .models import (
    Stage,
    StepState,
    layer_checkpointing,
    loss_head,
    oomb_attention,
    resolved_sparse,
    unwrap_causal_lm,
)
from .moe import RouterBalanceLoss
from .parallel import ParallelSetup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContinuationLogProbs:
    """The continuations' per-token log-probabilities, what a ``loss_fn`` receives.

    ``tokens[i, j]`` is log p(label j of continuation i | context, continuation i's tokens before j),
    float32, differentiable (the step takes its gradient); 0 where ``mask`` is False (labels of -100,
    and padding after a shorter continuation). Layout as TRL's per-token log-probabilities and
    completion mask: (K continuations, longest continuation)."""

    tokens: torch.Tensor
    """(K, max_len) float32 per-token log-probabilities, 0 where not counted."""
    mask: torch.Tensor
    """(K, max_len) bool: the counted labels."""

    @property
    def sums(self) -> torch.Tensor:
        """(K,) each continuation's summed log-probability (DPO's sequence log-probability)."""
        return (self.tokens * self.mask).sum(-1)

    @property
    def counts(self) -> torch.Tensor:
        """(K,) each continuation's number of counted labels."""
        return self.mask.sum(-1)


LossFn = Callable[[ContinuationLogProbs], torch.Tensor]


@dataclass
class _Row:
    """One continuation's row: context + continuation, its own chunks (from the context's last on)."""

    ids: torch.Tensor  # (1, T_i) context then continuation
    targets: torch.Tensor  # (1, T_i) shifted labels, -100 where not counted
    documents: Documents | None  # (1, T_i) boundaries when the context packs documents
    chunks: list[ChunkSpan]
    labels_at: int  # target position of the continuation's first label: the context's last token
    num_labels: int  # the continuation's length
    rng_states: list | None = None  # stage 1's RNG state per chunk, replayed by later passes
    weights: torch.Tensor | None = None  # loss_fn: (1, T_i) dL/dlogp per target position


def shared_context_backward(
    model: torch.nn.Module,
    context_ids: torch.Tensor,
    continuations: Sequence[torch.Tensor],
    labels: Sequence[torch.Tensor | None] | None = None,
    *,
    context_labels: torch.Tensor | None = None,
    config: OOMBConfig | None = None,
    loss_fn: LossFn | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | list | None = None,
    host_slabs: HostSlabs | None = None,
    parallel: ParallelSetup | None = None,
) -> torch.Tensor:
    """Forward and backward of many continuations of one long context, the context computed once.

    Leaves in every parameter's ``.grad`` (accumulating, like ``.backward()``) the gradient of the loss
    over the rows context + continuation i (module docstring). Without ``loss_fn`` the loss is what
    ``model(input_ids=batch, labels=batch_labels).loss`` gives on the right-padded batch of those rows:
    the mean token cross-entropy over every counted label of every row; continuation i's first label is
    predicted from the context's last token.

    Args:
        model: a supported transformers *ForCausalLM, optionally PEFT-wrapped.
        context_ids: (T,) or (1, T) token ids of the context (one context a call).
        continuations: K >= 1 token tensors (n_i,) or (1, n_i) of any lengths n_i >= 1.
        labels: None (each continuation's labels are its tokens) or K label tensors (or None each) of the
            continuations' shapes, -100 ignored. Label j of continuation i is predicted at its token j - 1
            (j = 0: at the context's last token), as Hugging Face shifts labels on the concatenation.
        context_labels: (T,) labels of the context, counted in the default loss once per row (as in the
            batch of rows); None: the context is not a target. Not with ``loss_fn``.
        config: options; defaults to OOMBConfig(). Dense or sparse, with or without offload.
        loss_fn: a loss of the continuations' per-token log-probabilities (``ContinuationLogProbs``),
            returning a scalar: DPO's, GRPO's. None: the mean cross-entropy above.
        position_ids: (T,) packed documents inside the context, as forward_backward takes them (positions
            restart at 0 at each document); every continuation continues the context's last document.
        cu_seqlens: the context's document boundaries as cumulative lengths instead (or as well).
        host_slabs: with ``config.offload.enabled``, pinned host memory to reuse across calls.
        parallel: must be None: a shared-context step runs on one process.
    Returns:
        The detached loss (float32 scalar): the mean cross-entropy, or ``loss_fn``'s value.
    """
    return _shared_context_step(model, context_ids, continuations, labels, context_labels, config, loss_fn,
                                position_ids, cu_seqlens, host_slabs, parallel, backward=True)


def shared_context_logprobs(
    model: torch.nn.Module,
    context_ids: torch.Tensor,
    continuations: Sequence[torch.Tensor],
    labels: Sequence[torch.Tensor | None] | None = None,
    *,
    config: OOMBConfig | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | list | None = None,
    host_slabs: HostSlabs | None = None,
) -> ContinuationLogProbs:
    """The continuations' per-token log-probabilities (detached), stage 1 alone: what ``loss_fn`` would
    receive; e.g. a reference model's for DPO or GRPO. Arguments as ``shared_context_backward``'s."""
    return _shared_context_step(model, context_ids, continuations, labels, None, config, None, position_ids,
                                cu_seqlens, host_slabs, None, backward=False)


def _shared_context_step(model, context_ids, continuations, labels, context_labels, config, loss_fn, position_ids,
                         cu_seqlens, host_slabs, parallel, backward: bool):
    config = config or OOMBConfig()
    causal_lm = unwrap_causal_lm(model)
    _refuse_unsupported(model, causal_lm, parallel, loss_fn, context_labels)
    parallel = ParallelSetup()
    device = causal_lm.get_input_embeddings().weight.device
    context, context_labels = _validated_context(causal_lm, context_ids, context_labels, device)
    num_context = context.shape[1]
    chunk_size = config.chunk_size
    trunk_end = (num_context - 1) // chunk_size * chunk_size  # S: the context's last chunk starts here
    trunk = split_into_chunks(trunk_end, chunk_size) if trunk_end else []
    context_documents = resolve_documents(position_ids, cu_seqlens, tuple(context.shape), device)
    rows = _make_rows(causal_lm, context, context_labels, context_documents, continuations, labels, chunk_size,
                      len(trunk), device)
    trunk_targets = rows[0].targets[:, :trunk_end]  # the same in every row
    trunk_targets_on_host = trunk_targets.cpu()  # read once: each trunk chunk's loss slices come from it
    num_targets = sum(int((row.targets != IGNORE_INDEX).sum()) for row in rows)
    if loss_fn is None and num_targets == 0:
        raise ValueError("no counted label in any continuation (all -100): the loss is undefined")
    longest = max(rows, key=lambda row: row.ids.shape[1])
    num_tokens = longest.ids.shape[1]
    compile_layers = resolve_compile_layers(config, device, parallel, causal_lm)
    backend, _, windows = attention_setup(causal_lm, config, device, num_tokens, longest.documents)
    if any(w is not None and w < num_tokens for w in windows):
        raise NotImplementedError(f"shared_context_backward does not support sliding-window layers shorter than a "
                                  f"row (windows {sorted({w for w in windows if w is not None})}, rows up to "
                                  f"{num_tokens} tokens): use forward_backward on each row")
    sparse = resolved_sparse(config, causal_lm)
    store = make_step_store(causal_lm, 1, num_tokens, config, device, sparse, host_slabs, parallel)
    if hasattr(store, "prefetch_across_chunks"):  # offload: the chunks do not run in the two-stage order
        store.prefetch_across_chunks = False
    decoder = causal_lm.get_decoder()
    lm_head = loss_head(causal_lm)
    kept_outputs = KeptOutputs() if config.performance.keep_attention_outputs else None
    trunk_documents = _split(context_documents)

    def run(chunk: ChunkSpan, stage: Stage, ids: torch.Tensor, documents: Documents | None,
            kept: KeptOutputs | None) -> torch.Tensor:
        if documents is None:
            positions = torch.arange(chunk.start, chunk.end, device=device)[None]
        else:
            positions = documents.positions[:, chunk.start:chunk.end]
        recompute_cache = {} if stage is Stage.GRAD and config.performance.checkpoint_layers else None
        out = decoder(input_ids=ids[:, chunk.start:chunk.end], position_ids=positions, use_cache=False,
                      oomb_step=StepState(store, chunk, stage, backend, recompute_cache, sparse, _split(documents),
                                          windows, {}, kept))
        return out.last_hidden_state

    rng_next = rng_state(device)  # where the next fresh stage-1 chunk continues the random stream

    def fill(chunks: list[ChunkSpan], ids: torch.Tensor, documents: Documents | None, kept: KeptOutputs | None,
             replay: list | None = None, on_hidden: Callable[[ChunkSpan, torch.Tensor], None] | None = None) -> list:
        """Stage 1 over ``chunks``; each chunk's RNG state is kept (``replay``: set again) so that every
        later pass draws the same dropout masks. Returns the states."""
        nonlocal rng_next
        states = []
        with torch.no_grad(), layer_checkpointing(decoder, False):
            for i, chunk in enumerate(chunks):
                states.append(replay[i] if replay is not None else rng_next)
                set_rng_state(device, states[-1])
                store.allocate(chunk)
                hidden = run(chunk, Stage.FILL, ids, documents, kept)
                store.finish_fill(chunk)
                if replay is None:
                    rng_next = rng_state(device)
                if on_hidden is not None:
                    on_hidden(chunk, hidden)
        return states

    def set_row(row: _Row) -> None:
        """Tell the store the row's history starts and document starts (trunk chunks' are the same in every row)."""
        set_history_starts(store, row.chunks, windows, {}, _split(row.documents))

    total_loss = torch.zeros((), dtype=torch.float32, device=device)
    try:
        with oomb_attention(causal_lm), compiled_layers(decoder, compile_layers), \
                step_gradient_sums(model, config, parallel) as sums:
            set_history_starts(store, trunk, windows, {}, trunk_documents)  # also the store's document starts
            trunk_states = fill(trunk, context, context_documents, kept_outputs)
            if loss_fn is not None or not backward:  # first pass: every row's log-probabilities, pages freed at once
                logprobs = []
                for row in rows:
                    set_row(row)
                    keep = _LogProbKeeper(row, lm_head, config.performance.loss_chunk_tokens)
                    with store.branch():
                        row.rng_states = fill(row.chunks, row.ids, row.documents, None, on_hidden=keep)
                        for chunk in row.chunks:
                            store.free(chunk)
                    logprobs.append(keep.by_position)
                gathered = _gather_logprobs(rows, logprobs)
                if not backward:
                    return gathered
                total_loss = _loss_weights(rows, gathered, loss_fn)
            for row in rows:
                set_row(row)
                with store.branch():
                    row.rng_states = fill(row.chunks, row.ids, row.documents, kept_outputs, row.rng_states)
                    with gradient_routing(model, config, parallel, compile_layers, sums=sums) as routing:
                        for chunk in reversed(row.chunks):
                            set_rng_state(device, row.rng_states[chunk.index - len(trunk)])
                            store.refill(chunk)
                            hidden = run(chunk, Stage.GRAD, row.ids, row.documents, kept_outputs)
                            targets = row.targets[:, chunk.start:chunk.end]
                            if loss_fn is None:
                                loss = chunked_cross_entropy(hidden, targets, lm_head, num_targets,
                                                             config.performance.loss_chunk_tokens,
                                                             config.performance.recompute_logits,
                                                             weight_gradient_now=True)
                                total_loss += loss.detach()
                            else:
                                loss = _weighted_logprob_sum(hidden, targets, row.weights[:, chunk.start:chunk.end],
                                                             lm_head, config.performance.loss_chunk_tokens)
                            routing.backward(loss, hidden)
                            store.free(chunk)
            # The trunk's labels belong to every row: their loss counts once per continuation.
            set_history_starts(store, trunk, windows, {}, trunk_documents)
            with gradient_routing(model, config, parallel, compile_layers, sums=sums) as routing:
                for chunk in reversed(trunk):
                    set_rng_state(device, trunk_states[chunk.index])
                    store.refill(chunk)
                    hidden = run(chunk, Stage.GRAD, context, context_documents, kept_outputs)
                    loss = hidden.new_zeros((), dtype=torch.float32)  # loss_fn: no context label
                    if loss_fn is None:
                        slice_tokens = config.performance.loss_chunk_tokens
                        counted = slices_with_labels(trunk_targets_on_host[:, chunk.start:chunk.end], slice_tokens)
                        loss = chunked_cross_entropy(hidden, trunk_targets[:, chunk.start:chunk.end], lm_head,
                                                     num_targets / len(rows), slice_tokens,
                                                     config.performance.recompute_logits, weight_gradient_now=True,
                                                     counted_slices=counted)
                        total_loss += loss.detach()
                    routing.backward(loss, hidden)
                    store.free(chunk)
    finally:
        if kept_outputs is not None:
            kept_outputs.clear()
        set_rng_state(device, rng_next)
        store.free_all()
    assert store.is_empty, "page store not empty after the step"
    return total_loss


def _refuse_unsupported(model, causal_lm, parallel: ParallelSetup | None, loss_fn, context_labels) -> None:
    """What a shared-context step cannot do, refused before any allocation."""
    if parallel is not None or any(isinstance(p, DTensor) for p in model.parameters()):
        raise NotImplementedError("shared_context_backward runs on one process: tensor, data and context "
                                  "parallelism are not supported (call forward_backward on each row instead)")
    if RouterBalanceLoss.of(causal_lm) is not None:
        raise NotImplementedError("shared_context_backward does not add a MoE load-balancing loss "
                                  "(output_router_logits=True): turn it off in the model config")
    if loss_fn is not None and context_labels is not None:
        raise ValueError("context_labels is for the default cross-entropy loss; a loss_fn sees only the "
                         "continuations' log-probabilities")


def _validated_context(causal_lm, context_ids: torch.Tensor, context_labels: torch.Tensor | None,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, T) context ids and (1, T) context labels (unshifted; all -100 without context labels)."""
    if isinstance(context_ids, torch.Tensor) and context_ids.dim() == 2 and context_ids.shape[0] != 1:
        raise NotImplementedError(f"one context a call: context_ids has {context_ids.shape[0]} rows; call "
                                  "shared_context_backward once per context")
    context, labels = validated_inputs(causal_lm, context_ids, context_labels, device)
    if context_labels is None:
        labels = torch.full_like(context, IGNORE_INDEX)
    return context, labels


def _make_rows(causal_lm, context: torch.Tensor, context_labels: torch.Tensor, documents: Documents | None,
               continuations: Sequence[torch.Tensor], labels, chunk_size: int, trunk_chunks: int,
               device: torch.device) -> list[_Row]:
    if isinstance(continuations, torch.Tensor) or len(continuations) == 0:
        raise ValueError("continuations must be a non-empty list of 1-D token tensors")
    if labels is not None and len(labels) != len(continuations):
        raise ValueError(f"labels has {len(labels)} entries for {len(continuations)} continuations")
    num_context = context.shape[1]
    rows = []
    for i, continuation in enumerate(continuations):
        if not isinstance(continuation, torch.Tensor) or continuation.numel() == 0 or \
                continuation.dim() > 2 or (continuation.dim() == 2 and continuation.shape[0] != 1):
            raise ValueError(f"continuation {i} must be a non-empty (n,) or (1, n) token tensor")
        ids, own_labels = validated_inputs(causal_lm, continuation.reshape(-1),
                                            None if labels is None else labels[i], device)
        row_ids = torch.cat([context, ids], dim=1)
        row_documents = None
        if documents is not None:  # the continuation continues the context's last document
            after = documents.positions[:, -1:] + 1 + torch.arange(ids.shape[1], device=device)
            row_documents = resolve_documents(torch.cat([documents.positions, after], 1), None,
                                              tuple(row_ids.shape), device)
        row_labels = torch.cat([context_labels, own_labels], dim=1)
        if row_documents is not None:  # no document's first token is predicted from the one before
            row_labels = row_documents.mask_labels(row_labels)
        targets = shift_labels(row_labels)
        chunks = split_into_chunks(row_ids.shape[1], chunk_size)[trunk_chunks:]
        rows.append(_Row(row_ids, targets, row_documents, chunks, num_context - 1, ids.shape[1]))
    return rows


def _split(documents: Documents | None) -> Documents | None:
    """The documents attention must respect: None unless some row holds several."""
    return documents if documents is not None and documents.split else None


class _LogProbKeeper:
    """Stage 1's ``on_hidden`` in the first pass: each position's log p(target), float32 (4 bytes a token)."""

    def __init__(self, row: _Row, lm_head: torch.nn.Module, slice_tokens: int) -> None:
        self.row, self.lm_head, self.slice_tokens = row, lm_head, slice_tokens
        self.by_position = torch.zeros(row.targets.shape, dtype=torch.float32, device=row.targets.device)

    def __call__(self, chunk: ChunkSpan, hidden: torch.Tensor) -> None:
        targets = self.row.targets[:, chunk.start:chunk.end]
        self.by_position[:, chunk.start:chunk.end] = _token_logprobs(hidden, targets, self.lm_head, self.slice_tokens)


def _gather_logprobs(rows: list[_Row], logprobs: list[torch.Tensor]) -> ContinuationLogProbs:
    """The continuations' labels' log-probabilities out of each row's (1, T_i) by target position."""
    longest = max(row.num_labels for row in rows)
    device = logprobs[0].device
    tokens = torch.zeros((len(rows), longest), dtype=torch.float32, device=device)
    mask = torch.zeros((len(rows), longest), dtype=torch.bool, device=device)
    for i, (row, by_position) in enumerate(zip(rows, logprobs, strict=True)):
        own = slice(row.labels_at, row.labels_at + row.num_labels)
        tokens[i, :row.num_labels] = by_position[0, own]
        mask[i, :row.num_labels] = row.targets[0, own] != IGNORE_INDEX
    return ContinuationLogProbs(tokens, mask)


def _loss_weights(rows: list[_Row], logprobs: ContinuationLogProbs, loss_fn: LossFn) -> torch.Tensor:
    """Evaluate ``loss_fn`` on the log-probabilities and set each row's per-position weights dL/dlogp.
    Returns the detached loss."""
    tokens = logprobs.tokens.detach().requires_grad_(True)
    mask = logprobs.mask
    with torch.enable_grad():
        loss = loss_fn(ContinuationLogProbs(tokens, mask))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} "
                             f"{tuple(getattr(loss, 'shape', ()))}")
        (weights,) = torch.autograd.grad(loss.reshape(()), tokens, allow_unused=True)
    weights = torch.zeros_like(tokens) if weights is None else weights * mask
    for i, row in enumerate(rows):
        row.weights = torch.zeros(row.targets.shape, dtype=torch.float32, device=tokens.device)
        row.weights[0, row.labels_at:row.labels_at + row.num_labels] = weights[i, :row.num_labels]
    return loss.detach().float().reshape(())


def dpo_sigmoid_loss(logprobs: ContinuationLogProbs, reference: torch.Tensor, beta: float = 0.1) -> torch.Tensor:
    """DPO's sigmoid loss as TRL's DPOTrainer computes it (loss_type="sigmoid"):
    mean over pairs of -logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected))), on summed
    log-probabilities. Continuations in TRL's concatenated order: the P chosen, then their P rejected.
    ``reference``: (2P,) the same continuations' summed log-probabilities under the reference model
    (``shared_context_logprobs(reference_model, ...).sums``)."""
    chosen, rejected = logprobs.sums.chunk(2)
    reference_chosen, reference_rejected = reference.to(chosen.dtype).chunk(2)
    margin = (chosen - reference_chosen) - (rejected - reference_rejected)
    return -torch.nn.functional.logsigmoid(beta * margin).mean()


def grpo_loss(logprobs: ContinuationLogProbs, advantages: torch.Tensor, *, old: torch.Tensor | None = None,
              reference: torch.Tensor | None = None, beta: float = 0.0, epsilon_low: float = 0.2,
              epsilon_high: float = 0.2) -> torch.Tensor:
    """GRPO's loss as TRL's GRPOTrainer computes it (loss_type="grpo", token-level importance sampling): per
    token -min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A) + beta KL, r = exp(logp - old), KL =
    exp(ref - logp) - (ref - logp) - 1; each continuation's masked token mean, then the mean over
    continuations. ``advantages``: (K,); ``old``, ``reference``: (K, max_len) per-token log-probabilities
    (``shared_context_logprobs(...).tokens``; old None: this policy's own, detached, as TRL with one
    iteration per generation)."""
    tokens, mask = logprobs.tokens, logprobs.mask
    old = tokens.detach() if old is None else old
    ratio = torch.exp(tokens - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    advantages = advantages[:, None]
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    if beta != 0.0:
        if reference is None:
            raise ValueError("grpo_loss with beta != 0 needs the reference model's per-token log-probabilities")
        per_token = per_token + beta * (torch.exp(reference - tokens) - (reference - tokens) - 1)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def _slice_logprobs(hidden: torch.Tensor, targets: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
    """(B, S) float32 log p(target) at each position (0 where the target is -100), through ``lm_head``."""
    logits = lm_head(hidden)
    factor = gradient_scale(lm_head)
    if factor != 1.0 and torch.is_grad_enabled():
        logits = ScaledGradient.apply(logits, factor)
    log_probs = logits.float().log_softmax(-1)
    picked = log_probs.gather(-1, targets.clamp_min(0)[..., None])[..., 0]
    return picked.masked_fill(targets == IGNORE_INDEX, 0.0)


def _token_logprobs(hidden: torch.Tensor, targets: torch.Tensor, lm_head: torch.nn.Module,
                    slice_tokens: int) -> torch.Tensor:
    """Stage 1: (B, L) log-probabilities of the counted targets, ``slice_tokens`` positions of logits at a time."""
    out = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
    for start in range(0, targets.shape[1], slice_tokens):
        part = slice(start, start + slice_tokens)
        if bool((targets[:, part] != IGNORE_INDEX).any()):
            out[:, part] = _slice_logprobs(hidden[:, part], targets[:, part], lm_head)
    return out


def _weighted_slice(hidden: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                    lm_head: torch.nn.Module) -> torch.Tensor:
    return (_slice_logprobs(hidden, targets, lm_head) * weights).sum()


def _weighted_logprob_sum(hidden: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                          lm_head: torch.nn.Module, slice_tokens: int) -> torch.Tensor:
    """Stage 2 under ``loss_fn``: sum_t weights_t * log p(target_t), whose gradient is the loss's through these
    positions; each slice's logits are recomputed in backward (checkpointed), so one slice's exist at a time."""
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.shape[1], slice_tokens):
        part = slice(start, start + slice_tokens)
        if bool((weights[:, part] != 0).any()):
            total = total + checkpoint(_weighted_slice, hidden[:, part], targets[:, part], weights[:, part], lm_head,
                                       use_reentrant=False)
    return total
