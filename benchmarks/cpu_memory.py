"""Peak RSS and time of one oomb step vs a full-sequence HF backward on the demo's tiny model (CPU).

Each measurement runs in its own process so that its peak RSS is its own.

    python benchmarks/cpu_memory.py --contexts 8192 32768 131072 --out benchmarks/results/cpu_memory.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import resource
import time
from datetime import date


def _measure(mode: str, num_tokens: int, chunk_size: int, queue) -> None:
    import torch
    import transformers

    import oomb
    from oomb.tools.demo import tiny_qwen2_config

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(tiny_qwen2_config(num_tokens))
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, model.config.vocab_size, (1, num_tokens))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    if mode == "hf":
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    else:
        loss = oomb.forward_backward(model, ids, config=oomb.OOMBConfig(chunk_size=chunk_size))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put({"mode": mode, "tokens": num_tokens, "seconds": round(seconds, 2), "loss": float(loss.detach()),
               "rss_before_mib": round(rss_before), "peak_rss_mib": round(peak),
               "step_rss_mib": round(peak - rss_before)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--out", default="benchmarks/results/cpu_memory.json")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for tokens in args.contexts:
        for mode in ("hf", "oomb"):
            queue = ctx.Queue()
            proc = ctx.Process(target=_measure, args=(mode, tokens, args.chunk_size, queue))
            proc.start()
            proc.join()
            row = queue.get() if proc.exitcode == 0 else {"mode": mode, "tokens": tokens,
                                                          "error": f"exit code {proc.exitcode}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    import torch
    import transformers

    report = {"date": date.today().isoformat(), "machine": f"{platform.node()} ({mp.cpu_count()} CPUs)",
              "torch": torch.__version__, "transformers": transformers.__version__,
              "command": "python benchmarks/cpu_memory.py " + " ".join(
                  f"--contexts {' '.join(map(str, args.contexts))} --chunk-size {args.chunk_size}".split()),
              "model": "oomb.tools.demo.tiny_qwen2_config (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 257)",
              "rows": rows}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print("| tokens | mode | time (s) | peak RSS (MiB) | RSS growth in the step (MiB) |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['mode']} | {r.get('seconds', '-')} | {r.get('peak_rss_mib', '-')} | "
              f"{r.get('step_rss_mib', r.get('error'))} |")


if __name__ == "__main__":
    main()
