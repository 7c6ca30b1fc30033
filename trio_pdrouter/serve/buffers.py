"""Decode output held for clients: bounded per request and across the whole process.

Rules of this module:

* A :class:`RelayBuffer` carries one stream's bytes from its upstream reader to its writer and
  never blocks the reader. A ``put`` that would take it past its own limit
  (``--max-buffered-bytes``) raises :class:`RelayOverflow` and queues nothing: the client is too
  far behind, the stream ends.
* A :class:`BufferBudget` counts the bytes of every live buffer of the process, from the ``put``
  that brought them until the send that took them has finished (the next ``take``), or the
  buffer is discarded. Past its limit (``--max-total-buffered-bytes``), the buffers with the
  most bytes queued are emptied, furthest behind first, until the total fits again; each one's
  reader then raises :class:`RelayOverflow` at its next ``put``. Only open buffers (whose reader
  still puts) are emptied: a finished stream's last bytes are left to the client write timeout.
* A writer takes at most :data:`PIECE_BYTES` per send, oldest bytes first (a longer backlog
  goes out in several sends), so a send blocked on a client measures that client's progress.
* Every buffer is discarded exactly once (:meth:`RelayBuffer.discard`, in the relay's
  ``finally``), which gives all its bytes back, so the budget's total returns to exactly 0.
"""

from __future__ import annotations

from collections import deque

import trio

from .outcomes import LegFailure

#: The most bytes one send to a client carries. A client that reads slowly but steadily
#: finishes each send, however far behind it is, so the write timeout
#: (``--client-write-timeout-secs``) measures its progress, not the size of its backlog.
PIECE_BYTES = 64 * 1024


class RelayOverflow(Exception):
    """The client fell more than a limit behind the engine (its own, or the process's)."""


class BufferBudget:
    """The bytes every live :class:`RelayBuffer` holds, and their limit (see the module doc)."""

    __slots__ = ("_buffers", "limit", "total")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self._buffers: set[RelayBuffer] = set()

    def join(self, buffer: RelayBuffer) -> None:
        self._buffers.add(buffer)

    def leave(self, buffer: RelayBuffer) -> bool:
        """Forget ``buffer``; False if it had left already."""
        if buffer not in self._buffers:
            return False
        self._buffers.discard(buffer)
        return True

    def make_room(self) -> None:
        """Empty the open buffers furthest behind until the total fits (the module doc)."""
        while self.total > self.limit:
            open_ = [b for b in self._buffers if b.queued and not b.closed]
            if not open_:
                return
            max(open_, key=lambda b: b.queued).evict()


class RelayBuffer:
    """Bytes from one stream's reader to its writer; never blocks the reader."""

    __slots__ = (
        "_budget",
        "_chunks",
        "_evicted",
        "_limit",
        "_taken",
        "_wakeup",
        "closed",
        "failure",
        "queued",
    )

    def __init__(self, limit: int, budget: BufferBudget) -> None:
        self._chunks: deque[bytes] = deque()
        #: Bytes put and not taken yet; bytes taken whose send has not finished.
        self.queued = 0
        self._taken = 0
        self._limit = limit
        self._budget = budget
        self._evicted = False
        self.closed = False
        self._wakeup = trio.Event()
        #: Set by the reader when the stream failed; the writer ends with an error event.
        self.failure: LegFailure | None = None
        budget.join(self)

    def put(self, data: bytes) -> None:
        """Append bytes (never blocks). Raises :class:`RelayOverflow` past either limit."""
        if self._evicted:
            raise self._furthest_behind()
        if self.queued + len(data) > self._limit:  # refused whole: never over the limit
            raise RelayOverflow(f"client is more than {self._limit} bytes behind")
        self._chunks.append(data)
        self.queued += len(data)
        self._budget.total += len(data)
        self._wakeup.set()
        if self._budget.total > self._budget.limit:
            self._budget.make_room()
            if self._evicted:
                raise self._furthest_behind()

    def _furthest_behind(self) -> RelayOverflow:
        limit = self._budget.limit
        return RelayOverflow(f"client is furthest behind while clients hold over {limit} bytes")

    def evict(self) -> None:
        """Drop what is queued (the budget's call); the reader's next ``put`` raises."""
        self._budget.total -= self.queued
        self._chunks.clear()
        self.queued = 0
        self._evicted = True

    def close(self, failure: LegFailure | None = None) -> None:
        """No more data; ``failure`` says why the stream ended early. The first close wins."""
        if not self.closed:
            self.closed = True
            self.failure = failure
            self._wakeup.set()

    def passing(self, size: int) -> None:
        """``size`` bytes go to the client without queueing (the reader sends them itself):
        they count like taken bytes, until the next ``passing``, ``take`` or ``discard``."""
        self._budget.total += size - self._taken
        self._taken = size

    async def take(self) -> bytes | None:
        """What is pending as one ``bytes`` of at most :data:`PIECE_BYTES`, or ``None`` once
        closed and drained.

        Calling it again means the previous piece was sent: its bytes leave the budget.
        """
        self._budget.total -= self._taken
        self._taken = 0
        while not self._chunks:
            if self.closed:
                return None
            await self._wakeup.wait()
            self._wakeup = trio.Event()
        data = self._next_piece()
        self._taken = len(data)
        self.queued -= len(data)
        return data

    def take_now(self) -> bytes | None:
        """:meth:`take` without waiting: the next piece, or ``None`` when nothing is pending."""
        self._budget.total -= self._taken
        self._taken = 0
        if not self._chunks:
            return None
        data = self._next_piece()
        self._taken = len(data)
        self.queued -= len(data)
        return data

    def _next_piece(self) -> bytes:
        """What is pending, oldest first, at most :data:`PIECE_BYTES` of it."""
        chunks = self._chunks
        if len(chunks) == 1 and len(chunks[0]) <= PIECE_BYTES:
            return chunks.popleft()
        out: list[bytes] = []
        room = PIECE_BYTES
        while chunks and room:
            chunk = chunks[0]
            if len(chunk) <= room:
                out.append(chunks.popleft())
                room -= len(chunk)
            else:
                out.append(chunk[:room])
                chunks[0] = chunk[room:]
                room = 0
        return b"".join(out)

    def discard(self) -> None:
        """The stream is over: every byte it still counts leaves the budget (once)."""
        if self._budget.leave(self):
            self._budget.total -= self.queued + self._taken
            self._chunks.clear()
            self.queued = self._taken = 0
