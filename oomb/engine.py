"""The two-stage chunk-recurrent training step (docs/design.md, "Data flow"), top to bottom.

    stage 1, no grad, chunks 0..N-1:  run chunk c at positions [cC, cC+len); every layer writes
                                       its k, v into the chunk's new pages and attends to all pages
                                       so far. Nothing else is kept.
    stage 2, grad, chunks N-1..0:     recompute chunk c with grad; its attention reads the pages and,
                                       in backward, adds dK/dV into the page gradient buffers and hands
                                       the chunk its own accumulated dK/dV. loss_c.backward() then
                                       accumulates parameter gradients; the chunk's pages are freed.

The sum over chunks of these backward passes is the exact gradient of the full-sequence loss
(mean token cross-entropy over all label positions of the whole batch).

Packed documents (position_ids restarting at 0, or cu_seqlens; oomb/documents.py): boundaries are
found once for the whole sequence, each chunk runs at its documents' own RoPE positions, attention
stays inside each document (history pages before every row's document start are skipped), and the
label of each document's first token is -100, as in Hugging Face's padding-free training.

Sparse mode (config.attention="sparse", docs/sparse.md) changes only what attention reads: in
stage 1 every layer also summarises the chunk's pages and selects, per query block, the history
pages it reads; stage 2 reuses that selection. The gradients are the exact gradients of that
sparse model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from .attention.backend import AttentionBackend, select_backend
from .attention.context_sparse import share_backend
from .attention.function import KeptOutputs
from .attention.variants import check_backend_supports
from .compiled_layers import compiled_layers, layer_inputs_requiring_grad, resolve_compile_layers
from .config import OOMBConfig, SparseConfig
from .documents import Documents, resolve_documents
from .fp32_linear import float32_weight_gradients, in_place_weight_gradients
from .grads import Fp32GradAccumulator
from .kv import ChunkSpan, PagedKVStore, split_into_chunks
from .kv.capacity import PageShape, check_pages_fit
from .kv.offload import HostSlabs, OffloadedKVStore
from .loss import IGNORE_INDEX, ScaledGradient, chunked_cross_entropy, gradient_scale, shift_labels, slices_with_labels
from .machine import gpu_free_bytes, host_available_bytes
from .models import (
    Stage,
    StepState,
    attention_variants,
    history_start,
    layer_checkpointing,
    layer_windows,
    loss_head,
    oomb_attention,
    resolved_sparse,
    step_window_bounds,
    unwrap_causal_lm,
)
from .moe import ROUTER_LOSS_FACTOR, RouterBalanceLoss
from .parallel import ParallelSetup, check_setup
from .sparse import page_summaries

logger = logging.getLogger(__name__)


def forward_backward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    config: OOMBConfig | None = None,
    *,
    progress: bool | Callable[[int, int], None] = False,
    grad_targets: Mapping[torch.nn.Parameter, torch.Tensor] | None = None,
    host_slabs: HostSlabs | None = None,
    parallel: ParallelSetup | None = None,
    sync_gradients: bool = True,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | list | None = None,
) -> torch.Tensor:
    """One training step's forward and backward over a long sequence, chunk by chunk.

    Leaves in every parameter's ``.grad`` (accumulating, like ``.backward()``) what
    ``model(input_ids=input_ids, labels=labels).loss.backward()`` would: labels unshifted,
    -100 ignored, mean over counted tokens; labels default to input_ids.

    Args:
        model: a supported transformers *ForCausalLM, optionally PEFT-wrapped.
        input_ids: (B, T) or (T,) token ids.
        labels: same shape as input_ids, or None.
        config: options; defaults to OOMBConfig().
        progress: True: a progress bar over the chunks of both stages. A callable: called as
            ``progress(done, total)`` after each chunk of either stage (the first ``total // 2`` are stage 1's),
            so that a caller's own bar can show where a step of minutes is.
        grad_targets: parameter -> fp32 tensor of its shape; the step's gradient of such a parameter
            is added into the tensor chunk by chunk (the sum is never rounded) instead of into ``.grad``.
            A trainer with fp32 master weights passes the masters' gradient buffers.
        host_slabs: with ``config.offload.enabled``, the pinned host memory to keep the pages in; pass the
            same object every step to reuse it (pinning tens of GiB takes seconds). None: a new one.
        parallel: the ``oomb.parallel.setup_parallel`` result of a tensor/data/context-parallel model (each
            rank calls this with its own sequences; the gradients are reduced over data-parallel ranks
            once, in the last chunk's backward). Not with grad_targets under data parallel: FSDP sums
            the chunks' gradients in fp32 itself. Context-parallel ranks pass the same sequences and each
            holds the pages of every cp-th chunk (oomb/context_parallel.py).
        sync_gradients: data parallel: reduce the gradients over ranks in this step's last backward
            (True), or keep summing them locally for a later step that syncs (gradient accumulation).
        position_ids: (B, T) or (T,) packed documents as HF's padding-free collators give them: positions
            restart at 0 at each document (a row may begin inside one). Attention then stays inside each
            document, RoPE uses these positions, and the label of every document's first token counts
            as -100 (no token is predicted from the previous document), so the loss is the mean over
            the remaining label positions of all documents. None: one document per row at 0..T-1.
        cu_seqlens: the same boundaries as cumulative lengths [0, l1, l1 + l2, ..., T]: one 1-D sequence
            (batch 1) or one per row; positions then restart at each boundary. With position_ids too,
            both must agree.
    Returns:
        The detached full-sequence loss (float32 scalar).
    """
    config = config or OOMBConfig()
    causal_lm = unwrap_causal_lm(model)
    parallel = check_setup(model, parallel, grad_targets, config)
    device = causal_lm.get_input_embeddings().weight.device
    input_ids, labels = validated_inputs(causal_lm, input_ids, labels, device)
    compile_layers = resolve_compile_layers(config, device, parallel, causal_lm)  # may refuse: before any page
    batch, num_tokens = input_ids.shape
    documents = resolve_documents(position_ids, cu_seqlens, (batch, num_tokens), device)
    if documents is not None:
        labels = documents.mask_labels(labels)
    targets = shift_labels(labels)
    targets_on_host = targets.cpu()  # one read from the device a step: each chunk's loss slices come from it
    num_targets = int((targets_on_host != IGNORE_INDEX).sum())
    if num_targets == 0:
        raise ValueError("labels have no counted position (all -100 after shifting): the loss is undefined")
    chunks = split_into_chunks(num_tokens, config.chunk_size)
    sparse = resolved_sparse(config, causal_lm)  # None in dense mode
    context_parallel = parallel.context_shard(config.chunk_size) is not None  # cp > 1, or a group of one
    if config.performance.keep_attention_outputs and context_parallel:  # before any page is allocated
        raise ValueError("keep_attention_outputs=True is not supported with context parallelism")
    backend, split_documents, windows = attention_setup(causal_lm, config, device, num_tokens, documents,
                                                        context_parallel=context_parallel)
    store = make_step_store(causal_lm, batch, num_tokens, config, device, sparse, host_slabs, parallel)
    bounds = step_window_bounds(windows, split_documents, (batch, num_tokens), device)
    set_history_starts(store, chunks, windows, bounds, split_documents)
    decoder = causal_lm.get_decoder()
    lm_head = loss_head(causal_lm)
    bar = tqdm(total=2 * len(chunks), desc="oomb step", unit="chunk", disable=progress is not True, leave=False)
    done_chunks = 0

    def chunk_done() -> None:
        nonlocal done_chunks
        done_chunks += 1
        bar.update()
        if callable(progress):
            progress(done_chunks, 2 * len(chunks))

    # OOMBConfig.performance.keep_attention_outputs: stage 1's (out, lse) per (layer, chunk index), taken by stage 2
    kept_outputs = KeptOutputs() if config.performance.keep_attention_outputs else None
    router_loss = RouterBalanceLoss.of(causal_lm)  # MoE with output_router_logits: HF adds it to the loss
    router_kwargs = {} if router_loss is None else {"output_router_logits": True}

    def run_chunk(chunk: ChunkSpan, stage: Stage):
        if documents is None:
            positions = torch.arange(chunk.start, chunk.end, device=device).expand(batch, -1)
        else:
            positions = documents.positions[:, chunk.start:chunk.end]
        recompute_cache = {} if stage is Stage.GRAD and config.performance.checkpoint_layers else None
        out = parallel.decoder_entry(decoder)(
            input_ids=input_ids[:, chunk.start:chunk.end],
            position_ids=positions,
            use_cache=False,
            oomb_step=StepState(store, chunk, stage, backend, recompute_cache, sparse, split_documents, windows,
                                bounds, kept_outputs),
            **router_kwargs,
        )
        return out.last_hidden_state, getattr(out, "router_logits", None)

    total_loss = torch.zeros((), dtype=torch.float32, device=device)
    rng_after_step = rng_state(device)  # replaced once stage 1 has drawn its random numbers
    try:
        with oomb_attention(causal_lm), compiled_layers(decoder, compile_layers):
            # Stage 1: fill the pages. Each chunk's RNG state is kept so that stage 2 replays the
            # same dropout masks (e.g. LoRA dropout) and recomputes exactly what stage 1 stored.
            rng_states = []
            with torch.no_grad(), layer_checkpointing(decoder, False):
                for chunk in chunks:
                    rng_states.append(rng_state(device))
                    store.allocate(chunk)
                    _, router_logits = run_chunk(chunk, Stage.FILL)
                    store.finish_fill(chunk)  # window layers: free the pages no later chunk reads
                    if router_loss is not None:  # the counts of every chunk, before any chunk's loss
                        router_loss.observe(router_logits)
                    chunk_done()
            rng_after_step = rng_state(device)

            # Stage 2: recompute in reverse with grad; attention backward feeds the page gradients.
            with gradient_routing(model, config, parallel, compile_layers, grad_targets) as routing:
                for chunk in reversed(chunks):
                    # Reduce once, in the last backward (of the last step of an accumulation).
                    parallel.set_gradient_sync(model, sync_gradients and chunk.index == 0)
                    set_rng_state(device, rng_states[chunk.index])
                    store.refill(chunk)  # window layers: pages for the recomputed k, v (kv/store.py)
                    hidden, router_logits = run_chunk(chunk, Stage.GRAD)
                    # The loss's own backward follows at once, unscaled: a trained head's weight gradient can be
                    # made in its forward (nothing of the vocabulary's size kept or recomputed).
                    slice_tokens = config.performance.loss_chunk_tokens
                    loss = chunked_cross_entropy(
                        hidden, targets[:, chunk.start:chunk.end], lm_head, num_targets, slice_tokens,
                        config.performance.recompute_logits, weight_gradient_now=True,
                        counted_slices=slices_with_labels(targets_on_host[:, chunk.start:chunk.end], slice_tokens),
                    )
                    if router_loss is not None:
                        loss = loss + _router_term(router_loss.chunk_loss(router_logits), causal_lm, lm_head)
                    routing.backward(loss, hidden)
                    store.free(chunk)
                    total_loss += loss.detach()
                    chunk_done()
    finally:
        if kept_outputs is not None:
            kept_outputs.clear()  # after an error, stage 1's outputs stage 2 did not reach
        set_rng_state(device, rng_after_step)
        bar.close()
        store.free_all()
        parallel.set_gradient_sync(model, True)
        parallel.finish_step(model)
    assert store.is_empty, "page store not empty after the step"
    return total_loss


class GradientRouting:
    """Stage 2's gradient routing, entered once around the reverse pass (``gradient_routing``): the backward
    of one chunk's loss with its parameter gradients collected."""

    def __init__(self, accumulator: Fp32GradAccumulator) -> None:
        self.accumulator = accumulator

    def backward(self, loss: torch.Tensor, hidden: torch.Tensor) -> None:
        """``loss.backward()`` of one chunk (or, when the chunk has no counted label, a backward that still
        pushes later chunks' page gradients through it), then its parameter gradients collected."""
        if loss.requires_grad:  # False when the chunk has no counted label
            loss.backward()
        else:
            # Still push the page gradients of later chunks through this chunk.
            _backward_without_loss(hidden)
        self.accumulator.collect()


@contextmanager
def step_gradient_sums(model: torch.nn.Module, config: OOMBConfig, parallel: ParallelSetup,
                       grad_targets: Mapping[torch.nn.Parameter, torch.Tensor] | None = None,
                       ) -> Iterator[Fp32GradAccumulator]:
    """The step's float32 gradient sums (``precision.fp32_grad_accumulation``), written into ``.grad`` (or
    ``grad_targets``) once on a normal exit and dropped on an error. A step whose backward passes are not one
    reverse pass (shared_context.py: one per row, then the trunk) routes them all into these sums, so the
    gradients are rounded once and no low-precision ``.grad`` is held next to the sums in between."""
    params = [] if parallel.fsdp else model.parameters()
    accumulator = Fp32GradAccumulator(params, config.precision.fp32_grad_accumulation, grad_targets)
    finished = False
    try:
        yield accumulator
        accumulator.finish()
        finished = True
    finally:
        if not finished:
            accumulator.abort()


@contextmanager
def gradient_routing(model: torch.nn.Module, config: OOMBConfig, parallel: ParallelSetup, compile_layers,
                     grad_targets: Mapping[torch.nn.Parameter, torch.Tensor] | None = None, *,
                     sums: Fp32GradAccumulator | None = None) -> Iterator[GradientRouting]:
    """Where stage 2's chunk backward passes put the parameter gradients. Without float32 sums, linear
    weights' chunk gradients go into .grad by their GEMMs (fp32_linear.py): the head's always, the decoder's
    where layers run eager (a routed linear breaks a compiled graph); compiled layers' weight gradients are
    added by autograd, and their inputs require grad (compiled_layers.layer_inputs_requiring_grad). Under FSDP
    the chunks' gradients
    are summed (in fp32) by FSDP until the last backward. Layer checkpointing and the tensor-parallel loss
    context are entered here too. ``sums``: the step's step_gradient_sums, for a step that routes several
    reverse passes; by default the routing owns them (written out on a normal exit, dropped on an error)."""
    if sums is None:
        with step_gradient_sums(model, config, parallel, grad_targets) as own, \
                gradient_routing(model, config, parallel, compile_layers, sums=own) as routing:
            yield routing
        return
    causal_lm = unwrap_causal_lm(model)
    decoder = causal_lm.get_decoder()
    in_place = parallel.tp == 1 and not parallel.fsdp
    with layer_checkpointing(decoder, config.performance.checkpoint_layers, compile_layers), parallel.loss_context(), \
            float32_weight_gradients(model, sums, enabled=parallel.tp == 1), \
            in_place_weight_gradients(loss_head(causal_lm) if compile_layers else model, sums,
                                      enabled=in_place), \
            layer_inputs_requiring_grad(causal_lm, compile_layers):
        yield GradientRouting(sums)


def _router_term(term: torch.Tensor, causal_lm, lm_head) -> torch.Tensor:
    """The chunk's load-balancing term as the step's loss takes it: times the model's ROUTER_LOSS_FACTOR
    (value and gradient), its gradient also times the head's GRADIENT_SCALE (every gradient of the loss)."""
    term = term * getattr(causal_lm, ROUTER_LOSS_FACTOR, 1.0)
    factor = gradient_scale(lm_head)
    return ScaledGradient.apply(term, factor) if factor != 1.0 else term


def attention_setup(causal_lm, config: OOMBConfig, device: torch.device, num_tokens: int,
                    documents: Documents | None, *, context_parallel: bool = False,
                    ) -> tuple[AttentionBackend, Documents | None, tuple[int | None, ...]]:
    """The step's attention backend, the documents attention must respect (None: plain causal) and
    each layer's sliding window (None: global); refuses, before any allocation, what the backend or
    the mode cannot compute. ``context_parallel`` sparse: the sparse calls read one rank's share of
    the selected keys (attention/context_sparse.py), the dense ones keep the backend's kernels."""
    windows = layer_windows(causal_lm)
    binding_windows = any(w is not None and w < num_tokens for w in windows)
    split_documents = None if documents is None or not documents.split else documents
    # cudnn's sparse documents rest on every block reading its document's first page (attention/cudnn_sparse.py)
    unsinked = config.attention == "sparse" and config.sparse.sink_pages == 0
    backend = _select_step_backend(causal_lm, config, device,
                                   split_documents is not None and (binding_windows or unsinked))
    softcap, sinks = attention_variants(causal_lm)
    check_backend_supports(backend.name, softcap=softcap, sinks=sinks, windows=binding_windows,
                           family=causal_lm.config.model_type, sparse=config.attention == "sparse",
                           documents=split_documents is not None)
    if backend.name == "cudnn" and split_documents is not None and unsinked:
        raise NotImplementedError("packed documents in sparse mode with sparse.sink_pages=0 are not supported by the "
                                  "cudnn backend (it reads each document's first page as its sink): set "
                                  "sparse.sink_pages >= 1, or backend='auto' or 'triton'")
    if context_parallel and config.attention == "sparse":
        backend = share_backend(backend)
    return backend, split_documents, windows


def set_history_starts(store: PagedKVStore, chunks: list[ChunkSpan], windows: tuple[int | None, ...],
                       bounds: Mapping[int, Documents], documents: Documents | None) -> None:
    """Tell the store, per chunk, the first history page any layer reads (documents, or windows when
    every layer slides): earlier pages are neither read nor staged. With documents the store also
    keeps each token's document start, for sparse offload to skip the selected pages no query sees."""
    store.document_starts = None if documents is None else documents.start_cpu
    window_layers = getattr(store, "window_layers", ())
    local = tuple(w for i, w in enumerate(windows) if i in window_layers)
    for chunk in chunks:
        first = history_start(chunk, windows, bounds, documents, store.page_size)
        if first:
            store.history_starts[chunk.index] = first
        if local:  # window layers with their own pages read (and keep) only their windows' pages
            store.window_history_starts[chunk.index] = history_start(chunk, local, bounds, documents,
                                                                     store.page_size)


def _select_step_backend(causal_lm, config: OOMBConfig, device: torch.device, not_on_cudnn: bool):
    """The step's attention backend. "auto": cudnn for bf16/fp16 on CUDA (the measured fast path; packed
    documents run there as per-document segments, dense and sparse), torch for float32, triton when
    deterministic; logit softcapping (Gemma 2), which cuDNN's fused attention does not have, and the
    packed documents it cannot run (``not_on_cudnn``: sliding windows inside them, which are neither
    segments nor a band; sparse mode without sink pages) stay on triton for bf16/fp16. Sliding windows
    alone and attention sinks go to cudnn like other models (its band path: attention/cudnn_band.py)."""
    softcap = attention_variants(causal_lm)[0]
    weights_dtype = causal_lm.get_input_embeddings().weight.dtype
    if (softcap or not_on_cudnn) and weights_dtype != torch.float32:
        weights_dtype = None  # "auto" on CUDA without a dtype: triton
    return select_backend(config.performance.backend, device, dtype=weights_dtype,
                          deterministic=config.precision.deterministic)


def _backward_without_loss(hidden: torch.Tensor) -> None:
    """Backward through a chunk whose own loss is zero: its K/V still carry later chunks' gradients."""
    if hidden.requires_grad:
        (hidden * 0).sum().backward()


def validated_inputs(
    causal_lm, input_ids: torch.Tensor, labels: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) as a step takes them: checked, batched, on ``device``; labels default to the ids."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
        labels = labels[None] if isinstance(labels, torch.Tensor) and labels.dim() == 1 else labels
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (batch, tokens), got {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}): nothing to train on")
    vocab = causal_lm.get_input_embeddings().num_embeddings
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"input_ids must lie in [0, {vocab}) (the model's vocabulary), found [{low}, {high}]")
    if labels is None:
        labels = input_ids
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor or None, got {type(labels).__name__}")
    if labels.shape != input_ids.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} differs from input_ids shape {tuple(input_ids.shape)}"
        )
    counted = labels[labels != IGNORE_INDEX]
    if counted.numel() and (int(counted.min()) < 0 or int(counted.max()) >= vocab):
        raise ValueError(f"labels must be -100 or lie in [0, {vocab}), found [{int(counted.min())}, "
                         f"{int(counted.max())}]")
    return input_ids.to(device=device, dtype=torch.long), labels.to(device=device, dtype=torch.long)


