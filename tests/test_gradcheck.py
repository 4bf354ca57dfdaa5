"""`oomb gradcheck` on the tiny preset, on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from oomb import cli
from oomb.config import OOMBConfig, SparseConfig
from oomb.tools.gradcheck import GradcheckOptions, compare, history_read, is_default_sparse, run_gradcheck

SMALL = ["--seq-len", "1024", "--chunk-size", "256", "--page-size", "32"]


def test_gradcheck_command_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "gradcheck.json"
    # 1024 tokens in pages of 32: the last chunk has 24 history pages; 23 + 1 sink read them all.
    assert cli.main(["gradcheck", *SMALL, "--budgets", "2", "23", "--scores", "minmax", "mean",
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for expected in ("oomb gradcheck: tiny-qwen2 (random weights, float32, cpu), 1024 tokens of random token ids",
                     "dense vs full-sequence HF", "minmax/max k=2", "mean/max k=23", "layer 0", "layer 1", "total",
                     "pages read"):
        assert expected in text
    report = json.loads(out.read_text())
    assert report["tokens"] == 1024 and report["hf"]["rel_err"] < 1e-5
    runs = {(r["score"], r["budget"]): r for r in report["sparse"]}
    assert set(runs) == {("minmax", 2), ("minmax", 23), ("mean", 2), ("mean", 23)}
    for score in ("minmax", "mean"):
        small, full = runs[score, 2], runs[score, 23]
        assert set(small["groups"]) == {"layer 0", "layer 1", "other", "total"}
        assert 0.5 < small["groups"]["total"]["cosine"] < 1.0 and small["groups"]["total"]["rel_err"] > 1e-3
        # A budget covering every earlier page is the dense step, bit for bit.
        assert full["groups"]["total"]["rel_err"] == 0.0 and full["loss"] == report["dense"]["loss"]
        assert small["history_read"] < full["history_read"] == 1.0


def test_gradcheck_arms_of_candidate_pooling(tmp_path, monkeypatch):
    """--candidate-poolings: one rerank arm per pooling of the candidates' summary scores, named after it, each
    proposing its candidates with that pooling (and softmax_max with the chunk's own pages)."""
    import oomb.sparse

    seen, propose = set(), oomb.sparse.propose_candidates

    def spy(*args, **kwargs):
        seen.add((args[3].research.candidate_pooling, args[8] is not None))  # (options, own)
        return propose(*args, **kwargs)

    monkeypatch.setattr(oomb.sparse, "propose_candidates", spy)
    out = tmp_path / "gradcheck.json"
    assert cli.main(["gradcheck", *SMALL, "--budgets", "2", "--scores", "rerank", "--rerank-factors", "2",
                     "--candidate-poolings", "max", "softmax_max", "--hf", "off", "--json", str(out)]) == 0
    runs = {r["score"]: r for r in json.loads(out.read_text())["sparse"]}
    assert set(runs) == {"rerank x2 minmax_mean", "rerank x2 minmax_mean softmax_max/256"}  # the default bound
    assert all(0.5 < r["groups"]["total"]["cosine"] < 1.0 for r in runs.values())
    assert seen == {("max", False), ("softmax_max", True)}


def test_gradcheck_arms_of_the_normaliser_bound(tmp_path, monkeypatch):
    """--normaliser-pages: one softmax_max arm per bound ('all': none), named after it, the bound reaching the
    candidates' options; max pooling's arm has no normaliser and runs once; a bad bound is refused."""
    import oomb.sparse

    seen, propose = set(), oomb.sparse.propose_candidates

    def spy(*args, **kwargs):
        seen.add((args[3].research.candidate_pooling, args[3].research.normaliser_pages))
        return propose(*args, **kwargs)

    monkeypatch.setattr(oomb.sparse, "propose_candidates", spy)
    out = tmp_path / "gradcheck.json"
    assert cli.main(["gradcheck", *SMALL, "--budgets", "1", "--scores", "rerank", "--rerank-factors", "2",
                     "--candidate-poolings", "max", "softmax_max", "--normaliser-pages", "all", "1",
                     "--hf", "off", "--json", str(out)]) == 0
    runs = {r["score"]: r for r in json.loads(out.read_text())["sparse"]}
    assert set(runs) == {"rerank x2 minmax_mean", "rerank x2 minmax_mean softmax_max",
                         "rerank x2 minmax_mean softmax_max/1"}
    assert runs["rerank x2 minmax_mean softmax_max/1"]["normaliser_pages"] == 1
    assert runs["rerank x2 minmax_mean softmax_max/1"]["loss"] != runs["rerank x2 minmax_mean softmax_max"]["loss"]
    assert seen == {("max", None), ("softmax_max", None), ("softmax_max", 1)}
    with pytest.raises(SystemExit):
        cli.main(["gradcheck", *SMALL, "--normaliser-pages", "0"])


def test_gradcheck_keeps_the_dense_step(tmp_path, monkeypatch):
    """--dense-cache: the first run keeps its dense step, a second run of the same model and tokens takes it
    (no dense step run: the sparse arms only) and reports the same numbers; other chunks or weights miss."""
    import oomb.tools.gradcheck as gradcheck

    real, steps = gradcheck.forward_backward, []

    def counted(*args, **kwargs):
        steps.append(kwargs["config"].attention)
        return real(*args, **kwargs)

    monkeypatch.setattr(gradcheck, "forward_backward", counted)
    cache, args = tmp_path / "dense", [*SMALL, "--budgets", "2", "--scores", "minmax", "--hf", "off"]
    reports = []
    for run in range(2):
        out = tmp_path / f"run{run}.json"
        assert cli.main(["gradcheck", *args, "--dense-cache", str(cache), "--json", str(out)]) == 0
        reports.append(json.loads(out.read_text()))
    assert steps == ["dense", "sparse", "sparse"]
    first, second = reports
    assert first["dense"]["kept"] == second["dense"]["kept"] and second["dense"]["kept_date"] == first["date"]
    assert second["dense"]["loss"] == first["dense"]["loss"]
    timeless = [[{k: v for k, v in arm.items() if k != "seconds"} for arm in r["sparse"]] for r in reports]
    assert timeless[0] == timeless[1]  # the same cosines, errors and losses against the kept reference
    assert len(list(cache.iterdir())) == 1
    assert cli.main(["gradcheck", *args, "--chunk-size", "512", "--dense-cache", str(cache)]) == 0
    assert cli.main(["gradcheck", *args, "--seed", "1", "--dense-cache", str(cache)]) == 0  # other random weights
    assert steps[3:] == ["dense", "sparse", "dense", "sparse"] and len(list(cache.iterdir())) == 3


def test_gradcheck_reports_each_step_and_a_stopped_run_keeps_what_finished(tmp_path, capsys, monkeypatch):
    """A line per finished step on stderr, and the JSON rewritten after each: a run stopped in its second
    sparse arm leaves the dense step and the first arm on disk (a 32K run on a CPU takes an hour)."""
    import oomb.tools.gradcheck as gradcheck

    real, calls = gradcheck.forward_backward, []

    def stopping(*args, **kwargs):
        calls.append(kwargs.get("progress"))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(gradcheck, "forward_backward", stopping)
    out = tmp_path / "gradcheck.json"
    with pytest.raises(KeyboardInterrupt):
        cli.main(["gradcheck", *SMALL, "--budgets", "2", "4", "--scores", "minmax", "--hf", "off",
                  "--json", str(out), "--progress"])
    assert calls == [True, True, True]
    err = capsys.readouterr().err
    assert "gradcheck: dense step: loss" in err and "gradcheck: sparse minmax/max k=2 (1 of 2): cosine" in err
    report = json.loads(out.read_text())
    assert report["dense"]["loss"] > 0 and [r["budget"] for r in report["sparse"]] == [2]
    assert "command" in report and not list(tmp_path.glob("*.partial"))


def test_gradcheck_reads_a_text_file_with_the_byte_tokenizer(tmp_path):
    text = tmp_path / "book.txt"
    text.write_text("It was the best of times, it was the worst of times. " * 12)  # 636 bytes
    report = run_gradcheck(GradcheckOptions(text=str(text), seq_len=512, chunk_size=128, page_size=32,
                                            budgets=[1], scores=["minmax"], hf="off"))
    assert report["sequence"] == "book.txt" and report["tokens"] == 512 and "hf" not in report
    with pytest.raises(ValueError, match=r"has 636 tokens, fewer than --seq-len 1024"):
        run_gradcheck(GradcheckOptions(text=str(text), seq_len=1024, hf="off", budgets=[]))
    assert cli.main(["gradcheck", "--text", str(tmp_path / "missing.txt")]) == 2


def test_gradcheck_reads_token_ids(tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str(i % 200) for i in range(300)) + "\n")
    report = run_gradcheck(GradcheckOptions(ids=str(ids), seq_len=256, chunk_size=128, page_size=32, budgets=[1],
                                            scores=["mean"], hf="off"))
    assert report["sequence"] == "ids.txt" and report["sparse"][0]["groups"]["total"]["cosine"] > 0.5
    with pytest.raises(ValueError, match="give --data or --ids, not both"):
        run_gradcheck(GradcheckOptions(ids=str(ids), text=str(ids)))


