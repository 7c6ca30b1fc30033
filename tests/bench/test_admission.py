"""The admission scenario's arithmetic: completions counted by when they ended, within the window
every generator measured, and its report section."""

from __future__ import annotations

from typing import Any

from benchmarks.admission import _done, _ttfb_p99_ms, _window
from benchmarks.report import _admission


def test_completions_count_within_the_common_window_and_only_answered_ones() -> None:
    window = _window([{"window": [10.0, 30.0]}, {"window": [12.0, 31.0]}])
    assert window == (12.0, 30.0)
    requests = [
        [0, 1.0, 2.0, 11.0, 200],  # ended before the common window
        [0, 9.0, 9.5, 13.0, 200],
        [-10, 12.0, 12.1, 14.0, 200],
        [0, 12.0, None, 15.0, 429],  # refused
        [0, 20.0, 21.0, 32.0, 200],  # ended after
    ]
    done = _done(requests, window)
    assert [r[3] for r in done] == [13.0, 14.0]
    assert round(_ttfb_p99_ms(done)) == 500


def test_the_report_section_names_the_goals_and_each_setup() -> None:
    row: dict[str, Any] = {
        "light_share": 0.5,
        "share_error": 0.0,
        "light_ttfb_p99_ms": 600.0,
        "heavy_ttfb_p99_ms": 10_000.0,
        "ttfb_ratio": 0.06,
        "failed": 0,
    }
    data = {
        "slots": 4,
        "heavy_clients": 40,
        "light_clients": 4,
        "priority": {
            "urgent_done": 8,
            "rest_done": 76,
            "urgent_ttfb_p99_ms": 582.0,
            "rest_ttfb_p99_ms": 7463.0,
            "ratio": 0.078,
            "failed": 0,
        },
        "tenants": {"one FIFO": {**row, "light_share": 0.095}, "fair share": row},
    }
    text = "\n".join(_admission(data))
    assert "**0.08** (goal ≤ 0.3)" in text
    assert "| one FIFO | 0.095 |" in text and "| fair share | 0.500 | 0.000 |" in text
