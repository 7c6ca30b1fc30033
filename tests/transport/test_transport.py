"""H11Transport against real servers on 127.0.0.1: small trio servers, written per test with h11
or raw bytes, so each test controls framing, stalls, truncation and closes exactly.

Synchronisation is by trio.Event (and wait_all_tasks_blocked), never by sleeping.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import h11
import httpx
import pytest
import trio
import trio.testing

from trio_pdrouter.transport import (
    SEND_SIDE,
    H11ResponseStream,
    H11Transport,
    SendSide,
    body_chunks,
)

Handler = Callable[[trio.SocketStream, int], Awaitable[None]]

# Generous bound for "promptly": a hang fails in seconds instead of stalling the suite.
PROMPT = 5.0


class Server:
    """Counts accepted connections; hands each to `handler(stream, connection_index)`."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.accepted = 0
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def origin(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _handle(self, stream: trio.SocketStream) -> None:
        index = self.accepted
        self.accepted += 1
        try:
            await self.handler(stream, index)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            stream.socket.close()


@asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[Server]:
    server = Server(handler)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_tcp, server._handle, 0, host="127.0.0.1")
        )
        server.port = listeners[0].socket.getsockname()[1]
        yield server
        nursery.cancel_scope.cancel()


async def wait(event: trio.Event) -> None:
    with trio.fail_after(PROMPT):
        await event.wait()


async def read_request(
    stream: trio.SocketStream, conn: h11.Connection
) -> tuple[h11.Request, bytes] | None:
    """The next request on a server-side h11 connection, or None if the client closed."""
    request: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            return request, bytes(body)
        elif isinstance(event, h11.ConnectionClosed):
            return None


async def send(stream: trio.SocketStream, conn: h11.Connection, *events: h11.Event) -> None:
    for event in events:
        data = conn.send(event)
        if data:
            await stream.send_all(data)


async def wait_closed(stream: trio.SocketStream) -> None:
    """Return once the peer has closed (EOF or reset); fail if it sends anything else."""
    with trio.fail_after(PROMPT):
        try:
            while data := await stream.receive_some(65536):
                pass
            assert data == b""
        except trio.BrokenResourceError:
            pass


def keep_alive(
    respond: Callable[[h11.Request, bytes, int], tuple[int, list[tuple[str, str]], bytes]],
) -> Handler:
    """A keep-alive h11 server: `respond(request, body, connection_index)` per request."""

    async def handler(stream: trio.SocketStream, index: int) -> None:
        conn = h11.Connection(h11.SERVER)
        while True:
            got = await read_request(stream, conn)
            if got is None:
                return
            status, headers, body = respond(got[0], got[1], index)
            await send(
                stream,
                conn,
                h11.Response(status_code=status, headers=headers),
                h11.Data(data=body),
                h11.EndOfMessage(),
            )
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()

    return handler


def hello(
    request: h11.Request, body: bytes, index: int
) -> tuple[int, list[tuple[str, str]], bytes]:
    payload = f"conn={index}".encode()
    return 200, [("Content-Length", str(len(payload)))], payload


def open_count(transport: H11Transport, server: Server) -> int:
    return transport.open_connections().get(server.origin, 0)


def client_for(transport: H11Transport, **timeouts: float | None) -> httpx.AsyncClient:
    timeout = httpx.Timeout(5.0, **timeouts)
    return httpx.AsyncClient(transport=transport, timeout=timeout)


# -- basic exchanges -------------------------------------------------------------------------


