"""Faults end to end: a real router (hypercorn) in front of real simulators on 127.0.0.1.

Clients leave at every phase of a request, with a FIN (normal close) and with a RST (``SO_LINGER``
0, then close); simulators inject upstream faults; a client stops reading while the engine keeps
producing. After each, :func:`assert_released` checks that nothing is left behind:

* the router's ledger is all zero;
* no simulator is running or queueing anything, and the engine counted an abort exactly where
  the router had to cut a generation short;
* no connection to a simulator is left open. Precisely: (1) every upstream response the router's
  transport handed out was read to its end or closed (a response neither read nor closed keeps
  its connection busy: that is the leak), and (2) the simulator's ESTABLISHED connections, less
  the one the stats probe itself uses, equal the connections the router's pool has open for that
  simulator — so each of them is an idle keep-alive connection the router knows about, and none
  is orphaned. Keep-alive connections are allowed: the pool exists to keep them.

Clients are raw trio sockets speaking HTTP/1.1, so the test controls exactly how a connection
ends. Remote effects (a simulator noticing a closed connection) are awaited with ``eventually``;
each ``/sim/stats`` read costs tens of milliseconds on a busy machine (it parses
``/proc/net/tcp``), so predicates check the router's ledger, which is cheap, first.
"""

from __future__ import annotations

import socket
import struct
from collections import Counter
from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import orjson
import pytest
import trio

import trio_pdrouter.http.upstream
from benchmarks.soak import SoakSettings, clean, soak
from tests.cluster import Cluster, eventually, start_cluster
from tests.http1 import dechunk
from trio_pdrouter.config import RetrySettings, Timeouts
from trio_pdrouter.endpoints import Role
from trio_pdrouter.transport import H11Transport
from trio_pdrouter_sim.server import SimServer

PROMPT = "Once upon a time " * 8
DONE = b"data: [DONE]\n\n"
#: One attempt per request (vllm-router's meaning of 1): each fault shows up exactly once.
NO_RETRY = RetrySettings(max_retries=1)


# -- what the router's transport handed out ----------------------------------------------------


class CountingTransport(H11Transport):
    """The router's own transport, counting responses handed out and not yet finished (read to
    their end or closed), per origin ``host:port``."""

    instances: list[CountingTransport] = []

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.unfinished: Counter[str] = Counter()
        CountingTransport.instances.append(self)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        origin = f"{request.url.host}:{request.url.port}"
        self.unfinished[origin] += 1
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _Finishing(response.stream, self.unfinished, origin)
        return response


class _Finishing(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, counts: Counter[str], origin: str) -> None:
        self._inner = inner
        self._counts = counts
        self._origin = origin
        self._finished = False

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            self._counts[self._origin] -= 1

    def __aiter__(self) -> _Finishing:
        self._chunks = self._inner.__aiter__()
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._chunks.__anext__()
        except StopAsyncIteration:
            self._finish()
            raise

    async def aclose(self) -> None:
        self._finish()  # before the await: a close inside a cancelled scope still counts
        await self._inner.aclose()


@pytest.fixture
def transports(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[CountingTransport]]:
    """Every router started in the test gets a :class:`CountingTransport` (the real h11 one)."""
    monkeypatch.setattr(trio_pdrouter.http.upstream, "H11Transport", CountingTransport)
    CountingTransport.instances = []
    yield CountingTransport.instances


# -- probes ---------------------------------------------------------------------------------------


async def sim_stats(sim: SimServer) -> dict[str, Any]:
    """``/sim/stats`` over a fresh connection (closed after), so the count of connections it
    reports includes exactly one that is not the router's: this probe's."""
    async with httpx.AsyncClient(timeout=10) as probe:
        resp = await probe.get(sim.url + "/sim/stats")
    resp.raise_for_status()
    result: dict[str, Any] = resp.json()
    return result


async def arm(sim: SimServer, spec: str, count: int = 1) -> None:
    """Apply a fault to the next ``count`` matching requests of ``sim``."""
    async with httpx.AsyncClient(timeout=10) as probe:
        resp = await probe.post(sim.url + "/sim/faults", json={"spec": spec, "count": count})
    resp.raise_for_status()


def _origin(sim: SimServer) -> str:
    return sim.url.removeprefix("http://")


