"""One HTTP/1.1 client connection: h11 over a trio `SocketStream`.

The contract, in plain primitives:

* `H11Connection.open(host, port, ...)` connects a TCP socket (TCP_NODELAY on).
* `send_request(request, ...)` writes one request: head, body, end of message.
* `receive_response_head(request, ...)` returns the `h11.Response` of that request.
* `next_body_chunk(request, ...)` returns the next piece of the body, or `None` at its
  clean end; a body that stops short raises, it never looks like a clean end. A chunked body
  (every SSE stream) is de-chunked by `ChunkedBody` rather than h11, one socket read at a time:
  h11 parses the head, then hands over what it buffered past it (`trailing_data`).
* `finish_cycle()` says whether the connection may carry another request (and arms h11 for
  it); `close()` drops the socket at once.

Why this layer exists: it is the only code that touches sockets and h11, and it translates
every failure into httpx's exception types, so the pool and the transport above it reason
only about "this connection is reusable" or "this connection is gone".

Releasing: a connection is either handed back after `finish_cycle()` returned True, or
closed with `close()`. `close()` is synchronous on purpose: it runs even inside a cancelled
scope, before any checkpoint, and the closed socket is what tells vLLM to abort the request.

    conn = await H11Connection.open("127.0.0.1", 8000, connect_timeout=5.0, request=request)
    try:
        await conn.send_request(request, write_timeout=5.0)
        head = await conn.receive_response_head(request, read_timeout=5.0)
        while (chunk := await conn.next_body_chunk(request, read_timeout=5.0)) is not None:
            ...
        reusable = conn.finish_cycle()
    except BaseException:
        conn.close()
        raise
"""

from __future__ import annotations

import contextlib
import os
import select

import h11
import httpx
import trio

from ._chunked import ChunkedBody, ChunkedError

__all__ = ["RECEIVE_SIZE", "H11Connection"]

# One socket read. Large enough that a burst of SSE events arrives as one chunk (fewer
# relay sends downstream), small enough to keep hundreds of streams cheap.
RECEIVE_SIZE = 65536

