"""Scenario 2b, relay capacity, coalesced: how many SSE events a router passes on, and at what
CPU cost, when events arrive faster than they can be relayed one by one.

Not what users see (that is :mod:`benchmarks.paced`, token-paced against the floor):
zero-latency simulators (``--fast``, tokens as fast as they can) behind a router in regular
mode with round_robin; 256-token streams from closed loops of clients in two load generator
processes. One simulator process tops out near 6,000 events/s (hypercorn spends ~165 µs per body
send), so the streams are spread over several simulator processes. Targets: trio-pdrouter with
its own h11 transport, trio-pdrouter with ``--upstream-transport httpx`` (httpx's stock pool),
and vllm-router, each as one process (``--workers 1``); the worker-count comparison is the
workers scenario (``benchmarks/workers.py``).

Everything shares the machine's cores, so events/s is bounded by the whole set of processes;
the router's CPU per event (and events per router CPU-second) is the figure that travels.
``BENCH_BASELINE=DIR`` adds an "ours (baseline)" target from another checkout, taking turns with
the others in each round (as in :mod:`benchmarks.paced`); ``BENCH_RELAY_REPEATS=N`` sets the
rounds.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .common import Context, median, run_load
from .procs import ProcessSet, Service, start_router, start_sim

PROFILES: dict[str, dict[str, Any]] = {
    "quick": {
        "warmup": 1.0,
        "seconds": 3.0,
        "repeats": 2,
        "concurrency": [50, 500],
        "sims": 3,
    },
    "full": {
        "warmup": 2.0,
        "seconds": 10.0,
        "repeats": 3,
        "concurrency": [25, 100, 250, 500, 1000],
        "sims": 4,
    },
}
HEADLINE_CONCURRENCY = 500
LOAD_FLAGS = ["--stream", "--max-tokens", "256", "--suffix-chars", "64", "--ramp", "0.02"]


def estimate(profile: str) -> float:
    p = PROFILES[profile]
    runs = 3 * p["repeats"] * len(p["concurrency"])
    return float(runs * (p["warmup"] + p["seconds"] + 1.5) + 10)


def run(ctx: Context) -> dict[str, Any]:
    p = dict(PROFILES[ctx.profile])
    p["repeats"] = int(os.environ.get("BENCH_RELAY_REPEATS", p["repeats"]))
    result: dict[str, Any] = {
        "scenario": "relay",
        "profile": ctx.profile,
        "settings": {**p, "load": LOAD_FLAGS, "sim": "--fast --max-num-seqs 4096"},
        "notes": [
            "trio-pdrouter runs as one process here (--workers 1); see the workers scenario.",
            f"{p['sims']} simulator processes share the streams (one tops out near 6k events/s).",
        ],
        "points": [],
    }
    procs = ProcessSet(ctx.log_dir / "relay")
    try:
        ctx.progress.phase("starting simulators and routers")
        sims = [
            start_sim(procs, f"sim-{i}", "--role", "both", "--fast", "--max-num-seqs", "4096")
            for i in range(p["sims"])
        ]
        workers = ["--worker-urls", *(s.url for s in sims), "--policy", "round_robin"]
        targets: dict[str, Service] = {
            "ours (h11 transport)": start_router(procs, "ours-h11", "ours", workers),
            "ours (httpx transport)": start_router(
                procs, "ours-httpx", "ours", [*workers, "--upstream-transport", "httpx"]
            ),
        }
        baseline = os.environ.get("BENCH_BASELINE")
        if baseline:
            targets["ours (baseline)"] = start_router(
                procs, "baseline-h11", "ours", workers, cwd=Path(baseline)
            )
        if ctx.vllm_router:
            targets["vllm-router"] = start_router(procs, "vllm", "vllm", workers)
        else:
            result["notes"].append(ctx.note_vllm_missing())
        total = len(targets) * p["repeats"] * len(p["concurrency"])
        done = 0
        for concurrency in p["concurrency"]:
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
            flags = [*LOAD_FLAGS, "--warmup", str(p["warmup"]), "--seconds", str(p["seconds"])]
            for rep in range(p["repeats"]):
                for name, router in targets.items():
                    done += 1
                    ctx.progress.phase(
                        f"C={concurrency}: {name}, round {rep + 1}/{p['repeats']} "
                        f"(run {done}/{total})"
                    )
                    raw = run_load(
                        ctx,
                        procs,
                        f"load-{done}",
                        router.url,
                        flags,
                        concurrency=concurrency,
                        router=router,
                        seconds=p["warmup"] + p["seconds"],
                        processes=2 if concurrency >= 100 else 1,
                    )
                    cpu = raw.get("router_cpu_s", float("nan"))
                    events = max(1, raw["events"])
                    runs[name].append(
                        {
                            "events_per_s": raw["events"] / raw["window_s"],
                            "router_cpu_util": cpu / raw["window_s"],
                            "router_us_per_event": cpu / events * 1e6,
                            "events_per_cpu_s": events / cpu if cpu else float("nan"),
                            "streams_per_s": raw["ok"] / raw["window_s"],
                            "failed": float(raw["failed"]),
                            "router_peak_rss_mb": raw["router_peak_rss"] / 2**20,
                        }
                    )
            point: dict[str, Any] = {"concurrency": concurrency, "targets": {}}
            for name, reps in runs.items():
                row: dict[str, Any] = {k: median([r[k] for r in reps]) for k in reps[0]}
                row["runs"] = reps
                point["targets"][name] = row
            result["points"].append(point)
    finally:
        procs.close()
    return result