async def test_get_and_post_with_content_length() -> None:
    seen: list[tuple[h11.Request, bytes]] = []

    def echo(
        request: h11.Request, body: bytes, index: int
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        seen.append((request, body))
        payload = b"echo:" + body
        return 201, [("Content-Length", str(len(payload))), ("X-Upstream", "yes")], payload

    transport = H11Transport()
    async with serve(keep_alive(echo)) as server, client_for(transport) as client:
        response = await client.get(server.url + "/path?q=1")
        assert response.status_code == 201
        assert response.content == b"echo:"
        assert response.headers["x-upstream"] == "yes"
        assert response.http_version == "HTTP/1.1"
        assert response.reason_phrase == ""

        response = await client.post(server.url + "/v1/completions", content=b'{"a": 1}')
        assert response.content == b'echo:{"a": 1}'

    get_request, _ = seen[0]
    assert get_request.method == b"GET"
    assert get_request.target == b"/path?q=1"
    post_request, post_body = seen[1]
    assert post_body == b'{"a": 1}'
    headers = dict(post_request.headers)
    assert headers[b"host"] == f"127.0.0.1:{server.port}".encode()
    assert headers[b"content-length"] == b"8"
    assert server.accepted == 1  # keep-alive: both on one connection


async def test_chunked_request_and_response() -> None:
    received: list[bytes] = []

    async def handler(stream: trio.SocketStream, index: int) -> None:
        conn = h11.Connection(h11.SERVER)
        got = await read_request(stream, conn)
        assert got is not None
        request, body = got
        assert dict(request.headers)[b"transfer-encoding"] == b"chunked"
        received.append(body)
        await send(
            stream,
            conn,
            h11.Response(status_code=200, headers=[("Transfer-Encoding", "chunked")]),
            h11.Data(data=b"abc"),
            h11.Data(data=b"defg"),
            h11.EndOfMessage(),
        )
        await wait_closed(stream)

    async def body() -> AsyncIterator[bytes]:
        yield b"part1-"
        yield b"part2"

    transport = H11Transport()
    async with serve(handler) as server, client_for(transport) as client:
        response = await client.post(server.url, content=body())
        assert response.content == b"abcdefg"
        assert open_count(transport, server) == 1  # chunked end is a clean end: kept
    assert received == [b"part1-part2"]


async def test_close_delimited_body_is_read_to_eof_and_not_reused() -> None:
    async def handler(stream: trio.SocketStream, index: int) -> None:
        assert await read_request(stream, h11.Connection(h11.SERVER)) is not None
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhello ")
        await stream.send_all(b"world")
        # returning closes the socket: that EOF ends the body

    transport = H11Transport()
    async with serve(handler) as server, client_for(transport) as client:
        response = await client.get(server.url)
        assert response.content == b"hello world"
        assert response.reason_phrase == "OK"
        assert open_count(transport, server) == 0


async def test_head_and_204_have_no_body_and_keep_the_connection() -> None:
    def no_body(
        request: h11.Request, body: bytes, index: int
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        if request.method == b"HEAD":
            return 200, [("Content-Length", "10")], b""
        return 204, [], b""

    transport = H11Transport()
    async with serve(keep_alive(no_body)) as server, client_for(transport) as client:
        assert (await client.head(server.url)).content == b""
        assert (await client.delete(server.url)).status_code == 204
        assert (await client.head(server.url)).headers["content-length"] == "10"
        assert server.accepted == 1
        assert open_count(transport, server) == 1


async def test_https_is_refused_clearly() -> None:
    async with client_for(H11Transport()) as client:
        with pytest.raises(httpx.UnsupportedProtocol, match="http:// only"):
            await client.get("https://127.0.0.1:1/")


# -- streaming -------------------------------------------------------------------------------


async def test_stream_yields_each_chunk_before_the_next_is_written() -> None:
    proceed = [trio.Event() for _ in range(3)]

    async def handler(stream: trio.SocketStream, index: int) -> None:
        conn = h11.Connection(h11.SERVER)
        assert await read_request(stream, conn) is not None
        await send(
            stream, conn, h11.Response(status_code=200, headers=[("Transfer-Encoding", "chunked")])
        )
        for n, event in enumerate(proceed):
            await send(stream, conn, h11.Data(data=f"data: {n}\n\n".encode()))
            await wait(event)  # the client must have seen chunk n before chunk n+1 exists
        await send(stream, conn, h11.EndOfMessage())
        await wait_closed(stream)

    transport = H11Transport()
    async with serve(handler) as server, client_for(transport) as client:
        async with client.stream("GET", server.url) as response:
            chunks = response.aiter_raw()
            for n, event in enumerate(proceed):
                expected = f"data: {n}\n\n".encode()
                got = b""
                while len(got) < len(expected):
                    got += await chunks.__anext__()
                assert got == expected
                event.set()
            assert [c async for c in chunks] == []
        assert open_count(transport, server) == 1


async def test_content_length_stream_in_several_writes() -> None:
    parts = [b"x" * 100_000, b"y" * 70_000, b"z"]
    proceed = trio.Event()

    async def handler(stream: trio.SocketStream, index: int) -> None:
        conn = h11.Connection(h11.SERVER)
        assert await read_request(stream, conn) is not None
        total = sum(map(len, parts))
        await send(
            stream, conn, h11.Response(status_code=200, headers=[("Content-Length", str(total))])
        )
        await send(stream, conn, h11.Data(data=parts[0]))
        await wait(proceed)
        await send(
            stream, conn, h11.Data(data=parts[1]), h11.Data(data=parts[2]), h11.EndOfMessage()
        )
        await wait_closed(stream)

    transport = H11Transport()
    async with serve(handler) as server, client_for(transport) as client:
        async with client.stream("GET", server.url) as response:
            got = b""
            async for chunk in response.aiter_raw():
                assert type(chunk) is bytes
                assert len(chunk) <= 65536  # one socket read at most
                got += chunk
                if len(got) == len(parts[0]):
                    proceed.set()
            assert got == b"".join(parts)
        assert open_count(transport, server) == 1


# -- reuse -----------------------------------------------------------------------------------


async def test_sequential_requests_reuse_one_connection() -> None:
    transport = H11Transport()
    async with serve(keep_alive(hello)) as server, client_for(transport) as client:
        for _ in range(5):
            assert (await client.get(server.url)).content == b"conn=0"
        assert server.accepted == 1
        assert transport.open_connections() == {server.origin: 1}


async def test_idle_list_is_lifo() -> None:
    transport = H11Transport()
    async with serve(keep_alive(hello)) as server, client_for(transport) as client:
        async with client.stream("GET", server.url) as a, client.stream("GET", server.url) as b:
            body_a = await a.aread()  # returned first
            body_b = await b.aread()  # returned last: reused first
        assert {body_a, body_b} == {b"conn=0", b"conn=1"}
        assert (await client.get(server.url)).content == body_b
        assert (await client.get(server.url)).content == body_b
        assert server.accepted == 2
        assert open_count(transport, server) == 2


async def test_idle_timeout_closes_old_connections() -> None:
    transport = H11Transport(idle_timeout=0.0)
    async with serve(keep_alive(hello)) as server, client_for(transport) as client:
        assert (await client.get(server.url)).content == b"conn=0"
        # idle for more than 0 s by the time it is found: closed, and a new one is made
        assert (await client.get(server.url)).content == b"conn=1"
        assert open_count(transport, server) == 1


async def test_max_idle_closes_the_oldest() -> None:
    transport = H11Transport(max_idle_per_host=1)
    async with serve(keep_alive(hello)) as server, client_for(transport) as client:
        async with client.stream("GET", server.url) as a, client.stream("GET", server.url) as b:
            await a.aread()
            await b.aread()
        assert open_count(transport, server) == 1


# -- closing early, cancellation ---------------------------------------------------------------


def partial_body_server(
    server_saw_close: trio.Event, request_arrived: trio.Event | None = None
) -> Handler:
    """Sends a head and 10 of 1000 body bytes, then waits for the client to close."""

    async def handler(stream: trio.SocketStream, index: int) -> None:
        conn = h11.Connection(h11.SERVER)
        assert await read_request(stream, conn) is not None
        if request_arrived is not None:
            request_arrived.set()
        else:
            await send(
                stream,
                conn,
                h11.Response(status_code=200, headers=[("Content-Length", "1000")]),
                h11.Data(data=b"0123456789"),
            )
        await wait_closed(stream)
        server_saw_close.set()

    return handler


async def test_closing_a_response_early_closes_the_upstream_connection() -> None:
    server_saw_close = trio.Event()
    transport = H11Transport()
    async with (
        serve(partial_body_server(server_saw_close)) as server,
        client_for(transport) as client,
    ):
        async with client.stream("GET", server.url) as response:
            assert await response.aiter_raw().__anext__() == b"0123456789"
            assert open_count(transport, server) == 1
        assert open_count(transport, server) == 0  # dropped synchronously, at aclose
        await wait(server_saw_close)
        await response.aclose()  # a second close is harmless


async def test_cancel_while_reading_the_body_closes_the_upstream_connection() -> None:
    server_saw_close = trio.Event()
    first_chunk = trio.Event()
    transport = H11Transport()
    async with (
        serve(partial_body_server(server_saw_close)) as server,
        client_for(transport) as client,
    ):
        with trio.CancelScope() as scope:

            async def cancel_after_first_chunk() -> None:
                await first_chunk.wait()
                await trio.testing.wait_all_tasks_blocked()  # reader is inside the next read
                scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_after_first_chunk)
                async with client.stream("GET", server.url) as response:
                    async for _ in response.aiter_raw():
                        first_chunk.set()
        assert scope.cancelled_caught
        assert open_count(transport, server) == 0
        await wait(server_saw_close)


async def test_body_chunks_reads_the_transport_stream_directly_and_closes_like_aiter_raw() -> None:
    server_saw_close = trio.Event()
    transport = H11Transport()
    async with (
        serve(partial_body_server(server_saw_close)) as server,
        client_for(transport) as client,
    ):
        async with client.stream("GET", server.url) as response:
            chunks = body_chunks(response)
            assert isinstance(chunks, H11ResponseStream)  # no httpx wrapper per chunk
            assert await chunks.__anext__() == b"0123456789"
            with pytest.raises(httpx.StreamConsumed):
                await response.aiter_raw().__anext__()
        assert open_count(transport, server) == 0  # response.aclose() reached the stream
        await wait(server_saw_close)


async def test_body_chunks_of_another_transport_is_aiter_raw() -> None:
    mock = httpx.MockTransport(lambda r: httpx.Response(200, stream=httpx.ByteStream(b"abc")))
    async with (
        httpx.AsyncClient(transport=mock) as client,
        client.stream("GET", "http://test/") as response,
    ):
        assert [c async for c in body_chunks(response)] == [b"abc"]


async def test_body_chunks_reads_a_chunked_body_to_its_end_and_keeps_the_connection() -> None:
    async def handler(stream: trio.SocketStream, index: int) -> None:
        conn = h11.Connection(h11.SERVER)
        while await read_request(stream, conn) is not None:
            await send(
                stream,
                conn,
                h11.Response(status_code=200, headers=[("Transfer-Encoding", "chunked")]),
                h11.Data(data=b"data: 1\n\n"),
                h11.Data(data=b"data: [DONE]\n\n"),
                h11.EndOfMessage(),
            )
            conn.start_next_cycle()

    transport = H11Transport()
    async with serve(handler) as server, client_for(transport) as client:
        for _ in range(2):
            async with client.stream("GET", server.url) as response:
                body = b"".join([c async for c in body_chunks(response)])
            assert body == b"data: 1\n\ndata: [DONE]\n\n"
        assert server.accepted == 1


async def test_cancel_between_reads_closes_the_upstream_connection() -> None:
    server_saw_close = trio.Event()
    transport = H11Transport()
    async with (
        serve(partial_body_server(server_saw_close)) as server,
        client_for(transport) as client,
    ):
        with trio.CancelScope() as scope:
            async with client.stream("GET", server.url) as response:
                await response.aiter_raw().__anext__()
                scope.cancel()
                await trio.Event().wait()  # cancelled here, outside the transport
        assert scope.cancelled_caught
        assert open_count(transport, server) == 0
        await wait(server_saw_close)


async def test_cancel_while_waiting_for_the_response_head() -> None:
    server_saw_close = trio.Event()
    request_arrived = trio.Event()
    transport = H11Transport()
    handler = partial_body_server(server_saw_close, request_arrived)
    async with serve(handler) as server, client_for(transport) as client:
        async with trio.open_nursery() as nursery:

            async def request() -> None:
                await client.post(server.url, content=b"prompt")

            nursery.start_soon(request)
            await wait(request_arrived)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        assert open_count(transport, server) == 0
        await wait(server_saw_close)


async def test_cancel_while_connecting_leaves_no_slot() -> None:
    transport = H11Transport(max_connections_per_host=1)
    async with serve(keep_alive(hello)) as server, client_for(transport) as client:
        with trio.CancelScope() as scope:
            scope.cancel()
            await client.get(server.url)
        assert scope.cancelled_caught
        assert (await client.get(server.url)).content in (b"conn=0", b"conn=1")
        assert open_count(transport, server) == 1


# -- errors ----------------------------------------------------------------------------------


def truncating_server(raw: bytes, *, reset: bool = False) -> Handler:
    async def handler(stream: trio.SocketStream, index: int) -> None:
        assert await read_request(stream, h11.Connection(h11.SERVER)) is not None
        await stream.send_all(raw)
        if reset:  # RST instead of FIN
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    return handler


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nhel",
    ],
    ids=["content-length", "chunked-between-chunks", "chunked-mid-chunk"],
)
# read=None: a stream's reads, which take a shorter path through the connection.
@pytest.mark.parametrize("read", [5.0, None], ids=["read-limit", "no-read-limit"])
async def test_truncated_body_raises(raw: bytes, read: float | None) -> None:
    transport = H11Transport()
    async with (
        serve(truncating_server(raw)) as server,
        client_for(transport, read=read) as client,
    ):
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(server.url)
        assert open_count(transport, server) == 0


