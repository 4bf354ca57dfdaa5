"""oomb.Trainer: runs, exact resume, Ctrl-C, LoRA export, fp32 masters, accumulation, actionable errors."""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import statistics

import pytest
import torch
from helpers import build_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

import oomb
import oomb.training.trainer
from oomb.training.checkpoint import load_checkpoint
from oomb.training.config import TrainerConfig
from oomb.training.data import PackedSequences, resolve_files
from oomb.training.presets import BYTE_VOCAB, byte_tokenizer
from oomb.training.trainer import NotEnoughMemoryError, Trainer

VOCAB = BYTE_VOCAB + 1  # the byte tokenizer's 256 bytes + <|endoftext|>


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 and the byte tokenizer, saved like any local Hugging Face model."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    build_tiny_model("qwen2", seed=3, vocab_size=VOCAB).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    lines = [{"text": f"Document {i}. " + "the quick brown fox jumps over the lazy dog " * (1 + i % 5)}
             for i in range(60)]
    lines.insert(7, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def make_config(out, model_dir, data_file, **sections) -> TrainerConfig:
    options = {
        "model": {"path": str(model_dir)},
        "data": {"paths": [str(data_file)], "seq_len": 256, "documents": "separate"},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "train": {"max_steps": 4, "output_dir": str(out), "device": "cpu", "seed": 1},
        "checkpoint": {"every": 2, "keep_last": 0},
        "logging": {"progress": False},
        "oomb": {"chunk_size": 128, "page_size": 32, "performance": {"backend": "torch"}},
    }
    for name, values in sections.items():
        options[name] = {**options.get(name, {}), **values}
    return TrainerConfig.from_dict(options)


def trainable_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def metric_lines(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


class ProcessKilledError(Exception):
    """Stands for the process dying: nothing is saved."""


RESUME_CASES = {
    "full": {},
    "bf16-masters": {"model": {"dtype": "bfloat16"}, "data": {"seq_len": 128}},
    "lora-dropout-accum": {"lora": {"enabled": True, "r": 4, "dropout": 0.1}, "train": {"grad_accum": 2}},
}


@pytest.fixture(scope="module", params=list(RESUME_CASES))
def uninterrupted(request, tmp_path_factory, model_dir, data_file):
    out = tmp_path_factory.mktemp("uninterrupted")
    trainer = Trainer(make_config(out, model_dir, data_file, **RESUME_CASES[request.param]))
    result = trainer.train()
    return request.param, result, trainable_state(trainer), out


def test_uninterrupted_run_writes_everything(uninterrupted):
    case, result, _, out = uninterrupted
    assert result.steps == 4 and len(result.losses) == 4 and not result.interrupted
    options = RESUME_CASES[case]
    seq_len, accum = options.get("data", {}).get("seq_len", 256), options.get("train", {}).get("grad_accum", 1)
    assert result.tokens == 4 * seq_len * accum
    assert result.losses[-1] < result.losses[0]
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step-000002", "step-000004"]
    lines = metric_lines(out)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert [m["loss"] for m in lines] == result.losses
    assert {"lr", "grad_norm", "tokens_per_s", "host_rss_gib", "epoch", "documents"} <= lines[0].keys()
    assert all(m["compile_s"] == 0.0 for m in lines)  # CPU steps compile nothing (compiled layers are CUDA-only)
    assert lines[0]["lr"] == pytest.approx(3e-3)  # warmup of one step, then cosine
    assert lines[-1]["lr"] < lines[1]["lr"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["losses"] == result.losses
    for m in lines:  # a step's parts add up to its time
        assert min(m["data_s"], m["update_s"], m["forward_backward_s"]) >= 0
        assert m["data_s"] + m["update_s"] + m["forward_backward_s"] == pytest.approx(m["step_time_s"])
    assert summary["steady_step_parts_s"]["forward_backward_s"] == pytest.approx(
        statistics.median(m["forward_backward_s"] for m in lines[1:]))
    assert summary["setup_s"] > 0 and summary["checkpoint_s"] > 0  # two checkpoints were written
    assert (out / "final" / "config.json").is_file() or (out / "final" / "adapter_config.json").is_file()


def test_killed_then_resumed_equals_uninterrupted(uninterrupted, tmp_path, model_dir, data_file, monkeypatch, caplog):
    case, want, want_weights, _ = uninterrupted
    out = tmp_path / "run"
    config = make_config(out, model_dir, data_file, **RESUME_CASES[case])
    step = Trainer.train_step

    def dies_in_step_3(self, **kwargs):
        if self.step == 2:
            raise ProcessKilledError
        return step(self, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", dies_in_step_3)
    with pytest.raises(ProcessKilledError):
        Trainer(config).train()
    monkeypatch.setattr(Trainer, "train_step", step)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000002"]

    config.checkpoint.resume = "latest"
    resumed = Trainer(config)
    with caplog.at_level(logging.WARNING, logger="oomb.training.trainer"):
        got = resumed.train()
    assert "changed settings" not in caplog.text
    assert got.resumed_from.endswith("step-000002")
    assert got.losses == want.losses  # exactly: CPU fp32 is deterministic
    assert_bitwise_equal(trainable_state(resumed), want_weights)
    assert "nothing to train" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="oomb.training.trainer"):  # resumed once more, already done
        Trainer(config).train()
    assert f"already train.max_steps={config.train.max_steps}: nothing to train (raise --steps" in caplog.text
    assert [m["step"] for m in metric_lines(out)] == [1, 2, 3, 4]


def test_resume_runs_the_current_configs_optimizer_settings(tmp_path, model_dir, data_file):
    """A run resumed with another peak lr, max_steps, betas or weight decay runs those from its first step on:
    the lr of each resumed step is the current schedule's at that step (the checkpoint's optimizer and scheduler
    state held the old ones, and the first resumed step used the old schedule's last lr)."""
    from oomb.training.optim import lr_factor

    out = tmp_path / "run"
    Trainer(make_config(out, model_dir, data_file, train={"max_steps": 2})).train()
    config = make_config(out, model_dir, data_file, train={"max_steps": 5}, checkpoint={"resume": "latest"},
                         optim={"lr": 1e-2, "betas": [0.5, 0.6], "weight_decay": 0.1})
    resumed = Trainer(config)
    resumed.train()
    lines = metric_lines(out)
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5]
    assert [m["lr"] for m in lines[2:]] == pytest.approx([1e-2 * lr_factor(s, config.optim, 5) for s in (2, 3, 4)])
    groups = resumed.optimizer.param_groups
    assert all(g["betas"] == (0.5, 0.6) and g["initial_lr"] == 1e-2 for g in groups)
    assert sorted(g["weight_decay"] for g in groups) == ([0.0, 0.1] if len(groups) == 2 else [0.1])


def test_resuming_an_earlier_checkpoint_sets_the_later_ones_aside(tmp_path, model_dir, data_file, caplog):
    """The later checkpoints belong to the replaced run: `--resume latest` must not pick them up again."""
    out = tmp_path / "run"
    Trainer(make_config(out, model_dir, data_file, train={"max_steps": 3}, checkpoint={"every": 1})).train()
    earlier = out / "checkpoints" / "step-000001"
    config = make_config(out, model_dir, data_file, train={"max_steps": 2}, checkpoint={"every": 0,
                                                                                         "resume": str(earlier)})
    with caplog.at_level(logging.WARNING, logger="oomb.training.trainer"):
        Trainer(config).setup()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000001"]
    assert sorted(p.name for p in (out / "superseded").iterdir()) == ["step-000002", "step-000003"]
    assert "moved to" in caplog.text


def test_ctrl_c_saves_the_last_complete_step_and_resume_finishes(uninterrupted, tmp_path, model_dir, data_file,
                                                                monkeypatch):
    case, want, want_weights, _ = uninterrupted
    out = tmp_path / "run"
    config = make_config(out, model_dir, data_file, **RESUME_CASES[case])
    config.checkpoint.every = 0
    sequences_per_step = config.train.grad_accum
    calls = []
    real = oomb.training.trainer.forward_backward

    def interrupted_third_sequence(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2 * sequences_per_step + 1:  # the first sequence of step 3
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(oomb.training.trainer, "forward_backward", interrupted_third_sequence)
    result = Trainer(config).train()
    assert result.interrupted and result.steps == 2 and result.export_dir is None
    assert result.checkpoint.endswith("step-000002")
    assert not (out / "final").exists()
    monkeypatch.setattr(oomb.training.trainer, "forward_backward", real)

    config.checkpoint.resume = "latest"
    resumed = Trainer(config)
    assert resumed.train().losses == want.losses
    assert_bitwise_equal(trainable_state(resumed), want_weights)


def test_ctrl_c_during_an_update_keeps_that_step(uninterrupted, tmp_path, model_dir, data_file, monkeypatch):
    case, want, want_weights, _ = uninterrupted
    out = tmp_path / "run"
    config = make_config(out, model_dir, data_file, **RESUME_CASES[case])
    real_step = torch.optim.AdamW.step

    def sigint_in_third_update(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        if self.state and next(iter(self.state.values()))["step"] == 3:
            os.kill(os.getpid(), signal.SIGINT)  # arrives while the update is being applied
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", sigint_in_third_update)
    result = Trainer(config).train()
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    assert result.interrupted and result.steps == 3 and result.checkpoint.endswith("step-000003")
    assert [m["step"] for m in metric_lines(out)] == [1, 2, 3]
    config.checkpoint.resume = "latest"
    resumed = Trainer(config)
    assert resumed.train().losses == want.losses
    assert_bitwise_equal(trainable_state(resumed), want_weights)


def test_a_failing_step_saves_the_last_complete_one_and_resume_finishes(uninterrupted, tmp_path, model_dir,
                                                                        data_file, monkeypatch, caplog):
    """A step that fails before its update (here out of memory in its third step, with no periodic checkpoint)
    checkpoints the state after the last complete step, then fails as it would have: the steps since the last
    checkpoint are not lost, and resuming gives the uninterrupted run's losses and weights bit for bit."""
    case, want, want_weights, _ = uninterrupted
    out = tmp_path / "run"
    config = make_config(out, model_dir, data_file, **RESUME_CASES[case])
    config.checkpoint.every = 0
    calls = []
    real = oomb.training.trainer.forward_backward

    def out_of_memory_in_step_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2 * config.train.grad_accum + 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(oomb.training.trainer, "forward_backward", out_of_memory_in_step_3)
    with caplog.at_level(logging.WARNING, logger="oomb.training.trainer"), pytest.raises(torch.OutOfMemoryError):
        Trainer(config).train()
    monkeypatch.setattr(oomb.training.trainer, "forward_backward", real)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000002"]
    assert "step 3 failed (OutOfMemoryError): saved the state after step 2" in caplog.text
    config.checkpoint.resume = "latest"
    resumed = Trainer(config)
    assert resumed.train().losses == want.losses
    assert_bitwise_equal(trainable_state(resumed), want_weights)


@pytest.mark.parametrize("failure", ["in the update", "loss not finite"])
def test_a_step_failing_in_its_update_or_with_a_non_finite_loss_saves_nothing(tmp_path, model_dir, data_file,
                                                                               monkeypatch, failure):
    """An update that fails half applied leaves no state worth saving, and a non-finite loss may come from the
    weights themselves: neither checkpoints (a rotation would drop an earlier, good checkpoint)."""
    out = tmp_path / "run"
    config = make_config(out, model_dir, data_file, checkpoint={"every": 0})
    if failure == "in the update":
        real_step = torch.optim.AdamW.step

        def fails_in_third_update(self, *args, **kwargs):
            if self.state and next(iter(self.state.values()))["step"] == 2:
                raise RuntimeError("failed mid-update")
            return real_step(self, *args, **kwargs)

        monkeypatch.setattr(torch.optim.AdamW, "step", fails_in_third_update)
        error = RuntimeError
    else:
        real = oomb.training.trainer.forward_backward
        calls = []

        def nan_in_step_3(*args, **kwargs):
            calls.append(1)
            loss = real(*args, **kwargs)
            return loss * float("nan") if len(calls) == 3 else loss

        monkeypatch.setattr(oomb.training.trainer, "forward_backward", nan_in_step_3)
        error = FloatingPointError
    with pytest.raises(error):
        Trainer(config).train()
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").iterdir())


def test_ctrl_c_waits_for_the_optimizer_update():
    before = signal.getsignal(signal.SIGINT)  # default_int_handler; SIG_IGN under nohup or a background job
    with pytest.raises(KeyboardInterrupt):
        with oomb.training.trainer._sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            finished = True
    assert finished
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_lora_two_steps_exports_adapter_and_merged_model(tmp_path, model_dir, data_file):
    from peft import PeftModel

    out = tmp_path / "lora"
    config = make_config(out, model_dir, data_file, train={"max_steps": 2},
                         lora={"enabled": True, "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"],
                               "merge_on_export": True})
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    result = Trainer(config).train()
    assert result.steps == 2 and result.merged_dir is not None
    final = out / "final"
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    assert not (final / "model.safetensors").exists()
    assert AutoTokenizer.from_pretrained(final)("ab")["input_ids"] == [97, 98]
    ckpt = out / "checkpoints" / "step-000002"
    assert (ckpt / "adapter.safetensors").is_file() and not (ckpt / "model.safetensors").exists()

    reloaded = PeftModel.from_pretrained(copy.deepcopy(base), final)
    adapters = {n: p for n, p in reloaded.named_parameters() if "lora_" in n}
    assert adapters and all("q_proj" in n or "v_proj" in n for n in adapters)
    assert any(float(p.abs().sum()) > 0 for n, p in adapters.items() if "lora_B" in n)  # B moved off zero
    ids = torch.arange(40)[None]
    merged = AutoModelForCausalLM.from_pretrained(out / "final-merged")
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, reloaded(ids).logits, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(merged(ids).logits, base(ids).logits)


def test_bf16_parameters_train_through_fp32_masters(tmp_path, model_dir, data_file):
    config = make_config(tmp_path / "bf16", model_dir, data_file, model={"dtype": "bfloat16"},
                         data={"seq_len": 128}, train={"max_steps": 2}, checkpoint={"every": 0})
    trainer = Trainer(config)
    trainer.train()
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    masters = trainer.masters.state_dict()
    assert masters and all(m.dtype == torch.float32 for m in masters.values())
    params = dict(trainer.model.named_parameters())
    for name, master in masters.items():
        assert torch.equal(params[name], master.to(torch.bfloat16)), name
    states = [s for s in trainer.optimizer.state.values()]
    assert states and all(s["exp_avg"].dtype == torch.float32 and s["exp_avg_sq"].dtype == torch.float32
                          for s in states)
    assert all(t.dtype == torch.float32 for group in trainer.optimizer.param_groups for t in group["params"])
    checkpoint = load_checkpoint(tmp_path / "bf16" / "checkpoints" / "step-000002")
    assert set(checkpoint.master) == set(masters) and len(checkpoint.weights) == 0  # bf16 = rounded masters


def test_accumulation_gives_the_mean_of_the_sequences_gradients(tmp_path, model_dir, data_file):
    config = make_config(tmp_path / "accum", model_dir, data_file, train={"grad_accum": 3},
                         optim={"max_grad_norm": 0.0})
    trainer = Trainer(config)
    trainer.setup()
    fresh = copy.deepcopy(trainer.model)
    seen = {}

    def record(optimizer, args, kwargs):
        seen.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})

    trainer.optimizer.register_step_pre_hook(record)
    trainer.train_step()
    sequences = PackedSequences(resolve_files(config.data), trainer.tokenizer, config.data, config.train.seed)
    for _ in range(3):
        sample = next(sequences)
        oomb.forward_backward(fresh, sample.input_ids[None], sample.labels[None], config=config.oomb,
                              cu_seqlens=sample.cu_seqlens())  # data.documents: separate (the default)
    sequences.close()
    trainer.data.close()
    for name, p in fresh.named_parameters():
        torch.testing.assert_close(seen[name], p.grad / 3, rtol=1e-5, atol=1e-7)


def test_accumulation_without_masters_sums_the_sequences_in_float32(tmp_path, model_dir, data_file, monkeypatch):
    """bf16 parameters stepped directly (optim.master_weights: false) over 3 sequences a step: their gradients
    are summed in float32 over the sequences and rounded once, and no bf16 .grad is kept beside the next
    sequence's float32 sums (the memory check counts only the sums)."""
    config = make_config(tmp_path / "accum", model_dir, data_file, model={"dtype": "bfloat16"},
                         data={"seq_len": 128}, train={"grad_accum": 3},
                         optim={"max_grad_norm": 0.0, "master_weights": False})
    trainer = Trainer(config)
    trainer.setup()
    fresh = copy.deepcopy(trainer.model)
    held, seen = [], {}
    step = oomb.training.trainer.forward_backward

    def watching(model, *args, **kwargs):
        held.append(sum(p.grad is not None for p in model.parameters() if p.dtype == torch.bfloat16))
        return step(model, *args, **kwargs)

    monkeypatch.setattr(oomb.training.trainer, "forward_backward", watching)
    trainer.optimizer.register_step_pre_hook(
        lambda *_: seen.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()}))
    trainer.train_step()
    assert held == [0, 0, 0]
    sequences = PackedSequences(resolve_files(config.data), trainer.tokenizer, config.data, config.train.seed)
    sums = {p: torch.zeros_like(p, dtype=torch.float32) for p in fresh.parameters()}
    for _ in range(3):
        sample = next(sequences)
        oomb.forward_backward(fresh, sample.input_ids[None], sample.labels[None], config=config.oomb,
                              cu_seqlens=sample.cu_seqlens(), grad_targets=sums)
    sequences.close()
    trainer.data.close()
    for name, p in fresh.named_parameters():
        assert seen[name].dtype == torch.bfloat16
        assert torch.equal(seen[name], sums[p].to(torch.bfloat16) * (1 / 3)), name


