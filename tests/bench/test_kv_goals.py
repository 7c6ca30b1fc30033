"""The benchmark report's verdicts on the goals ``kv_aware`` was built to: each setup from
the run's paired rounds where it has them, else from the medians of its main rows, each goal at
its own threshold."""

from __future__ import annotations

from typing import Any

from benchmarks.kv_goals import judge


def _pair(variant: str, replicas: int, workers: int, **fields: Any) -> dict[str, Any]:
    return {
        "variant": variant,
        "replicas": replicas,
        "workers": workers,
        "rounds": 8,
        "hit_rate": 0.6,
        "hit_diff_points_median": 0.0,
        "p99_ratio_median": 1.0,
        "pooled_p99_ratio": 1.0,
        **fields,
    }


def _row(policy: str, replicas: int, workers: int, hits: float, p99: float) -> dict[str, Any]:
    return {
        "router": "ours",
        "policy": policy,
        "replicas": replicas,
        "workers": workers,
        "hit_rate": hits,
        "ttfb_p99_ms": p99,
    }


def _verdicts(result: dict[str, Any]) -> dict[tuple[str, str, str], tuple[bool, str]]:
    return {(g["setup"], g["measure"], g["goal"]): (g["met"], g["source"]) for g in judge(result)}


def _rounds(**kv: dict[str, Any]) -> dict[str, Any]:
    """Paired rounds of every setup; ``kv`` overrides ``kv_aware``'s pair of a setup."""
    setups = {"one": (1, 1), "two": (2, 1), "workers": (1, 2)}
    pairs = []
    for name, (replicas, workers) in setups.items():
        pairs.append(_pair("cache_aware", replicas, workers))
        pairs.append(_pair("kv_aware", replicas, workers, **kv.get(name, {})))
    return {"pairs": pairs}


GOOD = {
    "one": {"pooled_p99_ratio": 1.05, "hit_diff_points_median": -1.0, "hit_rate": 0.61},
    "two": {"pooled_p99_ratio": 0.9, "hit_diff_points_median": 10.0, "hit_rate": 0.58},
    "workers": {"pooled_p99_ratio": 0.9, "hit_rate": 0.58},
}


def test_every_goal_at_its_threshold_is_met() -> None:
    verdicts = _verdicts({"rounds": _rounds(**GOOD)})
    assert len(verdicts) == 7
    assert all(met for met, _source in verdicts.values())
    assert {source for _met, source in verdicts.values()} == {"paired rounds (8)"}


def test_each_goal_is_missed_just_past_its_threshold() -> None:
    cases = {
        ("one", "pooled_p99_ratio", 1.06): ("one router", "TTFT p99"),
        ("one", "hit_diff_points_median", -1.1): ("one router", "prefix hits"),
        ("two", "pooled_p99_ratio", 0.91): ("two replicas", "TTFT p99"),
        ("two", "hit_diff_points_median", 9.9): ("two replicas", "prefix hits"),
        ("two", "hit_rate", 0.579): ("two replicas", "prefix hits"),
        ("workers", "pooled_p99_ratio", 0.91): ("--workers 2", "TTFT p99"),
        ("workers", "hit_rate", 0.579): ("--workers 2", "prefix hits"),
    }
    for (setup, field, value), (name, measure) in cases.items():
        given = {k: dict(v) for k, v in GOOD.items()}
        given[setup][field] = value
        missed = [
            key for key, (met, _s) in _verdicts({"rounds": _rounds(**given)}).items() if not met
        ]
        assert len(missed) == 1, (setup, field, missed)
        assert missed[0][:2] == (name, measure)


def test_without_rounds_the_main_rows_medians_are_judged() -> None:
    rows = [
        _row("cache_aware", 1, 2, 0.60, 800.0),
        _row("cache_aware", 1, 2, 0.60, 1000.0),
        _row("cache_aware", 1, 2, 0.60, 900.0),
        _row("kv_aware", 1, 2, 0.60, 700.0),
        _row("kv_aware", 1, 2, 0.60, 2000.0),
        _row("kv_aware", 1, 2, 0.60, 800.0),
        # vllm-router's rows are never the reference.
        {**_row("cache_aware", 1, 2, 0.10, 100.0), "router": "vllm"},
    ]
    verdicts = _verdicts({"configs": rows})
    # Medians 800 / 900: 0.89x, met; the mean (1,167 ms) would miss.
    assert verdicts[("--workers 2", "TTFT p99", "<= 0.9x cache_aware --workers 2's")] == (
        True,
        "main rows (3)",
    )
    rows[4]["ttfb_p99_ms"] = 850.0
    rows[5]["ttfb_p99_ms"] = 900.0  # median 850: 0.94x
    assert not _verdicts({"configs": rows})[
        ("--workers 2", "TTFT p99", "<= 0.9x cache_aware --workers 2's")
    ][0]


def test_rounds_take_precedence_over_main_rows_for_their_setups_only() -> None:
    rows = [_row("cache_aware", 1, 1, 0.6, 100.0), _row("kv_aware", 1, 1, 0.6, 500.0)]
    rows += [_row("cache_aware", 2, 1, 0.5, 100.0), _row("kv_aware", 2, 1, 0.7, 50.0)]
    pairs = [_pair("cache_aware", 1, 1), _pair("kv_aware", 1, 1, pooled_p99_ratio=0.8)]
    verdicts = _verdicts({"configs": rows, "rounds": {"pairs": pairs}})
    assert verdicts[("one router", "TTFT p99", "<= 1.05x cache_aware's")] == (
        True,
        "paired rounds (8)",
    )
    assert verdicts[("two replicas", "TTFT p99", "<= 0.9x two-replica cache_aware's")] == (
        True,
        "main rows (1)",
    )


def test_restart_and_idle() -> None:
    idle = {"index_blocks": {"a": 190}, "sim_blocks": {"a": 190}, "equal": True}
    restart = [
        {"policy": "cache_aware", "hit_rate_first_100": 0.5},
        {"policy": "kv_aware", "hit_rate_first_100": 0.65},
    ]
    verdicts = _verdicts({"restart": restart, "idle": idle})
    assert [met for met, _s in verdicts.values()] == [True, True]
    restart[1]["hit_rate_first_100"] = 0.649
    verdicts = _verdicts({"restart": restart, "idle": {**idle, "equal": False}})
    assert [met for met, _s in verdicts.values()] == [False, False]
