"""The streaming decode leg: an upstream reader and a downstream writer in a nursery of their own.

Why two tasks: hypercorn shields a ``send()`` to a client that stopped reading, so a relay that
reads and writes in one task would stop reading upstream while the client stalls — the engine
finishes, but the decode lease (held until upstream EOF) would stay charged. The reader therefore
owns the decode load and keeps reading into a :class:`RelayBuffer`; the writer (the request's
own task) drains the buffer and sends everything pending in one ``send()``, which also coalesces
events under load.

The buffer is bounded in bytes, and so is the sum over all streams (:mod:`.buffers`). A client
that falls further behind than either allows is treated as gone: the reader stops, which closes
the upstream connection (so the engine aborts) and releases load.

The idle limit (``stream_timeout.read``, the longest gap between two upstream reads) is one
cancel scope per stream (:class:`IdleDeadline`), not one per read: per token-paced event a fresh
scope costs more than the rest of the upstream read path.

Bytes go through untouched, but only whole SSE events (:class:`~.sse.EventFramer`): a partial
tail is held back, so an error event appended after a mid-stream failure always parses. One
event may not grow past the buffer's limit either: the stream then ends with an error.
"""

from __future__ import annotations

import math

import httpx
import trio

from . import outcomes
from .asgi import Headers, Reply
from .buffers import BufferBudget, RelayBuffer, RelayOverflow
from .legs import UpstreamCall, status_failure
from .outcomes import LegFailure
from .request import Attempt, Request
from .response_headers import passed_on, with_default
from .sse import EventFramer, EventTooLarge
from .transport import body_chunks
from .upstream import AnswerTooLarge, read_capped


class IdleDeadline:
    """The idle limit of one stream: fires between ``limit`` and ``limit + slack`` seconds after
    the last :meth:`touch`, never earlier.

    One cancel scope for the whole stream; ``touch`` (per chunk) moves its deadline forward
    only once every ``slack`` seconds (a 16th of the limit, at most one second), so a stream of
    events costs a clock read per chunk. ``limit`` ``None``: no limit.
    """

    __slots__ = ("_limit", "_refresh_at", "_slack", "scope")

    def __init__(self, limit: float | None) -> None:
        self._limit = limit
        self.scope = trio.CancelScope()
        self._slack = self._refresh_at = math.inf
        if limit is not None:
            self._slack = min(1.0, limit / 16)
            self._refresh_at = -math.inf
            self.touch()

    def touch(self) -> None:
        """Data arrived: the limit counts from now. Invariant: deadline = refresh_at + limit."""
        now = trio.current_time()
        if now >= self._refresh_at:
            assert self._limit is not None
            self._refresh_at = now + self._slack
            self.scope.deadline = self._refresh_at + self._limit

    def timeout(self, request: httpx.Request) -> httpx.ReadTimeout:
        return httpx.ReadTimeout(f"read timed out after {self._limit}s", request=request)


class _Head:
    """How the decode upstream answered, handed from the reader to the writer."""

    __slots__ = ("failure", "headers", "ready")

    def __init__(self) -> None:
        self.ready = trio.Event()
        #: The upstream's response headers that the client gets.
        self.headers: Headers = ()
        #: Set when the leg ended before streaming started.
        self.failure: LegFailure | None = None

    def open(self, headers: Headers) -> None:
        self.headers = headers
        self.ready.set()

    def fail(self, failure: LegFailure) -> None:
        self.failure = failure
        self.ready.set()


