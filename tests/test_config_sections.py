"""OOMBConfig's sections (sparse, offload, performance, precision), and the flat keys of earlier versions
(keywords, dataclasses.replace, attribute reads, YAML files, checkpoints), which still load, with one
DeprecatedConfigKey warning naming the new paths."""

import dataclasses
import warnings

import pytest
import yaml

from oomb.config import (
    FLAT_KEYS,
    SECTIONS,
    DeprecatedConfigKey,
    OffloadConfig,
    OOMBConfig,
    PerformanceConfig,
    PrecisionConfig,
    SparseConfig,
    SparseResearch,
    dotted_options,
)
from oomb.training.checkpointing import _changed_keys
from oomb.training.config import TrainerConfig

SECTIONED = OOMBConfig(attention="sparse", chunk_size=256, page_size=64,
                       sparse=SparseConfig(budget=32, sink_pages=2, query_block_pages=4, dense_layers=(3, 1),
                                           research=SparseResearch(pooling="softmax", rerank_factor=2)),
                       offload=OffloadConfig(enabled=True, resident_layers=2, stream_buffers=4),
                       performance=PerformanceConfig(backend="triton", checkpoint_layers=False),
                       precision=PrecisionConfig(kv_grad_dtype="bfloat16", deterministic=True))
FLAT = {"attention": "sparse", "chunk_size": 256, "page_size": 64, "sparse_budget": 32, "sparse_sink_pages": 2,
        "sparse_query_block_pages": 4, "sparse_dense_layers": [3, 1], "sparse_pooling": "softmax",
        "sparse_rerank_factor": 2, "offload": True, "offload_resident_layers": 2, "stream_buffers": 4,
        "backend": "triton", "checkpoint_layers": False, "kv_grad_dtype": "bfloat16", "deterministic": True}
OLD_NAMES = {new: old for old, new in FLAT_KEYS.items()}


def _one_warning(record) -> str:
    messages = [str(w.message) for w in record if issubclass(w.category, DeprecatedConfigKey)]
    assert len(messages) == 1, messages
    return messages[0]


def test_every_flat_key_has_a_place_in_the_sections():
    config = OOMBConfig()
    for old, new in FLAT_KEYS.items():
        assert new.split(".")[0] in SECTIONS
        assert old == "offload" or new.endswith(old.removeprefix("sparse_").removeprefix("offload_"))
        config.option(new)  # an existing path
    # every option of a section that existed flat before has its old key
    assert {path for path in config.options() if "." in path} - set(OLD_NAMES) == set()


def test_flat_keywords_map_to_the_sections_with_one_warning():
    with pytest.warns(DeprecatedConfigKey) as record:
        config = OOMBConfig(**FLAT)
    assert config == SECTIONED and config.sparse.dense_layers == (1, 3)
    message = _one_warning(record)
    assert "sparse_budget -> sparse.budget" in message and "sparse_pooling -> sparse.research.pooling" in message
    assert "offload -> offload.enabled" in message and "kv_grad_dtype -> precision.kv_grad_dtype" in message


def test_replace_with_a_flat_keyword_changes_the_section():
    with pytest.warns(DeprecatedConfigKey):
        changed = dataclasses.replace(SECTIONED, sparse_budget=8)
    assert changed.sparse == dataclasses.replace(SECTIONED.sparse, budget=8)
    with pytest.warns(DeprecatedConfigKey, match="stream_buffers -> offload.stream_buffers"):
        changed = dataclasses.replace(SECTIONED, stream_buffers=2, recompute_logits=False)
    assert changed.offload == dataclasses.replace(SECTIONED.offload, stream_buffers=2)
    assert changed.performance == dataclasses.replace(SECTIONED.performance, recompute_logits=False)


def test_the_flat_offload_flag_is_offload_enabled():
    """``offload`` was a flag and is now the section: a flag given for it (keyword, replace, mapping) sets
    offload.enabled. dataclasses.replace then passes the flag instead of the section, so the section's other
    options start from their defaults; with_options keeps them."""
    with pytest.warns(DeprecatedConfigKey, match="offload -> offload.enabled"):
        assert OOMBConfig(offload=True).offload == OffloadConfig(enabled=True)
    with pytest.warns(DeprecatedConfigKey):
        assert dataclasses.replace(SECTIONED, offload=False).offload == OffloadConfig()
    with pytest.warns(DeprecatedConfigKey):
        assert SECTIONED.with_options({"offload": False}).offload == dataclasses.replace(SECTIONED.offload,
                                                                                        enabled=False)
    with pytest.warns(DeprecatedConfigKey):
        assert dotted_options({"offload": "auto"}) == {"offload.enabled": "auto"}
    assert dotted_options({"offload": {"enabled": True}}) == {"offload.enabled": True}  # the section: no warning
    with pytest.raises(TypeError, match=r"offload\.enabled"):
        bool(SECTIONED.offload)  # `if config.offload:` of earlier versions fails loudly


