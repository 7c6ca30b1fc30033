"""``benchmarks/report.md`` and its charts, from the newest result file of every scenario."""

from __future__ import annotations

import math
import os
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from .common import scenario_results, table_cell
from .kv_goals import idle_counts, judge

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
REPORT = HERE / "report.md"
SCENARIOS = (
    "routing",
    "paced",
    "overhead",
    "relay",
    "memory",
    "radix_tree",
    "cluster",
    "workers",
    "caps",
    "mixed",
    "kv_aware",
    "kv_ownership",
    "tracing",
    "admission",
)


def latest(scenario: str) -> tuple[Path, dict[str, Any]] | None:
    """The newest ``results/<date>-<scenario>.json`` and its contents."""
    files = scenario_results(RESULTS, scenario)
    if not files:
        return None
    return files[-1], orjson.loads(files[-1].read_bytes())


def _pyplot() -> Any:
    """matplotlib's pyplot on the file backend, imported when a chart is drawn: the report's
    text functions (and the tests of them) need no plotting library."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _f(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(table_cell(cell) for cell in row) + " |" for row in rows]
    return lines


def _chart_name(path: Path, name: str) -> Path:
    return path.with_name(path.name.rsplit("-", 1)[0] + f"-{name}.png")


def _routing(path: Path, data: dict[str, Any]) -> list[str]:
    s = data["settings"]
    out = [
        "## 4. Routing quality",
        "",
        f"1 prefill + 1 decode simulator, 4 DP ranks each; {s['concurrency']} closed-loop "
        "clients; shared-prefix workload (3 hot groups take 60 %, 60 cold groups the rest). "
        f"Median of {s['repeats']} interleaved runs of {s['seconds']:.0f} s (after "
        f"{s['warmup']:.0f} s warm-up); fresh router and emptied caches per run.",
        f"Prefill simulator: `{' '.join(s['prefill_sim'])}`; decode: "
        f"`{' '.join(s['decode_sim'])}`; load: `{' '.join(s['load'])}`.",
        "",
        "*Load error*: how far the router's own count per endpoint (trio-pdrouter `/get_loads`, "
        "vllm-router the `load` in `/workers`) lies outside the simulators' running+waiting, "
        "read just before and after; mean and max over samples x 8 endpoints.",
        "",
    ]
    rows = []
    for c in data["configs"]:
        rows.append(
            [
                c["label"],
                _f(c["req_per_s"]),
                _f(c["ttfb_p50_ms"], 0),
                _f(c["ttfb_p99_ms"], 0),
                _f(c["total_p99_ms"], 0),
                " / ".join(_f(x, 0) for x in c["decode_peak_running"]),
                _f(c["decode_spread_mean"]),
                _f(c.get("prefill_cache_hit_rate", math.nan) * 100, 0) + " %",
                f"{_f(c['load_error_mean'], 2)} (max {_f(c['load_error_max'], 0)})",
                _f(c["router_cpu_util"] * 100, 0) + " %",
            ]
        )
    out += _table(
        [
            "router / policy",
            "req/s",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "total p99 ms",
            "decode peak running per rank",
            "mean decode spread (max-min running)",
            "prefill cache hit",
            "load error",
            "router CPU",
        ],
        rows,
    )
    out += ["", *(f"- {n}" for n in data.get("notes", []))]
    chart = _chart_name(path, "routing-running")
    _plot_running(data["configs"], chart)
    cdf = _chart_name(path, "routing-ttft-cdf")
    _plot_cdf({c["label"]: c["ttfb_cdf_ms"] for c in data["configs"]}, cdf, "TTFT (ms)", log=True)
    out += [
        "",
        f"![decode running per rank over time]({chart.relative_to(HERE)})",
        "",
        f"![TTFT CDF]({cdf.relative_to(HERE)})",
        "",
    ]
    return out


def _plot_running(configs: list[dict[str, Any]], dest: Path) -> None:
    n = len(configs)
    cols = 2
    rows = (n + cols - 1) // cols
    plt = _pyplot()
    fig, axes = plt.subplots(rows, cols, figsize=(12, 2.6 * rows), sharey=True, squeeze=False)
    for ax, c in zip(axes.flat, configs, strict=False):
        series = c["series"]["decode"]
        t = series["t"]
        running = series["running"]
        for rank in range(len(running[0]) if running else 0):
            ax.plot(t, [r[rank] for r in running], label=f"rank {rank}", linewidth=1)
        ax.set_title(c["label"], fontsize=10)
        ax.set_xlabel("s")
        ax.set_ylabel("decode running")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8, loc="upper left", ncol=4)
    fig.suptitle("Decode requests running per DP rank (simulator truth, first run of each)")
    fig.tight_layout()
    fig.savefig(dest, dpi=90)
    plt.close(fig)


def _plot_cdf(curves: dict[str, list[float]], dest: Path, xlabel: str, log: bool) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, points in curves.items():
        if points:
            ax.plot(points, [i / (len(points) - 1) for i in range(len(points))], label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    if log:
        ax.set_xscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dest, dpi=90)
    plt.close(fig)


def _tracing(data: dict[str, Any]) -> list[str]:
    off, on = data["off"], data["on"]
    return [
        "## Tracing cost (scenario 11)",
        "",
        f"PD mode, {data['settings']['concurrency']} streaming clients, zero-latency simulators;"
        " `--otlp-traces-endpoint` with sampling 1.0 into a local OTLP/HTTP sink.",
        "",
        "| tracing | router CPU ms / request | TTFB p50 ms | total p50 ms |",
        "|---|---|---|---|",
        *(
            f"| {name} | {row['router_cpu_ms_per_request']:.3f} | {row['ttfb_p50_ms']:.2f}"
            f" | {row['total_p50_ms']:.2f} |"
            for name, row in (("off", off), ("on", on))
        ),
        "",
        f"CPU on/off: {data['cpu_ratio_on_off']:.2f}x ({data['exports_received']} exports"
        " received).",
        "",
    ]


def _overhead(path: Path, data: dict[str, Any]) -> list[str]:
    s = data["settings"]
    out = [
        "## 1. Overhead",
        "",
        f"Zero-latency simulators, 16-token requests; median of {s['repeats']} interleaved "
        f"rounds of {s['seconds']} s. *Added* = router minus direct in the same round. PD rows "
        "include a prefill leg and a KV pull that direct requests do not make: compare PD with "
        "PD. CPU is the router process's, per 1,000 completed requests.",
        "",
    ]
    rows = []
    for cell in data["cells"]:
        mode = f"C={cell['concurrency']}, {'stream' if cell['stream'] else 'no stream'}"
        for name, t in cell["targets"].items():
            direct = name == "direct"
            rows.append(
                [
                    mode,
                    name,
                    _f(t["ttfb_p50_ms"], 2),
                    "" if direct else _f(t["added_ttfb_p50_ms"], 2),
                    "" if direct else _f(t["added_ttfb_p99_ms"], 2),
                    "" if direct else _f(t["added_total_p50_ms"], 2),
                    "" if direct else _f(t["added_total_p99_ms"], 2),
                    _f(t["req_per_s"], 0),
                    "" if direct else _f(t["router_cpu_s_per_1000"], 2),
                    "" if direct else _f(t["router_peak_rss_mb"], 0),
                ]
            )
    out += _table(
        [
            "load",
            "target",
            "TTFB p50 ms",
            "added TTFB p50",
            "added TTFB p99",
            "added total p50",
            "added total p99",
            "req/s",
            "router CPU s / 1k req",
            "router peak RSS MB",
        ],
        rows,
    )
    out += ["", *(f"- {n}" for n in data.get("notes", []))]
    for cell in data["cells"]:
        if cell["stream"]:
            chart = _chart_name(path, f"overhead-ttfb-cdf-c{cell['concurrency']}")
            curves = {n: t["ttfb_cdf_ms"] for n, t in cell["targets"].items()}
            _plot_cdf(curves, chart, f"TTFB (ms), C={cell['concurrency']}, streaming", log=True)
            out += ["", f"![TTFB CDF C={cell['concurrency']}]({chart.relative_to(HERE)})"]
    return [*out, ""]


def _relay(path: Path, data: dict[str, Any]) -> list[str]:
    s = data["settings"]
    out = [
        "## 2b. Relay capacity, coalesced (zero-latency simulators)",
        "",
        "Not what users see: with no inter-token latency many events arrive per upstream read, "
        "which hides the per-event cost (section 2 is the token-paced measurement). "
        f"256-token streams from {s['sims']} zero-latency simulator processes, regular mode, "
        f"round_robin; median of {s['repeats']} interleaved runs of {s['seconds']} s. "
        "*events per router CPU-second* is events/s per fully used core.",
        "",
    ]
    rows = []
    for point in data["points"]:
        for name, t in point["targets"].items():
            rows.append(
                [
                    str(point["concurrency"]),
                    name,
                    _f(t["events_per_s"], 0),
                    _f(t["router_cpu_util"] * 100, 0) + " %",
                    _f(t["router_us_per_event"], 1),
                    _f(t["events_per_cpu_s"], 0),
                    _f(t["router_peak_rss_mb"], 0),
                ]
            )
    out += _table(
        [
            "streams",
            "router",
            "events/s delivered",
            "router CPU",
            "router µs CPU / event",
            "events per router CPU-s",
            "peak RSS MB",
        ],
        rows,
    )
    out += ["", *(f"- {n}" for n in data.get("notes", []))]
    chart = _chart_name(path, "relay-events")
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = list(data["points"][0]["targets"]) if data["points"] else []
    xs = [pt["concurrency"] for pt in data["points"]]
    for name in names:
        left.plot(xs, [pt["targets"][name]["events_per_s"] for pt in data["points"]], "o-")
        right.plot(
            xs, [pt["targets"][name]["events_per_cpu_s"] for pt in data["points"]], "o-", label=name
        )
    left.set_title("SSE events/s delivered (whole machine)")
    right.set_title("events per router CPU-second")
    for ax in (left, right):
        ax.set_xlabel("concurrent streams")
        ax.set_xscale("log")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(chart, dpi=90)
    plt.close(fig)
    return [*out, "", f"![events/s vs concurrency]({chart.relative_to(HERE)})", ""]


def _paced(data: dict[str, Any]) -> list[str]:
    s = data["settings"]
    out = [
        "## 2. Relay cost, token-paced, against the stack's floor",
        "",
        "Simulators write one SSE event per token at a 20 ms inter-token latency (as vLLM "
        "does); *floor* is `benchmarks/floor.py`, the smallest relay hypercorn's trio worker "
        "can serve (one upstream read, at most one ASGI send; PD: prefill POST, read "
        "`kv_transfer_params`, decode POST, relay). Router CPU is the router process's CPU time "
        f"over the window; median of {s['repeats']} interleaved runs of {s['seconds']} s. "
        "*x floor* divides by the floor's figure in the same run. *floor, write at once* (an "
        "experiment, `benchmarks/hypercorn_send.py`) is the same floor on a hypercorn whose send "
        "path skips its lock and checkpoints: what a change to hypercorn would save. "
        "*ours (baseline)*, when present, is the router of another checkout in the same rounds "
        "(`BENCH_BASELINE`; the notes below name it when the run recorded it).",
        "",
    ]
    for mode, title in (("regular", "regular mode, 200-token streams"), ("pd", "PD mode")):
        rows = []
        for point in data.get(mode, []):
            for name, t in point["targets"].items():
                rows.append(
                    [
                        str(point["concurrency"]),
                        name,
                        _f(t["router_us_per_event"], 1),
                        _f(t["cpu_per_event_vs_floor"], 2),
                        _f(t["router_ms_per_request"], 2),
                        _f(t["cpu_per_request_vs_floor"], 2),
                        _f(t["events_per_s"], 0),
                        _f(t["req_per_s"], 1),
                        _f(t["ttft_p50_ms"], 0) + " / " + _f(t["ttft_p99_ms"], 0),
                        _f(t["ttft_p50_vs_floor"], 2),
                        _gaps(t),
                        _f(t["failed"], 0),
                    ]
                )
        if not rows:
            continue
        out += [f"### {title}", ""]
        out += _table(
            [
                "streams",
                "relay",
                "router µs CPU / event",
                "x floor",
                "router ms CPU / request",
                "x floor",
                "events/s",
                "req/s",
                "TTFT p50 / p99 ms",
                "TTFT p50 x floor",
                "event gap p50 / p99 / p99.9 ms",
                "failed",
            ],
            rows,
        )
        out.append("")
    out += [
        "*Event gap*: the time between two reads of a stream that brought events, as the "
        "client saw it (the engine writes one every 20 ms); what a relay adds to a token's "
        "delay shows as the spread around 20 ms. Results saved before the gap was measured "
        "show -.",
        "",
        *(f"- {n}" for n in data.get("notes", [])),
    ]
    return [*out, ""]


def _gaps(t: dict[str, Any]) -> str:
    if "gap_p50_ms" not in t:
        return "-"
    return " / ".join(_f(t[k], 1) for k in ("gap_p50_ms", "gap_p99_ms", "gap_p999_ms"))


def _caps(data: dict[str, Any]) -> list[str]:
    s = data["settings"]
    out = [
        "## 7. Memory caps under hostile clients and a broken upstream",
        "",
        f"{s['clients']} clients each open a stream of {s['tokens']} fast tokens with a 4 KiB"
        f" receive window and never read, for {s['hold_s']:g} s; then 20 HTTP/2 prefaces; then"
        " (trio-pdrouter) an upstream that writes an SSE line that never ends. Default flags.",
        "",
    ]
    rows = []
    for name, t in data["targets"].items():
        nr, h2 = t["non_readers"], t["http2"]
        rows.append(
            [
                name,
                _f(nr["rss_idle_mb"], 0),
                _f(nr["rss_peak_mb"], 0),
                _f(nr["buffered_peak_mb"], 1),
                _f(nr["engines_done_after_s"], 1),
                ", ".join(f"{k} x{v}" for k, v in h2["answers"].items()),
                _f(h2["rss_growth_mb"], 1),
            ]
        )
    out += _table(
        [
            "router",
            "RSS idle MB",
            "RSS peak, 100 non-readers MB",
            "held for clients MB",
            "engines done after s",
            "HTTP/2 preface answered",
            "RSS growth after HTTP/2 MB",
        ],
        rows,
    )
    endless = data["targets"].get("trio-pdrouter", {}).get("endless_line")
    if endless:
        wrote = ", ".join(_f(w, 1) for w in endless["upstream_wrote_mb"])
        out += [
            "",
            f"Endless upstream line: RSS {_f(endless['rss_idle_mb'], 0)} → peak"
            f" {_f(endless['rss_peak_mb'], 0)} MB, router CPU {_f(endless['router_cpu_s'], 2)} s"
            f" for {len(endless['client_tails'])} streams; the upstream wrote {wrote} MB each"
            " before the router hung up.",
            "",
        ]
    return out


def _memory(data: dict[str, Any]) -> list[str]:
    s = data["settings"]
    out = [
        "## 3. Memory",
        "",
        f"{s['streams']} concurrent slow streams (one token every 2 s) held through a fresh "
        f"router; RSS median over a {s['seconds']} s window once every stream has started; "
        f"median of {s['repeats']} runs.",
        "",
    ]
    rows = [
        [
            name,
            _f(t["open_streams"], 0),
            _f(t["rss_idle_mb"], 0),
            _f(t["rss_loaded_mb"], 0),
            _f(t["rss_peak_mb"], 0),
            _f(t["kb_per_stream"], 1),
            _f(t.get("seconds_to_open_all"), 1),
        ]
        for name, t in data["targets"].items()
    ]
    out += _table(
        [
            "router",
            "streams open",
            "RSS idle MB",
            "RSS with streams MB",
            "peak RSS MB",
            "KB per stream",
            "s until all streams started",
        ],
        rows,
    )
    return [*out, *(f"- {n}" for n in data.get("notes", [])), ""]


def _radix(data: dict[str, Any]) -> list[str]:
    out = [
        "## 5. Radix tree",
        "",
        f"`match` + `insert` per request, {data['tenants']} endpoints, budget "
        f"{data['budget']:,} characters each, {data['samples']} samples per point.",
        "",
    ]
    rows = [
        [
            str(r["prompt_bytes"]),
            f"{r['fill']:.0%}",
            f"{r['tree_chars']:,}",
            _f(r["new_mean_us"]),
            _f(r["new_p99_us"]),
            _f(r["repeat_mean_us"]),
            _f(r["repeat_p99_us"]),
            "" if r["evict_ms"] is None else _f(r["evict_ms"]),
            "" if r.get("evict_slices") is None else str(r["evict_slices"]),
            "" if r.get("evict_slice_max_ms") is None else _f(r["evict_slice_max_ms"]),
        ]
        for r in data["rows"]
    ]
    out += _table(
        [
            "prompt bytes",
            "fill",
            "tree chars",
            "new µs mean",
            "new µs p99",
            "repeat µs mean",
            "repeat µs p99",
            "evict 10 % ms (all slices)",
            "slices",
            "longest slice ms (event-loop stall)",
        ],
        rows,
    )
    return [*out, ""]


def _cluster(data: dict[str, Any]) -> list[str]:
    e = data["error"]
    out = [
        "## 6. Cluster view across replicas",
        "",
        "One sync round trip (publish own snapshot, read 3 peers') to a local redis-server:",
        "",
    ]
    out += _table(
        ["client", "wall µs", "CPU µs", "CPU ms per s at --cluster-sync-ms 50"],
        [
            [name, _f(r["wall_us"]), _f(r["cpu_us"]), _f(r["cpu_ms_per_s_at_50ms"], 2)]
            for name, r in data["exchange"].items()
        ],
    )
    out += [
        "",
        f"Peers' counts added to one routing choice (8 candidates, 3 peers): "
        f"{_f(data['choice']['add_to_us'], 2)} µs.",
        "",
        f"Two replicas (sync 50 ms), {e['streams']} token-paced streams ({e['tokens']} tokens at"
        f" {_f(e['itl_ms'], 0)} ms) through both, {e['samples']} samples of replica 1's view"
        f" every 100 ms; error = |view - engine running+waiting| of the worst decode endpoint"
        f" ({_f(e['req_per_s'])} req/s, {e['failed']} failed):",
        "",
    ]
    out += _table(
        ["view", "error p50", "error p99"],
        [
            ["cluster (own + peers)", _f(e["cluster_p50"], 0), _f(e["cluster_p99"], 0)],
            *(
                [["cluster, visible part", _f(e["visible_p50"], 0), _f(e["visible_p99"], 0)]]
                if "visible_p50" in e  # results from before the visible counts were published
                else []
            ),
            ["own counts only", _f(e["own_only_p50"], 0), _f(e["own_only_p99"], 0)],
        ],
    )
    return [*out, ""]


def _workers(data: dict[str, Any]) -> list[str]:
    lines = [
        "## 7. Workers: `--workers 1` vs `--workers 2`",
        "",
        "| load | target | per s | router CPU (cores) | router µs per unit | spread | failed |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for load, block in data["loads"].items():
        unit = f"{load} (C={block['concurrency']}, per {block['unit']})"
        for name, row in block["targets"].items():
            lines.append(
                f"| {unit} | {name} | {row['per_s']:.0f} | {row['router_cpu_util']:.2f} "
                f"| {row['router_us_per_unit']:.0f} | {row['spread']:.2f} | {row['failed']:.0f} |"
            )
    lines += [
        "",
        "spread: the busiest worker's CPU over the idlest's during a run (1.00 = even).",
        "",
    ]
    return lines


def _mixed(data: dict[str, Any]) -> list[str]:
    """Scenario 8: token-weighted load, mixed prompt lengths (see benchmarks/mixed.py)."""
    out = ["## 8. Token-weighted load: mixed prompt lengths", ""]
    for workload, rows in data["workloads"].items():
        out += [f"**{workload}**", ""]
        out += [
            "| router | req/s | TTFT p50 ms | TTFT p99 ms | prefix hits | failed |",
            "|---|---|---|---|---|---|",
        ]
        for label, row in rows.items():
            hits = row.get("prefix_hit_rate")  # absent from results before 2026-12-03
            out.append(
                f"| {label} | {row['req_per_s']:.1f} | {row['ttft_p50_ms']:.0f} |"
                f" {row['ttft_p99_ms']:.0f} | {'-' if hits is None else f'{hits:.1%}'} |"
                f" {row['failed']:.0f} |"
            )
        out.append("")
    return out


def _setup(row: dict[str, Any]) -> str:
    if row["replicas"] > 1:
        return f"{row['replicas']} replicas"
    return "one router" if row["workers"] == 1 else f"--workers {row['workers']}"


def _kv_rows(rows: list[dict[str, Any]], label: str) -> list[list[str]]:
    """One table row per (router, policy, setup, ``label`` field if any): the medians of its
    runs."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        name = f"{'ours' if row['router'] == 'ours' else 'vllm-router'} {row['policy']}"
        groups.setdefault((name, _setup(row), str(row.get(label, ""))), []).append(row)

    def mid(runs: list[dict[str, Any]], field: str) -> float | None:
        values = [r[field] for r in runs if r.get(field) is not None]
        return statistics.median(values) if values else None

    out = []
    for (name, setup, extra), runs in groups.items():
        hits = mid(runs, "hit_rate")
        out.append(
            [
                name,
                setup,
                *([extra] if label else []),
                str(len(runs)),
                "n/a" if hits is None else f"{hits:.1%}",
                _f(mid(runs, "ttfb_p50_ms"), 0),
                _f(mid(runs, "ttfb_p99_ms"), 0),
                _f(mid(runs, "req_per_s")),
                _f(mid(runs, "router_cpu_ms_per_req"), 2),
                str(sum(r["failed"] for r in runs)),
            ]
        )
    return out