def test_compare_groups_by_layer():
    want = {"model.layers.0.w": torch.tensor([1.0, 0.0]), "model.layers.10.w": torch.tensor([0.0, 2.0]),
            "lm_head.weight": torch.tensor([3.0])}
    got = {"model.layers.0.w": torch.tensor([0.0, 1.0]), "model.layers.10.w": torch.tensor([0.0, 2.0]),
           "lm_head.weight": torch.tensor([3.0])}
    result = compare(got, want)
    assert list(result) == ["layer 0", "layer 10", "other", "total"]
    assert result["layer 0"]["cosine"] == 0.0 and result["layer 0"]["rel_err"] == pytest.approx(2**0.5)
    assert result["layer 10"] == {"cosine": 1.0, "rel_err": 0.0}
    assert result["total"]["rel_err"] == pytest.approx((2 / 14) ** 0.5)


def test_history_read():
    config = OOMBConfig(chunk_size=64, page_size=16, attention="sparse", sparse=SparseConfig(budget=1, sink_pages=1))
    # Chunks of 4 blocks with 0, 4, 8 history pages: read 0, 2, 2 of them per block.
    assert history_read(192, config, 1) == pytest.approx((4 * 2 + 4 * 2) / (4 * 4 + 4 * 8))
    assert history_read(64, config, 1) == 1.0
    # a dense layer reads every page: with layer 1 of 2 dense, the mean of the two
    dense_one = OOMBConfig(chunk_size=64, page_size=16, attention="sparse",
                           sparse=SparseConfig(budget=1, sink_pages=1, dense_layers=(1,)))
    assert history_read(192, dense_one, 2) == pytest.approx(((4 * 2 + 4 * 2) / (4 * 4 + 4 * 8) + 1) / 2)


