"""Evaluation through stage 1: per-token log-probabilities against HF, buckets, passkeys, `oomb eval`, the trainer."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from helpers import build_tiny_model, save_tiny_model

from oomb import cli
from oomb.config import OffloadConfig, OOMBConfig, PerformanceConfig, SparseConfig
from oomb.evaluate import token_logprobs
from oomb.passkey import ANSWER, NEEDLE, QUESTION, judge_passkey, passkey_prompts
from oomb.perplexity import PerplexityByPosition, bucket_name, position_buckets
from oomb.training.config import TrainerConfig
from oomb.training.evaluation import held_out_sequences
from oomb.training.presets import BYTE_VOCAB, byte_tokenizer
from oomb.training.trainer import Trainer

TOKENS = 700  # chunks of 256: 256, 256, 188; pages of 64: the last page holds 60 tokens
CONFIG = OOMBConfig(chunk_size=256, page_size=64,  # loss slices cross chunk ends
                    performance=PerformanceConfig(loss_chunk_tokens=100, backend="torch"))
VOCAB = BYTE_VOCAB + 1


@pytest.fixture(scope="module")
def model_and_reference():
    """A tiny Llama, two random sequences, and HF's full-forward log-probabilities and logits."""
    model = build_tiny_model("llama", seed=11).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, TOKENS), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    want = logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # (B, T - 1): tokens 1..T-1
    return model, ids, want, logits


@pytest.mark.parametrize("offload", [False, True], ids=["gpu-tier", "offload"])
def test_logprobs_equal_a_full_hf_forward(model_and_reference, offload):
    """Dense stage 1, over three chunks with a partial last page, gives HF's log-probabilities to fp32 rounding,
    and the asked greedy predictions. Offload runs on the CPU too (synchronous copies, kv/offload.py)."""
    model, ids, want, logits = model_and_reference
    labels = ids.clone()
    labels[0, 300:340] = -100  # not scored: NaN, and the rest unchanged
    asked = torch.tensor([[1, 255, 256, 699], [5, 400, 512, 600]])
    got = token_logprobs(model, ids, labels, replace(CONFIG,
                                                        offload=OffloadConfig(enabled=offload)), predict_at=asked)
    assert got.logprobs.shape == (2, TOKENS) and got.logprobs.dtype == torch.float32
    assert got.logprobs[:, 0].isnan().all() and got.logprobs[0, 300:340].isnan().all()
    scored = ~labels[:, 1:].eq(-100)
    torch.testing.assert_close(got.logprobs[:, 1:][scored], want[scored], rtol=1e-5, atol=1e-5)
    rows = torch.arange(2)[:, None]
    assert torch.equal(got.predictions, logits[rows, asked - 1].argmax(-1))


def test_full_budget_sparse_is_dense_and_small_budget_is_not(model_and_reference):
    model, ids, _, _ = model_and_reference
    dense = token_logprobs(model, ids, config=CONFIG).logprobs
    full = token_logprobs(model, ids, config=replace(CONFIG, attention="sparse",
                                                        sparse=SparseConfig(budget=100))).logprobs
    small = token_logprobs(model, ids, config=replace(CONFIG, attention="sparse",
                                                         sparse=SparseConfig(budget=1))).logprobs
    assert torch.equal(full.isnan(), dense.isnan()) and torch.equal(full.nan_to_num(), dense.nan_to_num())
    assert torch.equal(small[:, :257].nan_to_num(), dense[:, :257].nan_to_num())  # chunk 0 has no history
    assert not torch.equal(small.nan_to_num(), dense.nan_to_num())


def test_modes_are_restored_and_bad_positions_refused(model_and_reference):
    model, ids, _, _ = model_and_reference
    model.train()
    model.model.layers[0].eval()
    try:
        token_logprobs(model, ids[:, :64], config=CONFIG)
        assert model.training and model.model.layers[1].training and not model.model.layers[0].training
    finally:
        model.eval()
    with pytest.raises(ValueError, match=r"predict_at must lie in \[1, 64\)"):
        token_logprobs(model, ids[:, :64], config=CONFIG, predict_at=torch.tensor([0]))


def test_buckets_double_and_stop_at_the_length():
    k = 1024
    assert position_buckets(1 << 20) == [(0, 8 * k)] + [(2**i * k, 2 ** (i + 1) * k) for i in range(3, 10)]
    assert position_buckets(96 * k)[-2:] == [(32 * k, 64 * k), (64 * k, 96 * k)]
    assert position_buckets(3000, first=1024) == [(0, 1024), (1024, 2048), (2048, 3000)]
    assert position_buckets(1000) == [(0, 1000)]
    assert [bucket_name(*b) for b in position_buckets(1 << 20)][::7] == ["0-8K", "512K-1M"]


