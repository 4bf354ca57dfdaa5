"""`oomb train` and its config: YAML < flags < --set, unknown keys, messages, end-to-end CLI runs."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from helpers import build_tiny_model

import oomb
import oomb.training.trainer
from oomb.cli import main as cli_main
from oomb.config import OOMBConfig, SparseConfig, SparseResearch
from oomb.training.config import SECTIONS, TrainerConfig
from oomb.training.presets import BYTE_VOCAB, byte_tokenizer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FAST = ["--set", "oomb.chunk_size=128", "--set", "oomb.page_size=32", "--set", "logging.progress=false",
        "--set", "train.device=cpu"]


def test_defaults_are_the_embedded_cpu_run():
    config = TrainerConfig()
    assert config.model.path is None and config.model.preset == "tiny-qwen2"
    assert config.data.paths == [] and config.lora.enabled is False
    assert isinstance(config.oomb, OOMBConfig)
    assert oomb.Trainer is oomb.training.trainer.Trainer and oomb.TrainerConfig is TrainerConfig


def test_every_preset_shape_is_a_training_preset():
    """`oomb train --preset` takes every shape `oomb plan` and `oomb bench` take (oomb/training/preset_shapes.py)."""
    from oomb.training.preset_shapes import PRESETS

    for name in PRESETS:
        assert TrainerConfig.load(None, [f"model.preset={name}"]).model.preset == name
    with pytest.raises(ValueError, match="gemma-2-9b"):  # the error lists them all
        TrainerConfig.load(None, ["model.preset=no-such-shape"])


def test_yaml_then_flags_then_set(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"optim": {"lr": "1e-4"}, "data": {"seq_len": 1024}, "train": {"max_steps": 3}}))
    config = TrainerConfig.load(path)
    assert config.optim.lr == 1e-4 and config.data.seq_len == 1024 and config.train.max_steps == 3
    config = TrainerConfig.load(path, ["data.seq_len=2048", "data.seq_len=4096", "oomb.precision.kv_grad_dtype=bf16",
                                       "model.rope_scaling.factor=4", "data.paths=one.jsonl"])
    assert config.data.seq_len == 4096 and config.oomb.precision.grad_dtype == torch.bfloat16
    assert config.model.rope_scaling == {"factor": 4} and config.data.paths == ["one.jsonl"]


def test_round_trip_through_yaml(tmp_path):
    config = TrainerConfig.load(None, ["lora.enabled=true", "lora.target_modules=[q_proj, v_proj]",
                                       "optim.betas=[0.8, 0.9]", "oomb.precision.kv_grad_dtype=bfloat16"])
    path = tmp_path / "c.yaml"
    path.write_text(config.to_yaml())
    assert TrainerConfig.load(path) == config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optim.learning_rate=1"], r"unknown key\(s\) \['optim.learning_rate'\]; valid keys of 'optim': \['lr',"),
        (["optimizer.lr=1"], r"unknown config section\(s\) \['optimizer'\]; valid sections: \['model', 'lora'"),
        (["oomb.chunk=1"], r"unknown OOMBConfig option\(s\) \['chunk'\]; valid options"),
        (["optim.schedule=linear"], r"optim.schedule='linear' must be one of 'cosine', 'constant'"),
        (["train.max_steps=0"], r"train.max_steps=0 must be > 0"),
        (["train.grad_accum=two"], r"train.grad_accum='two' must be an integer"),
        (["data.seq_len=1"], r"data.seq_len=1 must be at least 2"),
        (["lora.dropout=1.5"], r"lora.dropout=1.5 must lie in \[0, 1\)"),
        (["lora.target_modules=[]"], r"lora.target_modules=\[\] names no module"),
        (["train.device=tpu"], r"train.device='tpu' is not a device; use auto, cpu, cuda or cuda:N"),
        (["oomb.chunk_size=100"], r"chunk_size=100 must be a multiple of page_size=128"),
        (["optim.lr"], r"override 'optim.lr' must look like section.key=value"),
        (["model.dtype=fp8"], r"model.dtype='fp8' must be one of 'auto', 'float32', 'bfloat16', 'float16'"),
    ],
)
def test_bad_config_names_value_rule_and_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig.load(None, overrides)


def test_a_calibrate_plan_given_as_the_config_names_the_option_that_takes_it(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"oomb": {"attention": "sparse"}, "measured": {"history_read": 0.1}}))
    with pytest.raises(ValueError, match=r"an `oomb calibrate` plan .* --set oomb.sparse_plan=PATH"):
        TrainerConfig.load(plan)


@pytest.mark.parametrize(("argv", "message"), [
    (["--resume", "run.yaml"], r"--resume took 'run.yaml' as the checkpoint to resume: put the config file before"),
    (["--resume", "--overwrite"], r"--resume and --overwrite contradict each other"),
])
def test_flags_a_user_did_not_mean_are_refused(argv, message, capsys):
    assert cli_main(["train", *argv, "--print-config"]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_missing_config_file():
    with pytest.raises(FileNotFoundError, match="config file 'nope.yaml' does not exist"):
        TrainerConfig.load("nope.yaml")


def test_examples_are_valid_configs():
    lora = TrainerConfig.load(EXAMPLES / "qwen2.5-7b-1m-lora.yaml")
    assert lora.lora.enabled and lora.data.seq_len == 1 << 20 and lora.oomb.precision.grad_dtype == torch.bfloat16
    full = TrainerConfig.load(EXAMPLES / "qwen2.5-7b-768k-full.yaml")
    assert not full.lora.enabled and full.optim.offload and full.data.seq_len == 768 * 1024
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == ["qwen2.5-7b-1m-lora.yaml", "qwen2.5-7b-768k-full.yaml"]


def test_every_option_is_documented():
    text = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    missing = [f"{name}.{f.name}" for name, cls in SECTIONS.items() if cls is not OOMBConfig
               for f in dataclasses.fields(cls) if f"`{name}.{f.name}`" not in text]
    assert not missing, f"options missing from docs/training.md: {missing}"


def test_print_config_applies_flags(capsys):
    assert cli_main(["train", "--lora", "--seq-len", "1024", "--data", "a b.jsonl", "--set", "optim.lr=2e-5",
                     "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["lora"]["enabled"] is True and printed["data"]["seq_len"] == 1024
    assert printed["data"]["paths"] == ["a b.jsonl"] and printed["optim"]["lr"] == 2e-5
    assert cli_main(["train", "--preset", "qwen2.5-7b", "--lora", "--seq-len", "1M", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["preset"] == "qwen2.5-7b" and printed["data"]["seq_len"] == 1 << 20


def test_print_config_of_another_machines_run(capsys, monkeypatch):
    """The shipped 1M example names a GPU and a model directory this machine lacks: --print-config still shows
    every key, and says in a comment why the auto options are not resolved here."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_main(["train", str(EXAMPLES / "qwen2.5-7b-1m-lora.yaml"), "--print-config"]) == 0
    text = capsys.readouterr().out
    assert yaml.safe_load(text)["data"]["seq_len"] == 1 << 20
    assert "# the options left auto are not resolved here" in text and "CUDA is not available" in text


