"""In-memory plumbing for router tests: an ASGI client and a scripted upstream transport.

No sockets: the tests drive every ordering of upstream chunks, errors and client disconnects
deterministically, and can see whether each upstream response was closed.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import attrs
import httpx
import orjson
import trio

from trio_pdrouter.app import RouterApp
from trio_pdrouter.assemble import build_app
from trio_pdrouter.config import RouterConfig
from trio_pdrouter.http import LegClient
from trio_pdrouter.transport import SEND_SIDE

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]

# A NIXL prefill answer and a PD client request, as the proxy tests use them.
KV = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "engine-1",
    "remote_block_ids": [1, 2, 3],
    "remote_host": "10.1.2.3",
    "remote_port": 5600,
    "tp_size": 1,
}
PREFILL_ANSWER = {
    "id": "cmpl-1",
    "choices": [{"text": "x", "finish_reason": "length"}],
    "kv_transfer_params": KV,
}
EVENT = b'data: {"choices":[{"text":"hi"}]}\n\n'
REQUEST = {
    "model": "m",
    "prompt": "hello there",
    "max_tokens": 8,
    "stream": True,
    "stream_options": {"include_usage": True},
    "min_tokens": 2,
}


class ScriptedBody(httpx.AsyncByteStream):
    """A response body the test feeds: ``push`` bytes, then ``end`` or ``fail``."""

    def __init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel[bytes | Exception](math.inf)
        self.closed = False
        self.read_to_end = False

    def push(self, data: bytes) -> None:
        self._send.send_nowait(data)

    def fail(self, exc: Exception) -> None:
        self._send.send_nowait(exc)

    def end(self) -> None:
        self._send.close()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for item in self._receive:
            if isinstance(item, Exception):
                raise item
            yield item
        self.read_to_end = True

    async def aclose(self) -> None:
        self.closed = True


class ScriptedUpstream(httpx.AsyncBaseTransport):
    """Answers each upstream request with whatever ``handler`` returns; records everything."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[httpx.Request] = []
        self.bodies: list[ScriptedBody] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        self.requests.append(request)
        side = request.extensions.get(SEND_SIDE)
        if side is not None:
            side.written = True  # the engine has the whole request, as a real transport reports
        try:
            response = await self.handler(request)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            if side is not None:
                side.written = False  # a connection never made carried nothing
            raise
        if isinstance(response.stream, ScriptedBody):
            self.bodies.append(response.stream)
        return response

    def json_of(self, index: int) -> Any:
        return orjson.loads(self.requests[index].content)


def streaming(
    status: int = 200, content_type: str = "text/event-stream"
) -> tuple[httpx.Response, ScriptedBody]:
    body = ScriptedBody()
    return httpx.Response(status, headers={"content-type": content_type}, stream=body), body


def json_response(payload: Any, status: int = 200) -> httpx.Response:
    return httpx.Response(status, json=payload)


class StreamingDecode:
    """A scripted PD upstream: prefill answers :data:`PREFILL_ANSWER`; each decode request gets
    a streaming body that the test feeds (``bodies[i].push(...)``, ``.end()``, ``.fail()``)."""

    def __init__(self) -> None:
        self.bodies: list[ScriptedBody] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        response, body = streaming()
        self.bodies.append(body)
        return response


@attrs.define
class Exchange:
    """One in-memory request: what the app sent, and a switch to disconnect the client."""

    status: int | None = None
    headers: dict[str, str] = attrs.Factory(dict)
    body: bytearray = attrs.Factory(bytearray)
    complete: bool = False
    started: trio.Event = attrs.Factory(trio.Event)
    finished: trio.Event = attrs.Factory(trio.Event)
    disconnect: trio.Event = attrs.Factory(trio.Event)
    chunks: int = 0
    #: Set while the client drains its socket; cleared by :meth:`stop_reading`.
    draining: trio.Event = attrs.Factory(trio.Event)

    def __attrs_post_init__(self) -> None:
        self.draining.set()

    def json(self) -> Any:
        return orjson.loads(bytes(self.body))

    def stop_reading(self) -> None:
        """From now on the app's ``send()`` blocks (uncancellably, as in hypercorn) until the
        client reads again or leaves."""
        if self.draining.is_set():
            self.draining = trio.Event()

    def resume_reading(self) -> None:
        self.draining.set()

    def leave(self) -> None:
        """The client goes away: ``http.disconnect`` is delivered and a blocked ``send()``
        returns (hypercorn's send to a dead client silently succeeds)."""
        self.disconnect.set()
        self.draining.set()


async def call(
    app: RouterApp,
    method: str,
    path: str,
    body: Any = None,
    *,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    exchange: Exchange | None = None,
) -> Exchange:
    """Run one request through the app.

    ``exchange.disconnect.set()`` (or ``exchange.leave()``) makes the client leave;
    ``exchange.stop_reading()`` makes it stop draining its socket.
    """
    ex = exchange or Exchange()
    content = raw if raw is not None else (orjson.dumps(body) if body is not None else b"")
    hdrs = {"content-type": "application/json"} if body is not None else {}
    hdrs.update(headers or {})
    scope = {
        "type": "http",
        "method": method,
        # As an ASGI server gives them: the path percent-decoded once, the bytes as received.
        "path": unquote(path),
        "raw_path": path.encode(),
        "headers": [(k.lower().encode(), v.encode()) for k, v in hdrs.items()],
        "client": ("10.9.8.7", 50123),
    }
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": content, "more_body": False}
        await ex.disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            ex.status = message["status"]
            ex.headers = {k.decode(): v.decode() for k, v in message["headers"]}
            ex.started.set()
        elif message["type"] == "http.response.body":
            ex.body += message.get("body", b"")
            ex.chunks += 1
            if not message.get("more_body", False):
                ex.complete = True
        if not ex.draining.is_set():
            # The bytes sit in the socket buffer and the send waits for the client to drain
            # it; hypercorn shields that wait, so no cancellation gets in.
            with trio.CancelScope(shield=True):
                await ex.draining.wait()

    await app(scope, receive, send)
    ex.finished.set()
    return ex


def make_app(
    config: RouterConfig, handler: Handler, background: trio.Nursery
) -> tuple[RouterApp, ScriptedUpstream]:
    """The app over a scripted upstream; ``background`` runs what outlives a request (pass the
    ``background`` fixture of ``tests/conftest.py``)."""
    upstream = ScriptedUpstream(handler)
    app = build_app(config, LegClient(transport=upstream), background)
    return app, upstream


def pd_config(**changes: Any) -> RouterConfig:
    base = RouterConfig(
        pd=True,
        prefill_urls=("http://prefill:8100",),
        decode_urls=("http://decode:8200",),
        policy="round_robin",
    )
    return attrs.evolve(base, **changes)


def loads(app: RouterApp) -> dict[str, dict[str, int]]:
    return app.ledger.snapshot()


def total_load(app: RouterApp) -> int:
    return app.ledger.total()