def test_bucket_means_are_token_weighted_over_sequences():
    totals = PerplexityByPosition(3000, first=1024)
    first = torch.full((3000,), -1.0)
    first[0] = math.nan  # token 0: nothing predicts it
    first[2048:] = -3.0
    first[2500:2600] = math.nan  # not scored
    second = torch.full((1, 3000), -2.0)
    second[0, 0] = math.nan
    totals.add(first)
    totals.add(second)
    results = totals.results()
    assert [r["tokens"] for r in results] == [1023 + 1023, 1024 + 1024, 852 + 952]
    assert results[0]["mean_nll"] == pytest.approx(1.5) and results[1]["mean_nll"] == pytest.approx(1.5)
    assert results[2]["mean_nll"] == pytest.approx((852 * 3 + 952 * 2) / (852 + 952))
    assert results[2]["perplexity"] == pytest.approx(math.exp(results[2]["mean_nll"]))
    assert [r["bucket"] for r in results] == ["0-1K", "1K-2K", "2K-3,000"]
    with pytest.raises(ValueError, match="buckets made for 3000"):
        totals.add(torch.zeros(2999))


def test_passkeys_are_deterministic_and_the_key_sits_at_its_depth():
    tokenizer = byte_tokenizer()
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompts = passkey_prompts(tokenizer, [400, 600], [0.0, 0.5, 1.0], per_point=2, seed=7)
    assert prompts == passkey_prompts(tokenizer, [400, 600], [0.0, 0.5, 1.0], per_point=2, seed=7)
    assert [p.key for p in prompts] != [p.key for p in passkey_prompts(tokenizer, [400, 600], [0.0, 0.5, 1.0], 2, 8)]
    assert [(p.length, p.depth) for p in prompts][:3] == [(400, 0.0), (400, 0.0), (400, 0.5)]
    assert len({p.key for p in prompts}) == len(prompts) and all(len(p.key) == 5 for p in prompts)
    for p in prompts:
        needle, answer, question = encode(NEEDLE.format(key=p.key)), encode(ANSWER.format(key=p.key)), encode(QUESTION)
        assert len(p.input_ids) == p.length
        assert p.input_ids[p.needle_start:p.needle_start + len(needle)] == needle
        assert p.input_ids[p.answer_start:] == answer and p.answer_start == p.length - len(answer)
        room = p.length - len(needle) - len(question) - len(answer)  # filler tokens
        assert p.needle_start == round(p.depth * room)
        if p.depth == 1.0:  # right before the question
            assert p.input_ids[p.needle_start + len(needle):p.answer_start] == question
    filler = list(range(65, 75))
    custom = passkey_prompts(tokenizer, [300], [0.5], 1, seed=7, filler_ids=filler)[0]
    assert custom.input_ids[:10] == filler and custom.input_ids[10:20] == filler
    with pytest.raises(ValueError, match="shorter than the needle"):
        passkey_prompts(tokenizer, [50], [0.5], 1, seed=0)


