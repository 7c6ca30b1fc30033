"""The connection pool of one origin (host, port).

The contract, in plain primitives:

* `acquire(...)` returns `(connection, reused)`: the most recently returned idle connection
  (LIFO), else a new one if fewer than `max_connections` are open, else it waits, first come
  first served, for a connection or a slot (bounded by httpx's pool timeout -> PoolTimeout).
* Every acquired connection goes back exactly once: `release(conn)` after a clean end of the
  response (`conn.finish_cycle()` returned True), `discard(conn)` otherwise.
* `open_connections` counts connections that exist now (idle + busy).

Why this layer exists: httpcore's pool assigns connections in quadratic time and a request
cancelled during assignment can orphan a slot (encode/httpcore#1035, #1093). Here the
bookkeeping is a few synchronous steps with no checkpoint between deciding and recording,
so cancellation cannot land in the middle of it.

Releasing: `release` and `discard` are synchronous. `discard` closes the socket before it
returns, so it is the right call from `finally`/`except BaseException` in a cancelled scope.

    conn, reused = await pool.acquire(request, connect_timeout=5.0, pool_timeout=5.0)
    try:
        ...  # one request/response on conn
    except BaseException:
        pool.discard(conn)
        raise
    pool.release(conn) if conn.finish_cycle() else pool.discard(conn)

Theory of operation. `_slots` counts connections open or being opened and never exceeds
`max_connections`. A waiter exists only while the idle list is empty and all slots are taken;
so whatever frees capacity hands it straight to the first waiter: a released connection is
given to it (not put on the idle list), a discarded connection's slot is transferred to it
(the slot count stays the same). A waiter that leaves (cancelled, timed out) after being
granted something gives it back the same way; one that leaves before is skipped later.
"""

from __future__ import annotations

from collections import deque

import httpx
import trio

from ._connection import H11Connection

__all__ = ["HostPool"]


class _Waiter:
    """A task waiting for capacity. Exactly one of `connection`/`slot` is set on a grant."""

    __slots__ = ("abandoned", "connection", "event", "slot")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.connection: H11Connection | None = None
        self.slot = False
        self.abandoned = False


class HostPool:
    """HTTP/1.1 connections to one origin: LIFO idle list, bounded size, FIFO waiters."""

    def __init__(
        self, host: str, port: int, *, max_connections: int, max_idle: int, idle_timeout: float
    ) -> None:
        self.host = host
        self.port = port
        self._max_connections = max_connections
        self._max_idle = max_idle
        self._idle_timeout = idle_timeout
        # Right end = most recently returned (reused first); left end = oldest (expires first).
        self._idle: deque[H11Connection] = deque()
        self._waiters: deque[_Waiter] = deque()
        # Connections counted against max_connections: everything in `_connections` plus
        # those being opened right now.
        self._slots = 0
        self._connecting = 0
        # Membership means "counted in _slots": removal and the slot release happen together.
        self._connections: set[H11Connection] = set()
        self._closed = False

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    # -- acquiring -----------------------------------------------------------------------

    async def acquire(
        self,
        request: httpx.Request,
        *,
        connect_timeout: float | None,
        pool_timeout: float | None,
        fresh: bool = False,
    ) -> tuple[H11Connection, bool]:
        """A connection for one request and whether it was reused. `fresh=True` skips the idle
        list (used for the one retry after a stale keep-alive connection)."""
        if self._closed:
            raise httpx.ConnectError("transport is closed", request=request)
        if not fresh:
            conn = self._take_idle()
            if conn is not None:
                return conn, True
        elif self._slots >= self._max_connections and self._idle:
            # Make room for the fresh connection by dropping the oldest idle one.
            self._close(self._idle.popleft())
        if self._slots < self._max_connections:
            self._slots += 1
            return await self._open(request, connect_timeout), False
        waiter = await self._wait(request, pool_timeout)
        if waiter.connection is not None:
            # Handed over straight from a finished response: reused, and alive a moment ago.
            return waiter.connection, True
        if not waiter.slot:
            raise httpx.ConnectError("transport is closed", request=request)
        return await self._open(request, connect_timeout), False

    def _take_idle(self) -> H11Connection | None:
        idle = self._idle
        if not idle:
            return None
        now = trio.current_time()
        while idle:
            conn = idle.pop()
            if now - conn.idle_since > self._idle_timeout or conn.is_readable():
                # Expired, or the server already closed it: it would only fail the request.
                self._close(conn)
                continue
            return conn
        return None

    async def _open(self, request: httpx.Request, connect_timeout: float | None) -> H11Connection:
        """Open a connection into a slot the caller already holds in `_slots`."""
        self._connecting += 1
        try:
            conn = await H11Connection.open(
                self.host, self.port, connect_timeout=connect_timeout, request=request
            )
        except BaseException:
            self._connecting -= 1
            self._free_slot()
            raise
        self._connecting -= 1
        if self._closed:
            conn.close()
            self._free_slot()
            raise httpx.ConnectError("transport is closed", request=request)
        self._connections.add(conn)
        return conn

    async def _wait(self, request: httpx.Request, pool_timeout: float | None) -> _Waiter:
        waiter = _Waiter()
        self._waiters.append(waiter)
        try:
            if pool_timeout is None:
                await waiter.event.wait()
            else:
                with trio.fail_after(pool_timeout):
                    await waiter.event.wait()
        except BaseException as exc:
            if waiter.event.is_set():
                # Granted, but we are leaving: pass the grant on so nothing is lost.
                if waiter.connection is not None:
                    self.release(waiter.connection)
                elif waiter.slot:
                    self._free_slot()
            else:
                waiter.abandoned = True
            if isinstance(exc, trio.TooSlowError):
                raise httpx.PoolTimeout(
                    f"no connection to {self.host}:{self.port} within {pool_timeout}s "
                    f"({self._max_connections} in use)",
                    request=request,
                ) from None
            raise
        return waiter

    def _next_waiter(self) -> _Waiter | None:
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.abandoned:
                return waiter
        return None

    # -- returning -----------------------------------------------------------------------

    def release(self, conn: H11Connection) -> None:
        """Return a connection whose response ended cleanly and whose `finish_cycle()` was True."""
        if self._closed or conn.closed:
            self._close(conn)
            return
        waiter = self._next_waiter()
        if waiter is not None:
            waiter.connection = conn
            waiter.event.set()
            return
        now = trio.current_time()
        conn.idle_since = now
        idle = self._idle
        idle.append(conn)
        # Trim from the old end: over the idle cap, or expired. LIFO reuse means the old end is
        # rarely touched under load, so without this its sockets would linger until found.
        while idle and (
            len(idle) > self._max_idle or now - idle[0].idle_since > self._idle_timeout
        ):
            self._close(idle.popleft())

    def discard(self, conn: H11Connection) -> None:
        """Close a connection now (synchronously) and free its slot. Safe to call twice."""
        self._close(conn)

    def _close(self, conn: H11Connection) -> None:
        conn.close()
        if conn in self._connections:
            self._connections.remove(conn)
            self._free_slot()

    def _free_slot(self) -> None:
        if not self._closed:
            waiter = self._next_waiter()
            if waiter is not None:
                # The slot moves to the waiter; _slots is unchanged.
                waiter.slot = True
                waiter.event.set()
                return
        self._slots -= 1

    def close(self) -> None:
        """Close every connection (idle and busy) and fail every waiter. Synchronous."""
        self._closed = True
        while self._waiters:
            self._waiters.popleft().event.set()  # granted nothing: acquire raises
        self._idle.clear()
        for conn in list(self._connections):
            self._close(conn)
