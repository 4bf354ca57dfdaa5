"""Sparse attention's page selection: which earlier pages each query block of a chunk reads.

A chunk of Lq queries starting at page c0 is cut into query blocks of one page (P queries; the
last may be shorter). Per (sequence, KV head, block) the selection is a sorted list of *history*
pages (page-table positions < c0)::

    history pages 0 .. c0-1                                    the chunk's own pages c0 ..
    | sink | sink |  .  | top | . | top |  .  .  | top |  .  | own pages: always read, causal |
      '-- sink_pages --'   '--- budget pages with the best score ---'

* sinks: the first ``sink_pages`` pages, always read (attention sinks);
* top-k: the ``budget`` other history pages with the highest score of the block against the
  pages' summaries (oomb/kv/summaries.py), per KV head ("kv_head") or one choice for all heads
  ("shared", the best score of any head);
* the chunk's own pages are not part of the selection: every block reads them, causally;
* ``query_block_pages = g > 1``: g consecutive blocks share one selection (the best score of any
  of them; leak-free: their first block's), so a chunk selects fewer distinct pages (what host
  offload moves) for the same compute.

Scores (not differentiated; float32 results, from float32 matmuls or, for bf16/fp16 queries on a
GPU, from tensor cores with exact products and float32 sums):

* "minmax" (Quest): for a query row q and a page with elementwise key bounds [min_d, max_d],
  ``sum_d max(q_d min_d, q_d max_d)`` is an upper bound of q . k over the page's keys. It is
  computed as two matmuls: ``relu(q) . max + min(q, 0) . min``.
* "mean": q . mean key.
* "exact" (the oracle, a diagnostic): each query row's true attention probability on the page's keys,
  normalised over every key the row sees (history and its own chunk, causally). It reads every
  history key (oomb/attention/triton_scores.py on a GPU), costing more than a dense attention forward:
  what a summary score approximates, for `oomb gradcheck` to separate scoring error from budget error.
* "rerank" (the default, via "auto"): minmax picks rerank_factor x budget candidate pages per block
  (per group of query_block_pages blocks), then the exact probabilities over the candidates only
  (normalised over their keys and the chunk's) pick the budget: the oracle's rule at a cost that no
  longer grows with the history (docs/sparse.md, "Score: rerank").

A block's score for a page combines the block's rows (its queries x the G query heads of the KV
head): "max" pooling keeps a page if any row's score is high; "softmax" pooling sums each row's
softmax over the history pages (an estimate of the block's attention mass there, as InfLLM-v2 pools
over a GQA group); "softmax_max" keeps the largest estimated *probability* any row puts on the page:
each row's scaled scores are normalised by their log-sum-exp over the history pages and the chunk's
own pages the row can see, so a row with large logits everywhere no longer outvotes the rows that
concentrate on a few pages (with the exact score, this per-row normalisation and the max over rows
are what met the near-dense target on a real model: docs/real_model.md). ``leak_free`` scores a
block with the queries of the block before it and its own first query (the previous chunk's last
page for a chunk's first block), all at or before the block's first token, so that no query changes
which pages an earlier query of its block reads.

When the sinks plus the budget cover every history page there is nothing to choose: the selection
is ``None`` and the chunk runs the dense code path (so a large budget is dense attention, bit for bit).

Packed documents (oomb/documents.py): a block chooses only among the pages of its first query's
document (pages wholly before that document's first page are invisible to the whole block, since
document starts never decrease along the sequence), and its sinks are that document's first pages.
A block whose document holds fewer history pages than it reads fills its selection with invisible
pages, which the backend masks (keys before each query's document start get no attention).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from .config import SparseConfig
from .documents import Documents
from .fp32_linear import matmul_float32, tensor_cores_give_float32
from .kv import ChunkSpan, PagedKVStore
from .kv.summaries import summaries_of

if TYPE_CHECKING:
    from .context_parallel import ContextShard

SCORE_TILE_ELEMENTS = 1 << 24
"""At most this many float32 scores (64 MiB) exist at a time while scoring a chunk's blocks."""


def page_summaries(options: SparseConfig) -> tuple[str, ...]:
    """The page summaries a resolved sparse config's score reads (oomb/kv/summaries.py)."""
    return summaries_of(options.score, options.research.rerank_candidates)


def normaliser_span(n_hist: int, options: SparseConfig) -> tuple[int, int]:
    """(head, start): a softmax_max row's normaliser counts the history pages before ``head`` (the sinks)
    and from ``start`` on (the last ``normaliser_pages``), then the chunk's own pages; (0, 0): every
    history page (no bound set, or the history no longer than the sinks and the bound)."""
    bound = options.research.normaliser_pages
    if bound is None or n_hist <= options.sink_pages + bound:
        return 0, 0
    start = n_hist - bound
    return min(options.sink_pages, start), start