@pytest.mark.parametrize(
    ("raw", "kept"),
    [
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", True),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            b"5\r\nhello\r\n0\r\n\r\n",
            False,
        ),
        (b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", False),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\njunk",
            False,
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nx-t: 1\r\n\r\n",
            True,
        ),
    ],
    ids=["keep-alive", "connection-close", "http-1.0", "bytes-after-the-end", "trailers"],
)
async def test_chunked_body_end_decides_whether_the_connection_is_kept(
    raw: bytes, kept: bool
) -> None:
    async def handler(stream: trio.SocketStream, index: int) -> None:
        assert await read_request(stream, h11.Connection(h11.SERVER)) is not None
        await stream.send_all(raw)
        await wait_closed(stream)

    transport = H11Transport()
    async with serve(handler) as server, client_for(transport) as client:
        async with client.stream("GET", server.url) as response:
            assert b"".join([c async for c in body_chunks(response)]) == b"hello"
        assert open_count(transport, server) == (1 if kept else 0)


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nhel",
    ],
    ids=["content-length", "chunked"],
)
@pytest.mark.parametrize("read", [5.0, None], ids=["read-limit", "no-read-limit"])
async def test_reset_mid_body_raises(raw: bytes, read: float | None) -> None:
    transport = H11Transport()
    async with (
        serve(truncating_server(raw, reset=True)) as server,
        client_for(transport, read=read) as client,
    ):
        with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
            await client.get(server.url)
        assert open_count(transport, server) == 0