def test_flat_attribute_reads_still_answer():
    with pytest.warns(DeprecatedConfigKey, match="sparse_score -> sparse.score"):
        assert SECTIONED.sparse_score == "auto"
    with pytest.warns(DeprecatedConfigKey, match="offload_resident_layers -> offload.resident_layers"):
        assert SECTIONED.offload_resident_layers == 2
    with pytest.warns(DeprecatedConfigKey, match="kv_grad_dtype -> precision.kv_grad_dtype"):
        assert SECTIONED.kv_grad_dtype == "bfloat16"


def test_round_trip_through_a_plain_mapping_and_yaml():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the sectioned form warns about nothing
        data = yaml.safe_load(yaml.safe_dump(SECTIONED.to_dict()))
        assert data["sparse"]["budget"] == 32 and data["sparse"]["research"]["pooling"] == "softmax"
        assert data["offload"]["enabled"] is True and data["precision"]["kv_grad_dtype"] == "bfloat16"
        assert OOMBConfig.from_dict(data) == SECTIONED
        assert SECTIONED.with_options({"sparse.budget": 8, "sparse.research.rerank_factor": 3}).sparse == \
            dataclasses.replace(SECTIONED.sparse, budget=8, research=dataclasses.replace(
                SECTIONED.sparse.research, rerank_factor=3))


def test_flat_and_dotted_dicts_load():
    with pytest.warns(DeprecatedConfigKey) as record:
        assert OOMBConfig.from_dict(FLAT) == SECTIONED
    _one_warning(record)
    assert OOMBConfig.from_dict({"sparse.budget": 5}).sparse.budget == 5


def test_unknown_keys_name_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['sparse.bugdet'\]; valid options: \['budget'"):
        OOMBConfig.from_dict({"sparse": {"bugdet": 4}})
    with pytest.raises(ValueError, match=r"sparse.research.polling"):
        OOMBConfig.from_dict({"sparse": {"research": {"polling": "max"}}})


def test_a_flat_training_yaml_loads(tmp_path):
    """A config file written for an earlier version: flat sparse keys in its oomb section, one left auto."""
    path = tmp_path / "old.yaml"
    path.write_text("oomb:\n  attention: sparse\n  sparse_budget: 16\n  sparse_score: minmax\n"
                    "  sparse_query_block_pages: auto\n  offload: auto\n  kv_grad_dtype: bfloat16\n"
                    "  loss_chunk_tokens: 2K\n")
    with pytest.warns(DeprecatedConfigKey) as record:
        config = TrainerConfig.load(path, ["oomb.offload.resident_layers=3"])  # a dotted override on top
    _one_warning(record)
    assert (config.oomb.sparse.budget, config.oomb.sparse.score) == (16, "minmax")
    assert (config.oomb.precision.kv_grad_dtype, config.oomb.performance.loss_chunk_tokens) == ("bfloat16", 2048)
    assert config.oomb.offload.resident_layers == 3
    assert {"sparse.query_block_pages", "offload.enabled"} <= set(config.oomb_auto)
    new = TrainerConfig.load(None, ["oomb.attention=sparse", "oomb.sparse.budget=16", "oomb.sparse.score=minmax",
                                    "oomb.precision.kv_grad_dtype=bfloat16", "oomb.performance.loss_chunk_tokens=2K",
                                    "oomb.offload.resident_layers=3"])
    assert new.oomb == config.oomb


def test_an_old_checkpoints_config_resumes_as_the_same_run():
    """A checkpoint's config.yaml of an earlier version (every OOMBConfig field flat) is the same run."""
    cfg = TrainerConfig.from_dict({"oomb": {"attention": "sparse", "sparse": {"budget": 16},
                                            "offload": {"resident_layers": 2},
                                            "precision": {"kv_grad_dtype": "bfloat16"}}})
    old = cfg.to_dict()
    old["oomb"] = {OLD_NAMES.get(path, path): value for path, value in dotted_options(old["oomb"]).items()}
    assert "offload" in old["oomb"] and "kv_grad_dtype" in old["oomb"] and "precision" not in old["oomb"]
    old = yaml.safe_load(yaml.safe_dump(old))
    with pytest.warns(DeprecatedConfigKey):
        assert TrainerConfig.from_dict(old).oomb == cfg.oomb
    from oomb.config import nested_options

    with pytest.warns(DeprecatedConfigKey):
        old["oomb"] = nested_options(old["oomb"])  # as Checkpointing._restore reads it
    assert _changed_keys(old, cfg.to_dict()) == []
    # a changed option is named by its path, not by its section
    old["oomb"]["sparse"]["dense_layers"] = []
    assert _changed_keys(old, cfg.to_dict()) == ["oomb.sparse.dense_layers"]
