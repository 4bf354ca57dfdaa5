"""`oomb bench`: the quick CPU run end to end, the worker's out-of-memory handling, the parent's
bookkeeping when a worker dies, and the outputs of a GPU-style report."""

import argparse
import json
import queue

import pytest
import torch
from helpers import load_script

import oomb.tools.bench as bench
from oomb import cli
from oomb.planning.memory import MODES
from oomb.tools.plan import is_implemented

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_quick_bench_writes_json_markdown_and_plot(tmp_path):
    rc = cli.main(["bench", "--quick", "--out-dir", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "bench_quick.json").read_text())
    markdown = (tmp_path / "bench_quick.md").read_text()
    assert (tmp_path / "bench_quick.png").read_bytes()[:8] == PNG_MAGIC
    assert report["machine"]["device"] == "cpu" and report["versions"]["torch"] == torch.__version__
    assert set(report["modes"]) == set(bench.BENCH_MODES)
    rows = {(r["mode"], r["tokens"]): r for r in report["rows"]}
    for tokens in (1024, 2048):
        hf, dense = rows["hf", tokens], rows["dense", tokens]
        assert hf["status"] == dense["status"] == "ok"
        assert hf["seconds"] > 0 and dense["host_peak_gib"] > 0
        assert dense["loss"] == pytest.approx(hf["loss"], rel=1e-3)  # same weights, same tokens, exact gradients
        # Throughput: tokens, and the FLOPs step_floor counts for the mode (dense adds a replay), per second.
        options = bench.options_from_args(_quick_args(tmp_path))
        shape = bench.ModelShape.from_hf_config(bench.preset_config(report["workload"]["preset"], tokens))
        flops = {row["mode"]: bench.executed_flops(row["mode"], tokens, shape, options) for row in (hf, dense)}
        assert flops["dense"] > flops["hf"] > 0
        for row in (hf, dense):
            assert row["tokens_per_s"] == pytest.approx(tokens / row["seconds"], rel=1e-3)
            assert row["executed_tflop_per_s"] == pytest.approx(flops[row["mode"]] / row["seconds"] / 1e12, rel=1e-3)
        for mode in ("dense+offload", "sparse+offload"):
            if not is_implemented(mode):
                assert rows[mode, tokens]["status"] == bench.NOT_IMPLEMENTED
                assert "seconds" not in rows[mode, tokens]
    assert report["modes"]["dense"]["warmup_seconds"] > 0
    assert "| 2K | dense |" in markdown and "![step time and memory vs context](bench_quick.png)" in markdown
    if not is_implemented("dense+offload"):
        assert "Not implemented in this version of oomb (nothing measured): dense+offload" in markdown


def _quick_args(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["--quick", "--out-dir", str(tmp_path)])


class _FakeModel:
    config = type("Config", (), {"vocab_size": 16})()

    def zero_grad(self, set_to_none=True):
        pass


def test_worker_stops_a_mode_at_out_of_memory(monkeypatch):
    calls = []

    def step(model, ids):
        calls.append(ids.shape[1])
        if ids.shape[1] >= 2048:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64 GiB")
        return 1.0

    monkeypatch.setattr(bench, "build_model", lambda *args: _FakeModel())
    monkeypatch.setattr(bench, "make_step", lambda mode, options: step)
    options = bench.BenchOptions(**{**bench.QUICK, "contexts": [1024, 2048, 4096], "warmup_tokens": 128})
    events = []
    bench._run_mode("dense", options, float("inf"), events.append)
    rows = {e["tokens"]: e for e in events if e["event"] == "row"}
    assert rows[1024]["status"] == "ok"
    assert rows[2048]["status"] == "out of memory"
    assert rows[4096]["status"] == "skipped: out of memory at a shorter context"
    assert calls == [128, 1024, 2048]  # warm-up, then no attempt past the OOM
    assert events[-1] == {"event": "done"}