async def test_invalid_response_is_a_remote_protocol_error() -> None:
    transport = H11Transport()
    async with (
        serve(truncating_server(b"NOT HTTP AT ALL\r\n\r\n")) as server,
        client_for(transport) as client,
    ):
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(server.url)
        assert open_count(transport, server) == 0


async def test_connection_refused_is_connect_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    transport = H11Transport()
    async with client_for(transport) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{port}/")
    assert transport.open_connections() == {f"127.0.0.1:{port}": 0}


def stalling_server(*, send_head: bool) -> Handler:
    async def handler(stream: trio.SocketStream, index: int) -> None:
        conn = h11.Connection(h11.SERVER)
        assert await read_request(stream, conn) is not None
        if send_head:
            await send(
                stream,
                conn,
                h11.Response(status_code=200, headers=[("Transfer-Encoding", "chunked")]),
                h11.Data(data=b"first"),
            )
        await trio.Event().wait()  # never set: the stall lasts until the test ends

    return handler


async def test_read_timeout_waiting_for_the_head() -> None:
    transport = H11Transport()
    async with (
        serve(stalling_server(send_head=False)) as server,
        client_for(transport, read=0.1) as client,
    ):
        with pytest.raises(httpx.ReadTimeout):
            await client.get(server.url)
        assert open_count(transport, server) == 0


