"""Binding the listening sockets, before anything else starts.

The router binds its ports first (the single process and the supervisor of ``--workers N``
alike) and hands the sockets to hypercorn, so a port in use or a host that does not resolve is
known at once: :class:`BindError` says which address and why in one line, and the command line
exits 2 with it.
"""

from __future__ import annotations

import errno
import socket


class BindError(Exception):
    """An address the router cannot listen on: the one-line reason is the message."""


def listening_sockets(
    host: str, port: int, backlog: int, count: int, *, reuseport: bool
) -> list[socket.socket]:
    """``count`` sockets bound and listening on one port: distinct ``SO_REUSEPORT`` sockets, or
    the same socket ``count`` times. Raises :class:`BindError` when the address cannot be had."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError, OverflowError) as exc:
        raise BindError(f"cannot listen on {host}:{port}: {_reason(exc)}") from None
    sockets: list[socket.socket] = []
    try:
        for _ in range(count if reuseport else 1):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuseport:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]  # port 0: every reuseport socket on the first one's port
            sock.listen(backlog)
            sock.set_inheritable(True)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise BindError(f"cannot listen on {host}:{port}: {_reason(exc)}") from None
    return sockets if reuseport else sockets * count


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return "the address is already in use (another process listens there)"
    if isinstance(exc, OSError) and exc.errno == errno.EADDRNOTAVAIL:
        return "no interface of this machine has that address"
    if isinstance(exc, OSError) and exc.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges)"
    if isinstance(exc, socket.gaierror):
        return f"the host does not resolve ({exc.strerror})"
    return str(getattr(exc, "strerror", None) or exc)
