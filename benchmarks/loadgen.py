"""The load generator, run in its own process: ``python -m benchmarks.loadgen --url URL ...``.

A closed loop: ``--concurrency`` clients, each sending ``POST /v1/completions`` back to back
(``--hold``: one long request each, kept open until the end). The first ``--warmup`` seconds are
not measured (``--hold``: until every stream has started, at most ``--warmup``); then
``--seconds`` are. The client is httpx over our own h11 transport, which keeps
up with thousands of concurrent streams where httpx's stock pool does not.

Protocol with the parent process: a line ``window-start`` on stdout when measurement begins,
``window-end`` when it ends (the parent reads the router's CPU counters at those moments), and
the results as JSON in ``--out``:

``ttfb`` / ``total``  seconds to the first body byte / to the end, per request completed in
the window; ``first_bytes`` seconds to the first body byte of every request whose first byte
arrived in the window, finished or not (time to first token when streams outlast the
window); ``ok`` / ``failed`` / ``errors`` (by kind) over the window; ``events`` SSE events
received in the window; ``gaps`` the times between a stream's successive reads that brought
events, in the window, as counts per 0.1 ms (the last count: 200 ms or more); ``window_s`` the
window's real length, ``window_start_s`` when it opened (seconds after the start);
``open_streams_peak`` the most requests in flight at once.
With ``--log-requests``, ``requests`` lists every request that ended, measured or not, as
``[priority, started, first byte, ended, status]`` in seconds of the system's monotonic clock
(``time.monotonic``, the same in every process; first byte None if none came), so a parent can
line up several generators; ``--priority P --priority-share F`` gives a share F of the requests
vLLM's ``priority`` P.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from typing import Any

import httpx
import orjson
import trio

from trio_pdrouter.transport import H11Transport

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron".split()


class Workload:
    """Prompts and lengths. ``groups`` shared prefixes: ``hot`` of them take ``hot_share`` of
    the traffic, the rest share the remainder evenly; every prompt ends with a unique suffix."""

    def __init__(self, args: argparse.Namespace, seed: int) -> None:
        self.rng = random.Random(seed)
        self.min_tokens: int = args.max_tokens_min
        self.max_tokens: int = args.max_tokens
        self.hot: int = args.hot_groups
        self.cold: int = args.cold_groups
        self.hot_share: float = args.hot_share
        self.suffix_chars: int = args.suffix_chars
        prefix_chars: int = args.prefix_chars
        self.prefixes = [
            prompt_text(random.Random(1000 + g), prefix_chars, f"[group {g}] ")
            for g in range(self.hot + self.cold)
        ]
        self.long_share: float = args.long_share
        self.long_prefixes = [
            prompt_text(random.Random(5000 + g), args.long_prefix_chars, f"[long {g}] ")
            for g in range(args.long_groups)
        ]
        self.counter = 0
        self.priority_share: float = args.priority_share
        self.priority_level: int = args.priority

    def prompt(self) -> str:
        self.counter += 1
        if self.long_prefixes and self.rng.random() < self.long_share:
            long_prefix = self.rng.choice(self.long_prefixes)
            return long_prefix + prompt_text(self.rng, self.suffix_chars, f" q{self.counter} ")
        if not self.prefixes:
            return prompt_text(self.rng, self.suffix_chars, f"q{self.counter} ")
        if self.cold == 0 or (self.hot and self.rng.random() < self.hot_share):
            group = self.rng.randrange(self.hot) if self.hot else 0
        else:
            group = self.hot + self.rng.randrange(self.cold)
        return self.prefixes[group] + prompt_text(self.rng, self.suffix_chars, f" q{self.counter} ")

    def tokens(self) -> int:
        return self.rng.randint(self.min_tokens, self.max_tokens)

    def priority(self) -> int:
        """vLLM's ``priority`` for the next request (0: the field is left out)."""
        if self.priority_share and self.rng.random() < self.priority_share:
            return self.priority_level
        return 0


