"""``make demo``: the router in front of simulated vLLM servers, with a live view of load.

One prefill and one decode simulator with 4 data-parallel engines each, the router with the seed
command line's policy settings, and a load generator whose requests share prefixes. The view
shows, per endpoint, the router's load next to what the engine says it runs: they stay equal.
On a terminal it redraws in place; without one it prints a plain line every few seconds.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Sequence
from typing import Any

import attrs
import httpx
import trio

from .config import RouterConfig, ServerSettings
from .policies import PolicySettings
from .server import RunningRouter, run_router
from .sim.config import SimConfig
from .sim.server import SimServer

PREFIXES = [f"You are assistant #{i}. " + "Background material. " * 60 for i in range(6)]


@attrs.define
class LoadStats:
    done: int = 0
    failed: int = 0
    ttfb: list[float] = attrs.Factory(list)

    def percentile(self, q: float) -> float:
        if not self.ttfb:
            return math.nan
        ordered = sorted(self.ttfb)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def generate_load(
    url: str, concurrency: int, stats: LoadStats, rng: random.Random, stop: trio.Event
) -> None:
    """``concurrency`` clients, each sending streaming requests until ``stop`` is set."""
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def worker() -> None:
            while not stop.is_set():
                prompt = rng.choice(PREFIXES) + f"Question {rng.randrange(10**6)}?"
                body = {
                    "model": "sim-model",
                    "prompt": prompt,
                    "stream": True,
                    "max_tokens": rng.randint(40, 160),
                }
                started = trio.current_time()
                first = None
                try:
                    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                        async for _ in resp.aiter_raw():
                            if first is None:
                                first = trio.current_time() - started
                        ok = resp.status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok and first is not None:
                    stats.done += 1
                    stats.ttfb.append(first)
                else:
                    stats.failed += 1

        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)


async def engine_truth(client: httpx.AsyncClient, sims: Sequence[SimServer]) -> dict[str, int]:
    """``url@rank`` -> running + waiting, as the simulators report it."""
    out: dict[str, int] = {}
    for sim in sims:
        stats: dict[str, Any] = (await client.get(sim.url + "/sim/stats")).json()
        for engine in stats["engines"]:
            out[f"{sim.url}@{engine['rank']}"] = engine["running"] + engine["waiting"]
    return out


def render(router: RunningRouter, truth: dict[str, int], stats: LoadStats, left: float) -> str:
    lines = [f"trio-pdrouter demo  {router.url}   {left:5.1f}s left   (Ctrl-C stops)", ""]
    lines.append(f"{'endpoint':<36} {'role':<8} {'router':>7} {'engine':>7}")
    snapshot = router.ledger.snapshot()
    for role in ("prefill", "decode"):
        for key, n in snapshot.get(role, {}).items():
            lines.append(f"{key:<36} {role:<8} {n:>7} {truth.get(key, 0):>7}")
    lines.append("")
    lines.append(
        f"requests done {stats.done}   failed {stats.failed}   "
        f"TTFT p50 {stats.percentile(0.5):.0f} ms   p99 {stats.percentile(0.99):.0f} ms"
    )
    return "\n".join(lines)


async def run_demo(seconds: float, concurrency: int, interactive: bool) -> LoadStats:
    sim = SimConfig(port=0, dp_size=4)
    prefill = SimServer(attrs.evolve(sim, role="prefill"))
    decode = SimServer(attrs.evolve(sim, role="decode"))
    stats = LoadStats()
    async with trio.open_nursery() as nursery:
        await nursery.start(prefill.run)
        await nursery.start(decode.run)
        config = RouterConfig(
            pd=True,
            prefill_urls=(prefill.url,),
            decode_urls=(decode.url,),
            dp_size=4,
            policy="cache_aware",
            policy_settings=PolicySettings(
                cache_threshold=0.5, balance_abs_threshold=32, balance_rel_threshold=1.1
            ),
            server=ServerSettings(host="127.0.0.1", port=0),
        )
        router: RunningRouter = await nursery.start(run_router, config)
        stop = trio.Event()
        drained = trio.Event()

        async def load() -> None:
            await generate_load(router.url, concurrency, stats, random.Random(7), stop)
            drained.set()

        nursery.start_soon(load)
        deadline = trio.current_time() + seconds
        async with httpx.AsyncClient(timeout=10) as client:
            last_plain = -math.inf
            while (now := trio.current_time()) < deadline:
                truth = await engine_truth(client, [prefill, decode])
                view = render(router, truth, stats, deadline - now)
                if interactive:
                    sys.stdout.write("\x1b[H\x1b[2J" + view + "\n")
                    sys.stdout.flush()
                elif now - last_plain >= 2.0:
                    last_plain = now
                    print(view.splitlines()[-1], flush=True)
                await trio.sleep(0.25)
        stop.set()  # clients finish the request they are in, then stop
        with trio.move_on_after(30):
            await drained.wait()
        nursery.cancel_scope.cancel()
    return stats


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m trio_pdrouter.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to run")
    parser.add_argument("--concurrency", type=int, default=48, help="concurrent clients")
    args = parser.parse_args(argv)
    interactive = sys.stdout.isatty()
    try:
        stats = trio.run(run_demo, args.seconds, args.concurrency, interactive)
    except KeyboardInterrupt:
        print("\nstopped")
        return
    print(
        f"\nsummary: {stats.done} requests done, {stats.failed} failed, TTFT p50"
        f" {stats.percentile(0.5):.0f} ms, p99 {stats.percentile(0.99):.0f} ms"
    )
    if stats.failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
