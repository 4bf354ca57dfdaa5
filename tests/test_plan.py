"""The memory planner: model terms against docs/benchmarks.md's arithmetic and H200 measurements, search, CLI."""

import json

import pytest
import torch
from transformers import Qwen2Config

from oomb import cli
from oomb.config import ATTENTION_MODES, OOMBConfig, PerformanceConfig, PrecisionConfig, SparseConfig
from oomb.planning.fit import SAFETY_MARGIN
from oomb.planning.memory import (
    GIB,
    MODES,
    TrainingSetup,
    estimate_step_memory,
    predict,
)
from oomb.tools.plan import (
    Budget,
    format_tokens,
    is_implemented,
    largest_context,
    load_model_shape,
    make_plan,
    oomb_config_for,
    parse_tokens,
)
from oomb.training.config import LoraSection

KIB = 1024
QWEN7B = load_model_shape("qwen2.5-7b")
BENCH = TrainingSetup(torch.bfloat16, 1, "none")  # the standard workload: no optimizer
FIXED = SparseConfig(read_share=None)
"""The fixed budget of the measured sparse runs (the default reads a share of the history instead)."""
BENCH_CONFIG = OOMBConfig(sparse=FIXED, precision=PrecisionConfig(fp32_grad_accumulation=False))
MINMAX_CONFIG = OOMBConfig(sparse=SparseConfig(score="minmax", read_share=None),
                           precision=PrecisionConfig(fp32_grad_accumulation=False))
"""Sparse modes sized for minmax's two summary vectors per page (the default rerank keeps three), fixed budget."""


def test_presets_have_the_documented_shapes():
    assert QWEN7B.num_params() == 7_615_616_512  # what transformers built on the H200 (step_h200 JSON)
    assert QWEN7B.kv_bytes_per_token(torch.bfloat16) == 56 * KIB
    small = load_model_shape("qwen2.5-0.5b")
    assert (small.num_layers, small.num_kv_heads, small.head_dim, small.tie_word_embeddings) == (24, 2, 64, True)
    assert small.kv_bytes_per_token(torch.bfloat16) == 12 * KIB
    llama = load_model_shape("llama3-8b")
    assert (llama.num_layers, llama.head_dim, llama.attention_bias, llama.vocab_size) == (32, 128, False, 128256)
    assert load_model_shape("tiny-qwen2").hidden_size == 64


def test_kv_pages_of_qwen7b_at_one_million_tokens():
    """56 KiB/token K+V, 112 KiB fp32 dK+dV: 1M tokens = 56 GiB + 112 GiB."""
    p = predict("dense+offload", QWEN7B, 1 << 20, OOMBConfig(precision=PrecisionConfig(kv_grad_dtype="float32")))
    assert p.host["KV pages"] == 56 * GIB
    assert p.host["KV grad pages"] == 112 * GIB
    dense = predict("dense", QWEN7B, 1 << 20, OOMBConfig(precision=PrecisionConfig(kv_grad_dtype="float32")))
    assert dense.gpu["KV working set"] == 168 * GIB


def test_one_million_tokens_fits_only_with_offload_and_bf16_grad_pages():
    """Our GPU machine: 141 GB GPU, 125 GiB host."""
    budget = Budget(gpu_bytes=141 * GIB, host_bytes=125 * GIB)
    for grad_dtype, offload_fits in (("float32", False), ("bfloat16", True)):
        plan = make_plan("qwen2.5-7b", QWEN7B, 1 << 20, budget,
                         OOMBConfig(sparse=FIXED, precision=PrecisionConfig(kv_grad_dtype=grad_dtype)), BENCH)
        fits = {r.mode.name: r for r in plan.reports}
        assert not fits["dense"].fits and not fits["dense"].fits_gpu
        assert not fits["hf"].fits
        assert fits["dense+offload"].fits_gpu
        assert fits["dense+offload"].fits is offload_fits
        assert fits["sparse+offload"].fits is offload_fits
    assert any("dense+offload fits with --kv-grad-dtype bfloat16" in h for h in
               make_plan("q", QWEN7B, 1 << 20, budget, OOMBConfig(), BENCH).hints)


