"""OOMBDPOTrainer and OOMBGRPOTrainer against TRL's DPOTrainer and GRPOTrainer: the same losses and weights.

Each comparison trains the same tiny fp32 model on the same data twice, with TRL's trainer and with the
oomb switch (chunk 64, page 16: prompts of 70-150 tokens span several chunks and pages), and compares the
logged losses, gradient norms and metrics per step and the final weights (within 1e-5). GRPO's generation
is TRL's own, sampled under the same seed in both runs (oomb's step draws no random numbers without
dropout), so both runs see the same completions; the weights' EOS row is scaled so that completions end at
varied lengths.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import VOCAB, build_tiny_model, load_model

from oomb import OOMBConfig, PerformanceConfig

trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer  # noqa: E402

from oomb import OOMBDPOTrainer, OOMBGRPOTrainer  # noqa: E402
from oomb.training import trl_trainers  # noqa: E402

STEP = OOMBConfig(chunk_size=64, page_size=16, performance=PerformanceConfig(backend="torch"))
TOL = 1e-5
EOS = 2
EOS_SCALE = 4.0
"""Factor on the LM head's EOS row: completions of the tiny random model then end after 1 to 12 tokens."""


def word_tokenizer():
    """Words are token ids ("17" is 17): text datasets tokenize offline to known ids; pad 1, eos 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({str(i): i for i in range(VOCAB)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="1", eos_token=str(EOS), unk_token="0")


def words(g: torch.Generator, low: int, high: int) -> str:
    n = int(torch.randint(low, high, (1,), generator=g))
    return " ".join(str(int(x)) for x in torch.randint(3, VOCAB, (n,), generator=g))


def preference_data(n: int = 4, seed: int = 0) -> Dataset:
    """Prompts of 70-150 tokens, completions of 3-20 (ending with EOS, so TRL adds none)."""
    g = torch.Generator().manual_seed(seed)
    return Dataset.from_list([{"prompt": words(g, 70, 150), "chosen": f" {words(g, 3, 20)} {EOS}",
                               "rejected": f" {words(g, 3, 20)} {EOS}"} for _ in range(n)])


def common_args(out: Path) -> dict:
    """Plain SGD, so that the weights compare the gradients: AdamW's first steps move each element by about the
    learning rate in the direction of its gradient's sign, which float noise flips where a gradient nearly
    vanishes (1.1e-5 apart after two DPO steps at lr 1e-3, with equal losses and gradient norms)."""
    return dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, optim="sgd",
                learning_rate=1e-2, bf16=False, disable_tqdm=True, gradient_checkpointing=False)


def logged(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


def assert_same_run(plain, ours, metrics: tuple[str, ...]) -> None:
    a, b = logged(plain), logged(ours)
    assert len(a) == len(b) == plain.state.global_step == ours.state.global_step > 0
    for x, y in zip(a, b, strict=True):
        for key in ("loss", "grad_norm", *(m for m in metrics if m in x)):  # generation metrics: when it ran
            assert x[key] == pytest.approx(y[key], abs=TOL, rel=TOL), (key, x, y)
    s0, s1 = plain.model.state_dict(), ours.model.state_dict()
    assert s0.keys() == s1.keys()
    worst = max((s0[k] - s1[k]).abs().max().item() for k in s0)
    assert worst <= TOL, f"weights differ by {worst:.3g}"


DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
               "logps/rejected", "num_tokens")


@pytest.mark.parametrize("precompute", [False, True])
def test_dpo_equals_trl(tmp_path, precompute):
    """Two pairs a micro-batch, GA 2, a separate reference model (its log-probabilities through oomb's stage 1,
    or TRL's precomputed ones)."""
    data = preference_data()

    def run(cls, out, **extra):
        args = DPOConfig(**common_args(out), max_length=None, beta=0.1, precompute_ref_log_probs=precompute)
        trainer = cls(model=build_tiny_model("llama"), ref_model=build_tiny_model("llama", seed=1), args=args,
                      train_dataset=data, processing_class=word_tokenizer(), **extra)
        trainer.train()
        return trainer

    plain = run(DPOTrainer, tmp_path / "a")
    ours = run(OOMBDPOTrainer, tmp_path / "b", oomb_config=STEP)
    assert_same_run(plain, ours, DPO_METRICS)
    assert logged(ours)[0]["loss"] != pytest.approx(0.6931, abs=1e-3)  # the reference differs from the policy


def test_dpo_lora_reference_is_the_base_model(tmp_path):
    """PEFT and no ref_model: TRL's reference is the model with its adapter disabled; Qwen2 (q/k/v biases)."""
    peft = pytest.importorskip("peft")
    data = preference_data(seed=1)

    def run(cls, out, **extra):
        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
        args = DPOConfig(**common_args(out), max_length=None, beta=0.5)
        trainer = cls(model=build_tiny_model("qwen2"), args=args, train_dataset=data, peft_config=lora,
                      processing_class=word_tokenizer(), **extra)
        trainer.train()
        return trainer

    plain = run(DPOTrainer, tmp_path / "a")
    ours = run(OOMBDPOTrainer, tmp_path / "b", oomb_config=STEP)
    assert_same_run(plain, ours, DPO_METRICS)
    moved = [n for n, p in ours.model.named_parameters() if p.requires_grad]
    assert moved and all("lora_" in n for n in moved)


def test_dpo_refusals(tmp_path):
    data = preference_data(n=2)

    def make(**options):
        args = DPOConfig(**common_args(tmp_path), max_length=None, **options)
        return OOMBDPOTrainer(model=build_tiny_model("llama"), ref_model=build_tiny_model("llama"), args=args,
                              train_dataset=data, processing_class=word_tokenizer(), oomb_config=STEP)

    with pytest.raises(ValueError, match=r"loss_type=\['ipo'\].*use loss_type=\['sigmoid'\]"):
        make(loss_type=["ipo"])
    with pytest.raises(ValueError, match="f_divergence_type='forward_kl'"):
        make(f_divergence_type="forward_kl")
    with pytest.raises(ValueError, match="ld_alpha=0.5"):
        make(ld_alpha=0.5)
    with pytest.raises(ValueError, match="use_weighting=True"):
        make(use_weighting=True)


def test_preference_pairs_refuse_prompts_cut_differently():
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 10, 0], [6, 7, 11, 12, 0], [5, 6, 7, 13, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0]])
    completion = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 1, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 0]])
    with pytest.raises(ValueError, match="different prompts.*keep_start"):
        trl_trainers.preference_pairs({"input_ids": ids, "attention_mask": attention, "completion_mask": completion})
    completion[2] = torch.tensor([0, 0, 0, 1, 0])
    ids[2, :3] = torch.tensor([5, 6, 7])
    pairs = trl_trainers.preference_pairs({"input_ids": ids, "attention_mask": attention,
                                           "completion_mask": completion})
    assert [(p.tolist(), c.tolist(), r.tolist()) for p, c, r in pairs] == [([5, 6, 7], [8, 9], [12]),
                                                                          ([5, 6, 7], [10], [13])]