class _DyingProcess:
    """A worker that reports one measurement, starts the next and dies (like the OOM killer's -9)."""

    def __init__(self, target, args, name):
        self.events = args[-1]
        self.exitcode = None

    def start(self):
        for event in ({"event": "warmup", "tokens": 128, "seconds": 0.1}, {"event": "start", "tokens": 1024},
                      {"event": "row", "tokens": 1024, "status": "ok", "seconds": 0.5, "loss": 1.0,
                       "host_peak_gib": 1.0, "host_step_gib": 0.1}, {"event": "start", "tokens": 2048}):
            self.events.put(event)
        self.exitcode = -9

    def is_alive(self):
        return False

    def join(self, timeout=None):
        pass

    def kill(self):
        pass


class _FakeContext:
    Queue = queue.Queue
    Process = _DyingProcess


def test_parent_records_a_dead_worker_and_moves_on(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "POLL_SECONDS", 0.01)
    options = bench.BenchOptions(**{**bench.QUICK, "contexts": [1024, 2048, 4096], "out_dir": str(tmp_path)})
    shape = bench.ModelShape.from_hf_config(bench.preset_config("tiny-qwen2"))
    report = bench.new_report(options, shape)
    paths = bench.output_paths(tmp_path, "dead")
    bench._sweep_mode(_FakeContext(), "dense", options, float("inf"), report, report["modes"]["dense"], shape, paths)
    rows = {r["tokens"]: r["status"] for r in report["rows"]}
    assert rows[1024] == "ok"
    assert rows[2048] == "worker died (exit code -9)"
    assert rows[4096] == "skipped: worker died (exit code -9) at 2K"
    assert report["modes"]["dense"]["failure"] == "worker died (exit code -9) at 2K"
    bench.write_outputs(report, paths)
    assert "Failures: dense: worker died (exit code -9) at 2K." in paths["md"].read_text()


class _HungProcess(_DyingProcess):
    """A worker still busy with its warm-up when the time limit comes."""

    killed = False

    def start(self):
        self.events.put({"event": "init", "seconds": 1.0})

    def is_alive(self):
        return not self.killed

    def kill(self):
        self.killed = True
        self.exitcode = -9


def test_parent_kills_a_worker_at_the_time_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "POLL_SECONDS", 0.01)
    context = type("Context", (), {"Queue": queue.Queue, "Process": _HungProcess})()
    options = bench.BenchOptions(**{**bench.QUICK, "out_dir": str(tmp_path)})
    shape = bench.ModelShape.from_hf_config(bench.preset_config("tiny-qwen2"))
    report = bench.new_report(options, shape)
    info = report["modes"]["hf"]
    bench._sweep_mode(context, "hf", options, 0.0, report, info, shape, bench.output_paths(tmp_path, "late"))
    assert info["stopped"] == "time limit (--max-seconds) reached before its first measurement"
    assert "failure" not in info and info["init_seconds"] == 1.0
    assert {r["status"] for r in report["rows"]} == {
        "skipped: time limit (--max-seconds) reached before its first measurement"}


def _gpu_report():
    """A report shaped like an H200 run (numbers of benchmarks/results/step_h200_2026-11-29a.json)."""
    options = bench.BenchOptions()
    shape = bench.ModelShape.from_hf_config(bench.preset_config("qwen2.5-7b"))
    report = bench.new_report(options, shape)
    report["machine"].update(device="cuda", gpu="NVIDIA H200", gpu_memory_gib=139.8)
    measured = {"hf": [(32768, 5.41, 22.74), (65536, 14.07, 32.68), (131072, 43.41, 64.22), (262144, None, None)],
                "dense": [(32768, 8.16, 23.41), (65536, 23.32, 28.66), (131072, 74.84, 39.16),
                          (262144, None, None)]}
    for mode, points in measured.items():
        for tokens, seconds, gib in points:
            row = ({"status": "ok", "seconds": seconds, "loss": 12.65, "host_peak_gib": 3.0, "host_step_gib": 0.1,
                    "peak_gpu_above_weights_gib": gib} if seconds else
                   {"status": "out of memory" if mode == "hf" else "skipped: predicted 299 s exceeds the time left"})
            bench._add_row(report, mode, tokens, row, shape, options)
    for mode in ("dense+offload", "sparse+offload"):
        for tokens in options.contexts:
            bench._add_row(report, mode, tokens, {"status": bench.NOT_IMPLEMENTED}, shape, options)
    return report


