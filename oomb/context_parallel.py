"""Context parallelism: one sequence's KV pages spread over the ranks of a group, attention exact.

    ownership       chunk c's pages (every layer, every sequence of the batch) live on rank c mod N of
                    the context-parallel (CP) group, from stage 1 until stage 2 frees them; a rank's
                    page pools hold only its own chunks (memory / N)
    every rank      runs the same chunk loop (stages 1 and 2) on the same tokens with the same
                    (replicated, or TP-sharded) model: activations are identical on every rank
    attention of c  each rank attends the chunk's queries to the key windows of its own history
                    chunks, and the owner also to the chunk itself (causal); the partial (out, lse)
                    are all-gathered and folded with ``merge_window`` in rank order, so every rank
                    runs the same float operations and holds bit-identical outputs
    backward        each rank adds dK/dV into its own pages only (pages never move); the dQ
                    partials are all-gathered and summed in rank order; the chunk's own accumulated
                    dK/dV (on its owner) is broadcast, so every rank returns the same k/v gradient
    offload         a rank's host slabs hold its own chunks only, packed in chunk order (local_page)
    sparse          every rank keeps the page summaries of every chunk and selects with one process's
                    code (the same pages everywhere); rerank's exact probabilities take a normaliser
                    gathered over the ranks (logsumexp, maximum); each rank attends to the selected
                    pages it holds (attention/context_sparse.py), merged as above

Why chunks round-robin rather than pages: the chunk's queries see its own pages causally, and keeping
a chunk whole on one rank keeps every key window a page-aligned range of positions, the contract of
every backend (a history window, or the chunk itself), with packed documents and sliding windows
masked as on one process. Balance stays within one chunk of attention work per chunk step: for
chunk c, rank r holds floor(c/N) or floor(c/N)+1 history chunks, and the owner (r = c mod N) holds
floor(c/N) plus the causal half of its own chunk. Over a sequence of n chunks the slowest rank does
about 2N/n more than the mean (3 % for 4 ranks and 256 chunks).

The gathers cost N partial outputs of one chunk (float32, (B, Hq, L, D + 1) each) per attention call,
not an all-reduce's 2 (N - 1) / N: the price of identical results on every rank whatever the
collective's reduction order (NCCL's all-reduce order is not specified), and of the same merge
the single-process step runs over its windows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .attention.reference import merge_window


@dataclass(frozen=True)
class ContextShard:
    """This rank's place in a context-parallel group: which chunks' pages it holds, and the
    collectives that merge the ranks' partial attentions."""

    rank: int
    """Index of this rank in the CP group."""
    size: int
    """Ranks in the CP group (N)."""
    chunk_size: int
    """Tokens per chunk: the unit of ownership (chunk c on rank c mod N)."""
    group: dist.ProcessGroup | None = None
    """The CP process group; None only for tests of ownership alone (no collective may run)."""

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"context-parallel rank {self.rank} of {self.size} ranks is not valid")

    # ---- ownership -------------------------------------------------------------------------------

    def owner(self, chunk_index: int) -> int:
        return chunk_index % self.size

    def owns(self, chunk_index: int) -> bool:
        return self.owner(chunk_index) == self.rank

    def owned_pages(self, num_tokens: int, page_size: int) -> int:
        """Pages per sequence this rank holds for a step of ``num_tokens`` tokens."""
        assert self.chunk_size % page_size == 0, "chunks start on page boundaries"
        starts = range(self.rank * self.chunk_size, num_tokens, self.size * self.chunk_size)
        return sum(-(-min(start + self.chunk_size, num_tokens) // page_size) - start // page_size for start in starts)

    def own_windows(self, windows: list[tuple[int, int]], chunk_index: int) -> list[tuple[int, int]]:
        """The parts of a chunk's key windows (history blocks, then the chunk itself) on this rank's
        pages: each history block cut at chunk boundaries (page-aligned), the chunk itself only on its
        owner. Their union over the ranks is ``windows``. Consecutive owned pieces of one history block
        stay one window (one kernel call, no merge): a group of one rank attends exactly as one process."""
        *history, local = windows
        own = []
        for lo, hi in history:
            joinable = False  # the last piece ends where this block's next owned piece starts
            while lo < hi:
                end = min(hi, (lo // self.chunk_size + 1) * self.chunk_size)
                if not self.owns(lo // self.chunk_size):
                    joinable = False
                elif joinable:
                    own[-1] = (own[-1][0], end)
                else:
                    own.append((lo, end))
                    joinable = True
                lo = end
        return own + ([local] if self.owns(chunk_index) else [])

    def owned_positions(self, positions: torch.Tensor, page_size: int) -> torch.Tensor:
        """Bool tensor of ``positions``' shape: which page-table positions lie in this rank's chunks
        (sparse mode: the selected pages this rank reads, and the candidates whose keys it scores)."""
        assert self.chunk_size % page_size == 0, "chunks start on page boundaries"
        return positions.long() // (self.chunk_size // page_size) % self.size == self.rank

    def local_page(self, position: int, page_size: int) -> int:
        """Where page ``position`` of a sequence lies among this rank's own pages, its chunks in order
        (each whole but maybe the last): how the host tier addresses them (kv/offload.py), so that a
        rank pins host memory for its own chunks only."""
        chunk_pages = self.chunk_size // page_size
        chunk = position // chunk_pages
        if not self.owns(chunk):
            raise RuntimeError(f"page {position} (chunk {chunk}) lives on context-parallel rank {self.owner(chunk)}, "
                               f"not on rank {self.rank}")
        return chunk // self.size * chunk_pages + position % chunk_pages

    # ---- collectives (every rank of the group calls each, in the same order) --------------------

    def merge(self, q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None,
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention over every rank's keys from this rank's partial (out, lse) over its own
        (None: it holds no key of the chunk's windows): float32 out (B, Hq, L, D) and lse (B, Hq, L)."""
        if out is None:
            out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        packed = torch.cat([out.float(), lse.float()[..., None]], dim=-1)  # (B, Hq, L, D + 1): one gather
        parts = self._all_gather(packed)
        out, lse = parts[0][..., :-1], parts[0][..., -1]
        for part in parts[1:]:  # rank order: the same operations on every rank
            out, lse = merge_window(out, lse, part[..., :-1], part[..., -1])
        return out, lse

    def sum(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a per-rank partial (dQ), added in rank order: identical on every rank."""
        parts = self._all_gather(partial.contiguous())
        total = parts[0]
        for part in parts[1:]:
            total += part
        return total

    def logsumexp(self, partial: torch.Tensor) -> torch.Tensor:
        """The log-sum-exp over every rank's keys from this rank's partial one (float32, -inf where it
        holds none), folded in rank order: identical on every rank (sparse rerank's normaliser)."""
        parts = self._all_gather(partial.float().contiguous())
        total = parts[0]
        for part in parts[1:]:
            total = torch.logaddexp(total, part)
        return total

    def maximum(self, partial: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum over ranks (exact in any order): a score each rank knows only for its
        own pages, below every real score elsewhere, becomes its owner's value on every rank."""
        parts = self._all_gather(partial.contiguous())
        total = parts[0]
        for part in parts[1:]:
            total = torch.maximum(total, part)
        return total

    def from_owner(self, chunk_index: int, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's own accumulated (dK, dV), as its owner holds them, on every rank."""
        packed = torch.stack([dk, dv])  # (2, B, Hkv, L, D): one broadcast
        dist.broadcast(packed, src=dist.get_global_rank(self._group(), self.owner(chunk_index)), group=self.group)
        return packed[0], packed[1]

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor, group=self._group())
        return parts

    def _group(self) -> dist.ProcessGroup:
        if self.group is None:
            raise RuntimeError("this ContextShard has no process group: it can only answer ownership questions")
        return self.group


def check_context_parallel(config, causal_lm) -> None:
    """Refuse, before any allocation, what context parallelism does not support yet (with why)."""
    sparse = config.sparse
    if config.attention == "sparse" and sparse.resolved_score == "exact" and sparse.research.pooling == "softmax":
        raise NotImplementedError(
            "context parallelism (parallel cp > 1) with sparse.score='exact' and sparse.research.pooling='softmax' is "
            "not supported: under cp the exact score runs rerank's code over every history page, which keeps the best "
            "row's probability; use sparse.research.pooling='max' (or 'softmax_max', the same for the exact score)")
    if causal_lm.config.model_type == "gpt_oss":
        raise NotImplementedError(
            "context parallelism (parallel cp > 1) with attention sinks (gpt-oss) is not supported yet: the sink "
            "is folded into the chunk's own window, which only its owner rank computes")