def reward_len_and_words(completions, **kwargs) -> list[float]:
    return [float(len(c.split()) % 5) + 0.1 * sum(int(w) % 3 for w in c.split()) for c in completions]


def grpo_model_dir(tmp_path: Path) -> Path:
    """A saved tiny Llama whose EOS row is scaled (varied completion lengths); GRPO builds its reference
    model from the policy's path when beta != 0."""
    model = build_tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight[EOS] *= EOS_SCALE
    model.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


@pytest.mark.parametrize("loss_type, beta, iterations", [("dapo", 0.0, 1), ("grpo", 0.1, 2)])
def test_grpo_equals_trl(tmp_path, loss_type, beta, iterations):
    """4 prompts of 70-150 tokens, 4 completions each (up to 12 tokens), micro-batches of 4 completions
    shuffled across prompts, GA 2; dapo (the default) and grpo with a KL to the reference model and two
    iterations per generation (TRL's old log-probabilities, ratios away from 1)."""
    g = torch.Generator().manual_seed(0)
    data = Dataset.from_list([{"prompt": words(g, 70, 150)} for _ in range(4)])
    path = grpo_model_dir(tmp_path)

    def run(cls, out, **extra):
        args = GRPOConfig(**{**common_args(out), "per_device_train_batch_size": 4}, num_generations=4,
                          max_completion_length=12, loss_type=loss_type, beta=beta, num_iterations=iterations)
        trainer = cls(model=load_model("llama", path), reward_funcs=reward_len_and_words, args=args,
                      train_dataset=data, processing_class=word_tokenizer(), **extra)
        trainer.train()
        return trainer

    plain = run(GRPOTrainer, tmp_path / "a")
    ours = run(OOMBGRPOTrainer, tmp_path / "b", oomb_config=STEP)
    metrics = ("reward", "completions/mean_length", "clip_ratio/region_mean") + (("kl",) if beta else ())
    assert_same_run(plain, ours, metrics)
    generated = [h for h in logged(ours) if "completions/min_length" in h]
    assert generated[0]["completions/min_length"] < generated[0]["completions/max_length"]  # varied lengths


