"""The stack's floor: the smallest relay hypercorn's trio worker can serve, as its own process.

``python -m benchmarks.floor --port P --worker-urls URL ...`` (regular) or ``--prefill URL
--decode URL`` (PD). It answers ``GET /health`` and relays ``POST /v1/completions``:

* regular: one upstream POST, then per upstream ``receive_some`` at most one ASGI body
  ``send()`` of the de-chunked bytes; nothing else (no routing beyond round robin, no load
  ledger, no SSE framing, no metrics, no logging) but one task per request that ends the relay
  when the client leaves (as any relay must, or streams go on to nobody);
* PD: the prefill POST (one token, ``kv_transfer_params`` requested), its answer read whole and
  parsed for ``kv_transfer_params``, then the decode POST relayed as above.

Same hypercorn configuration as the router (trio worker, backlog, keep-alive). Upstream
connections are raw trio sockets with a LIFO idle list per server. This is a yardstick, not a
router: it assumes well-formed answers from the simulator and does no error handling beyond
dropping a connection that failed. The router's cost per event is reported as a ratio to this.
``--write-at-once`` (an experiment, :mod:`.hypercorn_send`) serves it on a hypercorn whose send
path writes at once, without its lock and checkpoints: what a change to hypercorn would save.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, cast
from urllib.parse import urlsplit

import orjson
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from hypercorn.typing import Framework

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

READ_SIZE = 65536
_SSE_HEAD = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class Upstream:
    """One server: where it is and its idle keep-alive connections (newest last)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.host_header = f"{self.host}:{self.port}".encode()
        self.idle: list[trio.SocketStream] = []

    async def connect(self) -> trio.SocketStream:
        return self.idle.pop() if self.idle else await trio.open_tcp_stream(self.host, self.port)


class Dechunker:
    """Chunked transfer coding (without trailers), undone incrementally; ``done`` once the
    body's last byte has been fed."""

    __slots__ = ("_buf", "_last", "_left", "_skip", "done")

    def __init__(self) -> None:
        self._buf = b""
        self._left = 0  # payload bytes still due in the current chunk
        self._skip = 0  # bytes of the current chunk's closing CRLF still to skip
        self._last = False  # the zero-size chunk was seen: its CRLF ends the body
        self.done = False

    def feed(self, data: bytes) -> bytes:
        buf = self._buf + data if self._buf else data
        out: list[bytes] = []
        pos, size = 0, len(buf)
        while pos < size and not self.done:
            if self._skip:
                step = min(self._skip, size - pos)
                pos += step
                self._skip -= step
                self.done = self._last and not self._skip
            elif self._left:
                take = min(self._left, size - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self._left -= take
                if not self._left:
                    self._skip = 2
            else:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                self._left = int(buf[pos:end].split(b";", 1)[0], 16)
                pos = end + 2
                if not self._left:  # no trailers: the body ends with one more CRLF
                    self._last, self._skip = True, 2
        self._buf = buf[pos:]
        return out[0] if len(out) == 1 else b"".join(out)


async def _request(up: Upstream, path: bytes, body: bytes) -> tuple[trio.SocketStream, bytes]:
    """Send a POST; return the connection and the bytes read past the response head."""
    stream = await up.connect()
    head = b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n" % (
        path,
        up.host_header,
    )
    await stream.send_all(head + b"content-length: %d\r\n\r\n" % len(body) + body)
    data = b""
    while (cut := data.find(b"\r\n\r\n")) < 0:
        more = await stream.receive_some(READ_SIZE)
        if not more:
            raise trio.BrokenResourceError("upstream closed before the response head")
        data += more
    return stream, data[cut + 4 :]


async def _relay(up: Upstream, path: bytes, body: bytes, send: Send) -> None:
    stream, rest = await _request(up, path, body)
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEAD})
    dechunk = Dechunker()
    try:
        payload = dechunk.feed(rest)
        while True:
            if payload:
                await send({"type": "http.response.body", "body": payload, "more_body": True})
            if dechunk.done:
                break
            data = await stream.receive_some(READ_SIZE)
            if not data:
                raise trio.BrokenResourceError("upstream closed mid-body")
            payload = dechunk.feed(data)
    except BaseException:
        stream.socket.close()
        raise
    up.idle.append(stream)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _read_json(up: Upstream, path: bytes, body: bytes) -> Any:
    stream, rest = await _request(up, path, body)
    # The simulator answers JSON with a content-length; the head was consumed by _request,
    # so read to the end of the JSON document by parsing what has arrived.
    data = rest
    while True:
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            more = await stream.receive_some(READ_SIZE)
            if not more:
                stream.socket.close()
                raise
            data += more
            continue
        up.idle.append(stream)
        return doc


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


class FloorApp:
    """The ASGI app: regular (``decode`` only) or PD (``prefill`` and ``decode``)."""

    def __init__(self, decode: Sequence[str], prefill: Sequence[str]) -> None:
        self._decode: Iterator[Upstream] = itertools.cycle([Upstream(u) for u in decode])
        self._prefill: Iterator[Upstream] | None = (
            itertools.cycle([Upstream(u) for u in prefill]) if prefill else None
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["method"] == "GET":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body", False):
                break
        async with trio.open_nursery() as nursery:
            # A client that left ends its relay (which closes the upstream): without this the
            # floor would relay whole streams to nobody after a load run stops.
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            await self._serve(scope["raw_path"], raw, send)
            nursery.cancel_scope.cancel()

    async def _serve(self, path: bytes, raw: bytes, send: Send) -> None:
        if self._prefill is None:
            await _relay(next(self._decode), path, raw, send)
            return
        body = orjson.loads(raw)
        first = {**body, "max_tokens": 1, "stream": False}
        first.pop("stream_options", None)
        first["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
        answer = await _read_json(next(self._prefill), path, orjson.dumps(first))
        body["kv_transfer_params"] = answer.get("kv_transfer_params")
        await _relay(next(self._decode), path, orjson.dumps(body), send)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.floor", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--worker-urls", nargs="+", default=[], help="regular mode servers")
    p.add_argument("--prefill", action="append", default=[], help="PD mode prefill server")
    p.add_argument("--decode", action="append", default=[], help="PD mode decode server")
    p.add_argument(
        "--write-at-once",
        action="store_true",
        help="EXPERIMENT: serve on hypercorn with its send path patched (benchmarks."
        "hypercorn_send): what a change to hypercorn would save",
    )
    args = p.parse_args(argv)
    if args.write_at_once:
        from .hypercorn_send import write_at_once

        write_at_once()
    decode = args.decode if args.prefill else args.worker_urls
    if not decode:
        p.error("give --worker-urls, or --prefill and --decode")
    config = Config()
    config.bind = [f"{args.host}:{args.port}"]
    config.backlog = 2048
    config.keep_alive_timeout = 75.0
    config.accesslog = None
    app = FloorApp(decode, args.prefill)
    trio.run(lambda: serve(cast(Framework, app), config))


if __name__ == "__main__":
    main()
