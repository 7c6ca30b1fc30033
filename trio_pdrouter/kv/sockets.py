"""The ZMQ side of an event source: where an engine publishes, and sockets trio can wait on.

* Bind or connect as vLLM decides for its side: an endpoint with ``*`` binds (vLLM connects to
  it), any other connects. So vLLM started with ``tcp://*:5557`` is reached as
  ``tcp://host:5557``, and vLLM started with ``tcp://router-host:5557`` needs ``tcp://*:5557``
  here (every interface) or ``bind:tcp://router-host:5557`` (that address only: the prefix
  :data:`BIND` binds what follows it).
* A ZMQ socket's FD is edge-triggered: drain it with ``NOBLOCK`` until ``zmq.Again`` before
  waiting on it; tell trio it is going (``notify_closing``) before every close.
"""

from __future__ import annotations

import attrs
import trio
import zmq

__all__ = ["BIND", "EventSource", "attach", "close", "socket_fd"]

#: An endpoint's prefix that binds the address after it (see the module doc).
BIND = "bind:"


@attrs.frozen
class EventSource:
    """Where one engine (server URL and DP rank) publishes its events and answers replays."""

    url: str
    rank: int | None
    endpoint: str
    replay: str | None = None

    @property
    def key(self) -> str:
        return self.url if self.rank is None else f"{self.url}@{self.rank}"

    @property
    def engine(self) -> tuple[str, int | None]:
        """(server URL, DP rank): what the feeds and the policy's view are keyed by."""
        return self.url, self.rank


def attach(sock: zmq.Socket[bytes], endpoint: str) -> None:
    """Bind or connect ``sock`` to ``endpoint`` by the module doc's rule."""
    if endpoint.startswith(BIND):
        sock.bind(endpoint.removeprefix(BIND))
    elif "*" in endpoint:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


def socket_fd(sock: zmq.Socket[bytes]) -> int:
    """The socket's edge-triggered FD, for ``trio.lowlevel.wait_readable``."""
    fd = sock.getsockopt(zmq.FD)
    assert isinstance(fd, int)
    return fd


def close(sock: zmq.Socket[bytes]) -> None:
    """Tell trio the FD is going (``notify_closing``), then close without lingering."""
    trio.lowlevel.notify_closing(socket_fd(sock))
    sock.close(linger=0)
