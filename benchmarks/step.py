"""One training step (forward + backward, no optimizer) of plain HF vs oomb dense, side by side.

Standard workload (DESIGN.md section 6): Qwen2.5-7B shape with random weights, bf16, chunk 4096,
page 128. Plain HF = SDPA + gradient checkpointing + oomb's chunked LM-head loss. Each step is
timed after a warm-up step (compilation and autotuning, reported apart), with synchronisation and
peak statistics reset; memory is the peak above the weights. Results are written after every
measurement, so a run cut short keeps what it measured.

    python benchmarks/step.py --contexts 32768 65536 131072 262144 --out benchmarks/results/step_h200.json
    python benchmarks/step.py --preset tiny --contexts 2048 4096 --device cpu   # smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from datetime import datetime, timezone

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

import oomb
from oomb.loss import chunked_cross_entropy, shift_labels
from oomb.memory import GIB, ModelShape, estimate_step_memory

PRESETS = {
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, rope_theta=1e6),
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, rope_theta=1e6),
}


def build_model(preset: str, max_tokens: int, device: torch.device, dtype: torch.dtype) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(**PRESETS[preset], max_position_embeddings=max_tokens, tie_word_embeddings=False)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    model.set_attn_implementation("sdpa")
    return model.train()


def hf_step(model, ids: torch.Tensor, loss_chunk_tokens: int) -> float:
    """Plain HF with the tools a savvy user adds: SDPA, gradient checkpointing, a chunked loss."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        targets = shift_labels(ids)
        loss = chunked_cross_entropy(hidden, targets, model.lm_head, int((targets != -100).sum()),
                                     loss_chunk_tokens)
        loss.backward()
    finally:
        model.gradient_checkpointing_disable()
    return float(loss.detach())


def oomb_step(model, ids: torch.Tensor, config: oomb.OOMBConfig) -> float:
    return float(oomb.forward_backward(model, ids, config=config))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(run, model, ids, device) -> dict:
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    sync(device)
    start = time.perf_counter()
    loss = run(model, ids)
    sync(device)
    seconds = time.perf_counter() - start
    row = {"seconds": round(seconds, 2), "loss": round(loss, 4)}
    if device.type == "cuda":
        row["peak_above_weights_gib"] = round((torch.cuda.max_memory_allocated(device) - base) / GIB, 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description="plain HF vs oomb dense: one training step")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-7b")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536, 131072, 262144, 524288])
    parser.add_argument("--modes", nargs="+", choices=["hf", "oomb"], default=["hf", "oomb"])
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--kv-grad-dtype", default="float32")
    parser.add_argument("--no-checkpoint-layers", action="store_true")
    parser.add_argument("--fp32-grad-accumulation", action="store_true",
                        help="oomb's fp32 sum of chunk gradients (+4 bytes/parameter); off: bf16 .grad like HF")
    parser.add_argument("--warmup-tokens", type=int, default=8192)
    parser.add_argument("--max-seconds", type=float, default=float("inf"),
                        help="skip a context whose predicted step time (quadratic from the last) exceeds what is left")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="benchmarks/results/step.json")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    deadline = time.perf_counter() + args.max_seconds
    model = build_model(args.preset, max(args.contexts), device, dtype)
    for p in model.parameters():
        p.requires_grad_(True)
    config = oomb.OOMBConfig(chunk_size=args.chunk_size, page_size=args.page_size,
                             kv_grad_dtype=args.kv_grad_dtype, checkpoint_layers=not args.no_checkpoint_layers,
                             fp32_grad_accumulation=args.fp32_grad_accumulation)
    shape = ModelShape.from_hf_config(model.config)
    n_params = sum(p.numel() for p in model.parameters())
    runs = {"hf": lambda m, ids: hf_step(m, ids, config.loss_chunk_tokens),
            "oomb": lambda m, ids: oomb_step(m, ids, config)}
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "oomb": oomb.__version__},
        "command": "python benchmarks/step.py " + " ".join(os.sys.argv[1:]),
        "workload": {"preset": args.preset, "params": n_params, "dtype": str(dtype), **vars(config)},
        "weights_gib": round(n_params * dtype.itemsize / GIB, 2),
        "warmup": {}, "rows": [],
    }
    report["workload"]["kv_grad_dtype"] = str(config.grad_dtype)

    def save() -> None:
        for path in filter(None, [args.out, os.environ.get("OUT") and os.path.join(os.environ["OUT"], "step.json")]):
            with open(path, "w") as f:
                json.dump(report, f, indent=2)

    for mode in args.modes:
        ids = torch.randint(0, shape.vocab_size, (1, args.warmup_tokens), device=device)
        start = time.perf_counter()
        runs[mode](model, ids)
        sync(device)
        report["warmup"][mode] = {"tokens": args.warmup_tokens, "seconds": round(time.perf_counter() - start, 2)}
        print(f"warm-up {mode}: {report['warmup'][mode]}", flush=True)
    last = {}  # mode -> (tokens, seconds) of its last completed step
    stopped = set()
    for tokens in args.contexts:
        ids = torch.randint(0, shape.vocab_size, (1, tokens), device=device)
        for mode in args.modes:
            row = {"mode": mode, "tokens": tokens}
            if mode in stopped:
                row["status"] = "skipped: out of memory at a shorter context"
            elif mode in last and last[mode][1] * (tokens / last[mode][0]) ** 2 > deadline - time.perf_counter():
                row["status"] = (f"skipped: predicted {last[mode][1] * (tokens / last[mode][0]) ** 2:.0f} s "
                                 f"exceeds the time left")
            else:
                try:
                    row.update(measure(runs[mode], model, ids, device), status="ok")
                    last[mode] = (tokens, row["seconds"])
                except torch.cuda.OutOfMemoryError:
                    row["status"] = "out of memory"
                    stopped.add(mode)
                    model.zero_grad(set_to_none=True)
                    gc.collect()
                    torch.cuda.empty_cache()
            if mode == "oomb":
                row["predicted_above_weights_gib"] = estimate_step_memory(
                    shape, tokens, config, dtype=dtype, trainable_params=n_params).as_gib()
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
            save()
    save()


if __name__ == "__main__":
    main()
