"""oomb inside transformers.Trainer / TRL SFTTrainer: the same losses and weights as the plain trainers.

Every comparison trains the same tiny fp32 model on the same data twice, once with the plain trainer
and once with oomb's step (chunk 64, page 16: sequences of 60-150 tokens span several chunks and
pages), and compares the logged losses and the final weights.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from helpers import VOCAB, build_tiny_model
from transformers import Trainer, TrainingArguments

from oomb import OOMBConfig, OOMBTrainer, forward_backward, patch_trainer
from oomb.config import PerformanceConfig
from oomb.loss import shift_labels
from oomb.training import hf_trainer as hft

trl = pytest.importorskip("trl")
from trl import SFTConfig, SFTTrainer  # noqa: E402

from oomb import OOMBSFTTrainer  # noqa: E402

STEP = OOMBConfig(chunk_size=64, page_size=16, performance=PerformanceConfig(backend="torch"))
TOL = 1e-5


def token_lists(n: int, seed: int, low: int = 60, high: int = 150) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def right_padded(examples: list[dict]) -> dict[str, torch.Tensor]:
    """A collator that pads on the right with attention_mask zeros and -100 labels (as HF's do)."""
    T = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), T, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, e in enumerate(examples):
        x = torch.tensor(e["input_ids"])
        ids[i, :len(x)], mask[i, :len(x)], labels[i, :len(x)] = x, 1, x
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def training_args(out, **overrides) -> TrainingArguments:
    options = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
                   logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, learning_rate=1e-3,
                   max_grad_norm=1.0, disable_tqdm=True)
    return TrainingArguments(**{**options, **overrides})


def logged(trainer: Trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


def assert_same_run(plain: Trainer, ours: Trainer) -> None:
    a, b = logged(plain), logged(ours)
    assert len(a) == len(b) == plain.state.global_step == ours.state.global_step > 0
    for x, y in zip(a, b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], abs=TOL, rel=0), (x, y)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], abs=TOL, rel=0), (x, y)
    assert_same_weights(plain.model, ours.model)


def assert_same_weights(m0: torch.nn.Module, m1: torch.nn.Module, tol: float = TOL) -> None:
    s0, s1 = m0.state_dict(), m1.state_dict()
    assert s0.keys() == s1.keys()
    worst = max((s0[k] - s1[k]).abs().max().item() for k in s0)
    assert worst <= tol, f"weights differ by {worst:.3g}"


@pytest.mark.slow
def test_trainer_accumulation_padding_and_checkpointing_flag(tmp_path):
    """GA 2 over right-padded batches of unequal token counts (num_items_in_batch scaling), clipping on;
    oomb's run asks for gradient checkpointing, which it replaces with a warning."""
    data = [{"input_ids": x} for x in token_lists(8, seed=0)]
    plain = Trainer(model=build_tiny_model("llama"), args=training_args(tmp_path / "a"), train_dataset=data,
                    data_collator=right_padded)
    plain.train()
    with pytest.warns(UserWarning, match="replaced by oomb's own recomputation"):
        ours = OOMBTrainer(model=build_tiny_model("llama"), train_dataset=data, data_collator=right_padded,
                           args=training_args(tmp_path / "b", gradient_checkpointing=True), oomb_config=STEP)
    assert not ours.args.gradient_checkpointing
    ours.train()
    assert_same_run(plain, ours)
    # evaluation is the Trainer's ordinary forward (oomb restored the model's attention after every step)
    assert ours.model.config._attn_implementation == plain.model.config._attn_implementation == "sdpa"
    eval_plain, eval_ours = plain.evaluate(data[:4]), ours.evaluate(data[:4])
    assert eval_ours["eval_loss"] == pytest.approx(eval_plain["eval_loss"], abs=TOL, rel=0)