def _kv_aware(data: dict[str, Any]) -> list[str]:
    """Section 9: PD under prefill cache pressure, ``kv_aware`` against ``cache_aware`` and
    vllm-router (see benchmarks/kv_aware.py); each part the file holds."""
    out = [
        "## 9. kv_aware: PD under prefill cache pressure",
        "",
        "2 prefill simulators (one prompt at a time, each caching about 6 of 32 prefix groups)"
        " publishing vLLM's KV events, 1 decode simulator (one SSE event per token, 20 ms"
        " apart), 64 closed-loop clients; hit rate is the simulators' own (cached / prompt"
        " tokens). Rows are medians over runs; router CPU is per request (one router only).",
        "",
    ]
    header = ["router / policy", "setup", "runs", "prefill hits", "TTFT p50 ms", "TTFT p99 ms",
              "req/s", "router CPU ms / req", "failed"]  # fmt: skip
    goals = judge(data)
    if goals:
        out += ["**Goals** (see benchmarks/kv_goals.py for how each is read)", ""]
        verdicts = [
            [g["setup"], g["measure"], g["goal"], g["figure"], "met" if g["met"] else "MISSED",
             g["source"]]
            for g in goals
        ]  # fmt: skip
        out += _table(["setup", "measure", "goal", "this run", "", "from"], verdicts)
        out.append("")
    if data.get("configs"):
        out += _table(header, _kv_rows(data["configs"], ""))
        out.append("")
    for row in data.get("restart", []):
        out.append(
            f"- Router restarted in front of warm engines, {row['policy']}: hit rate over its"
            f" first 100 requests {row['hit_rate_first_100']:.1%}."
        )
    idle = data.get("idle")
    if idle:
        out.append(
            "- Idle: the index's block counts equal the simulators', engine by engine:"
            f" {'yes' if idle['equal'] else 'no'} (index / simulator: {idle_counts(idle)})."
        )
    if data.get("tokenizer"):
        out += ["", "**Tokens per request**: engine `/tokenize` against a local tokenizer", ""]
        labelled = [
            dict(r, tokens=f"{r['tokens']}, {r['clients']} client{'s' * (r['clients'] != 1)}")
            for r in data["tokenizer"]
        ]
        out += _table([*header[:2], "tokens", *header[2:]], _kv_rows(labelled, "tokens"))
    rounds = data.get("rounds")
    if rounds:
        out += [
            "",
            "**Rounds**: each variant paired with `cache_aware` in the same round (TTFT p99"
            " ratio: median of the pairs, and of all paired requests pooled with its 90 %"
            " interval over resampled rounds)",
            "",
        ]
        rows: list[list[str]] = []
        for p in rounds["pairs"]:
            pooled = p.get("pooled_p99_ratio")
            band = p.get("pooled_p99_ratio_90")
            rows.append(
                [
                    p["variant"],
                    _setup(p),
                    str(p["rounds"]),
                    f"{p['hit_rate']:.1%}",
                    f"{p['hit_diff_points_median']:+.1f}",
                    _f(p["p99_ratio_median"], 2),
                    f"{p['pairs_under_1']} of {p['rounds']}",
                    "n/a" if pooled is None else _f(pooled, 2),
                    "n/a" if not band else f"{band[0]:.2f}-{band[1]:.2f}",
                ]
            )
        columns = ["variant", "setup", "rounds", "hits", "hits vs ref (points)", "p99 ratio",
                   "pairs under 1", "pooled p99 ratio", "90 %"]  # fmt: skip
        out += _table(columns, rows)
    return [*out, ""]


