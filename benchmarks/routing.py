"""Scenario 4, routing quality: where requests land when the engines are saturated.

One prefill and one decode simulator, 4 data-parallel ranks each. Prefill: one request at a time
per rank, 10 ms + 0.2 ms per uncached prompt token, an LRU prefix cache of 1,000 blocks per rank
(about 21 of the workload's prefixes). Decode: 16 running per rank at most (the rest wait), and a
token takes 20 ms + 2 ms per running request, so a crowded rank really is slower.

Workload: prompts of a 3,000-character shared prefix plus a unique 160-character question;
3 hot prefix groups take 60 % of the requests, 60 cold groups share the rest; 16-48 tokens
streamed; a closed loop of 112 clients (the decode ranks hold 64), so queues form.

Routers: trio-pdrouter with cache_aware (the seed command line's thresholds, and the defaults;
the seed flags also with ``--workers 4``, whose prefix trees each see a quarter of the requests),
power_of_two and round_robin; vllm-router with cache_aware (seed flags and defaults) and
round_robin. Each run gets a fresh router and simulators reset to empty caches; configurations
take turns. While a run is measured the router's own load count per endpoint (trio-pdrouter:
``GET /get_loads``; vllm-router: the ``load`` of ``GET /workers``, what its policies read) is
sampled next to the simulators' truth (``running + waiting`` per rank, ``GET /sim/stats``, read
just before and just after the router; the error is how far the router's count lies outside
that interval).

``BENCH_ROUTING_CONFIGS="seed flags|round_robin"`` runs only the configurations whose label
contains one of the ``|``-separated parts, ``BENCH_ROUTING_REPEATS=N`` sets the rounds, and
``BENCH_BASELINE=DIR`` adds each chosen trio-pdrouter configuration run from the checkout in DIR
(labelled ``(baseline)``), for before/after rows in the same run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx

from .common import Config, Context, cdf_points, chosen_configs, latency_summary, median, run_load
from .procs import ProcessSet, Service, start_router, start_sim, wait_sims_idle

PROFILES: dict[str, dict[str, Any]] = {
    "quick": {"warmup": 2.0, "seconds": 10.0, "repeats": 2, "sample_every": 0.5},
    "full": {"warmup": 5.0, "seconds": 40.0, "repeats": 3, "sample_every": 0.25},
}
DP = 4
CONCURRENCY = 96
API_KEY = "bench-key"
STAGES = ("prefill", "decode")
PREFILL_SIM = [
    "--role", "prefill", "--dp-size", str(DP), "--max-num-seqs", "1",
    "--prefill-base-s", "0.01", "--prefill-per-token-s", "0.0002",
    "--prefix-cache-blocks", "1000",
]  # fmt: skip
DECODE_SIM = [
    "--role", "decode", "--dp-size", str(DP), "--max-num-seqs", "64",
    "--itl-base-s", "0.02", "--itl-per-running-s", "0.003",
]  # fmt: skip
LOAD_FLAGS = [
    "--stream", "--prefix-chars", "3000", "--suffix-chars", "160",
    "--hot-groups", "3", "--cold-groups", "60", "--hot-share", "0.6",
    "--max-tokens-min", "8", "--max-tokens", "24", "--timeout", "300",
]  # fmt: skip
SEED_FLAGS = [
    "--cache-threshold", "0.5", "--balance-abs-threshold", "32", "--balance-rel-threshold", "1.1",
]  # fmt: skip
#: (label, router kind, policy flags)
CONFIGS: list[Config] = [
    ("ours cache_aware (seed flags)", "ours", ["--policy", "cache_aware", *SEED_FLAGS]),
    (
        "ours cache_aware (seed flags) --workers 4",
        "ours",
        ["--policy", "cache_aware", *SEED_FLAGS, "--workers", "4"],
    ),
    ("ours cache_aware (defaults)", "ours", ["--policy", "cache_aware"]),
    ("ours power_of_two", "ours", ["--policy", "power_of_two"]),
    ("ours round_robin", "ours", ["--policy", "round_robin"]),
    ("vllm-router cache_aware (seed flags)", "vllm", ["--policy", "cache_aware", *SEED_FLAGS]),
    ("vllm-router cache_aware (defaults)", "vllm", ["--policy", "cache_aware"]),
    ("vllm-router round_robin", "vllm", ["--policy", "round_robin"]),
]


def _chosen_configs(vllm_router: bool) -> list[Config]:
    chosen = chosen_configs(CONFIGS, "BENCH_ROUTING_CONFIGS", vllm_router)
    if os.environ.get("BENCH_BASELINE"):
        ours = [(label, f) for label, kind, f in chosen if kind == "ours"]
        chosen += [(f"{label} (baseline)", "baseline", f) for label, f in ours]
    return chosen


def _repeats(profile: str) -> int:
    return int(os.environ.get("BENCH_ROUTING_REPEATS", PROFILES[profile]["repeats"]))


def estimate(profile: str) -> float:
    p = PROFILES[profile]
    configs = _chosen_configs(vllm_router=True)
    return float(len(configs) * _repeats(profile) * (p["warmup"] + p["seconds"] + 3.5) + 5)


class LoadSampler:
    """Samples the router's load count per endpoint next to the simulators' truth."""

    def __init__(self, kind: str, router: Service, sims: list[Service], every: float) -> None:
        self.kind = kind
        self.router = router
        self.sims = sims
        self.every = every
        self.client = httpx.Client(timeout=2.0)
        self.next_at = 0.0
        self.errors: list[float] = []
        self.truths: list[float] = []
        self.samples = 0

    def router_loads(self) -> dict[str, int]:
        if self.kind == "ours":
            # Other sections (what engines report, drift) are not the router's own count.
            doc = self.client.get(self.router.url + "/get_loads").json()
            return {key: n for role in STAGES for key, n in doc.get(role, {}).items()}
        doc = self.client.get(
            self.router.url + "/workers", headers={"authorization": f"Bearer {API_KEY}"}
        ).json()
        return {w["url"]: int(w["load"]) for w in doc["workers"]}

    def truth(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for sim in self.sims:
            stats = self.client.get(sim.url + "/sim/stats").json()
            for engine in stats["engines"]:
                out[f"{sim.url}@{engine['rank']}"] = engine["running"] + engine["waiting"]
        return out

    def tick(self, measuring: bool) -> None:
        now = time.monotonic()
        if not measuring or now < self.next_at:
            return
        self.next_at = now + self.every
        try:
            # Truth is read before and after the router: its count is right if it lies
            # between the two (requests start and end while the three answers travel).
            before = self.truth()
            loads = self.router_loads()
            after = self.truth()
        except (httpx.HTTPError, ValueError, KeyError):
            return
        self.samples += 1
        for key, first in before.items():
            low, high = sorted((first, after.get(key, first)))
            mine = loads.get(key, 0)
            self.errors.append(max(0, low - mine, mine - high))
            self.truths.append((low + high) / 2)

    def summary(self) -> dict[str, float]:
        n = len(self.errors) or 1
        return {
            "load_error_mean": sum(self.errors) / n,
            "load_error_max": max(self.errors, default=0.0),
            "load_truth_mean": sum(self.truths) / n,
            "load_samples": float(self.samples),
        }

    def close(self) -> None:
        self.client.close()


def _engine_summary(stats: dict[str, Any], prefix: str) -> dict[str, Any]:
    engines = stats["engines"]
    totals = stats["totals"]
    out: dict[str, Any] = {
        f"{prefix}_peak_running": [e["peak_running"] for e in engines],
        f"{prefix}_completed": [e["completed"] for e in engines],
    }
    if totals.get("prefix_cache_queries"):
        out[f"{prefix}_cache_hit_rate"] = (
            totals["prefix_cache_hits"] / totals["prefix_cache_queries"]
        )
    return out


def _spread(series: dict[str, Any]) -> float:
    """Mean over the run of (busiest rank - idlest rank) running requests."""
    rows = series["running"]
    return sum(max(r) - min(r) for r in rows) / len(rows) if rows else float("nan")


def run(ctx: Context) -> dict[str, Any]:
    p = PROFILES[ctx.profile]
    configs = _chosen_configs(ctx.vllm_router is not None)
    p = {**p, "repeats": _repeats(ctx.profile)}
    result: dict[str, Any] = {
        "scenario": "routing",
        "profile": ctx.profile,
        "settings": {
            **p,
            "concurrency": CONCURRENCY,
            "prefill_sim": PREFILL_SIM,
            "decode_sim": DECODE_SIM,
            "load": LOAD_FLAGS,
        },
        "notes": [],
        "configs": [],
    }
    if not ctx.vllm_router:
        result["notes"].append(ctx.note_vllm_missing())
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in configs}
    series: dict[str, dict[str, Any]] = {}
    ttfbs: dict[str, list[float]] = {label: [] for label, _, _ in configs}
    procs = ProcessSet(ctx.log_dir / "routing")
    client = httpx.Client(timeout=5.0)
    try:
        ctx.progress.phase("starting simulators")
        prefill = start_sim(procs, "sim-prefill", *PREFILL_SIM)
        decode = start_sim(procs, "sim-decode", *DECODE_SIM)
        sims = [prefill, decode]
        pd = [
            "--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url,
            "--intra-node-data-parallel-size", str(DP),
        ]  # fmt: skip
        total = len(configs) * p["repeats"]
        done = 0
        for rep in range(p["repeats"]):
            for label, kind, policy in configs:
                done += 1
                ctx.progress.phase(f"{label}, round {rep + 1}/{p['repeats']} (run {done}/{total})")
                wait_sims_idle(client, sims)
                extra = ["--api-key", API_KEY] if kind == "vllm" else []
                if kind == "baseline":
                    baseline = Path(os.environ["BENCH_BASELINE"])
                    flags = [*pd, *policy]
                    router = start_router(procs, f"router-{done}", "ours", flags, cwd=baseline)
                else:
                    router = start_router(procs, f"router-{done}", kind, [*pd, *policy, *extra])
                sampler = LoadSampler(
                    "vllm" if kind == "vllm" else "ours", router, sims, p["sample_every"]
                )
                try:
                    for sim in sims:
                        client.post(sim.url + "/sim/reset", json={"prefix_cache": True})
                    window = ["--warmup", str(p["warmup"]), "--seconds", str(p["seconds"])]
                    raw = run_load(
                        ctx,
                        procs,
                        f"load-{done}",
                        router.url,
                        [*LOAD_FLAGS, *window, *extra],
                        concurrency=CONCURRENCY,
                        router=router,
                        seconds=p["warmup"] + p["seconds"],
                        tick=sampler.tick,
                    )
                    p_stats = client.get(prefill.url + "/sim/stats").json()
                    d_stats = client.get(decode.url + "/sim/stats").json()
                finally:
                    sampler.close()
                    procs.stop(router)
                row: dict[str, Any] = latency_summary(raw)
                row.update(sampler.summary())
                row.update(_engine_summary(p_stats, "prefill"))
                row.update(_engine_summary(d_stats, "decode"))
                row["decode_spread_mean"] = _spread(d_stats["series"])
                row["router_cpu_util"] = raw.get("router_cpu_s", float("nan")) / raw["window_s"]
                row["errors"] = raw["errors"]
                runs[label].append(row)
                ttfbs[label] += raw["ttfb"]
                if label not in series:
                    series[label] = {"decode": d_stats["series"], "prefill": p_stats["series"]}
    finally:
        client.close()
        procs.close()
    for label, _, _ in configs:
        reps = runs[label]
        row = {"label": label, "runs": reps}
        for key, value in reps[0].items():
            if isinstance(value, int | float):
                row[key] = median([r[key] for r in reps])
        for key in ("prefill_peak_running", "decode_peak_running"):
            row[key] = [median([r[key][i] for r in reps]) for i in range(DP)]
        row["ttfb_cdf_ms"] = cdf_points(ttfbs[label])
        row["series"] = series[label]
        result["configs"].append(row)
    return result
