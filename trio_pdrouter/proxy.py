"""One inference request's life: choose and charge, prefill leg, decode relay, release.

Structure (DESIGN "One request = one nursery")::

    lease = routing.lease_pd(key)                        # chosen and charged, no checkpoint
    async with lease:                                    # releases whatever is left, on any exit
        async with trio.open_nursery() as nursery:       # the request's cancel scope
            nursery.start_soon(watch_disconnect, ...)    # client gone -> cancel everything
            prefill leg                                  # prefill released when its body is read
            decode leg: a reader task owns the decode    # decode released at upstream EOF/error,
                        load, the body writes the client # even if the client stalls
            nursery.cancel_scope.cancel()                # stop the watcher *before* the final send
    send the final message

Cancelling the nursery (client disconnect) unwinds the upstream ``async with client.stream``,
whose close is synchronous in our transport: the engine sees its connection close and aborts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import attrs
import httpx
import orjson
import trio

from . import errors, logprobs, pd, sse
from .asgi import Downstream, Headers, Receive, Reply, Send
from .config import RouterConfig
from .endpoints import Endpoint, Role
from .errors import RouterError
from .load import Lease
from .policies import RoutingKey
from .relay import RelayBuffer, RelayOverflow
from .routing import NoHealthyEndpoint, Routing

log = logging.getLogger("trio_pdrouter.proxy")


@attrs.frozen
class Inference:
    """A parsed and validated client request."""

    path: str
    body: dict[str, Any]
    headers: Mapping[str, str]
    stream: bool
    request_id: str
    key: RoutingKey


@attrs.define
class RequestRecord:
    """What happened to one request; feeds the access log and metrics."""

    request_id: str
    route: str
    stream: bool
    started: float
    prefill: str | None = None
    decode: str | None = None
    status: int = 0
    outcome: str = "ok"
    prefill_ms: float | None = None
    ttfb_ms: float | None = None
    client_gone: bool = False


@attrs.define
class _Head:
    """How the decode upstream answered, handed from the reader task to the writer."""

    ready: trio.Event = attrs.Factory(trio.Event)
    content_type: bytes = b"text/event-stream"
    reply: Reply | None = None  # set when the leg ended before streaming started

    def open(self, content_type: bytes) -> None:
        self.content_type = content_type
        self.ready.set()

    def fail(self, reply: Reply) -> None:
        self.reply = reply
        self.ready.set()


class Proxy:
    def __init__(self, config: RouterConfig, routing: Routing, client: httpx.AsyncClient) -> None:
        self._config = config
        self._routing = routing
        self._client = client

    async def handle(self, inf: Inference, receive: Receive, send: Send) -> RequestRecord:
        rec = RequestRecord(inf.request_id, inf.path, inf.stream, trio.current_time())
        down = Downstream(send)
        try:
            await self._handle(inf, receive, down, rec)
        except Exception:
            # A bug, not an upstream failure (those are answered where they happen). Answer
            # in the shape the client expects; the lease was released on the way out.
            log.exception("request_id=%s unexpected error", inf.request_id)
            rec.outcome = "internal_error"
            if not rec.client_gone:
                error = errors.internal("the router failed while serving this request")
                reply = Reply.tail(sse.error_event(error)) if down.started else Reply.error(error)
                await down.finish(reply)
        rec.status = down.status
        return rec

    async def _handle(
        self, inf: Inference, receive: Receive, down: Downstream, rec: RequestRecord
    ) -> None:
        try:
            if self._config.pd:
                lease, prefill, decode = self._routing.lease_pd(inf.key)
            else:
                lease, decode = self._routing.lease_one(Role.REGULAR, inf.key)
                prefill = None
        except NoHealthyEndpoint as exc:
            rec.outcome = "no_endpoint"
            await down.finish(Reply.error(errors.no_healthy_endpoint(exc.role.value)))
            return
        rec.prefill = prefill.key if prefill else None
        rec.decode = decode.key
        reply: Reply | None = None
        async with lease, trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope, rec)
            reply = await self._exchange(inf, lease, prefill, decode, down, nursery, rec)
            nursery.cancel_scope.cancel()
        if rec.client_gone:
            rec.outcome = "client_disconnect"
        elif reply is not None:
            await down.finish(reply)

    async def _exchange(
        self,
        inf: Inference,
        lease: Lease,
        prefill: Endpoint | None,
        decode: Endpoint,
        down: Downstream,
        nursery: trio.Nursery,
        rec: RequestRecord,
    ) -> Reply:
        rid = inf.request_id
        if prefill is not None and self._config.kv_connector == "p2p_nccl":
            rid = pd.p2p_nccl_request_id(prefill, decode)
        extra: list[tuple[bytes, bytes]] = [(b"x-request-id", rid.encode())]
        if prefill is None:
            extra.append((b"x-trio-pdrouter-worker", decode.key.encode()))
            body = inf.body
            prefill_answer = None
        else:
            extra.append((b"x-trio-pdrouter-prefill", prefill.key.encode()))
            extra.append((b"x-trio-pdrouter-decode", decode.key.encode()))
            answer = await self._prefill(inf, rid, lease, prefill, rec)
            if isinstance(answer, Reply):
                return _with_headers(answer, extra)
            prefill_answer = answer
            body = pd.decode_body(inf.body, answer.get("kv_transfer_params"))
        leg = _Leg(
            stage="decode" if prefill is not None else "worker",
            endpoint=decode,
            url=decode.url + inf.path,
            content=orjson.dumps(body),
            headers=pd.upstream_headers(inf.headers, rid, decode, self._config.upstream_api_key),
        )
        if inf.stream:
            return await self._relay(leg, lease, down, nursery, extra, rec)
        return await self._buffered(inf, leg, lease, prefill_answer, extra, rec)

    async def _prefill(
        self, inf: Inference, rid: str, lease: Lease, ep: Endpoint, rec: RequestRecord
    ) -> dict[str, Any] | Reply:
        started = trio.current_time()
        headers = pd.upstream_headers(inf.headers, rid, ep, self._config.upstream_api_key)
        limit = self._config.timeouts.request
        try:
            with trio.move_on_after(limit) as scope:
                resp = await self._client.post(
                    ep.url + inf.path,
                    content=orjson.dumps(pd.prefill_body(inf.body)),
                    headers=headers,
                )
        except httpx.HTTPError as exc:
            rec.outcome = _outcome(exc)
            return Reply.error(_transport_error("prefill", ep, exc))
        finally:
            lease.release(ep)
        if scope.cancelled_caught:
            rec.outcome = "timeout"
            return Reply.error(
                errors.upstream_timeout("prefill", ep.key, f"no answer in {limit:g}s")
            )
        rec.prefill_ms = (trio.current_time() - started) * 1000
        if resp.status_code != 200:
            rec.outcome = "upstream_status"
            return _upstream_status("prefill", ep, resp.status_code, resp.headers, resp.content)
        try:
            answer = orjson.loads(resp.content)
        except orjson.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            rec.outcome = "upstream_error"
            return Reply.error(
                errors.upstream_failed("prefill", ep.key, "answer is not a JSON object")
            )
        return answer

    async def _buffered(
        self,
        inf: Inference,
        leg: _Leg,
        lease: Lease,
        prefill_answer: dict[str, Any] | None,
        extra: Headers,
        rec: RequestRecord,
    ) -> Reply:
        limit = self._config.timeouts.request
        try:
            with trio.move_on_after(limit) as scope:
                resp = await self._client.post(leg.url, content=leg.content, headers=leg.headers)
        except httpx.HTTPError as exc:
            rec.outcome = _outcome(exc)
            return Reply.error(_transport_error(leg.stage, leg.endpoint, exc), extra)
        finally:
            lease.release(leg.endpoint)
        if scope.cancelled_caught:
            rec.outcome = "timeout"
            err = errors.upstream_timeout(leg.stage, leg.endpoint.key, f"no answer in {limit:g}s")
            return Reply.error(err, extra)
        if resp.status_code != 200:
            rec.outcome = "upstream_status"
            reply = _upstream_status(
                leg.stage, leg.endpoint, resp.status_code, resp.headers, resp.content
            )
            return _with_headers(reply, extra)
        content = resp.content
        if prefill_answer is not None and logprobs.needs_merge(inf.body):
            try:
                merged = logprobs.merge(inf.body, prefill_answer, orjson.loads(content))
            except orjson.JSONDecodeError:
                err = errors.upstream_failed(leg.stage, leg.endpoint.key, "answer is not JSON")
                rec.outcome = "upstream_error"
                return Reply.error(err, extra)
            content = orjson.dumps(merged)
        ctype = resp.headers.get("content-type", "application/json").encode()
        return Reply(200, [(b"content-type", ctype), *extra], content)

    async def _relay(
        self,
        leg: _Leg,
        lease: Lease,
        down: Downstream,
        nursery: trio.Nursery,
        extra: Headers,
        rec: RequestRecord,
    ) -> Reply:
        head = _Head()
        buffer = RelayBuffer(self._config.max_buffered_bytes)
        nursery.start_soon(self._read_upstream, leg, lease, head, buffer, rec)
        await head.ready.wait()
        if head.reply is not None:
            return _with_headers(head.reply, extra)
        await down.start(
            200,
            [(b"content-type", head.content_type), (b"cache-control", b"no-cache"), *extra],
        )
        while (data := await buffer.take()) is not None:
            if rec.ttfb_ms is None:
                rec.ttfb_ms = (trio.current_time() - rec.started) * 1000
            await down.chunk(data)
        if buffer.error is not None:
            return Reply.tail(sse.error_event(buffer.error))
        return Reply.tail()

    async def _read_upstream(
        self, leg: _Leg, lease: Lease, head: _Head, buffer: RelayBuffer, rec: RequestRecord
    ) -> None:
        """The upstream reader: owns the decode load until upstream EOF, error or cancel."""
        ep = leg.endpoint
        try:
            async with self._client.stream(
                "POST", leg.url, content=leg.content, headers=leg.headers
            ) as resp:
                try:
                    await self._pump(leg, resp, lease, head, buffer, rec)
                finally:
                    # Released before the stream closes: closing may await (a clean EOF returns
                    # the connection to the pool), and load must not wait for that.
                    lease.release(ep)
        except (httpx.HTTPError, RelayOverflow) as exc:
            if isinstance(exc, RelayOverflow):
                rec.outcome = "client_too_slow"
                error = errors.upstream_failed(leg.stage, ep.key, str(exc))
            else:
                rec.outcome = _outcome(exc)
                error = _transport_error(leg.stage, ep, exc)
            if head.ready.is_set():
                buffer.close(error)
            else:
                head.fail(Reply.error(error))

    async def _pump(
        self,
        leg: _Leg,
        resp: httpx.Response,
        lease: Lease,
        head: _Head,
        buffer: RelayBuffer,
        rec: RequestRecord,
    ) -> None:
        ep = leg.endpoint
        if resp.status_code != 200:
            body = await resp.aread()
            rec.outcome = "upstream_status"
            head.fail(_upstream_status(leg.stage, ep, resp.status_code, resp.headers, body))
            return
        if self._config.release_decode_at_headers:
            lease.release(ep)  # the historic bug, reproducible on purpose in tests only
        content_type = resp.headers.get("content-type", "text/event-stream").encode()
        head.open(content_type)
        if not content_type.startswith(b"text/event-stream"):
            async for chunk in resp.aiter_raw():
                buffer.put(chunk)
            buffer.close()
            return
        framer = sse.EventFramer()
        async for chunk in resp.aiter_raw():
            data = framer.feed(chunk)
            if data:
                buffer.put(data)
        if framer.pending or not framer.saw_done:
            rec.outcome = "upstream_error"
            buffer.close(errors.upstream_failed(leg.stage, ep.key, "stream ended without [DONE]"))
        else:
            buffer.close()


@attrs.frozen
class _Leg:
    stage: str
    endpoint: Endpoint
    url: str
    content: bytes
    headers: dict[str, str]


async def _watch_disconnect(receive: Receive, scope: trio.CancelScope, rec: RequestRecord) -> None:
    # hypercorn never cancels the app when the client leaves; it only queues http.disconnect.
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            rec.client_gone = True
            scope.cancel()
            return


def _outcome(exc: Exception) -> str:
    return "timeout" if isinstance(exc, httpx.TimeoutException) else "upstream_error"


def _transport_error(stage: str, ep: Endpoint, exc: Exception) -> RouterError:
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        return errors.upstream_timeout(stage, ep.key, detail)
    return errors.upstream_failed(stage, ep.key, detail)


def _upstream_status(
    stage: str, ep: Endpoint, status: int, headers: httpx.Headers, body: bytes
) -> Reply:
    """An engine's 4xx goes to the client unchanged; anything else non-200 is a 502."""
    if 400 <= status < 500:
        ctype = headers.get("content-type", "application/json").encode()
        return Reply(status, [(b"content-type", ctype)], body)
    excerpt = body[:200].decode("utf-8", "replace")
    return Reply.error(errors.upstream_failed(stage, ep.key, f"HTTP {status}: {excerpt}"))


def _with_headers(reply: Reply, extra: Headers) -> Reply:
    return Reply(reply.status, [*reply.headers, *extra], reply.body)
