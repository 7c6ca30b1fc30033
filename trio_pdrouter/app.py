"""The ASGI application: the routing table, request parsing, and the small admin routes.

Inference requests are parsed and validated here, completely, before anything is chosen or
charged: a bad request never reaches an engine and never touches the ledger.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import httpx
import orjson
import trio

from . import errors, pd, sampling
from .asgi import Downstream, Headers, Receive, Reply, Scope, Send, answer_lifespan
from .config import RouterConfig
from .context_length import ContextCheck
from .cors import Cors, origin_of
from .endpoints import Role
from .engine_truth import EngineTruth
from .errors import RouterError
from .fleet import DuplicateServer, Fleet
from .health import HealthBoard, Verdicts
from .kv_subscriber import KvEvents
from .load import LoadLedger
from .metrics import CONTENT_TYPE, RouterMetrics
from .peers import PeerLoads, Snapshot, cluster_view
from .policies.routing_key import routing_key
from .prompt_tokens import PromptTokens
from .proxy import Proxy
from .record import RequestRecord, access_line
from .request import Inference
from .routes import ROUTES, Route
from .routing import Routing

log = logging.getLogger("trio_pdrouter.access")

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_ROUTES = frozenset({"/health", "/healthcheck", "/liveness", "/readiness"})
WORKER_PREFIX = "/workers/"
#: orjson parses JSON nested ~1000 deep but serialises only 255 levels; no OpenAI request nests
#: beyond a handful, so anything deeper is refused before it is charged or forwarded.
MAX_JSON_DEPTH = 64


#: Sent with an answer after which the connection cannot be reused (part of the request unread).
CLOSE = ((b"connection", b"close"),)


class BadRequest(Exception):
    def __init__(self, error: RouterError, headers: Headers = ()) -> None:
        super().__init__(error.message)
        self.error = error
        self.headers = headers


class RouterApp:
    """The router's ASGI application (see the module doc).

    Every collaborator is given here: the fleet (servers), routing (candidates), the ledger
    (``/get_loads``), the proxy (inference), the upstream client (``/v1/models``), metrics,
    the health board, engine truth (None when ``--engine-metrics-interval`` is 0), the
    peers' loads (None without ``--cluster-url``), the KV-event subscriber (None without
    ``--kv-event-source``), the prompt tokenizer calls (None without a ``kv_aware`` stage) and
    the context length check (None with ``--no-check-context-length``).
    """

    def __init__(
        self,
        config: RouterConfig,
        *,
        fleet: Fleet,
        routing: Routing,
        ledger: LoadLedger,
        proxy: Proxy,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        health: HealthBoard,
        engine_truth: EngineTruth | None,
        peers: PeerLoads | None,
        verdicts: Verdicts | None,
        kv_events: KvEvents | None,
        tokens: PromptTokens | None,
        context: ContextCheck | None,
    ) -> None:
        self._config = config
        self._cors = Cors(config.cors_allowed_origins)
        self.fleet = fleet
        self.routing = routing
        self.ledger = ledger
        self.proxy = proxy
        self._client = client
        self.metrics = metrics
        #: Health probes (run by :func:`trio_pdrouter.server.run_router`).
        self.health = health
        #: The engines' own counts, when --engine-metrics-interval is not 0 (and, with
        #: --workers N, in the prober only).
        self.engine_truth = engine_truth
        #: The other replicas' latest loads, when --cluster-url is set.
        self.peers = peers
        #: With --workers N, in every worker but the prober: the verdicts health follows.
        self.verdicts = verdicts
        #: The KV-event subscriber (--kv-event-source), run by run_router; and the tokenizer
        #: calls kv_aware needs before routing.
        self.kv_events = kv_events
        self._tokens = tokens
        #: Refuses prompts no candidate could hold (None with --no-check-context-length).
        self.context = context
        self.routes: dict[str, dict[str, Handler]] = {
            "/health": {"GET": self._health},
            "/healthcheck": {"GET": self._health},  # vLLM's PD proxy example serves this one
            "/liveness": {"GET": self._health},
            "/readiness": {"GET": self._readiness},
            "/get_loads": {"GET": self._get_loads},
            "/workers": {"GET": self._workers, "POST": self._add_worker},
            "/v1/models": {"GET": self._models},
            "/metrics": {"GET": self._metrics},
            "/debug/kv-index": {"GET": self._kv_index},
        }
        for path in ROUTES:
            self.routes[path] = {"POST": self._inference}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        origin = origin_of(scope)
        if origin is not None:  # a browser: answer its preflight, or add CORS headers
            if self._cors.is_preflight(scope):
                await _reply(send, self._cors.preflight(origin))
                return
            send = self._cors.on_response(origin, send)
        path: str = scope["path"]
        if scope.get("http_version", "1.1").startswith("2"):  # the HTTP/2 preface: see
            await _reply(send, Reply.error(errors.http2_not_served(), CLOSE))  # hypercorn_fixes
            return
        limit = self._config.server.max_header_bytes
        if _head_size(scope) > limit:
            # hypercorn bounds what it buffers of an incomplete head, but a head that completes
            # within one more read passes that check; this one counts the head itself.
            await _reply(send, Reply.error(errors.headers_too_large(limit), CLOSE))
            return
        key = self._config.api_key
        # Before the route is looked up: without the key, every route answers 401 alike, so
        # none can be told apart (enumerated) by its 404 or 405.
        if key is not None and path not in OPEN_ROUTES and not _authorized(scope, key):
            await _reply(send, Reply.error(errors.unauthorized()))
            return
        if _smuggling(scope):
            # RFC 9112 §6.1: a message with both may be a request smuggled past a proxy that
            # trusts Content-Length; refuse it and close the connection.
            error = errors.bad_request("request has both Content-Length and Transfer-Encoding")
            await _reply(send, Reply.error(error, CLOSE))
            return
        methods = self.routes.get(path)
        if methods is None and path.startswith(WORKER_PREFIX):
            methods = {"DELETE": self._remove_worker}
        if methods is None:
            await _reply(send, Reply.error(errors.not_found(path)))
            return
        handler = methods.get(scope["method"])
        if handler is None:
            allow = ", ".join(sorted(methods)).encode()
            reply = Reply.error(
                errors.method_not_allowed(scope["method"], path), [(b"allow", allow)]
            )
            await _reply(send, reply)
            return
        await handler(scope, receive, send)

    async def _inference(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = _headers(scope)
        if self._config.api_key is not None:
            # The client's Authorization carried the router's own key (checked in __call__);
            # it is not the engines' business. --upstream-api-key sets theirs.
            headers.pop("authorization", None)
        started = trio.current_time()
        try:
            inference = await self._parse(scope, headers, receive)
        except BadRequest as exc:
            reply = Reply.error(exc.error, exc.headers)
            await _reply(send, reply)
            record = RequestRecord(
                pd.request_id(headers, self._config.request_id_headers),
                scope["path"],
                False,
                started,
                status=reply.status,
                outcome="bad_request",
                total_ms=(trio.current_time() - started) * 1000,
                bytes_out=len(reply.body),
            )
        else:
            if inference is None:  # the client left while sending its body: nobody to answer
                return
            record = await self.proxy.handle(inference, receive, send)
        self._account(record)

    def account_unfinished(self) -> None:
        """Log and count every request still in flight, as it stands (the process is about
        to exit without them finishing)."""
        for req in list(self.proxy.in_flight):
            self._account(req.record())

    def _account(self, record: RequestRecord) -> None:
        """One access line and the metrics of one request."""
        if log.isEnabledFor(logging.INFO):
            log.info("%s", access_line(record))
        self.metrics.observe_request(record)

    async def _parse(
        self, scope: Scope, headers: dict[str, str], receive: Receive
    ) -> Inference | None:
        ctype = headers.get("content-type")
        if ctype is not None and ctype.split(";", 1)[0].strip().lower() != "application/json":
            raise BadRequest(errors.unsupported_media_type(ctype))
        limit = self._config.max_payload_size
        declared = headers.get("content-length")
        # isascii: "²".isdigit() is true, and int() refuses it.
        if declared and declared.isascii() and declared.isdigit() and int(declared) > limit:
            raise BadRequest(errors.payload_too_large(limit))
        raw = await _read_body(receive, limit, self._config.server.body_timeout)
        if raw is None:
            return None
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(errors.bad_request(f"request body is not valid JSON: {exc}")) from None
        del raw  # the parsed body is all that is kept: one copy less while checks await
        route = ROUTES[scope["path"]]
        _validate(route, body)
        if _nested_deeper_than(body, MAX_JSON_DEPTH):
            raise BadRequest(errors.bad_request(f"JSON nested deeper than {MAX_JSON_DEPTH} levels"))
        stream = body.get("stream", False)
        key = routing_key(body, headers)
        if self._tokens is not None:
            key = await self._tokens.key_with_tokens(body, key)
        if self.context is not None:
            # Before anything is chosen or charged: a prompt no decode could hold.
            refusal = await self.context.refusal(route.path, body, key)
            if refusal is not None:
                raise BadRequest(refusal)
        return Inference(
            path=route.path,
            route=route,
            body=body,
            headers=headers,
            stream=stream,
            request_id=pd.request_id(headers, self._config.request_id_headers),
            key=key,
        )

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _reply(send, Reply.json(b'{"status":"ok"}'))

    async def _readiness(self, scope: Scope, receive: Receive, send: Send) -> None:
        missing = [role.value for role in self.routing.roles if not self.routing.candidates(role)]
        if missing:
            body = orjson.dumps({"status": "not_ready", "no_healthy_endpoint": missing})
            await _reply(send, Reply.json(body, status=503))
        else:
            await _reply(send, Reply.json(b'{"status":"ready"}'))

    async def _get_loads(self, scope: Scope, receive: Receive, send: Send) -> None:
        loads: dict[str, Any] = {
            role.value: self.ledger.by_role(role) for role in self.routing.roles
        }
        loads["tokens"] = self.ledger.token_snapshot()  # token weights, beside the counts
        truth = self.engine_truth
        if truth is not None:  # beside the integer maps, so existing readers are unaffected
            loads["engine"] = truth.engine_totals()
            loads["drift"] = dict(truth.drift)
            loads["engine_tokens"] = truth.engine_tokens()
            loads["token_drift"] = dict(truth.token_drift)
            loads["drift_of"] = truth.drift_of
        if self.peers is not None:
            loads["cluster"] = cluster_view(Snapshot.of(self.ledger), self.peers)
        await _reply(send, Reply.json(orjson.dumps(loads)))

    async def _kv_index(self, scope: Scope, receive: Receive, send: Send) -> None:
        rows = self.kv_events.snapshot() if self.kv_events is not None else []
        forecasts = self.routing.forecasts()
        for row in rows:
            row["forecast"] = forecasts.get(str(row["endpoint"]), {})
        # The pid says which process answered (with --workers N, each worker has its own view).
        body = {"pid": os.getpid(), "engines": rows}
        await _reply(send, Reply.json(orjson.dumps(body)))

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self.metrics.exposition()
        await _reply(send, Reply(200, [(b"content-type", CONTENT_TYPE.encode())], body))

    async def _workers(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _reply(send, Reply.json(orjson.dumps({"workers": self.fleet.workers()})))

    async def _add_worker(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /workers {"url": ..., "role": "prefill"|"decode"|"regular"}``.

        The new server takes traffic once a health probe has passed (at once when health
        checks are off).
        """
        try:
            raw = await _read_body(receive, 64 * 1024, self._config.server.body_timeout)
        except BadRequest as exc:
            await _reply(send, Reply.error(exc.error, exc.headers))
            return
        try:
            body = orjson.loads(raw or b"null")
        except orjson.JSONDecodeError:
            body = None
        url, role_name = (body.get("url"), body.get("role")) if isinstance(body, dict) else (0, 0)
        if not isinstance(url, str) or role_name not in {r.value for r in Role}:
            error = errors.bad_request(
                'expected {"url": "http://host:port", "role": "prefill" | "decode" | "regular"}'
            )
            await _reply(send, Reply.error(error))
            return
        try:
            added = self.fleet.add(url, Role(role_name), serving=False)
        except DuplicateServer as exc:
            await _reply(send, Reply.error(errors.RouterError(409, str(exc), "conflict_error")))
            return
        except ValueError as exc:
            await _reply(send, Reply.error(errors.bad_request(str(exc), "url")))
            return
        log.info("worker_added url=%s role=%s endpoints=%d", added[0].url, role_name, len(added))
        payload = {"url": added[0].url, "role": role_name, "endpoints": [ep.key for ep in added]}
        await _reply(send, Reply.json(orjson.dumps(payload), status=201))

    async def _remove_worker(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``DELETE /workers/{url}``: stop routing to it, wait for its requests, forget it."""
        url = unquote(scope["path"][len(WORKER_PREFIX) :]).rstrip("/")
        removal = await self.fleet.remove(url, self._config.server.graceful_timeout)
        if removal is None:
            await _reply(send, Reply.error(errors.not_found(f"worker {url}")))
            return
        in_flight = removal.in_flight
        log.info("worker_removed url=%s in_flight=%d", url, in_flight)
        payload = {"removed": [ep.key for ep in removal.removed], "in_flight": in_flight}
        await _reply(send, Reply.json(orjson.dumps(payload), status=200 if not in_flight else 202))

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The model list of the first upstream that answers; never a 500 for one that is down."""
        seen: set[str] = set()
        order = (Role.DECODE, Role.REGULAR, Role.PREFILL)
        for role in order:
            for ep in self.routing.candidates(role):
                if ep.url in seen:
                    continue
                seen.add(ep.url)
                try:
                    resp = await self._client.get(ep.url + "/v1/models", timeout=5.0)
                except httpx.HTTPError:
                    continue
                if resp.status_code == 200:
                    await _reply(send, Reply.json(resp.content))
                    return
        await _reply(send, Reply.error(errors.no_healthy_endpoint("model-listing")))


def _nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests containers more than ``limit`` deep (visits containers only)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, dict | list))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, dict | list))
    return False