def test_lora_through_patch_trainer(tmp_path):
    peft = pytest.importorskip("peft")

    def lora_model():
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
        return peft.get_peft_model(build_tiny_model("qwen2"), config)

    data = [{"input_ids": x} for x in token_lists(8, seed=1)]
    # Plain SGD, so that the weights compare the gradients: LoRA's B starts at zero, so some of A's second-step
    # gradients are ~1e-8, four orders below the rest, where AdamW (epsilon 1e-8) turns float noise of 1e-10 into a
    # 1e-3 change of the normalised update (measured: one element of down_proj's A 1.26e-5 apart at lr 1e-2, every
    # other within 5e-7; with epsilon 1e-6 other elements sat near it instead)
    args = dict(learning_rate=0.5, max_steps=2, optim="sgd")
    plain = Trainer(model=lora_model(), args=training_args(tmp_path / "a", **args), train_dataset=data,
                    data_collator=right_padded)
    plain.train()
    ours = patch_trainer(Trainer(model=lora_model(), args=training_args(tmp_path / "b", **args), train_dataset=data,
                                 data_collator=right_padded), STEP)
    ours.train()
    assert_same_run(plain, ours)
    moved = [n for n, p in ours.model.named_parameters() if p.requires_grad]
    assert moved and all("lora_" in n for n in moved)


@pytest.mark.slow
def test_resume_from_checkpoint_gives_the_uninterrupted_weights(tmp_path):
    data = [{"input_ids": x} for x in token_lists(12, seed=2)]

    def trainer():
        args = training_args(tmp_path / "run", max_steps=4, save_strategy="steps", save_steps=2,
                             gradient_accumulation_steps=1)
        return OOMBTrainer(model=build_tiny_model("llama"), args=args, train_dataset=data, data_collator=right_padded,
                           oomb_config=STEP)

    whole = trainer()
    whole.train()
    resumed = trainer()  # fresh weights: everything comes from the checkpoint
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    assert [h["loss"] for h in logged(resumed)][-2:] == pytest.approx([h["loss"] for h in logged(whole)][-2:], abs=1e-6)
    assert_same_weights(whole.model, resumed.model, tol=1e-6)


def word_tokenizer():
    """A word-level tokenizer over the tiny vocabulary (ids are the words), with pad and eos."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {str(i): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="1", eos_token="2", unk_token="0")


def sft_config(out, **overrides) -> SFTConfig:
    options = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
                   logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, learning_rate=1e-3,
                   bf16=False, disable_tqdm=True, max_length=None, completion_only_loss=True,
                   gradient_checkpointing=False)
    return SFTConfig(**{**options, **overrides})


@pytest.mark.slow
def test_sft_trainer_completion_only(tmp_path):
    """SFTTrainer's own collator (right padding) and completion-only labels, GA 2."""
    from datasets import Dataset

    rows = []
    for prompt, completion in zip(token_lists(8, 3, 20, 70), token_lists(8, 4, 30, 80), strict=True):
        rows.append({"input_ids": prompt + completion, "completion_mask": [0] * len(prompt) + [1] * len(completion)})
    data = Dataset.from_list(rows)
    plain = SFTTrainer(model=build_tiny_model("llama"), args=sft_config(tmp_path / "a"), train_dataset=data,
                       processing_class=word_tokenizer())
    plain.train()
    ours = OOMBSFTTrainer(model=build_tiny_model("llama"), args=sft_config(tmp_path / "b"), train_dataset=data,
                          processing_class=word_tokenizer(), oomb_config=STEP)
    ours.train()
    assert_same_run(plain, ours)
    assert logged(ours)[-1]["num_tokens"] == logged(plain)[-1]["num_tokens"] > 0


