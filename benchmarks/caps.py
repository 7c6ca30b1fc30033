"""Scenario 7, memory caps: what hostile clients and a broken upstream cost the router.

Three attacks, each on a fresh router with default flags (regular mode, round_robin):

* **non-reading clients**: 100 clients each open a stream of 30,000 fast tokens (two simulators,
  0.5 ms per token) with a 4 KiB receive window and never read. Reported: the router's RSS
  idle and at its peak while they stay connected, the bytes it says it holds for clients
  (``trio_pdrouter_buffered_bytes``), and how long until every stream was over.
* **HTTP/2 on one socket**: 20 connections open with the HTTP/2 preface (prior knowledge).
  Reported: the status line each got and the RSS after.
* **an endless upstream line** (trio-pdrouter only: it needs an upstream that misbehaves): a
  server that answers 200 ``text/event-stream`` and then writes an SSE line that never ends,
  64 KiB per write, up to 256 MiB. Four clients stream from it. Reported: the router's RSS
  peak, its CPU seconds, how many bytes the upstream could write before the router hung up,
  and the end of what each client got.

vllm-router gets the first two attacks in the same run when it is installed.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from typing import Any

import httpx
import orjson

from .common import Context
from .procs import ProcessSet, Service, start_router, start_sim

FAST_SIM = [
    "--role", "both", "--itl-base-s", "0.0005", "--itl-per-running-s", "0",
    "--prefill-base-s", "0", "--prefill-per-token-s", "0", "--max-num-seqs", "4096",
]  # fmt: skip
CLIENTS = 100
TOKENS = 30_000
H2_CONNECTIONS = 20
ENDLESS_CLIENTS = 4
ENDLESS_LIMIT = 256 * 2**20
HOLD_SECONDS = 20.0
#: The HTTP/2 connection preface and an empty SETTINGS frame.
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def estimate(profile: str) -> float:
    return 2 * (HOLD_SECONDS + 15) + 30


def _stream_request(host: str, port: int) -> bytes:
    body = orjson.dumps(
        {"model": "sim-model", "prompt": "hello " * 8, "max_tokens": TOKENS, "stream": True,
         "ignore_eos": True}
    )  # fmt: skip
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _open_non_readers(url: str) -> list[socket.socket]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    socks = []
    for _ in range(CLIENTS):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: small window
        sock.connect((host, int(port)))
        sock.sendall(_stream_request(host, int(port)))
        socks.append(sock)
    return socks


def _buffered_bytes(client: httpx.Client, router: Service) -> float:
    try:
        text = client.get(router.url + "/metrics").text
    except httpx.HTTPError:
        return float("nan")
    for line in text.splitlines():
        if line.startswith("trio_pdrouter_buffered_bytes "):
            return float(line.split()[1])
    return float("nan")


def _running(client: httpx.Client, sims: list[Service]) -> int:
    return sum(int(client.get(s.url + "/sim/stats").json()["totals"]["running"]) for s in sims)


def _non_readers(router: Service, sims: list[Service]) -> dict[str, float]:
    idle = router.rss()
    peak, held, over_at = idle, 0.0, float("nan")
    socks = _open_non_readers(router.url)
    started = time.monotonic()
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() - started < HOLD_SECONDS:  # bounded
            time.sleep(0.5)
            peak = max(peak, router.rss())
            held = max(held, _buffered_bytes(client, router))
            if over_at != over_at and _running(client, sims) == 0:
                over_at = time.monotonic() - started
    for sock in socks:
        sock.close()
    return {
        "rss_idle_mb": idle / 2**20,
        "rss_peak_mb": peak / 2**20,
        "rss_growth_mb": (peak - idle) / 2**20,
        "buffered_peak_mb": held / 2**20,
        "engines_done_after_s": over_at,
    }


def _http2(router: Service) -> dict[str, Any]:
    host, port = router.url.removeprefix("http://").rsplit(":", 1)
    before = router.rss()
    answers: dict[str, int] = {}
    for _ in range(H2_CONNECTIONS):
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(PREFACE)
            try:
                line = sock.recv(64).split(b"\r\n", 1)[0].decode(errors="replace")
            except OSError as exc:
                line = type(exc).__name__
            answers[line or "closed"] = answers.get(line or "closed", 0) + 1
    return {"answers": answers, "rss_growth_mb": (router.rss() - before) / 2**20}


class _EndlessUpstream(socketserver.ThreadingTCPServer):
    """Answers /health; any POST gets an SSE head and then a line that never ends."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _EndlessHandler)
        self.written: list[int] = []


