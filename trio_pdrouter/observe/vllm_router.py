"""vllm-router 0.1.17's metric families, named ``vllm_router_*``, beside the router's own.

A dashboard or alert written for vllm-router reads the same names and label sets here. What
each family counts follows vllm-router's meaning as far as this router has the same event;
where the two routers differ, the docstring of :class:`VllmRouterMetrics` says how. Which
families vllm-router 0.1.17 exports, and with which labels, is listed in
``tests/observe/vllm_router_families.txt`` (and how that list was made).

Label values: ``worker`` is an engine's URL without its DP rank (vllm-router's worker URL);
``rank`` is the DP rank, or ``aggregate`` when the server runs one engine; ``route`` is the
request path; ``policy`` a stage's policy name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary

from ..endpoints import Endpoint, Role

if TYPE_CHECKING:
    from ..ledger import LoadLedger
    from .record import RequestRecord

PREFIX = "vllm_router_"

#: vllm-router's buckets for every ``*_duration_seconds`` histogram.
DURATION_BUCKETS = (
    0.001,
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
    15.0,
    30.0,
    45.0,
    60.0,
    90.0,
    120.0,
    180.0,
    240.0,
)

#: ``vllm_router_cb_state`` values: vllm-router codes half-open 2 and open 1 (the router's own
#: ``trio_pdrouter_circuit_breaker_state`` codes them the other way round).
CB_STATES = {"closed": 0, "open": 1, "half_open": 2}

#: cache_aware's reasons (``trio_pdrouter_policy_decisions_total``) as vllm-router's
#: ``vllm_router_prefix_routing_decisions_total`` outcomes.
PREFIX_OUTCOMES = {
    "cache_hit": "prefix_hit",
    "cache_miss": "prefix_miss",
    "empty_text": "missing_tokens",
    "unbalanced": "load_balanced",
}

#: Request outcomes that are not errors for ``vllm_router_request_errors_total``.
NOT_ERRORS = frozenset({"ok", "client_disconnect"})


def url_of(key: str) -> str:
    """The server URL of an endpoint key (``url`` or ``url@rank``; URLs carry no user info,
    so an ``@`` is a rank)."""
    return key.rsplit("@", 1)[0]


def worker_labels(ep: Endpoint) -> tuple[str, str]:
    """``(worker, rank)`` of an endpoint, as vllm-router labels its PD load gauges."""
    return ep.url, "aggregate" if ep.rank is None else str(ep.rank)


class VllmRouterMetrics:
    """The ``vllm_router_*`` families in ``registry``.

    Fed by :meth:`observe_request` (every finished inference request), the health and breaker
    hooks, the policy decisions, and at every scrape the load ledger:

    * ``requests_total{route}`` (regular mode) and ``pd_requests_total{route}`` (PD mode): one
      per request answered; ``generate_duration_seconds`` (regular) and
      ``pd_request_duration_seconds{route}`` (PD): from arrival to the decode answer's start,
      as vllm-router times it (a stream's first byte to the client; a non-streaming answer, which
      vLLM sends whole, its end);
    * ``processed_requests_total{worker}``: legs sent to each server (prefill and decode);
      ``pd_prefill_requests_total`` / ``pd_decode_requests_total{worker}``: the PD legs;
      ``pd_prefill_errors_total`` / ``pd_decode_errors_total{worker}``: their failures;
    * ``policy_decisions_total{policy, worker}``: each choice of a server;
      ``prefix_routing_decisions_total{policy, stage, outcome}``: cache_aware's choices
      (``prefix_hit``, ``prefix_miss``, ``missing_tokens``; ``load_balanced`` where load
      overrode the cache, which vllm-router counts in ``load_balancing_events_total``);
    * ``retries_total{route}``: attempts made again; ``retries_exhausted_total{route}``:
      requests that failed after every retry; ``request_errors_total{route, error_type}``:
      requests that failed, by the router's outcome;
    * ``worker_health{worker}`` (read at each scrape), ``cb_state{worker}`` (0 closed, 1 open,
      2 half-open),
      ``cb_outcomes_total{worker, outcome}`` (success, failure per leg),
      ``active_workers``;
    * from the ledger at each scrape, per ``{worker, rank}``: ``pd_prefill_occupancy``
      (prefills in flight), ``pd_active_prefill_tokens`` (their uncached prompt tokens, the
      router's estimate), ``pd_unknown_prefill_requests`` (always 0: every prompt gets an estimate),
      ``pd_pending_decode_requests`` (decode slots chosen whose prefill still runs),
      ``pd_active_decode_requests`` (decode legs running); regular mode:
      ``running_requests{worker}``;
    * ``pd_decode_pending_seconds``: how long a decode slot waited for its prefill.
    """

    def __init__(self, registry: CollectorRegistry, *, pd: bool, attempts: int) -> None:
        r = registry
        p = PREFIX
        self._pd = pd
        self._attempts = attempts
        self._policies: dict[str, str] = {}
        self._before_exposition: list[Callable[[], None]] = []
        # -- requests
        self.requests = Counter(
            p + "requests", "Requests by route (regular mode).", ["route"], registry=r
        )
        self.pd_requests = Counter(
            p + "pd_requests", "PD requests by route.", ["route"], registry=r
        )
        self.generate_duration = Histogram(
            p + "generate_duration_seconds",
            "Time from a request's arrival to the start of its answer (regular mode).",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.pd_duration = Histogram(
            p + "pd_request_duration_seconds",
            "Time from a PD request's arrival to the start of the decode answer, by route.",
            ["route"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.request_errors = Counter(
            p + "request_errors",
            "Requests that failed, by route and error type (the router's outcome).",
            ["route", "error_type"],
            registry=r,
        )
        self.retries = Counter(p + "retries", "Retries by route.", ["route"], registry=r)
        self.retries_exhausted = Counter(
            p + "retries_exhausted",
            "Requests that failed after every retry, by route.",
            ["route"],
            registry=r,
        )
        # -- workers
        self.processed = Counter(
            p + "processed_requests",
            "Requests sent to each worker (each leg of a PD request).",
            ["worker"],
            registry=r,
        )
        self.pd_prefill_requests = Counter(
            p + "pd_prefill_requests", "Prefill legs per worker.", ["worker"], registry=r
        )
        self.pd_decode_requests = Counter(
            p + "pd_decode_requests", "Decode legs per worker.", ["worker"], registry=r
        )
        self.pd_prefill_errors = Counter(
            p + "pd_prefill_errors", "Failed prefill legs per worker.", ["worker"], registry=r
        )
        self.pd_decode_errors = Counter(
            p + "pd_decode_errors", "Failed decode legs per worker.", ["worker"], registry=r
        )
        self.worker_health = Gauge(
            p + "worker_health", "1 healthy, 0 unhealthy, per worker.", ["worker"], registry=r
        )
        self.active_workers = Gauge(
            p + "active_workers", "Servers the router routes to.", registry=r
        )
        self.cb_state = Gauge(
            p + "cb_state",
            "Circuit breaker state per worker: 0 closed, 1 open, 2 half-open.",
            ["worker"],
            registry=r,
        )
        self.cb_outcomes = Counter(
            p + "cb_outcomes",
            "Leg outcomes the circuit breakers count, per worker (success, failure).",
            ["worker", "outcome"],
            registry=r,
        )
        # -- policies
        self.policy_decisions = Counter(
            p + "policy_decisions",
            "Servers chosen, by policy and worker.",
            ["policy", "worker"],
            registry=r,
        )
        self.prefix_decisions = Counter(
            p + "prefix_routing_decisions",
            "cache_aware's choices by stage and outcome (prefix_hit, prefix_miss,"
            " missing_tokens, load_balanced).",
            ["policy", "stage", "outcome"],
            registry=r,
        )
        # -- load, read from the ledger at each scrape
        rank = ["worker", "rank"]
        self.prefill_occupancy = Gauge(
            p + "pd_prefill_occupancy", "Prefills in flight.", rank, registry=r
        )
        self.active_prefill_tokens = Gauge(
            p + "pd_active_prefill_tokens",
            "Uncached prompt tokens of the prefills in flight (the router's estimate).",
            rank,
            registry=r,
        )
        self.unknown_prefill = Gauge(
            p + "pd_unknown_prefill_requests",
            "Prefills in flight whose prompt size is unknown (0: every prompt is estimated).",
            rank,
            registry=r,
        )
        self.pending_decode = Gauge(
            p + "pd_pending_decode_requests",
            "Decode slots chosen whose prefill is still running.",
            rank,
            registry=r,
        )
        self.active_decode = Gauge(
            p + "pd_active_decode_requests", "Decode legs running.", rank, registry=r
        )
        self.running = Gauge(
            p + "running_requests",
            "Requests in flight per worker (regular mode).",
            ["worker"],
            registry=r,
        )
        self.decode_pending = Summary(
            p + "pd_decode_pending_seconds",
            "How long a chosen decode slot waited for its prefill.",
            registry=r,
        )

    def policy_of(self, role: Role, policy: str) -> None:
        """``role``'s servers are chosen by ``policy`` (the ``policy`` label)."""
        self._policies[role.value] = policy

    def watch_load(
        self,
        ledger: LoadLedger,
        endpoints: Callable[[], list[Endpoint]],
        healthy: Callable[[Endpoint], bool],
    ) -> None:
        """Read the load gauges from ``ledger`` and ``worker_health`` from ``healthy`` at every
        scrape, for ``endpoints()`` (a server is healthy while any of its ranks is)."""

        def refresh() -> None:
            eps = endpoints()
            self.active_workers.set(len({ep.url for ep in eps}))
            health: dict[str, bool] = {}
            for ep in eps:
                health[ep.url] = health.get(ep.url, False) or healthy(ep)
            for url, up in health.items():
                self.worker_health.labels(url).set(1 if up else 0)
            loads = ledger.loads(eps)
            visible = ledger.visible_loads(eps)
            tokens = ledger.token_loads(eps)
            per_url: dict[str, int] = {}
            for ep in eps:
                labels = worker_labels(ep)
                if ep.role is Role.PREFILL:
                    self.prefill_occupancy.labels(*labels).set(loads[ep])
                    self.active_prefill_tokens.labels(*labels).set(tokens[ep])
                    self.unknown_prefill.labels(*labels).set(0)
                elif ep.role is Role.DECODE:
                    self.pending_decode.labels(*labels).set(loads[ep] - visible[ep])
                    self.active_decode.labels(*labels).set(visible[ep])
                else:
                    per_url[ep.url] = per_url.get(ep.url, 0) + loads[ep]
            for url, load in per_url.items():
                self.running.labels(url).set(load)

        self._before_exposition.append(refresh)

    def refresh(self) -> None:
        for refresh in self._before_exposition:
            refresh()

    def observe_request(self, rec: RequestRecord) -> None:
        """One finished inference request."""
        route = rec.route
        prefill = None if rec.prefill is None else url_of(rec.prefill)
        decode = None if rec.decode is None else url_of(rec.decode)
        start = rec.ttfb_ms if rec.stream and rec.ttfb_ms is not None else rec.total_ms
        if self._pd:
            self.pd_requests.labels(route).inc()
            if start is not None:
                self.pd_duration.labels(route).observe(start / 1000)
        else:
            self.requests.labels(route).inc()
            if start is not None:
                self.generate_duration.observe(start / 1000)
        if rec.prefill_ms is not None:
            self.decode_pending.observe(rec.prefill_ms / 1000)
        for stage, url in (("prefill", prefill), ("decode", decode)):
            if url is None:
                continue
            self.processed.labels(url).inc()
            policy = self._policies.get(stage if self._pd else "regular")
            if policy is not None:
                self.policy_decisions.labels(policy, url).inc()
            if stage == "prefill":
                self.pd_prefill_requests.labels(url).inc()
            elif self._pd:
                self.pd_decode_requests.labels(url).inc()
        failed: set[str | None] = set()
        for stage, endpoint, _kind in rec.upstream_errors:
            url = url_of(endpoint)
            failed.add(url)
            self.cb_outcomes.labels(url, "failure").inc()
            if stage == "prefill":
                self.pd_prefill_errors.labels(url).inc()
            elif self._pd:
                self.pd_decode_errors.labels(url).inc()
        if rec.status < 500:
            for url in {prefill, decode} - failed:
                if url is not None:
                    self.cb_outcomes.labels(url, "success").inc()
        if rec.retries:
            self.retries.labels(route).inc(rec.retries)
        if rec.outcome not in NOT_ERRORS:
            self.request_errors.labels(route, rec.outcome).inc()
            if rec.upstream_errors and self._attempts > 1 and rec.retries + 1 >= self._attempts:
                self.retries_exhausted.labels(route).inc()

    def breaker_state(self, endpoint: str, state: str) -> None:
        """``endpoint``'s breaker entered ``state`` (with DP ranks, the URL shows the last
        rank's transition)."""
        self.cb_state.labels(url_of(endpoint)).set(CB_STATES[state])

    def policy_decision(self, stage: str, reason: str) -> None:
        outcome = PREFIX_OUTCOMES.get(reason)
        policy = self._policies.get(stage)
        if outcome is not None and policy is not None:
            self.prefix_decisions.labels(policy, stage, outcome).inc()
