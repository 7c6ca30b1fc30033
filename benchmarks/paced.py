"""Scenario 2, token-paced relay cost: router CPU per event against the stack's floor.

vLLM writes one SSE event per token, each in its own write, spaced by the inter-token latency;
the simulators here do the same (``--itl-base-s`` 20 ms, no per-running slowdown, one ASGI send
per token). Next to trio-pdrouter and vllm-router runs the floor (:mod:`benchmarks.floor`): the
smallest relay hypercorn's trio worker can serve, on the same server stack. The router's CPU per
event divided by the floor's in the same run is the figure the relay-cost goal is stated in.
"floor, write at once" is an experiment (:mod:`.hypercorn_send`): the same floor relay on a
hypercorn whose send path skips its per-send lock and checkpoints, i.e. what a change to hypercorn
would save; the router does not ship that patch.

* regular: round_robin over 2 simulators x 4 DP ranks, 200-token streams, closed loops of
  64 / 256 / 1,000 clients;
* PD: a prefill and a decode simulator (4 DP ranks each), 100-token streams, 64 clients;
  the figure is router CPU per PD request.

Targets take turns within a round (floor, ours, vllm-router, floor, ...) and the median over
rounds is reported, because other processes load the machine. Router CPU is the router process's
user + system time over the measured window (psutil). "ours, no pump" is the router with
``--no-relay-pump`` (every stream relayed by its own task), "ours, --workers 2" two worker
processes (regular mode). ``BENCH_BASELINE=DIR`` adds an
"ours (baseline)" target run from another checkout (``git archive main | tar -x -C DIR``), for
before/after comparisons in the same run; ``BENCH_PACED_MODES=regular|pd``, ``BENCH_PACED_C=256``
and ``BENCH_PACED_REPEATS=N`` narrow or lengthen a run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from .common import Context, histogram_percentile, latency_summary, median, percentile, run_load
from .loadgen import GAP_BUCKET_S
from .procs import ProcessSet, Service, free_port, start_router, start_sim, wait_ready
from .procs import wait_sims_idle as _wait_idle

PROFILES: dict[str, dict[str, Any]] = {
    "quick": {"warmup": 3.0, "seconds": 8.0, "repeats": 2, "concurrency": [64, 256, 1000]},
    "full": {"warmup": 3.0, "seconds": 15.0, "repeats": 3, "concurrency": [64, 256, 1000]},
}
ITL_S = "0.02"
SIM_FLAGS = ["--dp-size", "4", "--max-num-seqs", "4096", "--itl-base-s", ITL_S]
SIM_FLAGS += ["--itl-per-running-s", "0", "--prefill-base-s", "0.01"]
SIM_FLAGS += ["--prefill-per-token-s", "0", "--log-level", "warning"]
REGULAR_LOAD = ["--stream", "--max-tokens", "200", "--suffix-chars", "64", "--ramp", "0.02"]
PD_LOAD = ["--stream", "--max-tokens", "100", "--suffix-chars", "64", "--ramp", "0.02"]
PD_CONCURRENCY = 64
HEADLINE_CONCURRENCY = 256


def estimate(profile: str) -> float:
    p = PROFILES[profile]
    runs = 3 * p["repeats"] * (len(p["concurrency"]) + 1)
    return float(runs * (p["warmup"] + p["seconds"] + 4.0) + 20)


def start_floor(procs: ProcessSet, name: str, flags: list[str]) -> Service:
    """The floor relay (:mod:`benchmarks.floor`) on a free port, ready."""
    port = free_port()
    argv = [sys.executable, "-m", "benchmarks.floor", "--port", str(port), *flags]
    service = procs.start(name, argv, url=f"http://127.0.0.1:{port}")
    wait_ready(service)
    return service


def _targets(
    ctx: Context, procs: ProcessSet, mode: str, flags: list[str], notes: list[str]
) -> dict[str, Service]:
    targets = {
        "floor": start_floor(procs, f"floor-{mode}", flags),
        "floor, write at once": start_floor(
            procs, f"floor-once-{mode}", [*flags, "--write-at-once"]
        ),
    }
    ours_flags = ["--vllm-pd-disaggregation", *flags] if mode == "pd" else flags
    ours_flags = [*ours_flags, "--policy", "round_robin"]
    targets["ours"] = start_router(procs, f"ours-{mode}", "ours", ours_flags)
    # The same router with every stream relayed by its own task: what the relay pump saves.
    targets["ours, no pump"] = start_router(
        procs, f"ours-nopump-{mode}", "ours", [*ours_flags, "--no-relay-pump"]
    )
    if mode == "regular":
        targets["ours, --workers 2"] = start_router(
            procs, f"ours-workers-{mode}", "ours", [*ours_flags, "--workers", "2"]
        )
    baseline = os.environ.get("BENCH_BASELINE")
    if baseline:
        targets["ours (baseline)"] = start_router(
            procs, f"baseline-{mode}", "ours", ours_flags, cwd=Path(baseline)
        )
        note = f"ours (baseline): the router of {_checkout(Path(baseline))}"
        if note not in notes:  # once for both modes
            notes.append(note)
    if ctx.vllm_router:
        targets["vllm-router"] = start_router(procs, f"vllm-{mode}", "vllm", ours_flags)
    elif mode == "regular":
        notes.append(ctx.note_vllm_missing())
    return targets


def _checkout(path: Path) -> str:
    """``path``, with its git commit when it is a git checkout."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(path)
    return f"{path} (commit {commit})"