def _kv_ownership(data: dict[str, Any]) -> list[str]:
    s = data["settings"]
    out = [
        "## 10. Prefill KV ownership when clients leave",
        "",
        "A prefill and a decode simulator (4 DP ranks each) whose NIXL stand-in frees a"
        " prefill's blocks when a decode that received them is aborted before reading them, and"
        " counts a read of blocks already pulled or freed (a second pull). Routers: the seed"
        f" command line, {s['concurrency']} clients at a time, {s['runs']} runs per router;"
        " each cell lists the runs. *leave-early*: 400 streams, KV read 80 ms, half the clients"
        " leave 20-170 ms after sending. *churn*: 500 streams, 40 % leave at random, 5 % of"
        " decode streams reset.",
        "",
    ]
    rows = []
    for name, shape in data["shapes"].items():
        for router, runs in shape["routers"].items():

            def cells(key: str, runs: list[dict[str, Any]] = runs) -> str:
                return " ".join(
                    "-" if r[key] is None else _f(r[key], 2 if "per" in key else 0) for r in runs
                )

            rows.append(
                [
                    name,
                    router,
                    cells("second_pulls"),
                    cells("stranded"),
                    cells("aborts_per_leaver"),
                    cells("ends_per_leaver"),
                    cells("left") + " (" + cells("left_after_reaching_an_engine") + ")",
                    cells("ledger_after"),
                ]
            )
    out += _table(
        [
            "scenario",
            "router",
            "second pulls",
            "stranded",
            "aborts per client that left",
            "aborts and reclaims per client that left",
            "clients that left (after reaching an engine)",
            "ledger after",
        ],
        rows,
    )
    return [*out, ""]