def make_step_store(
    causal_lm, batch: int, num_tokens: int, config: OOMBConfig, device, sparse: SparseConfig | None,
    host_slabs: HostSlabs | None = None,
    parallel: ParallelSetup | None = None,
) -> PagedKVStore:
    """The step's page store: on the GPU, or with offload in ``host_slabs``; checked to fit before allocating."""
    options = store_options(causal_lm, batch, num_tokens, config, device, sparse, parallel)
    context = options["context"]
    own_tokens = num_tokens if context is None else context.owned_pages(num_tokens, config.page_size) * config.page_size
    windows = window_store_options(causal_lm, num_tokens, context)
    shape = PageShape(options["num_layers"], batch, own_tokens, options["num_kv_heads"], options["head_dim"],
                      options["kv_dtype"], windows.get("window_layers", ()), windows.get("window", 0))
    _check_pages(shape, config, device, host_slabs)
    if not config.offload.enabled:
        return PagedKVStore(**options, **windows, chunk_size=config.chunk_size)
    store = OffloadedKVStore(slabs=host_slabs if host_slabs is not None else HostSlabs(),
                             resident_layers=config.offload.resident_layers,
                             stream_buffers=config.offload.stream_buffers,
                             chunk_size=config.chunk_size, **options, **windows)
    store.document_sinks = sparse is not None and sparse.sink_pages >= 1
    return store


