"""The router's Prometheus metrics, all named ``trio_pdrouter_*``.

Each router owns a private :class:`~prometheus_client.CollectorRegistry` (never the process-wide
default), so several routers can share one process — the test suite and the demo do. The router
serves it at ``GET /metrics`` and, with ``--prometheus-port``, on a separate listener.

What feeds each metric:

* the load ledger (every charge and release): ``in_flight``;
* the end of every inference request (:meth:`RouterMetrics.observe_request`, given the request's
  :class:`~trio_pdrouter.observe.record.RequestRecord`): ``requests_total``, ``ttfb_seconds``,
  ``request_duration_seconds``, ``prefill_duration_seconds``, ``decode_duration_seconds``,
  ``upstream_errors_total``, ``retries_total``, ``admission_rejections_total``;
* the end of every inference request, by model: ``model_requests_total``, ``model_tokens_total``
  (the ``model`` label is the request's model when some server lists it, ``unknown`` for any
  other name, ``none`` when the request named none: the label values stay as few as the fleet's
  models); what the servers serve (:meth:`RouterMetrics.watch_models`):
  ``servers_models_unknown``;
* the proxy's stranded-KV release (:meth:`RouterMetrics.stranded_kv`,
  :meth:`~RouterMetrics.stranded_kv_refused_by`, :meth:`~RouterMetrics.late_prefill_answer`):
  ``stranded_kv_handoffs``, ``stranded_kv_refused_total``,
  ``prefill_answers_after_client_left_total``;
* the engine-truth scrape (:mod:`trio_pdrouter.fleet.engine_truth`): ``engine_requests``,
  ``load_drift``, ``engine_scrape_errors_total``;
* the resilience and routing machinery, through one method each
  (:meth:`~RouterMetrics.breaker_state`, :meth:`~RouterMetrics.health`,
  :meth:`~RouterMetrics.watch_admission`, :meth:`~RouterMetrics.policy_decision`).

Load drift is the number to watch: it is the router's visible load (decode slots whose prefill is
still running are left out) minus what the engine reports, per endpoint. A request in transit
(sent, not yet seen by the engine; or finished by the engine, its end not yet read by the router)
shows as a momentary ±1, so alert on drift that persists,
e.g. ``min_over_time(abs(trio_pdrouter_load_drift)[1m]) > 0``.
"""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from .. import __version__
from ..endpoints import Endpoint, Role
from ..http import Downstream, Receive, Reply, Scope, Send, answer_lifespan, errors
from .vllm_router import VllmRouterMetrics

if TYPE_CHECKING:
    from ..ledger import LoadLedger
    from .record import RequestRecord

#: The ``Content-Type`` of :meth:`RouterMetrics.exposition`.
CONTENT_TYPE = CONTENT_TYPE_LATEST

PREFIX = "trio_pdrouter_"

# Seconds; from a cached-prefix first token on a simulator up to long generations.
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
)

#: ``trio_pdrouter_circuit_breaker_state`` values.
BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}


