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
    "--model": ("train", "plan", "gradcheck", "calibrate"),
    "--seq-len": ("train", "bench", "plan", "gradcheck", "calibrate", "demo"),
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
    values = {"--data": ["notes.txt"], "--sparse-score": ["minmax"], "--sparse-pooling": ["max"]}.get(new, ["16"])
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
