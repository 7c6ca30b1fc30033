"""`H11Transport`: httpx's client API over our own HTTP/1.1 pools (h11 on trio sockets).

The contract, in plain primitives: `handle_async_request(request)` sends one request on a
pooled connection to the request's origin and returns an `httpx.Response` as soon as the
response head has arrived; its stream yields the body as it comes off the socket, one chunk
per decoded read. Everything else (URLs, headers, timeouts, redirects) stays httpx's job.

Why this layer exists: it keeps httpx as the client API while replacing httpcore's pool,
which collapses past ~50-100 concurrent streams under trio (quadratic connection assignment,
encode/httpcore#1035) and can orphan a pool slot when a request is cancelled at the wrong
moment (encode/httpcore#1093). It also makes the one guarantee the router relies on
explicit: a response that is not read to its clean end has its connection closed at once,
because closing the connection is the only way vLLM learns to abort a request.

Releasing: the response must *either* be read to its end (the connection then returns to the
pool) *or* be closed (`await response.aclose()`, or leave `async with client.stream(...)`),
which closes the socket synchronously, before any checkpoint, so it also works from a
cancelled scope. A response that is neither read nor closed keeps its pool slot.

    async with httpx.AsyncClient(transport=H11Transport()) as client:
        async with client.stream("POST", "http://127.0.0.1:8000/v1/completions", json=body) as r:
            async for chunk in r.aiter_raw():
                ...  # cancelled or broken out of here: the upstream socket is closed now

Errors are httpx's: ConnectError, ConnectTimeout, ReadTimeout, WriteTimeout, PoolTimeout,
ReadError, WriteError, RemoteProtocolError (including a body cut short), LocalProtocolError.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import h11
import httpx

from ._connection import H11Connection
from ._pool import HostPool
from ._send_side import SEND_SIDE, SendSide

__all__ = ["H11ResponseStream", "H11Transport", "body_chunks"]

# The response extension under which the transport hands out its own body stream.
_STREAM = "trio_pdrouter.stream"


def body_chunks(response: httpx.Response) -> AsyncIterator[bytes]:
    """The body of a streamed ``response``, chunk by chunk, as ``aiter_raw()`` gives it.

    When the response came from an `H11Transport` this is the transport's own stream, read
    directly: no httpx wrapper objects per chunk (its async generators and byte chunker).
    Closing is unchanged: ``response.aclose()`` still reaches the stream. Any other transport
    (tests' ``httpx.MockTransport``) gets ``aiter_raw()``.
    """
    stream = response.extensions.get(_STREAM)
    if isinstance(stream, H11ResponseStream) and not response.is_stream_consumed:
        response.is_stream_consumed = True
        return stream
    return response.aiter_raw()


def _may_resend(request: httpx.Request, sent: bool, response_started: bool) -> bool:
    """Whether a request that failed on a reused connection may go again on a fresh one.

    A POST that reached the server whole may have started work there (an engine generating
    tokens, then failing): sending it again would run it twice, so only a POST whose writing
    failed is resent. Idempotent methods may go again after a failure to read an answer, as
    HTTP allows. Either way nothing of the response may have arrived, and the body must be
    sendable again (``httpx.ByteStream``: bytes content, or a body already read into memory).
    """
    if response_started or not isinstance(request.stream, httpx.ByteStream):
        return False
    return not sent or request.method in ("GET", "HEAD", "OPTIONS")


# Failures on a reused connection that may mean "the server closed it while it sat idle", when
# they happen before any byte of the response. Timeouts are not among them: a silent server
# may be working on the request, and sending it twice is not ours to decide.
_STALE_ERRORS = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)

_OPEN, _DONE, _BROKEN = 0, 1, 2


class H11ResponseStream(httpx.AsyncByteStream):
    """The body of one response, read straight off its connection.

    Reading to the end returns the connection to the pool; `aclose()` before the end (or any
    error or cancellation while reading) closes it synchronously. `aclose()` is idempotent
    and never checkpoints.
    """

    __slots__ = ("_conn", "_pool", "_read_timeout", "_request", "_state")

    def __init__(
        self,
        conn: H11Connection,
        pool: HostPool,
        request: httpx.Request,
        read_timeout: float | None,
    ) -> None:
        self._conn = conn
        self._pool = pool
        self._request = request
        self._read_timeout = read_timeout
        self._state = _OPEN

    def __aiter__(self) -> H11ResponseStream:
        # An iterator object rather than an async generator: no generator frame per response,
        # and no cancel scope spanning a `yield`.
        return self

    async def __anext__(self) -> bytes:
        conn = self._open_conn()
        try:
            chunk = await conn.next_body_chunk(self._request, read_timeout=self._read_timeout)
        except BaseException:
            self._broken()
            raise
        if chunk is None:
            self._ended()
            raise StopAsyncIteration
        return chunk

    def _open_conn(self) -> H11Connection:
        """The connection while the body is being read; at its end StopAsyncIteration, after a
        failure or close a ReadError."""
        if self._state != _OPEN:
            if self._state == _DONE:
                raise StopAsyncIteration
            raise httpx.ReadError(
                "response stream was closed before the end of the body", request=self._request
            )
        return self._conn

    def _broken(self) -> None:
        """Error, timeout or cancellation mid-body: close before anything else can run."""
        self._state = _BROKEN
        self._pool.discard(self._conn)

    def _ended(self) -> None:
        """Clean end: hand the connection back now rather than waiting for aclose(), so the
        next request can use it while the caller is still finishing up."""
        self._state = _DONE
        conn = self._conn
        if conn.finish_cycle():
            self._pool.release(conn)
        else:
            self._pool.discard(conn)

    @property
    def request(self) -> httpx.Request:
        return self._request

    def polled_fd(self) -> int | None:
        """The socket to poll before each :meth:`read_now`, or None if this body cannot be
        read that way (not chunked, or bytes of it already buffered: read on with
        ``__anext__`` until they are gone)."""
        if self._state == _OPEN and self._conn.reads_chunked():
            return self._conn.fd
        return None

    def read_now(self) -> bytes | None:
        """The next body bytes one read without waiting gives (``b""``: none yet), or None at
        the clean end, which hands the connection back as ``__anext__`` does. For a caller
        that polls :meth:`polled_fd` itself; any error closes the connection, as in
        ``__anext__``."""
        try:
            conn = self._open_conn()
        except StopAsyncIteration:
            return None
        try:
            chunk = conn.read_chunked_now(self._request)
        except BaseException:
            self._broken()
            raise
        if chunk is None:
            self._ended()
        return chunk

    @property
    def at_end(self) -> bool:
        """Whether the body's end has been read and :meth:`read_now` will return ``None``
        without reading (a read can bring the last bytes and the end together)."""
        return self._state == _DONE or (self._state == _OPEN and self._conn.chunked_done)

    def close(self) -> None:
        """:meth:`aclose`, for a caller that cannot await."""
        if self._state == _OPEN:
            self._state = _BROKEN
            self._pool.discard(self._conn)

    async def aclose(self) -> None:
        # No await in here on purpose: this must complete inside a cancelled scope.
        self.close()


class H11Transport(httpx.AsyncBaseTransport):
    """An `httpx.AsyncBaseTransport` with one HTTP/1.1 pool per origin (http:// only).

    Per origin: up to `max_connections_per_host` connections; beyond that requests wait in
    FIFO order (httpx's pool timeout applies). At most `max_idle_per_host` idle connections
    are kept; the most recently returned one is reused first; one idle for longer than
    `idle_timeout` seconds is closed when found. The default of 4 s stays under the 5 s after
    which vLLM's server (uvicorn) closes an idle keep-alive connection, so a request rarely
    lands on a connection the server is closing. A reused connection that turns out to have
    been closed by the server is retried once on a fresh connection when that cannot run the
    request twice (see `_may_resend`).
    """

    def __init__(
        self,
        *,
        max_connections_per_host: int = 2048,
        max_idle_per_host: int = 512,
        idle_timeout: float = 4.0,
    ) -> None:
        if max_connections_per_host < 1:
            raise ValueError(
                f"max_connections_per_host must be >= 1, not {max_connections_per_host}"
            )
        if max_idle_per_host < 0:
            raise ValueError(f"max_idle_per_host must be >= 0, not {max_idle_per_host}")
        if idle_timeout < 0:
            raise ValueError(f"idle_timeout must be >= 0, not {idle_timeout}")
        self._max_connections = max_connections_per_host
        self._max_idle = max_idle_per_host
        self._idle_timeout = idle_timeout
        self._pools: dict[tuple[str, int], HostPool] = {}
        self._closed = False

    def open_connections(self) -> dict[str, int]:
        """ "host:port" -> connections open now (idle + busy), for tests and metrics."""
        return {
            _origin_label(host, port): pool.open_connections
            for (host, port), pool in self._pools.items()
        }

    def _pool_for(self, request: httpx.Request) -> HostPool:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(
                f"H11Transport speaks plain http:// only, not {url.scheme}:// ({url})",
                request=request,
            )
        # raw_host is the ASCII (IDNA) form, without brackets for IPv6: what connect() wants.
        key = (url.raw_host.decode("ascii"), url.port or 80)
        pool = self._pools.get(key)
        if pool is None:
            if self._closed:
                raise httpx.ConnectError("transport is closed", request=request)
            pool = self._pools[key] = HostPool(
                key[0],
                key[1],
                max_connections=self._max_connections,
                max_idle=self._max_idle,
                idle_timeout=self._idle_timeout,
            )
        return pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        pool = self._pool_for(request)
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        connect_timeout: float | None = timeouts.get("connect")
        read_timeout: float | None = timeouts.get("read")
        write_timeout: float | None = timeouts.get("write")
        pool_timeout: float | None = timeouts.get("pool")

        side: SendSide | None = request.extensions.get(SEND_SIDE)
        conn, reused = await pool.acquire(
            request, connect_timeout=connect_timeout, pool_timeout=pool_timeout
        )
        sent = False
        try:
            if side is not None:
                side.attach(conn)
            await conn.send_request(request, write_timeout=write_timeout)
            sent = True
            if side is not None:
                side.written = True
            head = await conn.receive_response_head(request, read_timeout=read_timeout)
        except _STALE_ERRORS:
            pool.discard(conn)
            if not (reused and _may_resend(request, sent, conn.response_started)):
                raise
        except BaseException:
            # Cancellation included: the socket goes now, and with it the slot.
            pool.discard(conn)
            raise
        else:
            return self._response(conn, pool, request, head, read_timeout)

        # The one retry: a stale keep-alive connection, on a new connection.
        conn, _ = await pool.acquire(
            request, connect_timeout=connect_timeout, pool_timeout=pool_timeout, fresh=True
        )
        try:
            if side is not None:
                side.attach(conn)
            await conn.send_request(request, write_timeout=write_timeout)
            if side is not None:
                side.written = True
            head = await conn.receive_response_head(request, read_timeout=read_timeout)
        except BaseException:
            pool.discard(conn)
            raise
        return self._response(conn, pool, request, head, read_timeout)

    @staticmethod
    def _response(
        conn: H11Connection,
        pool: HostPool,
        request: httpx.Request,
        head: h11.Response,
        read_timeout: float | None,
    ) -> httpx.Response:
        stream = H11ResponseStream(conn, pool, request, read_timeout)
        return httpx.Response(
            status_code=head.status_code,
            headers=head.headers.raw_items(),
            stream=stream,
            extensions={
                "http_version": b"HTTP/" + head.http_version,
                "reason_phrase": head.reason,
                _STREAM: stream,
            },
        )

    async def aclose(self) -> None:
        """Close every connection of every pool, idle or busy, synchronously. Streams still
        being read then fail with httpx.ReadError; waiting requests with httpx.ConnectError."""
        self._closed = True
        for pool in self._pools.values():
            pool.close()


def _origin_label(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