def test_memory_check_refuses_with_numbers_and_fixes(tmp_path, model_dir, data_file, monkeypatch, caplog):
    monkeypatch.setattr(oomb.training.trainer, "host_available_bytes", lambda: 1 << 20)
    config = make_config(tmp_path / "mem", model_dir, data_file)
    with pytest.raises(NotEnoughMemoryError) as err:
        Trainer(config).setup()
    message = str(err.value)
    for part in ("not enough host memory", "GiB are free", "KV and KV-gradient pages", "lower data.seq_len=256",
                 "lora.enabled=true", "train.memory_check=warn"):
        assert part in message
    config.train.memory_check = "warn"
    with caplog.at_level(logging.WARNING, logger="oomb.training.trainer"):
        Trainer(config).setup()
    assert "not enough host memory" in caplog.text


def test_a_model_too_large_for_the_machine_is_refused_before_it_is_built(tmp_path, monkeypatch, caplog):
    """A 7B preset on a machine with 12 GiB free: refused with the numbers before any weight is allocated
    (building it first would die in the allocator). The free memory is injected; nothing large is allocated."""
    free = 12 * 1024**3
    monkeypatch.setattr(oomb.training.trainer, "host_available_bytes", lambda: free)

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built before the memory check")

    monkeypatch.setattr(oomb.training.trainer, "build_model", no_build)
    config = TrainerConfig.load(None, ["model.preset=qwen2.5-7b", "train.device=cpu", "data.seq_len=8192",
                                       f"train.output_dir={json.dumps(str(tmp_path / 'out'))}"])
    with pytest.raises(NotEnoughMemoryError) as err:
        Trainer(config).setup()
    message = str(err.value)
    params = oomb.training.trainer.ModelShape.from_hf_config(
        oomb.training.presets.load_model_config(config.model, 8192)).num_params()
    assert f"{params / 1e9:.2f} B parameters" in message
    assert f"need {params * 4 / 1024**3:.1f} GiB in float32" in message and "12.0 GiB are free" in message
    assert "model.dtype=bfloat16" in message and "train.memory_check=warn" in message
    assert not (tmp_path / "out").exists()  # nothing written either
    # warn: the check says so and goes on (to the build, stopped here by the stand-in)
    config.train.memory_check = "warn"
    with caplog.at_level(logging.WARNING, logger="oomb.training.trainer"), pytest.raises(AssertionError):
        Trainer(config).setup()
    assert "weights alone need" in caplog.text


