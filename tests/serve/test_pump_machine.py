"""Model-based tests of the relay pump (trio_pdrouter.serve.pump) over real sockets.

A Hypothesis state machine runs the real :class:`Pump` with real engine connections (our
``H11Transport`` to a scripted engine listening on 127.0.0.1) and real client sockets (socket
pairs with small buffers, so a client that stops reading fills them). Rules: a stream is handed
to the pump once its first event is read (the pump writes that event, or the request's task has
sent it); the engine sends events (split anywhere across writes), ends
with or without ``[DONE]``, or breaks; the client reads, stops reading, leaves; the request is
ended from outside (shutdown, stall, disconnect: the stream is taken back); time passes past the
idle limit. After every rule the loop runs until every task is blocked, then the invariants:

* load (the answer's release) is held while the engine streams and released as soon as the
  engine's answer ended, whatever the client does, and at the latest when the request ends;
* what the client received is valid HTTP/1.1 chunked framing of whole events, in order, a
  prefix of what the engine sent; once a clean answer finished, exactly all of it;
* a request taken back leaves a half-written chunk to ``unsent``, which completes the framing;
* nothing is left behind: no descriptors in the pump's set, no bytes in the budget.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.serve.test_lifecycle_machine import TrioLoopThread
from trio_pdrouter.http import Downstream, EventFramer
from trio_pdrouter.serve import BufferBudget, Pump, RelayBuffer
from trio_pdrouter.serve.pump import CLIENT_GONE, FINISHED, Pumped
from trio_pdrouter.transport import H11ResponseStream, H11Transport, body_chunks

IDLE = 10.0
MAX_LIVE = 3
#: Small socket buffers and a small per-stream cap, so stalls and overflows happen.
SOCKET_BUFFER = 4096
STREAM_CAP = 48 * 1024
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
DONE = b"data: [DONE]\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _dechunk(raw: bytes) -> tuple[bytes, bytes]:
    """The payload of the complete chunks in ``raw``, and the bytes of a chunk not complete."""
    payload, pos = [], 0
    while True:
        cut = raw.find(b"\r\n", pos)
        if cut < 0:
            return b"".join(payload), raw[pos:]
        size = int(raw[pos:cut], 16)
        assert size > 0, "the pump never writes an empty or terminal chunk"
        end = cut + 2 + size
        if len(raw) < end + 2:
            return b"".join(payload), raw[pos:]
        assert raw[end : end + 2] == b"\r\n", "chunk data not followed by CRLF"
        payload.append(raw[cut + 2 : end])
        pos = end + 2


class Answer:
    """The engine's answer as the pump settles it (the relay's answer, without the request)."""

    def __init__(self, budget: BufferBudget) -> None:
        self.buffer = RelayBuffer(STREAM_CAP, budget)
        self.framer = EventFramer(STREAM_CAP)
        self.released = False
        self.releases = 0
        #: How the engine's answer ended: "ok", "no_done", or the exception's type name.
        self.ending: str | None = None

    def feed(self, data: bytes) -> bytes:
        return self.framer.feed(data)

    def release(self) -> None:
        self.releases += 1
        self.released = True

    def upstream_ended(self) -> None:
        assert self.ending is None, "an answer ends once"
        self.release()
        self.ending = "no_done" if self.framer.pending or not self.framer.saw_done else "ok"
        self.buffer.close()

    def ended_by(self, exc: Exception) -> None:
        assert self.ending is None, "an answer ends once"
        self.release()
        self.ending = type(exc).__name__
        self.buffer.close()


class Client:
    """The client's connection as the pump sees it (``trio_pdrouter.http.Connection``)."""

    def __init__(self, router_end: trio.socket.SocketType) -> None:
        self.router_end = router_end
        self.was_cut = False

    def fileno(self) -> int:
        return self.router_end.fileno()

    def body_is_chunked(self) -> bool:
        return True

    def cut(self) -> None:
        self.was_cut = True
        self.router_end.close()

    async def send_raw(self, data: bytes) -> None:
        raise AssertionError("the machine flushes unsent bytes itself")


class Stream:
    def __init__(self, number: int) -> None:
        self.number = number
        self.engine: trio.SocketStream
        self.engine_done = False  # the engine ended its answer (cleanly or not)
        self.events: list[bytes] = []  # sent by the engine and due to the client, in order
        self.written = b""  # what the engine wrote of them (may stop mid-event)
        self.client_end: socket.socket
        self.client_open = True
        self.received = b""
        self.answer: Answer
        self.up: H11ResponseStream
        self.down: Downstream
        self.client: Client
        self.pumped: Pumped
        self.scope = trio.CancelScope()
        self.transport = H11Transport()
        self.end: str | None = None
        self.done = False
        self.taken_back = False


class PumpMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = trio.testing.MockClock()
        self.loop = TrioLoopThread(self.clock)
        self.budget = BufferBudget(4 * STREAM_CAP)
        self.pump = Pump(max_delay=0.0, idle_limit=IDLE)
        self.streams: list[Stream] = []
        self.loop.run(self._start)

    async def _start(self) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.listener = listeners[0]
        self.port = self.listener.socket.getsockname()[1]
        self.loop.nursery.start_soon(self.pump.run)

    def _do(self, afn: Any) -> Any:
        async def step() -> Any:
            result = await afn()
            await trio.testing.wait_all_tasks_blocked()
            return result

        return self.loop.run(step)

    def _live(self) -> list[Stream]:
        return [s for s in self.streams if not s.done]

    def _pumping(self) -> list[Stream]:
        return [s for s in self._live() if not s.pumped.ended.is_set()]

    # -- rules -------------------------------------------------------------------------------

    @precondition(lambda self: len(self._live()) < MAX_LIVE)
    @rule(first_by_pump=st.booleans())
    def a_stream_reaches_the_pump(self, first_by_pump: bool) -> None:
        """After the request's task read its first event: the pump writes that event (the
        relay's way), or the request's task sent it already (the pump's contract allows both)."""
        s = Stream(len(self.streams))
        self.streams.append(s)
        self._do(lambda: self._open(s, first_by_pump))

    async def _open(self, s: Stream, first_by_pump: bool) -> None:
        url = f"http://127.0.0.1:{self.port}/v1/completions"
        got: dict[str, httpx.Response] = {}

        async def ask() -> None:
            request = httpx.Request("POST", url, content=b"{}")
            # A transport per stream: a connection handed back at a clean end is not reused.
            got["resp"] = await s.transport.handle_async_request(request)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            s.engine = await self.listener.accept()
            await s.engine.send_all(HEAD + _chunk(b"data: first\n\n"))
        up = body_chunks(got["resp"])
        assert isinstance(up, H11ResponseStream)
        s.up = up
        first = await up.__anext__()
        assert first == b"data: first\n\n"
        router_end, test_end = trio.socket.socketpair()
        router_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        s.client_end = socket.socket(fileno=os.dup(test_end.fileno()))
        test_end.close()
        s.client_end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        s.client_end.setblocking(False)
        s.client = Client(router_end)
        s.answer = Answer(self.budget)
        s.down = Downstream(self._no_send)
        assert Pump.can_carry(up, s.client)  # type: ignore[arg-type]
        if first_by_pump:
            s.events.append(first)
        else:
            first = b""  # sent by the request's task, before the pump
        s.pumped = self.pump.enter(s.answer, up, s.client, s.down, first)  # type: ignore[arg-type]
        self.loop.nursery.start_soon(self._request, s)
        if first:  # on the client's socket already: the first token waits for no turn
            s.received = s.client_end.recv(65536)
            assert _dechunk(s.received) == (first, b"")

    @staticmethod
    async def _no_send(message: Any) -> None:
        raise AssertionError("a pumped stream sends nothing through hypercorn")

    async def _request(self, s: Stream) -> None:
        """The request's task: waits for the pump, then does what the relay's exit does."""
        try:
            with s.scope:
                s.end = await self.pump.carry(s.pumped)
        finally:
            s.answer.release()  # the lease's exit: a no-op if released already
            s.answer.buffer.discard()
            s.up.close()
            s.done = True

    @precondition(lambda self: any(not s.engine_done for s in self._live()))
    @rule(
        data=st.data(),
        sizes=st.lists(st.integers(1, 12_000), min_size=1, max_size=4),
        split=st.integers(0, 100_000),
    )
    def the_engine_sends_events(self, data: st.DataObject, sizes: list[int], split: int) -> None:
        s = data.draw(st.sampled_from([s for s in self._live() if not s.engine_done]))
        events = [
            b"data: %d-%s\n\n" % (len(s.events) + i, b"x" * size) for i, size in enumerate(sizes)
        ]
        self._engine_writes(s, events, split)

    def _engine_writes(self, s: Stream, events: list[bytes], split: int) -> None:
        s.events.extend(events)
        payload = b"".join(events)
        cut = split % (len(payload) + 1)
        pieces = [p for p in (payload[:cut], payload[cut:]) if p]

        async def send() -> None:
            for piece in pieces:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await s.engine.send_all(_chunk(piece))
                    s.written += piece
                await trio.testing.wait_all_tasks_blocked()

        self._do(send)

    @precondition(lambda self: any(not s.engine_done for s in self._live()))
    @rule(data=st.data(), with_done=st.booleans(), together=st.booleans())
    def the_engine_ends(self, data: st.DataObject, with_done: bool, together: bool) -> None:
        """The last chunk, with or without ``[DONE]`` before it, in its own write or in the
        same write as the last event (one read then brings both)."""
        s = data.draw(st.sampled_from([s for s in self._live() if not s.engine_done]))
        last = b""
        if with_done and together:
            s.events.append(DONE)
            last = _chunk(DONE)
        elif with_done:
            self._engine_writes(s, [DONE], 0)
        s.engine_done = True

        async def end() -> None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await s.engine.send_all(last + b"0\r\n\r\n")
                s.written += last

        self._do(end)

    @precondition(lambda self: any(not s.engine_done for s in self._live()))
    @rule(data=st.data())
    def the_engine_breaks(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from([s for s in self._live() if not s.engine_done]))
        s.engine_done = True
        self._do(s.engine.aclose)

    @precondition(lambda self: any(s.client_open for s in self.streams))
    @rule(data=st.data())
    def the_client_reads(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from([s for s in self.streams if s.client_open]))
        self._do(lambda: self._drain(s))

    async def _drain(self, s: Stream) -> None:
        while s.client_open:
            try:
                got = s.client_end.recv(65536)
            except BlockingIOError:
                await trio.testing.wait_all_tasks_blocked()
                try:
                    got = s.client_end.recv(65536)
                except BlockingIOError:
                    return
            except OSError:
                return
            if not got:
                return
            s.received += got

    @precondition(lambda self: any(s.client_open and not s.done for s in self.streams))
    @rule(data=st.data())
    def the_client_leaves(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from([s for s in self.streams if s.client_open and not s.done]))
        s.client_open = False

        async def leave() -> None:
            s.client_end.close()

        self._do(leave)

    @precondition(lambda self: bool(self._pumping()))
    @rule(data=st.data())
    def the_request_is_ended_from_outside(self, data: st.DataObject) -> None:
        """Shutdown, a stall cut or a disconnect: ``on_cancel`` takes the stream back, the
        request's scope is cancelled; what is half-written must still complete its chunk."""
        s = data.draw(st.sampled_from(self._pumping()))

        async def end() -> None:
            self.pump.take_back(s.pumped)
            s.taken_back = True
            s.scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            await self._drain(s)
            _, partial = _dechunk(s.received)
            if s.client_open:
                _, rest = _dechunk(partial + s.down.unsent)
                assert rest == b"", "a half-written chunk must be completed by unsent"

        self._do(end)

    @rule()
    def time_passes(self) -> None:
        async def jump() -> None:
            self.clock.jump(IDLE + 1)

        self._do(jump)

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def load_is_held_exactly_while_the_engine_streams(self) -> None:
        for s in self.streams:
            a = s.answer
            if s.done or (s.engine_done and s.pumped in self.pump._streams):
                assert a.released, f"stream {s.number}: the engine ended, load not released"
            if s.done:
                continue
            if not s.engine_done and a.ending is None:
                assert not a.released, f"stream {s.number}: released while the engine streams"

    @invariant()
    def the_client_gets_whole_events_in_order(self) -> None:
        for s in self.streams:
            payload, _ = _dechunk(s.received)
            sent = b"".join(s.events)
            assert sent.startswith(payload), f"stream {s.number}: bytes not sent, or out of order"
            assert not payload or payload.endswith(b"\n\n"), "a chunk ended inside an event"
            clean = s.answer.ending == "ok" and s.end == FINISHED and s.client_open
            if clean and not s.taken_back:
                self._do(lambda s=s: self._drain(s))
                payload, partial = _dechunk(s.received)
                assert payload == sent and not partial, f"stream {s.number}: answer incomplete"

    @invariant()
    def a_client_that_fails_ends_its_request(self) -> None:
        for s in self.streams:
            if s.end == CLIENT_GONE:
                assert not s.client_open

    @invariant()
    def nothing_is_left_behind(self) -> None:
        pumping = self._pumping()
        assert self.pump.streams == len(pumping)
        if not pumping:
            assert not self.pump._by_fd, "descriptors left in the pump's set"
        if not self._live():
            assert self.budget.total == 0, "bytes left counted in the budget"
        for s in self.streams:
            assert s.answer.releases <= 2  # the pump's, then the request exit's no-op

    def teardown(self) -> None:
        async def close() -> None:
            for s in self._live():
                s.scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            for s in self.streams:
                assert s.done
                await s.engine.aclose()
                s.client_end.close()
                s.client.router_end.close()
                await s.transport.aclose()
            self.listener.socket.close()
            assert self.budget.total == 0

        try:
            self.loop.run(close)
        finally:
            self.loop.close()