class DecodeRelay:
    """Relays a streaming decode (or regular) leg to the client.

    :meth:`run` returns the stream's tail once it ended, or the :class:`LegFailure` that ended
    it — before the response head (the proxy may retry) or after (the stream then ends with an
    error event). The decode load is released at upstream EOF, error or cancellation, never
    later because the client is slow; ``first_byte_limit`` bounds the wait for the response
    head, ``stream_timeout`` each read.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        *,
        first_byte_limit: float,
        stream_timeout: httpx.Timeout,
        max_buffered_bytes: int,
        budget: BufferBudget,
        release_at_headers: bool = False,
    ) -> None:
        self._client = client
        self._first_byte_limit = first_byte_limit
        # The transport bounds connect, write and pool; the idle limit between reads is ours.
        self._idle_limit: float | None = stream_timeout.read
        self._stream_timeout = httpx.Timeout(
            connect=stream_timeout.connect,
            read=None,
            write=stream_timeout.write,
            pool=stream_timeout.pool,
        )
        self._max_buffered_bytes = max_buffered_bytes
        self._budget = budget
        #: Test-only: reproduce the historic bug (decode load released when headers arrive).
        self._release_at_headers = release_at_headers

    async def run(self, req: Request, attempt: Attempt, call: UpstreamCall) -> Reply | LegFailure:
        head = _Head()
        buffer = RelayBuffer(self._max_buffered_bytes, self._budget)
        req.decode_sent()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read, req, attempt, call, head, buffer)
                await head.ready.wait()
                if head.failure is not None:
                    return head.failure
                # Stepped before the send: once it is under way the client may have the head.
                req.stream_started()
                headers = with_default(head.headers, b"cache-control", b"no-cache")
                await req.down.start(200, [*headers, *attempt.routing_headers()])
                while (data := await buffer.take()) is not None:
                    await req.down.chunk(data)
            return buffer.failure or Reply.tail()
        finally:
            buffer.discard()

    async def _read(
        self,
        req: Request,
        attempt: Attempt,
        call: UpstreamCall,
        head: _Head,
        buffer: RelayBuffer,
    ) -> None:
        """The upstream reader: owns the decode load until upstream EOF, error or cancel."""
        ep, stage = call.endpoint, call.stage
        request = self._client.build_request(
            "POST",
            call.url,
            content=call.content,
            headers=call.headers,
            timeout=self._stream_timeout,
        )
        limit = self._first_byte_limit
        attempt.lease.sent(ep)
        try:
            with trio.move_on_after(limit) as scope:
                resp = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            attempt.lease.release(ep)
            head.fail(req.record_failure(outcomes.transport_failure(stage, ep, exc)))
            return
        if scope.cancelled_caught:
            attempt.lease.release(ep)
            head.fail(req.record_failure(outcomes.timeout(stage, ep, f"no response in {limit:g}s")))
            return
        try:
            try:
                idle = IdleDeadline(self._idle_limit)
                with idle.scope:
                    await self._pump(req, attempt, call, resp, head, buffer, idle)
                if idle.scope.cancelled_caught:
                    raise idle.timeout(request)
            finally:
                # Released before the response closes: closing may await (a clean EOF returns
                # the connection to the pool), and load must not wait for that.
                attempt.lease.release(ep)
        except RelayOverflow as exc:
            buffer.close(req.record_failure(outcomes.client_too_slow(stage, ep, str(exc))))
        except AnswerTooLarge as exc:  # an error answer (before the head) past the cap
            head.fail(req.record_failure(outcomes.invalid(stage, ep, str(exc))))
        except EventTooLarge as exc:  # an upstream line that never ends: not held without limit
            buffer.close(req.record_failure(outcomes.invalid(stage, ep, str(exc))))
        except httpx.HTTPError as exc:
            failure = req.record_failure(outcomes.transport_failure(stage, ep, exc))
            if head.ready.is_set():  # mid-stream: the client gets an error event
                buffer.close(failure)
            else:
                head.fail(failure)
        finally:
            await resp.aclose()

    async def _pump(
        self,
        req: Request,
        attempt: Attempt,
        call: UpstreamCall,
        resp: httpx.Response,
        head: _Head,
        buffer: RelayBuffer,
        idle: IdleDeadline,
    ) -> None:
        ep = call.endpoint
        if resp.status_code != 200:
            body = await read_capped(resp, self._max_buffered_bytes)
            head.fail(req.record_failure(status_failure(call.stage, ep, resp, body)))
            return
        if self._release_at_headers:
            attempt.lease.release(ep)  # the historic bug, reproducible on purpose in tests only
        content_type = resp.headers.get("content-type", "text/event-stream")
        if not content_type.startswith("text/event-stream"):
            # Not a stream: the client asked for one, and an error event appended to it would
            # not parse. A 502 before any byte instead.
            failure = outcomes.invalid(call.stage, ep, f"a stream answered as {content_type}")
            head.fail(req.record_failure(failure))
            return
        head.open(with_default(passed_on(resp.headers), b"content-type", b"text/event-stream"))
        framer = EventFramer(self._max_buffered_bytes)
        taken = False
        async for chunk in body_chunks(resp):
            idle.touch()
            data = framer.feed(chunk)
            if data:
                if not taken and req.inf.route.error_marker not in data:
                    # The first output proves decode scheduled the request and so pulled the
                    # prefill's KV blocks (its head does not: see trio_pdrouter.lifecycle).
                    taken = True
                    req.kv_taken()
                buffer.put(data)
        if framer.pending or (req.inf.route.ends_with_done and not framer.saw_done):
            failure = outcomes.invalid(call.stage, ep, "stream ended without [DONE]")
            buffer.close(req.record_failure(failure))
        else:
            buffer.close()
            req.record_success(ep)