def test_memory_check_counts_kept_attention_outputs(tmp_path, model_dir, data_file):
    """keep_attention_outputs set in the config: the memory check's terms include the kept outputs (every
    layer's attention output and lse), as the planner counts them."""
    from oomb.planning.memory import kept_attention_bytes

    config = make_config(tmp_path / "kept", model_dir, data_file, oomb={"performance.keep_attention_outputs": True})
    trainer = Trainer(config)
    trainer.setup()
    terms = trainer.predicted_memory(trainer.model)
    shape = oomb.planning.memory.ModelShape.from_hf_config(trainer.model.config)
    assert terms["kept attention outputs (stage 1 to stage 2)"] == kept_attention_bytes(shape, 256, 1, trainer.dtype)
    plain = Trainer(make_config(tmp_path / "plain", model_dir, data_file))
    plain.setup()
    assert not any("kept" in name for name in plain.predicted_memory(plain.model))
    # Refused with context parallelism before anything is loaded or written.
    shared = make_config(tmp_path / "cp", model_dir, data_file, oomb={"performance.keep_attention_outputs": True},
                         parallel={"cp": 2})
    with pytest.raises(ValueError, match="keep_attention_outputs=true is not supported with context parallelism"):
        Trainer(shared).setup()
    assert not (tmp_path / "cp").exists()