def _measure(
    ctx: Context,
    procs: ProcessSet,
    targets: dict[str, Service],
    sims: list[Service],
    load: list[str],
    concurrency: int,
    label: str,
) -> dict[str, Any]:
    p = PROFILES[ctx.profile]
    repeats = int(os.environ.get("BENCH_PACED_REPEATS", p["repeats"]))
    flags = [*load, "--warmup", str(p["warmup"]), "--seconds", str(p["seconds"])]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
    with httpx.Client(timeout=5.0) as client:
        for rep in range(repeats):
            for name, router in targets.items():
                ctx.progress.phase(f"{label} C={concurrency}: {name}, round {rep + 1}")
                _wait_idle(client, sims, timeout=60.0)
                raw = run_load(
                    ctx,
                    procs,
                    f"load-{label}-{concurrency}-{name.split()[0]}-{rep}",
                    router.url,
                    flags,
                    concurrency=concurrency,
                    router=router,
                    seconds=p["warmup"] + p["seconds"],
                    processes=2 if concurrency >= 256 else 1,
                )
                cpu = raw.get("router_cpu_s", float("nan"))
                window = raw["window_s"]
                lat = latency_summary(raw)
                # Time to first token of every stream that started in the window: under
                # saturation streams outlast the window, and "completed" would be empty.
                ttft = raw["first_bytes"]
                runs[name].append(
                    {
                        "router_us_per_event": cpu / max(1, raw["events"]) * 1e6,
                        "router_ms_per_request": cpu / max(1, raw["ok"]) * 1e3,
                        "router_cpu_util": cpu / window,
                        "events_per_s": raw["events"] / window,
                        "req_per_s": lat["req_per_s"],
                        "ttft_p50_ms": percentile(ttft, 0.50) * 1e3,
                        "ttft_p99_ms": percentile(ttft, 0.99) * 1e3,
                        # How the client saw events paced (the engine's: ITL_S apart).
                        "gap_p50_ms": histogram_percentile(raw["gaps"], GAP_BUCKET_S, 0.5) * 1e3,
                        "gap_p99_ms": histogram_percentile(raw["gaps"], GAP_BUCKET_S, 0.99) * 1e3,
                        "gap_p999_ms": histogram_percentile(raw["gaps"], GAP_BUCKET_S, 0.999) * 1e3,
                        "started_per_s": len(ttft) / window,
                        "failed": float(raw["failed"]),
                        "router_peak_rss_mb": raw["router_peak_rss"] / 2**20,
                    }
                )
    point: dict[str, Any] = {"concurrency": concurrency, "targets": {}}
    for name, reps in runs.items():
        row: dict[str, Any] = {k: median([r[k] for r in reps]) for k in reps[0]}
        row["runs"] = reps
        point["targets"][name] = row
    floor = point["targets"]["floor"]
    for row in point["targets"].values():
        row["cpu_per_event_vs_floor"] = row["router_us_per_event"] / floor["router_us_per_event"]
        row["cpu_per_request_vs_floor"] = (
            row["router_ms_per_request"] / floor["router_ms_per_request"]
        )
        row["ttft_p50_vs_floor"] = row["ttft_p50_ms"] / floor["ttft_p50_ms"]
    return point


def run(ctx: Context) -> dict[str, Any]:
    p = PROFILES[ctx.profile]
    result: dict[str, Any] = {
        "scenario": "paced",
        "profile": ctx.profile,
        "settings": {**p, "sim": SIM_FLAGS, "regular_load": REGULAR_LOAD, "pd_load": PD_LOAD},
        "notes": [],
        "regular": [],
        "pd": [],
    }
    only = os.environ.get("BENCH_PACED_MODES", "regular,pd").split(",")
    concurrency = [int(c) for c in os.environ.get("BENCH_PACED_C", "").split(",") if c]
    procs = ProcessSet(ctx.log_dir / "paced")
    try:
        if "regular" in only:
            ctx.progress.phase("regular: starting simulators and routers")
            sims = [start_sim(procs, f"sim-{i}", "--role", "both", *SIM_FLAGS) for i in range(2)]
            targets = _targets(
                ctx, procs, "regular", ["--worker-urls", *(s.url for s in sims)], result["notes"]
            )
            for c in concurrency or p["concurrency"]:
                point = _measure(ctx, procs, targets, sims, REGULAR_LOAD, c, "regular")
                result["regular"].append(point)
            for service in [*targets.values(), *sims]:
                procs.stop(service)
        if "pd" in only:
            ctx.progress.phase("PD: starting simulators and routers")
            prefill = start_sim(procs, "sim-prefill", "--role", "prefill", *SIM_FLAGS)
            decode = start_sim(procs, "sim-decode", "--role", "decode", *SIM_FLAGS)
            flags = ["--prefill", prefill.url, "--decode", decode.url]
            targets = _targets(ctx, procs, "pd", flags, result["notes"])
            point = _measure(ctx, procs, targets, [prefill, decode], PD_LOAD, PD_CONCURRENCY, "pd")
            result["pd"].append(point)
    finally:
        procs.close()
    return result
