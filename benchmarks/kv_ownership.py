"""Scenario 9, prefill KV ownership: second pulls and stranded blocks when clients leave.

A prefill and a decode simulator (4 DP ranks each) whose NIXL stand-in follows vLLM's ends of a
decode request (``trio_pdrouter_sim.kv``): a decode aborted before it read the prefill's blocks
frees them, a read of blocks already pulled or freed fails and is counted. Each router
(trio-pdrouter and vllm-router, the seed command line's ``cache_aware``) gets the same load, in
the same run, and after each run the simulators' ground truth is read once everything settled:

* **second pulls**: reads of prefill blocks already pulled or freed (a reclaim sent after decode
  owned them);
* **stranded**: holds the prefill still keeps for a decode that will never come;
* **ends reaching an engine** per client that left after its request reached one (those that
  left before the router sent their prefill left nothing to abort): prefill or decode
  ``aborted`` (less the resets the decode simulator injected), plus trio-pdrouter's reclaims (a
  prefill answer already on its way when the client left is reclaimed, its blocks freed now);
* the router's ledger (``/get_loads``) back to 0 (trio-pdrouter).

Scenarios: ``leave-early``: 400 streams of short prompts, the decode's KV read taking 80 ms,
half the clients leaving 20-170 ms after sending; ``churn``: 500 streams, 40 % of the clients
leaving at a random instant of their request, 5 % of decode streams reset by the engine.
``BENCH_KV_OWNERSHIP_RUNS=N`` sets the runs of each (quick 2, full 5).
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import attrs
import httpx
import trio

from trio_pdrouter.transport import H11Transport

from .common import Context
from .procs import ProcessSet, Service, start_router, start_sim, wait_sims_idle

SIM = ["--dp-size", "4", "--itl-base-s", "0.02", "--kv-timeout", "600", "--log-level", "warning"]
SEED = [
    "--vllm-pd-disaggregation",
    "--policy",
    "cache_aware",
    "--cache-threshold",
    "0.5",
    "--balance-abs-threshold",
    "32",
    "--balance-rel-threshold",
    "1.1",
    "--intra-node-data-parallel-size",
    "4",
]
CONCURRENCY = 64
MAX_TOKENS = 40


@attrs.frozen
class Shape:
    """One scenario: how many streams, who leaves when, what the decode engine does."""

    name: str
    streams: int
    leave_share: float
    #: Seconds after sending that a leaving client goes: uniform in this range.
    leave_after: tuple[float, float]
    decode_flags: tuple[str, ...]


SHAPES = (
    Shape("leave-early", 400, 0.5, (0.02, 0.17), ("--kv-transfer", "0.08")),
    Shape(
        "churn",
        500,
        0.4,
        (0.0, 0.02 * MAX_TOKENS),
        ("--kv-transfer", "0.08", "--fault", "reset:2@decode~0.05"),
    ),
)


def estimate(profile: str) -> float:
    return 60.0 * _runs(profile)


def _runs(profile: str) -> int:
    return int(os.environ.get("BENCH_KV_OWNERSHIP_RUNS", 2 if profile == "quick" else 5))


async def _client(
    http: httpx.AsyncClient, url: str, n: int, leave_at: float | None, seen: dict[str, int]
) -> None:
    body = {
        "model": "sim-model",
        "prompt": f"request {n}: tell me something new about the number {n}.",
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    outcome = "error"
    with trio.move_on_after(leave_at if leave_at is not None else 60.0) as scope:
        try:
            async with http.stream("POST", url + "/v1/completions", json=body) as resp:
                outcome = f"status_{resp.status_code}"
                async for _ in resp.aiter_raw():
                    pass
        except httpx.HTTPError:
            outcome = "error"
    if scope.cancelled_caught and leave_at is not None:
        outcome = "left"
    seen[outcome] = seen.get(outcome, 0) + 1


async def _load(url: str, shape: Shape, seed: int) -> dict[str, int]:
    """Run ``shape``'s streams through the router at ``url``; returns how each ended: ``left``
    (the client went before its answer ended), ``status_200`` (read to its end), others."""
    rng = random.Random(seed)
    plan = [
        rng.uniform(*shape.leave_after) if rng.random() < shape.leave_share else None
        for _ in range(shape.streams)
    ]
    seen: dict[str, int] = {}
    limiter = trio.Semaphore(CONCURRENCY)
    transport = H11Transport(max_connections_per_host=CONCURRENCY * 2)
    async with httpx.AsyncClient(transport=transport, timeout=60.0) as http:

        async def one(n: int) -> None:
            async with limiter:
                await _client(http, url, n, plan[n], seen)

        async with trio.open_nursery() as nursery:
            for n in range(shape.streams):  # the semaphore is fair: they start in this order
                nursery.start_soon(one, n)
    return seen


def _totals(client: httpx.Client, sim: Service) -> dict[str, Any]:
    stats: dict[str, Any] = client.get(sim.url + "/sim/stats").json()
    received = stats["received"].get("/v1/completions", 0)
    return {
        **stats["totals"],
        "kv_holds": stats["kv_holds"],
        "faults": stats["faults_injected"],
        "received": received,
    }


def _counter(client: httpx.Client, router: Service, name: str) -> float:
    """The sum of a counter's samples in trio-pdrouter's ``/metrics``."""
    text = client.get(router.url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def _settled(client: httpx.Client, sims: list[Service], router: Service, ours: bool) -> float:
    """Wait for the engines to be idle and, for trio-pdrouter, its ledger back to 0; returns
    the ledger's total at the end (0 when it settled)."""
    wait_sims_idle(client, sims)
    total = 0.0
    deadline = time.monotonic() + 10.0
    while ours and time.monotonic() < deadline:
        loads = client.get(router.url + "/get_loads").json()
        total = sum(sum(loads.get(role, {}).values()) for role in ("prefill", "decode"))
        if total == 0:
            break
        time.sleep(0.1)
    time.sleep(1.0)  # reclaims and frees still on their way land before the truth is read
    wait_sims_idle(client, sims)
    return total


