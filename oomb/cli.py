"""Command-line entry point. Each command lives in its own module, which provides
``add_arguments(parser)`` and ``main(args) -> exit code``; this file only dispatches."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# command name -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS = {
    "demo": ("oomb.tools.demo", "train a tiny model on 16K-token sequences on this machine, then gradcheck"),
    "train": ("oomb.training.cli", "train a model on long packed sequences: config, checkpoints, resume, logs"),
    "plan": ("oomb.tools.plan", "predict GPU and host memory of a step and the longest context that fits"),
    "bench": ("oomb.tools.bench", "benchmark HF and oomb modes over contexts: JSON, markdown table and plot"),
    "gradcheck": ("oomb.tools.gradcheck",
                  "sparse vs dense (and dense vs HF) parameter gradients: per-layer cosine, error"),
    "eval": ("oomb.tools.eval", "held-out perplexity by position and passkey retrieval, at any length (stage 1)"),
    "calibrate": ("oomb.tools.calibrate",
                  "a sparse plan for your model and data: per-layer recall, budgets, dense layers"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oomb", description="million-token training on one GPU")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        # also after the command (`oomb train -v`); SUPPRESS keeps a -v given before it
        command_parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                                    help="log at INFO level")
        importlib.import_module(module).add_arguments(command_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        _check_device(args)
        return module.main(args)
    except (ValueError, TypeError, NotImplementedError, OSError) as err:  # OSError: a path that cannot be used
        print(f"oomb {args.command}: error: {err}", file=sys.stderr)
        return 2


PLANS_FOR_OTHER_DEVICES = ("plan",)
"""Commands whose --device names the machine planned for, not the one they run on."""


def _check_device(args: argparse.Namespace) -> None:
    """A CUDA device asked for where there is none: one line instead of torch's traceback."""
    device = getattr(args, "device", None)
    if args.command in PLANS_FOR_OTHER_DEVICES or not isinstance(device, str) or not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"--device {device} but CUDA is not available here: use --device cpu")


if __name__ == "__main__":
    sys.exit(main())