def test_gradcheck_reads_curve_marks_the_defaults_and_repeats_after_a_warm_up():
    options = GradcheckOptions(seq_len=512, chunk_size=128, page_size=32, budgets=[8], reads=[0.25],
                               scores=["auto", "exact"], hf="off", warmup_steps=1, warmup_lr=1e-3)
    report = run_gradcheck(options)
    rows = report["sparse"]
    states = [d["model_state"] for d in report["dense_steps"]]
    assert states == ["as shipped", "after 1 dense warm-up steps"] and len(report["warmup"]["losses"]) == 1
    assert len(rows) == 8  # (defaults, oracle) x (budget 8, the 25 % budget) x two model states
    for row in rows:
        assert row["seq_len"] == 512 and -1 <= row["cosine"] <= 1 + 1e-9
        assert row["loss_gap"] == pytest.approx((row["loss"] - row["dense_loss"]) / row["dense_loss"])
    curve = [r for r in rows if r["target_read"] == 0.25]
    assert curve and all(r["history_read"] >= 0.25 for r in curve)
    # the budget one page smaller reads less than asked: the smallest budget that reaches the share
    probe = OOMBConfig(attention="sparse", chunk_size=128, page_size=32,
                       sparse=SparseConfig(budget=curve[0]["budget"] - 1))
    assert history_read(512, probe, 2) < 0.25
    # page 32 is not the default page size, so no row runs the defaults; at page 128 the default arm does
    assert not any(r["defaults"] for r in rows)
    assert is_default_sparse(OOMBConfig(attention="sparse", chunk_size=1024), 30)
    assert not is_default_sparse(OOMBConfig(attention="sparse", sparse=SparseConfig(budget=32)), 30)
    # the default share written out keeps the default dense layers; written out, they are the defaults too
    assert is_default_sparse(OOMBConfig(attention="sparse", sparse=SparseConfig(read_share=0.35)), 30)
    assert is_default_sparse(OOMBConfig(attention="sparse", sparse=SparseConfig(dense_layers=tuple(range(6)))), 30)
    assert not is_default_sparse(OOMBConfig(attention="sparse", sparse=SparseConfig(dense_layers=())), 30)
    shipped = [r["cosine"] for r in rows if r["model_state"] == "as shipped"]
    warmed = [r["cosine"] for r in rows if r["model_state"] != "as shipped"]
    assert shipped != warmed  # the warm-up changed the model the second comparison sees