def test_sparse_read_share_flag(capsys):
    """--sparse-read-share sets oomb.sparse.read_share: a share, "none" (null: the fixed budget) or "auto"; a
    value outside (0, 1] is refused by the parser."""
    for flag, want in (("0.5", 0.5), ("none", None), ("auto", "auto")):
        assert cli_main(["train", "--attention", "sparse", "--sparse-read-share", flag, "--print-config"]) == 0
        assert yaml.safe_load(capsys.readouterr().out)["oomb"]["sparse"]["read_share"] == want
    with pytest.raises(SystemExit):
        cli_main(["train", "--sparse-read-share", "2", "--print-config"])
    assert "(0, 1]" in capsys.readouterr().err


def test_model_flag_takes_a_preset_name(capsys):
    """`oomb train --model qwen2.5-7b` trains the preset, as `oomb plan --model` and `oomb eval --model` read it."""
    assert cli_main(["train", "--model", "qwen2.5-7b", "--lora", "--print-config"]) == 0
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert (model["path"], model["preset"]) == (None, "qwen2.5-7b")


def test_sparse_budget_flag_alone_is_a_fixed_budget(capsys):
    """--sparse-budget N without --sparse-read-share is a fixed budget, N = the default (64) too: "auto" would
    read the default share over the default budget (7x the step at 1M); with both flags the share is kept."""
    for flags, want in ((["--sparse-budget", "64"], None), (["--sparse-budget", "32"], None),
                        (["--sparse-budget", "64", "--sparse-read-share", "0.35"], 0.35), ([], "auto")):
        assert cli_main(["train", "--attention", "sparse", *flags, "--print-config"]) == 0
        sparse = yaml.safe_load(capsys.readouterr().out)["oomb"]["sparse"]
        assert sparse["read_share"] == want and sparse["budget"] == int(flags[1] if flags else 64)


