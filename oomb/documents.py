"""Packed documents: attention and labels that stop at document boundaries.

Long-context data is many documents packed into one row. Hugging Face's padding-free packing
(TRL ``padding_free``, ``DataCollatorWithFlattening``) marks them by restarting ``position_ids`` at 0
at each document (or by ``cu_seqlens``); attention then stays inside each document and the label of
a document's first token is -100, so no token is predicted from the previous document.

Boundaries are derived once for the whole sequence, before chunking, so a chunk that starts inside
a document knows where that document began. Per row b and token t:

    start[b, t]  absolute position of the first token of t's document     query t sees keys
    end[b, t]    one past the last token of t's document                  start[b, t] <= j <= t

Both are non-decreasing in t, which is what lets attention skip key blocks: a key block wholly
before ``start`` of a tile's first query is invisible to the whole tile, and the queries that see a
key j are t in [j, end[b, j]).

Sliding-window layers (key j visible to query t iff t - window < j <= t) are the same kind of bound:
``window_bounds`` intersects the documents (or plain causality) with a window, giving

    start[b, t] = max(doc_start[b, t], t - window + 1)      end[b, j] = min(doc_end[b, j], j + window)

which keep both properties (non-decreasing, and start[b, t] <= j iff t < end[b, j] for t >= j), so
every backend that masks documents masks windows exactly and skips the key blocks before them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Documents:
    """Document boundaries of a (B, T) batch; see the module docstring."""

    start: torch.Tensor
    """(B, T) int32 on the step's device: first position of each token's document."""
    end: torch.Tensor
    """(B, T) int32 on the step's device: one past the last position of each token's document."""
    start_cpu: torch.Tensor
    """(B, T) int64 host copy of ``start``: page skipping is decided on the host without a device sync."""
    positions: torch.Tensor
    """(B, T) int64 on the step's device: RoPE position ids, restarting at 0 at each document."""
    window: int | None = None
    """A sliding window alone (``window_bounds`` without packed documents): start[b, t] is exactly
    max(0, t - window + 1), a band a backend may decompose instead of reading the bounds (cuDNN's
    band path, attention/cudnn_band.py). None: packed documents, or a window cut by them."""

    @property
    def split(self) -> bool:
        """Whether some row holds more than one document (otherwise attention is plainly causal)."""
        return bool((self.start_cpu != 0).any())

    def row(self, b: int) -> Documents:
        """The boundaries of row ``b`` alone, as a batch of one (backends that cut rows into segments)."""
        rows = slice(b, b + 1)
        return Documents(self.start[rows], self.end[rows], self.start_cpu[rows], self.positions[rows], self.window)

    def history_start(self, chunk_start: int, page_size: int) -> int:
        """First key position (page-aligned) any query of the chunk starting at ``chunk_start`` may see:
        pages before it belong to earlier documents of every row and are neither read nor staged."""
        first = int(self.start_cpu[:, chunk_start].min())
        return first // page_size * page_size

    def mask_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """``labels`` with -100 at the first token of every document after a row's first: the last
        token of a document does not predict the next document's first (as DataCollatorWithFlattening)."""
        positions = torch.arange(labels.shape[1], device=labels.device)
        first = self.start.to(labels.device, torch.long) == positions
        first[:, 0] = False  # position 0 is never a target after shifting
        return labels.masked_fill(first, IGNORE_INDEX)


