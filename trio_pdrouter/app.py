"""The ASGI application: the routing table, request parsing, and the small admin routes.

Inference requests are parsed and validated here, completely, before anything is chosen or
charged: a bad request never reaches an engine and never touches the ledger.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import orjson

from . import errors, pd
from .asgi import Downstream, Receive, Reply, Scope, Send
from .config import RouterConfig
from .endpoints import Role
from .errors import RouterError
from .policies.routing_key import routing_key
from .proxy import Inference, Proxy, RequestRecord
from .routing import Routing

log = logging.getLogger("trio_pdrouter.access")

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]

INFERENCE_ROUTES = ("/v1/completions", "/v1/chat/completions")
OPEN_ROUTES = frozenset({"/health", "/liveness", "/readiness"})


class BadRequest(Exception):
    def __init__(self, error: RouterError) -> None:
        super().__init__(error.message)
        self.error = error


class RouterApp:
    def __init__(
        self,
        config: RouterConfig,
        routing: Routing,
        proxy: Proxy,
        client: httpx.AsyncClient,
        on_request: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        self._config = config
        self.routing = routing
        self._proxy = proxy
        self._client = client
        self._on_request = on_request
        self.routes: dict[str, dict[str, Handler]] = {
            "/health": {"GET": self._health},
            "/liveness": {"GET": self._health},
            "/readiness": {"GET": self._readiness},
            "/get_loads": {"GET": self._get_loads},
            "/workers": {"GET": self._workers},
            "/v1/models": {"GET": self._models},
        }
        for path in INFERENCE_ROUTES:
            self.routes[path] = {"POST": self._inference}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        methods = self.routes.get(path)
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
        key = self._config.api_key
        if key is not None and path not in OPEN_ROUTES and not _authorized(scope, key):
            await _reply(send, Reply.error(errors.unauthorized()))
            return
        await handler(scope, receive, send)

    async def _inference(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = _headers(scope)
        try:
            inference = await self._parse(scope, headers, receive)
        except BadRequest as exc:
            await _reply(send, Reply.error(exc.error))
            return
        if inference is None:  # the client left while sending its body
            return
        record = await self._proxy.handle(inference, receive, send)
        log.info(
            "request_id=%s route=%s stream=%s prefill=%s decode=%s status=%d outcome=%s"
            " prefill_ms=%s ttfb_ms=%s",
            record.request_id,
            record.route,
            record.stream,
            record.prefill,
            record.decode,
            record.status,
            record.outcome,
            _ms(record.prefill_ms),
            _ms(record.ttfb_ms),
        )
        if self._on_request is not None:
            self._on_request(record)

    async def _parse(
        self, scope: Scope, headers: dict[str, str], receive: Receive
    ) -> Inference | None:
        ctype = headers.get("content-type")
        if ctype is not None and ctype.split(";", 1)[0].strip().lower() != "application/json":
            raise BadRequest(errors.unsupported_media_type(ctype))
        limit = self._config.max_payload_size
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BadRequest(errors.payload_too_large(limit))
        raw = await _read_body(receive, limit)
        if raw is None:
            return None
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(errors.bad_request(f"request body is not valid JSON: {exc}")) from None
        path: str = scope["path"]
        _validate(path, body)
        stream = body.get("stream", False)
        return Inference(
            path=path,
            body=body,
            headers=headers,
            stream=stream,
            request_id=pd.request_id(headers, self._config.request_id_headers),
            key=routing_key(body, headers),
        )

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _reply(send, Reply.json(b'{"status":"ok"}'))

    async def _readiness(self, scope: Scope, receive: Receive, send: Send) -> None:
        missing = [
            role.value for role in self.routing.endpoints if not self.routing.candidates(role)
        ]
        if missing:
            body = orjson.dumps({"status": "not_ready", "no_healthy_endpoint": missing})
            await _reply(send, Reply.json(body, status=503))
        else:
            await _reply(send, Reply.json(b'{"status":"ready"}'))

    async def _get_loads(self, scope: Scope, receive: Receive, send: Send) -> None:
        loads: dict[str, Any] = {
            role.value: self.routing.ledger.by_role(role) for role in self.routing.endpoints
        }
        await _reply(send, Reply.json(orjson.dumps(loads)))

    async def _workers(self, scope: Scope, receive: Receive, send: Send) -> None:
        healthy = set()
        for role in self.routing.endpoints:
            healthy.update(self.routing.candidates(role))
        workers = [
            {
                "url": ep.url,
                "key": ep.key,
                "role": ep.role.value,
                "rank": ep.rank,
                "healthy": ep in healthy,
                "load": self.routing.ledger.load(ep),
            }
            for ep in self.routing.all_endpoints()
        ]
        await _reply(send, Reply.json(orjson.dumps({"workers": workers})))

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


def _validate(path: str, body: Any) -> None:
    if not isinstance(body, dict):
        raise BadRequest(errors.bad_request("request body must be a JSON object"))
    if path == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest(errors.bad_request("'messages' must be a non-empty list", "messages"))
    elif "prompt" not in body or body["prompt"] in (None, "", []):
        raise BadRequest(errors.bad_request("'prompt' is required", "prompt"))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(errors.bad_request("'stream' must be a boolean", "stream"))


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
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


def _headers(scope: Scope) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in scope["headers"]:
        out.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return out


def _authorized(scope: Scope, api_key: str) -> bool:
    for name, value in scope["headers"]:
        if name.lower() == b"authorization":
            return hmac.compare_digest(value, b"Bearer " + api_key.encode())
    return False


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


async def _reply(send: Send, reply: Reply) -> None:
    await Downstream(send).finish(reply)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
