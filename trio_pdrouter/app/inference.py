"""The inference routes: a request parsed and validated completely, then served by the proxy.

Inference requests are parsed and validated here, completely, before anything is chosen or
charged: a bad request never reaches an engine and never touches the ledger. Each request ends
with one access line and its metrics.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import orjson
import trio

from ..config import RouterConfig
from ..fleet import ServedModels
from ..http import ROUTES, Receive, Reply, Route, Scope, Send, errors
from ..ledger import token_count
from ..observe import ACCESS, RequestRecord, RouterMetrics, access_fields, access_line
from ..routing import PromptTokens, routing_key
from ..serve import ContextCheck, Inference, Proxy, bodies, sampling
from ..tenants import DEFAULT_TENANT
from .request_body import BadRequest, read_body, send_reply

__all__ = ["MAX_JSON_DEPTH", "TENANT", "InferenceRoutes"]

#: The scope key under which the app leaves the request's tenant.
TENANT = "trio_pdrouter.tenant"

log = logging.getLogger("trio_pdrouter.access")

#: orjson parses JSON nested ~1000 deep but serialises only 255 levels; no OpenAI request nests
#: beyond a handful, so anything deeper is refused before it is charged or forwarded.
MAX_JSON_DEPTH = 64


class InferenceRoutes:
    """``POST`` of every route in :data:`~trio_pdrouter.http.ROUTES`: parse, then the proxy.

    ``tokens`` are the prompt tokenizer calls (None without a ``kv_aware`` stage), ``context``
    the context length check (None with ``--no-check-context-length``), ``models`` what the
    servers serve (a model none serves is answered 404 here: docs/models.md).
    """

    def __init__(
        self,
        config: RouterConfig,
        proxy: Proxy,
        metrics: RouterMetrics,
        tokens: PromptTokens | None,
        context: ContextCheck | None,
        models: ServedModels | None = None,
    ) -> None:
        self._config = config
        self._models = models
        self._proxy = proxy
        self._metrics = metrics
        self._tokens = tokens
        self._context = context

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = headers_of(scope)
        if self._config.api_key is not None or self._config.admission.tenants_file is not None:
            # The client's Authorization carried the router's own key or a tenant's (checked in
            # __call__); it is not the engines' business. --upstream-api-key sets theirs.
            headers.pop("authorization", None)
        started = trio.current_time()
        try:
            inference = await self._parse(scope, headers, receive)
        except BadRequest as exc:
            reply = Reply.error(exc.error, exc.headers)
            await send_reply(send, reply)
            record = RequestRecord(
                bodies.request_id(headers, self._config.request_id_headers),
                scope["path"],
                False,
                started,
                status=reply.status,
                outcome="unknown_model" if exc.error.type == "NotFoundError" else "bad_request",
                model=exc.model,
                total_ms=(trio.current_time() - started) * 1000,
                bytes_out=len(reply.body),
                client=client_address(scope),
            )
        else:
            if inference is None:  # the client left while sending its body: nobody to answer
                return
            record = await self._proxy.handle(inference, receive, send)
        self._account(record)

    def account_unfinished(self) -> None:
        """Log and count every request still in flight, as it stands (the process is about
        to exit without them finishing)."""
        for req in list(self._proxy.in_flight):
            self._account(req.record())

    def _account(self, record: RequestRecord) -> None:
        """One access line and the metrics of one request: at warning when the router or an
        upstream failed it (so ``--log-level warning`` still shows failures), else at info."""
        level = logging.WARNING if record.failed else logging.INFO
        if log.isEnabledFor(level):
            fields = {ACCESS: access_fields(record)}
            log.log(level, "%s", access_line(record), extra=fields)
        self._metrics.observe_request(record)

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
        raw = await read_body(receive, limit, self._config.server.body_timeout)
        if raw is None:
            return None
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(errors.bad_request(f"request body is not valid JSON: {exc}")) from None
        del raw  # the parsed body is all that is kept: one copy less while checks await
        route = ROUTES[scope["path"]]
        _validate(route, body)
        model = body.get("model")
        if (
            isinstance(model, str)
            and self._models is not None
            and await self._models.recheck(model)
        ):
            raise BadRequest(
                errors.model_not_found(model), model=model
            )  # before any engine is touched
        if nested_deeper_than(body, MAX_JSON_DEPTH):
            raise BadRequest(errors.bad_request(f"JSON nested deeper than {MAX_JSON_DEPTH} levels"))
        stream = body.get("stream", False)
        key = routing_key(body, headers)
        if isinstance(model, str) and self._models is not None and self._models.is_adapter(model):
            key = attrs.evolve(key, adapter=True)  # kv_aware does not look its ids up
        if self._tokens is not None and not key.adapter:
            key = await self._tokens.key_with_tokens(body, key)
        if self._context is not None:
            # Before anything is chosen or charged: a prompt no decode could hold.
            refusal = await self._context.refusal(route.path, body, key)
            if refusal is not None:
                raise BadRequest(refusal)
        return Inference(
            path=route.path,
            route=route,
            body=body,
            headers=headers,
            stream=stream,
            request_id=bodies.request_id(headers, self._config.request_id_headers),
            key=key,
            priority=token_count(body.get("priority", 0)) or 0,
            client=client_address(scope),
            tenant=scope.get(TENANT, DEFAULT_TENANT),
        )


def client_address(scope: Scope) -> str | None:
    """``host:port`` of the client as the server saw it (``[v6]:port``), for the access log."""
    client = scope.get("client")
    if not client:
        return None
    host, port = client[0], client[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def nested_deeper_than(value: Any, limit: int) -> bool:
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
    if token_count(body.get("priority", 0)) is None:  # vLLM's request models read an int
        raise BadRequest(errors.bad_request("'priority' must be an integer", "priority"))
    # Refused by the router, not by decode after prefill ran: that would strand the KV.
    if (refusal := sampling.refusal(body)) is not None:
        raise BadRequest(refusal)


def headers_of(scope: Scope) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in scope["headers"]:
        out.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return out
