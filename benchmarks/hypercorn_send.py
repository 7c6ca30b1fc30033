"""EXPERIMENT, not shipped: hypercorn's trio send path without its per-send lock and checkpoints.

What a change to hypercorn would save per token-paced event (the relay-cost issue keeps hypercorn
as the server and its private internals unpatched in the router; this lives in ``benchmarks/``
only). hypercorn's ``TCPServer.protocol_send`` takes a ``trio.Lock`` and a shielded
``send_all`` for every piece of every response: two trips through trio's scheduler per event,
even when the client's socket takes the bytes at once, which is nearly always.
:func:`write_at_once` replaces it, for the process that calls it, by one that first writes the
bytes in one ``os.write`` and returns without a checkpoint when the socket took them all; in
every other case (the socket full, another send under way, an error) what is left goes
hypercorn's way, so order, errors and cancellation are as before.

``python -m benchmarks.floor --write-at-once`` serves the floor relay this way; the paced
scenario reports it beside the plain floor ("floor, write at once").
"""

from __future__ import annotations

import os

import trio
from hypercorn.events import Event, RawData
from hypercorn.trio.tcp_server import TCPServer

#: Sends that went out in one write, and sends passed on to hypercorn's own path (for tests).
counts = {"at_once": 0, "passed_on": 0}


def write_at_once() -> None:
    """Patch this process's hypercorn as the module doc says (idempotent)."""
    original = TCPServer.protocol_send
    if getattr(original, "_writes_at_once", False):
        return

    async def protocol_send(self: TCPServer, event: Event) -> None:
        stream: trio.abc.Stream = self.stream  # hypercorn's annotation names its TLS stream
        if (
            type(event) is RawData
            and event.data
            and isinstance(stream, trio.SocketStream)
            and not self.send_lock.locked()
        ):
            data = event.data
            try:
                sent = os.write(stream.socket.fileno(), data)
            except OSError:  # full (BlockingIOError), closed, reset: hypercorn's way says which
                sent = 0
            if sent == len(data):
                counts["at_once"] += 1
                return
            event = RawData(data=data[sent:])
        counts["passed_on"] += 1
        await original(self, event)

    protocol_send._writes_at_once = True  # type: ignore[attr-defined]
    TCPServer.protocol_send = protocol_send  # type: ignore[method-assign]
