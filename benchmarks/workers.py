"""Scenario 6, workers: what ``--workers 2`` buys over one process, and how evenly it spreads.

Two loads, each against trio-pdrouter with ``--workers 1``, ``--workers 2`` (one shared
listening socket) and ``--workers 2 --worker-sockets reuseport``, taking turns:

* relay: regular mode over zero-latency simulators (``--fast``), 256-token streams, round_robin
  (events/s, router CPU per event summed over the supervisor and its workers);
* PD: 16-token non-streaming requests through a prefill and a decode simulator (requests/s,
  router CPU per request).

"spread" is the busiest worker's CPU over the idlest's during the run (1.0 = perfectly even):
how evenly the kernel hands connections to the workers. Everything shares this machine's cores
with the simulators and load generators, so throughput is bounded by the whole set; CPU per
event is the figure that travels.
"""

from __future__ import annotations

import contextlib
from typing import Any

import psutil  # type: ignore[import-untyped]

from .common import Context, median, run_load
from .procs import ProcessSet, Service, start_router, start_sim

PROFILES: dict[str, dict[str, Any]] = {
    "quick": {"warmup": 1.0, "seconds": 4.0, "repeats": 2, "relay_c": 200, "pd_c": 64},
    "full": {"warmup": 2.0, "seconds": 10.0, "repeats": 3, "relay_c": 500, "pd_c": 128},
}
TARGETS = {
    "--workers 1": [],
    "--workers 2 (shared socket)": ["--workers", "2"],
    "--workers 2 (reuseport)": ["--workers", "2", "--worker-sockets", "reuseport"],
}
RELAY_LOAD = ["--stream", "--max-tokens", "256", "--suffix-chars", "64", "--ramp", "0.02"]
PD_LOAD = ["--max-tokens", "16", "--suffix-chars", "64"]


def estimate(profile: str) -> float:
    p = PROFILES[profile]
    return float(2 * len(TARGETS) * p["repeats"] * (p["warmup"] + p["seconds"] + 2) + 30)


def _worker_cpu(router: Service) -> dict[int, float]:
    out: dict[int, float] = {}
    with contextlib.suppress(psutil.Error):
        for child in router.ps.children(recursive=False):
            with contextlib.suppress(psutil.Error):
                if "trio_pdrouter.workers.worker" not in child.cmdline():
                    continue  # the supervisor's multiprocessing resource tracker
                t = child.cpu_times()
                out[child.pid] = t.user + t.system
    return out


def _spread(before: dict[int, float], after: dict[int, float]) -> float:
    used = [after[pid] - before.get(pid, 0.0) for pid in after]
    if len(used) < 2 or min(used) <= 0:
        return 1.0
    return max(used) / min(used)


def run(ctx: Context) -> dict[str, Any]:
    p = PROFILES[ctx.profile]
    result: dict[str, Any] = {
        "scenario": "workers",
        "profile": ctx.profile,
        "settings": {**p, "relay_load": RELAY_LOAD, "pd_load": PD_LOAD},
        "notes": [],
        "loads": {},
    }
    procs = ProcessSet(ctx.log_dir / "workers")
    try:
        ctx.progress.phase("starting simulators and routers")
        sims = [start_sim(procs, f"sim-{i}", "--role", "both", "--fast") for i in range(3)]
        prefill = start_sim(procs, "sim-prefill", "--role", "prefill", "--fast")
        decode = start_sim(procs, "sim-decode", "--role", "decode", "--fast")
        setups = {
            "relay": (
                ["--worker-urls", *(s.url for s in sims), "--policy", "round_robin"],
                RELAY_LOAD,
                p["relay_c"],
            ),
            "pd": (
                ["--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url],
                PD_LOAD,
                p["pd_c"],
            ),
        }
        for load, (upstreams, flags, concurrency) in setups.items():
            routers = {
                name: start_router(procs, f"{load}-{i}", "ours", [*upstreams, *extra])
                for i, (name, extra) in enumerate(TARGETS.items())
            }
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in routers}
            window = ["--warmup", str(p["warmup"]), "--seconds", str(p["seconds"])]
            for rep in range(p["repeats"]):
                for name, router in routers.items():
                    ctx.progress.phase(f"{load}: {name}, round {rep + 1}/{p['repeats']}")
                    before = _worker_cpu(router)
                    raw = run_load(
                        ctx,
                        procs,
                        f"load-{load}-{rep}-{len(runs[name])}-{name[10]}",
                        router.url,
                        [*flags, *window],
                        concurrency=concurrency,
                        router=router,
                        seconds=p["warmup"] + p["seconds"],
                        processes=2,
                    )
                    cpu = raw.get("router_cpu_s", float("nan"))
                    unit = raw["events"] if load == "relay" else raw["ok"]
                    runs[name].append(
                        {
                            "per_s": unit / raw["window_s"],
                            "router_cpu_util": cpu / raw["window_s"],
                            "router_us_per_unit": cpu / max(1, unit) * 1e6,
                            "failed": float(raw["failed"]),
                            "spread": _spread(before, _worker_cpu(router)),
                        }
                    )
            result["loads"][load] = {
                "unit": "event" if load == "relay" else "request",
                "concurrency": concurrency,
                "targets": {
                    name: {**{k: median([r[k] for r in reps]) for k in reps[0]}, "runs": reps}
                    for name, reps in runs.items()
                },
            }
    finally:
        procs.close()
    return result