@pytest.mark.slow
def test_real_model_chat_sft_with_lora(tmp_path, smollm2_path):
    """SmolLM2-135M-Instruct, its chat template, LoRA: one optimizer step on the 4 chats, plain vs oomb.

    Plain SGD, so that the weights compare the gradients: AdamW's first steps move every element by about
    the learning rate in the direction of its gradient's sign, and where two elements' gradients nearly
    cancel (or vanish), float noise of 2e-5 relative between two exact attention implementations (30 layers,
    fp32) flips that sign (measured: 1.5e-3 apart with AdamW at lr 1e-3, identical losses and gradient norms).

    The plain trainer takes the model's own loss (``compute_loss_func``), the one oomb's step reproduces. TRL's
    SFTTrainer otherwise computes it through its fused LM head, which rounds it differently: on this batch the
    model's own float32 loss (torch's CPU log-softmax) lies 1.3e-5 below the float64 loss and the fused head's
    2e-7 above it (measured), more than TOL apart for two correct float32 losses.
    """
    peft = pytest.importorskip("peft")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.loss.loss_utils import ForCausalLMLoss

    chats = [
        ("What is the capital of France?", "The capital of France is Paris, a city on the Seine known for its museums, "
         "its cafes and the Eiffel Tower, built for the world fair of 1889."),
        ("Name a prime number greater than ten.", "Thirteen is a prime number greater than ten: it has no divisors "
         "other than one and itself, and the next prime after it is seventeen."),
        ("What colour is the sky on a clear day?", "On a clear day the sky is blue, because the molecules of the air "
         "scatter blue light much more strongly than red light."),
        ("Translate 'thank you' into German.", "'Thank you' in German is 'danke', and 'thank you very much' is "
         "'danke schön' or, a little more formally, 'vielen Dank'."),
    ]
    data = Dataset.from_list([{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                              for q, a in chats])

    def run(cls, out, **extra):
        model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32, attn_implementation="sdpa")
        lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                               task_type="CAUSAL_LM")
        args = sft_config(out, max_steps=1, per_device_train_batch_size=4, gradient_accumulation_steps=1, optim="sgd",
                          learning_rate=0.5,
                          lr_scheduler_type="constant", completion_only_loss=None)
        torch.manual_seed(0)  # the LoRA weights SFTTrainer creates: the same in both runs
        trainer = cls(model=model, args=args, train_dataset=data, processing_class=AutoTokenizer.from_pretrained(
            smollm2_path), peft_config=lora, **extra)
        trainer.train()
        return trainer

    def model_loss(outputs, labels, num_items_in_batch=None):
        return ForCausalLMLoss(outputs.logits, labels, outputs.logits.shape[-1], num_items_in_batch)

    plain = run(SFTTrainer, tmp_path / "a", compute_loss_func=model_loss)
    # less work
    ours = run(OOMBSFTTrainer, tmp_path / "b", oomb_config=STEP.with_options({"performance.checkpoint_layers": False}))
    batch = next(iter(ours.get_train_dataloader()))
    assert batch["input_ids"].shape[1] > STEP.chunk_size  # the chat examples span two chunks
    assert (batch["attention_mask"] == 0).any()  # and are right-padded
    assert_same_run(plain, ours)


# ---- the step's pieces, and what it refuses ----------------------------------------------------------


def tiny_trainer(tmp_path, cls=OOMBTrainer, **kwargs) -> Trainer:
    extra = {"oomb_config": STEP} if cls is OOMBTrainer else {}
    return cls(model=build_tiny_model("llama"), args=training_args(tmp_path, **kwargs),
               train_dataset=[{"input_ids": [5, 6]}], data_collator=right_padded, **extra)


def test_micro_batch_without_labels_adds_nothing(tmp_path):
    """A micro-batch whose labels are all -100 (e.g. a prompt truncated before its completion) adds 0 to the
    loss and nothing to the gradients, as in the plain Trainer (num_items_in_batch counts the whole step)."""
    batch = right_padded([{"input_ids": x} for x in token_lists(2, seed=5)])
    batch["labels"][:] = -100
    results = []
    for cls in (Trainer, OOMBTrainer):
        trainer = tiny_trainer(tmp_path / cls.__name__, cls)
        trainer.create_optimizer_and_scheduler(num_training_steps=1)
        loss = trainer.training_step(trainer.model, dict(batch), num_items_in_batch=torch.tensor(50))
        results.append((float(loss), [p.grad for p in trainer.model.parameters()]))
    (plain_loss, plain_grads), (loss, grads) = results
    assert plain_loss == loss == 0.0
    assert all(g is None for g in grads)
    assert all(g is None or not g.any() for g in plain_grads)


def test_step_scale_matches_the_trainer_loss(tmp_path):
    """One micro-batch of a 2-step accumulation: the returned loss and the gradients are the plain
    Trainer's (the count of the whole accumulated batch, num_items_in_batch, in the denominator)."""
    batch = right_padded([{"input_ids": x} for x in token_lists(2, seed=6)])
    n_items = torch.tensor(int((shift_labels(batch["labels"]) != -100).sum()) * 3)
    results = []
    for cls in (Trainer, OOMBTrainer):
        trainer = tiny_trainer(tmp_path / cls.__name__, cls)
        loss = trainer.training_step(trainer.model, dict(batch), num_items_in_batch=n_items)
        results.append((float(loss), torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters()])))
    (plain_loss, plain_grad), (loss, grad) = results
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    assert (grad - plain_grad).abs().max() <= 1e-6 * plain_grad.abs().max()