# Measured on the H200 (benchmarks/results/step_h200_2026-11-29{a,b}.json): GiB above the weights.
MEASURED_HF = {32768: 22.74, 65536: 32.68, 131072: 64.22}
MEASURED_DENSE = {32768: 23.41, 65536: 28.66, 131072: 39.94, 262144: 60.94}  # 32K/64K: run a, others: run b


@pytest.mark.parametrize(("mode", "measured"), [("hf", MEASURED_HF), ("dense", MEASURED_DENSE)])
def test_predictions_within_ten_percent_of_h200_measurements(mode, measured):
    for tokens, gib in measured.items():
        predicted = predict(mode, QWEN7B, tokens, BENCH_CONFIG, BENCH).gpu_above_weights / GIB
        assert abs(predicted / gib - 1) < 0.10, (mode, tokens, predicted, gib)


def test_hf_runs_out_of_memory_at_256k_on_the_h200():
    h200 = Budget(gpu_bytes=int(139.8 * GIB), host_bytes=125 * GIB)
    assert predict("hf", QWEN7B, 131072, BENCH_CONFIG, BENCH).gpu_total <= h200.gpu_limit
    assert predict("hf", QWEN7B, 262144, BENCH_CONFIG, BENCH).gpu_total > h200.gpu_limit


def test_estimate_step_memory_keeps_its_interface():
    est = estimate_step_memory(QWEN7B, 131072, BENCH_CONFIG, trainable_params=QWEN7B.num_params())
    gib = est.as_gib()
    assert set(gib) == {"param_grads", "chunk_activations", "kv_pages", "logits_slice", "kept_attention", "total"}
    assert gib["kv_pages"] == 21.0 and gib["kept_attention"] == 0
    full = predict("dense", QWEN7B, 131072, BENCH_CONFIG, BENCH)
    assert est.total == full.gpu_above_weights - full.gpu["page tables"]
    # The trainer's check counts the kept attention outputs as the planner does.
    keep = BENCH_CONFIG.with_options({"performance.keep_attention_outputs": True})
    kept = estimate_step_memory(QWEN7B, 131072, keep, trainable_params=QWEN7B.num_params())
    assert kept.kept_attention == predict("dense", QWEN7B, 131072, keep, BENCH).gpu["kept attention"] > 0
    assert kept.total == est.total + kept.kept_attention


def test_terms_follow_the_options():
    base = predict("dense", QWEN7B, 65536, OOMBConfig(precision=PrecisionConfig(fp32_grad_accumulation=False)), BENCH)
    acc = predict("dense", QWEN7B, 65536, OOMBConfig(precision=PrecisionConfig(fp32_grad_accumulation=True)), BENCH)
    # fp32 sums of every parameter; the bf16 .grad only of the embedding and norms (linear layers add
    # to the sums directly, oomb/fp32_linear.py). Measured on the H200 at 32K: +13.53 GiB.
    assert acc.gpu["fp32 grad sums"] == 4 * QWEN7B.num_params()
    assert acc.gpu["param grads"] == 2 * QWEN7B.non_linear_params() == 2 * (152064 * 3584 + 57 * 3584)
    assert acc.gpu_total - base.gpu_total == 2 * QWEN7B.num_params() + 2 * QWEN7B.non_linear_params()
    # Under tensor parallelism fp32_linear.py is off: every parameter keeps its bf16 .grad.
    tp2 = QWEN7B.per_rank(2)
    assert predict("dense", tp2, 65536, OOMBConfig(), BENCH).gpu["param grads"] == 2 * tp2.num_params()
    # Gradients into a trainer's fp32 master .grad (counted by the trainer): no sums, few bf16 .grad.
    config, trainable = OOMBConfig(), QWEN7B.num_params()
    to_masters = estimate_step_memory(QWEN7B, 65536, config, trainable_params=trainable, fp32_targets=True)
    summed = estimate_step_memory(QWEN7B, 65536, config, trainable_params=trainable)
    assert to_masters.param_grads == 2 * QWEN7B.non_linear_params()
    assert summed.param_grads == to_masters.param_grads + 4 * trainable
    adamw = predict("dense", QWEN7B, 65536, OOMBConfig(precision=PrecisionConfig(fp32_grad_accumulation=False)),
                    TrainingSetup())
    assert adamw.gpu["optimizer"] == 4 * QWEN7B.num_params()  # bf16 moments: AdamW steps the bf16 weights
    masters = predict("dense", QWEN7B, 65536, OOMBConfig(), TrainingSetup(master_weights=True))
    assert masters.gpu["optimizer"] == (8 + 4) * QWEN7B.num_params()  # fp32 moments + fp32 master weights
    lora = predict("dense", QWEN7B, 65536, OOMBConfig(), TrainingSetup(lora_rank=16))
    assert lora.gpu["param grads"] == 4 * QWEN7B.lora_params(16) < base.gpu["param grads"] / 50
    assert lora.gpu["fp32 grad sums"] == 0  # LoRA adapters are fp32 already
    sparse = predict("sparse", QWEN7B, 65536, MINMAX_CONFIG, BENCH)
    pages = 65536 // 128
    # int32 page ids per query block (page), layer and KV head, of the 13 chunks whose history of 96-480 pages
    # outgrows the sink and budget (the first three, 0-64 pages, read densely: nothing kept)
    selections = 28 * 13 * 32 * 4 * 65 * 4
    assert sparse.gpu["page summaries"] == 28 * pages * 2 * 4 * 128 * 2 + selections  # min/max key, head, layer