def _admission(data: dict[str, Any]) -> list[str]:
    """Scenario 12: priority and tenants' shares under overload (benchmarks/admission.py)."""
    pr = data["priority"]
    out = [
        "## 12. Admission under overload: priority and tenants",
        "",
        f"{data['slots']} slots (`--max-concurrent-requests`, summed over workers or replicas)"
        " for every client below, token-paced 25-token streams.",
        "",
        "| priority (48 clients, an eighth at -10) | done | TTFB p99 ms |",
        "|---|---:|---:|",
        f"| priority -10 | {pr['urgent_done']} | {_f(pr['urgent_ttfb_p99_ms'], 0)} |",
        f"| the rest | {pr['rest_done']} | {_f(pr['rest_ttfb_p99_ms'], 0)} |",
        "",
        f"TTFB p99 of priority -10 over the rest's: **{_f(pr['ratio'], 2)}** (goal ≤ 0.3);"
        f" failed {pr['failed']}.",
        "",
        f"Two tenants of equal weight, heavy with {data['heavy_clients']} clients, light with"
        f" {data['light_clients']}:",
        "",
        "| setup | light's share of completions | share error | light TTFB p99 ms |"
        " heavy TTFB p99 ms | light / heavy p99 | failed |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, row in data["tenants"].items():
        out.append(
            f"| {label} | {_f(row['light_share'], 3)} | {_f(row['share_error'], 3)} |"
            f" {_f(row['light_ttfb_p99_ms'], 0)} | {_f(row['heavy_ttfb_p99_ms'], 0)} |"
            f" {_f(row['ttfb_ratio'], 2)} | {row['failed']} |"
        )
    out += [
        "",
        "Goals: light's share ≥ 0.4 and its TTFB p99 ≤ 0.35 x heavy's; one FIFO gives it its"
        " head count's share (4/44 ≈ 0.09). Share error: |share - 0.5|.",
        "",
    ]
    return out


def write_report(command: str) -> Path:
    """Regenerate ``report.md`` and the charts from the newest results of each scenario."""
    parts: list[str] = [
        "# Benchmarks",
        "",
        f"Produced by `{command}` (newest result file of each scenario). Machine: "
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}. "
        "Routers, simulators and load generators all run on this machine as separate "
        "processes, so on few cores they compete for CPU: compare rows with each other, not "
        "with a real cluster.",
        "",
    ]
    sources: list[str] = []
    for scenario in SCENARIOS:
        found = latest(scenario)
        if found is None:
            continue
        path, data = found
        sources.append(f"`{path.relative_to(HERE)}` ({data.get('profile', '?')})")
        if scenario == "routing":
            parts += _routing(path, data)
        elif scenario == "overhead":
            parts += _overhead(path, data)
        elif scenario == "tracing":
            parts += _tracing(data)
        elif scenario == "paced":
            parts += _paced(data)
        elif scenario == "relay":
            parts += _relay(path, data)
        elif scenario == "memory":
            parts += _memory(data)
        elif scenario == "cluster":
            parts += _cluster(data)
        elif scenario == "workers":
            parts += _workers(data)
        elif scenario == "caps":
            parts += _caps(data)
        elif scenario == "mixed":
            parts += _mixed(data)
        elif scenario == "kv_aware":
            parts += _kv_aware(data)
        elif scenario == "kv_ownership":
            parts += _kv_ownership(data)
        elif scenario == "admission":
            parts += _admission(data)
        else:
            parts += _radix(data)
    parts += ["Sources: " + ", ".join(sources), ""]
    REPORT.write_text("\n".join(parts))
    return REPORT
