"""Server-sent events as vLLM writes them: ``data: <json>\\n\\n`` ... ``data: [DONE]\\n\\n``.

Upstream reads do not align with events. The relay passes bytes through untouched but only up to
the last complete event, holding back a partial tail until its end arrives. That keeps the
pass-through path to one ``bytes.rfind`` per read, and it means the client's stream is always at an
event boundary, so an error event can be appended after a mid-stream failure and still parse.

Rules of the framer:

* Linear: each byte is scanned once. A partial tail is kept as a list of reads and joined once,
  when its end arrives, so an upstream line that never ends costs its length, not its square.
* Bounded: a partial event larger than ``limit`` bytes raises :class:`EventTooLarge`; the relay
  then ends the stream with an error instead of holding an endless line.
"""

from __future__ import annotations

from .errors import RouterError

SEPARATOR = b"\n\n"
DONE = b"data: [DONE]\n\n"


def error_event(error: RouterError) -> bytes:
    """The event vLLM sends when a stream fails after its 200: the error object, then [DONE]."""
    return b"data: " + error.body() + SEPARATOR + DONE


class EventTooLarge(Exception):
    """An upstream event grew past the framer's limit without ending."""


class EventFramer:
    """Splits an upstream byte stream into runs of whole events.

    >>> framer = EventFramer(limit=1024)
    >>> framer.feed(b"data: 1\\n\\ndata: 2")
    b'data: 1\\n\\n'
    >>> framer.feed(b"\\n\\n")
    b'data: 2\\n\\n'
    """

    __slots__ = ("_limit", "_parts", "_size", "saw_done")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        #: The reads of the partial event, in order, and their total size.
        self._parts: list[bytes] = []
        self._size = 0
        #: True once the last complete event passed on was ``data: [DONE]``.
        self.saw_done = False

    @property
    def pending(self) -> bytes:
        """Bytes of an event whose end has not arrived yet."""
        return b"".join(self._parts)

    def feed(self, chunk: bytes) -> bytes:
        """Take one upstream read; return the complete events it finishes (maybe ``b""``)."""
        cut = chunk.rfind(SEPARATOR)
        if cut >= 0:
            cut += len(SEPARATOR)
        elif self._parts and chunk[:1] == b"\n" and self._parts[-1][-1:] == b"\n":
            cut = 1  # the separator straddles the previous read and this one
        else:
            if chunk:
                self._parts.append(chunk)
                self._size += len(chunk)
                if self._size > self._limit:
                    raise EventTooLarge(f"an upstream event grew past {self._limit} bytes")
            return b""
        if self._parts:
            complete = b"".join((*self._parts, chunk[:cut]))
            self._parts.clear()
        else:
            complete = chunk if cut == len(chunk) else chunk[:cut]
        rest = chunk[cut:]
        self._parts = [rest] if rest else []
        self._size = len(rest)
        self.saw_done = complete.endswith(DONE)
        return complete