def test_context_beyond_max_positions_warns_naming_rope_scaling(tmp_path, model_dir, data_file, caplog):
    config = make_config(tmp_path / "ctx", model_dir, data_file, data={"seq_len": 8192})
    with caplog.at_level(logging.WARNING, logger="oomb.training.trainer"):
        Trainer(config).setup()
    assert "data.seq_len=8192 exceeds the model's max_position_embeddings=4096" in caplog.text
    assert "model.rope_scaling" in caplog.text and "factor: 2.0" in caplog.text
    caplog.clear()
    scaled = make_config(tmp_path / "ctx2", model_dir, data_file, data={"seq_len": 8192}, model={
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "max_position_embeddings": 8192})
    with caplog.at_level(logging.WARNING, logger="oomb.training.trainer"):
        trainer = Trainer(scaled)
        trainer.setup()
    assert "exceeds" not in caplog.text
    assert trainer.model.config.rope_parameters["rope_type"] == "linear"


def test_model_directory_errors(tmp_path, model_dir, data_file):
    def setup(path):
        Trainer(make_config(tmp_path / "out", path, data_file)).setup()

    with pytest.raises(FileNotFoundError, match=r"model.path=.*missing.* is not a directory"):
        setup(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json: not a Hugging Face model directory"):
        setup(tmp_path / "empty")
    weights_only = tmp_path / "weights-only"
    build_tiny_model("qwen2", vocab_size=VOCAB).save_pretrained(weights_only)
    with pytest.raises(FileNotFoundError, match="has no tokenizer .*set model.tokenizer"):
        setup(weights_only)
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB)).save_pretrained(gpt2)
    with pytest.raises(NotImplementedError, match="model type 'gpt2' .* not supported by oomb; supported: llama"):
        setup(gpt2)