def test_print_config_shows_what_auto_resolves_to_here(capsys, monkeypatch):
    """Each oomb option left auto carries what it resolves to on this machine, and the chooser's plan follows
    as comments; the output still loads as the same config (those options left auto again)."""
    args = ["train", "--seq-len", "8K", "--chunk-size", "2K", "--set", "train.device=cpu", "--print-config"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    config = TrainerConfig.load(None, ["data.seq_len=8192", "oomb.chunk_size=2048", "train.device=cpu"])
    assert yaml.safe_load(out) == config.to_dict()
    oomb_lines = out.split("\noomb:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    annotated = {line.split(":")[0].strip(): line.split("# here: ")[1] for line in oomb_lines if "# here: " in line}
    leaves = {key.rsplit(".", 1)[-1] for key in config.oomb_auto}
    assert leaves <= set(annotated) and "chunk_size" not in annotated  # set by the flag: as given
    assert annotated["backend"] == "torch" and annotated["enabled"] == "false"  # a CPU: offload.enabled
    assert annotated["score"] == config.oomb.sparse.resolved_score
    assert "# configuration: pages in host memory" in out and "chunk 2048" in out and "#   why: " in out
    # The run's own empty settings too: the learning rate the header prints, the dtype (device cpu is as given).
    assert "\n  lr: null  # here: 0.003\n" in out and "\n  dtype: auto  # here: float32\n" in out
    assert "\n  device: cpu\n" in out

    assert cli_main([*args, "--no-auto-config"]) == 0  # nothing left to the chooser: no plan
    out = capsys.readouterr().out
    assert "# configuration:" not in out and "  offload:\n    enabled: false\n" in out and "enabled: auto" not in out

    monkeypatch.setattr(oomb.training.trainer, "host_available_bytes", lambda: 1 << 20)  # a machine with 1 MiB
    assert cli_main(args) == 0
    assert "# on this machine no plan fits:" in capsys.readouterr().out


def test_cli_errors_are_one_line_with_exit_2(capsys, tmp_path):
    assert cli_main(["train", "--set", "optim.lrr=1"]) == 2
    assert "oomb train: error: unknown key(s) ['optim.lrr']" in capsys.readouterr().err
    assert cli_main(["train", "--model", str(tmp_path / "none"), "--output-dir", str(tmp_path / "out"), *FAST]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")
    assert cli_main(["train", "--output-dir", str(tmp_path / "a_file"), *FAST]) == 2
    assert f"train.output_dir '{tmp_path / 'a_file'}' is a file: give a directory" in capsys.readouterr().err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model("qwen2", vocab_size=BYTE_VOCAB + 1).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def test_cli_run_resume_and_refusal(tmp_path, model_dir, capsys, caplog):
    data = tmp_path / "notes.txt"
    data.write_text("".join(f"note {i}: long context training, chunk by chunk.\n" for i in range(100)))
    out = tmp_path / "out"
    args = ["train", "--model", str(model_dir), "--data", str(data), "--seq-len", "256", "--steps", "2",
            "--output-dir", str(out), *FAST, "--set", "checkpoint.every=1"]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    assert "oomb train: " + str(model_dir) in printed and "done, 2 steps, 512 tokens" in printed
    assert str(out / "final") in printed
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2

    assert cli_main(args) == 2  # the same output dir again: refused, with the ways out
    assert "--resume" in capsys.readouterr().err
    assert cli_main([*args, "--steps", "3", "--resume", "--set", "data.seq_len=128"]) == 0  # one more step
    assert "changed settings ['data.seq_len']" in caplog.text
    assert "resuming at step 2" in capsys.readouterr().out
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3] and lines[-1]["tokens"] == 128


@pytest.mark.parametrize(("damaged_file", "spoil"), [
    ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])),  # a truncated copy
    ("optimizer.pt", lambda p: p.write_bytes(p.read_bytes()[:100])),
    ("trainer_state.json", lambda p: p.write_text('{"step": 2, "tok')),
])
def test_cli_resume_passes_over_a_damaged_checkpoint(tmp_path, model_dir, capsys, caplog, damaged_file, spoil):
    data = tmp_path / "notes.txt"
    data.write_text("".join(f"note {i}: long context training, chunk by chunk.\n" for i in range(100)))
    out = tmp_path / "out"
    args = ["train", "--model", str(model_dir), "--data", str(data), "--seq-len", "128", "--steps", "2",
            "--output-dir", str(out), *FAST, "--set", "checkpoint.every=1", "--set", "checkpoint.export=false"]
    assert cli_main(args) == 0
    checkpoints = out / "checkpoints"
    spoil(checkpoints / "step-000002" / damaged_file)
    capsys.readouterr()
    assert cli_main([*args, "--resume"]) == 0  # step 2 again, from step 1
    assert f"checkpoint {checkpoints / 'step-000002'}: {damaged_file} is " in caplog.text
    assert f"resuming from {checkpoints / 'step-000001'}, the latest intact checkpoint" in caplog.text
    assert "resuming at step 1" in capsys.readouterr().out
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]

    # An explicit checkpoint that is damaged: refused, naming the intact one to pass instead.
    spoil(checkpoints / "step-000002" / damaged_file)  # rewritten by the resumed run
    assert cli_main([*args, "--resume", str(checkpoints / "step-000002")]) == 2
    err = capsys.readouterr().err
    assert f"{damaged_file} is " in err and f"--resume {checkpoints / 'step-000001'}" in err

    # None intact: exit 2 with every damaged file listed, and the ways out; no traceback.
    spoil(checkpoints / "step-000001" / damaged_file)
    assert cli_main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"oomb train: error: no intact checkpoint to resume from in {checkpoints}")
    assert err.count(f"{damaged_file} is ") == 2 and "--overwrite" in err and "Traceback" not in err