async def test_read_timeout_between_chunks() -> None:
    transport = H11Transport()
    async with (
        serve(stalling_server(send_head=True)) as server,
        client_for(transport, read=0.1) as client,
    ):
        async with client.stream("GET", server.url) as response:
            chunks = response.aiter_raw()
            assert await chunks.__anext__() == b"first"
            with pytest.raises(httpx.ReadTimeout):
                await chunks.__anext__()
        assert open_count(transport, server) == 0


# -- stale keep-alive connections -------------------------------------------------------------


async def test_stale_connection_found_idle_is_replaced() -> None:
    closed = trio.Event()

    async def handler(stream: trio.SocketStream, index: int) -> None:
        conn = h11.Connection(h11.SERVER)
        assert await read_request(stream, conn) is not None
        payload = f"conn={index}".encode()
        await send(
            stream,
            conn,
            h11.Response(status_code=200, headers=[("Content-Length", str(len(payload)))]),
            h11.Data(data=payload),
            h11.EndOfMessage(),
        )
        if index == 0:
            stream.socket.close()  # keep-alive promised, then closed while idle
            closed.set()
        else:
            await wait_closed(stream)

    transport = H11Transport()
    async with serve(handler) as server, client_for(transport) as client:
        assert (await client.get(server.url)).content == b"conn=0"
        await wait(closed)
        assert (await client.get(server.url)).content == b"conn=1"
        assert server.accepted == 2
        assert open_count(transport, server) == 1


