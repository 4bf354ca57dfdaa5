"""One vocabulary for the `oomb` commands' options: the same thing has the same flag everywhere.

An option of the step is named after its ``OOMBConfig`` path, dashes for dots and underscores, without the
performance/precision section (``--sparse-budget`` for ``sparse.budget``, ``--kv-grad-dtype`` for
``precision.kv_grad_dtype``, ``--no-checkpoint-layers`` for ``performance.checkpoint_layers``,
``--fp32-grad-accumulation/--no-fp32-grad-accumulation``) and, for offload, as before (``--offload`` for
``offload.enabled``, ``--resident-layers`` for ``offload.resident_layers``); input text is ``--data``, the device
``--device``, the learning rate ``--lr``, the model ``--model`` (a local directory, a preset, or ``smollm2``).
Spellings the commands had before stay accepted as hidden aliases, because recorded commands
(benchmarks/results/INDEX.yaml, docs) use them; ``--help`` shows only the names above.
"""

from __future__ import annotations

import argparse
from pathlib import Path

REAL_MODEL = "smollm2"
"""``--model smollm2``: the real SmolLM2-135M-Instruct of oomb/real_model.py (converted once, cached)."""


def add_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, *old: str,
               **kwargs) -> argparse.Action:
    """``parser.add_argument(name, **kwargs)``, plus each spelling in ``old`` accepted for the same destination but
    left out of ``--help`` (an alias's default never overrides the option's)."""
    action = parser.add_argument(name, **kwargs)
    if old:
        alias = {k: v for k, v in kwargs.items() if k not in ("help", "default", "dest")}
        parser.add_argument(*old, dest=action.dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **alias)
    return action


def resolve_model(name: str) -> str:
    """``name``, or for ``smollm2`` (when no directory of that name is here) the converted SmolLM2 directory."""
    if name == REAL_MODEL and not Path(name).is_dir():
        from .real_model import smollm2_dir

        return str(smollm2_dir())
    return name


def check_model_option(given: str, resolved: str, presets) -> None:
    """``--model``: a preset name (of ``presets``), ``smollm2`` or a local directory; else one line naming all three."""
    if resolved not in presets and not Path(resolved).expanduser().is_dir():
        raise ValueError(f"--model {given!r} is not a preset ({', '.join(presets)}), {REAL_MODEL!r} or a local "
                         "directory: give a Hugging Face model directory (config.json + weights, as save_pretrained "
                         "writes it) or a preset name")


def parse_read_share(text: str) -> float | str:
    """--sparse-read-share: a share of the history in (0, 1], or "none" (the fixed budget) / "auto"."""
    if text.lower() in ("none", "auto"):
        return text.lower()
    return parse_share(text, "a share (e.g. 0.35), 'none' or 'auto'")


def parse_share(text: str, expected: str = "a share (e.g. 0.25)") -> float:
    """A share of the history in (0, 1] (gradcheck's --reads and --read-shares, calibrate's --max-read)."""
    try:
        share = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {expected}") from None
    if not 0 < share <= 1:
        raise argparse.ArgumentTypeError(f"{share} is not a share of the history in (0, 1]")
    return share


def positive_int(text: str) -> int:
    """A count of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def read_share_setting(given: float | str) -> float | str | None:
    """The ``sparse.read_share`` value of a parsed --sparse-read-share: "none" is null (the fixed budget)."""
    return None if given == "none" else given


def flag_read_share(share: float | str | None, budget: int | None) -> float | str | None:
    """``sparse.read_share`` from the command line: --sparse-read-share where given; else a --sparse-budget given
    alone is a fixed budget (None), even when it equals the default budget (whose own default is a read share);
    else "auto"."""
    if share is not None:
        return read_share_setting(share)
    return None if budget is not None else "auto"
