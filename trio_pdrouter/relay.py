"""The hand-off between a decode stream's upstream reader and its downstream writer.

Why two tasks: hypercorn shields a ``send()`` to a client that stopped reading, so a relay that
reads and writes in one task would stop reading upstream while the client stalls — the engine
finishes, but the decode lease (held until upstream EOF) would stay charged. The reader therefore
owns the lease and keeps reading into a :class:`RelayBuffer`; the writer drains the buffer and
sends everything pending in one ``send()``, which also coalesces events under load.

The buffer is bounded in bytes. A client that falls further behind than that is treated as gone:
the reader stops, which closes the upstream connection (so the engine aborts) and releases load.
"""

from __future__ import annotations

import trio

from .errors import RouterError


class RelayOverflow(Exception):
    """The client fell more than the buffer's limit behind the engine."""


class RelayBuffer:
    __slots__ = ("_chunks", "_closed", "_limit", "_size", "_wakeup", "error")

    def __init__(self, limit: int) -> None:
        self._chunks: list[bytes] = []
        self._size = 0
        self._limit = limit
        self._closed = False
        self._wakeup = trio.Event()
        #: Set by the reader when the stream failed; the writer ends with an error event.
        self.error: RouterError | None = None

    def put(self, data: bytes) -> None:
        """Append bytes (never blocks). Raises :class:`RelayOverflow` past the limit."""
        self._chunks.append(data)
        self._size += len(data)
        self._wakeup.set()
        if self._size > self._limit:
            raise RelayOverflow(f"client is more than {self._limit} bytes behind")

    def close(self, error: RouterError | None = None) -> None:
        """No more data; ``error`` says why the stream ended early. The first close wins."""
        if not self._closed:
            self._closed = True
            self.error = error
            self._wakeup.set()

    async def take(self) -> bytes | None:
        """Everything pending as one ``bytes``, or ``None`` once closed and drained."""
        while not self._chunks:
            if self._closed:
                return None
            await self._wakeup.wait()
            self._wakeup = trio.Event()
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._size = 0
        return data
