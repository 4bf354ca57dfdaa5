"""Diagnostic: bf16 error of each attention kernel (and each Triton tile config) against float64.

The engine's bf16 gradient error on the Triton backend changed with the tile configs autotune picked
(tests/test_gpu_engine.py: 0.01064 to 0.0114 for one and the same one-chunk step). This isolates the
attention: the same bf16 inputs go through every config combination of our Triton kernels, through
torch SDPA's bf16 backends and through the cudnn backend; each output and gradient is compared with
float64 attention on those very inputs, so only the kernels' own arithmetic is measured.

    python benchmarks/attention_accuracy.py --out benchmarks/results/attention_accuracy_h200.json
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

from oomb import machine

# (name, heads, KV heads, head dim, tokens, query scale): the GPU engine test's attention (Qwen2,
# hidden 256) and a production one (Qwen2.5-7B's heads). A query scale > 1 sharpens the softmax, as
# trained models' attention is sharper than random inputs'.
SHAPES = [("engine_test", 8, 2, 32, 3000, 1.0), ("engine_test_sharp", 8, 2, 32, 3000, 4.0),
          ("qwen7b", 28, 4, 128, 4096, 1.0)]
TINY = [("tiny", 4, 2, 16, 40, 1.0)]  # --tiny: a CPU smoke run (TRITON_INTERPRET=1)
PAGE = 128
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(heads: int, kv_heads: int, dim: int, tokens: int, q_scale: float, seed: int = 0) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE).bfloat16()

    return {"q": (randn(1, heads, tokens, dim).float() * q_scale).bfloat16(), "k": randn(1, kv_heads, tokens, dim),
            "v": randn(1, kv_heads, tokens, dim), "dout": randn(1, heads, tokens, dim)}


def exact(t: dict) -> dict:
    """float64 causal attention and its gradients on the bf16 inputs."""
    group = t["q"].shape[1] // t["k"].shape[1]
    q, k, v = (t[n].double().requires_grad_() for n in "qkv")
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         is_causal=True)
    out.backward(t["dout"].double())
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def sdpa(t: dict, backend) -> dict:
    from torch.nn.attention import sdpa_kernel

    group = t["q"].shape[1] // t["k"].shape[1]
    q, k, v = (t[n].clone().requires_grad_() for n in "qkv")
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                             is_causal=True)
        out.backward(t["dout"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def paged(t: dict, backend) -> dict:
    """One chunk with no history through a backend of oomb/attention (reference.py's contract)."""
    _, kv_heads, tokens, dim = t["k"].shape
    pages = -(-tokens // PAGE)

    def pool(x):
        padded = torch.zeros(pages * PAGE, kv_heads, dim, dtype=x.dtype, device=x.device)
        padded[:tokens] = x[0].transpose(0, 1)
        return padded.view(pages, PAGE, kv_heads, dim).transpose(1, 2).contiguous()

    def unpool(x):
        return x.transpose(1, 2).reshape(pages * PAGE, kv_heads, dim)[:tokens].transpose(0, 1)[None]

    k_pool, v_pool = pool(t["k"]), pool(t["v"])
    table = torch.arange(pages, dtype=torch.int32, device=DEVICE)[None]
    scale = dim**-0.5
    out, lse = backend.forward(t["q"], k_pool, v_pool, table, 0, scale)
    dk, dv = torch.zeros_like(k_pool, dtype=torch.float32), torch.zeros_like(v_pool, dtype=torch.float32)
    delta = backend.backward_delta(out, t["dout"])
    kwargs = {} if delta is None else {"delta": delta}
    dq = backend.backward(t["q"], k_pool, v_pool, table, 0, scale, out, t["dout"], lse, dk, dv, **kwargs)
    return {"out": out, "dq": dq, "dk": unpool(dk).bfloat16(), "dv": unpool(dv).bfloat16()}


def errors(got: dict, want: dict) -> dict:
    return {n: round(float((got[n].double() - want[n]).norm() / want[n].norm()), 6) for n in want}


def triton_configs(t: dict, want: dict) -> list[dict]:
    """Every forward config with every dK/dV and dQ config (the backward kernels are independent)."""
    from oomb.attention import triton_paged as tp
    from oomb.attention.backend import select_backend

    backend = select_backend("triton", torch.device(DEVICE))
    kernels = {"fwd": tp._fwd_kernel, "dkdv": tp._dkdv_kernel, "dq": tp._dq_kernel}
    every = {name: list(kernel.configs) for name, kernel in kernels.items()}
    rows = []
    try:
        for fwd in every["fwd"]:
            for i in range(max(len(every["dkdv"]), len(every["dq"]))):
                chosen = {"fwd": fwd, "dkdv": every["dkdv"][i % len(every["dkdv"])],
                          "dq": every["dq"][i % len(every["dq"])]}
                for name, kernel in kernels.items():
                    kernel.configs = [chosen[name]]
                err = errors(paged(t, backend), want)
                rows.append({"configs": {n: str(c) for n, c in chosen.items()}, **err})
                print(f"  triton {rows[-1]}")
    finally:
        for name, kernel in kernels.items():
            kernel.configs = every[name]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--tiny", action="store_true", help="one tiny shape (a CPU smoke run)")
    args = parser.parse_args()
    global PAGE
    PAGE = 16 if args.tiny else PAGE
    from torch.nn.attention import SDPBackend

    from oomb.attention.backend import select_backend

    result = {"command": "python benchmarks/attention_accuracy.py" + (f" --out {args.out}" if args.out else ""),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": machine.machine_info(torch.device(DEVICE)), "versions": machine.versions(),
              "metric": "relative Frobenius error against float64 attention on the same bf16 inputs", "shapes": {}}
    for name, heads, kv_heads, dim, tokens, q_scale in TINY if args.tiny else SHAPES:
        print(f"{name}: {heads} heads, {kv_heads} KV heads, head dim {dim}, {tokens} tokens, query scale {q_scale}")
        t = inputs(heads, kv_heads, dim, tokens, q_scale)
        want = exact(t)
        rows: dict = {}
        for label, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                               ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
            try:
                rows[label] = errors(sdpa(t, backend), want)
            except RuntimeError as err:  # a backend that does not take this shape
                rows[label] = {"error": str(err).splitlines()[0]}
            print(f"  {label} {rows[label]}")
        for label in ("torch", "cudnn"):
            try:
                rows[f"oomb_{label}"] = errors(paged(t, select_backend(label, torch.device(DEVICE))), want)
            except (RuntimeError, ImportError, ValueError, TypeError) as err:
                rows[f"oomb_{label}"] = {"error": str(err).splitlines()[0]}
            print(f"  oomb_{label} {rows[f'oomb_{label}']}")
        rows["oomb_triton_configs"] = triton_configs(t, want)
        result["shapes"][name] = {"heads": heads, "kv_heads": kv_heads, "head_dim": dim, "tokens": tokens,
                                  "query_scale": q_scale, **rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
