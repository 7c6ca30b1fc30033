"""Soak: hundreds of streams through a real router, a share of the clients leaving at random.

Everything runs in this process on 127.0.0.1: one prefill and two decode simulators, the router
(hypercorn, the h11 upstream pool), and raw-socket clients. Each client sends one streaming
completion; 30 % of them (by default) leave at a random moment — right away, during prefill,
before the first byte, mid-stream — half with a FIN, half with a RST (``SO_LINGER`` 0). The
others read to the end and must see ``data: [DONE]``.

Afterwards nothing may be left behind:

* load: the router's ledger is all zero;
* engines: no simulator request running or waiting;
* file descriptors: this process's descriptors are sorted by what they are (see
  :func:`census`) before the streams (after a warm-up request) and after. The router's
  keep-alive pool to the simulators may grow, by design: those connections are reported, not
  counted as leaks. A leak is any other descriptor that appeared: a client connection the
  router's server still holds, a simulator end without a router end, anything else.

Usage::

    .venv/bin/python -m benchmarks.soak [--streams 500] [--disconnect-rate 0.3] [--seed 1]

Prints one ``key=value`` line per measure and exits with status 1 if anything leaked, a client
that stayed did not get ``[DONE]``, or things did not wind down within ``--settle`` seconds.
About 25 s on 2 cores with the defaults.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import socket
import struct
import sys
import time
from collections import Counter
from typing import Any

import attrs
import orjson
import trio

from trio_pdrouter.config import RouterConfig, ServerSettings
from trio_pdrouter.server import RunningRouter, run_router
from trio_pdrouter_sim.config import SimConfig
from trio_pdrouter_sim.server import SimServer

DONE = b"data: [DONE]\n\n"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


@attrs.frozen
class Plan:
    """What one client does: how many tokens it asks for, and when and how it leaves."""

    max_tokens: int
    #: ``None``: reads to the end. Else leaves after this many response bytes (0: before any).
    leave_after_bytes: int | None
    #: Or leaves after this many seconds, whichever comes first.
    leave_after_s: float
    rst: bool


def plans(n: int, disconnect_rate: float, rng: random.Random) -> list[Plan]:
    out = []
    for _ in range(n):
        max_tokens = rng.randint(10, 100)
        if rng.random() < disconnect_rate:
            # ~230 bytes per event: anywhere from "before the head" to "near the end".
            after = rng.choice([0, rng.randint(1, 230 * max_tokens)])
            out.append(Plan(max_tokens, after, rng.uniform(0.0, 0.5), rng.random() < 0.5))
        else:
            out.append(Plan(max_tokens, None, 0.0, False))
    return out


async def run_client(url: str, plan: Plan, outcomes: Counter[str]) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = orjson.dumps(
        {
            "model": "sim-model",
            "prompt": PROMPT,
            "max_tokens": plan.max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
    )
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    try:
        await sock.connect((host, int(port)))
        await _send_all(sock, request)
        received = bytearray()
        leave = plan.leave_after_bytes is not None
        with trio.move_on_after(plan.leave_after_s if leave else float("inf")):
            while not received.endswith(b"\r\n0\r\n\r\n"):
                if leave and len(received) >= (plan.leave_after_bytes or 0):
                    break
                chunk = await sock.recv(65536)
                if not chunk:
                    break
                received += chunk
        if leave:
            outcomes["left_rst" if plan.rst else "left_fin"] += 1
            if plan.rst:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif DONE in received and received.startswith(b"HTTP/1.1 200"):
            outcomes["completed"] += 1
        else:
            outcomes["bad_response"] += 1
    finally:
        sock.close()


async def _send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[await sock.send(view) :]


def census(router_port: int, sim_ports: set[int]) -> Counter[str]:
    """This process's file descriptors by what they are:

    * ``client``: the router's end of a client connection (listener excluded);
    * ``upstream``: the router's end of a connection to a simulator (its keep-alive pool), of
      which ``upstream_close_wait`` the simulator has already closed;
    * ``sim_side``: a simulator's end of such a connection;
    * ``other``: everything else (listeners, the trio loop's own descriptors, files).

    Garbage is collected first: a socket that earlier code dropped without closing is closed by
    its finaliser at an unpredictable time, which would move the count between two censuses.
    """
    gc.collect()
    inodes: dict[int, str] = {}
    count: Counter[str] = Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since listdir
            continue
        if target.startswith("socket:["):
            inodes[int(target[len("socket:[") : -1])] = fd
        else:
            count["other"] += 1
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as table:
                rows = table.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            inode = int(fields[9])
            if inodes.pop(inode, None) is None:
                continue
            local = int(fields[1].rsplit(":", 1)[1], 16)
            remote = int(fields[2].rsplit(":", 1)[1], 16)
            listening = fields[3] == "0A"
            if local == router_port and not listening:
                count["client"] += 1
            elif remote in sim_ports:
                count["upstream"] += 1
                count["upstream_close_wait"] += fields[3] == "08"
            elif local in sim_ports and not listening:
                count["sim_side"] += 1
            else:
                count["other"] += 1
    count["other"] += len(inodes)  # sockets that are not TCP (the loop's wakeup pair)
    return count


def sims_busy(sims: list[SimServer]) -> int:
    return sum(e.running + e.waiting for sim in sims for e in sim.state.engines)


@attrs.frozen
class SoakSettings:
    streams: int = 500
    disconnect_rate: float = 0.3
    seed: int = 1
    #: Seconds allowed for load, engines and connections to wind down after the streams.
    settle: float = 10.0
    #: The router's hypercorn ``keep_alive_timeout``; the router's own default unless changed.
    keep_alive_timeout: float = ServerSettings().keep_alive_timeout


async def soak(args: SoakSettings) -> dict[str, Any]:
    """Run the soak in the current trio run; the measures, as printed by :func:`main`."""
    rng = random.Random(args.seed)
    async with trio.open_nursery() as nursery:
        fast = SimConfig.fast(port=0, itl_base_s=0.002)
        prefill = SimServer(attrs.evolve(fast, role="prefill"))
        decode = [SimServer(attrs.evolve(fast, role="decode")) for _ in range(2)]
        sims = [prefill, *decode]
        for sim in sims:
            await nursery.start(sim.run)
        config = RouterConfig(
            pd=True,
            prefill_urls=(prefill.url,),
            decode_urls=tuple(d.url for d in decode),
            policy="power_of_two",
            prometheus_listener=False,
            server=ServerSettings(
                host="127.0.0.1", port=0, keep_alive_timeout=args.keep_alive_timeout
            ),
        )
        router: RunningRouter = await nursery.start(run_router, config)
        warm_up = Counter[str]()
        await run_client(router.url, Plan(5, None, 0.0, False), warm_up)
        assert warm_up["completed"] == 1, warm_up
        await _settle(router, sims, args.settle)
        ports = (int(router.url.rsplit(":", 1)[1]), {sim.state.port for sim in sims})
        before = census(*ports)

        outcomes = Counter[str]()
        started = time.perf_counter()
        async with trio.open_nursery() as clients:
            for plan in plans(args.streams, args.disconnect_rate, rng):
                clients.start_soon(run_client, router.url, plan, outcomes)
        elapsed = time.perf_counter() - started

        settled = await _settle(router, sims, args.settle)
        after = census(*ports)
        aborted = sum(e.counters.aborted for d in decode for e in d.state.engines)
        nursery.cancel_scope.cancel()
    live_upstream = after["upstream"] - after["upstream_close_wait"]
    leaks = {
        # The router's end of a client connection that is over: hypercorn still holds it.
        "client_sockets": after["client"] - before["client"],
        # A simulator's end whose router end is gone.
        "sim_unpaired": after["sim_side"] - live_upstream,
        "other": after["other"] - before["other"],
    }
    return {
        "streams": args.streams,
        **dict(sorted(outcomes.items())),
        "elapsed_s": round(elapsed, 2),
        "decode_aborted": aborted,
        "leaked_load": router.ledger.total(),
        "engines_busy": sims_busy(sims),
        "fds_before": sum(before.values()) - before["upstream_close_wait"],
        "fds_after": sum(after.values()) - after["upstream_close_wait"],
        "pool_connections": after["upstream"],
        "pool_connections_closed_by_sim": after["upstream_close_wait"],
        **{f"leaked_{key}": value for key, value in leaks.items()},
        "leaked_fds": sum(leaks.values()),
        "settled": settled,
    }


async def _settle(router: RunningRouter, sims: list[SimServer], limit: float) -> bool:
    """Wait (bounded) until no load, no engine work and no dead client connection is left and
    the descriptors stop moving; False if that does not happen within ``limit`` seconds.

    Closed connections take a moment to be noticed on the other end, so poll: the effects are in
    other servers (hypercorn, the simulators), not in anything this function could await.
    """
    ports = (int(router.url.rsplit(":", 1)[1]), {sim.state.port for sim in sims})
    previous = None
    with trio.move_on_after(limit):
        while True:
            fds = census(*ports)
            now = (router.ledger.total(), sims_busy(sims), fds["client"], sorted(fds.items()))
            if now[:3] == (0, 0, 0) and now == previous:
                return True
            previous = now
            await trio.sleep(0.2)
    return False


def main(argv: list[str] | None = None) -> int:
    defaults = SoakSettings()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__)
    parser.add_argument("--streams", type=int, default=defaults.streams)
    parser.add_argument("--disconnect-rate", type=float, default=defaults.disconnect_rate)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--timeout", type=float, default=120.0, help="give up after this long")
    parser.add_argument(
        "--settle", type=float, default=defaults.settle, help="seconds allowed to wind down"
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=defaults.keep_alive_timeout,
        help="the router's hypercorn keep_alive_timeout (default: the router's default)",
    )
    args = parser.parse_args(argv)
    settings = SoakSettings(
        args.streams, args.disconnect_rate, args.seed, args.settle, args.keep_alive_timeout
    )
    try:
        result = trio.run(_bounded, settings, args.timeout)
    except trio.TooSlowError:
        print(f"soak did not finish within {args.timeout:g}s", file=sys.stderr)
        return 1
    for key, value in result.items():
        print(f"{key}={value}")
    return 0 if clean(result) else 1


def clean(result: dict[str, Any]) -> bool:
    """Nothing leaked, every client that stayed got ``[DONE]``, everything wound down."""
    leaked = result["leaked_load"] or result["engines_busy"] or result["leaked_fds"]
    return not leaked and not result.get("bad_response") and bool(result["settled"])


async def _bounded(settings: SoakSettings, limit_s: float) -> dict[str, Any]:
    with trio.fail_after(limit_s):
        return await soak(settings)


if __name__ == "__main__":
    sys.exit(main())