class _EndlessHandler(socketserver.BaseRequestHandler):
    server: _EndlessUpstream

    def handle(self) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            more = self.request.recv(65536)
            if not more:
                return
            data += more
        head = data.split(b"\r\n\r\n", 1)[0]
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        rest = data.split(b"\r\n\r\n", 1)[1]
        while len(rest) < length:
            rest += self.request.recv(65536)
        if head.startswith(b"GET"):
            self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            return
        self.request.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        piece = b"10000\r\n" + b"x" * 65536 + b"\r\n"
        written = 0
        try:
            while written < ENDLESS_LIMIT:  # bounded
                self.request.sendall(piece)
                written += 65536
        except OSError:
            pass
        self.server.written.append(written)


def _endless(procs: ProcessSet) -> dict[str, Any]:
    upstream = _EndlessUpstream()
    thread = threading.Thread(target=upstream.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{upstream.server_address[1]}"
        router = start_router(procs, "router-endless", "ours", ["--worker-urls", url])
        try:
            idle, cpu = router.rss(), router.cpu_seconds()
            body = {"model": "m", "prompt": "x", "max_tokens": 10, "stream": True}
            tails = []
            peak = idle
            with httpx.Client(timeout=60.0) as client:
                for _ in range(ENDLESS_CLIENTS):
                    with client.stream("POST", router.url + "/v1/completions", json=body) as r:
                        got = b"".join(r.iter_raw())
                    tails.append(got[-120:].decode(errors="replace"))
                    peak = max(peak, router.rss())
            return {
                "rss_idle_mb": idle / 2**20,
                "rss_peak_mb": peak / 2**20,
                "router_cpu_s": router.cpu_seconds() - cpu,
                "upstream_wrote_mb": [w / 2**20 for w in upstream.written],
                "client_tails": tails,
            }
        finally:
            procs.stop(router)
    finally:
        upstream.shutdown()
        upstream.server_close()


def run(ctx: Context) -> dict[str, Any]:
    result: dict[str, Any] = {
        "scenario": "caps",
        "profile": ctx.profile,
        "settings": {"sim": FAST_SIM, "clients": CLIENTS, "tokens": TOKENS, "hold_s": HOLD_SECONDS},
        "notes": [],
        "targets": {},
    }
    kinds = ctx.router_kinds(result["notes"])
    procs = ProcessSet(ctx.log_dir / "caps")
    try:
        sims = [start_sim(procs, f"sim-{i}", *FAST_SIM) for i in range(2)]
        workers = ["--worker-urls", *(s.url for s in sims), "--policy", "round_robin"]
        for label, kind in kinds:
            ctx.progress.phase(f"{CLIENTS} clients that never read, through {label}")
            router = start_router(procs, f"router-{kind}", kind, workers)
            try:
                row: dict[str, Any] = {"non_readers": _non_readers(router, sims)}
                ctx.progress.phase(f"{H2_CONNECTIONS} HTTP/2 prefaces to {label}")
                row["http2"] = _http2(router)
            finally:
                procs.stop(router)
            result["targets"][label] = row
        ctx.progress.phase("an upstream line that never ends")
        result["targets"]["trio-pdrouter"]["endless_line"] = _endless(procs)
    finally:
        procs.close()
    return result
