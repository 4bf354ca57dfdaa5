"""Diagnostic: how much a bf16 step's gradient error against float32 varies between implementations.

tests/test_gpu_engine.py compares oomb's bf16 gradient error (against a float32 full-sequence
backward) with HF's own bf16 SDPA backward's. On one sequence the ratio moved from 0.986x to 1.058x
between two sets of Triton tile configs whose attention errors are equal to three digits
(benchmarks/attention_accuracy.py). This measures the spread: HF's error with each of its bf16
attention implementations, and oomb's with each backend and chunk size, on several sequences, and
the error pooled over them (root of summed squared errors over summed squared gradients).

    python benchmarks/bf16_gradient_error.py --out benchmarks/results/bf16_gradient_error_h200.json
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import Qwen2Config, Qwen2ForCausalLM

import oomb
from oomb import machine

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HF_VARIANTS = {"sdpa": None, "sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
               "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "eager": "eager"}


def model_config() -> Qwen2Config:
    """tests/test_gpu_engine.py's model."""
    return Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)


def squared_error(model, reference) -> tuple[float, float]:
    """(sum of squared gradient errors, sum of squared reference gradients), summed over parameters."""
    num = sum(float(((p.grad.float() - r) ** 2).sum()) for p, r in zip(model.parameters(), reference, strict=True))
    return num, sum(float((r**2).sum()) for r in reference)


def hf_step(model, ids, variant: str) -> None:
    model.zero_grad(set_to_none=True)
    backend = HF_VARIANTS[variant]
    model.set_attn_implementation("eager" if backend == "eager" else "sdpa")
    if backend is None or backend == "eager":
        model(input_ids=ids, labels=ids).loss.backward()
        return
    with sdpa_kernel(backend):
        model(input_ids=ids, labels=ids).loss.backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4], help="one sequence per seed")
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 1024, 4096])
    parser.add_argument("--backends", nargs="+", default=["triton", "cudnn"] if DEVICE == "cuda" else ["torch"])
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    torch.manual_seed(0)
    fp32 = Qwen2ForCausalLM(model_config()).to(DEVICE).float()
    fp32.set_attn_implementation("sdpa")
    bf16 = Qwen2ForCausalLM(model_config()).to(DEVICE).bfloat16()
    bf16.load_state_dict(fp32.state_dict())
    hf_names = list(HF_VARIANTS) if DEVICE == "cuda" else ["sdpa", "eager"]
    oomb_names = [f"oomb_{b}_chunk{c}" for b in args.backends for c in args.chunks]
    sums = {name: [0.0, 0.0] for name in hf_names + oomb_names}
    per_seed = []
    for seed in args.seeds:
        torch.manual_seed(seed)
        ids = torch.randint(0, fp32.config.vocab_size, (1, args.tokens), device=DEVICE)
        fp32.zero_grad(set_to_none=True)
        fp32(input_ids=ids, labels=ids).loss.backward()
        reference = [p.grad.detach().float().clone() for p in fp32.parameters()]
        row = {"seed": seed}
        for name in hf_names:
            try:
                hf_step(bf16, ids, name)
            except RuntimeError as err:  # a backend this machine or shape does not have
                row[name] = str(err).splitlines()[0]
                continue
            num, den = squared_error(bf16, reference)
            sums[name][0] += num
            sums[name][1] += den
            row[name] = round((num / den) ** 0.5, 6)
        bf16.set_attn_implementation("sdpa")
        for backend in args.backends:
            for chunk in args.chunks:
                bf16.zero_grad(set_to_none=True)
                config = oomb.OOMBConfig(chunk_size=chunk, page_size=128, backend=backend)
                oomb.forward_backward(bf16, ids, config=config)
                num, den = squared_error(bf16, reference)
                name = f"oomb_{backend}_chunk{chunk}"
                sums[name][0] += num
                sums[name][1] += den
                row[name] = round((num / den) ** 0.5, 6)
        per_seed.append(row)
        print(row)
    pooled = {name: round((num / den) ** 0.5, 6) for name, (num, den) in sums.items() if den}
    print("pooled over the sequences:", pooled)
    if args.out:
        result = {"command": "python benchmarks/bf16_gradient_error.py --out " + args.out,
                  "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "machine": machine.machine_info(torch.device(DEVICE)), "versions": machine.versions(),
                  "tokens": args.tokens, "metric": "relative error of all gradients against a float32 backward",
                  "pooled": pooled, "per_sequence": per_seed}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
