"""``make demo``: the router in front of simulated vLLM servers, with a live view of load.

One prefill and one decode simulator with 4 data-parallel engines each, the router with the seed
command line's policy settings (``cache_aware``, threshold 0.5, balance 32 / 1.1), and a load
generator whose streaming requests share prefixes. The view reads the router's ``/get_loads``:
per endpoint, the router's load next to what the engine itself reports (its
``vllm:num_requests_running`` + ``_waiting``, scraped by the router a few times a second) and
their difference, the drift. With exact accounting prefill's drift is 0. Decode's is 0 too once
a request's decode leg runs; before that, while its prefill runs, the router already counts it on
the decode endpoint it reserved (so concurrent arrivals see it), and the engine does not yet.

On a terminal the view redraws in place; without one it prints a plain line every two seconds.
It stops after ``--seconds`` or on Ctrl-C (a second Ctrl-C aborts at once), then prints a
summary. The exit status is 0 unless a request failed.
"""

from __future__ import annotations

import argparse
import math
import random
import signal
import sys
from collections.abc import Sequence
from typing import Any

import attrs
import httpx
import trio

from trio_pdrouter.config import RouterConfig, ServerSettings
from trio_pdrouter.routing import PolicySettings
from trio_pdrouter.server import RunningRouter, run_router
from trio_pdrouter_sim.config import SimConfig
from trio_pdrouter_sim.server import SimServer

PREFIXES = [f"You are assistant #{i}. " + "Background material. " * 60 for i in range(6)]
#: How often the view refreshes and the router scrapes the engines, in seconds.
REFRESH_S = 0.25
PLAIN_EVERY_S = 2.0


@attrs.define
class LoadStats:
    """What the load generator and the view saw."""

    done: int = 0
    failed: int = 0
    ttfb: list[float] = attrs.Factory(list)
    #: Views taken; per role, how many showed a drift of 0 on all its endpoints, and the
    #: largest drift of one endpoint.
    views: int = 0
    views_without_drift: dict[str, int] = attrs.Factory(dict)
    max_abs_drift: dict[str, int] = attrs.Factory(dict)

    def percentile(self, q: float) -> float:
        """Time to first token at quantile ``q``, in milliseconds (NaN before any request)."""
        if not self.ttfb:
            return math.nan
        ordered = sorted(self.ttfb)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    def saw(self, loads: dict[str, Any]) -> None:
        """Account for one ``/get_loads`` answer."""
        self.views += 1
        drift: dict[str, int] = loads.get("drift", {})
        for role in ("prefill", "decode"):
            worst = max((abs(drift.get(key, 0)) for key in loads.get(role, {})), default=0)
            self.max_abs_drift[role] = max(self.max_abs_drift.get(role, 0), worst)
            if worst == 0:
                self.views_without_drift[role] = self.views_without_drift.get(role, 0) + 1

    def summary(self) -> str:
        line = (
            f"summary: {self.done} requests done, {self.failed} failed, TTFT p50"
            f" {self.percentile(0.5):.0f} ms, p99 {self.percentile(0.99):.0f} ms"
        )
        for role in ("prefill", "decode") if self.views else ():
            share = 100 * self.views_without_drift.get(role, 0) / self.views
            line += (
                f"; {role} drift 0 in {share:.0f}% of {self.views} views"
                f" (max {self.max_abs_drift.get(role, 0)})"
            )
        return line


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


def render(router_url: str, loads: dict[str, Any], stats: LoadStats, left: float) -> list[str]:
    """The view: one row per endpoint, then the request counters."""
    engine: dict[str, int] = loads.get("engine", {})
    drift: dict[str, int] = loads.get("drift", {})
    lines = [
        f"trio-pdrouter demo   router {router_url}   {left:5.1f}s left   (Ctrl-C stops)",
        "",
        f"{'endpoint':<34} {'role':<8} {'router':>7} {'engine':>7} {'drift':>6}",
    ]
    for role in ("prefill", "decode"):
        for key, now in loads.get(role, {}).items():
            if key in engine:
                # The router's load at the scrape, so the row is one consistent instant.
                at_scrape, seen, diff = str(engine[key] + drift[key]), str(engine[key]), drift[key]
                mark = f"{diff:+d}" if diff else "0"
            else:
                at_scrape, seen, mark = str(now), "?", "?"
            lines.append(f"{key:<34} {role:<8} {at_scrape:>7} {seen:>7} {mark:>6}")
    lines += [
        "",
        "router = requests the router counts on the endpoint; engine = running + waiting that",
        "the engine reports (vllm:num_requests_*); drift = router - engine at that scrape.",
        "Decode's router count includes requests whose prefill still runs: drift > 0 there",
        "while prefills are in flight.",
        "",
        f"requests done {stats.done}   failed {stats.failed}   TTFT p50"
        f" {stats.percentile(0.5):.0f} ms   p90 {stats.percentile(0.9):.0f} ms"
        f"   p99 {stats.percentile(0.99):.0f} ms",
    ]
    return lines


