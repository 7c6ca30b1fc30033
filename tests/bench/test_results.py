"""Which saved result files ``benchmarks/report.py`` reads as a scenario's: only
``<date>-<scenario>.json``, never a run kept under a longer name that ends the same way."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.common import histogram_percentile, scenario_results, table_cell


def test_a_scenarios_results_are_its_dated_files_oldest_first(tmp_path: Path) -> None:
    names = [
        "2026-12-07-workers.json",
        "2026-12-01-workers.json",
        "2026-12-08-kv_aware-rounds-rel-1.5-workers.json",
        "2026-12-09-kv_aware.json",
        "notes-workers.json",
        "2026-12-10-workers.json.tmp",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"{}")
    assert [p.name for p in scenario_results(tmp_path, "workers")] == [
        "2026-12-01-workers.json",
        "2026-12-07-workers.json",
    ]
    assert [p.name for p in scenario_results(tmp_path, "kv_aware")] == ["2026-12-09-kv_aware.json"]
    assert scenario_results(tmp_path, "caps") == []


def test_a_table_cell_shows_raw_bytes_escaped_and_keeps_the_table_whole() -> None:
    # vllm-router's answer to an HTTP/2 preface is binary frames, kept as text in a result
    assert table_cell("\x00\x00\x12\x04 x1, ok") == "\\x00\\x00\\x12\\x04 x1, ok"
    assert table_cell("a | b") == "a \\| b"
    assert table_cell("1,234 / 5 µs") == "1,234 / 5 µs"


def test_a_histogram_percentile_is_the_upper_edge_of_the_bucket_holding_its_rank() -> None:
    counts = [0, 3, 0, 6, 1]  # 10 values in 1 ms buckets: (1,2] x3, (3,4] x6, (4,5] x1
    assert histogram_percentile(counts, 0.001, 0.3) == pytest.approx(0.002)
    assert histogram_percentile(counts, 0.001, 0.31) == pytest.approx(0.004)
    assert histogram_percentile(counts, 0.001, 0.9) == pytest.approx(0.004)
    assert histogram_percentile(counts, 0.001, 0.99) == pytest.approx(0.005)
    assert histogram_percentile(counts, 0.001, 0.0) == pytest.approx(0.002)
    assert math.isnan(histogram_percentile([0, 0], 0.001, 0.5))
