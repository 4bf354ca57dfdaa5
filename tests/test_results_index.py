"""The README and docs/results.md tell the truth about the repository: every results-table cell is
regenerated from committed JSON (benchmarks/results/INDEX.yaml), every JSON they name exists, the
README's two commands are the Makefile's targets, and the `oomb` subcommands it mentions exist."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
from helpers import load_script

from oomb.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


@pytest.fixture(scope="module")
def suite():
    return load_script("benchmarks/suite.py")


@pytest.fixture(scope="module")
def index(suite):
    return suite.load_index()


def test_results_tables_are_what_the_json_gives(suite, index):
    """(a) docs/results.md and the README's table equal what `benchmarks/suite.py tables` writes."""
    assert (ROOT / "docs" / "results.md").read_text() == suite.results_doc(index), (
        "docs/results.md differs from the JSON: run `python benchmarks/suite.py tables`")
    assert README == suite.readme_with_table(README, suite.readme_table(index)), (
        "README.md's results table differs from the JSON: run `python benchmarks/suite.py tables`")
    assert sum(1 for s in index["scenarios"] if s.get("readme")) >= 5


def test_every_named_result_file_exists(index):
    """(b) every file the index, the README or a doc names under benchmarks/results/ exists."""
    results = ROOT / "benchmarks" / "results"
    named = {f for s in index["scenarios"] for f in s["files"] + s.get("also", [])} | set(index["kept"])
    missing = sorted(f for f in named if not (results / f).is_file())
    assert not missing, f"named in INDEX.yaml but not committed: {missing}"
    texts = {"README.md": README, **{f"docs/{p.name}": p.read_text() for p in (ROOT / "docs").glob("*.md")}}
    for where, text in texts.items():
        for path in re.findall(r"benchmarks/results/([\w./-]+\.(?:json|md|png|yaml))", text):
            assert (results / path).is_file(), f"{where} names benchmarks/results/{path}, which does not exist"


def test_every_committed_json_is_in_the_index(index):
    """A result file is either some scenario's (current or companion) or kept for a reason."""
    results = ROOT / "benchmarks" / "results"
    named = {f for s in index["scenarios"] for f in s["files"] + s.get("also", [])} | set(index["kept"])
    unlisted = sorted(str(p.relative_to(results)) for p in results.rglob("*.json")
                      if str(p.relative_to(results)) not in named)
    assert not unlisted, f"JSON under benchmarks/results/ that INDEX.yaml does not list: {unlisted}"


def spellings(words: list[str], flag: str) -> set[str]:
    """``flag`` and the hidden aliases the `oomb` command in ``words`` accepts for it (cli_options.add_option)."""
    if words[0] != "oomb":
        return {flag}
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    command = subparsers.choices[words[1]]
    dest = next((a.dest for a in command._actions if flag in a.option_strings), None)
    return {flag} | {o for a in command._actions if dest is not None and a.dest == dest for o in a.option_strings}


def test_index_entries_agree_with_their_json(suite, index):
    """The date and the options of each scenario's command are those its JSON recorded (or, in defaults_then,
    options that now must be given to run what was the default then)."""
    for s in index["scenarios"]:
        for key in ("name", "suite", "title", "machine", "date", "command", "files", "result"):
            assert key in s, f"{s.get('name')}: no {key}"
        data = suite.load_json(s["files"][0])
        recorded_date = str(data.get("date", ""))[:10] if isinstance(data, dict) else ""
        if recorded_date:
            assert recorded_date == str(s["date"]), f"{s['name']}: index date {s['date']}, JSON {recorded_date}"
        recorded = str(data.get("command", "")) if isinstance(data, dict) else ""
        if recorded:
            words = shlex.split(s["command"].split("&&")[-1].replace("<", "").replace(">", ""))
            start = next(i for i, w in enumerate(words) if w == "oomb" or w.endswith((".py", ".sh")))  # after launchers
            flags = [w for w in words[start:] if w.startswith("--")]
            spelled = set(recorded.split())
            # flags that spell out what was the default when it ran (listed in the scenario's defaults_then), or
            # that the recorded command gave under a spelling now kept as a hidden alias
            absent = [f for f in flags if not spelled & spellings(words[start:], f)
                      and f not in s.get("defaults_then", [])]
            assert not absent, f"{s['name']}: {absent} not in the recorded command {recorded!r}"


