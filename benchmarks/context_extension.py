"""Context extension of a real model, 8K -> 32K (YaRN x4) with LoRA: HF vs oomb dense vs oomb sparse.

    # tokenize the data once, on any machine (SmolLM2's tokenizer, Python's stdlib and docs)
    python benchmarks/context_extension.py prepare --out data/ctx
    # on a GPU: train every arm on the same data, seed and steps; evaluate each with plain HF attention
    python benchmarks/context_extension.py run --data data/ctx --model <smollm2 dir> --out out/ctx --steps 40

Arms: "hf" (transformers + SDPA + gradient checkpointing, one full-sequence backward), "dense" (oomb,
exact), and "sparse" (oomb sparse mode with the settings given by --sparse, default: OOMBConfig's sparse
defaults), plus any further sparse arms named by --sparse-arm. Every trained adapter, and the untrained
model, is evaluated with an ordinary HF forward (dense attention): held-out perplexity by position
bucket (0-8K, 8-16K, 16-32K) on English documentation and on code, and passkey retrieval at 8K/16K/32K
with a fixed set of prompts. Writes one JSON (losses per step, evaluations, timings) and a PNG of the
learning curves.

Training data: Python's standard library source (each module a document, concatenated with EOS),
cut into sequences of --seq-len tokens; held out: the last sequences of that stream and Python's
English help topics (oomb/real_model.py's english_text), which training never sees.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import sysconfig
import time
from dataclasses import asdict
from datetime import date
from pathlib import Path

import numpy as np
import torch

BUCKETS = ((0, 8192), (8192, 16384), (16384, 32768))
PASSKEY_LENGTHS = (8192, 16384, 32768)
PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
PASSKEY_SEEDS = 2  # prompts per (length, depth): 10 per length
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")


def prepare(out: Path, seq_len: int, train_sequences: int) -> None:
    """Tokenize the training stream, the held-out sets and the passkey prompts into ``out``."""
    from transformers import AutoTokenizer

    from oomb.real_model import english_text, smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    eos = tokenizer.eos_token_id
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    stream: list[int] = []
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        if "test" in path.parts[-2:][0] or path.name.startswith("test"):
            continue
        stream += tokenizer(path.read_text(errors="replace"))["input_ids"] + [eos]
        if len(stream) >= (train_sequences + 2) * seq_len:
            break
    need = (train_sequences + 2) * seq_len
    if len(stream) < need:
        raise SystemExit(f"only {len(stream)} stdlib tokens, need {need}")
    code = np.array(stream[:need], dtype=np.uint16).reshape(train_sequences + 2, seq_len)
    english = tokenizer(english_text())["input_ids"]
    n_eng = len(english) // seq_len
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "train.npy", code[:train_sequences])
    np.save(out / "heldout_code.npy", code[train_sequences:])
    np.save(out / "heldout_english.npy", np.array(english[: n_eng * seq_len], dtype=np.uint16).reshape(n_eng, seq_len))
    prompts = []
    rng = random.Random(0)
    filler_ids = tokenizer(FILLER)["input_ids"]
    for length in PASSKEY_LENGTHS:
        for depth in PASSKEY_DEPTHS:
            for _ in range(PASSKEY_SEEDS):
                key = str(rng.randint(10000, 99999))
                needle = tokenizer(f" The pass key is {key}. Remember it. {key} is the pass key. ")["input_ids"]
                question = tokenizer(" What is the pass key? The pass key is")["input_ids"]
                room = length - len(needle) - len(question) - 8
                filler = (filler_ids * (room // len(filler_ids) + 1))[:room]
                at = int(depth * room)
                ids = filler[:at] + needle + filler[at:] + question
                prompts.append({"length": length, "depth": depth, "key": key, "ids": ids})
    (out / "passkey.json").write_text(json.dumps(prompts))
    (out / "meta.json").write_text(json.dumps({"seq_len": seq_len, "train_sequences": train_sequences,
                                               "stdlib": str(stdlib), "python": platform.python_version()}))
    print(f"wrote {out}: train {code[:train_sequences].shape}, heldout code {code[train_sequences:].shape}, "
          f"english {n_eng} x {seq_len}, {len(prompts)} passkey prompts")


def load_model(path: Path, seq_len: int, device: torch.device, lora: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    original = config.max_position_embeddings
    factor = seq_len / original
    theta = config.rope_parameters["rope_theta"]
    config.rope_parameters = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
                              "rope_theta": theta}
    config.max_position_embeddings = seq_len
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").to(device)
    if lora:
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    return model


@torch.no_grad()
def evaluate(model, data: Path, device: torch.device) -> dict:
    """Plain HF forward (dense SDPA): per-bucket perplexity and passkey accuracy."""
    model.eval()
    result = {}
    for name in ("heldout_english", "heldout_code"):
        seqs = torch.from_numpy(np.load(data / f"{name}.npy").astype(np.int64))
        nll = torch.zeros(seqs.shape[1] - 1, dtype=torch.float64)
        for row in seqs:
            ids = row[None].to(device)
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0, :-1]
            head = model.get_output_embeddings()
            for s in range(0, hidden.shape[0], 4096):
                logits = head(hidden[s: s + 4096]).float()
                nll[s: s + 4096] += torch.nn.functional.cross_entropy(logits, ids[0, 1 + s: 1 + s + 4096],
                                                                      reduction="none").double().cpu()
        nll /= seqs.shape[0]
        # Position p of nll predicts token p + 1.
        result[name] = {f"{a // 1024}-{b // 1024}K": math.exp(float(nll[max(a - 1, 0): b - 1].mean()))
                        for a, b in BUCKETS if b <= seqs.shape[1]}
    prompts = json.loads((data / "passkey.json").read_text())
    hits: dict[int, list[bool]] = {}
    for p in prompts:
        ids = torch.tensor(p["ids"], device=device)[None]
        out = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
        text = TOKENIZER.decode(out[0, ids.shape[1]:])
        hits.setdefault(p["length"], []).append(p["key"] in text)
    result["passkey"] = {f"{n // 1024}K": sum(h) / len(h) for n, h in hits.items()}
    model.train()
    return result


TOKENIZER = None


def train_arm(arm: str, args, device: torch.device) -> dict:
    from oomb import OOMBConfig, forward_backward

    torch.manual_seed(args.seed)
    model = load_model(args.model, args.seq_len, device, lora=True)
    if arm == "hf":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    config = None
    if arm != "hf":
        options = dict(chunk_size=args.chunk_size, page_size=args.page_size, backend=args.backend)
        if arm.startswith("sparse"):
            options.update(attention="sparse", **sparse_options(arm, args))
        config = OOMBConfig(**options)
    train = torch.from_numpy(np.load(args.data / "train.npy").astype(np.int64))
    model.train()
    losses, times = [], []
    for step in range(args.steps):
        ids = train[step % train.shape[0]][None].to(device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        if arm == "hf":
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        else:
            loss = forward_backward(model, ids, config=config)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        print(f"{arm} step {step} loss {losses[-1]:.4f} {times[-1]:.2f} s", flush=True)
    if arm == "hf":
        model.gradient_checkpointing_disable()
    evaluation = evaluate(model, args.data, device)
    print(f"{arm} eval {evaluation}", flush=True)
    return {"losses": losses, "step_seconds": times, "eval": evaluation,
            "oomb_config": asdict(config) if config is not None else None}


def sparse_options(arm: str, args) -> dict:
    """The OOMBConfig options of a sparse arm: --sparse for "sparse", --sparse-arm NAME=JSON for the others."""
    if arm == "sparse":
        return json.loads(args.sparse)
    extra = dict(spec.split("=", 1) for spec in args.sparse_arm)
    if arm not in extra:
        raise SystemExit(f"arm {arm!r} needs --sparse-arm {arm}='{{...}}' (its OOMBConfig sparse options)")
    return json.loads(extra[arm])


def run(args) -> None:
    global TOKENIZER
    from transformers import AutoTokenizer

    device = torch.device("cuda")
    TOKENIZER = AutoTokenizer.from_pretrained(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"date": date.today().isoformat(), "command": "python " + " ".join(sys.argv),
              "machine": torch.cuda.get_device_name(), "commit": args.commit, "steps": args.steps,
              "seq_len": args.seq_len, "lr": args.lr, "seed": args.seed, "arms": {}}
    base = load_model(args.model, args.seq_len, device, lora=False)
    report["base_eval"] = evaluate(base, args.data, device)
    print(f"base eval {report['base_eval']}", flush=True)
    del base
    for arm in args.arms:
        report["arms"][arm] = train_arm(arm, args, device)
        (args.out / "context_extension.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "context_extension.png")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, result in report["arms"].items():
        ax.plot(range(1, len(result["losses"]) + 1), result["losses"], label=arm, alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss ({report['seq_len'] // 1024}K tokens)")
    ax.set_title("SmolLM2-135M, 8K -> 32K (YaRN x4), LoRA r=16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--train-sequences", type=int, default=40)
    r = sub.add_parser("run")
    r.add_argument("--data", type=Path, required=True)
    r.add_argument("--model", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--arms", nargs="+", default=["hf", "dense", "sparse"])
    r.add_argument("--steps", type=int, default=40)
    r.add_argument("--seq-len", type=int, default=32768)
    r.add_argument("--lr", type=float, default=2e-4)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--chunk-size", type=int, default=4096)
    r.add_argument("--page-size", type=int, default=128)
    r.add_argument("--backend", default="cudnn")
    r.add_argument("--sparse", default="{}", help="JSON of OOMBConfig sparse options for the sparse arm")
    r.add_argument("--sparse-arm", action="append", default=[], metavar="NAME=JSON",
                   help="a further sparse arm (NAME starts with 'sparse', listed in --arms) and its options, "
                        "e.g. sparse_b32='{\"sparse_budget\": 32}'")
    r.add_argument("--commit", default="unknown")
    args = parser.parse_args()
    if args.cmd == "prepare":
        prepare(args.out, args.seq_len, args.train_sequences)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
