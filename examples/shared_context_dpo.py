"""DPO over one long context: preference pairs that share their prompt, the prompt computed once.

    # a tiny random Llama and random tokens: runs on a CPU in seconds
    python examples/shared_context_dpo.py
    # the real SmolLM2-135M (converted once from its wheel), or any local model directory, on the GPU
    python examples/shared_context_dpo.py --model smollm2 --context 131072 --chunk 4096 --device cuda

Each step takes one context and P (chosen, rejected) pairs of answers to it, computes the reference
model's summed log-probabilities with ``oomb.shared_context_logprobs`` (stage 1 alone), then one
``oomb.shared_context_backward`` with TRL's sigmoid DPO loss: the context's pages are filled once and
shared by all 2P answers, and the gradient is that of the loss on the 2P full sequences
(docs/shared_context.md). The reference model here is a frozen copy of the starting weights.
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import oomb
from oomb.cli_options import resolve_model
from oomb.shared_context import dpo_sigmoid_loss

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=160,
            intermediate_size=128, max_position_embeddings=1 << 20)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local model directory, or smollm2 (default: a tiny random Llama)")
    parser.add_argument("--context", type=int, default=1000, help="context tokens")
    parser.add_argument("--pairs", type=int, default=2, help="preference pairs per context")
    parser.add_argument("--answer", type=int, default=40, help="tokens per answer")
    parser.add_argument("--chunk", type=int, default=256, help="oomb chunk size")
    parser.add_argument("--page", type=int, default=64, help="oomb page size")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default="cpu")
    return parser.parse_args(argv)


def load_model(args) -> torch.nn.Module:
    if args.model:
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        return AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=dtype).to(args.device)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).to(args.device)


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    model = load_model(args)
    reference_model = copy.deepcopy(model).eval().requires_grad_(False)
    config = oomb.OOMBConfig(chunk_size=args.chunk, page_size=args.page)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    losses = []
    for step in range(args.steps):
        # Stand-ins for a real dataset: one context, P chosen answers, then their P rejected answers (TRL's order).
        context = torch.randint(0, vocab, (args.context,), generator=generator).to(args.device)
        answers = [torch.randint(0, vocab, (args.answer,), generator=generator).to(args.device)
                   for _ in range(2 * args.pairs)]
        reference = oomb.shared_context_logprobs(reference_model, context, answers, config=config).sums
        loss = oomb.shared_context_backward(
            model, context, answers, config=config,
            loss_fn=lambda logps, ref=reference: dpo_sigmoid_loss(logps, ref, args.beta))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        print(f"step {step}: DPO loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
