"""`oomb demo`: a few optimizer steps of a tiny Qwen2-shaped model on 16K-token sequences.

Everything it needs is on the machine: the model has random weights (saved and loaded back
through ``save_pretrained``/``from_pretrained``), the text is this package's own source, read
byte by byte (vocabulary 256), so nothing is downloaded. It ends by checking one step's
gradients against an ordinary full-sequence backward.
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import Qwen2Config, Qwen2ForCausalLM

from ..config import OOMBConfig
from ..engine import forward_backward
from ..training.presets import TINY_PRESET, preset_config
from ..units import parse_tokens

logger = logging.getLogger(__name__)

@dataclass
class DemoOptions:
    steps: int = 4
    seq_len: int = 16384
    chunk_size: int = 4096
    page_size: int = 128
    lr: float = 3e-3
    seed: int = 0
    device: str = "cpu"


def tiny_qwen2_config(max_positions: int) -> Qwen2Config:
    """A Qwen2-shaped model small enough to train on 16K tokens on two CPU cores (oomb.training.presets)."""
    return preset_config(TINY_PRESET, max_positions)


def embedded_corpus() -> bytes:
    """This package's own source files, concatenated: text that ships with oomb."""
    root = Path(__file__).resolve().parent.parent  # the oomb package, not only oomb/tools/
    return b"\n".join(p.read_bytes() for p in sorted(root.rglob("*.py")))


def byte_sequences(corpus: bytes, seq_len: int, count: int) -> list[torch.Tensor]:
    """``count`` windows of ``seq_len`` bytes, walking through the corpus (wrapping around)."""
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
    repeats = -(-(seq_len * count) // data.numel())
    data = data.repeat(repeats)
    return [data[i * seq_len:(i + 1) * seq_len][None] for i in range(count)]


def peak_rss_mib() -> float:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def gradient_relative_error(model: torch.nn.Module, input_ids: torch.Tensor, config: OOMBConfig) -> tuple:
    """Relative error of oomb's gradients vs the full-sequence backward, and both losses."""
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    ref_loss = model(input_ids=input_ids, labels=input_ids).loss
    ref_loss.backward()
    reference = [p.grad.detach().clone() for p in params]
    model.zero_grad(set_to_none=True)
    loss = forward_backward(model, input_ids, config=config)
    diff = sum(float(((p.grad - r) ** 2).sum()) for p, r in zip(params, reference, strict=True))
    norm = sum(float((r**2).sum()) for r in reference)
    model.zero_grad(set_to_none=True)
    return (diff / norm) ** 0.5, float(loss), float(ref_loss.detach())


def run_demo(options: DemoOptions) -> dict:
    torch.manual_seed(options.seed)
    device = torch.device(options.device)
    config = OOMBConfig(chunk_size=options.chunk_size, page_size=options.page_size)
    with tempfile.TemporaryDirectory(prefix="oomb-demo-") as model_dir:
        Qwen2ForCausalLM(tiny_qwen2_config(options.seq_len)).save_pretrained(model_dir)
        model = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"oomb demo: tiny Qwen2 ({n_params / 1e6:.2f} M parameters, random weights) on {device}, "
          f"{options.steps} steps of {options.seq_len} tokens, chunk {options.chunk_size}, "
          f"page {options.page_size}")
    sequences = byte_sequences(embedded_corpus(), options.seq_len, options.steps + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr)
    losses = []
    bar = tqdm(sequences[: options.steps], desc="training", unit="step", file=sys.stdout)
    start = time.perf_counter()
    for step, ids in enumerate(bar, 1):
        ids = ids.to(device)
        optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = float(forward_backward(model, ids, config=config))
        optimizer.step()
        losses.append(loss)
        tokens_per_s = ids.numel() / (time.perf_counter() - t0)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", rss_mib=f"{peak_rss_mib():,.0f}")
        logger.info("step %d loss %.4f tokens/s %.0f", step, loss, tokens_per_s)
    elapsed = time.perf_counter() - start
    total_tokens = options.steps * options.seq_len
    print(f"losses: {' -> '.join(f'{x:.3f}' for x in losses)}")
    print(f"{total_tokens / elapsed:,.0f} tokens/s, peak RSS {peak_rss_mib():,.0f} MiB")

    rel_err, oomb_loss, hf_loss = gradient_relative_error(model, sequences[-1].to(device), config)
    ok = rel_err <= 1e-5 and abs(oomb_loss - hf_loss) <= 1e-5 * abs(hf_loss)
    print(f"gradient check vs full-sequence backward ({options.seq_len} tokens): relative error "
          f"{rel_err:.2e}, loss {oomb_loss:.6f} vs {hf_loss:.6f}: {'OK' if ok else 'MISMATCH'}")
    return {"losses": losses, "tokens_per_s": total_tokens / elapsed, "peak_rss_mib": peak_rss_mib(),
            "grad_relative_error": rel_err, "ok": ok}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `oomb demo`."""
    defaults = DemoOptions()
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    parser.add_argument("--seq-len", type=parse_tokens, default=defaults.seq_len, help="tokens per sequence")
    parser.add_argument("--chunk-size", type=parse_tokens, default=defaults.chunk_size)
    parser.add_argument("--page-size", type=parse_tokens, default=defaults.page_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--device", default=defaults.device, help="cpu or cuda")


def main(args: argparse.Namespace) -> int:
    """Run `oomb demo`; exit code 1 if the final gradient check fails."""
    result = run_demo(DemoOptions(steps=args.steps, seq_len=args.seq_len, chunk_size=args.chunk_size,
                                  page_size=args.page_size, lr=args.lr, seed=args.seed, device=args.device))
    return 0 if result["ok"] else 1