def test_offload_keeps_gpu_memory_flat():
    small, large = (predict("dense+offload", QWEN7B, t, BENCH_CONFIG, BENCH) for t in (1 << 17, 1 << 22))
    assert large.gpu_total - small.gpu_total < 1 * 1024**2  # only the page tables grow
    assert large.host_total > 30 * small.host_total - 30 * 2 * GIB
    # Sparse + offload stages the union of a chunk's selections: at most 32 blocks x 4 KV heads x 65
    # pages, reached by about 1.04M tokens; beyond, only the summaries grow.
    sparse_small, sparse_large = (predict("sparse+offload", QWEN7B, t, MINMAX_CONFIG, BENCH)
                                  for t in (1 << 21, 1 << 22))
    growth_per_10k = (sparse_large.gpu_total - sparse_small.gpu_total) / ((1 << 22) - (1 << 21)) * 10_000
    # Only the page summaries: 28 layers x 2 vectors x 4 KV heads x 128 x 2 bytes per 128-token page
    # (the selections wait on the host), under issue 5's 5 MB per 10K tokens.
    summaries_per_10k = 28 * 2 * 4 * 128 * 2 / 128 * 10_000
    assert summaries_per_10k <= growth_per_10k < summaries_per_10k + 4096 and growth_per_10k < 5e6
    assert sparse_large.host["selections"] == 28 * ((1 << 22) // 4096 - 3) * 32 * 4 * 65 * 4  # as above


def test_largest_context_search():
    assert largest_context(lambda t: t <= 1000, 128) == 896
    assert largest_context(lambda t: t <= 100, 128) == 0
    assert largest_context(lambda t: True, 128, limit=10_000) == 9984
    assert largest_context(lambda t: t <= 128 * 37, 128) == 128 * 37


def test_largest_context_is_exact_and_monotone_in_the_budget():
    config = OOMBConfig()
    previous = {m: 0 for m in MODES}
    for gpu_gib in (40, 60, 80, 141, 300):
        budget = Budget(gpu_bytes=gpu_gib * GIB, host_bytes=125 * GIB)
        plan = make_plan("qwen2.5-7b", QWEN7B, 4096, budget, config, BENCH)
        for r in plan.reports:
            assert r.largest_context >= previous[r.mode.name], (r.mode.name, gpu_gib)
            previous[r.mode.name] = r.largest_context
            if r.largest_context:
                at, beyond = (predict(r.mode.name, QWEN7B, t, config, BENCH)
                              for t in (r.largest_context, r.largest_context + config.page_size))
                assert at.gpu_total <= budget.gpu_limit and at.host_total <= budget.host_limit
                assert beyond.gpu_total > budget.gpu_limit or beyond.host_total > budget.host_limit
    assert previous["dense"] > previous["hf"] > 0


def test_implemented_modes_follow_the_config():
    assert is_implemented("hf") and is_implemented("dense")
    assert is_implemented("sparse") == ("sparse" in ATTENTION_MODES)
    assert oomb_config_for("dense", OOMBConfig(chunk_size=256)).chunk_size == 256
    for mode in MODES:
        if not is_implemented(mode):
            with pytest.raises(NotImplementedError, match="not implemented in this version"):
                oomb_config_for(mode, OOMBConfig())


def test_token_counts():
    assert parse_tokens("128K") == 131072 and parse_tokens("1M") == 1 << 20 and parse_tokens("4096") == 4096
    assert format_tokens(131072) == "128K" and format_tokens(1 << 20) == "1M" and format_tokens(1000) == "1,000"
    with pytest.raises(Exception, match="not a token count"):
        parse_tokens("lots")
    with pytest.raises(Exception, match="'0': a token count must be at least 1"):  # a page size as a context length
        parse_tokens("0")


def test_index_runs():
    from oomb.units import format_indices

    assert format_indices((4, 0, 1, 2, 3, 7)) == "0-4, 7" and format_indices([5]) == "5" and format_indices(()) == ""


def test_cli_table(capsys):
    rc = cli.main(["plan", "--model", "qwen2.5-7b", "--context", "1M", "--gpu-gib", "139", "--host-gib", "125",
                   "--no-master-weights"])
    out = capsys.readouterr().out
    assert rc == 0  # no mode fits 1M tokens with the options above, but the chooser's plan does: train runs it
    for text in ("dense+offload", "sparse+offload", "implemented", "largest context", "KV grad pages",
                 "does not fit with the options above: dense: GPU", "fits at 1,048,576 tokens",
                 "dense+offload fits with --kv-grad-dtype bfloat16"):
        assert text in out, text
    rc = cli.main(["plan", "--model", "qwen2.5-0.5b", "--context", "128K", "--gpu-gib", "139", "--host-gib", "125",
                   "--modes", "dense", "hf"])
    assert rc == 0
    assert "fits at 131,072 tokens with the options above: dense, hf" in capsys.readouterr().out
    assert cli.main(["plan", "--model", "qwen2.5-7b", "--context", "1M", "--gpu-gib", "16", "--host-gib", "16"]) == 1
    assert "oomb train would refuse: no configuration fits" in capsys.readouterr().out


def test_cli_sparse_read_share_as_in_train(capsys):
    """`oomb plan --sparse-read-share` takes train's values: the default share reads far more of a 1M history
    than the fixed budget ('none'), so its predicted step is longer."""
    common = ["plan", "--model", "qwen2.5-7b", "--context", "1M", "--gpu-gib", "79.6", "--host-gib", "120", "--lora",
              "--attention", "sparse", "--gpu", "H100"]
    lines = {}
    for share in ("none", "auto", "0.1"):
        assert cli.main([*common, "--sparse-read-share", share]) == 0
        lines[share] = next(x for x in capsys.readouterr().out.splitlines() if "sparse reads" in x)
    assert "reads 1.6 % of the history" in lines["none"]
    assert "reads 46.8 % of the history" in lines["auto"]  # 35 %, and 5 of 28 layers whole
    assert "reads 10.2 % of the history" in lines["0.1"]  # 10 % of each block's history, at least 64 pages
    assert cli.main([*common, "--sparse-budget", "64"]) == 0  # a budget given alone is fixed, the default too
    assert next(x for x in capsys.readouterr().out.splitlines() if "sparse reads" in x) == lines["none"]
    assert cli.main([*common, "--sparse-budget", "64", "--sparse-read-share", "auto"]) == 0
    assert next(x for x in capsys.readouterr().out.splitlines() if "sparse reads" in x) == lines["auto"]


def test_cli_named_gpu_plans_that_card_on_any_machine(capsys, monkeypatch):
    """`oomb plan --gpu H100` on a machine without one plans the H100's GPU step (its size, its step times);
    a kind of unknown size asks for --gpu-gib."""
    monkeypatch.setattr("oomb.machine.detect_gpu", lambda *a, **k: None)
    rc = cli.main(["plan", "--model", "qwen2.5-7b", "--context", "128K", "--gpu", "H100", "--host-gib", "120",
                   "--lora", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert report["budget"]["gpu_bytes"] == int(79.6 * 2**30)
    assert cli.main(["plan", "--model", "qwen2.5-7b", "--gpu", "A100", "--host-gib", "120"]) == 2
    assert "--gpu A100: its size is not known here; give it with --gpu-gib" in capsys.readouterr().err
    # The host memory is this machine's unless given: said, since the card planned is elsewhere.
    hint = "host memory is this machine's, the GPU the one named: give the target machine's with --host-gib"
    monkeypatch.setattr("oomb.machine.host_available_bytes", lambda *a, **k: 16 * 2**30)
    cli.main(["plan", "--model", "qwen2.5-7b", "--context", "128K", "--gpu", "H100", "--lora"])
    out = capsys.readouterr().out
    assert hint in out and "GPU 79.6 GiB (H100's size, --gpu)" in out  # the card's size, not one the user gave
    cli.main(["plan", "--model", "qwen2.5-7b", "--context", "128K", "--gpu", "H100", "--host-gib", "120", "--lora"])
    assert hint not in capsys.readouterr().out


def test_cli_sparse_choice_groups_selections_with_offload_unless_given(capsys):
    """`oomb plan --attention sparse` at 1M: what `oomb train` would run takes one selection per chunk
    with offload, and keeps --query-block-pages when given."""
    common = ["plan", "--model", "qwen2.5-7b", "--context", "1M", "--gpu-gib", "139", "--host-gib", "125", "--lora",
              "--attention", "sparse"]
    cli.main(common)
    assert "one sparse selection per 32 query blocks" in capsys.readouterr().out
    cli.main([*common, "--query-block-pages", "1"])
    out = capsys.readouterr().out
    assert "oomb train would run" in out and "one sparse selection per" not in out


def test_cli_log_probabilities_kept_unless_given(capsys):
    """`oomb plan` at 128K (7B, H200): a trained head's fused loss makes the head's weight gradient in the
    forward, so it keeps and recomputes nothing of the vocabulary's size whatever the flags (they are kept
    as given, and cost nothing; unset, recompute_logits is turned off as where the loss is autograd's, so that
    a checkpoint resumed with tensor parallelism sees the same setting); with LoRA the frozen head's fused
    loss keeps and recomputes nothing too (as `oomb train` finds for these presets: a plain linear head). A
    vocabulary-sharded head keeps autograd's loss and its log-probabilities where they fit."""
    common = ["plan", "--model", "qwen2.5-7b", "--context", "128K", "--gpu-gib", "139", "--host-gib", "125",
              "--optimizer", "none", "--json"]
    for flags, recompute in (([], False), (["--recompute-logits"], True), (["--no-recompute-logits"], False)):
        cli.main([*common, *flags])
        choice = json.loads(capsys.readouterr().out)["choice"]
        assert choice["performance.recompute_logits"] is recompute
        assert "the head's weight gradient is made in the forward" in choice["reason"]
        assert "recompute_logits" not in choice.get("factors", [])
    cli.main([*common, "--lora", "--recompute-logits"])
    assert "the frozen head's slices keep nothing" in json.loads(capsys.readouterr().out)["choice"]["reason"]
    cli.main([*common, "--tp", "2"])  # a vocabulary-sharded head keeps autograd's loss, as oomb train's does
    assert "log-probabilities kept" in json.loads(capsys.readouterr().out)["choice"]["reason"]


def test_cli_json_and_model_directory(tmp_path, capsys):
    Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1000).save_pretrained(tmp_path)
    rc = cli.main(["plan", "--model", str(tmp_path), "--context", "64K", "--gpu-gib", "24", "--host-gib", "16",
                   "--lora-rank", "8", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert data["shape"]["num_layers"] == 3 and data["tokens"] == 65536
    status = {m["mode"]: m["status"] for m in data["modes"]}
    assert status["hf"] == status["dense"] == "implemented"
    assert all(status[m] == ("implemented" if is_implemented(m) else "planned") for m in MODES)
    dense = next(m for m in data["modes"] if m["mode"] == "dense")
    assert dense["fits"] and dense["largest_context"] > 65536
    assert sum(dense["gpu_bytes"].values()) / GIB == pytest.approx(dense["gpu_total_gib"], abs=1e-3)


def test_cli_takes_train_s_names_for_the_model_and_lora(capsys):
    """`oomb plan --preset M --lora` plans what `oomb train --preset M --lora` runs (LoRA at train's rank)."""
    common = ["--context", "1M", "--gpu-gib", "139", "--host-gib", "125", "--json"]
    rc = cli.main(["plan", "--preset", "qwen2.5-7b", "--lora", *common])
    short = json.loads(capsys.readouterr().out)
    assert cli.main(["plan", "--model", "qwen2.5-7b", "--lora-rank", str(LoraSection.r), *common]) == rc
    assert short == json.loads(capsys.readouterr().out) and short["setup"]["lora_rank"] == LoraSection.r


def test_cli_keep_attention_outputs(capsys):
    """`oomb plan --attention sparse`: the chooser's plan keeps the attention outputs where they fit and says so in
    the JSON; --keep-attention-outputs counts them in the table's modes without offload (refused with offload),
    --no-keep-attention-outputs keeps the chooser from them."""
    common = ["--model", "qwen2.5-7b", "--context", "128K", "--gpu-gib", "139", "--host-gib", "125", "--optimizer",
              "none", "--attention", "sparse", "--json", "--no-master-weights"]
    assert cli.main(["plan", *common]) == 0
    chosen = json.loads(capsys.readouterr().out)
    assert chosen["choice"]["performance.keep_attention_outputs"] is True
    assert all(m["gpu_bytes"].get("kept attention", 0) == 0 for m in chosen["modes"])  # the table: off unless given
    assert cli.main(["plan", *common, "--keep-attention-outputs"]) == 0
    kept = {m["mode"]: m["gpu_bytes"].get("kept attention", 0) for m in json.loads(capsys.readouterr().out)["modes"]}
    assert kept["dense"] == kept["sparse"] == 131072 * 28 * 28 * (128 * 2 + 4)
    assert kept["dense+offload"] == kept["sparse+offload"] == kept.get("hf", 0) == 0
    assert cli.main(["plan", *common, "--no-keep-attention-outputs"]) == 0
    assert json.loads(capsys.readouterr().out)["choice"]["performance.keep_attention_outputs"] is False


def test_cli_errors(capsys, tmp_path):
    assert cli.main(["plan", "--model", "no-such-model", "--gpu-gib", "80", "--host-gib", "64"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    assert cli.main(["plan", "--model", str(tmp_path), "--gpu-gib", "80", "--host-gib", "64"]) == 2
    assert "config.json cannot be read" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "tiny-qwen2", "--chunk-size", "1000", "--gpu-gib", "8", "--host-gib", "8"]) == 2
    assert "multiple of page_size" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "tiny-qwen2", "--device", "cpu", "--tp", "2", "--host-gib", "8"]) == 2
    assert "one process" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert cli.main(["plan", "--model", "tiny-qwen2", "--device", "cuda", "--host-gib", "8"]) == 2
        assert "--gpu-gib" in capsys.readouterr().err


def test_a_cpu_plans_the_step_oomb_train_runs_there(capsys):
    """Without a CUDA device (or with --device cpu) `oomb plan` plans a CPU step: the chooser's plan with every
    term in host memory, as `oomb train` runs it there, and the longest context per mode."""
    from oomb.planning.choose import Resources, Workload, choose_config

    args = ["plan", "--model", "tiny-qwen2", "--context", "8K", "--host-gib", "8", "--device", "cpu"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "step on this CPU" in out and "float32" in out and "oomb train would run (dense attention" in out
    assert "pages in host memory" in out and "longest context oomb train fits here" in out
    assert cli.main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    shape = load_model_shape("tiny-qwen2")
    want = choose_config(Workload(shape, 8192, 1, torch.float32, may_compile=False),
                         Resources("cpu", None, int(8 * GIB * (1 - SAFETY_MARGIN))), {"attention": "dense"})
    assert report["device"] == "cpu" and report["choice"]["chunk_size"] == want.config.chunk_size
    assert report["choice"]["performance.checkpoint_layers"] == want.config.performance.checkpoint_layers
    assert report["longest"]["dense"] > 8192
    assert cli.main([*args[:-2], "--host-gib", "0.001", "--device", "cpu"]) == 1  # nothing fits: says so
    assert "nothing fits" in capsys.readouterr().out


def test_hint_names_the_faster_setting_only_where_it_fits():
    """Without layer checkpointing a chunk keeps every layer's activations: on a large GPU sparse+offload
    fits that way too at 1M (and the plan says so); on a small one it does not (the fixed budget)."""
    config = OOMBConfig(sparse=FIXED, precision=PrecisionConfig(kv_grad_dtype="bfloat16"))
    large = make_plan("q", QWEN7B, 1 << 20, Budget(gpu_bytes=141 * GIB, host_bytes=125 * GIB), config, BENCH,
                      modes=["sparse+offload"])
    assert any(h.startswith("sparse+offload also fits with --no-checkpoint-layers") for h in large.hints)
    small = make_plan("q", QWEN7B, 1 << 20, Budget(gpu_bytes=48 * GIB, host_bytes=125 * GIB), config,
                      TrainingSetup(optimizer="none", lora_rank=16), modes=["sparse+offload"])
    assert small.reports[0].fits and not any("no-checkpoint-layers" in h for h in small.hints)
    no_replay = OOMBConfig(sparse=FIXED, precision=PrecisionConfig(kv_grad_dtype="bfloat16"),
                           performance=PerformanceConfig(checkpoint_layers=False))
    no_replay = make_plan("q", QWEN7B, 1 << 20, Budget(gpu_bytes=141 * GIB, host_bytes=125 * GIB), no_replay, BENCH,
                          modes=["sparse+offload"])
    assert not any("no-checkpoint-layers" in h for h in no_replay.hints)


def test_plan_counts_the_step_kernels_training_would_run(tmp_path, monkeypatch):
    """`oomb plan`'s chooser counts compiled layers and the fused loss where `oomb train` would run them on
    this machine (a machine that compiles is stood in for): not under tensor parallelism, not for a model
    with active dropout (compiled layers), not for a softcapped head or float16 (the fused loss)."""
    import oomb.compiled_layers
    import oomb.tools.plan as plan_module
    from oomb.planning.memory import TrainingSetup

    monkeypatch.setattr(oomb.compiled_layers, "can_compile", lambda: True)
    bf16 = TrainingSetup(torch.bfloat16)
    shape = plan_module.load_model_shape("qwen2.5-7b")
    assert plan_module._step_kernels("qwen2.5-7b", shape, bf16) == {"may_compile": True, "may_fuse_loss": True}
    assert plan_module._step_kernels("qwen2.5-7b", shape.per_rank(2), bf16) == {"may_compile": False,
                                                                              "may_fuse_loss": False}
    assert not plan_module._step_kernels("qwen2.5-7b", shape, TrainingSetup(torch.float16))["may_fuse_loss"]
    assert not plan_module._step_kernels("gemma-2-9b", plan_module.load_model_shape("gemma-2-9b"),
                                         bf16)["may_fuse_loss"]
    Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1000, attention_dropout=0.1).save_pretrained(tmp_path)
    kernels = plan_module._step_kernels(str(tmp_path), plan_module.load_model_shape(str(tmp_path)), bf16)
    assert kernels == {"may_compile": False, "may_fuse_loss": True}
    assert plan_module._step_kernels("no-such-model", shape, bf16) == {"may_compile": False, "may_fuse_loss": False}


def test_cli_plans_the_optimizer_oomb_train_runs_by_default(capsys):
    """Full fine-tuning: oomb train keeps fp32 master weights by default (optim.master_weights), so oomb plan
    plans them unless told otherwise; --no-master-weights plans without."""
    common = ["plan", "--model", "qwen2.5-0.5b", "--context", "8K", "--gpu-gib", "79.6", "--host-gib", "120"]
    assert cli.main(common) == 0
    assert "fp32 master weights" in capsys.readouterr().out
    assert cli.main([*common, "--no-master-weights"]) == 0
    assert "fp32 master weights" not in capsys.readouterr().out


def test_longest_context_says_none_fits_instead_of_zero_tokens():
    from oomb.tools.plan import _longest

    assert _longest("dense", 1_061_632) == "dense 1,061,632 tokens (~1.01M)"
    assert _longest("sparse", 0) == "sparse: none fits"