def answer_then_drop_second_request(bodies: list[bytes]):  # type: ignore[no-untyped-def]
    """A server whose first connection reads a second request, then closes unanswered: the
    race a keep-alive timeout causes, and also what an engine failing mid-work looks like."""

    async def handler(stream: trio.SocketStream, index: int) -> None:
        conn = h11.Connection(h11.SERVER)
        while (got := await read_request(stream, conn)) is not None:
            bodies.append(got[1])
            if index == 0 and len(bodies) == 2:
                return
            payload = f"conn={index}".encode()
            await send(
                stream,
                conn,
                h11.Response(status_code=200, headers=[("Content-Length", str(len(payload)))]),
                h11.Data(data=payload),
                h11.EndOfMessage(),
            )
            conn.start_next_cycle()

    return handler


async def test_idempotent_request_unanswered_on_a_reused_connection_is_retried_once() -> None:
    bodies: list[bytes] = []
    transport = H11Transport()
    async with (
        serve(answer_then_drop_second_request(bodies)) as server,
        client_for(transport) as client,
    ):
        assert (await client.get(server.url)).content == b"conn=0"
        assert (await client.get(server.url)).content == b"conn=1"
        assert len(bodies) == 3
        assert server.accepted == 2
        assert open_count(transport, server) == 1


async def test_post_that_reached_the_server_is_never_sent_twice() -> None:
    """The engine may have started on it: the caller decides, not the transport."""
    bodies: list[bytes] = []
    transport = H11Transport()
    async with (
        serve(answer_then_drop_second_request(bodies)) as server,
        client_for(transport) as client,
    ):
        assert (await client.post(server.url, content=b"one")).content == b"conn=0"
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            await client.post(server.url, content=b"two")
        assert bodies == [b"one", b"two"]
        assert server.accepted == 1
        assert open_count(transport, server) == 0


async def test_fresh_connection_closed_without_answer_is_not_retried() -> None:
    async def handler(stream: trio.SocketStream, index: int) -> None:
        assert await read_request(stream, h11.Connection(h11.SERVER)) is not None

    transport = H11Transport()
    async with serve(handler) as server, client_for(transport) as client:
        with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
            await client.get(server.url)
        assert server.accepted == 1
        assert open_count(transport, server) == 0


# -- pool limits -----------------------------------------------------------------------------


async def test_request_waits_for_a_connection_at_the_limit() -> None:
    transport = H11Transport(max_connections_per_host=1)
    results: list[bytes] = []
    async with serve(keep_alive(hello)) as server, client_for(transport) as client:
        async with client.stream("GET", server.url) as held, trio.open_nursery() as nursery:

            async def second() -> None:
                results.append((await client.get(server.url)).content)

            nursery.start_soon(second)
            await trio.testing.wait_all_tasks_blocked()
            assert results == []  # waiting for the only connection
            assert server.accepted == 1
            await held.aread()  # clean end: the connection goes to the waiter
        assert results == [b"conn=0"]
        assert server.accepted == 1


