"""Supervised fine-tuning with TRL's SFTTrainer on long sequences, through oomb: one line changes.

    # a local model and a jsonl of {"messages": [...]}, {"prompt": ..., "completion": ...} or {"text": ...}
    python examples/sft_trainer.py --model /models/Qwen2.5-7B --data chats.jsonl --seq-len 131072 --lora
    # random weights of a preset shape (oomb/training/presets.py) and oomb's byte tokenizer: a smoke or memory run
    python examples/sft_trainer.py --preset qwen2.5-7b --data chats.jsonl --seq-len 32768 --lora --max-steps 2
    # the same script on the plain SFTTrainer, for a comparison
    python examples/sft_trainer.py ... --plain

Everything except the import of SFTTrainer (and the oomb_config argument) is an ordinary TRL script:
the dataset, the collator, the logging, the checkpoints and the accelerate launch stay what they were.
Each micro-batch is one long sequence (per_device_train_batch_size=1): oomb's step runs it chunk by chunk,
so GPU memory no longer grows with the activations of the whole sequence. It prints, at the end, the
step times and the peak GPU memory. See docs/trainer_integration.md.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed
from trl import SFTConfig
from trl import SFTTrainer as PlainSFTTrainer

from oomb import OOMBConfig
from oomb import OOMBSFTTrainer as SFTTrainer  # the one line: was `from trl import SFTTrainer`


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="local Hugging Face model directory (config, weights, tokenizer)")
    source.add_argument("--preset", help="random weights of an oomb preset shape, e.g. qwen2.5-7b, tiny-qwen2")
    p.add_argument("--data", required=True, help="jsonl file: messages, prompt/completion or text rows")
    p.add_argument("--seq-len", type=int, required=True, help="SFTConfig.max_length: tokens per sequence")
    p.add_argument("--output-dir", default="out/sft")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--lora", action="store_true", help="LoRA (r 16, all linear layers) instead of full fine-tuning")
    p.add_argument("--packing", action="store_true", help="pack rows into seq-len sequences")
    p.add_argument("--packing-strategy", default="bfd",
                   help="TRL's: bfd (padding-free: attention stays inside each document) or wrapped (one text)")
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--kv-grad-dtype", default="float32", help="dK/dV pages: float32 (exact) or bfloat16 (half)")
    p.add_argument("--offload", action="store_true", help="keep the KV pages in pinned host memory")
    p.add_argument("--backend", default="auto", help="auto, torch, triton or cudnn")
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every this many steps (0: only at the end)")
    p.add_argument("--seed", type=int, default=0, help="random weights (--preset), LoRA init and data order")
    p.add_argument("--plain", action="store_true", help="run TRL's own SFTTrainer (no oomb) for comparison")
    return p.parse_args(argv)


def load_model_and_tokenizer(args: argparse.Namespace, dtype: torch.dtype, device: str):
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
        return model, AutoTokenizer.from_pretrained(args.model)
    from oomb.training.presets import byte_tokenizer, preset_config

    config = preset_config(args.preset, args.seq_len)
    config._attn_implementation = "sdpa"
    with torch.device(device):  # initialise on the GPU: a 7B model's random init is slow on the CPU
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model, byte_tokenizer()


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (synchronised), for the summary line."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._start)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32  # fp32 on a CPU: bf16 there is slow
    set_seed(args.seed)  # the same random weights and LoRA init for the plain and the oomb run
    model, tokenizer = load_model_and_tokenizer(args, dtype, "cuda" if cuda else "cpu")
    dataset = load_dataset("json", data_files=args.data, split="train")
    config = SFTConfig(
        output_dir=args.output_dir, max_length=args.seq_len, per_device_train_batch_size=1,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, max_steps=args.max_steps,
        logging_steps=1, save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        bf16=cuda, use_cpu=not cuda, seed=args.seed, report_to="none", packing=args.packing,
        packing_strategy=args.packing_strategy,
        gradient_checkpointing=args.plain,  # the plain trainer needs it at long context; oomb replaces it
    )
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    common = dict(model=model, args=config, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config)
    timer = StepTimer()
    set_seed(args.seed)
    if args.plain:
        trainer = PlainSFTTrainer(**common, callbacks=[timer])
    else:
        oomb_config = OOMBConfig(chunk_size=args.chunk_size, page_size=args.page_size, kv_grad_dtype=args.kv_grad_dtype,
                                 offload=args.offload, backend=args.backend)
        trainer = SFTTrainer(**common, callbacks=[timer], oomb_config=oomb_config)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    trainer.save_model()
    summary = {
        "trainer": type(trainer).__name__, "seq_len": args.seq_len,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "step_seconds": [round(t, 2) for t in timer.times],
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
