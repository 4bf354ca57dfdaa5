"""Does a tiny model learn long-range retrieval with sparse attention? Dense vs sparse budgets, on a CPU.

Task (passkey copy): a sequence of random filler tokens holds one needle token (one of 16) at a
uniformly random position; near the end (a random slot of the last 64 tokens) comes a query token
Q, and the token after Q must be the needle. Only that token is a label. Answering needs attention
from Q back to wherever the needle is: with sparse attention, the needle's page must be selected
(or lie in the sink pages or in Q's own chunk).

Every arm starts from the same random weights (the tiny-qwen2 preset: 2 layers, hidden 64) and sees
the same batches: a length curriculum up to 8K tokens (a tiny model does not learn the task at 8K
from scratch in a CPU budget; it does through 256 -> 8K), trained with oomb.forward_backward in
the arm's attention mode. After each curriculum stage the retrieval accuracy is measured on a fixed
set of 8K-token sequences with the arm's own attention (the greedy prediction at the answer, from
oomb.evaluate.token_logprobs), split by where the needle is (in Q's own chunk / in the sink pages /
elsewhere in the history).

    python benchmarks/sparse_accuracy.py                                     # full study, ~1.5 h on 2 cores
    python benchmarks/sparse_accuracy.py --quick --out /tmp/sparse_quick     # smoke run, seconds

Writes OUT.json (curves, accuracies, settings) and OUT.png (learning curves side by side).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import oomb
from oomb.evaluate import token_logprobs
from oomb.training.presets import TINY_PRESET, preset_config

FILLER = 64  # filler ids 0..63
NEEDLES = 16  # needle ids 64..79
NEEDLE0 = FILLER
QUERY = FILLER + NEEDLES  # id 80
QUERY_WINDOW = 64
"""Q sits in a random slot of the last QUERY_WINDOW tokens (not always the same slot of its page)."""

CURRICULUM = ((256, 150), (512, 100), (1024, 100), (2048, 100), (4096, 60), (8192, 40))
"""(tokens, steps) of each stage."""
QUICK_CURRICULUM = ((128, 3), (256, 3))


@dataclass(frozen=True)
class Arm:
    name: str
    attention: str = "dense"
    budget: int = 0
    score: str = "minmax"
    leak_free: bool = False
    query_block_pages: int = 1  # query blocks sharing one selection


ARMS = {
    arm.name: arm
    for arm in (
        Arm("dense"),
        Arm("sparse k=8", "sparse", 8),
        Arm("sparse k=2", "sparse", 2),
        Arm("sparse k=0", "sparse", 0),
        Arm("sparse k=8 mean", "sparse", 8, score="mean"),
        Arm("sparse k=8 leak-free", "sparse", 8, leak_free=True),
        Arm("sparse k=8 per chunk", "sparse", 8, query_block_pages=8),  # chunk 256 = 8 pages of 32
        Arm("sparse k=2 per chunk", "sparse", 2, query_block_pages=8),
    )
}


def make_batch(generator: torch.Generator, batch: int, tokens: int):
    """(ids, labels, query positions, needle positions) of ``batch`` passkey sequences."""
    ids = torch.randint(0, FILLER, (batch, tokens), generator=generator)
    labels = torch.full_like(ids, -100)
    window = min(QUERY_WINDOW, tokens // 2)
    query_pos = tokens - window + torch.randint(0, window - 1, (batch,), generator=generator)
    needle_pos = torch.stack([torch.randint(0, int(q), (1,), generator=generator)[0] for q in query_pos])
    needle = NEEDLE0 + torch.randint(0, NEEDLES, (batch,), generator=generator)
    rows = torch.arange(batch)
    ids[rows, needle_pos] = needle
    ids[rows, query_pos] = QUERY
    ids[rows, query_pos + 1] = needle
    labels[rows, query_pos + 1] = needle
    return ids, labels, query_pos, needle_pos


def oomb_config(arm: Arm, args) -> oomb.OOMBConfig:
    return oomb.OOMBConfig(chunk_size=args.chunk_size, page_size=args.page_size, backend="torch",
                           attention=arm.attention, sparse_budget=arm.budget, sparse_sink_pages=args.sink_pages,
                           sparse_score=arm.score, sparse_leak_free=arm.leak_free,
                           sparse_query_block_pages=arm.query_block_pages, loss_chunk_tokens=args.chunk_size)


def evaluate(model, config: oomb.OOMBConfig, eval_set, args) -> dict:
    """Retrieval accuracy on the fixed eval set, overall and by where the needle lies."""
    hits = {"all": [], "own chunk": [], "sink pages": [], "history": []}
    for ids, labels, query_pos, needle_pos in eval_set:
        # The answer follows Q; only it is labelled, so the LM head runs on its slice alone.
        predicted = token_logprobs(model, ids, labels, config, predict_at=(query_pos + 1)[:, None]).predictions[:, 0]
        rows = torch.arange(ids.shape[0])
        correct = (predicted == ids[rows, needle_pos]).tolist()
        for c, q, n in zip(correct, query_pos.tolist(), needle_pos.tolist(), strict=True):
            where = ("own chunk" if n // args.chunk_size == q // args.chunk_size
                     else "sink pages" if n < args.sink_pages * args.page_size else "history")
            hits["all"].append(c)
            hits[where].append(c)
    return {k: {"accuracy": sum(v) / len(v), "count": len(v)} for k, v in hits.items() if v}


def train_arm(arm: Arm, args, curriculum, eval_set) -> dict:
    torch.manual_seed(args.seed)  # same initial weights in every arm
    model = AutoModelForCausalLM.from_config(preset_config(TINY_PRESET, curriculum[-1][0]),
                                             attn_implementation="sdpa")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    config = oomb_config(arm, args)
    data = torch.Generator().manual_seed(args.seed + 1)  # same batches in every arm
    losses, evals, step, start = [], [], 0, time.perf_counter()
    for tokens, steps in curriculum:
        for _ in range(steps):
            ids, labels, _, _ = make_batch(data, args.batch, tokens)
            optimizer.zero_grad(set_to_none=True)
            losses.append({"step": step, "tokens": tokens, "loss": float(oomb.forward_backward(model, ids, labels,
                                                                                             config))})
            optimizer.step()
            step += 1
        result = evaluate(model, config, eval_set, args)
        evals.append({"step": step, "trained_tokens": tokens, **result})
        print(f"  {arm.name:<22} step {step:4d} ({tokens:5d} tokens): loss {losses[-1]['loss']:.3f}, retrieval at "
              f"{eval_set[0][0].shape[1]} tokens {result['all']['accuracy']:.3f} ({time.perf_counter() - start:.0f} s)",
              flush=True)
    return {"arm": asdict(arm), "losses": losses, "evals": evals, "final": evals[-1],
            "seconds": time.perf_counter() - start}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(13, 4.8))
    for run in report["runs"]:
        steps = [x["step"] for x in run["losses"]]
        loss = torch.tensor([x["loss"] for x in run["losses"]])
        window = 10
        smooth = torch.nn.functional.avg_pool1d(loss[None, None], window, 1, window // 2,
                                                count_include_pad=False)[0, 0, : len(steps)]
        ax_loss.plot(steps, smooth.tolist(), label=run["arm"]["name"])
        ax_acc.plot([e["step"] for e in run["evals"]], [e["all"]["accuracy"] for e in run["evals"]], marker="o",
                    label=run["arm"]["name"])
    boundaries, step = [], 0
    for tokens, steps in report["settings"]["curriculum"]:
        step += steps
        boundaries.append((step, tokens))
    for ax in (ax_loss, ax_acc):
        for x, tokens in boundaries:
            ax.axvline(x, color="0.85", lw=0.8, zorder=0)
            ax.text(x, 1.0, f"{tokens // 1024}K" if tokens >= 1024 else str(tokens), transform=ax.get_xaxis_transform(),
                    ha="right", va="top", fontsize=7, color="0.4")
        ax.set_xlabel("optimizer step (curriculum stage ends marked with their length)")
    ax_loss.set_ylabel("training loss at the answer (10-step mean)")
    ax_loss.set_yscale("log")
    ax_acc.set_ylabel("retrieval accuracy on 8K-token sequences")
    ax_acc.axhline(1 / NEEDLES, color="0.5", ls=":", lw=1, label="chance (1/16)")
    ax_acc.set_ylim(-0.02, 1.02)
    ax_acc.legend(fontsize=8)
    s = report["settings"]
    fig.suptitle(f"Passkey retrieval, tiny Qwen2 (2 layers, hidden 64): dense vs sparse (chunk {s['chunk_size']}, "
                 f"page {s['page_size']}, {s['sink_pages']} sink page)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--sink-pages", type=int, default=1)
    parser.add_argument("--eval-sequences", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a few steps at 128-256 tokens: a smoke run")
    parser.add_argument("--out", default="benchmarks/results/sparse_accuracy", help="writes OUT.json and OUT.png")
    args = parser.parse_args()
    curriculum = QUICK_CURRICULUM if args.quick else CURRICULUM
    if args.quick:
        args.chunk_size, args.page_size, args.batch, args.eval_sequences = 64, 16, 2, 4
    eval_tokens = curriculum[-1][0]
    generator = torch.Generator().manual_seed(12345)
    eval_set = [make_batch(generator, args.batch, eval_tokens) for _ in range(args.eval_sequences // args.batch)]
    settings = {**{k: v for k, v in vars(args).items() if k not in ("arms", "out", "quick")},
                "curriculum": curriculum, "eval_tokens": eval_tokens, "task": __doc__.split("\n\n")[1],
                "filler_tokens": FILLER, "needles": NEEDLES, "query_window": QUERY_WINDOW}
    report = {"date": date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}, "
              f"{torch.get_num_threads()} threads, torch {torch.__version__}", "settings": settings, "runs": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.arms:
        print(f"arm {name}", flush=True)
        report["runs"].append(train_arm(ARMS[name], args, curriculum, eval_set))
        out.with_suffix(".json").write_text(json.dumps(report, indent=1))  # kept after every arm
        plot(report, out.with_suffix(".png"))
    print(f"final retrieval accuracy at {eval_tokens} tokens:")
    for run in report["runs"]:
        final = run["final"]
        split = ", ".join(f"{k} {v['accuracy']:.2f} (n={v['count']})" for k, v in final.items()
                          if k not in ("all", "step", "trained_tokens"))
        print(f"  {run['arm']['name']:<22} {final['all']['accuracy']:.3f}   [{split}]   {run['seconds']:.0f} s")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
