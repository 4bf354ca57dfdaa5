"""Command-line entry point: `oomb demo` (more commands arrive with their issues)."""

from __future__ import annotations

import argparse
import logging
import sys

from .demo import DemoOptions, run_demo


def _demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="train a tiny model on 16K-token sequences on this machine, then gradcheck")
    defaults = DemoOptions()
    p.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    p.add_argument("--seq-len", type=int, default=defaults.seq_len, help="tokens per sequence")
    p.add_argument("--chunk-size", type=int, default=defaults.chunk_size)
    p.add_argument("--page-size", type=int, default=defaults.page_size)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--device", default=defaults.device, help="cpu or cuda")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oomb", description="million-token training on one GPU")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.command == "demo":
            result = run_demo(DemoOptions(steps=args.steps, seq_len=args.seq_len, chunk_size=args.chunk_size,
                                          page_size=args.page_size, lr=args.lr, seed=args.seed,
                                          device=args.device))
            return 0 if result["ok"] else 1
    except (ValueError, TypeError, NotImplementedError) as err:
        print(f"oomb {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