class RouterMetrics:
    """Every metric of one router, in its own registry: the ``trio_pdrouter_*`` families,
    vllm-router's ``vllm_router_*`` ones (:attr:`vllm`, fed by the same hooks; ``pd`` and
    ``attempts`` (``--retry-max-retries``) are what they need of the config), the process's
    ``process_*`` metrics and ``trio_pdrouter_build_info``."""

    def __init__(self, *, pd: bool = False, attempts: int = 1) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._before_exposition: list[Callable[[], None]] = []
        r = self.registry
        p = PREFIX
        ProcessCollector(registry=r)
        self.build_info = Gauge(
            p + "build_info",
            "Always 1; the labels say which router this is (version) and on which Python.",
            ["version", "python"],
            registry=r,
        )
        self.build_info.labels(__version__, platform.python_version()).set(1)
        self.vllm = VllmRouterMetrics(r, pd=pd, attempts=attempts)
        self._restarts = _Restarts()
        r.register(self._restarts)
        self.requests = Counter(
            p + "requests",
            "Inference requests answered, by route, HTTP status, streaming and outcome"
            " (ok, client_disconnect, upstream_error, upstream_status, timeout, no_endpoint, ...).",
            ["route", "status", "stream", "outcome"],
            registry=r,
        )
        self.model_requests = Counter(
            p + "model_requests",
            "Inference requests answered, by the model they named (a model no server lists:"
            " 'unknown'; none named: 'none') and outcome.",
            ["model", "outcome"],
            registry=r,
        )
        self.model_tokens = Counter(
            p + "model_tokens",
            "Tokens of the inference requests answered, as the engines counted them (usage), by"
            " model (as model_requests_total) and kind (prompt, completion).",
            ["model", "kind"],
            registry=r,
        )
        self.models_unknown = Gauge(
            p + "servers_models_unknown",
            "Servers whose GET /v1/models was never read: each is assumed to serve only the"
            " models no candidate with a known list serves, and requests naming no model.",
            registry=r,
        )
        self._served: Callable[[], frozenset[str]] = frozenset
        self.in_flight = Gauge(
            p + "in_flight",
            "Requests the router has charged to an endpoint and not yet released (the load"
            " ledger), per endpoint and stage.",
            ["endpoint", "stage"],
            registry=r,
        )
        self.ttfb = Histogram(
            p + "ttfb_seconds",
            "Router-measured time from a request's arrival to the first body byte sent to the"
            " client (streaming requests).",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            p + "request_duration_seconds",
            "End-to-end time from a request's arrival to its last byte sent.",
            ["route", "stream"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_duration = Histogram(
            p + "prefill_duration_seconds",
            "Time of the prefill leg, from sending it to its answer (PD mode).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_duration = Histogram(
            p + "decode_duration_seconds",
            "Time from the prefill answer to the end of the response (PD mode): the decode"
            " leg plus the relay of its output to the client.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            p + "upstream_errors",
            "Upstream failures by stage, endpoint and kind (connect, timeout, reset,"
            " status_<code>, invalid).",
            ["stage", "endpoint", "kind"],
            registry=r,
        )
        self.retries = Counter(
            p + "retries",
            "Attempts made again after a retriable upstream failure, by route.",
            ["route"],
            registry=r,
        )
        self.breaker = Gauge(
            p + "circuit_breaker_state",
            "Circuit breaker state per endpoint: 0 closed, 1 half-open, 2 open.",
            ["endpoint"],
            registry=r,
        )
        self.healthy = Gauge(
            p + "endpoint_healthy",
            "1 if the endpoint passes its health checks, else 0.",
            ["endpoint"],
            registry=r,
        )
        self.queue_depth = Gauge(
            p + "admission_queue_depth",
            "Requests waiting for admission (beyond --max-concurrent-requests).",
            registry=r,
        )
        self.buffered = Gauge(
            p + "buffered_bytes",
            "Decode output held for clients, all streams (--max-total-buffered-bytes bounds it).",
            registry=r,
        )
        self.pumped = Gauge(
            p + "pumped_streams",
            "Streams the relay pump carries now (after their first event; --no-relay-pump: 0).",
            registry=r,
        )
        self.rejections = Counter(
            p + "admission_rejections",
            "Requests refused by admission control, by reason (queue_full, queue_timeout).",
            ["reason"],
            registry=r,
        )
        for reason in ("queue_full", "queue_timeout"):  # shown at 0 before the first
            self.rejections.labels(reason)
        # Per tenant: the tenant label is a name of --tenants-file or "default", never a value
        # a client chose, so the series stay as few as the file's tenants.
        self.tenant_requests = Counter(
            p + "tenant_requests",
            "Inference requests by tenant (a name of --tenants-file, or default), answered or"
            " refused.",
            ["tenant"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            p + "tenant_tokens",
            "Tokens by tenant: kind=admitted, what admission counted (the prompt's estimate plus"
            " the output cap); kind=used, the prompt and completion tokens the answers' usage"
            " reported.",
            ["tenant", "kind"],
            registry=r,
        )
        self.tenant_queue_wait = Histogram(
            p + "tenant_queue_wait_seconds",
            "Time admitted requests waited for admission, by tenant.",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tenant_rejections = Counter(
            p + "tenant_rejections",
            "Requests refused by admission, by tenant and reason (queue_full, queue_timeout,"
            " rate_limited, tenant_concurrency, tenant_tokens, tenant_share).",
            ["tenant", "reason"],
            registry=r,
        )
        self.policy_decisions = Counter(
            p + "policy_decisions",
            "Routing decisions by stage and reason (cache_aware: cache_hit, cache_miss,"
            " unbalanced, empty_text; sticky_least_loaded: session_kept, session_placed,"
            " session_moved, no_session).",
            ["stage", "reason"],
            registry=r,
        )
        self.kv_tokenize = Counter(
            p + "kv_tokenize",
            "kv_aware: prompts' token ids by where they came from (cached, local: the router's"
            " tokenizer, stitched: the router's, a cached shared start and the rest encoded,"
            " engine: an engine's /tokenize) or failed (routed on the estimate).",
            ["outcome"],
            registry=r,
        )
        self.load_balance_events = Counter(
            p + "load_balance_events",
            "Decisions where load imbalance overrode prefix-cache affinity (cache_aware's"
            " 'unbalanced'), by stage.",
            ["stage"],
            registry=r,
        )
        self.stranded_kv_handoffs = Counter(
            p + "stranded_kv_handoffs",
            "Stranded-KV hand-offs: the client left after prefill answered and before decode"
            " did, so the router sent this decode endpoint a one-token request that pulls the"
            " KV blocks and lets the prefill engine free them at once.",
            ["endpoint"],
            registry=r,
        )
        self.stranded_kv_refused = Counter(
            p + "stranded_kv_refused_total",
            "Reclaims of stranded KV blocks that the decode endpoint answered with an error"
            " status: the blocks stay on the prefill engine until its KV timeout or lease.",
            ["endpoint"],
            registry=r,
        )
        self.late_prefill_answers = Counter(
            p + "prefill_answers_after_client_left_total",
            "Prefill answers read after the client had left (during the prefill answer grace):"
            " their KV blocks were reclaimed instead of stranded.",
            registry=r,
        )
        self.engine_requests = Gauge(
            p + "engine_requests",
            "Requests an engine reports (vllm:num_requests_running/_waiting) at the last"
            " scrape, per endpoint and state (running, waiting).",
            ["endpoint", "state"],
            registry=r,
        )
        self.load_drift = Gauge(
            p + "load_drift",
            "The router's load minus the engine's running+waiting requests at the last scrape,"
            " per endpoint; persistently non-zero means a leak in the router, the engine, or"
            " another router sharing the engine.",
            ["endpoint"],
            registry=r,
        )
        self.engine_scrape_errors = Counter(
            p + "engine_scrape_errors",
            "Failed scrapes of an upstream's /metrics, by upstream URL.",
            ["url"],
            registry=r,
        )

        self.cluster_sync_errors = Counter(
            p + "cluster_sync_errors",
            "Failed exchanges with the cluster store (--cluster-url): unreachable, timed out or"
            " a bad reply. While they fail the router routes on its own counts only.",
            registry=r,
        )
        self.cluster_store_up = Gauge(
            p + "cluster_store_up",
            "1 if the last exchange with the cluster store succeeded, else 0.",
            registry=r,
        )
        self.cluster_peers = Gauge(
            p + "cluster_peers",
            "Other replicas whose load snapshot the last exchange returned (live peers).",
            registry=r,
        )
        self.cluster_sync_duration = Histogram(
            p + "cluster_sync_duration_seconds",
            "Time of one exchange with the cluster store (publish own loads, read the peers').",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
            registry=r,
        )

    # -- fed by the router itself --------------------------------------------------------------

    def watch_ledger(self, ledger: LoadLedger, endpoints: list[Endpoint]) -> None:
        """Mirror ``ledger`` into ``in_flight``: every exposition reads the ledger (with
        ``--workers N`` the machine's), so a charge or release costs no gauge update. An
        endpoint the ledger no longer counts shows 0."""
        shown: set[tuple[str, str]] = {(ep.key, ep.role.value) for ep in endpoints}

        def refresh() -> None:
            now = {
                (key, role): load
                for role, loads in ledger.snapshot().items()
                for key, load in loads.items()
            }
            shown.update(now)
            for labels in shown:
                self.in_flight.labels(*labels).set(now.get(labels, 0))

        refresh()
        self._before_exposition.append(refresh)

    def watch_fleet(
        self,
        ledger: LoadLedger,
        endpoints: Callable[[], list[Endpoint]],
        healthy: Callable[[Endpoint], bool],
        policies: dict[Role, str],
    ) -> None:
        """What the ``vllm_router_*`` families read of the fleet: the endpoints routed to now,
        their load in ``ledger`` and their health (at every scrape), each stage's policy."""
        for role, policy in policies.items():
            self.vllm.policy_of(role, policy)
        self.vllm.watch_load(ledger, endpoints, healthy)

        def known_labels() -> None:
            # Counters whose label sets are known show at 0 before their first event, so a
            # rate or an alert over them has a series to read.
            for ep in endpoints():
                self.breaker.labels(ep.key)  # 0, closed, until the first transition
                self.vllm.cb_state.labels(ep.url)
                self.engine_scrape_errors.labels(ep.url)
                if ep.role is Role.DECODE:
                    self.stranded_kv_handoffs.labels(ep.key)
                    self.stranded_kv_refused.labels(ep.key)

        self._before_exposition.extend((self.vllm.refresh, known_labels))

    def watch_models(
        self, served: Callable[[], frozenset[str]], unknown: Callable[[], int]
    ) -> None:
        """``served`` gives the model ids some server lists (the ``model`` label's values),
        ``unknown`` how many servers' lists were never read (read at every scrape)."""
        self._served = served
        self._before_exposition.append(lambda: self.models_unknown.set(unknown()))

    def model_label(self, model: str | None) -> str:
        """The ``model`` label of a request naming ``model`` (bounded: see the module doc)."""
        if model is None:
            return "none"
        return model if model in self._served() else "unknown"

    def watch_restarts(self, restarts: Callable[[], int]) -> None:
        """With ``--workers N``: ``trio_pdrouter_worker_restarts_total`` reads the machine's
        count (every worker answers the same); a single process shows 0."""
        self._restarts.read = restarts

    def observe_request(self, rec: RequestRecord) -> None:
        """Account for one finished inference request."""
        stream = "true" if rec.stream else "false"
        self.requests.labels(rec.route, str(rec.status), stream, rec.outcome).inc()
        model = self.model_label(rec.model)
        self.model_requests.labels(model, rec.outcome).inc()
        if rec.prompt_tokens:
            self.model_tokens.labels(model, "prompt").inc(rec.prompt_tokens)
        if rec.completion_tokens:
            self.model_tokens.labels(model, "completion").inc(rec.completion_tokens)
        if rec.total_ms is not None:
            self.duration.labels(rec.route, stream).observe(rec.total_ms / 1000)
        if rec.ttfb_ms is not None:
            self.ttfb.labels(rec.route).observe(rec.ttfb_ms / 1000)
        if rec.prefill_ms is not None:
            self.prefill_duration.observe(rec.prefill_ms / 1000)
            if rec.total_ms is not None:
                self.decode_duration.observe((rec.total_ms - rec.prefill_ms) / 1000)
        if rec.retries:
            self.retries.labels(rec.route).inc(rec.retries)
        if rec.rejection is not None:
            self.rejections.labels(rec.rejection).inc()
        if rec.tenant is not None:
            self._observe_tenant(rec, rec.tenant)
        for stage, endpoint, kind in rec.upstream_errors:
            self.upstream_errors.labels(stage, endpoint, kind).inc()
        self.vllm.observe_request(rec)

    def _observe_tenant(self, rec: RequestRecord, tenant: str) -> None:
        self.tenant_requests.labels(tenant).inc()
        if rec.rejection is not None:
            self.tenant_rejections.labels(tenant, rec.rejection).inc()
        elif rec.queue_ms is not None:
            self.tenant_queue_wait.labels(tenant).observe(rec.queue_ms / 1000)
            if rec.admitted_tokens is not None:
                self.tenant_tokens.labels(tenant, "admitted").inc(rec.admitted_tokens)
        used = (rec.prompt_tokens or 0) + (rec.completion_tokens or 0)
        if used:
            self.tenant_tokens.labels(tenant, "used").inc(used)

    def engine_seen(self, endpoint: str, running: int, waiting: int, drift: int) -> None:
        """One endpoint's scraped engine state and the drift computed from it."""
        self.engine_requests.labels(endpoint, "running").set(running)
        self.engine_requests.labels(endpoint, "waiting").set(waiting)
        self.load_drift.labels(endpoint).set(drift)

    def engine_unknown(self, endpoint: str) -> None:
        """Drop an endpoint's engine series: its last scrape failed, old numbers would lie."""
        for state in ("running", "waiting"):
            _remove(self.engine_requests, endpoint, state)
        _remove(self.load_drift, endpoint)

    def engine_scrape_failed(self, url: str) -> None:
        self.engine_scrape_errors.labels(url).inc()

    # -- hooks for the resilience and routing machinery ----------------------------------------

    def cluster_synced(self, peers: int, seconds: float) -> None:
        self.cluster_store_up.set(1)
        self.cluster_peers.set(peers)
        self.cluster_sync_duration.observe(seconds)

    def cluster_sync_failed(self) -> None:
        self.cluster_sync_errors.inc()
        self.cluster_store_up.set(0)

    def breaker_state(self, endpoint: str, state: str) -> None:
        """``endpoint``'s breaker entered ``state``: one of :data:`BREAKER_STATES`.

        The circuit breakers call it on every transition."""
        self.breaker.labels(endpoint).set(BREAKER_STATES[state])
        self.vllm.breaker_state(endpoint, state)

    def health(self, endpoint: str, healthy: bool) -> None:
        """The health checker calls it when ``endpoint`` changes state."""
        self.healthy.labels(endpoint).set(1 if healthy else 0)

    def watch_admission(self, queued: Callable[[], int]) -> None:
        """Report the admission queue's depth, read at every scrape."""
        self.queue_depth.set_function(queued)

    def watch_buffers(self, total: Callable[[], int]) -> None:
        """Report the bytes held for clients, read at every scrape."""
        self.buffered.set_function(total)

    def watch_pump(self, streams: Callable[[], int]) -> None:
        """Report the streams the relay pump carries, read at every scrape."""
        self.pumped.set_function(streams)

    def policy_decision(self, stage: str, reason: str) -> None:
        """A policy chose an endpoint for ``stage`` because of ``reason``; ``unbalanced`` is
        also a load-balance event.

        ``cache_aware`` calls it for every decision."""
        self.policy_decisions.labels(stage, reason).inc()
        self.vllm.policy_decision(stage, reason)
        if reason == "unbalanced":
            self.load_balance_events.labels(stage).inc()

    def tokenized(self, outcome: str) -> None:
        """``kv_aware`` got a prompt's token ids (``cached``, ``local``, ``stitched``,
        ``engine``) or did not (``failed``)."""
        self.kv_tokenize.labels(outcome).inc()

    def stranded_kv(self, decode: Endpoint) -> None:
        """``decode`` was sent a request that pulls a departed client's KV blocks."""
        self.stranded_kv_handoffs.labels(decode.key).inc()

    def stranded_kv_refused_by(self, decode: Endpoint) -> None:
        """``decode`` answered a reclaim with an error status."""
        self.stranded_kv_refused.labels(decode.key).inc()

    def late_prefill_answer(self) -> None:
        """A prefill answer was read after its client left."""
        self.late_prefill_answers.inc()

    # -- exposition ----------------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The registry in Prometheus text format (content type :data:`CONTENT_TYPE`)."""
        for refresh in self._before_exposition:
            refresh()
        return generate_latest(self.registry)


class _Restarts(Collector):
    """``trio_pdrouter_worker_restarts_total``, read at each scrape."""

    def __init__(self) -> None:
        self.read: Callable[[], int] = lambda: 0

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            PREFIX + "worker_restarts",
            "Worker processes the supervisor restarted after they died (--workers N;"
            " machine-wide, whichever worker answers); 0 for a single process.",
            value=self.read(),
        )


def _remove(metric: Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # never set: older prometheus-client versions raise
        metric.remove(*labels)


class MetricsApp:
    """An ASGI app serving only ``GET /metrics``: the separate ``--prometheus-port`` listener."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["path"] != "/metrics":
            reply = Reply.error(errors.not_found(scope["path"]))
        elif scope["method"] != "GET":
            reply = Reply.error(errors.method_not_allowed(scope["method"], scope["path"]))
        else:
            body = self._metrics.exposition()
            reply = Reply(200, [(b"content-type", CONTENT_TYPE.encode())], body)
        await Downstream(send).finish(reply)
