"""Scenario 1, overhead: what a router adds to a request, next to talking to the engine directly.

Zero-latency simulators (``--fast``), 16-token requests with short prompts, closed loops of 1 and
64 clients, streaming and not. Targets: the simulator directly; trio-pdrouter in regular mode
(one ``both`` simulator) and in PD mode (a prefill and a decode simulator); vllm-router in the
same two modes. Every router runs with its default policy (cache_aware) and ``--log-level
warning``. The targets take turns (A B C D E A B C D E ...); "added" latency is each router run
minus the direct run of the same round, then the median over rounds.

PD mode does more work by design (a prefill leg, then the decode leg, whose simulator pulls the
KV cache from the prefill simulator), so its added latency is not only the router's: compare PD
rows between routers.
"""

from __future__ import annotations

from typing import Any

from .common import Context, cdf_points, latency_summary, median, run_load
from .procs import ProcessSet, Service, start_router, start_sim

PROFILES: dict[str, dict[str, Any]] = {
    "quick": {"warmup": 0.5, "seconds": 2.5, "repeats": 2},
    "full": {"warmup": 2.0, "seconds": 10.0, "repeats": 5},
}
CELLS = [(1, False), (1, True), (64, False), (64, True)]
TARGETS = ["direct", "ours regular", "ours PD", "vllm-router regular", "vllm-router PD"]
LOAD_FLAGS = ["--max-tokens", "16", "--suffix-chars", "64"]


def estimate(profile: str) -> float:
    p = PROFILES[profile]
    runs = len(CELLS) * len(TARGETS) * p["repeats"]
    return float(runs * (p["warmup"] + p["seconds"] + 0.8) + 15)


def run(ctx: Context) -> dict[str, Any]:
    p = PROFILES[ctx.profile]
    result: dict[str, Any] = {
        "scenario": "overhead",
        "profile": ctx.profile,
        "settings": {**p, "load": LOAD_FLAGS, "sim": "--fast"},
        "notes": [],
        "cells": [],
    }
    procs = ProcessSet(ctx.log_dir / "overhead")
    try:
        ctx.progress.phase("starting simulators and routers")
        both = start_sim(procs, "sim-both", "--role", "both", "--fast")
        prefill = start_sim(procs, "sim-prefill", "--role", "prefill", "--fast")
        decode = start_sim(procs, "sim-decode", "--role", "decode", "--fast")
        regular = ["--worker-urls", both.url]
        pd = ["--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url]
        targets: dict[str, Service | None] = {"direct": None}
        targets["ours regular"] = start_router(procs, "ours-regular", "ours", regular)
        targets["ours PD"] = start_router(procs, "ours-pd", "ours", pd)
        if ctx.vllm_router:
            targets["vllm-router regular"] = start_router(procs, "vllm-regular", "vllm", regular)
            targets["vllm-router PD"] = start_router(procs, "vllm-pd", "vllm", pd)
        else:
            result["notes"].append(ctx.note_vllm_missing())
        total_runs = len(CELLS) * len(targets) * p["repeats"]
        done = 0
        for concurrency, stream in CELLS:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
            ttfbs: dict[str, list[float]] = {name: [] for name in targets}
            flags = [*LOAD_FLAGS, "--warmup", str(p["warmup"]), "--seconds", str(p["seconds"])]
            if stream:
                flags.append("--stream")
            for rep in range(p["repeats"]):
                for name, router in targets.items():
                    done += 1
                    ctx.progress.phase(
                        f"C={concurrency} {'stream' if stream else 'no stream'}: {name}, "
                        f"round {rep + 1}/{p['repeats']} (run {done}/{total_runs})"
                    )
                    url = both.url if router is None else router.url
                    raw = run_load(
                        ctx,
                        procs,
                        f"load-{name.replace(' ', '-')}",
                        url,
                        flags,
                        concurrency=concurrency,
                        router=router,
                        seconds=p["warmup"] + p["seconds"],
                    )
                    row = latency_summary(raw)
                    if router is not None:
                        cpu = raw.get("router_cpu_s", float("nan"))
                        row["router_cpu_s_per_1000"] = cpu / max(1, raw["ok"]) * 1000
                        row["router_cpu_util"] = cpu / raw["window_s"]
                        row["router_peak_rss_mb"] = raw["router_peak_rss"] / 2**20
                    runs[name].append(row)
                    ttfbs[name] += raw["ttfb"]
            result["cells"].append(_summarise(concurrency, stream, runs, ttfbs))
    finally:
        procs.close()
    return result


def _summarise(
    concurrency: int,
    stream: bool,
    runs: dict[str, list[dict[str, Any]]],
    ttfbs: dict[str, list[float]],
) -> dict[str, Any]:
    direct = runs["direct"]
    rows: dict[str, dict[str, Any]] = {}
    for name, reps in runs.items():
        row: dict[str, Any] = {"runs": reps}
        for key in reps[0]:
            row[key] = median([r[key] for r in reps])
        if name != "direct":
            for metric in ("ttfb_p50_ms", "ttfb_p99_ms", "total_p50_ms", "total_p99_ms"):
                row[f"added_{metric}"] = median(
                    [r[metric] - d[metric] for r, d in zip(reps, direct, strict=True)]
                )
        row["ttfb_cdf_ms"] = cdf_points(ttfbs[name])
        rows[name] = row
    return {"concurrency": concurrency, "stream": stream, "targets": rows}