# Socket-level failures. trio wraps most OSErrors in BrokenResourceError; ClosedResourceError
# means our own `close()` (or the transport's aclose) pulled the socket from under a read.
_IO_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class H11Connection:
    """One HTTP/1.1 connection to one origin, used by one request at a time."""

    __slots__ = (
        "_chunked",
        "_fd",
        "_h11",
        "_keep_alive",
        "_pending",
        "_sending_closed",
        "_stream",
        "closed",
        "idle_since",
        "response_started",
    )

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._fd = stream.socket.fileno()
        self._h11 = h11.Connection(our_role=h11.CLIENT)
        # A chunked response body is read with this instead of h11 (None: h11 reads it);
        # _pending holds the body bytes h11 had buffered past the head, _keep_alive whether
        # both sides allow another request on this connection afterwards.
        self._chunked: ChunkedBody | None = None
        self._pending = b""
        self._keep_alive = False
        # Half-closed for a caller (SendSide.close): the connection is never reused.
        self._sending_closed = False
        self.closed = False
        # trio.current_time() when the pool last put the connection on its idle list.
        self.idle_since = 0.0
        # True once any byte of the current response has arrived. A reused connection that
        # fails while this is False was closed by the server while idle: safe to retry.
        self.response_started = False

    @classmethod
    async def open(
        cls, host: str, port: int, *, connect_timeout: float | None, request: httpx.Request
    ) -> H11Connection:
        try:
            if connect_timeout is None:
                stream = await trio.open_tcp_stream(host, port)
            else:
                with trio.fail_after(connect_timeout):
                    stream = await trio.open_tcp_stream(host, port)
        except trio.TooSlowError:
            raise httpx.ConnectTimeout(
                f"connect to {host}:{port} timed out after {connect_timeout}s", request=request
            ) from None
        except OSError as exc:
            raise httpx.ConnectError(
                f"connect to {host}:{port} failed: {exc}", request=request
            ) from exc
        # trio's SocketStream already enables TCP_NODELAY; nothing more to set here. Without it
        # a small request head could wait for a delayed ACK (~40 ms) before leaving.
        return cls(stream)

    # -- sending -------------------------------------------------------------------------

    async def send_request(self, request: httpx.Request, *, write_timeout: float | None) -> None:
        """Write the request head, its body (Content-Length or chunked, as h11 frames it per the
        request headers) and the end of message. Small bodies go out in one write with the head."""
        h = self._h11
        self.response_started = False
        stream = request.stream
        assert isinstance(stream, httpx.AsyncByteStream)
        try:
            head = h.send(
                h11.Request(
                    method=request.method, target=request.url.raw_path, headers=request.headers.raw
                )
            )
            pending: list[bytes] = [head or b""]
            size = len(pending[0])
            async for chunk in stream:
                if not chunk:
                    continue
                pending.append(h.send(h11.Data(data=chunk)) or b"")
                size += len(chunk)
                if size >= RECEIVE_SIZE:
                    await self._write(b"".join(pending), write_timeout, request)
                    pending.clear()
                    size = 0
            pending.append(h.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError as exc:
            raise httpx.LocalProtocolError(str(exc), request=request) from exc
        await self._write(b"".join(pending), write_timeout, request)

    async def _write(
        self, data: bytes, write_timeout: float | None, request: httpx.Request
    ) -> None:
        try:
            if write_timeout is None:
                await self._stream.send_all(data)
            else:
                # A bare CancelScope rather than trio.fail_after: no generator-based context
                # manager on the hot path.
                with trio.CancelScope(deadline=trio.current_time() + write_timeout) as scope:
                    await self._stream.send_all(data)
                if scope.cancelled_caught:
                    raise httpx.WriteTimeout(
                        f"write timed out after {write_timeout}s", request=request
                    )
        except _IO_ERRORS as exc:
            raise httpx.WriteError(f"write failed: {exc!r}", request=request) from exc

    # -- receiving -----------------------------------------------------------------------

    async def _receive(self, read_timeout: float | None, request: httpx.Request) -> bool:
        """One socket read fed to h11. Returns False at EOF."""
        data = await self._read(read_timeout, request)
        self._h11.receive_data(data)
        return bool(data)

    async def _read(self, read_timeout: float | None, request: httpx.Request) -> bytes:
        """One socket read (``b""`` at EOF). The timeout bounds this read only, so a slow
        stream with steady chunks never times out as a whole."""
        try:
            if read_timeout is None:
                data = await self._recv()
            else:
                with trio.CancelScope(deadline=trio.current_time() + read_timeout) as scope:
                    data = await self._recv()
                if scope.cancelled_caught:
                    raise httpx.ReadTimeout(
                        f"read timed out after {read_timeout}s", request=request
                    )
        except _IO_ERRORS as exc:
            raise httpx.ReadError(f"read failed: {exc!r}", request=request) from exc
        if data:
            self.response_started = True
        return data

    async def _recv(self) -> bytes:
        """What the socket holds, once it holds something (``b""`` at EOF), read off its file
        descriptor.

        A stream reads once per token-paced event, and the next event is rarely there yet.
        trio's ``socket.recv`` then costs a failed ``recv`` call, a raised ``BlockingIOError``
        and an async context manager per event; this waits for readability first and reads
        once. The wait is the checkpoint; a read that finds nothing (a spurious wake-up) waits
        again. Errors are raw ``OSError`` (or ``trio.ClosedResourceError`` when
        :meth:`close` runs during the wait), which ``_IO_ERRORS`` holds. After :meth:`close`
        the number may already name another socket, so a closed connection never reads."""
        fd = self._fd
        while not self.closed:
            await trio.lowlevel.wait_readable(fd)
            try:
                return os.read(fd, RECEIVE_SIZE)
            except BlockingIOError:
                continue
        raise trio.ClosedResourceError("the connection was closed")

    def _next_event(
        self, request: httpx.Request
    ) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        try:
            return self._h11.next_event()
        except h11.RemoteProtocolError as exc:
            # Includes a Content-Length or chunked body cut short by EOF.
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc

    async def receive_response_head(
        self, request: httpx.Request, *, read_timeout: float | None
    ) -> h11.Response:
        while True:
            event = self._next_event(request)
            if event is h11.NEED_DATA:
                if not await self._receive(read_timeout, request):
                    # h11's own message for this case names an internal state; say what happened.
                    raise httpx.RemoteProtocolError(
                        "server disconnected without sending a response", request=request
                    )
            elif type(event) is h11.Response:
                self._take_over_chunked_body(request, event)
                return event
            elif type(event) is h11.InformationalResponse:
                continue  # 100 Continue and friends: the real head follows
            else:
                raise httpx.RemoteProtocolError(
                    f"unexpected event before the response head: {event!r}", request=request
                )

    async def next_body_chunk(
        self, request: httpx.Request, *, read_timeout: float | None
    ) -> bytes | None:
        """The bytes of the next h11 Data event (one per decoded socket read, not re-buffered),
        or None at the end of the body."""
        if self._chunked is not None:
            return await self._next_chunked(self._chunked, request, read_timeout)
        while True:
            event = self._next_event(request)
            if type(event) is h11.Data:
                data = event.data
                if data:
                    # h11 hands out bytearray slices of its buffer; callers are promised bytes.
                    return data if type(data) is bytes else bytes(data)
            elif event is h11.NEED_DATA:
                # At EOF h11 either ends a close-delimited body or raises for a truncated one.
                await self._receive(read_timeout, request)
            elif type(event) is h11.EndOfMessage:
                return None
            else:
                raise httpx.RemoteProtocolError(
                    f"unexpected event in the response body: {event!r}", request=request
                )

    def _take_over_chunked_body(self, request: httpx.Request, head: h11.Response) -> None:
        """After h11 parsed ``head``: if a chunked body follows, read it with `ChunkedBody`."""
        if head.status_code in (204, 304) or request.method == "HEAD":
            return
        if not any(name == b"transfer-encoding" for name, _ in head.headers):
            return  # Content-Length or close-delimited: h11 reads it
        self._chunked = ChunkedBody()
        self._pending = self._h11.trailing_data[0]
        self._keep_alive = head.http_version == b"1.1" and not any(
            b"close" in value.lower()
            for headers in (head.headers, request.headers.raw)
            for name, value in headers
            if name.lower() == b"connection"
        )

    async def _next_chunked(
        self, body: ChunkedBody, request: httpx.Request, read_timeout: float | None
    ) -> bytes | None:
        data, self._pending = self._pending, b""
        while True:
            if data:
                try:
                    out = body.feed(data)
                except ChunkedError as exc:
                    raise httpx.RemoteProtocolError(str(exc), request=request) from exc
                if out:
                    return out
            if body.done:
                return None
            data = await self._read(read_timeout, request)
            if not data:
                raise httpx.RemoteProtocolError(
                    "peer closed connection without sending complete message body: "
                    "incomplete chunked read",
                    request=request,
                )

    @property
    def fd(self) -> int:
        """The socket's file descriptor (valid while not :attr:`closed`)."""
        return self._fd

    def reads_chunked(self) -> bool:
        """Whether the body being read is chunked, not at its end, and nothing of it is
        buffered here: what polling the socket before :meth:`read_chunked_now` needs."""
        body = self._chunked
        return body is not None and not body.done and not self._pending and not self.closed

    @property
    def chunked_done(self) -> bool:
        """Whether the chunked body's end has been read (the next read returns ``None``)."""
        return self._chunked is not None and self._chunked.done

    def read_chunked_now(self, request: httpx.Request) -> bytes | None:
        """One read of a chunked body without waiting, for a caller that polls the socket
        itself (:attr:`fd`): the body bytes it completes (``b""`` when the socket held nothing
        yet or only framing), ``None`` at the body's clean end. A body cut short, bad framing
        or a socket error raise httpx's errors, as :meth:`next_body_chunk` does. A read that
        brings the last bytes and the end returns the bytes: :attr:`chunked_done` then says
        the end is there, and no socket event will say it again."""
        body = self._chunked
        assert body is not None and not self._pending
        if body.done:
            return None
        try:
            data = os.read(self._fd, RECEIVE_SIZE)
        except BlockingIOError:
            return b""
        except OSError as exc:
            raise httpx.ReadError(f"read failed: {exc!r}", request=request) from exc
        if not data:
            raise httpx.RemoteProtocolError(
                "peer closed connection without sending complete message body: "
                "incomplete chunked read",
                request=request,
            )
        self.response_started = True
        try:
            out = body.feed(data)
        except ChunkedError as exc:
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc
        if not out and body.done:
            return None
        return out

    # -- lifecycle -----------------------------------------------------------------------

    def finish_cycle(self) -> bool:
        """After the body's end: True (and h11 is ready for the next request) if the connection
        can be reused; False if it must be closed (Connection: close, HTTP/1.0, extra bytes, a
        sending side closed)."""
        if self._sending_closed:
            return False
        body = self._chunked
        if body is not None:
            # h11 stopped at the head: start the next cycle on a fresh h11 state machine.
            self._chunked = None
            if not (body.done and self._keep_alive) or body.extra:
                return False
            if self._h11.our_state is not h11.DONE:
                return False
            self._h11 = h11.Connection(our_role=h11.CLIENT)
            return True
        h = self._h11
        if h.our_state is not h11.DONE or h.their_state is not h11.DONE:
            return False
        trailing, eof = h.trailing_data
        if trailing or eof:
            return False
        h.start_next_cycle()
        return True

    def is_readable(self) -> bool:
        """True if an idle connection has something to read: EOF/RST from a server that closed
        it, or stray bytes. Either way it cannot carry a new request."""
        if self.closed:
            return True
        try:
            poller = select.poll()
            poller.register(self._stream.socket.fileno(), select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True

    def half_close(self) -> None:
        """Stop sending now, synchronously (``shutdown(SHUT_WR)``); reading goes on."""
        if not self.closed and not self._sending_closed:
            self._sending_closed = True
            with contextlib.suppress(OSError):  # already closed or reset: nothing to stop
                self._stream.socket.shutdown(trio.socket.SHUT_WR)

    def close(self) -> None:
        """Close the socket now, synchronously (no checkpoint, so it runs in a cancelled scope).
        Idempotent."""
        if not self.closed:
            self.closed = True
            # Not `await self._stream.aclose()`: that is a checkpoint, and a cancelled caller
            # would be interrupted before the socket is actually closed.
            self._stream.socket.close()