def prompt_text(rng: random.Random, chars: int, head: str) -> str:
    words = [head]
    size = len(head)
    while size < chars:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:chars] if chars else head


#: The event-gap histogram: 0.1 ms buckets up to 200 ms.
GAP_BUCKET_S = 0.0001
GAP_BUCKETS = 2000


class Results:
    def __init__(self) -> None:
        self.measuring = False
        self.ttfb: list[float] = []
        self.total: list[float] = []
        self.first_bytes: list[float] = []
        self.ok = 0
        self.failed = 0
        self.errors: dict[str, int] = {}
        self.events = 0
        #: Gaps between a stream's successive reads that brought events, in the window, as
        #: counts per GAP_BUCKET_S (the last bucket: that long or longer): how events are paced
        #: as the client sees them.
        self.gaps = [0] * GAP_BUCKETS
        self.in_flight = 0
        self.open_streams_peak = 0
        self.clients = 0
        #: Responses that have started (first body byte); with ``--hold``, the window opens
        #: when every client's stream has started (or when the warm-up runs out).
        self.streaming = 0
        self.all_streaming = trio.Event()
        #: With --log-requests: [priority, started, first byte, ended, status] per request.
        self.requests: list[list[float | int | None]] | None = None

    def as_json(self, window_s: float, window_start_s: float) -> dict[str, Any]:
        return {
            "ttfb": [round(x, 6) for x in self.ttfb],
            "total": [round(x, 6) for x in self.total],
            "first_bytes": [round(x, 6) for x in self.first_bytes],
            "ok": self.ok,
            "failed": self.failed,
            "errors": self.errors,
            "events": self.events,
            "gaps": self.gaps,
            "window_s": window_s,
            "window_start_s": window_start_s,
            "open_streams_peak": self.open_streams_peak,
            **({} if self.requests is None else {"requests": self.requests}),
        }


async def client_loop(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    workload: Workload,
    stream: bool,
    hold: bool,
    results: Results,
) -> None:
    """One closed-loop client: a request, then the next, until cancelled."""
    while True:
        ask: dict[str, Any] = {
            "model": "sim-model",
            "prompt": workload.prompt(),
            "max_tokens": workload.tokens(),
            "stream": stream,
            "ignore_eos": True,
        }
        priority = workload.priority()
        if priority:
            ask["priority"] = priority
        body = orjson.dumps(ask)
        started = trio.current_time()
        wall_started = time.monotonic()
        first: float | None = None
        status = 0
        results.in_flight += 1
        results.open_streams_peak = max(results.open_streams_peak, results.in_flight)
        try:
            async with client.stream("POST", url, content=body, headers=headers) as resp:
                status = resp.status_code
                last = b""
                last_event_at: float | None = None
                async for chunk in resp.aiter_raw():
                    if first is None:
                        first = trio.current_time() - started
                        if results.measuring:
                            results.first_bytes.append(first)
                        results.streaming += 1
                        if results.streaming == results.clients:
                            results.all_streaming.set()
                    # An event ends with a blank line; one byte of carry catches a "\n\n"
                    # split across two reads.
                    n = (last + chunk).count(b"\n\n")
                    last = chunk[-1:]
                    if n:
                        now = trio.current_time()
                        if results.measuring and last_event_at is not None:
                            bucket = int((now - last_event_at) / GAP_BUCKET_S)
                            results.gaps[min(bucket, GAP_BUCKETS - 1)] += 1
                        last_event_at = now
                    if results.measuring:
                        results.events += n
            error = None if status == 200 else f"http {status}"
        except httpx.HTTPError as exc:
            error = type(exc).__name__
        finally:
            results.in_flight -= 1
        if results.requests is not None:
            first_at = None if first is None else wall_started + first
            results.requests.append([priority, wall_started, first_at, time.monotonic(), status])
        if results.measuring:
            if error is None and first is not None:
                results.ok += 1
                results.ttfb.append(first)
                results.total.append(trio.current_time() - started)
            else:
                results.failed += 1
                kind = error or "empty body"
                results.errors[kind] = results.errors.get(kind, 0) + 1
        if hold:
            await trio.sleep_forever()


