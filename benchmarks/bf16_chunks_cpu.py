"""Diagnostic: bf16 gradient error of oomb (torch backend, CPU) vs HF bf16, against an fp32 reference.

tests/test_gpu_engine.py's model and sequence (4-layer Qwen2, hidden 256, 1 x 3000 tokens), on the
CPU with the reference attention: several chunks (1024) and one chunk (4096). On the H200 with the
Triton kernels oomb's multi-chunk error was 1.003x HF's (a strict xfail there); this says whether the
per-chunk rounding of weight gradients shows without the GPU kernels, with the linear layers'
gradients in float32 (oomb/fp32_linear.py, the default) and without.

    python benchmarks/bf16_chunks_cpu.py --out benchmarks/results/bf16_chunks_cpu.json
"""

import argparse
import contextlib
import json
from datetime import datetime, timezone

import torch
from bf16_gradient_error import model_config  # the GPU engine test's model (a sibling script)
from transformers import Qwen2ForCausalLM

import oomb
import oomb.engine
from oomb import machine


def grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().float().clone() for p in model.parameters()]


def rel_err(got, want) -> float:
    num = sum(float(((g - r) ** 2).sum()) for g, r in zip(got, want, strict=True))
    return (num / sum(float((r**2).sum()) for r in want)) ** 0.5


@contextlib.contextmanager
def float32_linear_gradients(enabled: bool):
    """Off: the engine leaves every linear layer to autograd (each chunk's weight gradient rounded to
    bf16 before the float32 sum), as before oomb/fp32_linear.py."""
    original = oomb.engine.float32_weight_gradients
    if not enabled:
        oomb.engine.float32_weight_gradients = lambda model, acc, enabled=True: original(model, acc, enabled=False)
    try:
        yield
    finally:
        oomb.engine.float32_weight_gradients = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = model_config()
    fp32 = Qwen2ForCausalLM(cfg).float()
    fp32.set_attn_implementation("sdpa")
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, 3000))
    fp32(input_ids=ids, labels=ids).loss.backward()
    reference = grads(fp32)
    bf16 = Qwen2ForCausalLM(cfg).bfloat16()
    bf16.load_state_dict(fp32.state_dict())
    bf16.set_attn_implementation("sdpa")
    bf16(input_ids=ids, labels=ids).loss.backward()
    rows = {"hf_bf16_sdpa_rel_err": rel_err(grads(bf16), reference)}
    for chunk in (1024, 4096):
        for float32_linear in (True, False):  # linear layers' gradients with float32 results (fp32_linear.py)
            bf16.zero_grad(set_to_none=True)
            with float32_linear_gradients(float32_linear):
                oomb.forward_backward(bf16, ids,
                                      config=oomb.OOMBConfig(chunk_size=chunk, page_size=128, backend="torch"))
            suffix = "" if float32_linear else "_per_chunk_rounding"
            rows[f"oomb_torch_bf16_chunk{chunk}{suffix}_rel_err"] = rel_err(grads(bf16), reference)
    for name, value in rows.items():
        print(f"{name}: {value:.6f}")
    if args.out:
        result = {"command": "python benchmarks/bf16_chunks_cpu.py --out " + args.out,
                  "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "machine": machine.machine_info(torch.device("cpu")), "versions": machine.versions(),
                  "batch": 1, "tokens": 3000, **rows}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
