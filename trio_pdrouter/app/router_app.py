"""The ASGI application: every request's first checks, then its route.

Before a route is looked up: lifespan, CORS preflight, the HTTP/2 preface, the head's size, the
keys, request smuggling. Then the inference routes (:mod:`.inference`) or the admin routes
(:mod:`.admin`).

Two keys, two audiences. ``--api-key`` is the clients': every route but the open ones
(:data:`OPEN_ROUTES`) needs it, or a key of ``--tenants-file``, which also names the request's
tenant (:class:`~trio_pdrouter.tenants.Tenancy`; the app puts it in the scope for the inference
routes). The routes that change the router — ``POST /workers``, ``DELETE
/workers/...`` — and those that show its insides, ``/admin/*`` and ``/debug/*``, need
``--admin-api-key``'s key instead (the clients' key never opens them); without an admin key
they are off (403), unless ``--admin-from-loopback`` lets a peer on 127.0.0.0/8 or ::1 in (the
TCP peer: a proxy on the same host counts as loopback). ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` change the engines' state, so they are admin routes too.
"""

from __future__ import annotations

import hmac
import ipaddress

from ..config import RouterConfig
from ..fleet import EngineTruth, Fleet, HealthBoard, ServedModels, StartupStatus, Verdicts
from ..http import ROUTES, Cors, Receive, Reply, Scope, Send, answer_lifespan, errors, origin_of
from ..kv import KvEvents
from ..ledger import LoadLedger, PeerLoads
from ..observe import RouterMetrics
from ..routing import Routing
from ..serve import ContextCheck, Proxy
from ..tenants import Tenancy, TenantLedger
from .admin import ADAPTER_ROUTES, WORKER_PREFIX, AdminRoutes, Handler
from .inference import TENANT, InferenceRoutes
from .request_body import CLOSE, send_reply

__all__ = ["OPEN_ROUTES", "RouterApp"]

OPEN_ROUTES = frozenset({"/health", "/healthcheck", "/liveness", "/readiness"})
#: Sent with a 401: the scheme the key goes in (RFC 6750).
CHALLENGE = ((b"www-authenticate", b"Bearer"),)