def _score_vectors(summaries: dict[str, torch.Tensor], score: str) -> torch.Tensor:
    """(B, pages, Hkv, D or 2D): what the query rows are multiplied with. minmax: one matmul over 2D,
    [relu(q), min(q, 0)] . [max; min], so each tile's scores are written once."""
    if score == "minmax":
        return torch.cat([summaries["key_max"], summaries["key_min"]], dim=-1)
    return summaries["key_mean"]


def _share_over_heads(out: torch.Tensor, options: SparseConfig) -> torch.Tensor:
    """selection="shared": every KV head gets the pooled score of all heads (summed for softmax pooling,
    the best otherwise); "kv_head": ``out`` unchanged."""
    if options.research.selection != "shared":
        return out
    pooled = out.sum(dim=1, keepdim=True) if options.research.pooling == "softmax" else out.amax(dim=1, keepdim=True)
    return pooled.expand_as(out)


def leak_free_rows(q: torch.Tensor, page_size: int, previous: torch.Tensor | None) -> torch.Tensor:
    """(B, Hq, n_blocks, P + 1, D): the rows that score each query block without a leak: the queries of
    the block before it (all earlier than the block's first token) and the block's first query. Block
    0 takes ``previous`` (B, Hq, P, D), the previous chunk's last page of queries, or, without one (the
    first chunk, or a partial page), copies of its first query."""
    B, Hq, Lq, D = q.shape
    P = page_size
    n_blocks = -(-Lq // P)
    if n_blocks * P > Lq:
        q = torch.cat([q, q[:, :, -1:].expand(B, Hq, n_blocks * P - Lq, D)], dim=2)
    blocks = q.reshape(B, Hq, n_blocks, P, D)
    first = blocks[:, :, :, :1]
    before_first = previous[:, :, None] if previous is not None and previous.shape[2] == P \
        else first[:, :, :1].expand(B, Hq, 1, P, D)
    before = torch.cat([before_first, blocks[:, :, :-1]], dim=2)
    return torch.cat([before, first], dim=3)


def block_scores(
    q: torch.Tensor, summaries: dict[str, torch.Tensor], page_size: int, options: SparseConfig,
    scale: float | None = None, previous: torch.Tensor | None = None,
    own: dict[str, torch.Tensor] | None = None, kernel: bool | None = None,
) -> torch.Tensor:
    """Score of every (query block, history page) pair.

    Args:
        q: (B, Hq, Lq, D) the chunk's post-RoPE queries (any strides).
        summaries: name -> (B, n_hist, Hkv, D) summaries of the history pages, in page order.
        page_size: P, the queries per block.
        options: score rule, granularity, leak-free, pooling (softmax_max: its normaliser bounded by
            ``normaliser_pages``, normaliser_span).
        scale: the attention's logit scale (default D**-0.5); pooling "softmax" needs it.
        previous: leak-free only: the previous chunk's last page of queries (leak_free_rows).
        own: pooling "softmax_max" only: the summaries of the chunk's own pages, (B, n_blocks, Hkv, D)
            each; block j's rows count own pages 0..j in their normaliser (leak-free: 0..j-1, wholly
            before the block's first query), None: history pages only.
        kernel: score with the Triton kernel (oomb/attention/triton_block_scores.py: the products never
            leave the chip); None: for CUDA tensors with pooling "max"
            or "softmax_max", not leak-free, summaries in q's dtype. The torch code below is
            the reference and the CPU's path.
    Returns:
        (B, Hkv, n_blocks, n_hist) float32, n_blocks = ceil(Lq / P); with selection="shared" every
        KV head holds the same scores.
    """
    B, Hq, Lq, D = q.shape
    first = next(iter(summaries.values()))
    n_hist, Hkv = first.shape[1], first.shape[2]
    normalised = options.research.pooling == "softmax_max"
    kernel_scores = ((options.research.pooling == "max" or normalised) and not options.leak_free
                     and options.score in ("minmax", "mean"))
    if kernel is None:
        kernel = (kernel_scores and q.is_cuda and first.dtype == q.dtype
                  and (q.dtype != torch.float32 or D <= 128))  # float32 tiles at D = 256 outgrow shared memory
    if kernel:
        if not kernel_scores:
            raise ValueError("the block-score kernel takes the minmax and mean scores with pooling 'max' or "
                             "'softmax_max', not leak-free; got "
                             f"{options.score!r}, {options.research.pooling!r}, leak_free={options.leak_free}")
        from .attention.triton_block_scores import summary_block_scores  # local: Triton is optional

        normaliser = (scale if scale is not None else D ** -0.5) if normalised else None
        n_own = 0
        if normalised and own is not None:  # the own pages after the history's, for the normaliser only
            n_own = next(iter(own.values())).shape[1]
            summaries = {name: torch.cat([summaries[name], own[name]], dim=1) for name in summaries}
        span = normaliser_span(n_hist, options) if normalised else (0, 0)
        return _share_over_heads(summary_block_scores(q, summaries, page_size, options.score, normaliser, n_own,
                                                      span), options)
    G, P = Hq // Hkv, page_size
    n_blocks = -(-Lq // P)
    # bf16/fp16 on a GPU: tensor cores with exact products and float32 sums, the float32 scores up
    # to the order of the sums (float32 matmuls instead: estimated ~34 s of a 1M step of the 7B shape).
    compute = q.dtype if tensor_cores_give_float32(q, first) else torch.float32
    if options.leak_free:
        rows = leak_free_rows(q.to(compute), P, previous.to(compute) if previous is not None else None)
        rows = rows.reshape(B, Hkv, G, n_blocks, rows.shape[3], D)
    else:
        # Pad the last block with copies of the last query: they cannot change a maximum.
        qf = q.to(compute)
        if n_blocks * P > Lq:
            qf = torch.cat([qf, qf[:, :, -1:].expand(B, Hq, n_blocks * P - Lq, D)], dim=2)
        rows = qf.reshape(B, Hkv, G, n_blocks, P, D)
    keys = _score_vectors(summaries, options.score)  # (B, n_hist, Hkv, D or 2D)
    n_own = 0
    if options.research.pooling == "softmax_max" and own is not None:
        own_keys = _score_vectors(own, options.score)
        n_own = own_keys.shape[1]
        keys = torch.cat([keys, own_keys], dim=1)
    keys_t = keys.to(compute).permute(0, 2, 3, 1).reshape(B * Hkv, -1, n_hist + n_own)  # (B Hkv, D or 2D, pages), once
    scale = scale if scale is not None else D ** -0.5

    rows_per_block = G * rows.shape[4]
    blocks_per_tile = max(1, SCORE_TILE_ELEMENTS // max(1, B * Hkv * rows_per_block * n_hist))
    out = torch.empty((B, Hkv, n_blocks, n_hist), dtype=torch.float32, device=q.device)
    for b0 in range(0, n_blocks, blocks_per_tile):
        b1 = min(b0 + blocks_per_tile, n_blocks)
        r = rows[:, :, :, b0:b1].permute(0, 1, 3, 2, 4, 5).reshape(B, Hkv, (b1 - b0) * rows_per_block, D)
        if options.score == "minmax":  # sum_d max(q_d min_d, q_d max_d) = relu(q) . max + min(q, 0) . min
            r = torch.cat([r.clamp(min=0), r.clamp(max=0)], dim=-1)
        r = r.reshape(B * Hkv, -1, r.shape[-1])
        s = matmul_float32(r, keys_t, "scoring")
        s = s.reshape(B, Hkv, b1 - b0, rows_per_block, n_hist + n_own)
        if options.research.pooling == "softmax":
            # Each row's estimated share of its attention over the history, summed over the block's rows
            # (InfLLM-v2 pools softmaxed scores over a GQA group): a page many rows want beats one that a
            # single row scores high, and heads with large logits no longer outvote the others.
            out[:, :, b0:b1] = torch.softmax(s * scale, dim=-1).sum(dim=3)
        elif options.research.pooling == "softmax_max":
            # Each row's estimated log-probability of the page (its scores normalised over every page it
            # sees: the history, or its sinks and last pages (normaliser_pages), and its own chunk's pages up
            # to its block), the best row's per page.
            logits = s * scale
            if n_own:
                block = torch.arange(b0, b1, device=q.device)[:, None]  # (blocks, 1)
                # Own pages after the block; leak-free, its own page too (its summary covers later keys).
                hidden = torch.arange(n_own, device=q.device)[None, :] >= block + (0 if options.leak_free else 1)
                logits[..., n_hist:] = logits[..., n_hist:].masked_fill(hidden[:, None, :], float("-inf"))
            head, start = normaliser_span(n_hist, options)  # a bounded normaliser: the sinks and the last pages
            counted = torch.cat([logits[..., :head], logits[..., start:]], dim=-1) if start else logits
            out[:, :, b0:b1] = (logits[..., :n_hist] - counted.logsumexp(dim=-1, keepdim=True)).amax(dim=3)
        else:
            out[:, :, b0:b1] = s.amax(dim=3)
    return _share_over_heads(out, options)


def exact_block_scores(
    q: torch.Tensor, store: PagedKVStore, layer: int, chunk: ChunkSpan, options: SparseConfig,
    scale: float | None = None, row_stride: int = 1, kernel: bool | None = None,
) -> torch.Tensor:
    """The "exact" score (the oracle of a summary score): every query row's true attention probability
    on each history page, from the page's keys in the store, pooled over the block's rows as
    block_scores pools (max: the largest probability any row puts on the page; softmax: the sum,
    the block's attention mass there).

    Args and result: as block_scores, with the keys read from ``store`` (every history page and
    the chunk's own pages, written by stage 1 before selection). ``row_stride`` > 1 pools only every
    row_stride-th query of a block (the last of each group), to measure how few queries an exact score
    needs. ``kernel``: score with the fused Triton kernel
    (oomb/attention/triton_scores.py; max pooling only); None: for CUDA tensors whose page size it
    takes. The torch code below materialises tiles of logits: the reference, and the CPU's path.
    """
    B, Hq, Lq, D = q.shape
    P = store.page_size
    if kernel is None:
        kernel = q.is_cuda and P % 16 == 0 and options.research.pooling != "softmax"
    if kernel:
        if options.research.pooling == "softmax":
            raise ValueError("the exact-score kernel pools by the best row (max); pooling 'softmax' runs in torch")
        from .attention.triton_scores import exact_page_scores  # local: Triton is optional

        scores = exact_page_scores(q, store.layers[layer].k, store.page_table, chunk.start,
                                   scale if scale is not None else D ** -0.5, row_stride)
        return _share_over_heads(scores, options)
    n_hist = chunk.start // P
    n_blocks = -(-Lq // P)
    pages = store.layers[layer]
    Hkv = pages.k.shape[1]
    G = Hq // Hkv
    scale = scale if scale is not None else D ** -0.5

    def keys(first: int, last: int) -> torch.Tensor:  # (B, Hkv, (last - first) * P, D) float32
        ids = store.page_table[:, first:last].long()
        return pages.k[ids].float().permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, D)

    history = keys(0, n_hist)
    own = keys(n_hist, n_hist + n_blocks)[:, :, :Lq]
    rows = q.float().reshape(B, Hkv, G, Lq, D)
    position = torch.arange(Lq, device=q.device)
    out = torch.zeros((B, Hkv, n_blocks, n_hist), dtype=torch.float32, device=q.device)
    per_block = B * Hq * P * (n_hist * P + Lq)
    blocks_per_tile = max(1, (4 * SCORE_TILE_ELEMENTS) // max(1, per_block))
    for b0 in range(0, n_blocks, blocks_per_tile):
        b1 = min(b0 + blocks_per_tile, n_blocks)
        r0, r1 = b0 * P, min(b1 * P, Lq)
        r = rows[:, :, :, r0:r1]  # (B, Hkv, G, R, D)
        s_hist = torch.einsum("bhgrd,bhkd->bhgrk", r, history) * scale
        s_own = torch.einsum("bhgrd,bhkd->bhgrk", r, own[:, :, :r1]) * scale
        s_own = s_own.masked_fill(position[None, :r1] > position[r0:r1, None], float("-inf"))
        lse = torch.logaddexp(s_hist.logsumexp(dim=-1), s_own.logsumexp(dim=-1))  # (B, Hkv, G, R)
        mass = (s_hist - lse[..., None]).exp().reshape(B, Hkv, G, r1 - r0, n_hist, P).sum(dim=-1)
        pad = (b1 - b0) * P - (r1 - r0)  # rows past the chunk's end: zero mass changes neither pooling
        mass = torch.nn.functional.pad(mass, (0, 0, 0, pad)).reshape(B, Hkv, G, b1 - b0, P, n_hist)
        mass = mass[:, :, :, :, row_stride - 1::row_stride]
        # "max" and "softmax_max" are the same here: the exact masses are already each row's probabilities.
        pooled = mass.sum(dim=(2, 4)) if options.research.pooling == "softmax" else mass.amax(dim=(2, 4))
        out[:, :, b0:b1] = pooled
    return _share_over_heads(out, options)


def candidate_options(options: SparseConfig, layer: int, history_pages: int = 0) -> SparseConfig:
    """The options whose top_pages are the "rerank" score's candidates: ``rerank_factor`` x the layer's
    budget at this history (the sinks besides), chosen by the minmax bound."""
    return replace(options, budget=options.research.rerank_factor * options.budget_of(layer, history_pages),
                   layer_budgets=None, dense_layers=(), read_share=None)


def propose_candidates(
    q: torch.Tensor, summaries: dict[str, torch.Tensor], page_size: int, options: SparseConfig, layer: int,
    scale: float | None = None, first_pages: torch.Tensor | None = None, previous: torch.Tensor | None = None,
    own: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The "rerank" score's candidates, as a selection (see selection_from_scores) of rerank_factor x
    budget pages: the top pages of the ``rerank_candidates`` summary score; "minmax_mean": minmax's top
    half, then the mean key's best of the rest (the two miss different pages: docs/sparse.md). A block's
    rows pool by ``candidate_pooling``: "max" (the raw scores' best row) or "softmax_max" (each row's
    scores normalised first over the history pages and ``own``, the chunk's own pages' summaries up to its
    block, as block_scores does, so a row with large scores everywhere does not decide alone). Leak-free,
    scored by the rows leak_free_rows gives (``previous``: the previous chunk's last page of queries)."""
    wanted = candidate_options(options, layer, next(iter(summaries.values())).shape[1])

    def scores(rule: str) -> torch.Tensor:
        # The summary score ``rule`` pooled as the candidates are (its own candidate pooling is then unused).
        research = replace(options.research, pooling=options.research.candidate_pooling, candidate_pooling="max")
        return block_scores(q, summaries, page_size, replace(options, score=rule, research=research),
                            scale, previous, own if options.research.candidate_pooling == "softmax_max" else None)

    if options.research.rerank_candidates != "minmax_mean":
        return selection_from_scores(scores(options.research.rerank_candidates), wanted, layer, first_pages)
    half = selection_from_scores(scores("minmax"), replace(wanted, budget=wanted.budget // 2), layer, first_pages)
    forced = scores("mean").scatter(-1, half.long(), float("inf"))  # minmax's half first, whatever the mean says
    return selection_from_scores(forced, wanted, layer, first_pages)


def rerank_block_scores(
    q: torch.Tensor, k_pool: torch.Tensor, page_table: torch.Tensor, chunk: ChunkSpan, candidates: torch.Tensor,
    options: SparseConfig, scale: float | None = None, kernel: bool | None = None,
    context: ContextShard | None = None, previous: torch.Tensor | None = None, key_pages: torch.Tensor | None = None,
    row_stride: int = 1,
) -> torch.Tensor:
    """The "rerank" score: each row's attention probability on each *candidate* page, normalised over
    the candidates' keys and the row's own chunk (causally), the best row's per block; -1 for pages
    that are not candidates (below every probability, so top_pages keeps candidates). Leak-free
    (options.leak_free), a block's rows are the page of queries before it and its first query
    (leak_free_rows; ``previous``: the previous chunk's last page of queries), each seeing only the
    keys at or before it.

    Args:
        k_pool, page_table: keys (num_pages, Hkv, P, D) and the table that places the candidates and
            the chunk's own pages in them (PagedKVStore.scoring_keys).
        candidates: (B, Hkv, n_blocks, M) sorted page-table positions of each block's candidates
            (top_pages of the minmax scores with candidate_options).
        kernel: score with the Triton kernel (oomb/attention/triton_scores.py); None: for CUDA tensors
            whose page size it takes. The torch code below is the reference and the CPU's path.
        context: context parallel: ``k_pool`` holds only this rank's pages (and the chunk's, on its
            owner); each rank scores its own candidates with every rank's normaliser (a log-sum-exp
            gathered per tile), and every rank ends with the same scores. Runs the torch code: the
            kernel normalises over the keys it reads.
        key_pages: where ``candidates``' keys sit in ``page_table`` when not at their own positions
            (offload staged by (page, head) rows, kv/head_rows.py); the scores still go to the candidates.
            Not leak-free (that masks the last history page by its position).
        row_stride: pool only every row_stride-th query of a block (the last of each group), as
            exact_block_scores does: what scoring fewer rows costs in accuracy (not leak-free).
    Returns:
        (B, Hkv, n_blocks, n_hist) float32, as block_scores.
    """
    B, Hq, Lq, D = q.shape
    _, Hkv, P, _ = k_pool.shape
    n_hist, n_blocks = chunk.start // P, -(-Lq // P)
    M = candidates.shape[3]
    G = Hq // Hkv
    scale = scale if scale is not None else D ** -0.5
    out = torch.full((B, Hkv, n_blocks, n_hist), -1.0, dtype=torch.float32, device=q.device)
    if kernel is None:
        kernel = q.is_cuda and P % 16 == 0 and context is None
    if kernel and context is not None:
        raise ValueError("the rerank kernel normalises over the keys one process holds: context parallel runs torch")
    if key_pages is not None and options.leak_free:
        raise ValueError("leak-free rerank masks the last history page by its position: key_pages must be None")
    if row_stride != 1 and options.leak_free:
        raise ValueError("leak-free rerank scores a block from its P + 1 fixed rows: row_stride must be 1")
    keys_at = candidates if key_pages is None else key_pages
    if kernel:
        from .attention.triton_scores import exact_page_scores  # local: Triton is optional

        listed = keys_at.to(torch.int32).contiguous()
        scores = exact_page_scores(q, k_pool, page_table, chunk.start, scale, pages=listed,
                                   leak_free=options.leak_free, previous=previous, row_stride=row_stride)
        return _share_over_heads(out.scatter_(3, candidates.long(), scores), options)
    ids = page_table[:, None, None].expand(B, Hkv, n_blocks, -1).gather(3, keys_at.long())
    heads = torch.arange(Hkv, device=q.device)[None, :, None, None]
    held = None if context is None else context.owned_positions(candidates, P)  # (B, Hkv, n_blocks, M)
    own = None
    if context is None or context.owns(chunk.index):
        own_ids = page_table[:, n_hist: n_hist + n_blocks].long()  # (B, n_blocks)
        own = k_pool[own_ids].float().permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, D)[:, :, :Lq]  # (B, Hkv, Lq, D)
    if options.leak_free:  # block j: the P queries before its first, then its first (positions in the chunk)
        R = P + 1
        rows = leak_free_rows(q.float(), P, previous.float() if previous is not None else None)
        rows = rows.reshape(B, Hkv, G, n_blocks, R, D)
        position = torch.arange(n_blocks, device=q.device)[:, None] * P + torch.arange(R, device=q.device) - P
        if previous is None or previous.shape[2] != P:  # block 0's rows are copies of query 0
            position[0] = 0
        row_ok = torch.ones(n_blocks, R, dtype=torch.bool, device=q.device)
        key_position = candidates.long()[..., None] * P + torch.arange(P, device=q.device)  # (B, Hkv, nb, M, P)
    else:
        R = P
        pad = n_blocks * P - Lq
        rows = q.float().reshape(B, Hkv, G, Lq, D)
        rows = torch.nn.functional.pad(rows, (0, 0, 0, pad)).reshape(B, Hkv, G, n_blocks, P, D)
        row_ok = (torch.arange(n_blocks * P, device=q.device) < Lq).reshape(n_blocks, P)
        row_ok &= torch.arange(P, device=q.device) % row_stride == row_stride - 1  # the pooled rows
        position = torch.arange(n_blocks * P, device=q.device).reshape(n_blocks, P)
    per_block = B * Hq * R * (M * P + Lq)
    blocks_per_tile = max(1, (4 * SCORE_TILE_ELEMENTS) // max(1, per_block))
    for b0 in range(0, n_blocks, blocks_per_tile):
        b1 = min(b0 + blocks_per_tile, n_blocks)
        keys = k_pool[ids[:, :, b0:b1], heads].float()  # (B, Hkv, nb, M, P, D)
        r = rows[:, :, :, b0:b1]  # (B, Hkv, G, nb, R, D)
        s_cand = torch.einsum("bhgjrd,bhjmkd->bhgjrmk", r, keys) * scale
        if options.leak_free:  # rows before the chunk see the last history page only up to themselves
            later = key_position[:, :, None, b0:b1, None] > (chunk.start + position[b0:b1])[..., None, None]
            s_cand.masked_fill_(later, float("-inf"))
        if held is not None:  # other ranks' candidates: whatever their rows here hold, no key
            s_cand.masked_fill_(~held[:, :, None, b0:b1, None, :, None], float("-inf"))
        lse = s_cand.flatten(-2).logsumexp(-1)  # (B, Hkv, G, nb, P)
        if own is not None:
            s_own = torch.einsum("bhgjrd,bhkd->bhgjrk", r, own) * scale
            hidden = torch.arange(Lq, device=q.device) > position[b0:b1, :, None]  # (nb, P, Lq): causal
            lse = torch.logaddexp(lse, s_own.masked_fill(hidden, float("-inf")).logsumexp(-1))
        if context is not None:
            lse = context.logsumexp(lse)  # every rank's candidates and the chunk: finite in every row
        mass = (s_cand - lse[..., None, None]).exp().sum(-1)  # (B, Hkv, G, nb, P, M)
        mass = mass.masked_fill(~row_ok[b0:b1, :, None], 0.0)
        best = mass.amax(dim=(2, 4))  # (B, Hkv, nb, M)
        if held is not None:  # each candidate's score from the rank holding it (the others' are -1)
            best = context.maximum(best.masked_fill(~held[:, :, b0:b1], -1.0))
        out[:, :, b0:b1].scatter_(3, candidates[:, :, b0:b1].long(), best)
    return _share_over_heads(out, options)


def top_pages(scores: torch.Tensor, options: SparseConfig, layer: int = 0,
              first_pages: torch.Tensor | None = None) -> torch.Tensor:
    """The selection from block scores: sinks + top-budget, sorted ascending.

    Args:
        scores: (B, Hkv, n_blocks, n_hist) from block_scores.
        first_pages: packed documents: (B, n_blocks) the first page of each block's first query's
            document; the block's sinks start there and earlier pages are chosen only to fill up.
    Returns:
        (B, Hkv, n_blocks, K) int32 page-table positions, K = options.num_selected(n_hist); each row
        distinct and ascending.
    """
    B, Hkv, n_blocks, n_hist = scores.shape
    if first_pages is not None:
        return _top_pages_in_documents(scores, options, layer, first_pages)
    sinks = min(options.sink_pages, n_hist)
    k = options.num_selected(n_hist, layer) - sinks
    chosen = torch.topk(scores[..., sinks:], k, dim=-1, sorted=False).indices + sinks
    sink_ids = torch.arange(sinks, device=scores.device).expand(B, Hkv, n_blocks, sinks)
    selection = torch.cat([sink_ids, chosen], dim=-1).sort(dim=-1).values
    return selection.to(torch.int32)


def _top_pages_in_documents(scores: torch.Tensor, options: SparseConfig, layer: int,
                            first_pages: torch.Tensor) -> torch.Tensor:
    """top_pages with per-block documents: the sinks are the document's first pages (always chosen),
    pages before the document rank below every page of it (chosen only when it has too few)."""
    n_hist = scores.shape[3]
    page = torch.arange(n_hist, device=scores.device)
    first = first_pages.to(scores.device, torch.long)[:, None, :, None]  # (B, 1, n_blocks, 1)
    ranked = scores.masked_fill(page < first, float("-inf"))
    ranked = ranked.masked_fill((page >= first) & (page < first + options.sink_pages), float("inf"))
    chosen = torch.topk(ranked, options.num_selected(n_hist, layer), dim=-1, sorted=False).indices
    return chosen.sort(dim=-1).values.to(torch.int32)


def recent_pages_hold_the_documents(documents: Documents, chunk: ChunkSpan, page_size: int,
                                    selected: int, device: torch.device | None = None) -> torch.Tensor | None:
    """Packed documents: where the history of every block's document fits in ``selected`` pages, the selection
    whatever the scores: each block reads all of its document's pages and fills up with earlier pages, which the
    backends mask; the ``selected`` pages before the chunk hold every block's document pages and are all earlier
    ones otherwise, so they serve every block ((1, 1, 1, selected) int32 positions on ``device``, ascending) and
    the chunk is not scored. Decided on the host from the documents' starts and made on the device (no device
    synchronisation, no copy); None otherwise. Packed corpora of files or chats often have such short documents
    (docs/sparse.md counts them in oomb train's embedded corpus)."""
    n_hist = chunk.start // page_size
    earliest = int(documents.start_cpu[:, chunk.start:chunk.end:page_size].min()) // page_size
    if earliest < n_hist - selected:
        return None
    return torch.arange(n_hist - selected, n_hist, dtype=torch.int32, device=device)[None, None, None]


def block_first_pages(documents: Documents, chunk: ChunkSpan, page_size: int) -> torch.Tensor:
    """(B, n_blocks) first page of the document of each query block's first query (packed documents)."""
    firsts = documents.start[:, chunk.start: chunk.end: page_size]
    return torch.div(firsts, page_size, rounding_mode="floor")


@torch.no_grad()
def select_pages(
    q: torch.Tensor, store: PagedKVStore, layer: int, chunk: ChunkSpan, options: SparseConfig,
    scale: float | None = None, documents: Documents | None = None,
) -> torch.Tensor | None:
    """The history pages each query block of ``chunk`` reads in ``layer`` (stage 1, after its pages
    and summaries were written); ``documents``: packed documents (oomb/documents.py), or None.

    Returns:
        (B, Hkv, n_blocks, K) int32 page-table positions (see top_pages), or None when the sinks and
        the budget cover every history page: then the chunk reads all of them (dense).
    """
    P = store.page_size
    assert chunk.start % P == 0, "chunks start on page boundaries"
    n_hist = chunk.start // P
    previous = store.scoring_queries(layer, chunk) if options.leak_free else None
    if options.leak_free and chunk.length >= P:
        store.keep_scoring_queries(layer, chunk, q[:, :, chunk.length - P: chunk.length].detach())
    if options.num_selected(n_hist, layer) == n_hist:
        return None
    if documents is not None:
        recent = recent_pages_hold_the_documents(documents, chunk, P, options.num_selected(n_hist, layer), q.device)
        if recent is not None:
            return recent.expand(q.shape[0], store.num_kv_heads, -(-chunk.length // P), -1)
    first_pages = block_first_pages(documents, chunk, P) if documents is not None else None
    if options.score == "exact" and store.context is not None:
        # Context parallel: rerank's code with every history page a candidate is the exact score (max
        # pooling), its normaliser gathered over the ranks that hold the pages.
        B, Hkv, n_blocks = q.shape[0], store.num_kv_heads, -(-chunk.length // P)
        every = torch.arange(n_hist, device=q.device).expand(B, Hkv, n_blocks, n_hist)
        with store.scoring_keys(layer, chunk, every) as (k_pool, table, _):
            scores = rerank_block_scores(q, k_pool, table, chunk, every, options, scale, context=store.context)
    elif options.score == "exact":
        scores = exact_block_scores(q, store, layer, chunk, options, scale)
    elif options.score == "rerank":
        # Candidates per group of query_block_pages blocks (the group shares its selection): with
        # offload, stage 1 then moves at most one candidate set per group and KV head.
        own = None
        if options.research.candidate_pooling == "softmax_max":  # the chunk's own pages count in each row's normaliser
            pages = store.history_summaries(layer, n_hist + -(-chunk.length // P))  # the history, then own pages
            history = {name: summary[:, :n_hist] for name, summary in pages.items()}
            own = {name: summary[:, n_hist:] for name, summary in pages.items()}
        else:
            history = store.history_summaries(layer, n_hist)
        candidates = propose_candidates(q, history, P, options, layer, scale, first_pages, previous, own)
        # Leak-free scoring masks the last history page by its position: the candidates keep their own.
        with store.scoring_keys(layer, chunk, candidates, by_head=not options.leak_free) as (k_pool, table, keys_at):
            scores = rerank_block_scores(q, k_pool, table, chunk, candidates, options, scale, context=store.context,
                                         previous=previous, key_pages=keys_at)
    elif options.research.pooling == "softmax_max":
        n_own = -(-chunk.length // P)
        pages = store.history_summaries(layer, n_hist + n_own)
        history = {name: summary[:, :n_hist] for name, summary in pages.items()}
        own = {name: summary[:, n_hist:] for name, summary in pages.items()}
        scores = block_scores(q, history, P, options, scale, previous, own)
    else:
        scores = block_scores(q, store.history_summaries(layer, n_hist), P, options, scale, previous)
    return selection_from_scores(scores, options, layer, first_pages)


def selection_from_scores(scores: torch.Tensor, options: SparseConfig, layer: int = 0,
                          first_pages: torch.Tensor | None = None) -> torch.Tensor:
    """(B, Hkv, n_blocks, K) selection from block scores, one per group of query_block_pages blocks
    (``first_pages``: packed documents, see top_pages; a group takes its first block's)."""
    group = options.query_block_pages
    if group == 1:
        return top_pages(scores, options, layer, first_pages)
    n_blocks = scores.shape[2]
    grouped_first = first_pages[:, ::group] if first_pages is not None else None
    selection = top_pages(group_scores(scores, group, options.leak_free, options.research.pooling), options, layer,
                          grouped_first)
    if selection.shape[2] == 1:
        # One group covers the chunk: a view with stride 0 over the blocks says so without reading
        # the values (cudnn_sparse.py then needs no device synchronisation to find its groups).
        return selection.expand(-1, -1, n_blocks, -1)
    return selection.repeat_interleave(group, dim=2)[:, :, :n_blocks].contiguous()


def group_scores(scores: torch.Tensor, group: int, leak_free: bool, pooling: str = "max") -> torch.Tensor:
    """Scores of groups of ``group`` consecutive query blocks: (B, Hkv, n_blocks, n_hist) ->
    (B, Hkv, ceil(n_blocks / group), n_hist). A group keeps a page if any of its blocks wants it;
    leak-free, only its first block (scored with the queries before it) decides. Pooling "softmax" sums the
    blocks' estimated masses instead of taking the best."""
    if leak_free:
        return scores[:, :, ::group]
    pad = -scores.shape[2] % group
    if pad:  # copies of the last block cannot change a maximum (nor, as zeros, a sum)
        fill = scores[:, :, -1:] if pooling == "max" else torch.zeros_like(scores[:, :, -1:])
        scores = torch.cat([scores, fill.expand(-1, -1, pad, -1)], dim=2)
    grouped = scores.unflatten(2, (-1, group))
    return grouped.sum(dim=3) if pooling == "softmax" else grouped.amax(dim=3)