async def test_pool_timeout_then_the_pool_still_works() -> None:
    transport = H11Transport(max_connections_per_host=1)
    async with serve(keep_alive(hello)) as server, client_for(transport, pool=0.05) as client:
        async with client.stream("GET", server.url) as held:
            with pytest.raises(httpx.PoolTimeout):
                await client.get(server.url)
            await held.aread()
        assert (await client.get(server.url)).content == b"conn=0"


async def test_waiter_gets_the_slot_of_a_discarded_connection() -> None:
    transport = H11Transport(max_connections_per_host=1)
    results: list[bytes] = []
    async with serve(keep_alive(hello)) as server, client_for(transport) as client:
        async with trio.open_nursery() as nursery, client.stream("GET", server.url):

            async def second() -> None:
                results.append((await client.get(server.url)).content)

            nursery.start_soon(second)
            await trio.testing.wait_all_tasks_blocked()
            # closed unread: socket dropped, the slot passes to the waiter, which connects
        assert results == [b"conn=1"]
        assert open_count(transport, server) == 1


async def test_cancelled_waiter_does_not_leak() -> None:
    transport = H11Transport(max_connections_per_host=1)
    async with serve(keep_alive(hello)) as server, client_for(transport) as client:
        async with client.stream("GET", server.url) as held:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.get, server.url)
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()
            await held.aread()
        assert (await client.get(server.url)).content == b"conn=0"
        assert open_count(transport, server) == 1


@asynccontextmanager
async def a_stream_read_in_part(
    transport: H11Transport, server_saw_close: trio.Event, **timeouts: float | None
) -> AsyncIterator[tuple[Server, httpx.AsyncClient, AsyncIterator[bytes]]]:
    """A `partial_body_server` whose first body chunk has been read; the rest never comes."""
    async with serve(partial_body_server(server_saw_close)) as server:
        client = client_for(transport, **timeouts)
        async with client.stream("GET", server.url) as response:
            chunks = response.aiter_raw()
            await chunks.__anext__()
            yield server, client, chunks


async def test_transport_aclose_closes_idle_and_busy_connections() -> None:
    server_saw_close = trio.Event()
    transport = H11Transport()
    async with a_stream_read_in_part(transport, server_saw_close) as (server, client, chunks):
        await client.aclose()
        await wait(server_saw_close)
        with pytest.raises(httpx.ReadError):
            await chunks.__anext__()
        assert open_count(transport, server) == 0
        with pytest.raises(httpx.ConnectError):
            await transport.handle_async_request(httpx.Request("GET", server.url))


async def test_closing_the_transport_during_a_read_wait_fails_that_read() -> None:
    server_saw_close = trio.Event()
    transport = H11Transport()
    stream = a_stream_read_in_part(transport, server_saw_close, read=None)
    async with stream as (_, client, chunks):
        failed: list[BaseException] = []

        async def read_next() -> None:
            try:
                await chunks.__anext__()
            except httpx.ReadError as exc:
                failed.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_next)
            await trio.testing.wait_all_tasks_blocked()
            assert not failed  # waiting on the socket: the server sent nothing more
            await client.aclose()
        assert len(failed) == 1
        await wait(server_saw_close)


async def test_a_closed_connection_never_reads_the_socket_that_took_its_number() -> None:
    server_saw_close = trio.Event()
    transport = H11Transport()
    async with a_stream_read_in_part(transport, server_saw_close) as (server, client, chunks):
        # The number the connection's socket has (white-box: nothing public shows it).
        (conn,) = transport._pools[("127.0.0.1", server.port)]._connections
        old = conn._stream.socket.fileno()
        await client.aclose()
        a, b = socket.socketpair()
        try:
            newcomer = a if a.fileno() == old else b
            assert newcomer.fileno() == old  # the lowest free number is reused
            other = b if newcomer is a else a
            other.sendall(b"HTTP/1.1 200 OK\r\n")  # now readable under the old number
            with pytest.raises(httpx.ReadError):
                await chunks.__anext__()
            assert newcomer.recv(100) == b"HTTP/1.1 200 OK\r\n"  # still all there
        finally:
            a.close()
            b.close()


# -- load ------------------------------------------------------------------------------------


