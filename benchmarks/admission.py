"""Scenario 12, admission under overload: priority, and fair share between tenants.

One simulator (token-paced: one SSE event per token every 20 ms, 25-token streams, about half a
second each) behind trio-pdrouter with ``--max-concurrent-requests`` far below the offered load
(4 slots for 44-48 closed-loop clients), so nearly every request waits in the admission queue.

* ``priority``: 48 clients, an eighth of the requests with vLLM's ``priority: -10``. Figure:
  their time to first byte at the p99 over the rest's (goal: at most 0.3).
* ``tenants``: two tenants of equal weight (``--tenants-file``, one API key each), ``heavy``
  with 40 clients and ``light`` with 4. Each has more clients than its fair half of the slots,
  so both have requests queued all through the window. Figures: the light tenant's share of the
  completions in the window (goal: at least 0.4; equal weights mean 0.5) and its TTFB p99 over
  the heavy tenant's (goal: at most 0.35). Run as:

  - ``one FIFO``: the same load without a tenants file (every request the default tenant's):
    the light clients get their head count's share, 4/44;
  - ``fair share``: one process;
  - ``fair share, --workers 2``: two workers with 2 slots each (4 in all);
  - ``fair share, 2 replicas``: two router processes on one Redis (``--cluster-url``, sync
    50 ms), 2 slots each, every tenant's clients split evenly between them.

  "share error" is ``|share - 0.5|``: how far the light tenant is from its weight's share.

Completions are counted by when they ended, over the window all load generators measured
together (each generator logs every request's times on the system's monotonic clock).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .cluster import _start_redis
from .common import Context, percentile
from .procs import LoadRun, ProcessSet, Service, start_router, start_sim

PROFILES: dict[str, dict[str, float]] = {
    "quick": {"warmup": 4.0, "seconds": 12.0},
    "full": {"warmup": 5.0, "seconds": 40.0},
}
SLOTS = 4
HEAVY, LIGHT = 40, 4
PRIORITY_CLIENTS = 48
SIM_FLAGS = ["--max-num-seqs", "4096", "--itl-base-s", "0.02", "--itl-per-running-s", "0"]
SIM_FLAGS += ["--prefill-base-s", "0.01", "--prefill-per-token-s", "0", "--log-level", "warning"]
LOAD = ["--stream", "--max-tokens", "25", "--suffix-chars", "64", "--log-requests"]
ROUTER = ["--queue-size", "1000", "--queue-timeout-secs", "120", "--policy", "round_robin"]
TENANTS = """
[tenants.heavy]
keys = ["sk-heavy"]