async def assert_released(
    c: Cluster, transports: list[CountingTransport], *, aborted: dict[str, int]
) -> None:
    """Ledger zero, simulators idle with the expected aborts, no upstream connection busy or
    orphaned. ``aborted`` maps "prefill"/"decode" to the abort count expected on that sim."""
    sims = {"prefill": c.prefill, "decode": c.decode}

    async def ledger_zero() -> bool:
        return c.router.ledger.total() == 0

    await eventually(ledger_zero)

    async def sims_idle() -> bool:
        for group in sims.values():
            for sim in group:
                totals = (await sim_stats(sim))["totals"]
                if totals["running"] or totals["waiting"]:
                    return False
        return True

    await eventually(sims_idle)
    for role, group in sims.items():
        got = 0
        for sim in group:
            got += (await sim_stats(sim))["totals"]["aborted"]
        assert got == aborted.get(role, 0), f"{role} aborts: {got}, expected {aborted}"
    (transport,) = transports

    async def connections_settled() -> bool:
        for group in sims.values():
            for sim in group:
                origin = _origin(sim)
                on_sim = (await sim_stats(sim))["connections"] - 1  # less the probe's own
                if transport.unfinished[origin] or on_sim != transport.open_connections().get(
                    origin, 0
                ):
                    return False
        return True

    await eventually(connections_settled)
    assert c.router.ledger.total() == 0, c.router.ledger.snapshot()


# -- a client that controls how its connection ends --------------------------------------------


@attrs.define
class RawClient:
    """One HTTP/1.1 request over a plain trio socket."""

    sock: trio.socket.SocketType
    received: bytearray = attrs.Factory(bytearray)

    @classmethod
    async def send(
        cls, url: str, path: str, body: dict[str, Any], *, rcvbuf: int | None = None
    ) -> RawClient:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        if rcvbuf is not None:
            # Before connect, so the window the client advertises stays small.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        await sock.connect((host, int(port)))
        content = orjson.dumps(body)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(content)}\r\n\r\n"
        ).encode()
        data = memoryview(head + content)
        while data:
            sent = await sock.send(data)
            data = data[sent:]
        return cls(sock)

    async def read_until(self, predicate: Any) -> None:
        """Read until ``predicate(received bytes)`` holds; fails if the connection ends first."""
        while not predicate(bytes(self.received)):
            chunk = await self.sock.recv(65536)
            assert chunk, f"connection ended early: {bytes(self.received)[-300:]!r}"
            self.received += chunk

    async def read_to_end(self) -> bytes:
        """Everything up to the end of the chunked body (or the connection's end)."""
        with trio.fail_after(30):  # a guard: a body that never ends fails the test, not CI
            while not self.received.endswith(b"\r\n0\r\n\r\n"):
                chunk = await self.sock.recv(65536)
                if not chunk:
                    break
                self.received += chunk
        return bytes(self.received)

    def close(self, how: str) -> None:
        """``fin``: an orderly close. ``rst``: linger 0, so the kernel sends a RST."""
        if how == "rst":
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


def _events(raw: bytes) -> int:
    return raw.count(b'"text"')


# -- the client leaves -------------------------------------------------------------------------

PHASES = ["during_prefill", "decode_not_answered", "before_first_byte", "mid_stream"]


@pytest.mark.parametrize("how", ["fin", "rst"])
@pytest.mark.parametrize("phase", PHASES)
async def test_client_leaves(phase: str, how: str, transports: list[CountingTransport]) -> None:
    """The client closes its connection at each phase; the router closes what it opened."""
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery, retry=NO_RETRY)
        prefill, decode = c.prefill[0], c.decode[0]
        stream = phase != "decode_not_answered"
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 200, "stream": stream}
        aborted: dict[str, int]

        async def running(sim: SimServer) -> bool:
            return bool((await sim_stats(sim))["totals"]["running"] == 1)

        if phase == "during_prefill":
            await arm(prefill, "slow-prefill:30@prefill")
            client = await RawClient.send(c.url, "/v1/completions", body)
            await eventually(lambda: running(prefill))
            aborted = {"prefill": 1}
        elif phase == "decode_not_answered":
            # Non-streaming: decode answers only when done, and its (slow) prefill never is.
            await arm(decode, "slow-prefill:30@decode")
            client = await RawClient.send(c.url, "/v1/completions", body)
            await eventually(lambda: running(decode))
            aborted = {"decode": 1}
        elif phase == "before_first_byte":
            await arm(decode, "stall:0@decode")
            client = await RawClient.send(c.url, "/v1/completions", body)
            await client.read_until(lambda got: b"\r\n\r\n" in got)
            assert client.received.startswith(b"HTTP/1.1 200")
            aborted = {"decode": 1}
        else:
            await arm(decode, "stall:3@decode")
            client = await RawClient.send(c.url, "/v1/completions", body)
            await client.read_until(lambda got: _events(got) >= 3)
            aborted = {"decode": 1}
        assert c.router.ledger.by_role(Role.DECODE) == {decode.url: 1}
        client.close(how)
        await assert_released(c, transports, aborted=aborted)
        if phase == "during_prefill":
            assert (await sim_stats(decode))["totals"]["requests"] == 0
        nursery.cancel_scope.cancel()


