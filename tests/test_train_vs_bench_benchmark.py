"""benchmarks/train_vs_bench.py on the CPU: both commands run, and the JSON sets their plans and times side by
side with the ratio computed from them."""

import json

import pytest
from helpers import load_script


@pytest.mark.slow
def test_both_arms_run_and_the_ratio_is_theirs(tmp_path):
    script = load_script("benchmarks/train_vs_bench.py")
    report = script.main(["--preset", "tiny-qwen2", "--seq-len", "4K", "--device", "cpu", "--steps", "2",
                          "--attention", "sparse", "--sparse-read-share", "none", "--out-dir", str(tmp_path),
                          "--work-dir", str(tmp_path / "work"), "--name", "tvb.json", "--progress",
                          "--train-first"])
    assert json.loads((tmp_path / "tvb.json").read_text()) == report
    bench, train = report["bench"], report["train"]
    assert bench["status"] == "ok" and train["status"] == "ok" and len(train["step_seconds"]) == 2
    assert report["train_over_bench"] == round(train["steady_step_s"] / bench["step_seconds"], 4)
    assert train["plan"]["sparse.read_share"] is None and bench["plan"]["sparse.read_share"] is None
    assert set(report["plans_differ"]) <= set(script.PLAN_KEYS)
    assert set(train["steady_step_parts_s"]) == {"data_s", "forward_backward_s", "update_s"}
    assert "stage 2, chunk" in (tmp_path / "train.log").read_text()  # --progress: chunks within a step, in the log


def test_each_arm_gets_empty_compile_caches_of_its_own(tmp_path):
    script = load_script("benchmarks/train_vs_bench.py")
    stale = tmp_path / "bench" / "inductor_cache" / "old.py"
    stale.parent.mkdir(parents=True)
    stale.write_text("compiled by an earlier run")
    env = script.fresh_compile_caches({"PATH": "/bin"}, tmp_path / "bench")
    other = script.fresh_compile_caches({"PATH": "/bin"}, tmp_path / "train")
    assert env["PATH"] == "/bin" and not stale.exists()
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "bench" / "inductor_cache")
    assert env["TRITON_CACHE_DIR"] != other["TRITON_CACHE_DIR"]
    assert all(not any((tmp_path / arm / cache).iterdir()) for arm in ("bench", "train")
               for cache in ("inductor_cache", "triton_cache"))


def test_a_comparison_cut_short_keeps_the_arm_that_ran():
    script = load_script("benchmarks/train_vs_bench.py")
    args = script.parse_args(["--seq-len", "1M", "--attention", "sparse", "--train-first"])
    train = {"arm": "oomb train", "command": "oomb train ...", "status": "ok", "steady_step_s": 230.0,
             "plan": {"precision.kv_grad_dtype": "float32"}}
    result = script.comparison(args, [], 1 << 20, "sparse", {"arm": "oomb bench --chosen", "command": "oomb bench"},
                               train)
    assert result["train"]["steady_step_s"] == 230.0 and result["train_over_bench"] is None
    assert result["plans_differ"]["precision.kv_grad_dtype"] == {"bench": None, "train": "float32"}


def test_the_train_arm_can_take_the_benchs_page_dtype(tmp_path):
    """--train-kv-grad-dtype bfloat16: oomb train at the page dtype the bench's plan takes (every weight trained,
    float32 pages do not fit it at 1M), so the comparison leaves the dtype out; by default the chooser's."""
    script = load_script("benchmarks/train_vs_bench.py")
    args = script.parse_args(["--seq-len", "1M", "--attention", "sparse", "--lora",
                              "--train-kv-grad-dtype", "bfloat16"])
    bench, train = script.arm_commands(args, 1 << 20, "sparse+offload", tmp_path)
    assert train[train.index("--kv-grad-dtype") + 1] == "bfloat16" and "--kv-grad-dtype" not in bench
    assert "--kv-grad-dtype" not in script.arm_commands(script.parse_args([]), 1 << 20, "dense", tmp_path)[1]
    result = script.comparison(args, [], 1 << 20, "sparse+offload", {}, {})
    assert result["workload"]["train_kv_grad_dtype"] == "bfloat16"