def _check_ids(name: str, value: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {value.dtype}")
    return value.detach().to("cpu", torch.long)


def starts_from_position_ids(position_ids: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """(B, T) int64 document start of every token from restarting position ids (HF's rule: a new
    document begins wherever a position is not the previous one plus 1). A row may begin inside a
    document (any first position >= 0); inside a row a new document must restart at 0."""
    pos = _check_ids("position_ids", position_ids)
    if pos.dim() == 1:
        pos = pos[None]
    batch, tokens = shape
    if pos.dim() != 2 or pos.shape[1] != tokens or pos.shape[0] not in (1, batch):
        raise ValueError(f"position_ids must have shape ({batch}, {tokens}) (or ({tokens},) / (1, {tokens}) for "
                         f"every row), got {tuple(position_ids.shape)}")
    pos = pos.expand(batch, tokens)
    if int(pos.min()) < 0:
        raise ValueError(f"position_ids must be >= 0, found {int(pos.min())}")
    restart = torch.ones_like(pos, dtype=torch.bool)
    restart[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    bad = restart[:, 1:] & (pos[:, 1:] != 0)
    if bool(bad.any()):
        b, t = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"position_ids of row {b} jump from {int(pos[b, t])} to {int(pos[b, t + 1])} at token {t + 1}: "
            "within a document positions count up by 1, and a new document restarts at 0"
        )
    index = torch.arange(tokens).expand(batch, tokens)
    return torch.where(restart, index, torch.zeros_like(index)).cummax(dim=1).values


def starts_from_cu_seqlens(cu_seqlens, shape: tuple[int, int]) -> torch.Tensor:
    """(B, T) int64 document starts from cumulative document lengths [0, l1, l1 + l2, ..., T]: one 1-D
    sequence for batch 1 (flash-attention's format), or one per row."""
    batch, tokens = shape
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1:
        rows = [cu_seqlens]
    elif isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 2:
        rows = list(cu_seqlens)
    elif isinstance(cu_seqlens, Sequence) and cu_seqlens and all(isinstance(x, int) for x in cu_seqlens):
        rows = [torch.tensor(cu_seqlens)]
    elif isinstance(cu_seqlens, Sequence):
        rows = [r if isinstance(r, torch.Tensor) else torch.tensor(list(r)) for r in cu_seqlens]
    else:
        raise TypeError(f"cu_seqlens must be a 1-D tensor/list of ints or one per row, got {type(cu_seqlens).__name__}")
    if len(rows) != batch:
        raise ValueError(f"cu_seqlens gives {len(rows)} row(s) of boundaries for a batch of {batch}")
    starts = torch.zeros((batch, tokens), dtype=torch.long)
    for b, row in enumerate(rows):
        cu = _check_ids("cu_seqlens", row)
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != tokens:
            raise ValueError(f"cu_seqlens of row {b} must run from 0 to the row's {tokens} tokens, got {cu.tolist()}")
        lengths = cu.diff()
        if bool((lengths <= 0).any()):
            raise ValueError(f"cu_seqlens of row {b} must increase strictly (no empty document), got {cu.tolist()}")
        starts[b] = torch.repeat_interleave(cu[:-1], lengths)
    return starts


def positions_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """RoPE position ids restarting at 0 at each document."""
    return torch.arange(starts.shape[1]).expand_as(starts) - starts


def ends_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """(B, T) one past the last position of each token's document."""
    batch, tokens = starts.shape
    index = torch.arange(tokens).expand(batch, tokens)
    is_last = torch.ones_like(starts, dtype=torch.bool)
    is_last[:, :-1] = starts[:, 1:] != starts[:, :-1]
    ends = torch.where(is_last, index + 1, torch.full_like(index, tokens))
    return ends.flip(1).cummin(dim=1).values.flip(1)


def resolve_documents(
    position_ids: torch.Tensor | None, cu_seqlens, shape: tuple[int, int], device: torch.device
) -> Documents | None:
    """Documents from ``position_ids`` and/or ``cu_seqlens`` (None when neither is given). Given both,
    they must agree: the positions must restart exactly where cu_seqlens puts the boundaries."""
    if position_ids is None and cu_seqlens is None:
        return None
    starts = positions = None
    if position_ids is not None:
        starts = starts_from_position_ids(position_ids, shape)
        positions = _check_ids("position_ids", position_ids)
        positions = (positions[None] if positions.dim() == 1 else positions).expand(shape)
    if cu_seqlens is not None:
        from_cu = starts_from_cu_seqlens(cu_seqlens, shape)
        if starts is not None and not torch.equal(starts, from_cu):
            b, t = (int(x) for x in (starts != from_cu).nonzero()[0])
            raise ValueError(f"position_ids and cu_seqlens disagree on the document of token {t} of row {b} "
                             f"(it starts at {int(starts[b, t])} by position_ids, {int(from_cu[b, t])} by cu_seqlens)")
        starts = from_cu
    if positions is None:
        positions = positions_from_starts(starts)
    return Documents(
        start=starts.to(device=device, dtype=torch.int32),
        end=ends_from_starts(starts).to(device=device, dtype=torch.int32),
        start_cpu=starts,
        positions=positions.to(device=device, dtype=torch.long).contiguous(),
    )


def window_bounds(documents: Documents | None, window: int, shape: tuple[int, int], device: torch.device) -> Documents:
    """The key bounds of a sliding-window layer (module docstring): the step's documents (None: one
    document per row) intersected with ``window``. Attention backends take it in place of the
    documents, so a window layer reads only the pages its queries' windows overlap. Without packed
    documents (None, or one document per row) the result's ``window`` says the bounds are the band alone."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding window must be a positive int, got {window!r}")
    batch, tokens = shape
    index = torch.arange(tokens).expand(batch, tokens)
    if documents is None:
        doc_start, positions = torch.zeros_like(index), index.to(device)
        doc_end = torch.full_like(index, tokens)
    else:
        doc_start, positions = documents.start_cpu, documents.positions
        doc_end = documents.end.to("cpu", torch.long)
    start = torch.maximum(doc_start, index - window + 1)
    end = torch.minimum(doc_end, index + window)
    pure = documents is None or not documents.split  # one document per row: the bounds are the band alone
    return Documents(start=start.to(device=device, dtype=torch.int32).contiguous(),
                     end=end.to(device=device, dtype=torch.int32).contiguous(),
                     start_cpu=start, positions=positions, window=window if pure else None)
