"""OOMBConfig's sparse section, and the flat sparse_* keys of earlier versions (keywords, YAML files,
checkpoints), which still load, with one DeprecatedConfigKey warning naming the new paths."""

import dataclasses
import warnings

import pytest
import yaml

from oomb.config import FLAT_KEYS, DeprecatedConfigKey, OOMBConfig, SparseConfig, SparseResearch
from oomb.training.checkpointing import _changed_keys
from oomb.training.config import TrainerConfig

SECTIONED = OOMBConfig(attention="sparse", chunk_size=256, page_size=64,
                       sparse=SparseConfig(budget=32, sink_pages=2, query_block_pages=4, dense_layers=(3, 1),
                                           research=SparseResearch(pooling="softmax", rerank_factor=2)))
FLAT = {"attention": "sparse", "chunk_size": 256, "page_size": 64, "sparse_budget": 32, "sparse_sink_pages": 2,
        "sparse_query_block_pages": 4, "sparse_dense_layers": [3, 1], "sparse_pooling": "softmax",
        "sparse_rerank_factor": 2}


def _one_warning(record) -> str:
    messages = [str(w.message) for w in record if issubclass(w.category, DeprecatedConfigKey)]
    assert len(messages) == 1, messages
    return messages[0]


def test_every_flat_key_has_a_place_in_the_sections():
    config = OOMBConfig()
    for old, new in FLAT_KEYS.items():
        assert old.startswith("sparse_") and new.startswith("sparse.")
        config.option(new)  # an existing path


def test_flat_keywords_map_to_the_sections_with_one_warning():
    with pytest.warns(DeprecatedConfigKey) as record:
        config = OOMBConfig(**FLAT)
    assert config == SECTIONED and config.sparse.dense_layers == (1, 3)
    message = _one_warning(record)
    assert "sparse_budget -> sparse.budget" in message and "sparse_pooling -> sparse.research.pooling" in message


def test_replace_with_a_flat_keyword_changes_the_section():
    with pytest.warns(DeprecatedConfigKey):
        changed = dataclasses.replace(SECTIONED, sparse_budget=8)
    assert changed.sparse == dataclasses.replace(SECTIONED.sparse, budget=8)


def test_flat_attribute_reads_still_answer():
    with pytest.warns(DeprecatedConfigKey, match="sparse_score -> sparse.score"):
        assert SECTIONED.sparse_score == "auto"


def test_round_trip_through_a_plain_mapping_and_yaml():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the sectioned form warns about nothing
        data = yaml.safe_load(yaml.safe_dump(SECTIONED.to_dict()))
        assert data["sparse"]["budget"] == 32 and data["sparse"]["research"]["pooling"] == "softmax"
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
                    "  sparse_query_block_pages: auto\n")
    with pytest.warns(DeprecatedConfigKey) as record:
        config = TrainerConfig.load(path)
    _one_warning(record)
    assert (config.oomb.sparse.budget, config.oomb.sparse.score) == (16, "minmax")
    assert "sparse.query_block_pages" in config.oomb_auto
    new = TrainerConfig.load(None, ["oomb.attention=sparse", "oomb.sparse.budget=16", "oomb.sparse.score=minmax"])
    assert new.oomb == config.oomb


def test_an_old_checkpoints_config_resumes_as_the_same_run():
    """A checkpoint's config.yaml of an earlier version (every OOMBConfig field flat) is the same run."""
    cfg = TrainerConfig.from_dict({"oomb": {"attention": "sparse", "sparse": {"budget": 16}}})
    old = cfg.to_dict()
    sparse = old["oomb"].pop("sparse")
    old["oomb"].update({f"sparse_{k}": v for k, v in sparse.items() if k != "research"})
    old["oomb"].update({f"sparse_{k}": v for k, v in sparse["research"].items()})
    old = yaml.safe_load(yaml.safe_dump(old))
    with pytest.warns(DeprecatedConfigKey):
        assert TrainerConfig.from_dict(old).oomb == cfg.oomb
    from oomb.config import nested_options

    with pytest.warns(DeprecatedConfigKey):
        old["oomb"] = nested_options(old["oomb"])  # as Checkpointing._restore reads it
    assert _changed_keys(old, cfg.to_dict()) == []