def _one_run(
    client: httpx.Client,
    sims: tuple[Service, Service],
    router: Service,
    ours: bool,
    shape: Shape,
    seed: int,
) -> dict[str, Any]:
    prefill, decode = sims
    for sim in sims:
        client.post(sim.url + "/sim/reset")
    holds_before = _totals(client, prefill)["kv_holds"]
    names = ("trio_pdrouter_stranded_kv_handoffs_total", "trio_pdrouter_prefill_answers_after")
    before = [_counter(client, router, n) for n in names] if ours else [0.0, 0.0]
    seen = trio.run(_load, router.url, shape, seed)
    left = seen.get("left", 0)
    if seen.get("status_200", 0) + left < shape.streams * 0.9:
        raise RuntimeError(f"{router.name}: most streams failed: {seen}")
    ledger = _settled(client, list(sims), router, ours)
    p, d = _totals(client, prefill), _totals(client, decode)
    after = [_counter(client, router, n) for n in names] if ours else [0.0, 0.0]
    reclaims, late = (a - b for a, b in zip(after, before, strict=True))
    aborts = p["aborted"] + d["aborted"] - d["faults"]
    # Each stream sends one prefill, unless its client left before the router sent it: those
    # left nothing on any engine to abort.
    reached = left - max(0, shape.streams - p["received"])
    return {
        "ended": seen,
        "left": left,
        "left_after_reaching_an_engine": reached,
        "second_pulls": p["kv_second_pulls"],
        "stranded": p["kv_holds"] - holds_before,
        "freed_by_decode": p["kv_blocks_freed"],
        "aborts": aborts,
        "aborts_per_leaver": aborts / reached if reached else None,
        "decode_resets": d["faults"],
        "pd_ok": d["pd_ok"],
        "pd_missing": d["pd_missing"],
        "ledger_after": ledger if ours else None,
        "reclaims": reclaims if ours else None,
        # Ends that reached an engine for a client that left: an abort, or a reclaim of a
        # prefill answer already on its way (whose blocks the reclaim frees at once).
        "ends_per_leaver": (aborts + (reclaims if ours else 0)) / reached if reached else None,
        "late_prefill_answers": late if ours else None,
    }


def run(ctx: Context) -> dict[str, Any]:
    runs = _runs(ctx.profile)
    result: dict[str, Any] = {
        "scenario": "kv_ownership",
        "profile": ctx.profile,
        "settings": {"sim": SIM, "router": SEED, "concurrency": CONCURRENCY, "runs": runs},
        "notes": [],
        "shapes": {},
    }
    kinds = ctx.router_kinds(result["notes"])
    procs = ProcessSet(ctx.log_dir / "kv_ownership")
    try:
        with httpx.Client(timeout=10.0) as client:
            for shape in SHAPES:
                rows: dict[str, list[dict[str, Any]]] = {}
                prefill = start_sim(procs, f"{shape.name}-prefill", "--role", "prefill", *SIM)
                decode = start_sim(
                    procs, f"{shape.name}-decode", "--role", "decode", *SIM, *shape.decode_flags
                )
                flags = [*SEED, "--prefill", prefill.url, "--decode", decode.url]
                for label, kind in kinds:
                    router = start_router(procs, f"{shape.name}-{kind}", kind, flags)
                    try:
                        for i in range(runs):
                            ctx.progress.phase(f"{shape.name}: {label}, run {i + 1} of {runs}")
                            row = _one_run(
                                client, (prefill, decode), router, kind == "ours", shape, i
                            )
                            rows.setdefault(label, []).append(row)
                    finally:
                        procs.stop(router)
                procs.stop(prefill)
                procs.stop(decode)
                result["shapes"][shape.name] = {"shape": attrs.asdict(shape), "routers": rows}
    finally:
        procs.close()
    return result
