"""oomb.planning.choose: the chooser's decision for a table of workloads and machines, with its reason;
refusals with numbers; user-set options kept; token counts with K/M; backend resolution."""

from __future__ import annotations

import argparse
import dataclasses
import runpy
import sys

import pytest
import torch

from oomb.attention.backend import resolve_backend_name
from oomb.config import OffloadConfig, OOMBConfig, PerformanceConfig, PrecisionConfig
from oomb.planning.choose import (
    CPU_MEMORY_SAVING,
    CPU_SLOWER_ALLOWED,
    SPEED_FACTS,
    NoConfigFitsError,
    Resources,
    Workload,
    choose_backend,
    choose_config,
    fixed_from_options,
    lora_no_replay_bytes,
    predict_candidate,
)
from oomb.planning.memory import GIB
from oomb.planning.model_shape import ModelShape
from oomb.tools.plan import Budget, make_plan, preset_config
from oomb.training.config import TrainerConfig
from oomb.units import parse_tokens

SHAPES = {name: ModelShape.from_hf_config(preset_config(name)) for name in ("tiny-qwen2", "qwen2.5-0.5b", "qwen2.5-7b")}
M = 1 << 20


def gpu(gpu_gib: float, host_gib: float) -> Resources:
    """A machine as `oomb plan --gpu-gib --host-gib` sees it (5 % margin, CUDA context)."""
    budget = Budget(int(gpu_gib * GIB), int(host_gib * GIB))
    return Resources("cuda", budget.gpu_limit, budget.host_limit, gpu_name=f"{gpu_gib:g} GiB GPU")


H200 = gpu(139, 125)
H100 = gpu(79, 125)

# (model, tokens, LoRA rank, machine, fixed) -> (offload, resident layers, dK/dV, layer replay, chunk, backend,
# a phrase of the reason)
CASES = [
    ("tiny-qwen2", 8192, 0, Resources("cpu", None, 20 * GIB), {},
     (False, 0, "float32", False, 4096, "torch", "no offload on a CPU")),
    ("qwen2.5-0.5b", 128 * 1024, 0, H200, {},
     (False, 0, "float32", False, 4096, "cudnn", "all pages on the GPU")),
    ("qwen2.5-0.5b", 4 * M, 0, H200, {},
     (True, 19, "float32", False, 4096, "cudnn", "19 layers resident")),
    ("qwen2.5-7b", 128 * 1024, 16, H200, {},
     (False, 0, "float32", False, 4096, "cudnn", "no layer replay: a chunk's activations fit")),
    ("qwen2.5-7b", M, 16, H200, {},
     (True, 13, "float32", False, 4096, "cudnn", "the pages do not fit the GPU")),
    ("qwen2.5-7b", M, 16, H100, {},
     (True, 9, "float32", True, 4096, "cudnn", "layer replay on: without it")),
    ("qwen2.5-7b", M, 16, H100, {},  # the faster bf16 plan is named, with the setting that takes it
     (True, 9, "float32", True, 4096, "cudnn", "; the fastest bf16 dK/dV plan would take 0.")),
    ("qwen2.5-7b", M, 16, gpu(139, 250), {},  # GPU-bound: more host memory changes nothing
     (True, 13, "float32", False, 4096, "cudnn", "13 layers resident")),
    ("qwen2.5-7b", 2 * M, 16, H200, {},
     (True, 14, "bfloat16", True, 4096, "cudnn", "bf16 dK/dV: no float32 configuration fits")),
    ("qwen2.5-7b", M, 0, H200, {},
     (True, 9, "float32", True, 4096, "cudnn", "9 layers resident")),
    # What the user set is kept, and the rest is chosen around it.
    ("qwen2.5-7b", M, 16, H200, {"offload.enabled": False},
     (False, 0, "bfloat16", True, 4096, "cudnn", "offload.enabled=False as set")),
    ("qwen2.5-7b", M, 16, H200, {"precision.kv_grad_dtype": "bfloat16", "performance.checkpoint_layers": True},
     (False, 0, "bfloat16", True, 4096, "cudnn", "precision.kv_grad_dtype=bfloat16 as set")),
    ("qwen2.5-7b", M, 16, H200, {"offload.resident_layers": 4},
     (True, 4, "bfloat16", False, 4096, "cudnn", "bf16 dK/dV")),
    ("qwen2.5-7b", M, 16, H200, {"performance.backend": "triton"},
     (True, 13, "float32", False, 4096, "triton", "performance.backend='triton' as set")),
    ("qwen2.5-7b", M, 16, H200, {"precision.deterministic": True},
     (True, 13, "float32", False, 4096, "triton", "deterministic=True")),
    ("qwen2.5-7b", 128 * 1024, 16, H200, {"chunk_size": 8192},
     (False, 0, "float32", False, 8192, "cudnn", "no layer replay")),
]


