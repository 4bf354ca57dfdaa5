"""One vocabulary: every `oomb` command that takes the same thing takes it under the same flag, and the
spellings a command had before stay accepted, hidden from --help (recorded commands use them)."""

from __future__ import annotations

import argparse

import pytest

import oomb.cli_options
from oomb.cli import build_parser

# canonical flag: the commands that take it
SHARED = {
    "--sparse-budget": ("train", "bench", "plan", "gradcheck", "calibrate"),
    "--sparse-score": ("train", "bench", "gradcheck", "calibrate"),
    "--sparse-pooling": ("train", "bench", "gradcheck", "calibrate"),
    "--sparse-sink-pages": ("train", "plan", "gradcheck", "calibrate"),
    "--sparse-query-block-pages": ("train", "bench", "plan", "gradcheck"),
    "--sparse-candidate-pooling": ("train", "bench", "gradcheck"),
    "--data": ("train", "gradcheck", "calibrate"),
    "--device": ("train", "bench", "gradcheck", "calibrate", "demo"),
    "--lr": ("train", "demo"),
    "--model": ("train", "plan", "gradcheck", "calibrate", "eval"),
    "--seq-len": ("train", "bench", "plan", "gradcheck", "calibrate", "demo", "eval"),
    "--chunk-size": ("train", "bench", "plan", "gradcheck", "calibrate", "demo"),
    "--kv-grad-dtype": ("train", "bench", "plan"),
    "--fp32-grad-accumulation": ("train", "bench", "plan"),
    "--no-fp32-grad-accumulation": ("train", "bench", "plan"),
    "--checkpoint-layers": ("train", "bench", "plan"),
    "--recompute-logits": ("train", "bench", "plan"),
    "--keep-attention-outputs": ("train", "bench", "plan"),
}
# old spelling: (command, the canonical flag it is an alias of)
ALIASES = {
    "--budgets": ("gradcheck", "--sparse-budget"), "--grid": ("calibrate", "--sparse-budget"),
    "--top-k-pages": ("plan", "--sparse-budget"), "--scores": ("gradcheck", "--sparse-score"),
    "--score": ("calibrate", "--sparse-score"), "--poolings": ("gradcheck", "--sparse-pooling"),
    "--pooling": ("calibrate", "--sparse-pooling"), "--text": ("gradcheck", "--data"),
    "--preset": ("eval", "--model"), "--context": ("gradcheck", "--seq-len"),
}


def commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def visible_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions if action.help != argparse.SUPPRESS
            for flag in action.option_strings}


def test_commands_share_the_flag_names():
    parsers = commands()
    missing = [f"oomb {command} {flag}" for flag, names in SHARED.items() for command in names
               if flag not in visible_flags(parsers[command])]
    assert not missing, f"commands without the shared flag: {missing}"


@pytest.mark.parametrize("old", ALIASES)
def test_old_spellings_are_hidden_aliases(old):
    command, new = ALIASES[old]
    parser = commands()[command]
    assert old not in visible_flags(parser)  # --help shows one name
    values = {"--data": ["notes.txt"], "--sparse-score": ["minmax"], "--sparse-pooling": ["max"],
              "--model": ["tiny-qwen2"]}.get(new, ["16"])
    required = ["--model", "qwen2.5-7b"] if command == "plan" else []
    assert vars(parser.parse_args([*required, old, *values])) == vars(parser.parse_args([*required, new, *values]))


def test_fp32_grad_accumulation_is_one_switch_with_its_negation():
    for command in ("train", "bench", "plan"):
        parser = commands()[command]
        required = ["--model", "qwen2.5-7b"] if command == "plan" else []
        on = parser.parse_args([*required, "--fp32-grad-accumulation"]).fp32_grad_accumulation
        off = parser.parse_args([*required, "--no-fp32-grad-accumulation"]).fp32_grad_accumulation
        assert (on, off) == (True, False), command


def test_train_takes_smollm2_lr_and_device(monkeypatch, tmp_path):
    from oomb.training.cli import shortcut_overrides

    monkeypatch.setattr("oomb.real_model.smollm2_dir", lambda: tmp_path / "smollm2")
    args = commands()["train"].parse_args(["--model", "smollm2", "--lr", "1e-4", "--device", "cpu",
                                           "--sparse-budget", "16"])
    overrides = shortcut_overrides(args)
    assert f'model.path="{tmp_path / "smollm2"}"' in overrides
    assert {"optim.lr=0.0001", 'train.device="cpu"', "oomb.sparse.budget=16"} <= set(overrides)
    assert oomb.cli_options.resolve_model("my/model") == "my/model"


@pytest.mark.parametrize("command", ["train", "bench", "plan", "gradcheck", "calibrate", "demo", "eval"])
def test_lengths_take_k_and_m_everywhere(command):
    """Token counts accept K and M wherever a length is given (docs/training.md)."""
    parser = commands()[command]
    required = ["--model", "qwen2.5-7b"] if command == "plan" else []
    for flag in ("--seq-len", "--chunk-size", "--page-size"):
        if flag in visible_flags(parser):
            args = parser.parse_args([*required, flag, "1K"])
            action = visible_flags(parser)[flag]
            value = getattr(args, action.dest)
            assert (value[0] if isinstance(value, list) else value) == 1024, (command, flag)


def test_verbose_goes_before_or_after_the_command():
    parser = build_parser()
    assert parser.parse_args(["-v", "train"]).verbose and parser.parse_args(["train", "-v"]).verbose
    assert not parser.parse_args(["train"]).verbose


def test_counts_and_shares_are_checked_where_they_are_parsed(capsys):
    for argv, expected in ((["eval", "--sequences", "0"], "--sequences: 0 must be at least 1"),
                           (["gradcheck", "--reads", "1.5"], "--reads: 1.5 is not a share"),
                           (["calibrate", "--max-read", "0"], "--max-read: 0.0 is not a share")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert expected in capsys.readouterr().err


def test_user_errors_are_one_line(monkeypatch, tmp_path, capsys):
    """A CUDA device where there is none, a one-chunk calibration, a model that is nowhere: `oomb CMD: error: ...`."""
    import torch

    from oomb import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["gradcheck", "--device", "cuda"], ["demo", "--device", "cuda"],
                 ["calibrate", "--model", "tiny-qwen2", "--device", "cuda"]):
        assert cli.main(argv) == 2
        assert "--device cuda but CUDA is not available here: use --device cpu" in capsys.readouterr().err
    assert cli.main(["calibrate", "--model", "tiny-qwen2", "--seq-len", "4K", "--device", "cpu"]) == 2
    assert "fits in one chunk" in capsys.readouterr().err
    assert cli.main(["gradcheck", "--model", str(tmp_path / "nowhere")]) == 2
    assert "is not a preset (" in capsys.readouterr().err


def test_plan_writes_json_to_a_path_or_prints_it(tmp_path, capsys):
    import json

    from oomb import cli

    args = ["plan", "--model", "qwen2.5-7b", "--context", "128K", "--gpu", "H100", "--no-master-weights"]
    cli.main([*args, "--json"])
    assert json.loads(capsys.readouterr().out)["model"] == "qwen2.5-7b"
    out = tmp_path / "plan.json"
    cli.main([*args, "--json", str(out)])
    text = capsys.readouterr().out
    assert f"wrote {out}" in text and "oomb train would run" in text
    assert json.loads(out.read_text())["model"] == "qwen2.5-7b"