def test_cli_ctrl_c_exits_130_with_resume_hint(tmp_path, model_dir, capsys, monkeypatch):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(oomb.training.trainer, "forward_backward", interrupt)
    out = tmp_path / "out"
    assert cli_main(["train", "--model", str(model_dir), "--seq-len", "256", "--output-dir", str(out), *FAST]) == 130
    printed = capsys.readouterr().out
    assert "interrupted after 0 steps" in printed and "--resume" in printed
    assert (out / "checkpoints" / "step-000000" / "trainer_state.json").is_file()


def test_cli_not_enough_memory_exits_3(tmp_path, model_dir, capsys, monkeypatch):
    monkeypatch.setattr(oomb.training.trainer, "host_available_bytes", lambda: 1 << 20)
    assert cli_main(["train", "--model", str(model_dir), "--seq-len", "256", "--output-dir", str(tmp_path), *FAST]) == 3
    assert "not enough host memory" in capsys.readouterr().err


def test_cli_embedded_default_round_trip(tmp_path, capsys):
    """No model, no data: the embedded preset and corpus; then train on from its export."""
    out = tmp_path / "default"
    assert cli_main(["train", "--seq-len", "256", "--steps", "1", "--output-dir", str(out), *FAST]) == 0
    assert "preset tiny-qwen2 (random weights)" in capsys.readouterr().out
    again = tmp_path / "again"
    assert cli_main(["train", "--model", str(out / "final"), "--seq-len", "256", "--steps", "1",
                     "--output-dir", str(again), *FAST]) == 0
    assert (again / "final" / "model.safetensors").is_file()