@pytest.mark.parametrize("model,tokens,lora,machine,fixed,expected", CASES)
def test_choice_table(model, tokens, lora, machine, fixed, expected):
    dtype = torch.float32 if machine.device == "cpu" else torch.bfloat16
    choice = choose_config(Workload(SHAPES[model], tokens, dtype=dtype, lora_rank=lora), machine, fixed)
    c = choice.config
    got = (c.offload.enabled, c.offload.resident_layers if c.offload.enabled else 0,
           str(c.precision.grad_dtype).removeprefix("torch."),
           c.performance.checkpoint_layers, c.chunk_size, c.performance.backend)
    assert got == expected[:6], choice.reason
    assert expected[6] in choice.reason
    for key, value in fixed.items():
        assert c.option(key) == value
    limit = machine.gpu_limit if machine.device == "cuda" else machine.host_limit
    assert choice.chosen.gpu_counted <= limit
    assert machine.host_limit is None or choice.host_bytes <= machine.host_limit
    text = choice.describe()
    if machine.device == "cuda":
        assert "configuration:" in text and f"GPU {choice.gpu_bytes / GIB:.1f} GiB" in text
    else:  # one memory: the host's, every term of the step in it
        assert f"host {choice.chosen.host_counted / GIB:.1f} GiB" in text and "GPU" not in text
    if choice.runner_up is not None:  # a real alternative: it fits, and ranks behind
        r = choice.runner_up
        assert r.gpu_counted <= limit and (r.config.precision.grad_dtype, r.relative_time) != (c.precision.grad_dtype,
                                                                                               0)
        searched = (r.config.precision.grad_dtype != torch.float32, r.relative_time) >= (
            c.precision.grad_dtype != torch.float32, choice.chosen.relative_time)
        # it ranks behind, or only its last decisions (kept outputs or logits) put it ahead, and it says so
        assert searched or "not measured" in text


def test_attention_mode_is_never_changed():
    for mode in ("dense", "sparse"):
        choice = choose_config(Workload(SHAPES["qwen2.5-7b"], M, lora_rank=16), H200, {"attention": mode})
        assert choice.config.attention == mode
    choice = choose_config(Workload(SHAPES["qwen2.5-7b"], M, lora_rank=16), H200)
    assert choice.config.attention == "dense"


def test_sparse_offload_uses_its_own_speed_fact():
    choice = choose_config(Workload(SHAPES["qwen2.5-7b"], M, lora_rank=16), H200, {"attention": "sparse"})
    assert choice.config.offload.enabled and "offload_sparse" in choice.chosen.factors