def test_readme_commands_are_the_makefile_targets():
    """(c) `make train` and `make test` are in the README and are targets of the Makefile."""
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.MULTILINE))
    section = README.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^make (\w+)", section, flags=re.MULTILINE)
    assert commands == ["train", "test"], commands
    assert set(commands) <= targets
    assert '$(PY) -m pytest -q -m "not slow" tests' in makefile and "$(PY) -m pytest -q tests" in makefile
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test\n" in ci and "pytest -q -m slow tests" in ci  # the fast tier, then the rest once


def test_readme_oomb_subcommands_exist():
    """(d) every `oomb <command>` in the README is in oomb/cli.py's command table."""
    from oomb.cli import COMMANDS

    # commands: lines of code blocks that start with `oomb`, and inline code starting with it
    blocks = "\n".join(re.findall(r"```\w*\n(.*?)```", README, flags=re.DOTALL))
    mentioned = set(re.findall(r"^oomb (\w+)", blocks, flags=re.MULTILINE))
    mentioned |= set(re.findall(r"`oomb (\w+)", README))
    unknown = sorted(mentioned - set(COMMANDS))
    assert not unknown, f"README mentions oomb commands that oomb/cli.py lacks: {unknown}"
    assert {"train", "plan", "bench", "gradcheck"} <= mentioned


def test_index_value_paths(suite):
    """The path language the tables are written in."""
    data = {"rows": [{"mode": "hf", "tokens": 1, "s": 2.0}, {"mode": "dense", "tokens": 1, "s": 3.0}],
            "arms": {"a": {"x": 1, "y": 2}, "b": {"x": 3, "y": 4}}}
    suite.load_json.cache_clear()
    original = suite.load_json
    try:
        suite.load_json = lambda name: data
        assert suite.lookup("rows[mode=dense,tokens=1].s", "f.json") == 3.0
        assert suite.lookup("rows[0].mode", "f.json") == "hf"
        assert suite.lookup("arms.*.x", "f.json") == [1, 3]
        assert suite.lookup("arms.*.*", "f.json") == [1, 2, 3, 4]
        with pytest.raises(KeyError):
            suite.lookup("rows[mode=sparse].s", "f.json")
        scenario = {"name": "t", "files": ["f.json"], "values": {"a": "rows[mode=hf].s", "r": "=a / 4"}}
        assert suite.scenario_values(scenario) == {"a": 2.0, "r": 0.5}
    finally:
        suite.load_json = original


def test_suite_run_selects_and_fills_commands(suite, index):
    """`suite.py run NAME`: a suite name stands for its scenarios in order, a scenario name for itself, and a
    command's <placeholders> must all be given (--set name=value) before anything runs."""
    standard = suite.selected(index, "standard")
    assert [s["suite"] for s in standard] == ["standard"] * len(standard) and len(standard) >= 3
    assert [s["name"] for s in suite.selected(index, "standard-128k")] == ["standard-128k"]
    with pytest.raises(KeyError, match="unknown suite or scenario"):
        suite.selected(index, "no-such-thing")
    scenario = {"name": "t", "command": "python x.py --out <out dir>"}
    with pytest.raises(ValueError, match="--set data=... --set out=..."):
        suite.command_line({"name": "t", "command": "python x.py --data <data> --out <out>"}, {})
    filled = suite.command_line({"name": "t", "command": "python x.py --data <data> --out <out>"},
                                {"data": "/d", "out": "/o p"})
    assert filled == "python x.py --data /d --out '/o p'"
    assert suite.command_line(scenario, {}) == scenario["command"]  # "<out dir>" is no placeholder name
    assert suite.main(["run", "standard-128k", "--dry-run"]) == 0
    assert len(suite.readme_table(index).splitlines()) <= suite.README_MAX_ROWS + 4  # markers and header


def test_readme_lists_what_users_run_first(suite, index):
    """The README's headline rows start with the trainer's (what `oomb train` gets), then the step alone."""
    rows = suite.readme_table(index).splitlines()[3:-1]
    marked = [s for s in index["scenarios"] if s.get("readme")]
    users = [s for s in marked if s["suite"] in suite.USER_SUITES]
    assert users, "no oomb train row among the README's headline rows"
    assert [r.split(" | ")[0].lstrip("| ") for r in rows[:len(users)]] == [s["title"] for s in users]
