"""Token counts as people write them: '131072', '128K', '1M' (binary: K = 1024, M = 1024**2).

Used by every place a length is given: CLI flags of train/plan/bench/gradcheck, YAML configs and
``--set`` overrides. Kept free of heavy imports so configuration code can use it.
"""

from __future__ import annotations

import argparse
import re

TOKEN_SUFFIXES = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


def parse_tokens(text: str | int) -> int:
    """'131072', '128K', '1M', '1.5M' (binary: K = 1024) -> a positive token count.

    Raises argparse.ArgumentTypeError (argparse shows its message as is)."""
    if isinstance(text, bool):
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (e.g. 131072, 128K, 1M)")
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (e.g. 131072, 128K, 1M)")
    value = float(match.group(1)) * TOKEN_SUFFIXES[match.group(2).upper()]
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    tokens = int(value)
    if tokens <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a token count must be at least 1")
    return tokens


def coerce_tokens(value, name: str):
    """A config value that may be a token count string ('1M') -> int; other values pass unchanged
    (the config's own type check reports them). Bad strings raise ValueError naming ``name``."""
    if isinstance(value, str):
        try:
            return parse_tokens(value)
        except argparse.ArgumentTypeError as err:
            raise ValueError(f"{name}={value!r}: {err}") from None
    return value


def format_tokens(tokens: int) -> str:
    """131072 -> '128K', 1048576 -> '1M', 1000 -> '1,000'."""
    for suffix, scale in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if tokens >= scale and tokens % scale == 0:
            return f"{tokens // scale}{suffix}"
    return f"{tokens:,}"


def format_indices(indices) -> str:
    """Sorted indices as runs: (0, 1, 2, 3, 4, 7) -> "0-4, 7"."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_normaliser_pages(text: str) -> int | str | None:
    """--normaliser-pages / --sparse-normaliser-pages: 'all' (None: every history page), 'auto' or a
    positive number of pages (OOMBConfig.sparse.research.normaliser_pages)."""
    if text in ("all", "auto"):
        return None if text == "all" else text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a positive number of pages, 'auto' or 'all', not {text!r}")
    return int(text)


def count(n: int, noun: str, plural: str | None = None) -> str:
    """'1 layer', '9 layers', '1 sink page' (``plural``: the plural where adding 's' is wrong)."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
