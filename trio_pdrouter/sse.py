"""Server-sent events as vLLM writes them: ``data: <json>\\n\\n`` ... ``data: [DONE]\\n\\n``.

Upstream reads do not align with events. The relay passes bytes through untouched but only up to
the last complete event, holding back a partial tail until its end arrives. That keeps the
pass-through path to one ``bytes.rfind`` per read, and it means the client's stream is always at an
event boundary, so an error event can be appended after a mid-stream failure and still parse.
"""

from __future__ import annotations

from .errors import RouterError

SEPARATOR = b"\n\n"
DONE = b"data: [DONE]\n\n"


def error_event(error: RouterError) -> bytes:
    """The event vLLM sends when a stream fails after its 200: the error object, then [DONE]."""
    return b"data: " + error.body() + SEPARATOR + DONE


class EventFramer:
    """Splits an upstream byte stream into runs of whole events.

    >>> framer = EventFramer()
    >>> framer.feed(b"data: 1\\n\\ndata: 2")
    b'data: 1\\n\\n'
    >>> framer.feed(b"\\n\\n")
    b'data: 2\\n\\n'
    """

    __slots__ = ("_tail", "saw_done")

    def __init__(self) -> None:
        self._tail = b""
        #: True once the last complete event passed on was ``data: [DONE]``.
        self.saw_done = False

    @property
    def pending(self) -> bytes:
        """Bytes of an event whose end has not arrived yet."""
        return self._tail

    def feed(self, chunk: bytes) -> bytes:
        """Take one upstream read; return the complete events it finishes (maybe ``b""``)."""
        data = self._tail + chunk if self._tail else chunk
        cut = data.rfind(SEPARATOR)
        if cut < 0:
            self._tail = data
            return b""
        cut += len(SEPARATOR)
        self._tail = data[cut:]
        complete = data[:cut]
        self.saw_done = complete.endswith(DONE)
        return complete