def plain_line(elapsed: float, loads: dict[str, Any], stats: LoadStats) -> str:
    """The headless view: one line with totals."""
    router = sum(loads.get("decode", {}).values())
    engine = sum(n for key, n in loads.get("engine", {}).items() if key in loads.get("decode", {}))
    drift: dict[str, int] = loads.get("drift", {})
    prefill_drift = sum(drift.get(key, 0) for key in loads.get("prefill", {}))
    decode_drift = sum(drift.get(key, 0) for key in loads.get("decode", {}))
    return (
        f"t={elapsed:5.1f}s done={stats.done} failed={stats.failed}"
        f" ttft_p50_ms={stats.percentile(0.5):.0f} ttft_p99_ms={stats.percentile(0.99):.0f}"
        f" decode_router={router} decode_engine={engine}"
        f" prefill_drift={prefill_drift} decode_drift={decode_drift}"
    )


async def _until_ctrl_c(stopping: trio.Event) -> None:
    # Only the first Ctrl-C stops gracefully: leaving the receiver restores Python's handler,
    # so a second one raises KeyboardInterrupt and aborts.
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async for _ in signals:
            stopping.set()
            return


async def run_demo(seconds: float, concurrency: int, interactive: bool, stats: LoadStats) -> None:
    """Run the demo for ``seconds`` (or until Ctrl-C), filling ``stats``."""
    sim = SimConfig(port=0, dp_size=4)
    prefill = SimServer(attrs.evolve(sim, role="prefill"))
    decode = SimServer(attrs.evolve(sim, role="decode"))
    async with trio.open_nursery() as nursery:
        await nursery.start(prefill.run)
        await nursery.start(decode.run)
        config = RouterConfig(
            pd=True,
            prefill_urls=(prefill.url,),
            decode_urls=(decode.url,),
            dp_size=4,
            policy="cache_aware",
            prometheus_listener=False,  # /metrics on the demo's own port is enough
            policy_settings=PolicySettings(
                cache_threshold=0.5, balance_abs_threshold=32, balance_rel_threshold=1.1
            ),
            server=ServerSettings(host="127.0.0.1", port=0),
            engine_metrics_interval=REFRESH_S,
        )
        router: RunningRouter = await nursery.start(run_router, config)
        stopping = trio.Event()
        nursery.start_soon(_until_ctrl_c, stopping)
        stop_load = trio.Event()
        drained = trio.Event()

        async def load() -> None:
            await generate_load(router.url, concurrency, stats, random.Random(7), stop_load)
            drained.set()

        nursery.start_soon(load)
        began = trio.current_time()
        deadline = began + seconds
        if interactive:
            sys.stdout.write("\x1b[2J")
        async with httpx.AsyncClient(timeout=10) as client:
            last_plain = began
            while (now := trio.current_time()) < deadline and not stopping.is_set():
                loads: dict[str, Any] = (await client.get(router.url + "/get_loads")).json()
                stats.saw(loads)
                if interactive:
                    view = render(router.url, loads, stats, deadline - now)
                    # Home, each line cleared to its end, then the rest of the screen cleared:
                    # redraws in place without flicker.
                    sys.stdout.write("\x1b[H" + "".join(f"{line}\x1b[K\n" for line in view))
                    sys.stdout.write("\x1b[J")
                    sys.stdout.flush()
                elif now - last_plain >= PLAIN_EVERY_S:
                    last_plain = now
                    print(plain_line(now - began, loads, stats), flush=True)
                with trio.move_on_at(min(now + REFRESH_S, deadline)):
                    await stopping.wait()  # the next refresh, or Ctrl-C
        stop_load.set()  # clients finish the request they are in, then stop
        with trio.move_on_after(30):
            await drained.wait()
        nursery.cancel_scope.cancel()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to run")
    parser.add_argument("--concurrency", type=int, default=48, help="concurrent clients")
    args = parser.parse_args(argv)
    stats = LoadStats()
    try:
        trio.run(run_demo, args.seconds, args.concurrency, sys.stdout.isatty(), stats)
    except KeyboardInterrupt:  # the second Ctrl-C: stop without draining
        print("\naborted")
    print("\n" + stats.summary(), flush=True)
    if stats.failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