def test_refuses_left_padding_and_labels_after_padding():
    batch = right_padded([{"input_ids": x} for x in token_lists(2, seed=7)])
    hft.step_inputs(batch)  # right padding is accepted
    left = {k: v.flip(1) for k, v in batch.items()}
    with pytest.raises(ValueError, match="left padding"):
        hft.step_inputs(left)
    counted = dict(batch, labels=batch["input_ids"].clone())  # padding positions predict counted labels
    with pytest.raises(ValueError, match="labels after a padding position"):
        hft.step_inputs(counted)


@pytest.mark.slow
def test_sft_trainer_padding_free(tmp_path):
    """TRL's padding-free collator (one row, position_ids restarting at each document): document-aware
    attention, against the plain SFTTrainer (which derives a block-diagonal mask from position_ids).

    SGD, as in the real-model test: the gradients of one such batch agree to 1e-6 relative (every
    parameter), but AdamW's normalised first steps turned that into 1.9e-5 apart in the weights."""
    from datasets import Dataset

    data = Dataset.from_list([{"input_ids": x} for x in token_lists(8, 12, 20, 90)])
    batch = next(iter(SFTTrainer(model=build_tiny_model("llama"), train_dataset=data, processing_class=word_tokenizer(),
                                 args=sft_config(tmp_path / "probe", padding_free=True)).get_train_dataloader()))
    assert "attention_mask" not in batch and (batch["position_ids"][0, 1:] == 0).any()
    assert batch["input_ids"].shape[1] > 2 * STEP.chunk_size
    args = dict(padding_free=True, completion_only_loss=False, optim="sgd", learning_rate=0.5)
    plain = SFTTrainer(model=build_tiny_model("llama"), args=sft_config(tmp_path / "a", **args), train_dataset=data,
                       processing_class=word_tokenizer())
    plain.train()
    ours = OOMBSFTTrainer(model=build_tiny_model("llama"), args=sft_config(tmp_path / "b", **args), train_dataset=data,
                          processing_class=word_tokenizer(), oomb_config=STEP)
    ours.train()
    assert_same_run(plain, ours)


def test_packed_batch_inputs():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    labels = torch.tensor([[-100, 5, 6, -100, 7, -100, 8, 9]])
    ids = torch.full_like(labels, 4)
    kwargs = hft.step_inputs({"input_ids": ids, "labels": labels, "position_ids": position_ids})
    assert kwargs["position_ids"] is position_ids
    with pytest.raises(ValueError, match="counted label at a document's first token"):
        hft.step_inputs({"input_ids": ids, "labels": labels.abs(), "position_ids": position_ids})
    cu = torch.tensor([0, 3, 5, 8], dtype=torch.int32)
    assert hft.step_inputs({"input_ids": ids, "labels": labels, "cu_seq_lens_q": cu})["cu_seqlens"] is cu
    # position_ids 0..T-1 (one document) need nothing more
    assert "position_ids" not in hft.step_inputs({"input_ids": ids, "labels": labels,
                                                  "position_ids": torch.arange(8)[None]})


def test_shift_labels_become_labels():
    labels = torch.tensor([[5, 6, -100, 7, 8]])
    shifted = shift_labels(labels)
    assert torch.equal(shift_labels(hft._to_labels(shifted)), shifted)
    kwargs = hft.step_inputs({"input_ids": torch.ones_like(labels), "shift_labels": shifted})
    assert torch.equal(shift_labels(kwargs["labels"]), shifted)


def test_refuses_what_it_cannot_reproduce(tmp_path):
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        tiny_trainer(tmp_path / "a", label_smoothing_factor=0.1)
    with pytest.raises(ValueError, match="torch_compile=True"):
        tiny_trainer(tmp_path / "compiled", torch_compile=True)

    class CustomLoss(OOMBTrainer):
        def compute_loss(self, model, inputs, **kwargs):
            return super().compute_loss(model, inputs, **kwargs)

    with pytest.raises(ValueError, match="custom compute_loss"):
        tiny_trainer(tmp_path / "b", CustomLoss)
    with pytest.raises(ValueError, match="keys oomb's step does not use"):
        hft.step_inputs({"input_ids": torch.ones(1, 4, dtype=torch.long), "pixel_values": torch.zeros(1)})
    with pytest.raises(ValueError, match="no labels"):
        hft.step_inputs({"input_ids": torch.ones(1, 4, dtype=torch.long)})
    with pytest.raises(TypeError, match="OOMBConfig"):
        patch_trainer(Trainer(model=build_tiny_model("llama"), args=training_args(tmp_path / "c")), {"chunk_size": 64})


