"""One inference request's life: admission, attempts, prefill leg, decode relay, release.

Structure (DESIGN "One request = one nursery")::

    async with trio.open_nursery() as nursery:           # the request's cancel scope
        nursery.start_soon(watch_disconnect, ...)        # client gone -> cancel everything
        async with admission slot:                       # held for the whole response
            for each attempt:
                lease = routing.lease_pd(key)            # chosen and charged, no checkpoint
                async with lease:                        # releases what is left, on any exit
                    prefill leg                          # prefill released when its body is read
                    decode leg: a reader task owns the   # decode released at upstream EOF/error,
                      decode load; the body writes the   # even if the client stalls
                      client
                retry only if the client got nothing yet and the failure is retriable
        nursery.cancel_scope.cancel()                    # stop the watcher *before* the final send
    send the final message

Cancelling the nursery (client disconnect) unwinds the upstream response, whose close is
synchronous in our transport: the engine sees its connection close and aborts the request.

Retries: the prefill leg is retried on another endpoint after a connection error, a timeout, a
5xx or a 429; a decode failure is retried only before any byte reached the client, and always with
a fresh prefill (the KV blocks of the first may be gone). Each attempt charges and releases its own
endpoints.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs
import httpx
import orjson
import trio

from . import errors, logprobs, pd, sse
from .admission import Admission, Rejected
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
    total_ms: float | None = None
    bytes_out: int = 0
    retries: int = 0
    client_gone: bool = False
    #: Every upstream failure seen, as (stage, endpoint key, kind); kind is ``connect``,
    #: ``timeout``, ``reset``, ``status_<code>`` or ``invalid``.
    upstream_errors: list[tuple[str, str, str]] = attrs.Factory(list)


class OutcomeSink(Protocol):
    """Where leg outcomes go (the circuit breakers)."""

    def record_success(self, endpoint: Endpoint, now: float) -> None: ...

    def record_failure(self, endpoint: Endpoint, now: float) -> None: ...


@attrs.frozen
class _Failure:
    """A leg that failed before the client got a byte."""

    reply: Reply
    endpoint: Endpoint
    retriable: bool
    error: RouterError | None = None


@attrs.define
class _Leg:
    stage: str
    endpoint: Endpoint
    url: str
    content: bytes
    headers: dict[bytes, bytes]
    #: The upstream answered (a response head for a stream, the whole body otherwise).
    answered: bool = False


@attrs.define
class _Head:
    """How the decode upstream answered, handed from the reader task to the writer."""

    ready: trio.Event = attrs.Factory(trio.Event)
    content_type: bytes = b"text/event-stream"
    #: Set when the leg ended before streaming started (a failure, or a 4xx to pass on).
    failure: _Failure | Reply | None = None

    def open(self, content_type: bytes) -> None:
        self.content_type = content_type
        self.ready.set()

    def fail(self, failure: _Failure | Reply) -> None:
        self.failure = failure
        self.ready.set()


class Proxy:
    def __init__(self, config: RouterConfig, routing: Routing, client: httpx.AsyncClient) -> None:
        self._config = config
        self._routing = routing
        self._client = client
        self._rng = random.Random()
        self._stream_timeout = httpx.Timeout(
            connect=config.timeouts.connect,
            read=config.timeouts.idle_limit,
            write=config.timeouts.idle_limit,
            pool=config.timeouts.first_byte_limit,
        )
        #: The concurrency cap and its queue; a slot is held for the whole response.
        self.admission: Admission | None = None
        #: Circuit breakers, fed with every leg's outcome.
        self.outcomes: OutcomeSink | None = None
        #: Where work that outlives its request runs (the stranded-KV release).
        self.background: trio.Nursery | None = None
        #: Called for each stranded-KV release sent.
        self.on_stranded: Callable[[Endpoint], None] | None = None

    async def handle(self, inf: Inference, receive: Receive, send: Send) -> RequestRecord:
        rec = RequestRecord(inf.request_id, inf.path, inf.stream, trio.current_time())
        down = Downstream(send)
        try:
            await self._handle(inf, receive, down, rec)
        except Exception:
            # A bug, not an upstream failure (those are answered where they happen). Answer
            # in the shape the client expects; the leases were released on the way out.
            log.exception("request_id=%s unexpected error", inf.request_id)
            rec.outcome = "internal_error"
            if not rec.client_gone:
                error = errors.internal("the router failed while serving this request")
                reply = Reply.tail(sse.error_event(error)) if down.started else Reply.error(error)
                await down.finish(reply)
        rec.status = down.status
        rec.bytes_out = down.bytes_sent
        rec.total_ms = (trio.current_time() - rec.started) * 1000
        return rec

    async def _handle(
        self, inf: Inference, receive: Receive, down: Downstream, rec: RequestRecord
    ) -> None:
        reply: Reply | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope, rec)
            # Admission waits inside the request's scope: a client that leaves while queued
            # gives its place up at once.
            if self.admission is None:
                reply = await self._serve(inf, down, nursery, rec)
            else:
                try:
                    async with self.admission.slot():
                        reply = await self._serve(inf, down, nursery, rec)
                except Rejected as exc:
                    rec.outcome = "rejected"
                    reply = Reply.error(exc.error)
            nursery.cancel_scope.cancel()
        if rec.client_gone:
            rec.outcome = "client_disconnect"
        elif reply is not None:
            await down.finish(reply)

    async def _serve(
        self, inf: Inference, down: Downstream, nursery: trio.Nursery, rec: RequestRecord
    ) -> Reply:
        """Run attempts until one answers, the failure is final, or attempts run out."""
        attempts = self._config.retry.max_retries
        failed_urls: list[str] = []
        failure: _Failure | None = None
        for attempt in range(1, attempts + 1):
            try:
                if self._config.pd:
                    lease, prefill, decode = self._routing.lease_pd(inf.key, failed_urls)
                else:
                    lease, decode = self._routing.lease_one(Role.REGULAR, inf.key, failed_urls)
                    prefill = None
            except NoHealthyEndpoint as exc:
                if failure is not None:  # the breakers closed the last door: say why
                    return failure.reply
                rec.outcome = "no_endpoint"
                return Reply.error(errors.no_healthy_endpoint(exc.role.value))
            rec.prefill = prefill.key if prefill else None
            rec.decode = decode.key
            async with lease:
                result = await self._attempt(inf, lease, prefill, decode, down, nursery, rec)
            if isinstance(result, Reply):
                return result
            failure = result
            if not failure.retriable or down.started or attempt == attempts:
                break
            failed_urls.append(failure.endpoint.url)
            rec.retries += 1
            await trio.sleep(self._backoff(attempt))
        assert failure is not None
        return failure.reply

    def _backoff(self, attempt: int) -> float:
        r = self._config.retry
        base = min(r.initial_backoff_ms * r.backoff_multiplier ** (attempt - 1), r.max_backoff_ms)
        jitter = 1.0 + r.jitter_factor * self._rng.uniform(-1.0, 1.0)
        return max(0.0, base * jitter) / 1000

    async def _attempt(
        self,
        inf: Inference,
        lease: Lease,
        prefill: Endpoint | None,
        decode: Endpoint,
        down: Downstream,
        nursery: trio.Nursery,
        rec: RequestRecord,
    ) -> Reply | _Failure:
        rid = inf.request_id
        if prefill is not None and self._config.kv_connector == "p2p_nccl":
            rid = pd.p2p_nccl_request_id(prefill, decode)
        extra: list[tuple[bytes, bytes]] = [(b"x-request-id", rid.encode("latin-1", "replace"))]
        prefill_answer: dict[str, Any] | None = None
        kv: Any = None
        if prefill is None:
            extra.append((b"x-trio-pdrouter-worker", decode.key.encode()))
            body = inf.body
        else:
            extra.append((b"x-trio-pdrouter-prefill", prefill.key.encode()))
            extra.append((b"x-trio-pdrouter-decode", decode.key.encode()))
            answer = await self._prefill(inf, rid, lease, prefill, rec)
            if not isinstance(answer, dict):
                return _with_headers(answer, extra)
            prefill_answer = answer
            kv = answer.get("kv_transfer_params")
            body = pd.decode_body(inf.body, kv)
        leg = _Leg(
            stage="decode" if prefill is not None else "worker",
            endpoint=decode,
            url=decode.url + inf.path,
            content=orjson.dumps(body),
            headers=pd.upstream_headers(inf.headers, rid, decode, self._config.upstream_api_key),
        )
        try:
            if inf.stream:
                # The relay sends ``extra`` with its response start, or on its failure reply.
                return await self._relay(leg, lease, down, nursery, rec, extra)
            return _with_headers(await self._buffered(inf, leg, lease, prefill_answer, rec), extra)
        finally:
            if rec.client_gone and kv is not None and not leg.answered:
                self._release_stranded(inf, leg, kv)

    async def _prefill(
        self, inf: Inference, rid: str, lease: Lease, ep: Endpoint, rec: RequestRecord
    ) -> dict[str, Any] | _Failure | Reply:
        started = trio.current_time()
        headers = pd.upstream_headers(inf.headers, rid, ep, self._config.upstream_api_key)
        content = orjson.dumps(pd.prefill_body(inf.body))
        limit = self._config.timeouts.prefill_limit
        try:
            with trio.move_on_after(limit) as scope:
                resp = await self._client.post(ep.url + inf.path, content=content, headers=headers)
        except httpx.HTTPError as exc:
            return self._transport_failure("prefill", ep, exc, rec)
        finally:
            lease.release(ep)
        if scope.cancelled_caught:
            return self._timeout_failure("prefill", ep, f"no answer in {limit:g}s", rec)
        rec.prefill_ms = (trio.current_time() - started) * 1000
        if resp.status_code != 200:
            return self._status_failure(
                "prefill", ep, resp.status_code, resp.headers, resp.content, rec
            )
        try:
            answer = orjson.loads(resp.content)
        except orjson.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            error = errors.upstream_failed("prefill", ep.key, "answer is not a JSON object")
            return self._failure("prefill", ep, error, "invalid", rec, retriable=False)
        self._succeeded(ep)
        return answer

    async def _buffered(
        self,
        inf: Inference,
        leg: _Leg,
        lease: Lease,
        prefill_answer: dict[str, Any] | None,
        rec: RequestRecord,
    ) -> Reply | _Failure:
        ep = leg.endpoint
        limit = self._config.timeouts.first_byte_limit
        lease.sent(ep)
        try:
            with trio.move_on_after(limit) as scope:
                resp = await self._client.post(leg.url, content=leg.content, headers=leg.headers)
        except httpx.HTTPError as exc:
            return self._transport_failure(leg.stage, ep, exc, rec)
        finally:
            lease.release(ep)
        if scope.cancelled_caught:
            return self._timeout_failure(leg.stage, ep, f"no answer in {limit:g}s", rec)
        leg.answered = True
        if resp.status_code != 200:
            return self._status_failure(
                leg.stage, ep, resp.status_code, resp.headers, resp.content, rec
            )
        content = resp.content
        if prefill_answer is not None and logprobs.needs_merge(inf.body):
            try:
                merged = logprobs.merge(inf.body, prefill_answer, orjson.loads(content))
            except orjson.JSONDecodeError:
                error = errors.upstream_failed(leg.stage, ep.key, "answer is not JSON")
                return self._failure(leg.stage, ep, error, "invalid", rec, retriable=False)
            content = orjson.dumps(merged)
        self._succeeded(ep)
        ctype = resp.headers.get("content-type", "application/json").encode()
        return Reply(200, [(b"content-type", ctype)], content)

    async def _relay(
        self,
        leg: _Leg,
        lease: Lease,
        down: Downstream,
        nursery: trio.Nursery,
        rec: RequestRecord,
        extra: Headers,
    ) -> Reply | _Failure:
        head = _Head()
        buffer = RelayBuffer(self._config.max_buffered_bytes)
        nursery.start_soon(self._read_upstream, leg, lease, head, buffer, rec)
        await head.ready.wait()
        if head.failure is not None:
            return _with_headers(head.failure, extra)
        await down.start(
            200, [(b"content-type", head.content_type), (b"cache-control", b"no-cache"), *extra]
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
        request = self._client.build_request(
            "POST", leg.url, content=leg.content, headers=leg.headers, timeout=self._stream_timeout
        )
        limit = self._config.timeouts.first_byte_limit
        lease.sent(ep)
        try:
            with trio.move_on_after(limit) as scope:
                resp = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            lease.release(ep)
            head.fail(self._transport_failure(leg.stage, ep, exc, rec))
            return
        if scope.cancelled_caught:
            lease.release(ep)
            head.fail(self._timeout_failure(leg.stage, ep, f"no response in {limit:g}s", rec))
            return
        try:
            try:
                await self._pump(leg, resp, lease, head, buffer, rec)
            finally:
                # Released before the response closes: closing may await (a clean EOF returns
                # the connection to the pool), and load must not wait for that.
                lease.release(ep)
        except (httpx.HTTPError, RelayOverflow) as exc:
            if isinstance(exc, RelayOverflow):
                rec.outcome = "client_too_slow"
                buffer.close(errors.upstream_failed(leg.stage, ep.key, str(exc)))
            elif head.ready.is_set():  # mid-stream: the client gets an error event
                buffer.close(self._transport_failure(leg.stage, ep, exc, rec).error)
            else:
                head.fail(self._transport_failure(leg.stage, ep, exc, rec))
        finally:
            await resp.aclose()

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
        leg.answered = True
        if resp.status_code != 200:
            body = await resp.aread()
            head.fail(
                self._status_failure(leg.stage, ep, resp.status_code, resp.headers, body, rec)
            )
            return
        if self._config.release_decode_at_headers:
            lease.release(ep)  # the historic bug, reproducible on purpose in tests only
        content_type = resp.headers.get("content-type", "text/event-stream").encode()
        head.open(content_type)
        if not content_type.startswith(b"text/event-stream"):
            async for chunk in resp.aiter_raw():
                buffer.put(chunk)
            buffer.close()
            self._succeeded(ep)
            return
        framer = sse.EventFramer()
        async for chunk in resp.aiter_raw():
            data = framer.feed(chunk)
            if data:
                buffer.put(data)
        if framer.pending or not framer.saw_done:
            error = errors.upstream_failed(leg.stage, ep.key, "stream ended without [DONE]")
            self._failure(leg.stage, ep, error, "invalid", rec, retriable=False)
            buffer.close(error)
        else:
            buffer.close()
            self._succeeded(ep)

    # -- stranded KV -------------------------------------------------------------------------

    def _release_stranded(self, inf: Inference, leg: _Leg, kv: Any) -> None:
        """The client left after prefill answered but before decode did: pull the KV anyway."""
        if not self._config.release_stranded_kv or self.background is None:
            return
        content = orjson.dumps(pd.stranded_decode_body(inf.body, kv))
        # Charged now, synchronously: the engine is about to run this request.
        lease = self._routing.ledger.lease(leg.endpoint)
        try:
            self.background.start_soon(self._drain_stranded, leg, content, lease)
        except RuntimeError:  # shutting down: the background nursery is closed
            lease.release_all()

    async def _drain_stranded(self, leg: _Leg, content: bytes, lease: Lease) -> None:
        with lease, trio.move_on_after(self._config.timeouts.first_byte_limit):
            try:
                async with self._client.stream(
                    "POST", leg.url, content=content, headers=leg.headers
                ) as resp:
                    async for _ in resp.aiter_raw():
                        break  # the first event means the KV blocks were pulled
            except httpx.HTTPError as exc:
                log.info("stranded_kv endpoint=%s error=%s", leg.endpoint.key, type(exc).__name__)
        if self.on_stranded is not None:
            self.on_stranded(leg.endpoint)

    # -- outcomes ----------------------------------------------------------------------------

    def _succeeded(self, ep: Endpoint) -> None:
        if self.outcomes is not None:
            self.outcomes.record_success(ep, trio.current_time())

    def _failure(
        self,
        stage: str,
        ep: Endpoint,
        error: RouterError,
        kind: str,
        rec: RequestRecord,
        *,
        retriable: bool,
        breaker: bool = True,
    ) -> _Failure:
        rec.upstream_errors.append((stage, ep.key, kind))
        rec.outcome = "timeout" if kind == "timeout" else "upstream_error"
        if breaker and self.outcomes is not None:
            self.outcomes.record_failure(ep, trio.current_time())
        return _Failure(Reply.error(error), ep, retriable, error)

    def _transport_failure(
        self, stage: str, ep: Endpoint, exc: httpx.HTTPError, rec: RequestRecord
    ) -> _Failure:
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if isinstance(exc, httpx.TimeoutException):
            return self._failure(
                stage,
                ep,
                errors.upstream_timeout(stage, ep.key, detail),
                "timeout",
                rec,
                retriable=True,
            )
        kind = "connect" if isinstance(exc, httpx.ConnectError) else "reset"
        error = errors.upstream_failed(stage, ep.key, detail)
        return self._failure(stage, ep, error, kind, rec, retriable=True)

    def _timeout_failure(
        self, stage: str, ep: Endpoint, detail: str, rec: RequestRecord
    ) -> _Failure:
        error = errors.upstream_timeout(stage, ep.key, detail)
        return self._failure(stage, ep, error, "timeout", rec, retriable=True)

    def _status_failure(
        self,
        stage: str,
        ep: Endpoint,
        status: int,
        headers: httpx.Headers,
        body: bytes,
        rec: RequestRecord,
    ) -> _Failure | Reply:
        """An engine's 4xx goes to the client unchanged (429 after retries); 5xx is a 502."""
        if 400 <= status < 500:
            ctype = headers.get("content-type", "application/json").encode()
            reply = Reply(status, [(b"content-type", ctype)], body)
            if status != 429:
                rec.outcome = "upstream_status"
                self._succeeded(ep)  # the engine is healthy; the request was not
                return reply
            rec.upstream_errors.append((stage, ep.key, "status_429"))
            rec.outcome = "upstream_status"
            return _Failure(reply, ep, retriable=True)
        excerpt = body[:200].decode("utf-8", "replace")
        error = errors.upstream_failed(stage, ep.key, f"HTTP {status}: {excerpt}")
        return self._failure(stage, ep, error, f"status_{status}", rec, retriable=True)


async def _watch_disconnect(receive: Receive, scope: trio.CancelScope, rec: RequestRecord) -> None:
    # hypercorn never cancels the app when the client leaves; it only queues http.disconnect.
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            rec.client_gone = True
            scope.cancel()
            return


def _with_headers(result: Reply | _Failure, extra: Headers) -> Reply | _Failure:
    if isinstance(result, _Failure):
        return attrs.evolve(result, reply=_reply_with_headers(result.reply, extra))
    return _reply_with_headers(result, extra)


def _reply_with_headers(reply: Reply, extra: Headers) -> Reply:
    return Reply(reply.status, [*reply.headers, *extra], reply.body)
