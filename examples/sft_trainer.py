"""Supervised fine-tuning with TRL's SFTTrainer on long sequences, through oomb: one line changes.

    # a local model and a jsonl of {"messages": [...]}, {"prompt": ..., "completion": ...} or {"text": ...}
    python examples/sft_trainer.py --model /models/Qwen2.5-7B --data chats.jsonl --seq-len 131072 --lora
    # random weights of a preset shape (oomb/training/presets.py) and oomb's byte tokenizer: a smoke or memory run
    python examples/sft_trainer.py --preset qwen2.5-7b --data chats.jsonl --seq-len 32768 --lora --max-steps 2
    # the same script on the plain SFTTrainer, for a comparison
    python examples/sft_trainer.py ... --plain
    # the step options `oomb train` chose (its output's config.yaml), and a JSON summary
    python examples/sft_trainer.py ... --oomb-from runs/train/config.yaml --summary sft.json

Everything except the import of SFTTrainer (and the oomb_config argument) is an ordinary TRL script:
the dataset, the collator, the logging, the checkpoints and the accelerate launch stay what they were.
Each micro-batch is one long sequence (per_device_train_batch_size=1): oomb's step runs it chunk by chunk,
so GPU memory no longer grows with the activations of the whole sequence. It prints, at the end, the
losses, the step times (a callback: wall time from on_step_begin to on_step_end, CUDA synchronized at
both) and the peak GPU memory per step. See docs/trainer_integration.md; benchmarks/sft_trainer_vs_train.py
times it against `oomb train` on the same settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
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
    oomb = p.add_argument_group("oomb's step (OOMBConfig; unset: --oomb-from's value, else OOMBConfig's default)")
    oomb.add_argument("--oomb-from", metavar="YAML",
                      help="OOMBConfig from a YAML file: its `oomb:` section (e.g. the config.yaml of an `oomb train` "
                           "run, which records the options it chose) or a mapping of OOMBConfig fields")
    oomb.add_argument("--chunk-size", type=int, help="tokens per chunk (default 4096)")
    oomb.add_argument("--page-size", type=int, help="tokens per KV page (default 128)")
    oomb.add_argument("--kv-grad-dtype", help="dK/dV pages: float32 (exact, default) or bfloat16 (half)")
    oomb.add_argument("--offload", action=argparse.BooleanOptionalAction,
                      help="keep the KV pages in pinned host memory")
    oomb.add_argument("--backend", help="auto (default), torch, triton or cudnn")
    oomb.add_argument("--checkpoint-layers", action=argparse.BooleanOptionalAction,
                      help="layer replay in backward (default on; off is faster when a chunk's activations fit)")
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every this many steps (0: only at the end)")
    p.add_argument("--seed", type=int, default=0, help="random weights (--preset), LoRA init and data order")
    p.add_argument("--plain", action="store_true", help="run TRL's own SFTTrainer (no oomb) for comparison")
    p.add_argument("--no-save", action="store_true", help="skip trainer.save_model() at the end")
    p.add_argument("--summary", metavar="JSON", help="also write the summary printed at the end to this file")
    return p.parse_args(argv)


def oomb_config_from(args: argparse.Namespace) -> OOMBConfig:
    """--oomb-from's options, then the flags given, over OOMBConfig's defaults."""
    options = {}
    if args.oomb_from:
        import yaml

        with open(args.oomb_from) as f:
            loaded = yaml.safe_load(f) or {}
        # "auto" (an option left to oomb train's chooser, which did not run): OOMBConfig's default
        def known(section: dict) -> dict:
            return {k: known(v) if isinstance(v, dict) else v for k, v in section.items() if v != "auto"}

        options = known(loaded.get("oomb", loaded))
    flags = {"chunk_size": args.chunk_size, "page_size": args.page_size, "precision.kv_grad_dtype": args.kv_grad_dtype,
             "offload.enabled": args.offload, "performance.backend": args.backend,
             "performance.checkpoint_layers": args.checkpoint_layers}
    options.update({k: v for k, v in flags.items() if v is not None})
    return OOMBConfig.from_dict(options)


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
    """Wall time and peak GPU memory of each optimizer step, for the summary.

    From on_step_begin to on_step_end, CUDA synchronized at both: the training step(s) of the optimizer
    step, clipping, the optimizer and the scheduler. Not inside: fetching and collating the batch (the
    Trainer does it before on_step_begin) and logging (after on_step_end)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.peaks_gib: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._start)
        if torch.cuda.is_available():
            self.peaks_gib.append(torch.cuda.max_memory_allocated() / 2**30)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
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
    oomb_config = None
    if args.plain:
        trainer = PlainSFTTrainer(**common, callbacks=[timer])
    else:
        oomb_config = oomb_config_from(args)
        trainer = SFTTrainer(**common, callbacks=[timer], oomb_config=oomb_config)
    setup_seconds = time.perf_counter() - started
    trainer.train()
    train_seconds = time.perf_counter() - started - setup_seconds
    if not args.no_save:
        trainer.save_model()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    tokens = [int(h["num_tokens"]) for h in logs if "num_tokens" in h]
    summary = {
        "trainer": type(trainer).__name__, "seq_len": args.seq_len,
        "tokens_per_step": [b - a for a, b in zip([0, *tokens], tokens, strict=False)],
        "losses": [h["loss"] for h in logs],
        "grad_norms": [h.get("grad_norm") for h in logs],
        "step_seconds": [round(t, 3) for t in timer.times],
        "first_step_seconds": round(timer.times[0], 3) if timer.times else None,
        "median_later_step_seconds": round(statistics.median(timer.times[1:]), 3) if len(timer.times) > 1 else None,
        "step_peak_gpu_gib": [round(g, 2) for g in timer.peaks_gib],
        "peak_gpu_gib": round(max(timer.peaks_gib), 2) if timer.peaks_gib else None,  # weights included
        "setup_seconds": round(setup_seconds, 1), "train_seconds": round(train_seconds, 1),
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "oomb_config": dataclasses.asdict(oomb_config) if oomb_config is not None else None,
    }
    line = json.dumps(summary, default=str)
    print(line)
    if args.summary:
        with open(args.summary, "w") as f:
            f.write(line + "\n")
    return summary


if __name__ == "__main__":
    main()