def test_sft_trainer_without_trl(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)
    hft._make_sft_trainer.cache_clear()  # built again, without TRL
    with pytest.raises(ImportError, match=r"pip install 'oomb\[trl\]'"):
        hft.OOMBSFTTrainer  # noqa: B018


def test_loss_gradient_scale_is_exact():
    """The LM-head hook scales every parameter's gradient (tied embeddings included) by the factor."""
    model = build_tiny_model("llama", tie_word_embeddings=True)
    ids = torch.tensor(token_lists(1, seed=10)[0])[None]
    forward_backward(model, ids, config=STEP)
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with warnings.catch_warnings(), hft.scaled_loss_gradient(model, 0.25):
        forward_backward(model, ids, config=STEP)
    for g, ref in zip((p.grad for p in model.parameters()), reference, strict=True):
        torch.testing.assert_close(g, ref * 0.25, rtol=1e-6, atol=1e-9)
    model.zero_grad()
    with warnings.catch_warnings(), hft.scaled_loss_gradient(model, 0.5), hft.scaled_loss_gradient(model, 0.5):
        forward_backward(model, ids, config=STEP)  # nested: the factors multiply
    for g, ref in zip((p.grad for p in model.parameters()), reference, strict=True):
        torch.testing.assert_close(g, ref * 0.25, rtol=1e-6, atol=1e-9)
    assert not hasattr(model.get_output_embeddings(), hft.GRADIENT_SCALE)


@pytest.mark.slow
def test_ddp_two_processes(tmp_path):
    """2 CPU processes (gloo) under torchrun: accelerate's DDP, GA 2, tokens counted over both ranks."""
    import json
    import os
    import socket
    import subprocess
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "result.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
               str(root / "tests" / "hf_trainer_ddp_worker.py"), str(out)]
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["world"] == 2 and result["ddp"] == "DistributedDataParallel", result
    assert result["oomb"] == pytest.approx(result["plain"], abs=TOL, rel=0), result
    assert result["oomb_grad_norm"] == pytest.approx(result["plain_grad_norm"], abs=TOL, rel=0), result
    assert result["worst"] <= TOL, result
    assert result["replica_gap"] == 0.0, result
    assert result["reductions"] == 2, result  # one all-reduce per optimizer step, none in no_sync micro-steps
    assert result["plain_ddp_buckets"] >= 2 and result["oomb_ddp_buckets"] == 0, result  # DDP's reducer stays idle
    print(result)


@pytest.mark.slow
@pytest.mark.parametrize("items", [True, False], ids=["num_items_in_batch", "accumulation_mean"])
def test_moe_load_balancing_term_weighs_as_the_trainers(tmp_path, items):
    """qwen3_moe with its load-balancing loss, GA 2: with num_items_in_batch the model adds the term unscaled
    to a token sum (the Trainer logs it once per micro-batch); without, the Trainer divides the whole loss by
    the accumulation steps. oomb's logged losses, gradient norms and weights match the plain Trainer's
    (SGD: Adam's normalization would magnify rounding in near-zero gradients)."""
    from test_families import build

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(3, 100, (96,), generator=g).tolist()} for _ in range(8)]
    runs = []
    for cls, extra in ((Trainer, {}), (OOMBTrainer, {"oomb_config": STEP})):
        trainer = cls(model=build("qwen3_moe"), args=training_args(tmp_path / cls.__name__, max_steps=2, optim="sgd"),
                      train_dataset=data, data_collator=right_padded, **extra)
        trainer.model_accepts_loss_kwargs = items and trainer.model_accepts_loss_kwargs
        trainer.train()
        runs.append(trainer)
    assert_same_run(*runs)
    assert not hasattr(runs[1].model, "_oomb_router_loss_factor")