def test_sparse_offload_selects_once_per_chunk_unless_set():
    """With offload a sparse step gets one selection per chunk (an offloaded call stages its blocks'
    union: per block, most of the history); without offload, or when the user set it, it is kept."""
    workload = Workload(SHAPES["qwen2.5-7b"], M, lora_rank=16)
    choice = choose_config(workload, H200, {"attention": "sparse"})
    assert choice.config.offload.enabled and choice.config.sparse.query_block_pages == 4096 // 128
    assert "one sparse selection per chunk" in choice.reason
    assert "one sparse selection per 32 query blocks" in choice.describe()
    kept = choose_config(workload, H200, {"attention": "sparse", "sparse.query_block_pages": 1})
    assert kept.config.offload.enabled and kept.config.sparse.query_block_pages == 1
    assert "one sparse selection" not in kept.reason
    on_gpu = choose_config(Workload(SHAPES["qwen2.5-7b"], 128 * 1024, lora_rank=16), H200, {"attention": "sparse"})
    assert not on_gpu.config.offload.enabled and on_gpu.config.sparse.query_block_pages == 1
    # The trainer leaves it to the chooser unless the config file sets it.
    assert "sparse.query_block_pages" in TrainerConfig().oomb_auto
    given = TrainerConfig.from_dict({"oomb": {"attention": "sparse", "sparse": {"query_block_pages": 1}}})
    assert "sparse.query_block_pages" not in given.oomb_auto


