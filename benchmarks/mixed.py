"""Scenario 8, token-weighted load: mixed prompt lengths under cache pressure.

One prefill and one decode simulator, 4 data-parallel ranks each. Prefill: one request at a time
per rank, 5 ms + 50 us per uncached prompt token (a 16k-token prompt takes 0.8 s, a 500-token one
30 ms), an LRU prefix cache of 2,500 blocks (40,000 tokens) per rank. Decode: token-paced, one
SSE event per token at 20 ms + 1 ms per running request.

Workloads, each a closed loop of 64 clients streaming 16-48 tokens:

* ``mixed``: 10 % of prompts ~16k tokens (8 long prefix groups of 64,000 characters), 90 %
  ~500 tokens (32 groups of 2,000 characters, 8 hot with 60 % of them), each with a unique
  160-character question: a rank's cache holds about two long groups beside its short ones, so
  the 8 fit only when each stays on its home rank, and a long prompt sent elsewhere misses
  (0.8 s of prefill) and evicts;
* ``uniform``: the short prompts alone (no regression check).

Routers: trio-pdrouter ``cache_aware`` with ``--load-metric requests``, its defaults (tokens
on prefill, requests on decode) and ``tokens`` on both stages, ``power_of_two`` with each
metric, and vllm-router ``cache_aware``, all with the routers' default thresholds; they take
turns and each gets a fresh router and empty caches. Reported: req/s, TTFT (time to the first
streamed byte) p50/p99, the prefill simulator's prefix-hit rate (cached / prompt tokens over the
run, warm-up included), medians over the repeats.
``BENCH_MIXED_WORKLOADS=mixed|uniform`` narrows a run, ``BENCH_MIXED_CONFIGS="requests|vllm"``
runs only the configurations whose label contains one of the ``|``-separated parts, and
``BENCH_MIXED_REPEATS=N`` sets the rounds.
"""

from __future__ import annotations

import os
from typing import Any

import httpx

from .common import Config, Context, chosen_configs, latency_summary, median, percentile, run_load
from .procs import ProcessSet, start_router, start_sim, wait_sims_idle

PROFILES: dict[str, dict[str, Any]] = {
    "quick": {"warmup": 4.0, "seconds": 20.0, "repeats": 2},
    "full": {"warmup": 5.0, "seconds": 40.0, "repeats": 3},
}
DP = 4
CONCURRENCY = 64
PREFILL_SIM = [
    "--role", "prefill", "--dp-size", str(DP), "--max-num-seqs", "1",
    "--prefill-base-s", "0.005", "--prefill-per-token-s", "0.00005",
    "--prefix-cache-blocks", "2500", "--log-level", "warning",
]  # fmt: skip
DECODE_SIM = [
    "--role", "decode", "--dp-size", str(DP), "--max-num-seqs", "256",
    "--itl-base-s", "0.02", "--itl-per-running-s", "0.001", "--log-level", "warning",
]  # fmt: skip
SHORT = [
    "--stream", "--prefix-chars", "2000", "--suffix-chars", "160",
    "--hot-groups", "8", "--cold-groups", "24", "--hot-share", "0.6",
    "--max-tokens-min", "16", "--max-tokens", "48", "--timeout", "300",
]  # fmt: skip
LONG = ["--long-share", "0.1", "--long-groups", "8", "--long-prefix-chars", "64000"]
WORKLOADS = {"mixed": [*SHORT, *LONG], "uniform": SHORT}
#: (label, router kind, policy flags)
CONFIGS: list[Config] = [
    ("ours cache_aware requests", "ours", ["--policy", "cache_aware", "--load-metric", "requests"]),
    ("ours cache_aware (defaults: prefill tokens)", "ours", ["--policy", "cache_aware"]),
    ("ours cache_aware tokens", "ours", ["--policy", "cache_aware", "--load-metric", "tokens"]),
    (
        "ours power_of_two requests",
        "ours",
        ["--policy", "power_of_two", "--load-metric", "requests"],
    ),
    ("ours power_of_two tokens", "ours", ["--policy", "power_of_two", "--load-metric", "tokens"]),
    ("vllm-router cache_aware", "vllm", ["--policy", "cache_aware"]),
]


def estimate(profile: str) -> float:
    p = PROFILES[profile]
    return float(2 * len(CONFIGS) * p["repeats"] * (p["warmup"] + p["seconds"] + 5.0) + 10)


def run(ctx: Context) -> dict[str, Any]:
    p = PROFILES[ctx.profile]
    configs = chosen_configs(CONFIGS, "BENCH_MIXED_CONFIGS", ctx.vllm_router is not None)
    chosen = os.environ.get("BENCH_MIXED_WORKLOADS", "mixed,uniform").split(",")
    repeats = int(os.environ.get("BENCH_MIXED_REPEATS", p["repeats"]))
    result: dict[str, Any] = {
        "scenario": "mixed",
        "profile": ctx.profile,
        "settings": {
            **p,
            "repeats": repeats,
            "concurrency": CONCURRENCY,
            "prefill_sim": PREFILL_SIM,
            "decode_sim": DECODE_SIM,
            "workloads": {w: WORKLOADS[w] for w in chosen},
        },
        "notes": [] if ctx.vllm_router else [ctx.note_vllm_missing()],
        "workloads": {},
    }
    procs = ProcessSet(ctx.log_dir / "mixed")
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
        for workload in chosen:
            runs: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in configs}
            for rep in range(repeats):
                for n, (label, kind, policy) in enumerate(configs):
                    ctx.progress.phase(f"{workload}: {label}, round {rep + 1}/{repeats}")
                    wait_sims_idle(client, sims)
                    for sim in sims:
                        client.post(sim.url + "/sim/reset", json={"prefix_cache": True})
                    router = start_router(
                        procs, f"router-{workload}-{rep}-{n}", kind, [*pd, *policy]
                    )
                    try:
                        window = ["--warmup", str(p["warmup"]), "--seconds", str(p["seconds"])]
                        raw = run_load(
                            ctx,
                            procs,
                            f"load-{workload}-{rep}-{n}",
                            router.url,
                            [*WORKLOADS[workload], *window],
                            concurrency=CONCURRENCY,
                            router=router,
                            seconds=p["warmup"] + p["seconds"],
                        )
                        totals = client.get(prefill.url + "/sim/stats").json()["totals"]
                    finally:
                        procs.stop(router)
                    lat = latency_summary(raw)
                    queried = int(totals["prefix_cache_queries"])
                    ttft = raw["first_bytes"]
                    runs[label].append(
                        {
                            "req_per_s": lat["req_per_s"],
                            "ttft_p50_ms": percentile(ttft, 0.50) * 1e3,
                            "ttft_p99_ms": percentile(ttft, 0.99) * 1e3,
                            "total_p99_ms": lat["total_p99_ms"],
                            "failed": float(raw["failed"]),
                            "prefix_hit_rate": int(totals["prefix_cache_hits"]) / (queried or 1),
                        }
                    )
            rows: dict[str, dict[str, Any]] = {}
            for label, reps in runs.items():
                rows[label] = {k: median([r[k] for r in reps]) for k in reps[0]}
                rows[label]["runs"] = reps
            result["workloads"][workload] = rows
    finally:
        client.close()
        procs.close()
    return result
