"""Context extension of a real model, 8K -> 32K (YaRN x4) with LoRA: HF vs oomb dense vs oomb sparse.

    # tokenize the data once, on any machine (SmolLM2's tokenizer, Python's stdlib and docs)
    python benchmarks/context_extension.py prepare --out data/ctx
    # on a GPU: train every arm on the same data, seed and steps; evaluate each with plain HF attention
    python benchmarks/context_extension.py run --data data/ctx --model <smollm2 dir> --out out/ctx --steps 40

Arms: "hf" (transformers + SDPA + gradient checkpointing, one full-sequence backward), "dense" (oomb,
exact), and "sparse" (oomb sparse mode with the settings given by --sparse, default: OOMBConfig's sparse
defaults), plus any further sparse arms named by --sparse-arm. Every trained adapter, and the untrained
model, is evaluated with dense (exact) attention through oomb's stage-1 forward (oomb/evaluate.py, the
library's evaluation: oomb/perplexity.py, oomb/passkey.py): held-out perplexity by position bucket
(0-8K, 8K-16K, 16K-32K) on English documentation and on code, and passkey retrieval at 8K/16K/32K with a
fixed set of prompts, judged teacher-forced (retrieved iff the greedy prediction at every answer token is
right). Writes one JSON (losses per step, evaluations, timings) and a PNG of the learning curves.

Training data: Python's standard library source (each module a document, concatenated with EOS),
cut into sequences of --seq-len tokens; held out: the last sequences of that stream and Python's
English help topics (oomb/real_model.py's english_text), which training never sees.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import sysconfig
import time
from dataclasses import asdict
from datetime import date
from pathlib import Path

import numpy as np
import torch

from oomb.config import PerformanceConfig

PASSKEY_LENGTHS = (8192, 16384, 32768)
PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
PASSKEY_SEEDS = 2  # prompts per (length, depth): 10 per length


def prepare(out: Path, seq_len: int, train_sequences: int) -> None:
    """Tokenize the training stream, the held-out sets and the passkey prompts into ``out``."""
    from transformers import AutoTokenizer

    from oomb.passkey import passkey_prompts
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
    prompts = passkey_prompts(tokenizer, PASSKEY_LENGTHS, PASSKEY_DEPTHS, PASSKEY_SEEDS, seed=0)
    (out / "passkey.json").write_text(json.dumps([asdict(p) for p in prompts]))
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


def evaluate(model, data: Path, config) -> dict:
    """Dense stage-1 forward (oomb.evaluate): per-bucket perplexity and passkey accuracy per length."""
    from oomb.evaluate import token_logprobs
    from oomb.passkey import PasskeyPrompt, passkey_accuracy
    from oomb.perplexity import PerplexityByPosition
    from oomb.units import format_tokens

    device = model.get_input_embeddings().weight.device
    result = {}
    for name in ("heldout_english", "heldout_code"):
        seqs = torch.from_numpy(np.load(data / f"{name}.npy").astype(np.int64))
        totals = PerplexityByPosition(seqs.shape[1])
        for row in seqs:
            totals.add(token_logprobs(model, row.to(device), config=config).logprobs)
        result[name] = {b["bucket"]: b["perplexity"] for b in totals.results()}
    prompts = [PasskeyPrompt(**p) for p in json.loads((data / "passkey.json").read_text())]
    points = passkey_accuracy(model, prompts, config)
    hits: dict[int, list[int]] = {}
    for point in points:
        hits.setdefault(point["length"], [0, 0])
        hits[point["length"]][0] += point["retrieved"]
        hits[point["length"]][1] += point["count"]
    result["passkey"] = {format_tokens(n): retrieved / count for n, (retrieved, count) in hits.items()}
    result["passkey_points"] = points
    return result


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
        config = OOMBConfig.from_dict(options)  # dotted keys ("sparse.budget") or the flat ones of old records
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
    evaluation = evaluate(model, args.data, eval_config(args))
    print(f"{arm} eval {evaluation}", flush=True)
    return {"losses": losses, "step_seconds": times, "eval": evaluation,
            "oomb_config": asdict(config) if config is not None else None}


def eval_config(args):
    """Every arm is evaluated alike: dense (exact) attention, the run's chunk, page and backend."""
    from oomb import OOMBConfig

    return OOMBConfig(chunk_size=args.chunk_size, page_size=args.page_size,
                      performance=PerformanceConfig(backend=args.backend))


def sparse_options(arm: str, args) -> dict:
    """The OOMBConfig options of a sparse arm: --sparse for "sparse", --sparse-arm NAME=JSON for the others."""
    if arm == "sparse":
        return json.loads(args.sparse)
    extra = dict(spec.split("=", 1) for spec in args.sparse_arm)
    if arm not in extra:
        raise SystemExit(f"arm {arm!r} needs --sparse-arm {arm}='{{...}}' (its OOMBConfig sparse options)")
    return json.loads(extra[arm])


def run(args) -> None:
    device = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"date": date.today().isoformat(), "command": "python " + " ".join(sys.argv),
              "machine": torch.cuda.get_device_name(), "commit": args.commit, "steps": args.steps,
              "seq_len": args.seq_len, "lr": args.lr, "seed": args.seed, "arms": {}}
    base = load_model(args.model, args.seq_len, device, lora=False)
    report["base_eval"] = evaluate(base, args.data, eval_config(args))
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
