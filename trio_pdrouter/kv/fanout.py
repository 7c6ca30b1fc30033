"""``--workers N`` with KV events: the machine subscribes once, the supervisor fans frames out.

If every worker subscribed to every source itself, an endpoint the router binds (``*`` or
``bind:``) would work for one worker only (the others' bind fails), and every worker would
pull every message off the network. Instead:

* The supervisor runs :class:`KvFanout`: per :class:`~.sockets.EventSource` one
  SUB, attached by the subscriber's rule (bound here, once per machine, or connected), and one PUB
  bound on :func:`relay_endpoint` (``ipc://`` in the supervisor's private directory, the one that
  holds the machine table's lock file). Each message goes on as received: topic, sequence number and
  payload untouched and undecoded, so each worker's :class:`~trio_pdrouter.kv.feed.Feed` sees the
  engine's own numbering and finds gaps and restarts exactly as a single process does.
* Each worker subscribes to those local endpoints instead (:func:`relayed`) and keeps the
  engines' replay endpoints: vLLM binds its replay ROUTER whatever its live endpoint's mode,
  and a ROUTER answers every DEALER, so a worker that misses batches (the local PUB dropping
  past its high-water mark, a worker that started late, the replacement of a dead one)
  replays from the engine and converges as a freshly started router does.
* The supervisor forwards bytes, it does not decode: it holds no per-engine state, a worker's
  view never depends on another process's decoding, and the single-process replay rules stay
  the only ones.
* pyzmq under trio without threads, as in :mod:`trio_pdrouter.kv.subscriber`: one task per source,
  its SUB drained with ``NOBLOCK`` until ``zmq.Again`` before waiting on the edge-triggered FD; a
  send on the PUB never blocks (past its high-water mark it drops, which a worker sees as a gap).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import trio
import zmq

from .sockets import EventSource, attach, close, socket_fd

__all__ = ["KvFanout", "relay_endpoint", "relayed"]

log = logging.getLogger("trio_pdrouter.kv_events")

#: Messages forwarded before letting the supervisor's other tasks run.
_SLICE = 1000
#: Messages a socket queues (the subscriber's receive side uses the same).
_HWM = 100_000


def relay_endpoint(directory: str, n: int) -> str:
    """Where the supervisor republishes source ``n`` (its place in the sources' order)."""
    return f"ipc://{directory}/kv-{n}.sock"


def relayed(sources: Sequence[EventSource], directory: str) -> list[EventSource]:
    """A worker's view of ``sources``: live events from the supervisor's copies in
    ``directory``, replays from the engines themselves."""
    return [
        attrs.evolve(source, endpoint=relay_endpoint(directory, n))
        for n, source in enumerate(sources)
    ]


class KvFanout:
    """The machine's one subscription per source, republished locally (see the module doc)."""

    def __init__(
        self,
        sources: Sequence[EventSource],
        directory: str,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.sources = tuple(sources)
        self.directory = directory
        self._context = context or zmq.Context.instance()
        #: Messages forwarded, per source key.
        self.forwarded: dict[str, int] = {s.key: 0 for s in self.sources}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Forward until cancelled; started once every local PUB is bound (workers may then
        connect) and every source attached."""
        async with trio.open_nursery() as nursery:
            for n, source in enumerate(self.sources):
                pub = self._context.socket(zmq.PUB)
                pub.setsockopt(zmq.SNDHWM, _HWM)
                pub.bind(relay_endpoint(self.directory, n))
                sub = self._context.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.setsockopt(zmq.RCVHWM, _HWM)
                try:
                    attach(sub, source.endpoint)
                except zmq.ZMQError as exc:
                    close(sub)
                    close(pub)  # the workers get no live batches; they still replay
                    log.warning(
                        "kv events: cannot attach %s to %s: %s", source.key, source.endpoint, exc
                    )
                    continue
                nursery.start_soon(self._forward, source, sub, pub)
            task_status.started()

    async def _forward(
        self, source: EventSource, sub: zmq.Socket[bytes], pub: zmq.Socket[bytes]
    ) -> None:
        fd = socket_fd(sub)
        try:
            while True:
                forwarded = 0
                while forwarded < _SLICE:
                    try:
                        frames = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    pub.send_multipart(frames, zmq.NOBLOCK)
                    forwarded += 1
                self.forwarded[source.key] += forwarded
                if forwarded < _SLICE:
                    await trio.lowlevel.wait_readable(fd)
                else:
                    await trio.lowlevel.checkpoint()
        finally:
            close(sub)
            close(pub)