class RouterApp:
    """The router's ASGI application (see the module doc).

    It answers with the two route sets it is given (``inference``, ``admin``) and holds what
    the server runs beside it: the fleet, routing, the ledger, the proxy, metrics, the health
    board, engine truth (None when ``--engine-metrics-interval`` is 0), the peers' loads (None
    without ``--cluster-url``), the health verdicts a worker follows, the KV-event subscriber
    (None without ``--kv-event-source``) and the context length check (None with
    ``--no-check-context-length``).
    """

    def __init__(
        self,
        config: RouterConfig,
        *,
        fleet: Fleet,
        routing: Routing,
        ledger: LoadLedger,
        proxy: Proxy,
        metrics: RouterMetrics,
        health: HealthBoard,
        engine_truth: EngineTruth | None,
        peers: PeerLoads | None,
        verdicts: Verdicts | None,
        kv_events: KvEvents | None,
        context: ContextCheck | None,
        models: ServedModels,
        inference: InferenceRoutes,
        admin: AdminRoutes,
        startup: StartupStatus,
        tenancy: Tenancy,
        tenants: TenantLedger,
    ) -> None:
        self._config = config
        #: Who each request is for, and whether its key lets it in (``--api-key``, the tenants
        #: file's keys, ``--tenant-header``).
        self._tenancy = tenancy
        #: Each tenant's numbers, as admission keeps them (published to the peer replicas).
        self.tenants = tenants
        self._cors = Cors(config.cors_allowed_origins)
        self.fleet = fleet
        self.routing = routing
        self.ledger = ledger
        self.proxy = proxy
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
        #: Refuses prompts no candidate could hold (None with --no-check-context-length).
        self.context = context
        #: Each server's models and adapters, learnt by their own loop (run by run_router).
        self.models = models
        #: The start-up wait for the command line's servers (run by
        #: :func:`~trio_pdrouter.server.run_router`).
        self.startup = startup
        self._inference = inference
        self._admin = admin
        self.routes: dict[str, dict[str, Handler]] = self._admin.routes()
        for path in ROUTES:
            self.routes[path] = {"POST": self._inference.handle}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        origin = origin_of(scope)
        if origin is not None:  # a browser: answer its preflight, or add CORS headers
            if self._cors.is_preflight(scope):
                await send_reply(send, self._cors.preflight(origin))
                return
            send = self._cors.on_response(origin, send)
        path: str = scope["path"]
        if scope.get("http_version", "1.1").startswith("2"):
            # The HTTP/2 preface (trio_pdrouter.http.serve_http1_only says why it lands here).
            await send_reply(send, Reply.error(errors.http2_not_served(), CLOSE))
            return
        limit = self._config.server.max_header_bytes
        if _head_size(scope) > limit:
            # hypercorn bounds what it buffers of an incomplete head, but a head that completes
            # within one more read passes that check; this one counts the head itself.
            await send_reply(send, Reply.error(errors.headers_too_large(limit), CLOSE))
            return
        # Before the route is looked up: without the key, every route answers 401 alike, so
        # none can be told apart (enumerated) by its 404 or 405.
        if _admin_only(scope["method"], path):
            refusal = self._admin_refusal(scope)
            if refusal is not None:
                await send_reply(send, refusal)
                return
        elif path not in OPEN_ROUTES:
            tenant = self._tenancy.tenant_of(_bearer(scope), _header(scope, self._tenancy.header))
            if tenant is None:
                await send_reply(send, Reply.error(errors.unauthorized(), CHALLENGE))
                return
            scope[TENANT] = tenant
        if _smuggling(scope):
            # RFC 9112 §6.1: a message with both may be a request smuggled past a proxy that
            # trusts Content-Length; refuse it and close the connection.
            error = errors.bad_request("request has both Content-Length and Transfer-Encoding")
            await send_reply(send, Reply.error(error, CLOSE))
            return
        methods = self.routes.get(path)
        if methods is None and path.startswith(WORKER_PREFIX):
            methods = {"DELETE": self._admin.remove_worker}
        if methods is None:
            await send_reply(send, Reply.error(errors.not_found(path)))
            return
        handler = methods.get(scope["method"])
        if handler is None:
            allow = ", ".join(sorted(methods)).encode()
            reply = Reply.error(
                errors.method_not_allowed(scope["method"], path), [(b"allow", allow)]
            )
            await send_reply(send, reply)
            return
        await handler(scope, receive, send)

    def _admin_refusal(self, scope: Scope) -> Reply | None:
        """None if ``scope`` may use an admin route (module doc), else the answer."""
        key, config = self._config.admin_api_key, self._config
        if key is not None and _authorized(scope, key):
            return None
        if config.admin_from_loopback and _from_loopback(scope):
            return None
        if key is not None:
            return Reply.error(errors.unauthorized("missing or invalid admin API key"), CHALLENGE)
        return Reply.error(
            errors.forbidden(
                "the admin routes are off: start the router with --admin-api-key"
                " (or --admin-from-loopback)"
            )
        )

    def account_unfinished(self) -> None:
        """Log and count every request still in flight, as it stands (the process is about
        to exit without them finishing)."""
        self._inference.account_unfinished()


def _head_size(scope: Scope) -> int:
    """The size of the request line and headers as they came on the wire (near enough: the
    method, version and separators are counted at their usual width)."""
    size = len(scope.get("raw_path") or scope["path"]) + len(scope.get("query_string", b"")) + 16
    for name, value in scope["headers"]:
        size += len(name) + len(value) + 4
    return size


def _admin_only(method: str, path: str) -> bool:
    """An admin route (module doc): adds or removes servers, or shows the router's insides."""
    if path.startswith(("/debug/", "/admin/")) or path in ADAPTER_ROUTES:
        return True
    return method in ("POST", "DELETE") and (path == "/workers" or path.startswith(WORKER_PREFIX))


def _from_loopback(scope: Scope) -> bool:
    client = scope.get("client")
    if not client:
        return False
    try:
        address = ipaddress.ip_address(client[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _authorized(scope: Scope, api_key: str) -> bool:
    """``Authorization: Bearer KEY``; the scheme's name is case-insensitive (RFC 7235)."""
    for name, value in scope["headers"]:
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(
                token.strip(b" "), api_key.encode()
            )
    return False


def _bearer(scope: Scope) -> bytes | None:
    """The token of ``Authorization: Bearer TOKEN`` (the scheme's name is case-insensitive)."""
    for name, value in scope["headers"]:
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip(b" ") if scheme.lower() == b"bearer" else None
    return None


def _header(scope: Scope, wanted: str | None) -> str | None:
    if wanted is None:
        return None
    raw = wanted.encode("latin-1")
    for name, value in scope["headers"]:
        if name.lower() == raw:
            text: str = value.decode("latin-1")
            return text.strip()
    return None


def _smuggling(scope: Scope) -> bool:
    names = {name.lower() for name, _ in scope["headers"]}
    return b"content-length" in names and b"transfer-encoding" in names