@pytest.mark.parametrize("attention", ["sparse", "dense"])
def test_steps_keep_their_attention_outputs_where_they_fit(attention):
    """The chooser keeps stage 1's attention outputs for a step with every page on the GPU where they fit
    (kept-attention-outputs-128k: 0.941x sparse; kept-attention-outputs-dense-128k: 0.858x dense), after the
    weightier choices; never with offload, on a CPU, under context parallelism, or against the user's setting."""
    from oomb.planning.choose import SPEED_FACTS

    workload = Workload(SHAPES["qwen2.5-7b"], 128 * 1024, lora_rank=16)
    choice = choose_config(workload, H200, {"attention": attention})
    plain = choose_config(workload, H200, {"attention": attention, "performance.keep_attention_outputs": False})
    fact = f"kept_attention_{attention}"
    assert choice.config.performance.keep_attention_outputs and fact in choice.chosen.factors
    # nothing else moved
    assert choice.config == plain.config.with_options({"performance.keep_attention_outputs": True})
    assert choice.chosen.relative_time == pytest.approx(plain.chosen.relative_time * SPEED_FACTS[fact].factor)
    assert choice.chosen.prediction.gpu["kept attention"] == 128 * 1024 * 28 * 28 * (128 * 2 + 4)
    assert f"{attention} attention outputs kept for stage 2: they fit" in choice.reason
    assert "attention outputs kept" in choice.describe()
    assert "performance.keep_attention_outputs=False as set" in plain.reason
    # Not with offload (1M), not on a CPU.
    assert not choose_config(Workload(SHAPES["qwen2.5-7b"], M, lora_rank=16), H200,
                             {"attention": attention}).config.performance.keep_attention_outputs
    cpu = Resources("cpu", None, 1 << 42)
    assert not choose_config(Workload(SHAPES["tiny-qwen2"], 8192, dtype=torch.float32), cpu,
                             {"attention": attention}).config.performance.keep_attention_outputs
    # A GPU where the step fits without them but not with them: recomputed, the rest as on the larger GPU.
    kept_bytes = choice.chosen.gpu_counted - plain.chosen.gpu_counted
    tight = Resources("cuda", plain.chosen.gpu_counted + kept_bytes // 2, H200.host_limit)
    narrow = choose_config(workload, tight, {"attention": attention})
    assert narrow.config == plain.config
    assert "attention outputs recomputed in stage 2: keeping them does not fit" in narrow.reason
    # Not under context parallelism, which refuses them; said so, not as if the user had set it.
    shared = choose_config(dataclasses.replace(workload, context_parallel=True), H200, {"attention": attention})
    assert shared.config == plain.config
    assert "context parallelism refuses keeping them" in shared.reason and "as set" not in shared.reason
    # The trainer leaves it to the chooser unless the config file sets it.
    assert "performance.keep_attention_outputs" in TrainerConfig().oomb_auto
    assert "performance.keep_attention_outputs" not in TrainerConfig.from_dict(
        {"oomb": {"performance.keep_attention_outputs": False}}).oomb_auto


def test_refusal_names_numbers_and_what_fits():
    with pytest.raises(NoConfigFitsError) as err:
        choose_config(Workload(SHAPES["qwen2.5-7b"], 2 * M), H200)
    message = str(err.value)
    assert "no configuration fits 1 x 2,097,152 tokens (2M)" in message
    assert "host 170.0 GiB of 118.8 usable" in message  # the closest configuration's need vs the limit
    assert "up to 1,610,752 tokens (1.54M) fit" in message


def test_refusal_says_which_fixed_option_blocks():
    with pytest.raises(NoConfigFitsError,
                       match=r"without the options you set \(offload.enabled=False\) it fits: offload"):
        choose_config(Workload(SHAPES["qwen2.5-7b"], 2 * M, lora_rank=16), H200, {"offload.enabled": False})


def test_refusal_when_the_weights_alone_do_not_fit():
    tiny_gpu = Resources("cuda", 4 * GIB, 100 * GIB)
    with pytest.raises(NoConfigFitsError, match=r"not even one page of tokens fits.*\(train LoRA adapters, offload"):
        choose_config(Workload(SHAPES["qwen2.5-7b"], 8192), tiny_gpu)
    with pytest.raises(NoConfigFitsError, match=r"too large \(offload the optimizer"):  # LoRA is already given
        choose_config(Workload(SHAPES["qwen2.5-7b"], 8192, lora_rank=16), Resources("cuda", 1 * GIB, 100 * GIB))
    with pytest.raises(NoConfigFitsError, match=r"too large \(bfloat16 weights \(--dtype bfloat16\), a smaller"):
        choose_config(Workload(SHAPES["qwen2.5-7b"], 8192, lora_rank=16, dtype=torch.float32),
                      Resources("cpu", None, 4 * GIB))


def test_more_memory_never_picks_a_slower_plan():
    """Monotone: a larger GPU gives a plan at least as fast (same exactness or better)."""
    workload = Workload(SHAPES["qwen2.5-7b"], M, lora_rank=16)
    ranks = []
    for gpu_gib in (60, 79, 100, 139, 192):
        chosen = choose_config(workload, gpu(gpu_gib, 125)).chosen
        ranks.append((chosen.config.precision.grad_dtype != torch.float32, round(chosen.relative_time, 6)))
    assert ranks == sorted(ranks, reverse=True)


def test_models_with_layers_cudnn_cannot_run_get_triton():
    """Softcapping is refused by the cudnn backend (oomb/attention/variants.py): the chooser must not hand
    `oomb train` a backend the engine then refuses. Sliding windows and sinks run on cudnn (its band path),
    so Gemma 3 and gpt-oss get it as other models do."""
    refuses = {name: ModelShape.from_hf_config(preset_config(name)).cudnn_refuses
               for name in ("qwen2.5-7b", "gemma-2-9b", "gemma-3-12b", "gpt-oss-20b")}
    assert refuses["qwen2.5-7b"] is None
    assert refuses["gemma-2-9b"] == "attention logit softcapping"
    assert refuses["gemma-3-12b"] is None
    assert refuses["gpt-oss-20b"] is None
    backend, why = choose_backend("cuda", torch.bfloat16, False, refuses["gemma-2-9b"])
    assert backend == "triton" and "softcapping" in why
    assert choose_backend("cuda", torch.float32, False, refuses["gemma-2-9b"])[0] == "torch"
    for name, backend in (("gemma-3-12b", "cudnn"), ("gemma-2-9b", "triton")):
        shape = ModelShape.from_hf_config(preset_config(name))
        assert choose_config(Workload(shape, 32 * 1024, lora_rank=16),
                             H200).chosen.config.performance.backend == backend


def test_backend_choice_and_resolution():
    assert choose_backend("cuda", torch.bfloat16, False)[0] == "cudnn"
    assert choose_backend("cuda", torch.bfloat16, True)[0] == "triton"
    assert choose_backend("cuda", torch.float32, False)[0] == "torch"
    assert choose_backend("cpu", torch.bfloat16, False)[0] == "torch"
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_backend_name("auto", cuda, torch.bfloat16) == "cudnn"
    assert resolve_backend_name("auto", cuda, torch.float16, deterministic=True) == "triton"
    assert resolve_backend_name("auto", cuda, torch.float32) == "torch"
    assert resolve_backend_name("auto", cuda, torch.float32, deterministic=True) == "triton"
    assert resolve_backend_name("auto", cuda) == "triton"  # dtype unknown (the engine today): as before
    assert resolve_backend_name("auto", cpu, torch.bfloat16) == "torch"
    assert resolve_backend_name("triton", cuda, torch.bfloat16) == "triton"
    with pytest.raises(ValueError, match="not bitwise deterministic"):
        resolve_backend_name("cudnn", cuda, torch.bfloat16, deterministic=True)
    with pytest.raises(ValueError, match="precision.deterministic=True conflicts with performance.backend='cudnn'"):
        OOMBConfig(performance=PerformanceConfig(backend="cudnn"), precision=PrecisionConfig(deterministic=True))
    assert SPEED_FACTS["triton_vs_cudnn_dense"].factor > 1  # the measurement cudnn-by-default rests on


def test_speed_facts_name_their_source_files():
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    for key, fact in SPEED_FACTS.items():
        names = [w.strip(" ,()") for w in fact.source.split() if w.strip(" ,()").endswith(".json")]
        assert names or fact.source.startswith(("assumed", "derived")), key
        for name in names:
            assert (results / name).is_file(), f"{key}: {name}"


def test_plan_prints_the_choice_and_runner_up():
    plan = make_plan("qwen2.5-7b", SHAPES["qwen2.5-7b"], M, Budget(139 * GIB, 125 * GIB), OOMBConfig(),
                     fixed={})
    assert plan.choice is not None and plan.choice.config.offload.enabled
    from oomb.tools.plan import format_plan, plan_to_dict

    text = format_plan(plan)
    assert "oomb train would run (dense attention" in text and "runner-up:" in text
    assert plan_to_dict(plan)["choice"]["offload.resident_layers"] == plan.choice.config.offload.resident_layers


def test_plan_cli_aliases_and_token_counts(capsys):
    from oomb.cli import main

    assert main(["plan", "--model", "qwen2.5-7b", "--seq-len", "2M", "--gpu-gib", "139", "--host-gib", "125",
                 "--offload-resident-layers", "3", "--sparse-budget", "32"]) in (0, 1)
    out = capsys.readouterr().out
    assert "2,097,152 tokens (2M)" in out and "oomb train would refuse" in out


def test_token_counts():
    assert parse_tokens("1M") == M and parse_tokens("128K") == 131072 and parse_tokens("1.5K") == 1536
    assert parse_tokens(4096) == 4096
    for bad in ("1.3", "0", "one", True):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_tokens(bad)
    config = TrainerConfig.load(None, ["data.seq_len=1M", "oomb.chunk_size=2K",
                                       "oomb.performance.loss_chunk_tokens=1K"])
    assert (config.data.seq_len, config.oomb.chunk_size, config.oomb.performance.loss_chunk_tokens) == (M, 2048, 1024)
    with pytest.raises(ValueError, match="data.seq_len='1Q'"):
        TrainerConfig.load(None, ["data.seq_len=1Q"])


def test_trainer_config_knows_what_is_left_to_the_chooser():
    config = TrainerConfig.load(None, ["oomb.offload.enabled=true", "oomb.precision.kv_grad_dtype=auto"])
    assert "offload.enabled" not in config.oomb_auto and "precision.kv_grad_dtype" in config.oomb_auto
    printed = config.to_dict()["oomb"]
    assert printed["offload"]["enabled"] is True and printed["precision"]["kv_grad_dtype"] == "auto"
    assert printed["performance"]["backend"] == "auto"
    assert TrainerConfig.from_dict(config.to_dict()).oomb_auto == config.oomb_auto  # round trip
    # Built in Python: the options still at their defaults are left to the chooser.
    assert "offload.enabled" not in TrainerConfig(oomb=OOMBConfig(offload=OffloadConfig(enabled=True))).oomb_auto
    assert TrainerConfig(oomb_auto=()).oomb_auto == ()
    assert fixed_from_options({"performance.backend": "auto", "precision.kv_grad_dtype": "bf16"}) == {
        "precision.kv_grad_dtype": "bfloat16"}


def test_python_dash_m_oomb(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["oomb", "train", "--seq-len", "1K", "--print-config"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("oomb", run_name="__main__")
    assert exit_.value.code == 0
    assert "seq_len: 1024" in capsys.readouterr().out


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from helpers import build_tiny_model

    from oomb.training.presets import BYTE_VOCAB, byte_tokenizer

    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model("qwen2", vocab_size=BYTE_VOCAB + 1).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.mark.slow
def test_oomb_train_prints_the_plan_and_first_step_apart(tmp_path, tiny_model_dir, capsys):
    """CPU end to end: the chooser runs before the first step (chunk and page fixed by the user),
    its plan is printed, config.yaml records what ran, the summary reports the first step apart."""
    import yaml

    from oomb.cli import main

    data = tmp_path / "notes.txt"
    data.write_text("".join(f"note {i}: long context training, chunk by chunk.\n" for i in range(100)))
    def args(out):
        return ["train", "--model", str(tiny_model_dir), "--data", str(data), "--seq-len", "0.25K", "--steps", "3",
                "--output-dir", str(out), "--chunk-size", "128", "--page-size", "32",
                "--set", "logging.progress=false", "--set", "train.device=cpu", "--set", "checkpoint.export=false"]

    assert main(args(tmp_path / "out")) == 0
    printed = capsys.readouterr().out
    assert ("configuration: pages in host memory, dK/dV float32, layer replay off, loss fused (head's gradient made "
            "in the forward: nothing kept), chunk 128, backend torch") in printed
    assert "why: no offload on a CPU" in printed
    assert "step time: first" in printed
    assert "first step's overhead" in printed or "the first step took no longer than the others" in printed
    ran = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["oomb"]
    assert ran["performance"]["checkpoint_layers"] is False and ran["performance"]["backend"] == "torch"
    assert ran["chunk_size"] == 128

    assert main([*args(tmp_path / "out2"), "--no-auto-config"]) == 0
    assert "configuration:" not in capsys.readouterr().out
    ran = yaml.safe_load((tmp_path / "out2" / "config.yaml").read_text())["oomb"]
    assert ran["performance"]["checkpoint_layers"] is True and ran["performance"]["backend"] == "auto"


def test_float32_documents_on_cuda_take_the_torch_kernels():
    """A masked step (packed documents, windows) of a float32 model on CUDA gets torch, as an unmasked one:
    Triton's float32 kernels take minutes to compile (fp32_first_step_h200_2026-12-02.json)."""
    from helpers import build_tiny_model

    import oomb.engine

    model = build_tiny_model("qwen2", seed=0)
    for masked in (False, True):
        backend = oomb.engine._select_step_backend(model, OOMBConfig(), torch.device("cuda"), masked)
        assert backend.name == "torch"


def test_log_probabilities_are_kept_only_where_they_fit_next_to_the_plan():
    """The chooser keeps the loss slices' log-probabilities (no LM-head recompute) as a last choice: where
    they fit next to the plan (7B LoRA 128K on the H200), never at the cost of an earlier decision (at 1M the
    offloaded plan stays as without the option), and never against the user's setting."""
    workload = Workload(SHAPES["qwen2.5-7b"], 128 * 1024, lora_rank=16)
    kept = choose_config(workload, H200)
    assert kept.config.performance.recompute_logits is False and "log-probabilities kept" in kept.reason
    assert "recompute_logits_dense" not in kept.chosen.factors
    recomputed = choose_config(workload, H200, {"performance.recompute_logits": True})
    assert recomputed.config.performance.recompute_logits is True
    assert "performance.recompute_logits=True as set" in recomputed.reason
    assert kept.gpu_bytes > recomputed.gpu_bytes  # the kept log-probabilities are counted
    between = (recomputed.chosen.gpu_counted + kept.chosen.gpu_counted) // 2
    tight = choose_config(workload, Resources("cuda", between, H200.host_limit))
    assert tight.config.performance.recompute_logits is True and "keeping them does not fit" in tight.reason
    long = choose_config(dataclasses.replace(workload, seq_len=M), H200)
    plain = choose_config(dataclasses.replace(workload, seq_len=M), H200, {"performance.recompute_logits": True})
    assert long.config.with_options({"performance.recompute_logits": True}) == plain.config
    # A base that keeps them, not fixed, does not steer the search: the same plan as the default base.
    steered = choose_config(dataclasses.replace(workload, seq_len=M), H200,
                            base=OOMBConfig(performance=PerformanceConfig(recompute_logits=False)))
    assert steered.config == long.config
    # The runner-up is compared after the same last decision.
    assert kept.runner_up is not None and kept.runner_up.config.performance.recompute_logits is False


def test_the_trainer_fixes_what_the_run_decides():
    """What the trainer hands the chooser as fixed: the user's options, and the Triton backend for separate
    documents on CUDA only where sliding windows bind inside them (cuDNN runs other documents)."""
    from oomb.training.trainer import chooser_fixed

    plain = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=128, vocab_size=256)
    windowed = dataclasses.replace(plain, sliding_window=128, sliding_window_layers=1)
    config = TrainerConfig.load(None, ["oomb.attention=sparse"])
    assert chooser_fixed(config, True, plain)["attention"] == "sparse"
    assert "performance.keep_attention_outputs" not in chooser_fixed(config, True, plain)
    documents = TrainerConfig.load(None, ["data.documents=separate", "data.seq_len=1024"])
    assert "performance.backend" not in chooser_fixed(documents, True, plain)
    assert chooser_fixed(documents, True, windowed)["performance.backend"] == "triton"
    assert "performance.backend" not in chooser_fixed(documents, False, windowed)
    assert "performance.backend" not in chooser_fixed(dataclasses.replace(documents), True,
                                          dataclasses.replace(windowed, sliding_window=4096))


SMOLLM2 = ModelShape(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                     intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)
"""SmolLM2-135M's shape (oomb/real_model.py), without its files."""


def test_cpu_prediction_counts_every_term_as_host_memory_and_prefers_replay():
    """On a CPU activations, logits and pages are host memory: a SmolLM2-135M LoRA step at 8K in float32 was
    predicted at 2.0 GiB of host (the process alone) where 16.5 GiB were measured without layer replay and 7.9
    GiB with it, for 3 % more time. The prediction counts them, and the chooser takes the replay."""
    workload = Workload(SMOLLM2, 8192, dtype=torch.float32, lora_rank=16)
    small = Resources("cpu", None, 16 * GIB, weights_loaded=True)  # a 16 GiB laptop's free memory
    choice = choose_config(workload, small)
    chosen = choice.chosen
    assert choice.config.performance.checkpoint_layers and choice.config.chunk_size == 4096, choice.reason
    terms = chosen.prediction.gpu
    assert chosen.host_counted == sum(terms.values()) - terms["weights"] + chosen.host_bytes
    assert chosen.host_counted > 2 * chosen.prediction.host["process"]  # activations, logits, pages counted
    without = choose_config(workload, small, {"performance.checkpoint_layers": False, "chunk_size": 4096}).chosen
    assert without.host_counted > (1 / (1 - CPU_MEMORY_SAVING)) * chosen.host_counted
    assert chosen.relative_time <= without.relative_time * CPU_SLOWER_ALLOWED
    # No replay keeps PEFT's inputs in the model's dtype: twice the bf16 bytes in float32.
    assert lora_no_replay_bytes(SMOLLM2, 4096, torch.float32) == 2 * lora_no_replay_bytes(SMOLLM2, 4096,
                                                                                           torch.bfloat16)
    text = choice.describe()
    assert "pages in host memory" in text and "GPU" not in text
    assert f"instead of {without.host_counted / GIB:.1f} GiB" in choice.reason
    # On a GPU the same step keeps the faster plan: the GPU's memory is the step's alone.
    on_gpu = choose_config(dataclasses.replace(workload, dtype=torch.bfloat16), gpu(79, 125))
    assert not on_gpu.config.performance.checkpoint_layers


def test_refusal_of_a_grown_sparse_budget_says_whether_the_fixed_budget_fits():
    """At 2M on an H200 the defaults (35 % of the history and the first 5 of 28 layers whole: 46.7 % read) do not
    fit, the fixed budget does: the refusal offers that trade with the share it reads, and never makes it itself."""
    workload = Workload(SHAPES["qwen2.5-7b"], 2 * M, lora_rank=16)
    with pytest.raises(NoConfigFitsError) as err:
        choose_config(workload, H200, {"attention": "sparse"})
    message = str(err.value)
    assert ("with the fixed budget (--sparse-read-share none: 64 pages per query block, 0.8% of the history at 2M "
            "instead of 46.7%) it fits: offload (14 of 28 layers resident") in message
    fixed = choose_config(workload, H200, {"attention": "sparse", "sparse.read_share": None})
    assert f"host {fixed.host_bytes / GIB:.1f} GiB); docs/sparse.md" in message
    # Dense steps and fixed budgets get no such line.
    with pytest.raises(NoConfigFitsError) as err:
        choose_config(dataclasses.replace(workload, seq_len=4 * M), H200,
                      {"attention": "sparse", "sparse.read_share": None})
    assert "with the fixed budget" not in str(err.value)


def test_eager_layers_cost_their_measured_factor_on_a_gpu():
    """A step whose layers may not compile (an active dropout, several processes) runs them eager: the prediction
    counts what eager layers were measured to cost against compiled ones, more with LoRA's small kernels. A
    workload that may compile pays nothing, with or without layer replay (replayed layers run compiled), and a
    CPU step never pays it (nothing compiles there)."""
    shape = SHAPES["qwen2.5-7b"]
    replay, no_replay = ({"performance.checkpoint_layers": on} for on in (True, False))
    for lora, fact in ((16, "eager_layers_lora"), (0, "eager_layers")):
        workload = Workload(shape, 128 * 1024, lora_rank=lora, may_compile=True)
        eager = predict_candidate(dataclasses.replace(workload, may_compile=False), H200,
                                  OOMBConfig().with_options(replay))
        compiled = predict_candidate(workload, H200, OOMBConfig().with_options(replay))
        assert fact in eager.factors and not any(f.startswith("eager") for f in compiled.factors)
        assert eager.relative_time == pytest.approx(compiled.relative_time * SPEED_FACTS[fact].factor)
        without = predict_candidate(workload, H200, OOMBConfig().with_options(no_replay))
        assert compiled.relative_time == pytest.approx(without.relative_time * SPEED_FACTS["replay_dense"].factor)
    assert SPEED_FACTS["eager_layers_lora"].factor > SPEED_FACTS["eager_layers"].factor > 1
    cpu = predict_candidate(Workload(shape, 8192, lora_rank=16), Resources("cpu", None, 64 * GIB),
                            OOMBConfig().with_options(replay))
    assert not any(f.startswith("eager") for f in cpu.factors)