async def test_200_concurrent_streams() -> None:
    n = 200
    all_started = trio.Event()
    started = 0

    async def handler(stream: trio.SocketStream, index: int) -> None:
        nonlocal started
        conn = h11.Connection(h11.SERVER)
        while await read_request(stream, conn) is not None:
            await send(
                stream,
                conn,
                h11.Response(status_code=200, headers=[("Transfer-Encoding", "chunked")]),
            )
            await send(stream, conn, h11.Data(data=b"data: 1\n\n"))
            started += 1
            if started == n:
                all_started.set()
            await wait(all_started)  # every stream is open at once
            await send(stream, conn, h11.Data(data=b"data: [DONE]\n\n"), h11.EndOfMessage())
            conn.start_next_cycle()

    transport = H11Transport()
    async with serve(handler) as server, client_for(transport) as client:

        async def one() -> None:
            async with client.stream("POST", server.url, content=b"{}") as response:
                assert (
                    b"".join([c async for c in response.aiter_raw()])
                    == b"data: 1\n\ndata: [DONE]\n\n"
                )

        for _round in range(2):
            started = 0
            all_started = trio.Event()
            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    nursery.start_soon(one)
            assert open_count(transport, server) == n
        assert server.accepted == n  # the second round reused every connection


async def test_write_timeout() -> None:
    async def handler(stream: trio.SocketStream, index: int) -> None:
        await trio.Event().wait()  # never reads: the client's send buffers fill up

    transport = H11Transport()
    async with serve(handler) as server, client_for(transport, write=0.1) as client:
        with pytest.raises(httpx.WriteTimeout):
            await client.post(server.url, content=b"x" * (64 * 1024 * 1024))
        assert open_count(transport, server) == 0


async def test_connect_timeout() -> None:
    # A listener that never accepts, with its backlog already full: further SYNs are dropped
    # and connect() hangs until the timeout.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        try:
            transport = H11Transport()
            async with client_for(transport, connect=0.2) as client:
                with pytest.raises(httpx.ConnectTimeout):
                    await client.get(f"http://127.0.0.1:{port}/")
            assert transport.open_connections() == {f"127.0.0.1:{port}": 0}
        finally:
            for filler in fillers:
                filler.close()


# -- the sending side ------------------------------------------------------------------------


async def test_a_half_close_reaches_the_server_and_its_answer_is_still_read() -> None:
    """SendSide: ``written`` once the request is out; ``close()`` is a FIN the server sees
    while the answer it then writes still arrives; the connection is not reused after."""
    saw_eof = trio.Event()

    async def handler(stream: trio.SocketStream, index: int) -> None:
        conn = h11.Connection(h11.SERVER)
        got = await read_request(stream, conn)
        assert got is not None
        assert await stream.receive_some(65536) == b""  # the client's FIN
        saw_eof.set()
        await send(
            stream,
            conn,
            h11.Response(status_code=200, headers=[("Content-Length", "4")]),
            h11.Data(data=b"late"),
            h11.EndOfMessage(),
        )

    transport = H11Transport()
    async with serve(handler) as server, transport:
        side = SendSide()
        request = httpx.Request(
            "POST", server.url + "/x", content=b"body", extensions={SEND_SIDE: side}
        )
        async with trio.open_nursery() as nursery:

            async def leave_once_written() -> None:
                while not side.written:
                    await trio.testing.wait_all_tasks_blocked()
                side.close()

            nursery.start_soon(leave_once_written)
            response = await transport.handle_async_request(request)
            assert side.written and side.closed and saw_eof.is_set()
            assert await response.aread() == b"late"
            await response.aclose()
        assert open_count(transport, server) == 0, "a half-closed connection is not reused"


async def test_a_close_asked_for_before_the_connection_exists_sends_nothing() -> None:
    """The caller left before the request went out: the connection is half-closed as soon as
    it exists, so the server gets no request and the side was never written."""
    got: list[object] = []
    done = trio.Event()

    async def handler(stream: trio.SocketStream, index: int) -> None:
        got.append(await read_request(stream, h11.Connection(h11.SERVER)))
        done.set()

    transport = H11Transport()
    async with serve(handler) as server, transport:
        side = SendSide()
        side.close()
        request = httpx.Request(
            "POST", server.url + "/x", content=b"body", extensions={SEND_SIDE: side}
        )
        with pytest.raises(httpx.WriteError):
            await transport.handle_async_request(request)
        await wait(done)
    assert got == [None] and not side.written