TestPump = PumpMachine.TestCase


@asynccontextmanager
async def engine_stream(
    wire: bytes,
) -> AsyncIterator[tuple[trio.SocketStream, H11ResponseStream, Client, trio.socket.SocketType]]:
    """One answer from a scripted engine that first writes ``HEAD`` and ``wire``: the engine's
    end, the response stream, the router's end of a client socket pair (a :class:`Client`)
    and the client's own end; all closed afterwards."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    transport = H11Transport()
    router_end, test_end = trio.socket.socketpair()
    got: dict[str, httpx.Response] = {}

    async def ask() -> None:
        request = httpx.Request("POST", f"http://127.0.0.1:{port}/v1/completions", content=b"{}")
        got["resp"] = await transport.handle_async_request(request)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        engine = await listeners[0].accept()
        await engine.send_all(HEAD + wire)
    up = body_chunks(got["resp"])
    assert isinstance(up, H11ResponseStream)
    try:
        yield engine, up, Client(router_end), test_end
    finally:
        up.close()
        await engine.aclose()
        await transport.aclose()
        listeners[0].socket.close()
        router_end.close()
        test_end.close()


async def test_an_answer_whose_end_came_with_its_first_event_is_not_pumped() -> None:
    """Nothing more would arrive on its socket to wake the pump: the relay reads it to its end."""
    wire = _chunk(b"data: first\n\n" + DONE) + b"0\r\n\r\n"
    async with engine_stream(wire) as (_, up, client, _):
        assert await up.__anext__() == b"data: first\n\n" + DONE
        assert not Pump.can_carry(up, client)  # type: ignore[arg-type]
        assert up.at_end
        with pytest.raises(StopAsyncIteration):
            await up.__anext__()


async def test_a_busy_pump_turns_on_its_clock_and_waits_on_its_set_again_once_quiet(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Past the read rate that batches, the pump stops waiting on its set and turns every
    ``max_delay`` (virtual time here): every event still arrives, in order; once the engine is
    quiet for a rate window the pump says it no longer batches, and an event then arrives at
    once (without the clock moving: the pump woke on the socket, not on its clock)."""
    max_delay = 0.05  # batches past 4 / 0.05 = 80 reads a second
    pump = Pump(max_delay=max_delay, idle_limit=None)
    received = b""
    # Virtual seconds: a pump that stops turning fails, not hangs.
    with trio.fail_after(10):
        async with (
            engine_stream(_chunk(b"data: first\n\n")) as (engine, up, client, test_end),
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(pump.run)
            assert await up.__anext__() == b"data: first\n\n"
            answer = Answer(BufferBudget(4 * STREAM_CAP))
            down = Downstream(PumpMachine._no_send)
            pumped = pump.enter(answer, up, client, down, b"")  # type: ignore[arg-type]

            async def read_until(count: int) -> bytes:
                nonlocal received
                while received.count(b"\n\n") < count:
                    received += await test_end.recv(65536)
                return received

            events = [b"data: %d\n\n" % i for i in range(40)]
            for event in events[:30]:  # 200 reads a second: past the rate that batches
                await engine.send_all(_chunk(event))
                await trio.sleep(0.005)
            await read_until(30)
            assert pump.batching
            await trio.sleep(0.1 + 2 * max_delay)  # quiet for a rate window and a turn
            assert not pump.batching
            before = trio.current_time()
            await engine.send_all(_chunk(events[30]))
            await read_until(31)
            assert trio.current_time() == before, "a quiet pump forwards on the socket's wakeup"
            for event in events[31:]:
                await engine.send_all(_chunk(event))
            await engine.send_all(b"0\r\n\r\n")
            assert await pump.carry(pumped) == FINISHED
            payload, partial = _dechunk(await read_until(40))
            assert payload == b"".join(events) and not partial
            assert answer.ending == "no_done" and answer.releases == 1
            nursery.cancel_scope.cancel()
