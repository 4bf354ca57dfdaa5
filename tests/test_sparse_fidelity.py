"""The share of the history a sparse plan reads, and the nearest measured fidelity shown with it."""

from __future__ import annotations

import pytest

from oomb.config import OOMBConfig, SparseConfig
from oomb.sparse_fidelity import MEASURED, FidelityPoint, budget_for_read, describe, history_read, nearest


def test_a_fixed_budget_reads_a_shrinking_share_of_a_growing_history():
    config = OOMBConfig(attention="sparse", sparse=SparseConfig(read_share=None))  # 64 pages of 128 tokens, 1 sink
    shares = [history_read(tokens, config, 28) for tokens in (32768, 131072, 1 << 20)]
    assert shares[0] > shares[1] > shares[2]
    # at 1M the average query block has ~4,096 history pages and reads 65 of them
    assert shares[2] == pytest.approx(65 / 4096, rel=0.02)


def test_the_default_reads_its_share_at_every_length():
    """read_share "auto" over the default budget: 35 % of every block's history (more while the budget's floor
    of 64 pages covers more) and the first fifth of the layers whole; a budget set on purpose stays fixed."""
    default = OOMBConfig(attention="sparse")
    assert default.sparse.resolved_read_share == 0.35
    for tokens in (131072, 1 << 20, 1 << 21):
        assert 0.35 <= history_read(tokens, default, 4) < 0.38  # a fifth of 4 layers rounds down to none
        assert 0.48 <= history_read(tokens, default, 30) < 0.51  # 24 layers at 35 %, 6 whole
    assert history_read(32768, default, 4) > 0.35  # the floor of 64 pages
    assert SparseConfig(budget=32).resolved_read_share is None
    assert SparseConfig(budget=32, read_share=0.5).resolved_read_share == 0.5
    assert SparseConfig().resolved(30).read_share == 0.35
    assert SparseConfig().resolved(30).dense_layers == (0, 1, 2, 3, 4, 5)
    assert SparseConfig().resolved(28).dense_layers == (0, 1, 2, 3, 4)
    assert SparseConfig(read_share=0.35).resolved(30).dense_layers == (0, 1, 2, 3, 4, 5)  # the default, written
    assert SparseConfig(dense_layers=()).resolved(30).dense_layers == ()  # every layer sparse, asked for
    for other in (SparseConfig(read_share=0.5), SparseConfig(read_share=None), SparseConfig(budget=32),
                  SparseConfig(layer_budgets=(64,) * 30)):
        assert other.resolved(30).dense_layers == ()  # a share, budget or plan of one's own keeps no dense layers
        assert other.resolved().dense_layers == ()  # which needs no layer count
    with pytest.raises(ValueError, match="number of decoder layers"):
        SparseConfig().resolved()
    with pytest.raises(ValueError, match="number of decoder layers"):
        SparseConfig().num_selected(100, 0)
    assert SparseConfig(budget=4).num_selected(100, 0) == 5  # no layer count needed: every layer sparse
    # a sliding-window layer reads its window densely anyway: "auto" leaves it out (gemma3: layers 0-4 sliding)
    assert SparseConfig().resolved(30, window_layers=(0, 1, 2, 3, 4, 6)).dense_layers == (5,)
    assert SparseConfig(dense_layers=(0, 1)).resolved(30, window_layers=(0,)).dense_layers == (0, 1)  # as written


def test_budget_for_read_is_the_smallest_budget_reaching_the_share():
    config = OOMBConfig(attention="sparse")
    budget = budget_for_read(131072, config, 0.25, 28)
    assert history_read(131072, OOMBConfig(attention="sparse", sparse=SparseConfig(budget=budget)), 28) >= 0.25
    assert history_read(131072, OOMBConfig(attention="sparse", sparse=SparseConfig(budget=budget - 1)), 28) < 0.25
    assert budget_for_read(8192, config, 1.0, 28) <= 8192 // 128


def test_nearest_weighs_length_and_share_by_doublings():
    points = (FidelityPoint(32768, 0.25, 0.99, 0.001, "a", "a.json"),
              FidelityPoint(131072, 0.03, 0.95, 0.02, "b", "b.json"))
    assert nearest(1 << 20, 0.016, points).setting == "b"
    assert nearest(16384, 0.3, points).setting == "a"
    assert nearest(1 << 20, 0.016, ()) is None
    # the share read weighs more than the length: a plan reading 35 % at 1M is judged by 35 % at 512K (or at
    # 128K without that point), not by 10 % at 512K
    assert nearest(1 << 20, 0.35).read == pytest.approx(0.354) and nearest(1 << 20, 0.35).seq_len == 524288
    without = tuple(p for p in MEASURED if not (p.seq_len == 524288 and p.read > 0.3))
    assert nearest(1 << 20, 0.35, without).read == pytest.approx(0.351)
    assert nearest(1 << 20, 0.35, without).seq_len == 131072
    assert nearest(1 << 20, 0.016).seq_len == 524288  # a fixed 64 pages at 1M: 512K at 3.2 %