async def main_async(args: argparse.Namespace) -> None:
    results = Results()
    results.clients = args.concurrency
    if args.log_requests:
        results.requests = []
    headers = {"content-type": "application/json"}
    if args.api_key:
        headers["authorization"] = f"Bearer {args.api_key}"
    transport = H11Transport(max_connections_per_host=args.concurrency + 8)
    timeout = httpx.Timeout(args.timeout, connect=args.timeout)
    url = args.url.rstrip("/") + "/v1/completions"
    begun = trio.current_time()
    async with (
        httpx.AsyncClient(transport=transport, timeout=timeout) as client,
        trio.open_nursery() as nursery,
    ):
        for i in range(args.concurrency):
            workload = Workload(args, seed=args.seed * 100_003 + i)
            nursery.start_soon(
                client_loop, client, url, headers, workload, args.stream, args.hold, results
            )
            if args.ramp and i % 50 == 49:
                # Open connections in batches: a listen backlog overflow is not what we measure.
                await trio.sleep(args.ramp)
        if args.hold:
            with trio.move_on_after(args.warmup):
                await results.all_streaming.wait()
        else:
            await trio.sleep(args.warmup)
        results.measuring = True
        started = trio.current_time()
        window_start = started - begun
        print("window-start", flush=True)
        await trio.sleep(args.seconds)
        results.measuring = False
        window = trio.current_time() - started
        print("window-end", flush=True)
        nursery.cancel_scope.cancel()
    await trio.Path(args.out).write_bytes(orjson.dumps(results.as_json(window, window_start)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loadgen", description=__doc__)
    p.add_argument("--url", required=True, help="router or server base URL")
    p.add_argument("--out", required=True, help="where to write the JSON results")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument(
        "--warmup",
        type=float,
        default=1.0,
        help="seconds not measured (--hold: at most this long, until every stream has started)",
    )
    p.add_argument("--seconds", type=float, default=5.0, help="seconds measured")
    p.add_argument("--stream", action="store_true", help="stream=true requests")
    p.add_argument("--hold", action="store_true", help="one request per client, held open")
    p.add_argument("--max-tokens", type=int, default=16, help="most tokens per request")
    p.add_argument("--max-tokens-min", type=int, default=None, help="fewest (default: same)")
    p.add_argument("--prefix-chars", type=int, default=0, help="shared prefix length")
    p.add_argument("--hot-groups", type=int, default=0, help="prefix groups that are hot")
    p.add_argument("--cold-groups", type=int, default=0, help="prefix groups that are cold")
    p.add_argument("--hot-share", type=float, default=0.0, help="share of hot-group traffic")
    p.add_argument("--long-share", type=float, default=0.0, help="share of long prompts")
    p.add_argument("--long-groups", type=int, default=0, help="prefix groups of long prompts")
    p.add_argument("--long-prefix-chars", type=int, default=0, help="long prompts' prefix")
    p.add_argument("--suffix-chars", type=int, default=64, help="unique part of every prompt")
    p.add_argument("--api-key", default=None, help="send Authorization: Bearer KEY")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout")
    p.add_argument("--ramp", type=float, default=0.0, help="pause after every 50 clients")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--priority", type=int, default=0, help="vLLM priority of some requests")
    p.add_argument("--priority-share", type=float, default=0.0, help="share given --priority")
    p.add_argument("--log-requests", action="store_true", help="every request's times")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.max_tokens_min is None:
        args.max_tokens_min = args.max_tokens
    if args.prefix_chars == 0:
        args.hot_groups = args.cold_groups = 0
    trio.run(main_async, args)


if __name__ == "__main__":
    main()