def test_grpo_refusals(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = Dataset.from_list([{"prompt": words(g, 5, 10)} for _ in range(2)])

    def make(**options):
        args = GRPOConfig(**{**common_args(tmp_path), "per_device_train_batch_size": 4}, num_generations=4,
                          max_completion_length=4, **options)
        return OOMBGRPOTrainer(model=build_tiny_model("llama"), reward_funcs=reward_len_and_words, args=args,
                               train_dataset=data, processing_class=word_tokenizer(), oomb_config=STEP)

    with pytest.raises(ValueError, match="loss_type='cispo'.*'dapo'"):
        make(loss_type="cispo")
    with pytest.raises(ValueError, match="temperature=0.7.*temperature=1.0"):
        make(temperature=0.7)
    with pytest.raises(ValueError, match="importance_sampling_level='sequence'"):
        make(importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="entropy"):
        make(entropy_coef=0.01)
    with pytest.raises(ValueError, match="off_policy_mask_threshold"):
        make(off_policy_mask_threshold=0.5)


def test_trl_trainers_without_trl(monkeypatch):
    import sys

    trl_trainers._make_trainer.cache_clear()
    monkeypatch.setitem(sys.modules, "trl", None)
    try:
        with pytest.raises(ImportError, match="OOMBDPOTrainer needs TRL"):
            trl_trainers.OOMBDPOTrainer  # noqa: B018
    finally:
        trl_trainers._make_trainer.cache_clear()


@pytest.mark.slow
def test_real_model_dpo_on_long_context_pairs(tmp_path, smollm2_path):
    """SmolLM2-135M-Instruct through OOMBDPOTrainer: two pairs whose prompts are ~3K tokens of python-stdlib
    source, answered by two snippets of the same source; one optimizer step on the CPU (LoRA, the reference is
    the base model). The loss is finite and the adapter moved."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oomb.real_model import stdlib_source

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    ids = tokenizer(stdlib_source(40_000))["input_ids"]
    assert len(ids) > 7_000
    rows = []
    for p in range(2):
        start = p * 3_500
        prompt = tokenizer.decode(ids[start:start + 3_000])
        rows.append({"prompt": prompt, "chosen": tokenizer.decode(ids[start + 3_000:start + 3_040]),
                     "rejected": tokenizer.decode(ids[start + 3_200:start + 3_230])})
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32, attn_implementation="sdpa")
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    args = DPOConfig(**{**common_args(tmp_path), "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
                        "max_steps": 1, "learning_rate": 1e-3}, max_length=None, beta=0.1)
    step = OOMBConfig(chunk_size=1024, performance=PerformanceConfig(backend="torch"))
    trainer = OOMBDPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), peft_config=lora,
                             processing_class=tokenizer, oomb_config=step)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    (log,) = logged(trainer)
    assert torch.isfinite(torch.tensor(log["loss"])) and log["grad_norm"] > 0
    assert log["num_tokens"] > 12_000
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in trainer.model.named_parameters()
                if p.requires_grad)
    assert moved > 0