[tenants.light]
keys = ["sk-light"]
"""


def estimate(profile: str) -> float:
    p = PROFILES[profile]
    return 5 * (p["warmup"] + p["seconds"] + 8.0) + 10


def _load(
    procs: ProcessSet, name: str, url: str, clients: int, p: dict[str, float], *extra: str
) -> LoadRun:
    flags = ["--url", url, *LOAD, "--warmup", str(p["warmup"]), "--seconds", str(p["seconds"])]
    return LoadRun(procs, name, [*flags, *extra], concurrency=clients, watch=None)


def _window(results: list[dict[str, Any]]) -> tuple[float, float]:
    """The time every generator was measuring."""
    starts = [r["window"][0] for r in results if r["window"][0] is not None]
    ends = [r["window"][1] for r in results if r["window"][1] is not None]
    if not starts or not ends:
        raise RuntimeError("a load generator reported no measuring window")
    return max(starts), min(ends)


def _done(requests: list[list[Any]], window: tuple[float, float]) -> list[list[Any]]:
    """The requests answered 200 that ended within ``window``."""
    return [r for r in requests if r[4] == 200 and window[0] <= r[3] <= window[1]]


def _ttfb_p99_ms(requests: list[list[Any]]) -> float:
    return percentile([r[2] - r[1] for r in requests if r[2] is not None], 0.99) * 1e3


def _failed(results: list[dict[str, Any]]) -> int:
    return sum(int(r["failed"]) for r in results)


def _priority(ctx: Context, procs: ProcessSet, sim: Service, p: dict[str, float]) -> dict[str, Any]:
    ctx.progress.phase("priority: an eighth at priority -10")
    flags = ["--worker-urls", sim.url, "--max-concurrent-requests", str(SLOTS), *ROUTER]
    router = start_router(procs, "admission-priority", "ours", flags)
    try:
        urgent_flags = ["--priority", "-10", "--priority-share", "0.125"]
        run = _load(procs, "load-priority", router.url, PRIORITY_CLIENTS, p, *urgent_flags)
        result = run.wait(timeout=p["warmup"] + p["seconds"] + 120)
    finally:
        procs.stop(router)
    window = _window([result])
    done = _done(result["requests"], window)
    urgent = [r for r in done if r[0] == -10]
    rest = [r for r in done if r[0] != -10]
    urgent_p99, rest_p99 = _ttfb_p99_ms(urgent), _ttfb_p99_ms(rest)
    return {
        "clients": PRIORITY_CLIENTS,
        "slots": SLOTS,
        "urgent_done": len(urgent),
        "rest_done": len(rest),
        "urgent_ttfb_p99_ms": urgent_p99,
        "rest_ttfb_p99_ms": rest_p99,
        "ratio": urgent_p99 / rest_p99 if rest_p99 else math.nan,
        "failed": _failed([result]),
    }


def _tenants_case(
    ctx: Context,
    procs: ProcessSet,
    sim: Service,
    p: dict[str, float],
    label: str,
    tenants_file: Path | None,
    replicas: int = 1,
    workers: int = 1,
    redis: str | None = None,
) -> dict[str, Any]:
    ctx.progress.phase(f"tenants: {label}")
    slots = SLOTS // max(replicas, workers)
    flags = ["--worker-urls", sim.url, "--max-concurrent-requests", str(slots), *ROUTER]
    if tenants_file is not None:
        flags += ["--tenants-file", str(tenants_file)]
    if workers > 1:
        flags += ["--workers", str(workers)]
    routers: list[Service] = []
    try:
        for i in range(replicas):
            cluster = [] if redis is None else ["--cluster-url", redis, "--replica-id", f"r{i}"]
            name = f"admission-{label.replace(' ', '-').replace(',', '')}-{i}"
            routers.append(start_router(procs, name, "ours", [*flags, *cluster]))
        runs: list[tuple[str, LoadRun]] = []
        for i, router in enumerate(routers):
            for tenant, clients in (("heavy", HEAVY), ("light", LIGHT)):
                key = ["--api-key", f"sk-{tenant}"] if tenants_file is not None else []
                per_router = clients // replicas
                run = _load(procs, f"load-{tenant}-{i}", router.url, per_router, p, *key)
                runs.append((tenant, run))
        results = [
            (tenant, run.wait(timeout=p["warmup"] + p["seconds"] + 120)) for tenant, run in runs
        ]
    finally:
        for router in routers:
            procs.stop(router)
    window = _window([r for _, r in results])
    done = {
        tenant: [req for t, r in results if t == tenant for req in _done(r["requests"], window)]
        for tenant in ("heavy", "light")
    }
    total = len(done["heavy"]) + len(done["light"])
    share = len(done["light"]) / total if total else math.nan
    light_p99, heavy_p99 = _ttfb_p99_ms(done["light"]), _ttfb_p99_ms(done["heavy"])
    return {
        "heavy_done": len(done["heavy"]),
        "light_done": len(done["light"]),
        "light_share": share,
        "share_error": abs(share - 0.5),
        "light_ttfb_p99_ms": light_p99,
        "heavy_ttfb_p99_ms": heavy_p99,
        "ttfb_ratio": light_p99 / heavy_p99 if heavy_p99 else math.nan,
        "window_s": window[1] - window[0],
        "failed": _failed([r for _, r in results]),
    }


def run(ctx: Context) -> dict[str, Any]:
    p = PROFILES[ctx.profile]
    procs = ProcessSet(ctx.log_dir / "admission")
    try:
        ctx.progress.phase("starting the simulator")
        sim = start_sim(procs, "sim-admission", *SIM_FLAGS)
        tenants_file = procs.log_dir / "tenants.toml"
        tenants_file.write_text(TENANTS)
        priority = _priority(ctx, procs, sim, p)
        cases = {
            "one FIFO": _tenants_case(ctx, procs, sim, p, "one FIFO", None),
            "fair share": _tenants_case(ctx, procs, sim, p, "fair share", tenants_file),
            "fair share, --workers 2": _tenants_case(
                ctx, procs, sim, p, "fair share workers", tenants_file, workers=2
            ),
        }
        redis = _start_redis(procs)
        cases["fair share, 2 replicas"] = _tenants_case(
            ctx, procs, sim, p, "fair share replicas", tenants_file, replicas=2, redis=redis
        )
    finally:
        procs.close()
    return {
        "scenario": "admission",
        "profile": ctx.profile,
        "slots": SLOTS,
        "heavy_clients": HEAVY,
        "light_clients": LIGHT,
        "priority": priority,
        "tenants": cases,
    }