def test_gradcheck_read_share_arms_read_their_share_and_a_full_one_is_dense():
    """Share arms take the default budget (64 pages) as their floor, as the default config does: past it (here 255
    history pages of 16 tokens at the end) the share decides."""
    report = run_gradcheck(GradcheckOptions(seq_len=4096, chunk_size=512, page_size=16, budgets=[], reads=[0.5],
                                            read_shares=[0.5, 1.0], scores=["auto"], hf="off"))
    fixed, half, full = report["sparse"]
    assert fixed["budget"] != "share 0.5" and half["budget"] == "share 0.5" and full["budget"] == "share 1.0"
    assert 0.5 <= half["history_read"] < 1.0 and half["target_read"] == 0.5
    assert full["cosine"] == pytest.approx(1.0, abs=1e-12) and full["loss_gap"] == 0.0


def test_default_scores_are_the_default_configs():
    """`oomb gradcheck` with no --sparse-score checks what a default OOMBConfig trains with."""
    from oomb.cli import build_parser
    from oomb.config import OOMBConfig

    assert GradcheckOptions().scores == [OOMBConfig().sparse.resolved_score]
    assert build_parser().parse_args(["gradcheck"]).scores == GradcheckOptions().scores


def test_gradcheck_with_offload_is_bitwise_the_same_and_the_page_gradient_dtype_keys_the_dense_cache(tmp_path):
    """--offload (how SmolLM2's 1M dense reference fits one GPU) changes where pages live, not one bit of the report;
    --kv-grad-dtype changes the dense step's rounding, so a kept dense step is not reused across it."""
    from oomb.tools import dense_cache
    from oomb.tools.gradcheck import load_sequence

    options = GradcheckOptions(seq_len=1024, chunk_size=256, page_size=32, budgets=[2], scores=["minmax"], hf="off")
    plain = run_gradcheck(options)
    offloaded = run_gradcheck(GradcheckOptions(**{**options.__dict__, "offload": True}))
    assert offloaded["dense"]["loss"] == plain["dense"]["loss"]
    assert [r["groups"] for r in offloaded["sparse"]] == [r["groups"] for r in plain["sparse"]]
    assert [r["loss"] for r in offloaded["sparse"]] == [r["loss"] for r in plain["sparse"]]
    assert offloaded["options"]["offload"] and not plain["options"]["offload"]
    model, rows, _, _ = load_sequence(options)
    keys = {dtype: dense_cache.dense_key(model, rows[:1], 256, 32, dtype) for dtype in ("float32", "bfloat16")}
    assert keys["float32"] == dense_cache.dense_key(model, rows[:1], 256, 32) != keys["bfloat16"]
    with pytest.raises(SystemExit):
        from oomb.cli import build_parser
        build_parser().parse_args(["gradcheck", "--kv-grad-dtype", "float16"])


def test_gradcheck_runs_the_quick_budgets_only_when_no_arm_is_asked_for():
    """A long run asked for --read-shares (or --reads) compares those arms alone: no 4/8/16-page arms beside them."""
    from oomb.tools.gradcheck import QUICK_BUDGETS, _arms

    base = OOMBConfig(chunk_size=512, page_size=16)
    def budgets(**asked):
        return [arm["budget"] for arm in _arms(GradcheckOptions(scores=["minmax"], **asked), base, 4096, 2)]
    assert budgets() == list(QUICK_BUDGETS)
    assert budgets(read_shares=[0.35]) == ["share 0.35"]
    assert budgets(budgets=[64], read_shares=[0.35]) == [64, "share 0.35"]
    assert len(budgets(reads=[0.5])) == 1