def test_header_names_the_layers_sparse_reads_whole(tmp_path, capsys):
    """A sparse run's header says which layers read every page: the defaults' first fifth (here 2 of 10)."""
    path = tmp_path / "ten_layers"
    build_tiny_model("qwen2", vocab_size=BYTE_VOCAB + 1, num_hidden_layers=10).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    args = ["train", "--model", str(path), "--seq-len", "256", "--steps", "1", "--attention", "sparse", *FAST]
    assert cli_main([*args, "--output-dir", str(tmp_path / "out")]) == 0
    assert "35% of the history, at least 64 pages; layers 0-1 of 10 read every page" in capsys.readouterr().out
    assert cli_main([*args, "--output-dir", str(tmp_path / "fixed"), "--sparse-read-share", "none"]) == 0
    assert "read every page" not in capsys.readouterr().out  # a fixed budget reads every layer sparsely


def test_header_names_how_rerank_ranks_its_candidates():
    """The run header says which candidate pooling and normaliser a sparse run uses (they changed default)."""
    from oomb.training.cli import _candidates

    assert _candidates(OOMBConfig(attention="sparse")) == " with softmax_max candidates (normaliser: last 256 pages)"
    assert _candidates(OOMBConfig(attention="sparse",
                                  sparse=SparseConfig(research=SparseResearch(normaliser_pages=None)))) == \
        " with softmax_max candidates (normaliser: every page)"
    max_pooled = SparseConfig(research=SparseResearch(candidate_pooling="max"))
    assert _candidates(OOMBConfig(attention="sparse", sparse=max_pooled)) == " with max candidates"
    assert _candidates(OOMBConfig(attention="sparse", sparse=SparseConfig(score="minmax"))) == ""


@pytest.mark.parametrize(("first", "steady", "words"), [
    (40.0, 1.0, "the first step's overhead was 39.00 s"),
    (1.01, 1.0, "the first step took no longer than the others"),  # within the steps' own spread
    (0.9, 1.0, "the first step took no longer than the others"),
])
def test_summary_reports_a_first_step_overhead_only_when_there_is_one(tmp_path, first, steady, words):
    from oomb.training.cli import _summary
    from oomb.training.trainer import TrainResult

    result = TrainResult(steps=3, losses=[2.0, 1.0], tokens=768, elapsed_s=first + 2 * steady, tokens_per_s=1.0,
                         output_dir=str(tmp_path), checkpoint=None, export_dir=None, merged_dir=None,
                         interrupted=False, resumed_from=None, peak_gpu_gib=None, peak_host_gib=0.5,
                         first_step_s=first, steady_step_s=steady)
    trainer = type("T", (), {"output_dir": tmp_path, "config": TrainerConfig()})()
    text = _summary(result, trainer)
    assert words in text and "was 0.00 s" not in text


