"""Scenario 3, memory: a router's resident memory while it holds many slow streams open.

Two simulators emit one token every 2 s per stream (no queueing: 4,096 slots each); clients in
two load generator processes each open one stream and keep reading it. Each run starts a fresh
router (regular mode, round_robin), reads its RSS idle, then while every stream is open (checked
against the simulators' ``running`` count). Targets take turns: trio-pdrouter, vllm-router.
"""

from __future__ import annotations

import statistics
from typing import Any

import httpx

from .common import Context, median, run_load
from .procs import ProcessSet, Service, start_router, start_sim, wait_sims_idle

PROFILES: dict[str, dict[str, Any]] = {
    # warmup: the most time allowed for every stream to start (the window opens when they have).
    # The quick profile holds 1,000 streams (opening 2,000 takes ~30 s on 2 cores).
    "quick": {"streams": 1000, "warmup": 30.0, "seconds": 3.0, "repeats": 2},
    "full": {"streams": 2000, "warmup": 60.0, "seconds": 10.0, "repeats": 3},
}
SLOW_SIM = [
    "--role", "both", "--itl-base-s", "2.0", "--itl-per-running-s", "0",
    "--prefill-base-s", "0", "--prefill-per-token-s", "0", "--max-num-seqs", "4096",
]  # fmt: skip
LOAD_FLAGS = ["--hold", "--stream", "--max-tokens", "20000", "--ramp", "0.05", "--timeout", "600"]


def estimate(profile: str) -> float:
    p = PROFILES[profile]
    return float(2 * p["repeats"] * (p["streams"] / 100 + p["seconds"] + 4.0) + 5)


class RssWatch:
    def __init__(self, router: Service, sims: list[Service]) -> None:
        self.router = router
        self.sims = sims
        self.client = httpx.Client(timeout=5.0)
        self.rss: list[int] = []
        self.open_streams: list[int] = []

    def tick(self, measuring: bool) -> None:
        if not measuring:
            return
        self.rss.append(self.router.rss())
        running = 0
        for sim in self.sims:
            running += int(self.client.get(sim.url + "/sim/stats").json()["totals"]["running"])
        self.open_streams.append(running)


def run(ctx: Context) -> dict[str, Any]:
    p = PROFILES[ctx.profile]
    result: dict[str, Any] = {
        "scenario": "memory",
        "profile": ctx.profile,
        "settings": {**p, "sim": SLOW_SIM, "load": LOAD_FLAGS},
        "notes": [],
        "targets": {},
    }
    kinds = ctx.router_kinds(result["notes"])
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, _ in kinds}
    procs = ProcessSet(ctx.log_dir / "memory")
    try:
        ctx.progress.phase("starting simulators")
        sims = [start_sim(procs, f"sim-{i}", *SLOW_SIM) for i in range(2)]
        workers = ["--worker-urls", *(s.url for s in sims), "--policy", "round_robin"]
        done = 0
        for rep in range(p["repeats"]):
            for label, kind in kinds:
                done += 1
                ctx.progress.phase(
                    f"{p['streams']} streams through {label}, round {rep + 1}/{p['repeats']}"
                )
                with httpx.Client(timeout=5.0) as client:
                    wait_sims_idle(client, sims)
                router = start_router(procs, f"router-{done}", kind, workers)
                try:
                    idle = router.rss()
                    watch = RssWatch(router, sims)
                    raw = run_load(
                        ctx,
                        procs,
                        f"load-{done}",
                        router.url,
                        [*LOAD_FLAGS, "--warmup", str(p["warmup"]), "--seconds", str(p["seconds"])],
                        concurrency=p["streams"],
                        router=router,
                        seconds=p["warmup"] + p["seconds"],
                        processes=2,
                        tick=watch.tick,
                    )
                    watch.client.close()
                    peak = router.peak_rss()
                finally:
                    procs.stop(router)
                opened = raw["window_start_s"]
                loaded = statistics.median(watch.rss) if watch.rss else float("nan")
                streams = min(watch.open_streams) if watch.open_streams else 0
                runs[label].append(
                    {
                        "rss_idle_mb": idle / 2**20,
                        "rss_loaded_mb": loaded / 2**20,
                        "rss_peak_mb": peak / 2**20,
                        "open_streams": float(streams),
                        "seconds_to_open_all": opened,
                        "kb_per_stream": (loaded - idle) / max(1, streams) / 1024,
                    }
                )
    finally:
        procs.close()
    for label, reps in runs.items():
        row: dict[str, Any] = {k: median([r[k] for r in reps]) for k in reps[0]}
        row["runs"] = reps
        result["targets"][label] = row
    return result
