"""The simulator's ASGI application: vLLM's HTTP surface plus the ``/sim/*`` control routes.

One request = one nursery, as in the router. A generation request runs its engine work in the
main task while a sibling task watches ``receive()``: hypercorn never cancels an app whose
client left, it only queues ``http.disconnect``. The watcher cancels the work, which frees
the engine slot and counts an abort. It is stopped *before* the final ``more_body=False``
send, because hypercorn also queues ``http.disconnect`` during that send.

Routes:

=========================  ======================================================
``GET /health``            200, empty body
``GET /version``           ``{"version": ...}``
``GET /v1/models``         the served model and its LoRA adapters
``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter``: LoRA adapters at run time
``GET /metrics``           Prometheus text: ``vllm:num_requests_running``,
                           ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
                           ``vllm:cache_config_info`` (block_size, num_gpu_blocks),
                           ... labelled ``model_name`` and ``engine`` (DP rank)
``POST /v1/completions``   vLLM completions, streaming or not
``POST /v1/chat/completions``  vLLM chat completions, streaming or not
``POST /v1/responses``     the Responses API, streaming or not (:mod:`.responses_api`)
``GET /sim/stats``         ground truth (see :meth:`SimState.stats`)
``POST /sim/reset``        zero counters and series (``{"prefix_cache": true}`` also
                           empties the prefix caches)
``GET/POST/DELETE /sim/faults``  armed faults (see :mod:`trio_pdrouter_sim.faults`)
``POST /sim/down``         close the listener (``{"seconds": S}``: reopen after S s)
``POST /sim/kv/pull``      NIXL stand-in, called by decode simulators
``POST /sim/kv/free``      a decode aborted before its read: free the blocks (:mod:`.kv`)
``POST /tokenize``         vLLM's tokenizer: ``{prompt}`` or ``{messages}`` -> ``{tokens}``
``GET/POST /sim/kv/events``  KV-event publishers per rank (blocks held, next seq); POST
                           ``{"drop": N}`` or ``{"restart": true}`` (see :mod:`.kv_events`)
=========================  ======================================================
"""

from __future__ import annotations

import math
import random
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import attrs
import orjson
import trio

from . import netinfo, responses_api, shapes
from .config import SimConfig
from .engine import Engine, block_hashes
from .faults import FaultBook, FaultPlan, plan_for
from .kv import FREE_PATH, PULL_PATH, KvStore, pull_remote
from .kv_events import KvPublishers
from .requests import BadRequest, GenRequest, Kind, parse_request, tokenize

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MAX_BODY_BYTES = 64 * 1024 * 1024
SERIES_INTERVAL_S = 0.05
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]
_DONE = b"data: [DONE]\n\n"


class _Reset(Exception):
    """Raised inside the engine work when a ``reset`` fault fires."""


@attrs.frozen
class GenResult:
    """What the engine produced for one request."""

    tokens: list[str]
    finish_reason: str
    cached_tokens: int
    kv_transfer_params: dict[str, Any] | None


