"""Diagnostic: does the dense kernels' key-window path change bf16 gradient error?

One chunk of 3000 tokens (tests/test_gpu_engine.py's setup): the local window (0, L) covers every
key, so the kernels can run it with key_range=(0, L) (window code path) or key_range=None (the
unwindowed path). Both run in one process with the same autotuned configs; prints both errors
against the fp32 full-sequence reference, HF bf16's error, and the configs autotune chose.

    python benchmarks/bf16_window_diag.py --out diag.json
"""

import argparse
import json
from dataclasses import replace

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import oomb
import oomb.engine
from oomb.attention import triton_paged
from oomb.attention.backend import select_backend


def grads(model):
    return [p.grad.detach().float().clone() for p in model.parameters()]


def rel_err(got, want):
    num = sum(float(((g - r) ** 2).sum()) for g, r in zip(got, want, strict=True))
    return (num / sum(float((r**2).sum()) for r in want)) ** 0.5


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bf16_window_diag.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    model = Qwen2ForCausalLM(cfg).cuda().float()
    model.set_attn_implementation("sdpa")
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, 3000), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    reference = grads(model)
    bf16 = Qwen2ForCausalLM(cfg).cuda().bfloat16()
    bf16.load_state_dict(model.state_dict())
    bf16.set_attn_implementation("sdpa")
    bf16(input_ids=ids, labels=ids).loss.backward()
    result = {"hf_bf16": rel_err(grads(bf16), reference)}
    triton = select_backend("triton", torch.device("cuda"))

    def whole(key_range, query_start):
        return None if key_range is not None and key_range[0] == 0 and query_start == 0 else key_range

    unwindowed = replace(
        triton, name="triton-unwindowed",
        forward=lambda *a, key_range=None, **k: triton.forward(*a, key_range=whole(key_range, a[4]), **k),
        backward=lambda *a, key_range=None, **k: triton.backward(*a, key_range=whole(key_range, a[4]), **k))
    config = oomb.OOMBConfig(chunk_size=4096, page_size=128, backend="triton")
    for name, backend in (("window", triton), ("no_window", unwindowed), ("window_again", triton),
                          ("no_window_again", unwindowed)):
        oomb.engine.select_backend = lambda _name, _device, b=backend: b
        bf16.zero_grad(set_to_none=True)
        loss = oomb.forward_backward(bf16, ids, config=config)
        result[name] = rel_err(grads(bf16), reference)
        result[name + "_loss"] = float(loss)
    result["configs"] = {k: str(getattr(getattr(triton_paged, k), "best_config", None))
                         for k in ("_fwd_kernel", "_dkdv_kernel", "_dq_kernel")}
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
