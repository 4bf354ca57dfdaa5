"""examples/sft_trainer.py takes the step options an `oomb train` run chose (its config.yaml), flags over them."""

from __future__ import annotations

import pytest
from helpers import load_script

from oomb import OOMBConfig
from oomb.training.config import TrainerConfig

pytest.importorskip("trl")
pytest.importorskip("datasets")

def load_example():
    return load_script("examples/sft_trainer.py")


def test_oomb_from_train_config_then_flags(tmp_path):
    example = load_example()
    config = TrainerConfig.load(None, ["oomb.chunk_size=1024", "oomb.performance.backend=torch",
                                       "oomb.performance.checkpoint_layers=false",
                                       "oomb.precision.kv_grad_dtype=bfloat16"])
    path = tmp_path / "config.yaml"
    path.write_text(config.to_yaml())
    base = ["--preset", "tiny-qwen2", "--data", "x.jsonl", "--seq-len", "2048"]
    chosen = example.oomb_config_from(example.parse_args([*base, "--oomb-from", str(path)]))
    assert chosen == config.oomb
    assert (chosen.chunk_size, chosen.performance.backend, chosen.performance.checkpoint_layers) == (1024, "torch",
                                                                                                     False)
    flagged = example.oomb_config_from(example.parse_args([*base, "--oomb-from", str(path), "--chunk-size", "512",
                                                           "--checkpoint-layers"]))
    assert (flagged.chunk_size, flagged.performance.checkpoint_layers, flagged.performance.backend) == (512, True,
                                                                                                        "torch")
    assert example.oomb_config_from(example.parse_args(base)) == OOMBConfig()
    unresolved = tmp_path / "auto.yaml"  # the chooser's options left "auto": OOMBConfig's defaults
    unresolved.write_text(TrainerConfig.load(None, ["oomb.chunk_size=1024"]).to_yaml())
    assert example.oomb_config_from(example.parse_args([*base, "--oomb-from", str(unresolved)])) == \
        OOMBConfig(chunk_size=1024)
