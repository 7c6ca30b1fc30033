"""What the ASGI app cannot see through hypercorn: its TCP connections (Linux ``/proc``).

ASGI gives an app neither a connection id nor the socket. Two things need them:

* ``GET /sim/stats`` reports ``connections``: the number of TCP connections clients hold open
  to the simulator. It is read from ``/proc/net/tcp`` and ``/proc/net/tcp6`` as the sockets in
  state ESTABLISHED whose *local* port is the simulator's port. That is exact (the kernel's
  own table), needs no bookkeeping in hypercorn, and does not count connections a client has
  already closed (CLOSE_WAIT) or the listening socket. A client in the same process is not
  counted twice: its side of the connection has the ephemeral port as local port.
* the ``reset`` fault must abort a connection with a RST. :func:`abort_connection` finds the
  socket by its address pair (``/proc/net/tcp`` gives the inode, ``/proc/self/fd`` the
  descriptor), sets ``SO_LINGER`` to 0 on a duplicate descriptor and shuts the socket down.
  The peer sees the connection end at once; when hypercorn closes its descriptor the kernel
  sends a RST because of the zero linger.

Both return a neutral answer (0 / ``False``) where ``/proc`` is unavailable.
"""

from __future__ import annotations

import os
import socket
import struct

import attrs

_ESTABLISHED = "01"


@attrs.frozen
class _TcpRow:
    local: tuple[str, int]
    remote: tuple[str, int]
    state: str
    inode: int


def _decode_addr(text: str) -> tuple[str, int]:
    hex_ip, hex_port = text.split(":")
    raw = bytes.fromhex(hex_ip)
    # The kernel prints the address as 32-bit words in host (little-endian) order.
    fixed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(fixed) == 4:
        ip = socket.inet_ntop(socket.AF_INET, fixed)
    else:
        ip = socket.inet_ntop(socket.AF_INET6, fixed)
        if ip.startswith("::ffff:") and "." in ip:
            ip = ip[len("::ffff:") :]
    return ip, int(hex_port, 16)


def _rows() -> list[_TcpRow]:
    rows: list[_TcpRow] = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as table:
                lines = table.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            rows.append(
                _TcpRow(
                    local=_decode_addr(fields[1]),
                    remote=_decode_addr(fields[2]),
                    state=fields[3],
                    inode=int(fields[9]),
                )
            )
    return rows


def count_connections(port: int) -> int:
    """Number of ESTABLISHED TCP connections whose local port is ``port``."""
    return sum(1 for row in _rows() if row.state == _ESTABLISHED and row.local[1] == port)


def _same(a: tuple[str, int], b: tuple[str, int]) -> bool:
    return a[1] == b[1] and (a[0] == b[0] or a[0].removeprefix("::ffff:") == b[0])


def abort_connection(local: tuple[str, int], remote: tuple[str, int]) -> bool:
    """Abort the connection ``local <-> remote`` of this process with a RST.

    Returns False when the socket cannot be found (then the caller falls back to a plain
    close). Safe to call from a trio task: it only issues non-blocking system calls.
    """
    inodes = {row.inode for row in _rows() if _same(row.local, local) and _same(row.remote, remote)}
    inodes.discard(0)
    if not inodes:
        return False
    targets = {f"socket:[{inode}]" for inode in inodes}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for name in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link not in targets:
            continue
        # A duplicate shares the socket, so options and shutdown reach hypercorn's socket;
        # closing the duplicate does not close hypercorn's descriptor.
        try:
            with socket.socket(fileno=os.dup(int(name))) as dup:
                dup.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                dup.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
        return True
    return False