def test_summary_says_what_compiling_took_of_the_first_step(tmp_path):
    from oomb.training.cli import _summary
    from oomb.training.trainer import TrainResult

    result = TrainResult(steps=3, losses=[2.0, 1.0], tokens=768, elapsed_s=170.0, tokens_per_s=1.0,
                         output_dir=str(tmp_path), checkpoint=None, export_dir=None, merged_dir=None,
                         interrupted=False, resumed_from=None, peak_gpu_gib=None, peak_host_gib=0.5,
                         first_step_s=144.5, steady_step_s=24.2, first_step_compile_s=112.25)
    trainer = type("T", (), {"output_dir": tmp_path, "config": TrainerConfig()})()
    assert ("the first step's overhead was 120.30 s, of which torch.compile of the layers 112.2 s (the rest: kernel "
            "tuning, allocator and cache warm-up)") in _summary(result, trainer)
    pinned = dataclasses.replace(result, first_step_s=463.0, steady_step_s=380.1, first_step_compile_s=None,
                                 first_step_pin_s=41.5)
    assert "was 82.90 s, of which pinning host memory for the pages 41.5 s" in _summary(pinned, trainer)


def test_summary_gives_a_steps_parts(tmp_path):
    """The end of `oomb train` says where a step's time goes (oomb's step, the update, the data), and what
    setup and checkpoints took: the trainer's overhead over the step alone, by cause."""
    from oomb.training.cli import _summary
    from oomb.training.trainer import TrainResult

    result = TrainResult(steps=3, losses=[2.0, 1.0], tokens=768, elapsed_s=3.0, tokens_per_s=1.0,
                         output_dir=str(tmp_path), checkpoint=None, export_dir=None, merged_dir=None,
                         interrupted=False, resumed_from=None, peak_gpu_gib=None, peak_host_gib=0.5,
                         first_step_s=1.0, steady_step_s=1.0,
                         steady_step_parts_s={"data_s": 0.004, "update_s": 0.25, "forward_backward_s": 0.746},
                         setup_s=12.5, checkpoint_s=3.25)
    trainer = type("T", (), {"output_dir": tmp_path, "config": TrainerConfig()})()
    assert ("a step's parts (median): oomb's forward and backward 0.75 s, optimizer update 0.25 s, data 0.004 s; "
            "setup took 12.50 s, checkpoints 3.25 s") in _summary(result, trainer)


def test_mask_document_boundaries_is_the_older_spelling_of_loss_only():
    """Alone it means documents: loss_only (attention across documents, no loss across them), as documented;
    beside an explicit data.documents that mode stands."""
    assert TrainerConfig.load(None, ["data.mask_document_boundaries=true"]).data.documents == "loss_only"
    both = TrainerConfig.load(None, ["data.mask_document_boundaries=true", "data.documents=separate"])
    assert both.data.documents == "separate"
    assert TrainerConfig.load(None, []).data.documents == "separate"


def test_bad_data_is_named_with_its_file(tmp_path, capsys, caplog):
    """A data file given where the config goes, a jsonl line or text that is not UTF-8, a file that is not the
    parquet its suffix says, an empty text file: each named, with the way out (no traceback, no silent U+FFFD)."""
    run = ["--seq-len", "256", "--steps", "1", "--output-dir", str(tmp_path / "out"), "--overwrite", *FAST]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"text": "a document"}\n')
    assert cli_main(["train", str(jsonl), *run]) == 2
    assert "give data with --data" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ok \xff\xfe"}\n')
    assert cli_main(["train", "--data", str(bad), *run]) == 2
    assert "bad.jsonl:1: not UTF-8" in capsys.readouterr().err
    fake = tmp_path / "fake.parquet"
    fake.write_bytes(jsonl.read_bytes())
    assert cli_main(["train", "--data", str(fake), *run]) == 2
    assert "fake.parquet: not a parquet file" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert cli_main(["train", "--data", str(empty), *run]) == 2
    assert "the data has no tokens" in capsys.readouterr().err
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café naïve résumé\n".encode("latin-1") * 40)
    with caplog.at_level("WARNING", logger="oomb.training.data"):
        assert cli_main(["train", "--data", str(latin), *run]) == 0
    assert "latin.txt: not UTF-8 from byte 3 on" in caplog.text
    late = tmp_path / "late.jsonl"  # the bad record is far past the first step's tokens: found before it
    late.write_text('{"text": "a long enough document"}\n' * 200 + '{"txt": "typo"}\n')
    assert cli_main(["train", "--data", str(late), *run, "--output-dir", str(tmp_path / "late")]) == 2
    assert "late.jsonl:201: record has neither 'text' nor 'messages'" in capsys.readouterr().err
    assert not (tmp_path / "late" / "metrics.jsonl").exists()