# -- upstream faults ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "spec", "count", "stream", "status", "aborted"),
    [
        ("prefill", "error:503", 1, True, 503, {}),
        ("prefill", "reset:0", 1, False, 502, {}),
        ("decode", "error:500", 1, True, 500, {}),
        ("decode", "reset:0", 1, True, 502, {}),
        ("decode", "reset:3", 1, True, 200, {"decode": 1}),
        ("decode", "reset:2", 1, False, 502, {"decode": 1}),
    ],
)
async def test_upstream_fault(
    stage: str,
    spec: str,
    count: int,
    stream: bool,
    status: int,
    aborted: dict[str, int],
    transports: list[CountingTransport],
) -> None:
    """An engine answers 5xx or drops the connection: the client gets an error in the right
    shape (the engine's own 5xx, a 502, or after the 200 an error event and ``[DONE]``), and
    nothing stays charged.

    A warm-up request leaves a keep-alive connection to each simulator, so the faulty request
    goes out on a reused one. The transport never sends a POST twice once it reached the engine
    (the engine may have started on it), so each fault is armed for exactly one request and a
    reset after two tokens is one abort, not two.
    """
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery, retry=NO_RETRY)
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 20, "stream": stream}
        warm_up = await c.client.post(c.url + "/v1/completions", json=body)
        assert warm_up.status_code == 200
        sim = c.prefill[0] if stage == "prefill" else c.decode[0]
        await arm(sim, f"{spec}@{stage}", count)
        resp = await c.client.post(c.url + "/v1/completions", json=body)
        assert resp.status_code == status, resp.text
        if status == 200:
            assert resp.content.endswith(DONE)
            error = orjson.loads(resp.content.split(b"\n\n")[-3].removeprefix(b"data: "))
            assert error["error"]["code"] == 502
            assert _events(resp.content) == 3
        elif status == 502:
            assert resp.json()["error"]["type"] == "upstream_error"
        else:  # the engine's answer, passed through
            assert resp.json()["error"]["message"] == f"simulated fault: HTTP {status}"
        await assert_released(c, transports, aborted=aborted)
        nursery.cancel_scope.cancel()


async def test_decode_stall_hits_the_idle_timeout(transports: list[CountingTransport]) -> None:
    """An engine that stops producing mid-stream: the router gives up after the idle limit,
    ends the stream with an error event and ``[DONE]``, and closes the connection (abort)."""
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery, retry=NO_RETRY, timeouts=Timeouts(request=0.5))
        await arm(c.decode[0], "stall:2@decode")
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 20, "stream": True}
        resp = await c.client.post(c.url + "/v1/completions", json=body)
        assert resp.status_code == 200
        assert resp.content.endswith(DONE) and b'"error"' in resp.content
        assert _events(resp.content) == 2
        await assert_released(c, transports, aborted={"decode": 1})
        nursery.cancel_scope.cancel()


# -- the client stops reading ------------------------------------------------------------------

#: Tokens in the stalled-reader tests: ~230 kB of SSE, far more than the kernel buffers between
#: the router and a client whose receive buffer is 4 kB, so the router's writer really blocks.
STALLED_TOKENS = 1000


