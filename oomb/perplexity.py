"""Perplexity by position bucket: how well a model predicts tokens far into a long context.

A model extended to a longer context can keep its perplexity over the first thousands of tokens and
lose it further on; one number over the whole sequence hides that. Buckets double from a first one:

    [0, 8K), [8K, 16K), [16K, 32K), [32K, 64K), [64K, 128K), ..., [512K, 1M)

the last cut at the sequence length (96K tokens: ..., [32K, 64K), [64K, 96K)). A predicted token
counts in the bucket of its own position t (t >= 1; token 0 has nothing before it), so the first
bucket of a sequence holds 8K - 1 of them. Each bucket's mean NLL is the sum of its tokens' negative
log-likelihoods (float64) over all sequences / their count; its perplexity is exp(mean NLL).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .units import format_tokens

FIRST_BUCKET = 8192
"""Tokens of the first bucket; later buckets double."""


def position_buckets(seq_len: int, first: int = FIRST_BUCKET) -> list[tuple[int, int]]:
    """The [start, end) position ranges of a sequence of ``seq_len`` tokens: [0, first), then doubling."""
    if seq_len < 2 or first < 1:
        raise ValueError(f"position buckets need seq_len >= 2 and first >= 1, got seq_len={seq_len}, first={first}")
    edges, end = [0], first
    while edges[-1] < seq_len:
        edges.append(min(end, seq_len))
        end *= 2
    return list(zip(edges[:-1], edges[1:], strict=True))


def bucket_name(start: int, end: int) -> str:
    """'0-8K', '8K-16K', '512K-1M'."""
    return f"{format_tokens(start) if start else 0}-{format_tokens(end)}"


@dataclass
class Bucket:
    start: int
    end: int
    tokens: int = 0
    nll_sum: float = 0.0

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.tokens if self.tokens else math.nan

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll) if self.tokens else math.nan

    def to_dict(self) -> dict:
        return {"bucket": bucket_name(self.start, self.end), "start": self.start, "end": self.end,
                "tokens": self.tokens, "mean_nll": self.mean_nll, "perplexity": self.perplexity}


class PerplexityByPosition:
    """Sums of negative log-likelihoods per position bucket over the sequences ``add`` is given."""

    def __init__(self, seq_len: int, first: int = FIRST_BUCKET) -> None:
        self.seq_len = seq_len
        self.buckets = [Bucket(start, end) for start, end in position_buckets(seq_len, first)]

    def add(self, logprobs: torch.Tensor) -> None:
        """Count one batch of sequences: (B, T) or (T,) per-token log-probabilities (oomb.evaluate's
        ``token_logprobs``), NaN where a token is not scored."""
        if logprobs.dim() == 1:
            logprobs = logprobs[None]
        if logprobs.shape[-1] != self.seq_len:
            raise ValueError(f"log-probabilities of {logprobs.shape[-1]} positions, buckets made for {self.seq_len}")
        for bucket in self.buckets:
            part = logprobs[:, bucket.start:bucket.end]
            counted = ~part.isnan()
            bucket.tokens += int(counted.sum())
            bucket.nll_sum -= float(part[counted].double().sum())

    def results(self) -> list[dict]:
        """Per bucket: name, start, end, tokens, mean_nll, perplexity."""
        return [bucket.to_dict() for bucket in self.buckets]