def test_describe_states_the_share_and_the_measurement():
    line = describe(1 << 20, OOMBConfig(attention="sparse"), 28)
    assert line.startswith("sparse reads 46.8 % of the history at 1M tokens; nearest measurement:")
    assert "layers 0-5 dense" in line  # the nearest point is the defaults' own
    fixed = describe(1 << 20, OOMBConfig(attention="sparse", sparse=SparseConfig(read_share=None)), 28)
    assert fixed.startswith("sparse reads 1.6 % of the history at 1M tokens; nearest measurement:")
    assert "gradient cosine" in line and "near-dense mark" in line
    short = describe(8192, OOMBConfig(attention="sparse"), 28)  # 64 pages hold 8K tokens' whole history
    assert short == ("sparse reads 100 % of the history at 8K tokens: every query block reads every earlier page, so "
                     "this step is dense attention (exact, and no faster); sparse reads less at longer sequences or "
                     "with a smaller sparse budget")


def test_the_memory_model_sizes_a_read_share_for_the_longest_history():
    from oomb.planning.memory import sparse_pages_read

    fixed, grown = SparseConfig(read_share=None), SparseConfig(read_share=0.25)
    assert sparse_pages_read(fixed, 1 << 20, 128) == 65
    assert sparse_pages_read(grown, 1 << 20, 128) == 1 + 2048  # a quarter of 8,192 pages
    assert sparse_pages_read(grown, 8192, 128) == 65  # the budget is the floor while the history is short
    read = history_read(1 << 20, OOMBConfig(attention="sparse", sparse=SparseConfig(read_share=0.25)), 28)
    assert 0.25 <= read < 0.27


def test_the_memory_model_counts_each_layers_selections():
    """Layers that read alike are counted once (the default's dense layers keep no selection, per-layer budgets
    their own), and the total is each layer's selection_bytes summed."""
    from oomb.config import OffloadConfig
    from oomb.planning.memory import predict, selection_bytes
    from oomb.tools.plan import load_model_shape

    shape = load_model_shape("qwen2.5-7b")
    tokens, resident = 1 << 19, 3
    budgets = tuple(64 + 16 * (layer % 3) for layer in range(shape.num_layers))
    for sparse in (SparseConfig(), SparseConfig(layer_budgets=budgets, dense_layers=(1, 4))):
        config = OOMBConfig(attention="sparse", sparse=sparse, offload=OffloadConfig(enabled=True,
                                                                                     resident_layers=resident))
        resolved = sparse.resolved(shape.num_layers)
        each = [selection_bytes(resolved, tokens, config.chunk_size, config.page_size, 1, shape.num_kv_heads, layer)
                for layer in range(shape.num_layers)]
        assert predict("sparse+offload", shape, tokens, config).host["selections"] == sum(each[resident:])
        dense = resolved.dense_layers
        assert dense and all(each[layer] == 0 for layer in dense)  # a dense layer keeps no selection
        assert all(each[layer] > 0 for layer in range(shape.num_layers) if layer not in dense)


def test_every_measured_point_is_in_its_results_file():
    """The plan quotes these numbers: each must be a row of the JSON it names (read, cosine, loss gap)."""
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    for point in MEASURED:
        data = json.loads((results / point.source).read_text())
        rows = []
        for row in data["sparse"]:
            cosine = row.get("cosine", row.get("groups", {}).get("total", {}).get("cosine"))
            dense_loss = row.get("dense_loss", data.get("dense", {}).get("loss"))
            gap = row.get("loss_gap", (row["loss"] - dense_loss) / dense_loss if dense_loss else None)
            rows.append((row["history_read"], cosine, gap))
        assert any(abs(read - point.read) < 1e-3 and abs(cosine - point.cosine) < 1e-4 and abs(gap - point.loss_gap)
                   < 1e-4 for read, cosine, gap in rows), (point, rows)


def test_shares_print_as_percentages_a_reader_expects():
    from oomb.sparse_fidelity import format_share

    shares = (1.0, 0.125, 0.47, 0.016, 0.0082)
    assert [format_share(s) for s in shares] == ["100 %", "12.5 %", "47 %", "1.6 %", "0.82 %"]
