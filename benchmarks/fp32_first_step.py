"""First vs second step of a float32 model with head_dim 128 on CUDA, per attention backend: float32
on CUDA must not spend minutes compiling or tuning before its first step. Prints both times per
backend and, with --out, writes them as JSON (date, machine, commit from OOMB_GIT_COMMIT, command).

    python benchmarks/fp32_first_step.py --backends triton torch --out fp32_first_step.json

Each backend runs in its own process (a fresh Triton cache is what a new user meets only on a fresh
machine; the caller decides that)."""

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import date


def one_backend(backend: str) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from oomb.config import OOMBConfig
    from oomb.engine import forward_backward

    cfg = Qwen2Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=128, vocab_size=1000, max_position_embeddings=16384)
    model = Qwen2ForCausalLM(cfg).cuda().float().train()
    ids = torch.randint(0, 1000, (1, 8192), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    config = OOMBConfig(backend=backend, chunk_size=2048)
    times, losses = [], []
    for step in range(2):
        start = time.perf_counter()
        loss = forward_backward(model, ids, config=config)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        print(f"{backend} step {step + 1}: {times[-1]:.2f} s, loss {losses[-1]:.4f}", flush=True)
    return {"backend": backend, "first_step_seconds": round(times[0], 3), "second_step_seconds": round(times[1], 3),
            "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["triton"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process: one backend
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one_backend(args.one)), flush=True)
        return
    runs = []
    for backend in args.backends:
        child = subprocess.run([sys.executable, __file__, "--one", backend], capture_output=True, text=True)
        sys.stdout.write(child.stdout[-2000:])
        lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
        runs.append(json.loads(lines[-1][7:]) if lines else {"backend": backend, "error": child.stderr[-1500:]})
    import torch

    report = {"date": date.today().isoformat(), "machine": torch.cuda.get_device_name(0),
              "commit": os.environ.get("OOMB_GIT_COMMIT", "unknown"),
              "command": "python benchmarks/fp32_first_step.py " + " ".join(sys.argv[1:]),
              "model": "Qwen2 2 layers, hidden 512, head_dim 128, float32, 8,192 tokens, chunk 2048", "runs": runs}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