def _validate(route: Route, body: Any) -> None:
    if not isinstance(body, dict):
        raise BadRequest(errors.bad_request("request body must be a JSON object"))
    if "messages" in route.required:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest(errors.bad_request("'messages' must be a non-empty list", "messages"))
    for name in route.required:
        if body.get(name) in (None, "", [], {}):
            raise BadRequest(errors.bad_request(f"'{name}' is required", name))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(errors.bad_request("'stream' must be a boolean", "stream"))
    # Refused by the router, not by decode after prefill ran: that would strand the KV.
    if (refusal := sampling.refusal(body)) is not None:
        raise BadRequest(refusal)


async def _read_body(receive: Receive, limit: int, seconds: float) -> bytes | None:
    """The whole body, at most ``limit`` bytes, within ``seconds``; ``None`` if the client left
    while sending it."""
    chunks: list[bytes] = []
    size = 0
    with trio.move_on_after(seconds):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BadRequest(errors.payload_too_large(limit))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
    raise BadRequest(errors.body_timeout(seconds), CLOSE)


def _head_size(scope: Scope) -> int:
    """The size of the request line and headers as they came on the wire (near enough: the
    method, version and separators are counted at their usual width)."""
    size = len(scope.get("raw_path") or scope["path"]) + len(scope.get("query_string", b"")) + 16
    for name, value in scope["headers"]:
        size += len(name) + len(value) + 4
    return size


def _headers(scope: Scope) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in scope["headers"]:
        out.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return out


def _authorized(scope: Scope, api_key: str) -> bool:
    """``Authorization: Bearer KEY``; the scheme's name is case-insensitive (RFC 7235)."""
    for name, value in scope["headers"]:
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(
                token.strip(b" "), api_key.encode()
            )
    return False


def _smuggling(scope: Scope) -> bool:
    names = {name.lower() for name, _ in scope["headers"]}
    return b"content-length" in names and b"transfer-encoding" in names


async def _reply(send: Send, reply: Reply) -> None:
    await Downstream(send).finish(reply)
