"""The pump: one task per process moves the bytes of every pass-through stream.

Token-paced, a stream relayed by its own task costs a trio wakeup per event (the socket's
registration, the reschedule, the task switch, hypercorn's send path): more than the bytes. Once
a stream's head is out and its first event read, :class:`~.relay.DecodeRelay` hands it here
(the first event written at once, from the request's task, so the time to the first token
never waits for the pump) and the request's task waits for its end. The pump polls every
stream's engine socket in one ``epoll`` set of its own, and trio wakes it when that set has
something ready: one wakeup moves whatever arrived on all streams.

Rules:

* **What it moves.** The events the request's task has read when it hands the stream over
  (the first, written at once from that task), then upstream bodies read off the socket
  without waiting
  (:meth:`~trio_pdrouter.transport.H11ResponseStream.read_now`: de-chunked), cut into whole SSE
  events by the stream's :class:`~trio_pdrouter.http.EventFramer` (the partial tail held back,
  ``[DONE]`` seen), written to the client's socket as HTTP/1.1 chunks, one chunk per read. Only
  an answer whose engine body is chunked and whose client response is chunked (an HTTP/1.1
  client) comes here; hypercorn sends the head and the terminal chunk.
* **Never blocked by a client.** A write that does not take everything leaves the rest for
  when the socket is writable again (the client's descriptor is polled for that only then);
  what arrives meanwhile queues in the stream's :class:`~.buffers.RelayBuffer`, bounded per
  stream and per process, past which the stream ends as today's relay ends it.
* **Ends are the request's.** The engine's end (clean or not) is settled at once, from the pump:
  decode load released, the outcome recorded, the buffer closed (:class:`~.relay.Answer`). Once
  everything due is written, the request's task wakes with :data:`FINISHED` and answers the
  tail as before; a client whose socket fails wakes it with :data:`CLIENT_GONE`.
* **Taking back.** A request ended from outside (client gone, stalled, shutdown) takes its
  stream back synchronously (:meth:`Pump.take_back`, also from ``on_cancel``, before the stall
  watch closes the socket): its descriptors leave the set, and a chunk left half-written is
  given to :attr:`~trio_pdrouter.http.Downstream.unsent`, so whatever the request sends next
  still parses.
* **Idle limit.** A stream whose engine sent nothing for ``idle_limit`` seconds ends with a read
  timeout; checked every ``idle_limit / 16`` seconds (at most every second).
* **Batching.** Under light load the pump forwards at once. When recent traffic says that more
  than :data:`BATCH_EVENTS` reads would arrive within ``max_delay``, it turns every
  ``max_delay`` instead of at each wakeup, so one wakeup carries many events: no event waits
  longer than ``max_delay`` plus one turn for it (``--relay-pump-max-delay-ms``; 0: never
  batches). A turn that finds nothing costs one ``epoll`` call, and the rate it measures soon
  turns batching off.
* The stall watch (:mod:`.stalled`) sees a pumped stream as one send under way, finished each
  time a write makes progress, so a client that accepts nothing is cut as before.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
from typing import Protocol

import httpx
import trio

from ..http import Connection, Downstream, EventTooLarge
from ..transport import H11ResponseStream
from .buffers import RelayBuffer, RelayOverflow

__all__ = ["BATCH_EVENTS", "CLIENT_GONE", "FINISHED", "Pump", "Pumped"]

#: The request's task wakes with one of these.
FINISHED = "finished"  # the engine's answer ended and every byte due was written
CLIENT_GONE = "client_gone"  # a write to the client failed

#: Batch when more reads than this would arrive within ``max_delay`` (see the module doc).
BATCH_EVENTS = 4
#: How often the read rate is re-estimated, in seconds.
RATE_WINDOW = 0.1

_IN = select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP
_OUT = select.EPOLLOUT | select.EPOLLERR | select.EPOLLHUP


def _chunk(data: bytes) -> bytes:
    """``data`` as one HTTP/1.1 chunk."""
    return b"%x\r\n%b\r\n" % (len(data), data)


class Answer(Protocol):
    """What the pump settles of an engine's answer (the relay's, :mod:`.relay`)."""

    @property
    def buffer(self) -> RelayBuffer: ...

    def feed(self, data: bytes) -> bytes:
        """Whole events the read ``data`` completes (may raise ``EventTooLarge``)."""
        ...

    def upstream_ended(self) -> None:
        """The engine's body ended cleanly (it may still lack ``[DONE]``)."""
        ...

    def ended_by(self, exc: Exception) -> None:
        """``exc`` ended the engine's answer mid-stream."""
        ...


