"""The README and docs agree with the code: the Python quick start runs as written (its code block is executed
against a tiny local model directory), every `oomb <command> --flag` they show is a flag of that command, and
no file they or the docstrings cite is missing."""

from __future__ import annotations

import argparse
import re
import subprocess
import warnings
from pathlib import Path

import torch
from helpers import save_tiny_model
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
QUICK_START = re.compile(r"## Quick start: Python\n\n```python\n(.*?)```", re.S)
# The only edits to the block: where the model is, the device, and a context a 2-core CPU steps in seconds
# (the block's own 16K tokens take minutes there). Each must be present, so the test notices when the
# README changes under it.
SUBSTITUTIONS = {
    "path/to/local/model": None,  # the tiny model's directory, filled in below
    ".cuda()": "",
    "(1, 16384)": "(1, 1024)",
    "chunk_size=4096": "chunk_size=256",
}


def quick_start_code() -> str:
    match = QUICK_START.search((ROOT / "README.md").read_text())
    assert match, "README.md has no '## Quick start: Python' section with a ```python block"
    return match.group(1)


def test_readme_python_quick_start_runs(tmp_path: Path) -> None:
    model_dir = save_tiny_model("qwen2", tmp_path / "model")
    code = quick_start_code()
    for old, new in SUBSTITUTIONS.items():
        assert old in code, f"the README quick start no longer contains {old!r}: update SUBSTITUTIONS"
        code = code.replace(old, str(model_dir) if new is None else new)
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # e.g. transformers' torch_dtype deprecation
        warnings.simplefilter("error", DeprecationWarning)
        exec(compile(code, "README.md quick start", "exec"), namespace)
    loss = namespace["loss"]
    assert torch.isfinite(loss), loss
    model = namespace["model"]
    assert next(model.parameters()).dtype == torch.bfloat16  # the block's dtype reached the model
    # forward_backward left gradients, the optimizer stepped with them (weights moved), then cleared them.
    before = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).state_dict()
    after = model.state_dict()
    assert any(not torch.equal(before[name], after[name]) for name in before)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_docs_use_the_commands_real_flags():
    """`oomb train --model.path ...` or `oomb train --dp N` in a doc would fail for whoever copies it."""
    from oomb.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    known = {name: {f for action in parser._actions for f in action.option_strings}
             for name, parser in sub.choices.items()}
    command = re.compile(r"oomb (" + "|".join(known) + r")(?= )([^`\n|]*)")
    flag = re.compile(r"(?<![\w-])(--[a-z][\w.-]*)")
    wrong = [f"{path.relative_to(ROOT)}: oomb {m.group(1)} {f}"
             for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
             for m in command.finditer(path.read_text()) for f in flag.findall(m.group(2))
             if f not in known[m.group(1)]]
    assert not wrong, f"flags the commands do not have: {wrong}"


def test_no_citation_of_a_missing_design_file():
    found = subprocess.run(["git", "grep", "-n", "DESIGN.md", "--", "oomb", "docs", "tests", "benchmarks", "README.md",
                            ":!tests/test_readme.py"], cwd=ROOT, capture_output=True, text=True).stdout
    assert not found, f"DESIGN.md is not in the repository (docs/design.md is):\n{found}"