def test_empty_data_is_refused_before_training(tmp_path, model_dir, data_file):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    trainer = Trainer(make_config(tmp_path / "out", model_dir, empty))
    with pytest.raises(ValueError, match="the data has no tokens"):
        trainer.train()
    # What the failed setup left (config.yaml, an empty metrics.jsonl) is no run: the corrected retry starts.
    assert (tmp_path / "out" / "metrics.jsonl").stat().st_size == 0
    retry = Trainer(make_config(tmp_path / "out", model_dir, data_file, train={"max_steps": 1}))
    assert retry.train().steps == 1


def test_an_existing_run_is_not_overwritten_by_accident(tmp_path, model_dir, data_file):
    out = tmp_path / "run"
    config = make_config(out, model_dir, data_file, train={"max_steps": 1})
    Trainer(config).train()
    with pytest.raises(ValueError, match="already holds a run .*--resume.*--overwrite"):
        Trainer(config).train()
    config.train.overwrite = True
    assert Trainer(config).train().steps == 1
    assert [m["step"] for m in metric_lines(out)] == [1]


def test_missing_tensorboard_is_a_warning(tmp_path, model_dir, data_file, caplog, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    config = make_config(tmp_path / "tb", model_dir, data_file, train={"max_steps": 1},
                         logging={"tensorboard": True}, checkpoint={"export": False})
    with caplog.at_level(logging.WARNING, logger="oomb.training.trainer"):
        assert Trainer(config).train().steps == 1
    assert "tensorboard package is not installed" in caplog.text


def test_embedded_default_preset_trains_and_exports_a_loadable_model(tmp_path):
    config = TrainerConfig.from_dict({
        "data": {"seq_len": 256}, "train": {"max_steps": 1, "output_dir": str(tmp_path / "out"), "device": "cpu"},
        "logging": {"progress": False}, "oomb": {"chunk_size": 128, "page_size": 32}})
    result = Trainer(config).train()
    assert result.steps == 1 and result.tokens == 256
    final = tmp_path / "out" / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert model.config.model_type == "qwen2" and tokenizer.eos_token_id == BYTE_VOCAB


def test_optimizer_offload_steps_the_same_weights_on_the_host(tmp_path, model_dir, data_file):
    """fp32 parameters: masters in host memory (here the same device) give bitwise the same run."""
    runs = {}
    for offload in (False, True):
        config = make_config(tmp_path / f"offload-{offload}", model_dir, data_file, optim={"offload": offload},
                             train={"max_steps": 2}, checkpoint={"every": 0, "export": False})
        trainer = Trainer(config)
        runs[offload] = trainer.train().losses, trainable_state(trainer)
        assert bool(trainer.masters.state_dict()) == offload
    assert runs[True][0] == runs[False][0]
    assert_bitwise_equal(runs[True][1], runs[False][1])


def test_warmup_then_cosine_schedule():
    from oomb.training.config import OptimSection
    from oomb.training.optim import lr_factor

    options = OptimSection(warmup_steps=4, min_lr_ratio=0.1)
    factors = [lr_factor(step, options, max_steps=14) for step in range(15)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and factors[9] == pytest.approx(0.55) and factors[14] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[3:], factors[4:], strict=False))
    constant = OptimSection(warmup_steps=0, schedule="constant")
    assert {lr_factor(step, constant, 10) for step in range(10)} == {1.0}