def test_gpu_report_outputs_and_replot(tmp_path):
    report = _gpu_report()
    paths = bench.output_paths(tmp_path, "h200")
    bench.write_outputs(report, paths)
    md = paths["md"].read_text()
    assert "| 256K | hf | - | - |" in md and "out of memory" in md
    # the model's prediction beside the measurement (the memory model moves on: computed, not copied)
    shape = bench.ModelShape.from_hf_config(bench.preset_config("qwen2.5-7b"))
    predicted = bench._prediction("dense", 131072, shape, bench.BenchOptions())["predicted_gpu_above_weights_gib"]
    assert f"| 128K | dense | 74.84 s | 39.16 GiB | {predicted:.2f} GiB ({(predicted / 39.16 - 1) * 100:+.1f}%)" in md
    growth = report["summary"]["memory_growth_per_10k_tokens_mib"]
    assert 1500 < growth["dense"] < 1800  # 168 KiB per token of KV and KV-gradient pages: 1,640 MiB per 10K
    assert growth["hf"] > 2 * growth["dense"]
    (tmp_path / "h200.png").unlink()
    assert cli.main(["bench", "--replot", str(paths["json"])]) == 0
    assert paths["png"].read_bytes()[:8] == PNG_MAGIC


def test_bench_options_validation():
    with pytest.raises(ValueError, match="unknown mode"):
        bench.BenchOptions(modes=["fast"])
    with pytest.raises(ValueError, match="multiple of page_size"):
        bench.BenchOptions(chunk_size=1000)
    assert bench.BenchOptions(contexts=[4096, 1024, 4096]).contexts == [1024, 4096]
    assert set(bench.BENCH_MODES) <= set(MODES)


def test_sparse_options_reach_the_step_config_and_the_prediction():
    args = cli.build_parser().parse_args(["bench", "--quick", "--sparse-budget", "5", "--query-block-pages", "4",
                                          "--progress"])
    options = bench.options_from_args(args)
    default = bench.options_from_args(cli.build_parser().parse_args(["bench", "--quick"]))
    assert options.progress and not default.progress
    config = options.oomb_config()
    assert (config.sparse.budget, config.sparse.query_block_pages) == (5, 4)
    for flags, want in ((["--sparse-budget", "64"], None),  # a budget given alone is fixed, the default one too
                        (["--sparse-budget", "64", "--sparse-read-share", "0.5"], 0.5), ([], "auto")):
        given = bench.options_from_args(cli.build_parser().parse_args(["bench", "--quick", *flags]))
        assert given.oomb_config().sparse.read_share == want
    with pytest.raises(ValueError, match="sparse.budget=-1"):
        bench.BenchOptions(sparse_budget=-1)
    pooled = bench.options_from_args(cli.build_parser().parse_args(
        ["bench", "--quick", "--sparse-candidate-pooling", "softmax_max", "--sparse-normaliser-pages", "256"]))
    config = pooled.oomb_config()
    assert (config.sparse.research.candidate_pooling, config.sparse.research.normaliser_pages) == ("softmax_max", 256)
    assert default.oomb_config().sparse.research.normaliser_pages == "auto"
    every_page = bench.options_from_args(cli.build_parser().parse_args(
        ["bench", "--quick", "--sparse-normaliser-pages", "all"]))
    assert every_page.oomb_config().sparse.research.normaliser_pages is None
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--sparse-normaliser-pages", "0"])