class SimState:
    """Everything one simulated server knows; the ASGI app is a view on it."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        #: KV events (``--kv-events-port`` or ``--kv-events-connect``): one publisher per engine.
        self.kv_events = (
            KvPublishers(
                host=config.host,
                dp_size=config.dp_size,
                block_size=config.block_size,
                pub_port=config.kv_events_port or 0,
                connect=config.kv_events_connect,
                replay_port=config.kv_replay_port,
                layout="array" if config.kv_events_layout == "array" else "map",
                buffer=config.kv_events_buffer,
                join_delay_s=config.kv_events_join_delay_s,
            )
            if config.kv_events_port is not None or config.kv_events_connect is not None
            else None
        )
        journals = self.kv_events.journals if self.kv_events is not None else None
        self.engines = [
            Engine(rank, config, journals[rank] if journals else None)
            for rank in range(config.dp_size)
        ]
        #: LoRA adapter name -> path (``--lora-modules``, then loaded and unloaded at run time).
        self.adapters: dict[str, str] = dict(_lora_module(spec) for spec in config.lora_modules)
        self.kv = KvStore(f"sim-{uuid.uuid4().hex[:12]}", config.kv_timeout_s)
        self.faults = FaultBook(config.faults)
        self.rng = random.Random(config.seed)
        self.url = ""
        self.port = 0
        self.created = int(time.time())
        #: trio time the series counts from; set when the server starts and on reset.
        self.started_at = 0.0
        maxlen = max(1, int(config.series_window_s / SERIES_INTERVAL_S))
        self.series_t: deque[float] = deque(maxlen=maxlen)
        self.series_running: deque[list[int]] = deque(maxlen=maxlen)
        self._tie_break = 0
        #: HTTP requests received per path, whatever their answer (refused ones included).
        self.received: dict[str, int] = {}
        #: The ``traceparent`` header of each generation request received (the latest 1000),
        #: as a vLLM engine would join its spans to it.
        self.traceparents: deque[str] = deque(maxlen=1000)
        #: Set by the server: runs background tasks (KV expiry) for the server's lifetime.
        self.nursery: trio.Nursery | None = None
        #: Set by the server: closes the listener, reopening after the given seconds if any.
        self.request_down: Callable[[float | None], None] = lambda _seconds: None

    # -- engines ----------------------------------------------------------------------------

    def pick_engine(self) -> Engine:
        """The least-loaded engine (running + waiting); ties rotate so rank 0 is not favoured."""
        n = len(self.engines)
        self._tie_break = (self._tie_break + 1) % n
        order = self.engines[self._tie_break :] + self.engines[: self._tie_break]
        return min(order, key=lambda e: e.load)

    def sample(self) -> None:
        """Append one point to the running-per-engine series."""
        self.series_t.append(round(trio.current_time() - self.started_at, 3))
        self.series_running.append([e.running for e in self.engines])

    def reset(self, *, prefix_cache: bool = False) -> None:
        """``POST /sim/reset``: zero counters and series; in-flight requests are untouched."""
        for engine in self.engines:
            engine.reset_counters()
            if prefix_cache:
                engine.cache.clear()
        self.series_t.clear()
        self.series_running.clear()
        self.started_at = trio.current_time()
        self.faults.injected = 0
        self.received.clear()
        self.traceparents.clear()

    def stats(self) -> dict[str, Any]:
        """``GET /sim/stats``: the ground truth. Keys (stable, tests depend on them):

        * ``role``, ``model``, ``url``;
        * ``engines``: one object per DP rank with ``rank``, ``running``, ``waiting``,
          ``peak_running``, ``completed``, ``aborted`` (client gone, reset fault or server
          down while running), ``pd_ok`` (KV pulled from a prefill server), ``pd_missing``
          (a decode server prefilled itself: no, invalid or unpullable ``kv_transfer_params``),
          ``kv_blocks_held`` (prefill side, awaiting a pull), ``kv_blocks_leaked`` (freed by
          the timeout: stranded), ``kv_blocks_freed`` (freed because the decode request was
          aborted before it read them), ``kv_second_pulls`` (pulls of blocks already pulled,
          freed or expired), ``prefix_cache_hits`` / ``prefix_cache_queries`` (in tokens, like
          vLLM's counters), ``requests`` (that reached the engine; 4xx and ``error:`` faults
          do not), plus ``prompt_tokens``, ``generation_tokens``, ``kv_cache_usage_perc``;
        * ``totals``: the same counters summed over engines;
        * ``series``: ``{"interval_ms": 50, "t": [seconds since start or reset],
          "running": [[running per engine], ...]}``, the last ``series_window_s`` seconds;
        * ``connections``: client TCP connections open now (see :mod:`.netinfo`);
        * ``kv_holds``, ``faults_injected``;
        * ``received``: HTTP requests received per path since start or reset, whatever their
          answer (a 400 included; ``/sim/*`` control routes not counted);
        * ``traceparents``: the ``traceparent`` of each generation request received, oldest
          first (the latest 1000).
        """
        engines = [e.stats() for e in self.engines]
        totals: dict[str, float] = {}
        for row in engines:
            for key, value in row.items():
                if key not in ("rank", "kv_cache_usage_perc"):
                    totals[key] = totals.get(key, 0) + value
        return {
            "role": self.config.role,
            "model": self.config.model,
            "url": self.url,
            "engines": engines,
            "totals": totals,
            "series": {
                "interval_ms": int(SERIES_INTERVAL_S * 1000),
                "t": list(self.series_t),
                "running": list(self.series_running),
            },
            "connections": netinfo.count_connections(self.port) if self.port else 0,
            "kv_holds": len(self.kv),
            "faults_injected": self.faults.injected,
            "received": dict(self.received),
            "traceparents": list(self.traceparents),
        }

    def metrics_text(self) -> str:
        """Prometheus exposition of vLLM's gauges and counters, one series per engine."""
        model = self.config.model.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        gauges: list[tuple[str, str, str, Callable[[Engine], float]]] = [
            (
                "vllm:num_requests_running",
                "gauge",
                "Number of requests in model execution batches.",
                lambda e: e.running,
            ),
            (
                "vllm:num_requests_waiting",
                "gauge",
                "Number of requests waiting to be processed.",
                lambda e: e.waiting,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "gauge",
                "KV-cache usage. 1 means 100 percent usage.",
                lambda e: e.kv_cache_usage,
            ),
            (
                "vllm:prefix_cache_queries_total",
                "counter",
                "Prefix cache queries, in tokens.",
                lambda e: e.counters.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits_total",
                "counter",
                "Prefix cache hits, in tokens.",
                lambda e: e.counters.prefix_cache_hits,
            ),
            (
                "vllm:prompt_tokens_total",
                "counter",
                "Number of prefill tokens processed.",
                lambda e: e.counters.prompt_tokens,
            ),
            (
                "vllm:generation_tokens_total",
                "counter",
                "Number of generation tokens processed.",
                lambda e: e.counters.generation_tokens,
            ),
        ]
        lines: list[str] = []
        for name, kind, help_text, value in gauges:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for engine in self.engines:
                labels = f'model_name="{model}",engine="{engine.rank}"'
                lines.append(f"{name}{{{labels}}} {float(value(engine))}")
        # vLLM's info gauge of the cache config: with it, KV usage converts to tokens.
        cfg = self.config
        lines.append("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig")
        lines.append("# TYPE vllm:cache_config_info gauge")
        for engine in self.engines:
            labels = (
                f'block_size="{cfg.block_size}",engine="{engine.rank}",'
                f'num_gpu_blocks="{cfg.num_gpu_blocks}"'
            )
            lines.append(f"vllm:cache_config_info{{{labels}}} 1.0")
        return "\n".join(lines) + "\n"


# -- small response helpers -------------------------------------------------------------------


async def _send_json(
    send: Send, status: int, doc: Any, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    body = orjson.dumps(doc)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_text(send: Send, text: str) -> None:
    """200 with ``text`` and no content type, as vLLM answers its adapter routes
    (``Response(status_code=200, content=response)`` in its API server)."""
    body = text.encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _lora_error(status: int, err_type: str, message: str) -> shapes.JSON:
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}


def _lora_module(spec: str) -> tuple[str, str]:
    """``name=path`` (vLLM's ``--lora-modules`` spelling) or a bare name."""
    name, _, path = spec.partition("=")
    return name, path or name


async def _send_error(send: Send, status: int, message: str, param: str | None = None) -> None:
    await _send_json(send, status, shapes.error_body(status, message, param=param))


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body; None if the client left or it exceeds the limit (-> 413)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BadRequest("Request body too large", status=413)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _watch_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def _sse(doc: Any) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


# -- the app ----------------------------------------------------------------------------------


class SimApp:
    """ASGI callable serving one :class:`SimState`."""

    def __init__(self, state: SimState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            await self._route(scope, receive, send)
        except BadRequest as exc:
            await _send_error(send, exc.status, exc.message, exc.param)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        if not path.startswith("/sim/"):
            received = self.state.received
            received[path] = received.get(path, 0) + 1
        routes: dict[str, dict[str, Callable[[Scope, Receive, Send], Awaitable[None]]]] = {
            "/health": {"GET": self._health},
            "/version": {"GET": self._version},
            "/v1/models": {"GET": self._models},
            "/v1/load_lora_adapter": {"POST": self._load_adapter},
            "/v1/unload_lora_adapter": {"POST": self._unload_adapter},
            "/metrics": {"GET": self._metrics},
            "/v1/completions": {"POST": self._completions},
            "/v1/chat/completions": {"POST": self._chat},
            "/v1/responses": {"POST": self._responses},
            "/sim/stats": {"GET": self._stats},
            "/sim/reset": {"POST": self._reset},
            "/sim/faults": {
                "GET": self._faults_get,
                "POST": self._faults_post,
                "DELETE": self._faults_delete,
            },
            "/sim/down": {"POST": self._down},
            "/tokenize": {"POST": self._tokenize},
            "/sim/kv/events": {"GET": self._kv_events_get, "POST": self._kv_events_post},
            PULL_PATH: {"POST": self._kv_pull},
            FREE_PATH: {"POST": self._kv_free},
        }
        by_method = routes.get(path)
        if by_method is None:
            await _send_json(send, 404, {"detail": "Not Found"})
            return
        handler = by_method.get(method)
        if handler is None:
            await _send_json(send, 405, {"detail": "Method Not Allowed"})
            return
        await handler(scope, receive, send)

    # -- vLLM surface ----------------------------------------------------------------------

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]}
        )
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_json(send, 200, {"version": "0.0.0+trio-pdrouter-sim"})

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        cfg = self.state.config
        await _send_json(
            send,
            200,
            shapes.models_list(
                cfg.model, self.state.created, cfg.max_model_len, self.state.adapters
            ),
        )

    async def _load_adapter(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's ``load_lora_adapter`` (vllm/entrypoints/openai/serving_models.py, commit
        075e9ba825513f0e50ae1a5185d6db0ee405f84e): both fields required, a name loaded once;
        200 with a line of text. Any path loads (there are no weights to read)."""
        body = await self._json_body(receive)
        name = body.get("lora_name") if isinstance(body, dict) else None
        path = body.get("lora_path") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            message = "Both 'lora_name' and 'lora_path' must be provided."
            await _send_json(send, 400, _lora_error(400, "InvalidUserInput", message))
            return
        if name in self.state.adapters:
            message = f"The lora adapter '{name}' has already been loaded."
            await _send_json(send, 400, _lora_error(400, "InvalidUserInput", message))
            return
        self.state.adapters[name] = path
        await _send_text(send, f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload_adapter(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's ``unload_lora_adapter`` (same file): 404 for a name not loaded."""
        body = await self._json_body(receive)
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            message = "either 'lora_name' and 'lora_int_id' needs to be provided."
            await _send_json(send, 400, _lora_error(400, "InvalidUserInput", message))
            return
        if self.state.adapters.pop(name, None) is None:
            message = f"The lora adapter '{name}' cannot be found."
            await _send_json(send, 404, _lora_error(404, "NotFoundError", message))
            return
        await _send_text(send, f"Success: LoRA adapter '{name}' removed successfully.")

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self.state.metrics_text().encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate("completions", scope, receive, send)

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate("chat", scope, receive, send)

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate("responses", scope, receive, send)

    # -- control routes --------------------------------------------------------------------

    async def _json_body(self, receive: Receive) -> Any:
        raw = await _read_body(receive)
        if not raw:
            return None
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"Invalid JSON body: {exc}") from None

    async def _stats(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_json(send, 200, self.state.stats())

    async def _reset(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._json_body(receive)
        clear = isinstance(body, dict) and body.get("prefix_cache") is True
        self.state.reset(prefix_cache=clear)
        await _send_json(send, 200, {"ok": True})

    async def _tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        cfg = self.state.config
        body = await self._json_body(receive)
        model = body.get("model") if isinstance(body, dict) else None
        if model is not None and model != cfg.model and model not in self.state.adapters:
            # As vLLM's create_tokenize (vllm/entrypoints/openai/serving_tokenization.py,
            # commit 0492d792466c41a514f0aadc20138dbc88c7a254): the model checked first.
            raise BadRequest(f"The model `{model}` does not exist.", param="model", status=404)
        tokens = tokenize(body, cfg.text_tokens)
        await _send_json(
            send, 200, {"count": len(tokens), "max_model_len": cfg.max_model_len, "tokens": tokens}
        )

    async def _kv_events_get(self, scope: Scope, receive: Receive, send: Send) -> None:
        publishers = self.state.kv_events
        ranks = publishers.describe() if publishers is not None else []
        for row, engine in zip(ranks, self.state.engines, strict=False):
            row["blocks"] = len(engine.cache)
        await _send_json(send, 200, {"ranks": ranks})

    async def _kv_events_post(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Fault knobs: ``{"drop": N}`` loses the next N batches of every rank on the wire;
        ``{"restart": true}`` restarts every rank's engine (empty cache, seq from 0)."""
        body = await self._json_body(receive)
        publishers = self.state.kv_events
        if publishers is None or not isinstance(body, dict):
            raise BadRequest('KV events are off, or the body is not {"drop": N, "restart": B}')
        drop = body.get("drop", 0)
        if isinstance(drop, bool) or not isinstance(drop, int) or drop < 0:
            raise BadRequest("drop must be a non-negative integer", param="drop")
        for journal, engine in zip(publishers.journals, self.state.engines, strict=True):
            journal.faults.drop_next += drop
            if body.get("restart") is True:
                journal.restart()
                engine.cache.clear(publish=False)
        await self._kv_events_get(scope, receive, send)

    async def _faults_get(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_json(send, 200, self.state.faults.describe())

    async def _faults_post(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._json_body(receive)
        if not isinstance(body, dict) or not isinstance(body.get("spec"), str):
            raise BadRequest('expected {"spec": SPEC, "count": N or null}', param="spec")
        count = body.get("count")
        if count is not None and (isinstance(count, bool) or not isinstance(count, int)):
            raise BadRequest("count must be an integer or null", param="count")
        try:
            self.state.faults.arm(body["spec"], count)
        except ValueError as exc:
            raise BadRequest(str(exc), param="spec") from None
        await _send_json(send, 200, self.state.faults.describe())

    async def _faults_delete(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.state.faults.disarm()
        await _send_json(send, 200, self.state.faults.describe())

    async def _down(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._json_body(receive)
        seconds = body.get("seconds") if isinstance(body, dict) else None
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0
        ):
            raise BadRequest("seconds must be a number >= 0 or null", param="seconds")
        await _send_json(send, 200, {"ok": True, "seconds": seconds})
        self.state.request_down(None if seconds is None else float(seconds))

    async def _kv_pull(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._json_body(receive)
        if not isinstance(body, dict) or not isinstance(body.get("remote_request_id"), str):
            raise BadRequest("expected remote_request_id", param="remote_request_id")
        engine_id = body.get("remote_engine_id")
        hold = self.state.kv.pull(
            body["remote_request_id"], engine_id if isinstance(engine_id, str) else None
        )
        if hold is None:
            await _send_json(send, 404, shapes.error_body(404, "no such KV hold"))
        else:
            await _send_json(send, 200, {"blocks": len(hold.block_ids)})

    async def _kv_free(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._json_body(receive)
        if not isinstance(body, dict) or not isinstance(body.get("remote_request_id"), str):
            raise BadRequest("expected remote_request_id", param="remote_request_id")
        hold = self.state.kv.free(body["remote_request_id"])
        if hold is None:
            await _send_json(send, 404, shapes.error_body(404, "no such KV hold"))
        else:
            await _send_json(send, 200, {"blocks": len(hold.block_ids)})

    # -- generation ------------------------------------------------------------------------

    async def _generate(self, kind: Kind, scope: Scope, receive: Receive, send: Send) -> None:
        state, cfg = self.state, self.state.config
        raw = await _read_body(receive)
        if raw is None:
            return
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"Invalid JSON body: {exc}") from None
        req = parse_request(
            kind,
            body,
            served_model=cfg.model,
            text=cfg.text_tokens,
            max_model_len=cfg.max_model_len,
            adapters=state.adapters,
        )
        engine = self._engine_for(scope)
        traceparent = _header(scope, b"traceparent")
        if traceparent is not None:
            state.traceparents.append(traceparent)
        try:
            faults = state.faults.faults_for(
                "prefill" if req.remote_decode else "decode", _header(scope, b"x-sim-fault")
            )
        except ValueError as exc:
            raise BadRequest(f"x-sim-fault: {exc}", param="x-sim-fault") from None
        plan = plan_for(faults, state.rng)
        if not plan.empty:
            state.faults.injected += 1
        if plan.error_status is not None:
            await _send_error(send, plan.error_status, f"simulated fault: HTTP {plan.error_status}")
            return
        if plan.reset_after == 0:
            await self._abort(scope, receive, send, headers_sent=False)
            return

        request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex
        prefix = {"completions": "cmpl-", "chat": "chatcmpl-", "responses": "resp_"}[kind]
        rid = prefix + request_id
        extra_headers = [(b"x-request-id", request_id.encode("latin-1"))]
        created = int(time.time())
        emit = _Emitter(req, rid, created, send)

        if req.stream:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [*_SSE_HEADERS, *extra_headers],
                }
            )
            # As vLLM: the head goes out at once, the first events with the engine's first
            # output, after the request was scheduled (and its remote KV pulled).

        result: GenResult | None = None
        reset = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope)
            try:
                result = await self._run(engine, req, plan, scope, emit)
            except _Reset:
                reset = True
            nursery.cancel_scope.cancel()  # stop the watcher before the final send

        if reset:
            await self._abort(scope, receive, send, headers_sent=req.stream)
            return
        if result is None:
            return  # the client went away; the engine counted the abort
        if req.stream:
            await emit.finish(result)
        else:
            await _send_json(send, 200, emit.whole(result), extra_headers)

    def _engine_for(self, scope: Scope) -> Engine:
        engines = self.state.engines
        header = _header(scope, b"x-data-parallel-rank")
        if header is None:
            return self.state.pick_engine()
        try:
            rank = int(header.strip())
        except ValueError:
            raise BadRequest(
                f"X-data-parallel-rank must be an integer, got {header!r}",
                param="X-data-parallel-rank",
            ) from None
        if not 0 <= rank < len(engines):
            raise BadRequest(
                f"data_parallel_rank {rank} is out of range [0, {len(engines)})",
                param="X-data-parallel-rank",
            )
        return engines[rank]

    async def _abort(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        *,
        headers_sent: bool,
    ) -> None:
        """The ``reset`` fault: end the connection abortively, without a complete answer."""
        server, client = scope.get("server"), scope.get("client")
        if server and client and netinfo.abort_connection(tuple(server), tuple(client)):
            # The socket is shut down: hypercorn sees EOF and queues http.disconnect. Waiting
            # for it keeps hypercorn from writing a 500 for an app that ended without an answer.
            with trio.move_on_after(1.0):
                while (await receive())["type"] != "http.disconnect":
                    pass
            return
        # No socket access: end the app mid-body, so hypercorn closes the connection and
        # the client sees a truncated message (a protocol error, not a clean EOF).
        if not headers_sent:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", b"1000000"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": b"{", "more_body": True})

    async def _run(
        self, engine: Engine, req: GenRequest, plan: FaultPlan, scope: Scope, emit: _Emitter
    ) -> GenResult:
        """The engine work of one request; cancellation (client gone) counts an abort."""
        cfg = self.state.config
        n_prompt = len(req.prompt)
        blocks = math.ceil(n_prompt / cfg.block_size)
        read = False  # whether this request started reading its remote KV, if it has any
        try:
            await engine.acquire()
        except BaseException:  # aborted while waiting to be scheduled (trio may group it)
            engine.counters.aborted += 1
            await self._free_remote(req)
            raise
        engine.kv_blocks_active += blocks
        completed = False
        try:
            engine.counters.prompt_tokens += n_prompt
            hashes = block_hashes(req.prompt.ids, cfg.block_size)
            cached = engine.lookup_prefix(hashes, n_prompt)
            pulled = False
            if req.remote_prefill is not None:
                remote = req.remote_prefill
                pulled = (
                    await pull_remote(
                        remote.host,
                        remote.port,
                        {
                            "remote_request_id": remote.request_id,
                            "remote_engine_id": remote.engine_id,
                            "remote_block_ids": list(remote.block_ids),
                        },
                        cfg.kv_pull_timeout_s,
                    )
                    if remote.request_id is not None
                    else False
                )
                read = True  # from here an abort lets the read end, which frees the blocks
            if pulled:
                engine.counters.pd_ok += 1
                if cfg.kv_transfer_s > 0:
                    await trio.sleep(cfg.kv_transfer_s)
            elif (
                req.remote_prefill is not None
                or req.remote_prefill_invalid
                or (cfg.role == "decode" and not req.remote_decode)
            ):
                engine.counters.pd_missing += 1
            prefill_s = plan.extra_prefill_s
            if not pulled:
                prefill_s += engine.prefill_seconds(n_prompt - cached)
            if prefill_s > 0:
                await trio.sleep(prefill_s)
            engine.cache.insert(hashes, req.prompt.ids)

            if req.remote_decode:
                result = await self._prefill_only(engine, req, plan, scope, cached, emit)
            else:
                result = await self._decode(engine, req, plan, cached, emit)
            completed = True
            return result
        finally:
            if not completed and not read:  # scheduled, ended before its read began
                await self._free_remote(req)
            engine.release(completed=completed, blocks=blocks)

    async def _free_remote(self, req: GenRequest) -> None:
        """A decode request aborted before it read its remote KV tells the prefill to free the
        blocks, as vLLM's NIXL connector does (:mod:`.kv`); shielded: it runs as the request is
        being cancelled."""
        remote = req.remote_prefill
        if remote is None or remote.request_id is None:
            return
        with trio.CancelScope(shield=True):
            await pull_remote(
                remote.host,
                remote.port,
                {"remote_request_id": remote.request_id},
                self.state.config.kv_pull_timeout_s,
                FREE_PATH,
            )

    async def _stall_or_reset(self, plan: FaultPlan, position: int) -> None:
        if plan.stall_after == position:
            if plan.stall_seconds is None:
                await trio.sleep_forever()
            await trio.sleep(plan.stall_seconds)
        if plan.reset_after == position:
            raise _Reset

    async def _decode(
        self, engine: Engine, req: GenRequest, plan: FaultPlan, cached: int, emit: _Emitter
    ) -> GenResult:
        cfg, rng = self.state.config, self.state.rng
        tokens: list[str] = []
        finish = "length"
        if req.stream:
            await emit.start()
        for i in range(req.max_tokens):
            await self._stall_or_reset(plan, i)
            delay = engine.token_seconds()
            if delay > 0:
                await trio.sleep(delay)
            else:
                await trio.lowlevel.checkpoint()
            engine.counters.generation_tokens += 1
            tokens.append(shapes.gen_token(i))
            last = i + 1 == req.max_tokens
            if (
                not last
                and not req.ignore_eos
                and cfg.eos_rate > 0
                and i + 1 >= req.min_tokens
                and rng.random() < cfg.eos_rate
            ):
                finish, last = "stop", True
            await emit.token(i, finish if last else None, len(req.prompt), cached)
            if last:
                break
        await self._stall_or_reset(plan, len(tokens))
        return GenResult(tokens, finish, cached, None)

    async def _prefill_only(
        self,
        engine: Engine,
        req: GenRequest,
        plan: FaultPlan,
        scope: Scope,
        cached: int,
        emit: _Emitter,
    ) -> GenResult:
        """NIXL prefill: one token, then hold the blocks for the decode side."""
        cfg, state = self.state.config, self.state
        await self._stall_or_reset(plan, 0)
        engine.counters.generation_tokens += 1
        stop = cfg.stop_rate > 0 and state.rng.random() < cfg.stop_rate
        finish = "stop" if stop else "length"
        kv_params: dict[str, Any] | None = None
        if not stop:
            assert state.nursery is not None, "serve the app with SimServer"
            hold = state.kv.hold(engine, math.ceil(len(req.prompt) / cfg.block_size), state.nursery)
            server = scope.get("server") or (cfg.host, state.port)
            kv_params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": state.kv.engine_id(engine),
                "remote_block_ids": hold.block_ids,
                "remote_host": server[0],
                "remote_port": server[1],
                "remote_request_id": hold.request_id,
                "tp_size": cfg.tp_size,
            }
        await emit.token(0, finish, len(req.prompt), cached)
        await self._stall_or_reset(plan, 1)
        return GenResult([shapes.gen_token(0)], finish, cached, kv_params)


class _Emitter:
    """Turns tokens into vLLM's stream events, or collects them for one JSON answer."""

    def __init__(self, req: GenRequest, rid: str, created: int, send: Send) -> None:
        self.req, self.rid, self.created, self.send = req, rid, created, send
        self.model = req.model
        #: The Responses API's stream: its event numbering, its message and the text so far.
        self.events = responses_api.EventWriter()
        self.message_id = "msg_" + rid.removeprefix("resp_")
        self.text = ""
        self.echo_offset = len(req.prompt.text) if req.echo else 0
        #: text_offset of the next generated token in a stream.
        self.offset = self.echo_offset

    def _usage(self, completion_tokens: int, cached: int) -> shapes.JSON:
        return shapes.usage(len(self.req.prompt), completion_tokens, cached)

    async def _body(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    def _response(self, status: str, output: list[shapes.JSON], usage: Any, kv: Any) -> Any:
        return responses_api.response(
            response_id=self.rid,
            created=self.created,
            model=self.model,
            status=status,
            output=output,
            usage=usage,
            max_output_tokens=self.req.max_tokens,
            kv_transfer_params=kv,
        )

    async def start(self) -> None:
        """First events of a stream: the chat role delta, the echoed prompt, or the Responses
        API's opening events."""
        req = self.req
        if req.kind == "responses":
            ev, item = self.events.event, self.message_id
            opening = self._response("in_progress", [], None, None)
            await self._body(
                ev("response.created", response=opening)
                + ev("response.in_progress", response=opening)
                + ev(
                    "response.output_item.added",
                    output_index=0,
                    item=responses_api.message(item, None, "in_progress"),
                )
                + ev(
                    "response.content_part.added",
                    item_id=item,
                    output_index=0,
                    content_index=0,
                    part=responses_api.output_text(""),
                )
            )
        elif req.kind == "chat":
            doc = shapes.chat_chunk(
                request_id=self.rid,
                created=self.created,
                model=self.model,
                delta={"role": "assistant", "content": ""},
                logprobs=None,
                finish_reason=None,
            )
            await self.send({"type": "http.response.body", "body": _sse(doc), "more_body": True})
        elif req.echo:
            logprobs = None
            if req.logprobs is not None:
                logprobs = shapes.completion_logprobs(
                    req.prompt.tokens,
                    start_position=0,
                    start_offset=0,
                    k=req.logprobs,
                    first_null=True,
                )
            doc = shapes.completion_chunk(
                request_id=self.rid,
                created=self.created,
                model=self.model,
                text=req.prompt.text,
                logprobs=logprobs,
                finish_reason=None,
                usage=None,
            )
            await self.send({"type": "http.response.body", "body": _sse(doc), "more_body": True})

    async def token(
        self,
        index: int,
        finish: str | None,
        prompt_tokens: int,
        cached: int,
    ) -> None:
        """One generated token; sent at once when streaming."""
        req = self.req
        if not req.stream:
            return
        text = shapes.gen_token(index)
        usage = self._usage(index + 1, cached) if req.continuous_usage else None
        doc: shapes.JSON
        if req.kind == "responses":
            self.text += text
            delta = self.events.event(
                "response.output_text.delta",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                delta=text,
                logprobs=[],
            )
            await self._body(delta)
            return
        if req.kind == "chat":
            logprobs = None
            if req.logprobs is not None:
                logprobs = {
                    "content": shapes.chat_logprobs_content(
                        [text], start_position=prompt_tokens + index, k=req.logprobs
                    )
                }
            doc = shapes.chat_chunk(
                request_id=self.rid,
                created=self.created,
                model=self.model,
                delta={"content": text},
                logprobs=logprobs,
                finish_reason=finish,
                usage=usage,
            )
        else:
            logprobs = None
            if req.logprobs is not None:
                logprobs = shapes.completion_logprobs(
                    [text],
                    start_position=prompt_tokens + index,
                    start_offset=self.offset,
                    k=req.logprobs,
                    first_null=False,
                )
            doc = shapes.completion_chunk(
                request_id=self.rid,
                created=self.created,
                model=self.model,
                text=text,
                logprobs=logprobs,
                finish_reason=finish,
                usage=usage,
            )
        self.offset += len(text)
        await self.send({"type": "http.response.body", "body": _sse(doc), "more_body": True})

    async def finish(self, result: GenResult) -> None:
        """The end of a stream: the usage event if asked for, then ``[DONE]`` (the Responses
        API: its closing events)."""
        if self.req.kind == "responses":
            ev, item, text = self.events.event, self.message_id, self.text
            done = responses_api.message(item, text, "completed")
            usage = responses_api.usage(
                len(self.req.prompt), len(result.tokens), result.cached_tokens
            )
            status = responses_api.status_of(result.finish_reason)
            closing = (
                ev(
                    "response.output_text.done",
                    item_id=item,
                    output_index=0,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
                + ev(
                    "response.content_part.done",
                    item_id=item,
                    output_index=0,
                    content_index=0,
                    part=responses_api.output_text(text),
                )
                + ev("response.output_item.done", output_index=0, item=done)
                + ev("response.completed", response=self._response(status, [done], usage, None))
            )
            await self.send({"type": "http.response.body", "body": closing, "more_body": False})
            return
        body = b""
        if self.req.include_usage:
            usage = self._usage(len(result.tokens), result.cached_tokens)
            builder = (
                shapes.chat_usage_chunk
                if self.req.kind == "chat"
                else shapes.completion_usage_chunk
            )
            body += _sse(
                builder(request_id=self.rid, created=self.created, model=self.model, usage=usage)
            )
        await self.send({"type": "http.response.body", "body": body + _DONE, "more_body": False})

    def whole(self, result: GenResult) -> shapes.JSON:
        """The non-streaming answer."""
        req = self.req
        n_prompt = len(req.prompt)
        if req.kind == "responses":
            text = "".join(result.tokens)
            done = responses_api.message(self.message_id, text, "completed")
            usage = responses_api.usage(n_prompt, len(result.tokens), result.cached_tokens)
            status = responses_api.status_of(result.finish_reason)
            answer: shapes.JSON = self._response(status, [done], usage, result.kv_transfer_params)
            return answer
        usage = self._usage(len(result.tokens), result.cached_tokens)
        prompt_lp = (
            shapes.prompt_logprobs(req.prompt, req.prompt_logprobs)
            if req.prompt_logprobs is not None
            else None
        )
        text = "".join(result.tokens)
        if req.kind == "chat":
            chat_lp = None
            if req.logprobs is not None:
                chat_lp = {
                    "content": shapes.chat_logprobs_content(
                        result.tokens, start_position=n_prompt, k=req.logprobs
                    )
                }
            return shapes.chat_response(
                request_id=self.rid,
                created=self.created,
                model=self.model,
                text=text,
                logprobs=chat_lp,
                finish_reason=result.finish_reason,
                prompt_logprobs=prompt_lp,
                usage=usage,
                kv_transfer_params=result.kv_transfer_params,
            )
        logprobs = None
        if req.logprobs is not None:
            gen = shapes.completion_logprobs(
                result.tokens,
                start_position=n_prompt,
                start_offset=self.echo_offset,
                k=req.logprobs,
                first_null=False,
            )
            if req.echo:
                head = shapes.completion_logprobs(
                    req.prompt.tokens,
                    start_position=0,
                    start_offset=0,
                    k=req.logprobs,
                    first_null=True,
                )
                logprobs = {key: head[key] + gen[key] for key in gen}
            else:
                logprobs = gen
        if req.echo:
            text = req.prompt.text + text
        return shapes.completion_response(
            request_id=self.rid,
            created=self.created,
            model=self.model,
            text=text,
            logprobs=logprobs,
            finish_reason=result.finish_reason,
            prompt_logprobs=prompt_lp,
            usage=usage,
            kv_transfer_params=result.kv_transfer_params,
        )
