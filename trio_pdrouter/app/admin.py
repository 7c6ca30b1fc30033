"""The admin routes: health and readiness, loads, servers, models, metrics, the KV index, the
version, the effective configuration and the end of a sticky session.

``POST /workers`` and ``DELETE /workers/{url}`` change the fleet (through
:class:`~trio_pdrouter.fleet.Fleet` only); ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` pass to the servers (:meth:`AdminRoutes.adapter`); the others read
what the router knows.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs, unquote

import httpx
import orjson
import trio

from .. import __version__
from ..config import RouterConfig, effective
from ..endpoints import Role
from ..fleet import DuplicateServer, EngineTruth, Fleet, FleetFull, ServedModels, StartupStatus
from ..http import Receive, Reply, Scope, Send, errors
from ..kv import KvEvents
from ..ledger import LoadLedger, PeerLoads, Snapshot, cluster_view
from ..observe import CONTENT_TYPE, RouterMetrics
from ..routing import Routing
from .request_body import BadRequest, read_body, send_reply

__all__ = ["ADAPTER_ROUTES", "WORKER_PREFIX", "AdminRoutes", "Handler"]

log = logging.getLogger("trio_pdrouter.access")

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]

WORKER_PREFIX = "/workers/"
#: Seconds ``GET /version`` waits for each server's own ``/version``.
VERSION_TIMEOUT = 2.0
LOAD_ADAPTER = "/v1/load_lora_adapter"
UNLOAD_ADAPTER = "/v1/unload_lora_adapter"
#: vLLM's runtime LoRA routes (``--enable-lora`` with VLLM_ALLOW_RUNTIME_LORA_UPDATING): the
#: router passes them to its servers; admin routes (they change the engines).
ADAPTER_ROUTES = frozenset({LOAD_ADAPTER, UNLOAD_ADAPTER})
#: Seconds an engine may take to load or unload an adapter (loading reads it from disk).
ADAPTER_TIMEOUT = 60.0
#: What :meth:`AdminRoutes._json_body` returns once it answered an unreadable body itself.
_NO_BODY = object()


class AdminRoutes:
    """The admin routes over the subsystems they read or change: ``engine_truth`` is None when
    ``--engine-metrics-interval`` is 0, ``peers`` without ``--cluster-url``, ``kv_events``
    without ``--kv-event-source``."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        fleet: Fleet,
        routing: Routing,
        ledger: LoadLedger,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        engine_truth: EngineTruth | None,
        peers: PeerLoads | None,
        kv_events: KvEvents | None,
        startup: StartupStatus,
        models: ServedModels,
    ) -> None:
        self._config = config
        self._fleet = fleet
        self._routing = routing
        self._ledger = ledger
        self._client = client
        self._metrics = metrics
        self._engine_truth = engine_truth
        self._peers = peers
        self._kv_events = kv_events
        self._startup = startup
        self._models = models

    def routes(self) -> dict[str, dict[str, Handler]]:
        """Path -> method -> handler of every admin route but ``DELETE /workers/{url}``
        (:meth:`remove_worker`, matched by prefix)."""
        return {
            "/health": {"GET": self._health},
            "/healthcheck": {"GET": self._health},  # vLLM's PD proxy example serves this one
            "/liveness": {"GET": self._health},
            "/readiness": {"GET": self._readiness},
            "/get_loads": {"GET": self._get_loads},
            "/workers": {"GET": self._workers, "POST": self._add_worker},
            "/v1/models": {"GET": self._model_list},
            LOAD_ADAPTER: {"POST": self.adapter},
            UNLOAD_ADAPTER: {"POST": self.adapter},
            "/metrics": {"GET": self._metrics_route},
            "/debug/kv-index": {"GET": self._kv_index},
            "/version": {"GET": self._version},
            "/admin/config": {"GET": self._effective_config},
            "/finish_session": {"POST": self._finish_session},
        }

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_reply(send, Reply.json(b'{"status":"ok"}'))

    async def _readiness(self, scope: Scope, receive: Receive, send: Send) -> None:
        """503 while the start-up wait has servers to see healthy (named), or while a role has no
        endpoint that health (real probes: unknown is not healthy) and the breakers admit."""
        awaited = self._startup.awaited(lambda url: self._fleet.health(url) == "healthy")
        if awaited:
            body = orjson.dumps({"status": "starting", "waiting_for": awaited})
            await send_reply(send, Reply.json(body, status=503))
            return
        missing = [role.value for role in self._routing.roles if not self._routing.candidates(role)]
        if missing:
            body = orjson.dumps({"status": "not_ready", "no_healthy_endpoint": missing})
            await send_reply(send, Reply.json(body, status=503))
        else:
            await send_reply(send, Reply.json(b'{"status":"ready"}'))

    async def _get_loads(self, scope: Scope, receive: Receive, send: Send) -> None:
        loads: dict[str, Any] = {
            role.value: self._ledger.by_role(role) for role in self._routing.roles
        }
        loads["tokens"] = self._ledger.token_snapshot()  # token weights, beside the counts
        truth = self._engine_truth
        if truth is not None:  # beside the integer maps, so existing readers are unaffected
            loads["engine"] = truth.engine_totals()
            loads["drift"] = dict(truth.drift)
            loads["engine_tokens"] = truth.engine_tokens()
            loads["token_drift"] = dict(truth.token_drift)
            loads["drift_of"] = truth.drift_of
        if self._peers is not None:
            loads["cluster"] = cluster_view(Snapshot.of(self._ledger), self._peers)
        await send_reply(send, Reply.json(orjson.dumps(loads)))

    async def _kv_index(self, scope: Scope, receive: Receive, send: Send) -> None:
        rows = self._kv_events.snapshot() if self._kv_events is not None else []
        forecasts = self._routing.forecasts()
        for row in rows:
            row["forecast"] = forecasts.get(str(row["endpoint"]), {})
        # The pid says which process answered (with --workers N, each worker has its own view).
        body = {"pid": os.getpid(), "engines": rows}
        await send_reply(send, Reply.json(orjson.dumps(body)))

    async def _finish_session(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /finish_session?session_id=ID``, vllm-router's: ``sticky_least_loaded`` forgets
        the session in every stage (this process's maps; a no-op with other policies)."""
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        given = query.get("session_id", [])
        if len(given) != 1 or not given[0]:
            error = errors.bad_request("expected ?session_id=ID", "session_id")
            await send_reply(send, Reply.error(error))
            return
        session = given[0]
        bound = self._routing.finish_session(session)
        log.info("session_finished session_bound=%s", bound)
        body = orjson.dumps({"status": "ok", "session_id": session})
        await send_reply(send, Reply.json(body))

    async def _metrics_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self._metrics.exposition()
        await send_reply(send, Reply(200, [(b"content-type", CONTENT_TYPE.encode())], body))

    async def _workers(self, scope: Scope, receive: Receive, send: Send) -> None:
        rows = self._fleet.workers()
        for row in rows:  # what each server serves; null while its list was never read
            served = self._models.of(row["url"])
            row["models"] = None if served is None else served.models
            row["adapters"] = None if served is None else served.adapters
        await send_reply(send, Reply.json(orjson.dumps({"workers": rows})))

    async def _add_worker(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /workers {"url": ..., "role": "prefill"|"decode"|"regular"}``.

        The new server takes traffic once a health probe has passed (at once when health
        checks are off).
        """
        body = await self._json_body(receive, send)
        if body is _NO_BODY:
            return
        url, role_name = (body.get("url"), body.get("role")) if isinstance(body, dict) else (0, 0)
        if not isinstance(url, str) or role_name not in {r.value for r in Role}:
            error = errors.bad_request(
                'expected {"url": "http://host:port", "role": "prefill" | "decode" | "regular"}'
            )
            await send_reply(send, Reply.error(error))
            return
        try:
            added = self._fleet.add(url, Role(role_name), serving=False)
        except DuplicateServer as exc:
            await send_reply(send, Reply.error(errors.RouterError(409, str(exc), "conflict_error")))
            return
        except FleetFull as exc:
            log.warning("worker_refused url=%s role=%s reason=%s", url, role_name, exc)
            error = errors.RouterError(503, str(exc), "service_unavailable")
            await send_reply(send, Reply.error(error))
            return
        except ValueError as exc:
            await send_reply(send, Reply.error(errors.bad_request(str(exc), "url")))
            return
        log.info("worker_added url=%s role=%s endpoints=%d", added[0].url, role_name, len(added))
        payload = {"url": added[0].url, "role": role_name, "endpoints": [ep.key for ep in added]}
        await send_reply(send, Reply.json(orjson.dumps(payload), status=201))

    async def remove_worker(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``DELETE /workers/{url}[?role=prefill|decode|regular]``: stop routing to it (in that
        role, else in every role), wait for its requests, forget it."""
        # Decoded once: from the bytes received where the server gives them, else its path,
        # which ASGI servers have already decoded (decoding that again would change a URL).
        raw: bytes | None = scope.get("raw_path")
        target = unquote(raw.decode("latin-1")) if raw else scope["path"]
        url = target[len(WORKER_PREFIX) :].rstrip("/")
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        roles = query.get("role", [])
        if len(roles) > 1 or (roles and roles[0] not in {r.value for r in Role}):
            error = errors.bad_request("role must be one of prefill, decode, regular", "role")
            await send_reply(send, Reply.error(error))
            return
        role = Role(roles[0]) if roles else None
        try:
            removal = await self._fleet.remove(url, self._config.server.graceful_timeout, role)
        except FleetFull as exc:
            error = errors.RouterError(503, str(exc), "service_unavailable")
            await send_reply(send, Reply.error(error))
            return
        if removal is None:
            what = "server" if role is None else f"{role.value} server"
            error = errors.RouterError(404, f"no {what} at {url}", "not_found_error")
            await send_reply(send, Reply.error(error))
            return
        in_flight = removal.in_flight
        log.info("worker_removed url=%s in_flight=%d", url, in_flight)
        payload = {"removed": [ep.key for ep in removal.removed], "in_flight": in_flight}
        await send_reply(
            send, Reply.json(orjson.dumps(payload), status=200 if not in_flight else 202)
        )

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /version``: the router's version, and the versions the servers give at vLLM's
        own ``GET /version`` (``{"version": ...}``), each with how many servers run it, and how
        many did not answer in time. No server is named: clients learn no address here.

        vllm-router 0.1.17 has no route of its own there: in regular mode its fallback passes
        the request to a worker (the client gets that engine's vLLM version), in PD mode it
        answers 405."""
        urls = sorted({ep.url for ep in self._fleet.endpoints()})
        versions: dict[str, int] = {}
        unanswered = len(urls)

        async def ask(url: str) -> None:
            nonlocal unanswered
            try:
                resp = await self._client.get(url + "/version", timeout=VERSION_TIMEOUT)
                version = resp.json().get("version") if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError):
                return
            if isinstance(version, str):
                versions[version] = versions.get(version, 0) + 1
                unanswered -= 1

        async with trio.open_nursery() as nursery:
            for url in urls:
                nursery.start_soon(ask, url)
        body = {
            "name": "trio-pdrouter",
            "version": __version__,
            "engine_versions": dict(sorted(versions.items())),
            "engines_unanswered": unanswered,
        }
        await send_reply(send, Reply.json(orjson.dumps(body)))

    async def _effective_config(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /admin/config``: every flag's effective value, secrets redacted
        (:func:`trio_pdrouter.config.effective`)."""
        body = {"version": __version__, "flags": effective(self._config)}
        await send_reply(send, Reply.json(orjson.dumps(body)))

    async def _model_list(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The union of the models and adapters of the servers routable now (vLLM's list shape,
        one card per id); while none of them has a known list, the list of the first upstream
        that answers."""
        routing = self._routing
        cards = self._models.cards(
            {ep.url for role in routing.roles for ep in routing.candidates(role)}
        )
        if cards:
            body = orjson.dumps({"object": "list", "data": cards})
            await send_reply(send, Reply.json(body))
            return
        seen: set[str] = set()
        order = (Role.DECODE, Role.REGULAR, Role.PREFILL)
        for role in order:
            for ep in self._routing.candidates(role):
                if ep.url in seen:
                    continue
                seen.add(ep.url)
                try:
                    resp = await self._client.get(ep.url + "/v1/models", timeout=5.0)
                except httpx.HTTPError:
                    continue
                if resp.status_code == 200:
                    await send_reply(send, Reply.json(resp.content))
                    return
        await send_reply(send, Reply.error(errors.no_healthy_endpoint("model-listing")))

    async def adapter(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``, passed to the servers.

        vLLM's body is ``{"lora_name": ..., "lora_path": ...}`` (load) or ``{"lora_name": ...}``
        (unload), answered 200 with a line of text, or its error (``LoadLoRAAdapterRequest`` and
        ``OpenAIServingModels.load_lora_adapter`` in vllm/entrypoints/openai/serving_models.py,
        commit 075e9ba825513f0e50ae1a5185d6db0ee405f84e). A load goes to every healthy server of
        the fleet, or, when the body names ``base_model`` (the router's own field, not
        forwarded), to those whose list has that base model; an unload to the healthy servers
        that list the adapter (all healthy servers if none does). Every server asked is then
        asked its model list again before the answer, so the next request routes on what each
        server now serves, whichever of them succeeded. The answer: the first server's when all
        succeeded, else the first failure's (the log names every server's status).
        """
        path = scope["path"]
        body = await self._json_body(receive, send)
        if body is _NO_BODY:
            return
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(body, dict) or not isinstance(name, str) or not name:
            error = errors.bad_request("expected a JSON object with 'lora_name'", "lora_name")
            await send_reply(send, Reply.error(error))
            return
        base = body.pop("base_model", None)
        targets = self._adapter_targets(path, name, base if isinstance(base, str) else None)
        if not targets and isinstance(base, str):
            error = errors.bad_request(
                f"no server taking traffic serves the base model `{base}`", "base_model"
            )
            await send_reply(send, Reply.error(error))
            return
        if not targets:
            await send_reply(send, Reply.error(errors.no_healthy_endpoint("adapter")))
            return
        content = orjson.dumps(body)
        headers = {"content-type": "application/json"}
        if self._config.upstream_api_key:
            headers["authorization"] = f"Bearer {self._config.upstream_api_key}"
        answers: dict[str, tuple[int, bytes, str | None]] = {}

        async def one(url: str) -> None:
            try:
                resp = await self._client.post(
                    url + path, content=content, headers=headers, timeout=ADAPTER_TIMEOUT
                )
            except httpx.HTTPError as exc:
                log.warning("adapter path=%s url=%s failed=%r", path, url, exc)
                error = errors.upstream_failed("adapter", "could not be reached")
                answers[url] = (error.status, error.body(), "application/json")
                return
            answers[url] = (resp.status_code, resp.content, resp.headers.get("content-type"))

        async with trio.open_nursery() as nursery:
            for url in targets:
                nursery.start_soon(one, url)
        await self._models.learn_now(targets)
        statuses = " ".join(f"{url}={answers[url][0]}" for url in targets)
        log.info("adapter path=%s lora_name=%s statuses=%s", path, name, statuses)
        failed = [url for url in targets if answers[url][0] != 200]
        status, answer, kind = answers[failed[0] if failed else targets[0]]
        head = [] if kind is None else [(b"content-type", kind.encode("latin-1"))]
        await send_reply(send, Reply(status, head, answer))

    async def _json_body(self, receive: Receive, send: Send) -> object:
        """An admin request's JSON body (None if it is not JSON), or :data:`_NO_BODY` once a
        body that could not be read (too large, too slow) has been answered."""
        try:
            raw = await read_body(receive, 64 * 1024, self._config.server.body_timeout)
        except BadRequest as exc:
            await send_reply(send, Reply.error(exc.error, exc.headers))
            return _NO_BODY
        try:
            return orjson.loads(raw or b"null")
        except orjson.JSONDecodeError:
            return None

    def _adapter_targets(self, path: str, name: str, base: str | None) -> list[str]:
        """The healthy servers an adapter route goes to (see :meth:`adapter`)."""
        routing = self._routing
        healthy = sorted({ep.url for role in routing.roles for ep in routing.candidates(role)})
        models = self._models
        if path == UNLOAD_ADAPTER:
            listing = [url for url in healthy if name in getattr(models.of(url), "ids", ())]
            return listing or healthy
        if base is not None:
            return [url for url in healthy if base in getattr(models.of(url), "models", ())]
        return healthy
