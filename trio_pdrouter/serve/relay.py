"""The streaming decode leg: the request's task reads the engine and sends to the client, and
hands reading to a task of its own when the client holds a send.

Why a hand-off: hypercorn shields a ``send()`` to a client that stopped reading, so a task
that reads and writes would stop reading upstream while the client stalls — the engine
finishes, but the decode lease (held until upstream EOF) would stay charged. Why not a reader
task from the start: token-paced, one upstream read and one send per event, a second task
costs a wakeup per event. So the request's task sends each event itself (an :class:`_Answer`
"inline") while the client keeps up, and :meth:`DecodeRelay.sweep` (every ``takeover_after / 2``
seconds) gives every answer whose send has been under way for ``takeover_after`` seconds
(:data:`TAKEOVER_AFTER`, 100 ms: on a saturated CPU a send that does not block can take tens of
milliseconds to return, and 20 ms handed half the streams of a 256-stream run to readers) a
reader of its own, in the answer's nursery, that reads into a :class:`RelayBuffer`; the
request's task, once its send returns, drains that buffer and sends everything pending in one
``send()``, which also coalesces events under load. Whoever reads the engine's EOF (or error)
releases decode load at once; a client that accepts nothing delays that by at most
``1.5 * takeover_after``. A request ended from outside (stall cut, shutdown) while a send holds
its task is handed off at once, so the cancellation closes the engine's response.

The buffer is bounded in bytes, and so is the sum over all streams (:mod:`.buffers`). A client
that falls further behind than either allows is treated as gone: the reader stops, which closes
the upstream connection (so the engine aborts) and releases load.

With a pump (:mod:`.pump`, the default), a pass-through stream goes there once its first event
is read (the pump writes it at once, from the request's task) and the request's task waits for
its end; the takeover above then only covers the head.

The idle limit (``stream_timeout.read``, the longest gap between two upstream reads) is one
cancel scope per reading task (:class:`IdleDeadline`), not one per read: per token-paced event a
fresh scope costs more than the rest of the upstream read path.

Bytes go through untouched, but only whole SSE events
(:class:`~trio_pdrouter.http.sse.EventFramer`): a partial tail is held back, so an error event
appended after a mid-stream failure always parses. One event may not grow past the buffer's limit
either: the stream then ends with an error.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import httpx
import trio

from ..http import (
    AnswerTooLarge,
    EventFramer,
    EventTooLarge,
    LegClient,
    Reply,
    passed_on,
    read_capped,
    with_default,
)
from ..transport import H11ResponseStream, SendSide, body_chunks
from . import outcomes
from .buffers import BufferBudget, RelayBuffer, RelayOverflow
from .legs import UpstreamCall, status_failure
from .outcomes import LegFailure
from .pump import CLIENT_GONE, Pump
from .request import Attempt, Request


class IdleDeadline:
    """The idle limit of one stream: fires between ``limit`` and ``limit + slack`` seconds after
    the last :meth:`touch`, never earlier.

    One cancel scope for the whole stream; ``touch`` (per chunk) moves its deadline forward
    only once every ``slack`` seconds (a 16th of the limit, at most one second), so a stream of
    events costs a clock read per chunk. ``limit`` ``None``: no limit.
    """

    __slots__ = ("_limit", "_refresh_at", "_slack", "last", "scope")

    def __init__(self, limit: float | None) -> None:
        self._limit = limit
        self.scope = trio.CancelScope()
        self._slack = self._refresh_at = math.inf
        #: When data last arrived (or the deadline was made).
        self.last = trio.current_time()
        if limit is not None:
            self._slack = min(1.0, limit / 16)
            self._refresh_at = -math.inf
            self.touch()

    def touch(self) -> None:
        """Data arrived: the limit counts from now. Invariant: deadline = refresh_at + limit."""
        self.last = now = trio.current_time()
        if now >= self._refresh_at:
            assert self._limit is not None
            self._refresh_at = now + self._slack
            self.scope.deadline = self._refresh_at + self._limit

    def timeout(self, request: httpx.Request) -> httpx.ReadTimeout:
        return httpx.ReadTimeout(f"read timed out after {self._limit}s", request=request)


#: How long one send to a client may be under way before the engine gets a reader of its own.
TAKEOVER_AFTER = 0.1


class _Answer:
    """One decode answer being relayed: read by the request's task, or after a takeover by a
    reader of its own (never both: the request's task reads only while :attr:`inline`)."""

    __slots__ = (
        "attempt",
        "buffer",
        "call",
        "chunks",
        "framer",
        "idle",
        "inline",
        "nursery",
        "req",
        "resp",
    )

    def __init__(
        self,
        req: Request,
        attempt: Attempt,
        call: UpstreamCall,
        resp: httpx.Response,
        buffer: RelayBuffer,
        framer: EventFramer,
        idle: IdleDeadline,
        nursery: trio.Nursery,
    ) -> None:
        self.req = req
        self.attempt = attempt
        self.call = call
        self.resp = resp
        self.chunks = aiter(body_chunks(resp))
        self.buffer = buffer
        self.framer = framer
        #: The request task's idle limit, while it reads.
        self.idle = idle
        self.nursery = nursery
        self.inline = True

    async def next(self, idle: IdleDeadline) -> bytes | None:
        """The next whole events, or ``None`` once the engine's answer ended: then decode load
        is released and the buffer closed (with a failure if the answer was cut short)."""
        async for chunk in self.chunks:
            idle.touch()
            data = self.framer.feed(chunk)
            if data:
                return data
        self.upstream_ended()
        return None

    def feed(self, data: bytes) -> bytes:
        """The whole events an upstream read completes (the pump's reads)."""
        return self.framer.feed(data)

    def upstream_ended(self) -> None:
        """The engine's body ended: decode load is released and the buffer closed (with a
        failure if the answer was cut short)."""
        ep = self.call.endpoint
        self.attempt.lease.release(ep)
        if self.framer.pending or (self.req.inf.route.ends_with_done and not self.framer.saw_done):
            self.fail(outcomes.invalid(self.call.stage, ep, "stream ended without [DONE]"))
        else:
            self.buffer.close()
            self.req.record_success(ep)

    def ended_by(self, exc: Exception) -> None:
        """The reading task's ``exc`` ended the answer mid-stream."""
        stage, ep = self.call.stage, self.call.endpoint
        if isinstance(exc, RelayOverflow):
            self.fail(outcomes.client_too_slow(stage, ep, str(exc)))
        elif isinstance(exc, EventTooLarge):  # an upstream line that never ends
            self.fail(outcomes.invalid(stage, ep, str(exc)))
        else:
            assert isinstance(exc, httpx.HTTPError)
            self.fail(outcomes.transport_failure(stage, ep, exc))

    def fail(self, failure: LegFailure) -> None:
        self.attempt.lease.release(self.call.endpoint)
        self.buffer.close(self.req.record_failure(failure))

    def take_over(self, reader: Callable[[_Answer], Awaitable[None]]) -> None:
        """The client holds a send: reading moves to ``reader``, in a task of its own."""
        self.leave_request_task()
        self.nursery.start_soon(reader, self)

    def leave_request_task(self) -> None:
        """The request's task reads no more (a reader of its own, or the pump, does)."""
        self.inline = False
        self.idle.scope.deadline = math.inf


class DecodeRelay:
    """Relays a streaming decode (or regular) leg to the client.

    :meth:`run` returns the stream's tail once it ended, or the :class:`LegFailure` that ended
    it — before the response head (the proxy may retry) or after (the stream then ends with an
    error event). The decode load is released at upstream EOF, error or cancellation, at most
    ``1.5 * takeover_after`` later because the client accepts nothing (the module doc);
    ``first_byte_limit`` bounds the wait for the response head, ``stream_timeout`` each read.
    :meth:`watch` must run for the relay's lifetime.
    """

    def __init__(
        self,
        client: LegClient,
        *,
        first_byte_limit: float,
        stream_timeout: httpx.Timeout,
        max_buffered_bytes: int,
        budget: BufferBudget,
        pump: Pump | None,
        release_at_headers: bool = False,
        takeover_after: float = TAKEOVER_AFTER,
    ) -> None:
        self._client = client
        #: Carries pass-through streams from their first event (None: each request's task
        #: relays its stream to the end).
        self._pump = pump
        self._first_byte_limit = first_byte_limit
        # The transport bounds connect, write and pool; the idle limit between reads is ours.
        self._idle_limit: float | None = stream_timeout.read
        self._stream_limits = httpx.Timeout(
            connect=stream_timeout.connect,
            read=None,
            write=stream_timeout.write,
            pool=stream_timeout.pool,
        ).as_dict()
        self._max_buffered_bytes = max_buffered_bytes
        self._budget = budget
        #: Test-only: reproduce the historic bug (decode load released when headers arrive).
        self._release_at_headers = release_at_headers
        self._takeover_after = takeover_after
        #: The answers their request's task reads, candidates for :meth:`sweep`.
        self._inline: set[_Answer] = set()

    async def watch(self) -> None:
        """Runs :meth:`sweep` every ``takeover_after / 2`` seconds, for the app's lifetime."""
        while True:
            await trio.sleep(self._takeover_after / 2)
            self.sweep()

    def sweep(self) -> None:
        """Give a reader of its own to every answer whose client has held one send for
        ``takeover_after`` seconds or more since its last data (the module doc)."""
        since = trio.current_time() - self._takeover_after
        for answer in list(self._inline):
            if answer.idle.last <= since:
                self._hand_off(answer)

    def _hand_off(self, answer: _Answer) -> None:
        """If a send holds the request's task, reading ``answer`` moves to a reader of its own
        (also when the request is ended from outside: the reader's cancellation then closes
        the engine's response at once). Never while the request's task reads."""
        if answer.inline and answer.req.down.sending:
            self._inline.discard(answer)
            answer.take_over(self._read)

    async def run(self, req: Request, attempt: Attempt, call: UpstreamCall) -> Reply | LegFailure:
        """The stream's tail once it ended, or the :class:`LegFailure` that ended it (see the
        class doc)."""
        ep, stage = call.endpoint, call.stage
        limit = self._first_byte_limit
        req.decode_sent()
        req.kv_taken()  # the engine's once it has the whole request (see lifecycle)
        attempt.lease.sent(ep)
        side = SendSide()
        try:
            with trio.move_on_after(limit) as scope:
                resp = await self._client.open_post(
                    call.url, call.content, call.headers, self._stream_limits, side
                )
        except httpx.HTTPError as exc:
            attempt.lease.release(ep)
            req.kv_unless_unwritten(side)
            return req.record_failure(outcomes.transport_failure(stage, ep, exc))
        except BaseException:
            req.kv_unless_unwritten(side)
            raise
        if scope.cancelled_caught:
            attempt.lease.release(ep)
            req.kv_unless_unwritten(side)
            return req.record_failure(outcomes.timeout(stage, ep, f"no response in {limit:g}s"))
        buffer = RelayBuffer(self._max_buffered_bytes, self._budget)
        idle = IdleDeadline(self._idle_limit)
        try:
            async with trio.open_nursery() as nursery:
                answer = None
                with idle.scope:
                    failure = await self._refusal(req, call, resp)
                    if failure is not None:
                        return failure
                    framer = EventFramer(self._max_buffered_bytes)
                    answer = _Answer(req, attempt, call, resp, buffer, framer, idle, nursery)
                    self._inline.add(answer)
                    req.on_cancel = lambda: self._hand_off(answer)
                    try:
                        await self._stream(answer)
                    finally:
                        req.on_cancel = None
                        self._inline.discard(answer)
                if idle.scope.cancelled_caught:
                    timeout = idle.timeout(resp.request)
                    if answer is None:  # nothing sent: the proxy may retry
                        return req.record_failure(outcomes.transport_failure(stage, ep, timeout))
                    if answer.inline:  # the request's task was reading
                        answer.ended_by(timeout)
                while (data := await buffer.take()) is not None:
                    await req.down.chunk(data)
            return buffer.failure or Reply.tail()
        finally:
            # Released before the response closes: closing may await (a clean EOF returns
            # the connection to the pool), and load must not wait for that. (A reader of its
            # own closed it already; closing again does nothing.)
            attempt.lease.release(ep)
            buffer.discard()
            await resp.aclose()

    async def _refusal(
        self, req: Request, call: UpstreamCall, resp: httpx.Response
    ) -> LegFailure | None:
        """Why the engine's answer cannot stream to the client, or ``None`` if it can."""
        ep, stage = call.endpoint, call.stage
        if resp.status_code != 200:
            req.kv_refused()  # an error status: the engine did not take the blocks
            try:
                body = await read_capped(resp, self._max_buffered_bytes)
            except AnswerTooLarge as exc:  # an error answer past the cap
                return req.record_failure(outcomes.invalid(stage, ep, str(exc)))
            except httpx.HTTPError as exc:
                return req.record_failure(outcomes.transport_failure(stage, ep, exc))
            return req.record_failure(status_failure(stage, ep, resp, body))
        content_type = resp.headers.get("content-type", "text/event-stream")
        if not content_type.startswith("text/event-stream"):
            # Not a stream: the client asked for one, and an error event appended to it would
            # not parse. A 502 before any byte instead.
            failure = outcomes.invalid(stage, ep, f"a stream answered as {content_type}")
            return req.record_failure(failure)
        return None

    async def _stream(self, answer: _Answer) -> None:
        """The request's task: the head, then each event as it arrives, until the answer ends
        or a reader takes over."""
        req = answer.req
        if self._release_at_headers:  # the historic bug, reproducible on purpose in tests only
            answer.attempt.lease.release(answer.call.endpoint)
        # Stepped before the send: once it is under way the client may have the head.
        req.stream_started()
        headers = with_default(
            passed_on(answer.resp.headers), b"content-type", b"text/event-stream"
        )
        headers = with_default(headers, b"cache-control", b"no-cache")
        down, idle, buffer, conn = req.down, answer.idle, answer.buffer, req.connection
        await down.start(200, [*headers, *req.routing_headers()])
        try:
            while answer.inline and (data := await answer.next(idle)) is not None:
                pump = self._pump
                if pump is not None and pump.can_carry(answer.chunks, conn):
                    await self._pumped(answer, pump, data)
                    return
                buffer.passing(len(data))
                await down.chunk(data)
        except (EventTooLarge, httpx.HTTPError) as exc:
            answer.ended_by(exc)

    async def _pumped(self, answer: _Answer, pump: Pump, first: bytes) -> None:
        """The rest of the stream, from the events ``first`` just read, goes through ``pump``
        (:mod:`.pump`); the request's task waits for its end."""
        req, up, client = answer.req, answer.chunks, answer.req.connection
        assert isinstance(up, H11ResponseStream) and client is not None
        self._inline.discard(answer)  # never handed to a reader of its own now
        answer.leave_request_task()  # the pump keeps the idle limit
        carried = pump.enter(answer, up, client, req.down, first)
        req.on_cancel = lambda: pump.take_back(carried)
        if await pump.carry(carried) == CLIENT_GONE:
            req.client_lost()
            await trio.lowlevel.checkpoint()  # the request's cancellation, at once

    async def _read(self, answer: _Answer) -> None:
        """A reader of its own, after a takeover: reads into the buffer until the answer ends,
        then closes the engine's response (a client too far behind aborts the engine now, not
        when its send returns)."""
        idle = IdleDeadline(self._idle_limit)
        try:
            with idle.scope:
                while (data := await answer.next(idle)) is not None:
                    answer.buffer.put(data)
            if idle.scope.cancelled_caught:
                raise idle.timeout(answer.resp.request)
        except (RelayOverflow, EventTooLarge, httpx.HTTPError) as exc:
            answer.ended_by(exc)
        finally:
            answer.attempt.lease.release(answer.call.endpoint)  # first: closing may await
            await answer.resp.aclose()