def test_the_progress_bar_shows_the_chunk_in_progress(tmp_path, model_dir, data_file, capsys):
    """A long step's bar says which stage and chunk it is at (forward_backward's progress callback), in order:
    stage 1's chunks, then stage 2's, per sequence of the step."""
    config = make_config(tmp_path / "bar", model_dir, data_file, train={"max_steps": 1, "grad_accum": 2},
                         logging={"progress": True}, checkpoint={"export": False})
    trainer = Trainer(config)
    calls = []
    trainer.setup()
    trainer.train_step(on_chunk=lambda *args: calls.append(args))
    # 256 tokens in chunks of 128: 2 chunks, so 4 calls per sequence (2 stages), for 2 sequences
    assert calls == [(m, done, 4) for m in (0, 1) for done in (1, 2, 3, 4)]
    Trainer(make_config(tmp_path / "bar2", model_dir, data_file, train={"max_steps": 1, "grad_accum": 2},
                        logging={"progress": True}, checkpoint={"export": False})).train()
    err = capsys.readouterr().err
    positions = [err.index(f"step 1: sequence {s}/2, stage {st}, chunk {c}/2")
                 for s in (1, 2) for st in (1, 2) for c in (1, 2)]
    assert positions == sorted(positions)


def test_lora_adapters_are_added_without_a_deprecation_warning(model_dir):
    """PEFT asks transformers for a deprecated property; oomb's call must not print its FutureWarning at the top of
    every LoRA run."""
    import warnings

    from oomb.training.config import LoraSection
    from oomb.training.presets import apply_lora

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_lora(model, LoraSection(enabled=True))