def test_resident_layers_reach_the_step_config_and_the_prediction():
    """--resident-layers keeps the first layers' pages on the GPU in offload modes, and the predicted
    memory counts them (more GPU, the same host slabs for the offloaded rest)."""
    from oomb.planning.memory import TrainingSetup, predict
    from oomb.planning.model_shape import ModelShape
    from oomb.tools.plan import preset_config

    args = cli.build_parser().parse_args(["bench", "--quick", "--resident-layers", "2", "--modes", "dense+offload"])
    options = bench.options_from_args(args)
    assert options.oomb_config().offload.resident_layers == 2
    config = bench.oomb_config_for("dense+offload", options.oomb_config())
    shape = ModelShape.from_hf_config(preset_config("qwen2.5-7b", 131072))
    setup = TrainingSetup(torch.bfloat16, 1, "none")
    resident, offloaded = (predict("dense+offload", shape, 131072, c, setup)
                           for c in (config, config.with_options({"offload.resident_layers": 0})))
    assert resident.gpu_total > offloaded.gpu_total


def test_time_limit_extrapolates_dense_quadratically_and_sparse_linearly():
    assert bench.expected_seconds("dense", (32768, 10.0), 131072) == pytest.approx(160.0)
    assert bench.expected_seconds("hf", (32768, 10.0), 65536) == pytest.approx(40.0)
    assert bench.expected_seconds("sparse+offload", (32768, 10.0), 131072) == pytest.approx(40.0)


def test_documents_benchmark_smoke(tmp_path, monkeypatch):
    """benchmarks/documents.py on the tiny preset (CPU): every measurement runs and the JSON holds them."""
    import json
    import sys

    script = load_script("benchmarks/documents.py")
    lengths = script.document_lengths(2048, 256, 1024, 0)
    assert sum(lengths) == 2048 and all(0 < n <= 1024 for n in lengths) and min(lengths[:-1]) >= 256
    out = tmp_path / "documents.json"
    monkeypatch.setattr(sys, "argv", ["documents.py", "--preset", "tiny-qwen2", "--device", "cpu", "--context", "2048",
                                      "--min-doc", "256", "--max-doc", "1024", "--chunk-size", "512",
                                      "--page-size", "64", "--warmup-tokens", "1024", "--out", str(out)])
    script.main()
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["rows"]] == [
        "oomb_documents[torch]", "oomb_cross_documents[torch]", "hf_per_document"]
    assert all(r["seconds"] > 0 for r in report["rows"]), report["rows"]
    assert report["documents"]["lengths"] == lengths and report["ratios"]["oomb_documents[torch]"]["vs_hf_per_document"]
    documents, _, hf = report["rows"]
    assert abs(documents["loss"] - hf["loss"]) < 1e-3  # the same documents, weighted alike up to first tokens


def test_reported_backend_follows_the_model_as_the_step_resolves_it():
    """"auto" goes to the step unresolved (the engine picks per model); the report names what it picks:
    cudnn for bf16 on CUDA, triton for a softcapped model (cuDNN has no softcap), as given otherwise."""
    from oomb.planning.model_shape import ModelShape
    from oomb.tools.plan import preset_config

    gemma2, qwen = (ModelShape.from_hf_config(preset_config(p, 8192)) for p in ("gemma-2-9b", "qwen2.5-7b"))
    auto = bench.BenchOptions(device="cuda", backend="auto")
    assert auto.oomb_config().performance.backend == "auto"
    assert (auto.backend_for(qwen), auto.backend_for(gemma2)) == ("cudnn", "triton")
    assert bench.BenchOptions(device="cuda", backend="cudnn").backend_for(gemma2) == "cudnn"  # as set: refused later
    assert bench.BenchOptions(device="cpu").backend_for(gemma2) == "torch"