async def test_client_that_stops_reading_does_not_hold_decode_load(
    transports: list[CountingTransport],
) -> None:
    """The engine finishes and the decode load is released while the client, still connected,
    has not read a byte; the router holds the rest and delivers all of it later."""
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery, retry=NO_RETRY)
        body = {
            "model": "sim-model",
            "prompt": PROMPT,
            "max_tokens": STALLED_TOKENS,
            "stream": True,
            "ignore_eos": True,
        }
        client = await RawClient.send(c.url, "/v1/completions", body, rcvbuf=4096)

        async def engine_done() -> bool:
            totals = (await sim_stats(c.decode[0]))["totals"]
            return bool(totals["completed"] + totals["aborted"] == 1)

        await eventually(engine_done)
        totals = (await sim_stats(c.decode[0]))["totals"]
        assert (totals["completed"], totals["aborted"], totals["running"]) == (1, 0, 0)

        async def decode_released() -> bool:
            return c.router.ledger.total() == 0

        await eventually(decode_released)
        assert not client.received, "the client has not read anything yet"
        payload = dechunk(await client.read_to_end())
        assert payload.endswith(DONE) and _events(payload) == STALLED_TOKENS
        client.close("fin")
        await assert_released(c, transports, aborted={})
        nursery.cancel_scope.cancel()


async def test_client_that_accepts_nothing_is_cut_off_after_the_write_timeout(
    transports: list[CountingTransport],
) -> None:
    """The engine finished long ago; the client is still connected and reads nothing. After
    ``--client-write-timeout-secs`` the router ends the request and closes the connection."""
    async with trio.open_nursery() as nursery:
        c = await start_cluster(
            nursery, retry=NO_RETRY, listening={"write_timeout": 0.5}, max_buffered_bytes=32 * 1024
        )
        body = {
            "model": "sim-model",
            "prompt": PROMPT,
            # More than the kernel's socket buffers hold (up to 4 MiB on the sending side).
            "max_tokens": 30 * STALLED_TOKENS,
            "stream": True,
            "ignore_eos": True,
        }
        client = await RawClient.send(c.url, "/v1/completions", body, rcvbuf=4096)

        async def engine_aborted() -> bool:  # the router's buffer overflowed: load released
            return bool((await sim_stats(c.decode[0]))["totals"]["aborted"] == 1)

        await eventually(engine_aborted)
        assert c.router.ledger.total() == 0

        async def cut_off() -> bool:
            return not c.router.app.proxy.in_flight

        await eventually(cut_off)
        payload = await client.read_to_end()  # what the kernel held, then the end
        assert not payload.endswith(b"\r\n0\r\n\r\n"), "the stalled answer was not cut"
        metrics = (await c.client.get(f"{c.url}/metrics")).text
        assert 'outcome="client_stalled"' in metrics
        client.close("fin")
        await assert_released(c, transports, aborted={"decode": 1})
        nursery.cancel_scope.cancel()


async def test_client_too_far_behind_is_cut_off(transports: list[CountingTransport]) -> None:
    """Past ``max_buffered_bytes`` the stalled client is treated as gone: the engine is aborted
    and the load released. (That this happens at all shows the writer was blocked.)"""
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery, retry=NO_RETRY, max_buffered_bytes=32 * 1024)
        body = {
            "model": "sim-model",
            "prompt": PROMPT,
            "max_tokens": STALLED_TOKENS,
            "stream": True,
            "ignore_eos": True,
        }
        client = await RawClient.send(c.url, "/v1/completions", body, rcvbuf=4096)

        async def engine_aborted() -> bool:
            return bool((await sim_stats(c.decode[0]))["totals"]["aborted"] == 1)

        await eventually(engine_aborted)
        payload = dechunk(await client.read_to_end())
        assert payload.endswith(DONE) and b'"error"' in payload
        assert _events(payload) < STALLED_TOKENS
        client.close("fin")
        await assert_released(c, transports, aborted={"decode": 1})
        nursery.cancel_scope.cancel()


# -- the soak ------------------------------------------------------------------------------------


async def test_soak_500_streams_with_30_percent_disconnects_leaks_nothing() -> None:
    """``benchmarks/soak.py`` with its defaults (about 25 s): no load, no engine work and no
    file descriptor is left once 500 streams are over, 30 % of their clients having left at a
    random moment with a FIN or a RST."""
    result = await soak(SoakSettings())
    assert result["leaked_load"] == 0 and result["engines_busy"] == 0, result
    assert result.get("bad_response", 0) == 0, result
    assert result["leaked_fds"] == 0, result
    assert clean(result), result