def store_options(causal_lm, batch: int, num_tokens: int, config: OOMBConfig, device,
                  sparse: SparseConfig | None = None, parallel: ParallelSetup | None = None) -> dict:
    """The PagedKVStore arguments of a step of ``causal_lm`` (also used to reserve host slabs ahead)."""
    cfg = causal_lm.config
    parallel = parallel or ParallelSetup()
    return dict(
        num_layers=cfg.num_hidden_layers,
        batch_size=batch,
        num_tokens=num_tokens,
        num_kv_heads=parallel.local_kv_heads(cfg.num_key_value_heads),  # tensor parallel: this rank's heads
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        page_size=config.page_size,
        kv_dtype=causal_lm.get_input_embeddings().weight.dtype,
        grad_dtype=config.precision.grad_dtype,
        device=device,
        summaries=page_summaries(sparse) if sparse is not None else (),
        stream_block_pages=config.offload.stream_block_pages,
        context=parallel.context_shard(config.chunk_size),  # context parallel: this rank's chunks only
    )


def window_store_options(causal_lm, num_tokens: int, context=None) -> dict:
    """The window layers of the store (kv/store.py): every layer whose sliding window is shorter than
    the step, without context parallelism. Without offload they get their own, bounded GPU pages; with
    offload, bounded host slots (kv/window_slots.py), and they stage only their windows' pages."""
    windows = layer_windows(causal_lm)
    local = tuple(i for i, w in enumerate(windows) if w is not None and w < num_tokens)
    if not local or context is not None:
        return {}
    return dict(window_layers=local, window=max(windows[i] for i in local))


def _check_pages(shape: PageShape, config: OOMBConfig, device: torch.device, host_slabs: HostSlabs | None) -> None:
    """Stop before allocating when the pages cannot fit (CUDA only: on CPU the pools are host RAM
    the operating system may page out)."""
    if device.type != "cuda":
        return
    host_free = host_available_bytes() if config.offload.enabled else None
    held = host_slabs.nbytes if host_slabs is not None else 0  # slabs kept from earlier steps are reused
    check_pages_fit(shape, config, gpu_free_bytes(device), host_free, host_held=held)


def rng_state(device: torch.device) -> tuple:
    """The CPU and (on CUDA) device random states: stage 2 replays each chunk's stage-1 dropout masks."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_state(device: torch.device, state: tuple) -> None:
    """Restore a state taken by rng_state."""
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