def test_chosen_runs_the_choosers_plan_and_keeps_what_was_given(tmp_path):
    """--chosen: an oomb mode runs the plan `oomb train`'s chooser makes from the free memory, the mode
    fixing attention and offload and the command line's options kept; the rows' predictions follow it."""
    from oomb.planning.choose import Resources, Workload, choose_config
    from oomb.tools.bench_choice import CHOSEN_FIELDS, chosen_options

    rc = cli.main(["bench", "--quick", "--chosen", "--modes", "hf", "sparse", "--contexts", "1K",
                   "--no-checkpoint-layers", "--out-dir", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "bench_quick.json").read_text())
    assert "chosen" not in report["modes"]["hf"]
    chosen = report["modes"]["sparse"]["chosen"]
    assert set(chosen) == set(CHOSEN_FIELDS) and "configuration:" in report["modes"]["sparse"]["plan"]
    assert chosen["chunk_size"] == 512 and chosen["checkpoint_layers"] is False  # given (--quick, the flag)
    assert report["workload"]["options"]["given"] == ["chunk_size", "checkpoint_layers"]
    row = next(r for r in report["rows"] if r["mode"] == "sparse")
    assert row["status"] == "ok"
    # The same plan as the chooser's for that workload; a given option stays whatever the chooser prefers.
    options = bench.options_from_args(cli.build_parser().parse_args(["bench", "--quick", "--chosen"]))
    shape = bench.ModelShape.from_hf_config(bench.preset_config(options.preset, 2048))
    choice = chosen_options("sparse", options, shape, None, 20 << 30)
    changes, plan = choice.changes, choice.plan
    assert choice.too_long == ()
    base = bench.oomb_config_for("sparse", options.oomb_config())
    want = choose_config(Workload(shape, 2048, 1, options.dtype, optimizer="none"),
                         Resources("cpu", None, int(0.95 * (20 << 30)), weights_loaded=True),
                         {"chunk_size": 512, "attention": "sparse", "offload.enabled": False,
                          "precision.deterministic": False}, base)
    assert changes == {**{n: want.config.option(p) for n, p in CHOSEN_FIELDS.items()}, "kv_grad_dtype": "float32"}
    assert changes["recompute_logits"] is False and "log-probabilities kept" in plan
    replay = bench.options_from_args(cli.build_parser().parse_args(["bench", "--quick", "--chosen",
                                                                     "--checkpoint-layers", "--recompute-logits"]))
    assert replay.given == ("chunk_size", "checkpoint_layers", "recompute_logits")
    forced = chosen_options("sparse", replay, shape, None, 20 << 30).changes
    assert forced["checkpoint_layers"] is True and forced["recompute_logits"] is True
    assert "The chooser's plans (`--chosen`" in (tmp_path / "bench_quick.md").read_text()


def test_chosen_reports_contexts_nothing_fits_and_measures_the_rest(monkeypatch):
    """--chosen with a context no configuration fits: that row says so (a result, not a failure), the plan is
    made for the longest context that fits, and the shorter contexts are measured (the worker's code, run
    in this process)."""
    from oomb.tools.bench_choice import chosen_options

    options = bench.options_from_args(cli.build_parser().parse_args(["bench", "--quick", "--chosen",
                                                                      "--contexts", "1K", "1M"]))
    shape = bench.ModelShape.from_hf_config(bench.preset_config(options.preset, 1 << 20))
    # 2.5 GiB of host: 1M does not fit; the tiny preset's plain head takes the fused loss, as the worker finds
    small = chosen_options("sparse", options, shape, None, 5 << 29, fuse_possible=True)
    assert small.too_long == (1 << 20,) and small.why_too_long.startswith("no configuration fits")
    assert "planned at 1,024 tokens" in small.plan
    assert not chosen_options("sparse", options, shape, None, 1 << 20).changes  # nothing fits at all
    monkeypatch.setattr(bench.machine, "host_free_bytes", lambda: 5 << 29)
    events = []
    bench._run_mode("sparse", bench.dataclasses.replace(options, warmup_tokens=512), float("inf"), events.append)
    rows = {e["tokens"]: e for e in events if e["event"] == "row"}
    assert rows[1024]["status"] == "ok"
    assert rows[1 << 20]["status"].startswith("does not fit (the chooser): no configuration fits")
    assert "\n" not in rows[1 << 20]["status"] and events[-1] == {"event": "done"}
    assert next(e for e in events if e["event"] == "chosen")["plan"] == small.plan