class Pumped:
    """One stream in the pump."""

    __slots__ = (
        "answer",
        "client_fd",
        "down",
        "end",
        "ended",
        "last_read",
        "offset",
        "piece",
        "up",
        "up_fd",
        "watching_client",
    )

    def __init__(
        self, answer: Answer, up: H11ResponseStream, client: Connection, down: Downstream
    ) -> None:
        self.answer = answer
        self.up = up
        fd = up.polled_fd()
        assert fd is not None
        #: The engine's descriptor while it is polled, else -1.
        self.up_fd = fd
        self.client_fd = client.fileno()
        self.down = down
        self.watching_client = False
        #: The chunk being written to the client and how much of it is written.
        self.piece = b""
        self.offset = 0
        self.last_read = trio.current_time()
        self.end: str | None = None
        self.ended = trio.Event()


class Pump:
    """Moves pass-through streams (see the module doc). :meth:`run` is a service of the
    server's nursery; :meth:`carry` is called by each request's task."""

    def __init__(self, *, max_delay: float, idle_limit: float | None) -> None:
        self._max_delay = max_delay
        self._idle_limit = idle_limit
        self._check_every = math.inf if idle_limit is None else min(1.0, idle_limit / 16)
        self._epoll = select.epoll()
        self._by_fd: dict[int, Pumped] = {}
        self._streams: set[Pumped] = set()
        self._reads = 0
        self._rate = 0.0  # reads per second, over the last RATE_WINDOW
        self._rate_since = 0.0
        self._next_check = math.inf
        #: trio's clock at the start of the current turn (a read's time, to the turn).
        self._now = 0.0

    @property
    def streams(self) -> int:
        """Streams the pump carries now."""
        return len(self._streams)

    @property
    def batching(self) -> bool:
        """Whether the pump turns every ``max_delay`` now, not at each wakeup (module doc)."""
        return self._max_delay > 0 and self._rate * self._max_delay > BATCH_EVENTS

    @staticmethod
    def can_carry(up: object, client: Connection | None) -> bool:
        """Whether a stream read from ``up`` and answered on ``client`` may come here."""
        return (
            client is not None
            and isinstance(up, H11ResponseStream)
            and up.polled_fd() is not None
            and client.fileno() >= 0
            and client.body_is_chunked()
        )

    def enter(
        self,
        answer: Answer,
        up: H11ResponseStream,
        client: Connection,
        down: Downstream,
        first: bytes,
    ) -> Pumped:
        """The stream is the pump's from now (:meth:`can_carry` said it may be); wait for its
        end with :meth:`carry`. ``first``: whole events already read and not yet sent (may be
        empty), written at once from the caller's task, so the first token waits for no turn."""
        p = Pumped(answer, up, client, down)
        self._streams.add(p)
        self._by_fd[p.up_fd] = p
        self._epoll.register(p.up_fd, _IN)
        if self._idle_limit is not None:
            self._next_check = min(self._next_check, trio.current_time() + self._check_every)
        down.sending = True
        if first:
            self._send_now(p, first)
        return p

    async def carry(self, p: Pumped) -> str:
        """Wait for the end of a stream :meth:`enter` gave the pump: :data:`FINISHED` or
        :data:`CLIENT_GONE`. Cancelled, the stream is taken back first (:meth:`take_back`)."""
        try:
            await p.ended.wait()
        finally:
            p.down.sending = False
            self.take_back(p)
        assert p.end is not None
        return p.end

    def take_back(self, p: Pumped) -> None:
        """The stream leaves the pump now (idempotent): its descriptors leave the set, a
        half-written chunk goes to ``down.unsent``; the engine's response is the caller's."""
        if p not in self._streams:
            return
        self._streams.discard(p)
        self._stop_reading(p)
        self._stop_watching_client(p)
        if 0 < p.offset < len(p.piece):
            p.down.unsent = p.piece[p.offset :]
        p.piece = b""
        p.offset = 0

    async def run(self) -> None:
        """Forever: wait until a polled socket is ready, move what is there (module doc)."""
        epoll_fd = self._epoll.fileno()
        try:
            while True:
                if self.batching:
                    # Busy: reads are surely due by then, so the set is not waited on (one
                    # trip through trio's scheduler a turn, not two).
                    await trio.sleep(self._max_delay)
                else:
                    with trio.move_on_at(self._next_check):
                        await trio.lowlevel.wait_readable(epoll_fd)
                self.turn()
        finally:
            self._epoll.close()

    def turn(self) -> None:
        """Move everything ready now, without waiting; check idle limits when due."""
        self._now = trio.current_time()
        by_fd = self._by_fd
        for fd, _ in self._epoll.poll(0):
            p = by_fd.get(fd)
            if p is None:
                continue
            if fd == p.up_fd:
                self._read(p)
            elif fd == p.client_fd and p.watching_client:
                self._write(p)
        now = self._now  # a turn takes no measurable time
        if now >= self._next_check:
            self._check_idle(now)
        if now - self._rate_since >= RATE_WINDOW:
            self._rate = self._reads / (now - self._rate_since)
            self._reads = 0
            self._rate_since = now

    def _read(self, p: Pumped) -> None:
        answer = p.answer
        try:
            data = p.up.read_now()
        except httpx.HTTPError as exc:
            self._engine_over(p, exc)
            return
        if data is None:
            self._engine_over(p, None)
            return
        if not data:
            return
        self._reads += 1
        p.last_read = self._now
        try:
            events = answer.feed(data)
            if events and (p.piece or answer.buffer.queued):
                answer.buffer.put(events)  # behind what waits: in order
                events = b""
        except (EventTooLarge, RelayOverflow) as exc:
            self._engine_over(p, exc)
            return
        if events:
            self._send_now(p, events)
        else:
            self._write(p)
        if p.up.at_end and p in self._streams:  # the end came in the same read: no socket
            self._read(p)  # event will tell it

    def _engine_over(self, p: Pumped, exc: Exception | None) -> None:
        """The engine's answer ended (``exc``: what cut it short): it is polled no more,
        settled at once, and the client gets what is left."""
        self._stop_reading(p)
        if exc is None:
            p.answer.upstream_ended()
        else:
            p.up.close()  # the engine learns at once that nobody reads on (if still open)
            p.answer.ended_by(exc)
        self._write(p)

    def _send_now(self, p: Pumped, events: bytes) -> None:
        """Nothing waits for the client: write ``events`` straight away, as one chunk; what
        its socket does not take is finished by :meth:`_write` when it is writable."""
        p.answer.buffer.passing(len(events))
        p.down.passed(events)
        p.piece, p.offset = _chunk(events), 0
        self._write_piece(p)

    def _write(self, p: Pumped) -> None:
        """Write what is due to the client until its socket takes no more (module doc)."""
        if p not in self._streams:
            return
        buffer = p.answer.buffer
        while True:
            if not p.piece:
                data = buffer.take_now()
                if data is None:
                    if buffer.closed and p.up_fd < 0:
                        self._finish(p, FINISHED)
                    else:
                        self._stop_watching_client(p)
                    return
                p.down.passed(data)
                p.piece, p.offset = _chunk(data), 0
            if not self._write_piece(p):
                return

    def _write_piece(self, p: Pumped) -> bool:
        """Write what is left of the chunk under way; True once it is all written (else the
        client's socket is watched for room, or the client is gone)."""
        piece, offset = p.piece, p.offset
        try:
            written = os.write(p.client_fd, memoryview(piece)[offset:] if offset else piece)
        except BlockingIOError:
            written = 0
        except OSError:
            self._finish(p, CLIENT_GONE)
            return False
        if written:
            p.down.sends_done += 1
            offset += written
        if offset < len(piece):
            p.offset = offset
            self._watch_client(p)
            return False
        p.piece, p.offset = b"", 0
        return True

    def _finish(self, p: Pumped, end: str) -> None:
        if p.end is None:
            p.end = end
        self.take_back(p)
        p.ended.set()

    def _check_idle(self, now: float) -> None:
        limit = self._idle_limit
        assert limit is not None
        for p in list(self._streams):
            if p.up_fd >= 0 and now - p.last_read > limit:
                timeout = httpx.ReadTimeout(f"read timed out after {limit}s", request=p.up.request)
                self._engine_over(p, timeout)
        self._next_check = now + self._check_every if self._streams else math.inf

    def _stop_reading(self, p: Pumped) -> None:
        if p.up_fd >= 0:
            # The response may have closed its socket already (an error, an end that could not
            # be reused): the kernel then dropped it from the set itself.
            with contextlib.suppress(OSError):
                self._epoll.unregister(p.up_fd)
            del self._by_fd[p.up_fd]
            p.up_fd = -1

    def _watch_client(self, p: Pumped) -> None:
        if not p.watching_client:
            p.watching_client = True
            self._by_fd[p.client_fd] = p
            self._epoll.register(p.client_fd, _OUT)

    def _stop_watching_client(self, p: Pumped) -> None:
        if p.watching_client:
            p.watching_client = False
            with contextlib.suppress(OSError):  # cut already: out of the set with its socket
                self._epoll.unregister(p.client_fd)
            del self._by_fd[p.client_fd]