def test_passkey_judgement_is_the_greedy_answer(model_dir):
    """Retrieved iff the argmax at every answer position is the answer's token, as in HF's logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt = passkey_prompts(byte_tokenizer(), [300], [0.5], 1, seed=3)[0]
    result = judge_passkey(model, prompt, CONFIG)
    ids = torch.tensor(prompt.input_ids)
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].float()
    greedy = logits[prompt.answer_start - 1:-1].argmax(-1)
    assert result["predicted"] == greedy.tolist()
    assert result["retrieved"] == (greedy.tolist() == prompt.input_ids[prompt.answer_start:])
    want = logits[prompt.answer_start - 1:-1].log_softmax(-1).gather(-1, ids[prompt.answer_start:, None]).sum()
    assert result["answer_logprob"] == pytest.approx(float(want), abs=1e-4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 with the byte tokenizer, saved like any local Hugging Face model."""
    path = save_tiny_model("qwen2", tmp_path_factory.mktemp("tiny-qwen2"), seed=3, vocab_size=VOCAB)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "heldout.jsonl"
    lines = [{"text": f"Held-out document {i}: " + "a stitch in time saves nine, " * (2 + i % 3)} for i in range(30)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_eval_command_writes_json_that_matches_hf(model_dir, data_file, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--model", str(model_dir), "--data", str(data_file), "--seq-len", "1K", "--sequences", "2",
                     "--passkey-lengths", "300", "400", "--passkey-depths", "0", "1", "--passkeys-per-point", "1",
                     "--chunk-size", "256", "--page-size", "64", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for expected in ("perplexity by position (2 sequence(s) of 1K tokens)", "0-1K", "passkey retrieval", "depth 0",
                     "depth 1", f"wrote {out}"):
        assert expected in text
    report = json.loads(out.read_text())
    assert report["options"]["seq_len"] == 1024 and report["oomb_config"]["attention"] == "dense"
    assert "threads" in report["machine"] and "command" in report
    (bucket,) = report["perplexity"]
    assert bucket["tokens"] == 2 * 1023
    # The same sequences through a plain HF forward give the same mean NLL.
    sequences = torch.stack(held_out_sequences(str(data_file), byte_tokenizer(), 1024, 2))
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(model(input_ids=sequences).logits[:, :-1].flatten(0, 1).float(),
                                                sequences[:, 1:].flatten())
    assert bucket["mean_nll"] == pytest.approx(float(nll), rel=1e-5)
    assert [(p["length"], p["depth"], p["count"]) for p in report["passkey"]] == [
        (300, 0.0, 1), (300, 1.0, 1), (400, 0.0, 1), (400, 1.0, 1)]


def test_eval_command_errors_name_value_and_fix(model_dir, data_file, tmp_path, capsys):
    common = ["--model", str(model_dir), "--chunk-size", "256", "--page-size", "64"]
    assert cli.main(["eval", *common, "--data", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt' is not a file" in capsys.readouterr().err
    assert cli.main(["eval", *common, "--data", str(data_file), "--seq-len", "64K"]) == 2
    err = capsys.readouterr().err
    tokens = sum(len(json.loads(line)["text"].encode()) + 1 for line in data_file.read_text().splitlines())
    assert f"holds {tokens:,} tokens, 0 whole sequence(s) of 65536 tokens" in err  # byte tokenizer: bytes + EOS
    assert "shorter sequence length" in err
    assert cli.main(["eval", "--model", "no-such-model", "--passkey-lengths", "300"]) == 2
    assert "--model 'no-such-model' is not a preset" in capsys.readouterr().err
    assert cli.main(["eval", *common]) == 2
    assert "nothing to evaluate" in capsys.readouterr().err
    assert cli.main(["eval", *common, "--data", str(data_file), "--json", str(tmp_path)]) == 2  # before evaluating
    assert f"--json '{tmp_path}' is a directory: give a file name" in capsys.readouterr().err
    assert cli.main(["eval", *common, "--data", str(data_file), "--json", str(tmp_path / "no" / "e.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_trainer_evaluates_every_n_steps_without_changing_training(model_dir, data_file, tmp_path, capsys):
    def config(out, **evaluation):
        return TrainerConfig.from_dict({
            "model": {"path": str(model_dir)},
            "data": {"paths": [str(data_file)], "seq_len": 128},
            "optim": {"lr": 3e-3},
            "train": {"max_steps": 3, "output_dir": str(out), "device": "cpu", "seed": 1},
            "checkpoint": {"every": 0, "export": False},
            "logging": {"progress": False},
            "oomb": {"chunk_size": 64, "page_size": 32, "performance": {"backend": "torch"}},
            "eval": evaluation,
        })

    plain = Trainer(config(tmp_path / "plain")).train()
    evaluated = config(tmp_path / "eval", every_steps=2, data=str(data_file), seq_len="256",
                       passkey_lengths=["200"], passkey_depths=[0, 1], passkeys_per_point=1)
    trainer = Trainer(evaluated)
    result = trainer.train()
    assert result.losses == plain.losses  # evaluation draws no random number and leaves the modes as they were
    assert trainer.model.training
    lines = [json.loads(line) for line in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "eval" in m] == [2, 3]  # every 2 steps, and after the last
    report = lines[1]["eval"]
    assert report["perplexity"][0]["tokens"] == 255 and len(report["passkey"]) == 2
    printed = capsys.readouterr().out  # without a progress bar the tables are printed all the same
    assert "eval after step 2" in printed and "eval after step 3" in printed and "passkey" in printed
    with pytest.raises(ValueError, match="nothing to evaluate"):
        config(tmp_path / "none", every_steps=2)


def test_hf_trainer_callback_evaluates_every_n_steps(tmp_path):
    from transformers import Trainer, TrainingArguments

    from oomb.training.config import EvalSection
    from oomb.training.hf_trainer import OOMBEvalCallback

    model = build_tiny_model("llama", vocab_size=VOCAB)
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, VOCAB, (8, 64), generator=generator)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=1)
    callback = OOMBEvalCallback(byte_tokenizer(), EvalSection(every_steps=2, passkey_lengths=[200],
                                                              passkey_depths=[0.5], passkeys_per_point=1),
                                CONFIG)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    evaluations = [h for h in trainer.state.log_history if "oomb_eval" in h]
    assert [h["step"] for h in evaluations] == [2, 3]
    assert evaluations[0]["oomb_eval"]["passkey"][0]["count"] == 1 and trainer.model.training
    with pytest.raises(ValueError, match="every_steps > 0"):
        OOMBEvalCallback(byte_tokenizer(), EvalSection())


def test_eval_takes_a_lora_adapter_directory(model_dir, data_file, tmp_path, capsys):
    """What `oomb train --lora` exports (an adapter beside its tokenizer) evaluates as its base with the adapter merged:
    the same NLL as the merged model through plain HF; an adapter whose base is not here is refused by name."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    adapter = tmp_path / "final"
    lora.save_pretrained(adapter)
    byte_tokenizer().save_pretrained(adapter)
    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--model", str(adapter), "--data", str(data_file), "--seq-len", "1K", "--sequences", "1",
                     "--chunk-size", "256", "--page-size", "64", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "LoRA adapter merged into" in report["model"]
    sequences = torch.stack(held_out_sequences(str(data_file), byte_tokenizer(), 1024, 1))
    merged = lora.merge_and_unload().eval()
    with torch.no_grad():
        logits = merged(input_ids=sequences).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), sequences[:, 1:].flatten())
        plain = AutoModelForCausalLM.from_pretrained(model_dir).eval()(input_ids=sequences).logits[:, :-1]
    assert float(nll) != pytest.approx(float(torch.nn.functional.cross_entropy(
        plain.flatten(0, 1).float(), sequences[:, 1:].flatten())), rel=1e-4)  # the adapter changes the model
    assert report["perplexity"][0]["mean_nll"] == pytest.approx(float(nll), rel=1e-5)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    capsys.readouterr()
    assert cli.main(["eval", "--model", str(adapter), "--data", str(data_file), "--seq-len", "1K"]) == 2
    assert "is a LoRA adapter whose base model (none recorded)" in capsys.readouterr().err


def test_short_eval_data_is_refused_without_the_training_warning(model_dir, tmp_path, caplog, capsys):
    """A file shorter than one sequence: one error, not the trainer's "every sequence repeats it" warning before it."""
    short = tmp_path / "short.txt"
    short.write_text("short text.\n")
    assert cli.main(["eval", "--model", str(model_dir), "--data", str(short), "--seq-len", "1K",
                     "--chunk-size", "256", "--page-size", "64"]) == 2
    err = capsys.readouterr().err
    assert "holds 13 tokens, 0 whole sequence(s)" in err  # the byte tokenizer: 12 bytes and the EOS
    assert not [r for r in caplog.records if "repeats it" in r.getMessage()]


def test_eval_section_takes_token_strings_and_the_callback_refuses_nothing_to_evaluate():
    """From Python as from YAML: '1K' is 1024; a callback with neither data nor passkeys would evaluate nothing."""
    import oomb

    options = oomb.EvalSection(every_steps=2, seq_len="1K", passkey_lengths=["512", 300])
    assert (options.seq_len, options.passkey_lengths) == (1024, [512, 300])
    with pytest.raises(ValueError, match="eval.seq_len='lots'"):
        oomb.EvalSection(seq_len="lots")
    with pytest.raises(ValueError, match="nothing to evaluate"):
        oomb.OOMBEvalCallback(byte_tokenizer(), oomb.EvalSection(every_steps=2))


def test_eval_reads_the_documents_field_it_is_given(model_dir, data_file, tmp_path, capsys):
    """A jsonl whose documents sit under another key: refused with eval's own fix (not data.text_field, which
    oomb eval cannot set), and --text-field reads the same tokens as the "text" file."""
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_text("".join(json.dumps({"content": json.loads(line)["text"]}) + "\n"
                               for line in data_file.read_text().splitlines()))
    common = ["eval", "--model", str(model_dir), "--seq-len", "1K", "--chunk-size", "256", "--page-size", "64"]
    assert cli.main([*common, "--data", str(renamed)]) == 2
    err = capsys.readouterr().err
    assert "keys: ['content']" in err and "oomb eval --text-field" in err and "data.text_field" not in err
    original, again = tmp_path / "original.json", tmp_path / "again.json"
    assert cli.main([*common, "--data", str(data_file), "--json", str(original)]) == 0
    assert cli.main([*common, "--data", str(renamed), "--text-field", "content", "--json", str(again)]) == 0
    assert json.loads(again.read_text())["perplexity"] == json.loads(original.read_text())["perplexity"]
    # The trainer's evaluation reads its data.text_field unless eval.text_field says otherwise.
    config = TrainerConfig.from_dict({
        "model": {"path": str(model_dir)},
        "data": {"paths": [str(renamed)], "seq_len": 128, "text_field": "content"},
        "train": {"max_steps": 1, "output_dir": str(tmp_path / "run"), "device": "cpu"},
        "checkpoint": {"every": 0, "export": False}, "logging": {"progress": False},
        "oomb": {"chunk_size": 64, "page_size": 32, "performance": {"backend": "torch"}},
        "eval": {"every_steps": 1, "data": str(renamed), "seq_len": 256},
    })
    Trainer(config).train()
    (line,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert line["eval"]["perplexity"][0]["tokens"] == 255