def test_chosen_needs_the_free_gpu_memory_on_cuda():
    from oomb.tools.bench_choice import chosen_options

    options = bench.options_from_args(cli.build_parser().parse_args(["bench", "--quick", "--chosen"]))
    shape = bench.ModelShape.from_hf_config(bench.preset_config(options.preset, 2048))
    with pytest.raises(ValueError, match="free GPU memory"):
        chosen_options("sparse", bench.dataclasses.replace(options, device="cuda"), shape, None, 20 << 30)


def test_chosen_plan_on_cuda_predicts_with_the_cards_measured_rate(monkeypatch):
    """The bench's plan on a CUDA device knows the card, as oomb train's does: its step time uses the H100's
    measured rate and does not call the card unmeasured."""
    from oomb.tools.bench_choice import chosen_options

    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    options = bench.options_from_args(cli.build_parser().parse_args(["bench", "--quick", "--chosen"]))
    shape = bench.ModelShape.from_hf_config(bench.preset_config(options.preset, 2048))
    choice = chosen_options("dense", bench.dataclasses.replace(options, device="cuda"), shape, 60 << 30, 100 << 30)
    assert "the rate of a dense step on an H100" in choice.plan
    assert "not measured" not in choice.plan


def test_sparse_warmup_reaches_rerank_candidates():
    """On a GPU the sparse warm-up runs until a chunk's history outgrows the sinks and rerank's candidates
    (factor x budget pages), so the score kernel is tuned for its largest calls before the timed step; when
    the contexts are shorter than that, until it outgrows the budget; minmax needs the budget only, and a CPU
    run keeps the given warm-up."""
    options = bench.BenchOptions(contexts=[131072], warmup_tokens=8192, device="cuda")
    page, chunk = options.page_size, options.chunk_size

    def covering(pages: int) -> int:
        return (-(-pages * page // chunk) + 1) * chunk

    config = bench.OOMBConfig()
    rerank_pages = config.sparse.sink_pages + config.sparse.research.rerank_factor * config.sparse.budget + 1
    assert bench.warmup_tokens("sparse", options) == covering(rerank_pages) == 40960
    budget_pages = covering(config.sparse.sink_pages + config.sparse.budget + 1)
    minmax = bench.dataclasses.replace(options, sparse_score="minmax")
    assert bench.warmup_tokens("sparse", minmax) == budget_pages == 16384
    assert bench.warmup_tokens("sparse", bench.dataclasses.replace(options, contexts=[32768])) == budget_pages
    assert bench.warmup_tokens("sparse", bench.dataclasses.replace(options, contexts=[12288])) == 8192
    assert bench.warmup_tokens("sparse", bench.dataclasses.replace(options, device="cpu")) == 8192
    assert bench.warmup_tokens("dense", options) == 8192


def test_hf_baseline_checkpoints_without_a_deprecation_warning():
    """The hf mode's gradient checkpointing uses transformers' current name where it exists (the old one warns
    on every call)."""
    import warnings

    from helpers import build_tiny_model

    from oomb.tools.bench import enable_checkpointing

    model = build_tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        enable_checkpointing(model)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_a_cpu_bench_of_weights_larger_than_the_host_is_refused_before_any_worker(monkeypatch, capsys):
    """The 7B preset in float32 (28.4 GiB) on a machine with 20 GiB available: one line naming the small preset,
    not a worker killed by the kernel; a tiny preset passes the check."""
    monkeypatch.setattr(bench.machine, "host_free_bytes", lambda: 20 * 1024**3)
    assert cli.main(["bench", "--device", "cpu", "--modes", "sparse", "--contexts", "1K"]) == 2
    err = capsys.readouterr().err
    assert "the qwen2.5-7b preset's weights alone need 28.4 GiB in float32 on this CPU, and 20.0 GiB" in err
    assert "--preset tiny-qwen2" in err
    args = cli.build_parser().parse_args(
        ["bench", "--device", "cpu", "--preset", "tiny-qwen2", "--modes", "sparse", "--contexts", "1K"])
    assert bench.options_from_args(args).preset == "tiny-qwen2"