def test_merge_on_export_needs_lora_and_an_export():
    """Full fine-tuning, or no export at all, would silently write no final-merged/."""
    with pytest.raises(ValueError, match="lora.enabled is false"):
        TrainerConfig.load(None, ["lora.merge_on_export=true"])
    with pytest.raises(ValueError, match="checkpoint.export is false"):
        TrainerConfig.load(None, ["lora.merge_on_export=true", "lora.enabled=true", "checkpoint.export=false"])
    assert TrainerConfig.load(None, ["lora.merge_on_export=true", "lora.enabled=true"]).lora.merge_on_export


@pytest.mark.parametrize("lora", [[], ["--lora"]])
def test_print_config_shows_the_plan_the_run_prints(lora, tmp_path, capsys):
    """--print-config plans from the model's config alone, the run from the built model: both count the fused
    loss (and compiled layers where they apply) alike, so the plan shown is the plan that runs."""
    args = ["train", "--seq-len", "4K", "--chunk-size", "1K", "--steps", "1", "--set", "train.device=cpu",
            "--output-dir", str(tmp_path / "out"), *lora]
    assert cli_main([*args, "--print-config"]) == 0
    shown = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("# configuration:"))
    assert cli_main([*args, "--set", "logging.progress=false"]) == 0
    ran = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("configuration:"))
    assert shown.removeprefix("# ").strip() == ran.strip() and "loss fused" in ran


def test_sparse_flags_on_a_dense_run_are_named_not_ignored(capsys):
    assert cli_main(["train", "--sparse-budget", "8", "--sparse-read-share", "0.35", "--print-config"]) == 0
    err = capsys.readouterr().err
    assert "--sparse-budget, --sparse-read-share apply to sparse attention only; this run is dense" in err
    assert cli_main(["train", "--sparse-budget", "8", "--print-config"]) == 0
    assert "--sparse-budget applies to sparse attention only" in capsys.readouterr().err
    assert cli_main(["train", "--attention", "sparse", "--sparse-budget", "8", "--print-config"]) == 0
    assert "to sparse attention only" not in capsys.readouterr().err


def test_resume_without_a_checkpoint_starts_again_and_keeps_the_old_metrics(tmp_path, capsys, caplog):
    """A run killed before its first checkpoint: --resume starts it again from step 0 (what a scheduler's restart
    wants), and the metrics it had logged move to output_dir/superseded instead of being overwritten."""
    out = tmp_path / "out"
    out.mkdir()
    old = '{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n'
    (out / "metrics.jsonl").write_text(old)
    args = ["train", "--seq-len", "256", "--steps", "1", "--output-dir", str(out), *FAST, "--resume"]
    assert cli_main(args) == 0
    assert (out / "superseded" / "metrics.jsonl").read_text() == old
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert "moved to" in caplog.text and "starting from step 0" in caplog.text


def test_cli_sigterm_is_handled_as_ctrl_c(tmp_path, model_dir, capsys, monkeypatch):
    """A scheduler's or `timeout`'s SIGTERM stops the run as Ctrl-C does: exit 130, the last complete step
    checkpointed, and the handler the process had before is back afterwards."""
    import os
    import signal

    real = oomb.training.trainer.forward_backward
    calls = []

    def terminated_in_step_two(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(oomb.training.trainer, "forward_backward", terminated_in_step_two)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "out"
    assert cli_main(["train", "--model", str(model_dir), "--seq-len", "256", "--steps", "3", "--output-dir", str(out),
                     *FAST]) == 130
    assert "interrupted after 1 step" in capsys.readouterr().out
    assert (out / "checkpoints" / "step-000001" / "trainer_state.json").is_file()
    assert signal.getsignal(signal.SIGTERM) is before
