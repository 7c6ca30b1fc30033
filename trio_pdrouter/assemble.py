"""The composition root: the whole router as an ASGI app, wired from its settings.

Every runtime object is built here from :class:`~trio_pdrouter.config.RouterConfig` and handed
its collaborators; nothing below builds its own. :func:`build_app` returns the app with what
runs in the background still to start (:mod:`trio_pdrouter.server` starts it), so tests build
the same app over an in-memory transport.
"""

from __future__ import annotations

import logging
import os
import random

import trio

from .app import AdminRoutes, InferenceRoutes, RouterApp
from .config import RouterConfig
from .endpoints import Role
from .fleet import (
    PROBER_ROW,
    Breakers,
    EngineTruth,
    Fleet,
    HealthBoard,
    MachineServers,
    MachineVerdicts,
    ServedModels,
    StartupStatus,
)
from .http import LegClient, stream_timeout
from .kv import KvCollector, kv_events_for
from .ledger import LoadLedger, MachineLedger, PeerLoads, exchange_timeout
from .machine import PrefixRing, RouteRing, TableFull
from .observe import RouterMetrics, tracing_for
from .routing import KvAware, LocalTokenizer, PromptTokens, Routing, make_policy
from .serve import (
    Admission,
    BufferBudget,
    BufferedDecode,
    ContextCheck,
    DecodeRelay,
    KvReclaimer,
    PrefillLeg,
    Proxy,
    Pump,
    TokenBucket,
)
from .tenants import MachineTenantLedger, Tenancy, TenantBook, TenantLedger, TenantsFile

log = logging.getLogger("trio_pdrouter.server")

__all__ = ["build_app"]


def know_tenants(ledger: TenantLedger, book: TenantBook) -> None:
    """A reloaded book's tenants get their slots; a machine table out of room says so and the
    new tenants are counted where they are first admitted."""
    try:
        ledger.know(book.names())
    except TableFull as exc:
        log.warning("tenants file reloaded but not every tenant has a slot: %s", exc)


def build_app(
    config: RouterConfig,
    client: LegClient,
    background: trio.Nursery,
    *,
    ledger: LoadLedger | None = None,
    starting: bool = False,
) -> RouterApp:
    """The whole router as an ASGI app over ``client``; tests pass an in-memory transport.

    ``background`` runs work that outlives a request (the stranded-KV reclaim). Health probes,
    the engine-truth scrape and policy maintenance are started by :func:`run_router`. ``ledger``
    is this process's own unless given (a worker of ``--workers N`` gives its machine ledger).
    ``starting``: the servers of the command line are unknown, so not routable, until a probe
    passes (:func:`~trio_pdrouter.server.run_router` then waits for them through
    ``app.startup``); else they take traffic at once.
    """
    ledger = LoadLedger() if ledger is None else ledger
    metrics = RouterMetrics(pd=config.pd, attempts=config.retry.max_retries)
    fleet: Fleet
    models = ServedModels(
        client,
        lambda: {ep.url for ep in fleet.endpoints()},
        lambda url: any(health.is_healthy(ep) for ep in fleet.endpoints_of(url)),
        interval_s=config.models_refresh_interval,
        api_key=config.upstream_api_key,
    )

    def health_changed(url: str, healthy: bool) -> None:
        log.log(logging.INFO if healthy else logging.WARNING, "url=%s healthy=%s", url, healthy)
        for ep in fleet.endpoints_of(url):
            metrics.health(ep.key, healthy)
        if healthy:  # perhaps restarted with another model: learn what it serves again
            models.relearn(url)

    verdicts = None
    prober = True  # this process probes health and scrapes the engines
    if isinstance(ledger, MachineLedger):
        verdicts = MachineVerdicts(ledger.table, ledger.row)
        prober = ledger.row == PROBER_ROW
    health = HealthBoard(config.health, on_change=health_changed, verdicts=verdicts, publish=prober)
    breakers = Breakers(
        config.breaker,
        in_flight=ledger.load,
        on_change=lambda ep, old, new: metrics.breaker_state(ep.key, new),
    )
    rng = random.Random()
    every = [ep for endpoints in config.endpoints().values() for ep in endpoints]
    relay_dir = None  # a worker of --workers N: the supervisor's fan-out beside the lock file
    if isinstance(ledger, MachineLedger):
        relay_dir = os.path.dirname(ledger.table.lock_path)
    kv = kv_events_for(config.kv_events, config.policy_settings, every, relay_dir=relay_dir)
    if kv is not None:
        metrics.registry.register(KvCollector(kv))

    def feed(role: Role) -> PrefixRing | None:
        """With ``--workers N``: the machine's prefix rings, so every worker's tree learns all."""
        if not isinstance(ledger, MachineLedger):
            return None
        table = ledger.table
        return PrefixRing(table.prefixes, table.rows, ledger.row, role.value)

    def routes(role: Role) -> RouteRing | None:
        """With ``--workers N``: the machine's route rings, so every worker's forecasts see
        the prompts all workers have in flight."""
        if not isinstance(ledger, MachineLedger) or config.stage_policy(role) != "kv_aware":
            return None
        table = ledger.table
        return RouteRing(table.routes, table.rows, ledger.row, role.value)

    policies = {
        role: make_policy(
            config.stage_policy(role),
            stage=role.value,
            settings=config.policy_settings,
            on_decision=metrics.policy_decision,
            rng=rng,
            feed=feed(role),
            kv=kv,
            routes=routes(role),
        )
        for role in config.servers()
    }
    peers = None
    if config.cluster.url is not None:
        cluster = config.cluster
        # Peers' counts hold for an expiry plus one exchange's time limit without news: longer
        # and the sync loop has stopped (a failed exchange forgets them at once anyway).
        peers = PeerLoads(
            cluster.replica(config.server.port),
            cluster.ttl + exchange_timeout(cluster.ttl),
            trio.current_time,
        )
    routing = Routing(
        policies,
        ledger,
        (health.is_healthy, lambda ep: breakers.admits(ep, trio.current_time())),
        peers,
        by_tokens=config.token_roles(),
        models=models,
    )
    machine = None
    if isinstance(ledger, MachineLedger):
        machine = MachineServers(ledger.table, background, config.server.graceful_timeout)
    fleet = Fleet(
        dp_size=config.dp_size,
        routing=routing,
        ledger=ledger,
        health=health,
        breakers=breakers,
        machine=machine,
        max_runtime=config.max_runtime_servers,
        policy=config.upstream_policy(),
    )
    for role, urls in config.servers().items():
        for url in urls:
            fleet.add_at_start(url, role, serving=not starting)
    startup = StartupStatus(on_healthy=health.confirm)
    fleet.catch_up()  # and then the runtime changes made before it started
    tenants_file = None
    if config.admission.tenants_file is not None:
        tenants_file = TenantsFile(config.admission.tenants_file)
    tenant_ledger = (
        MachineTenantLedger(ledger.table, ledger.row, peers)
        if isinstance(ledger, MachineLedger)
        else TenantLedger(peers=peers)
    )
    if tenants_file is not None:
        tenant_ledger.know(tenants_file.book.names())
        background.start_soon(tenants_file.watch, lambda book: know_tenants(tenant_ledger, book))
    if isinstance(ledger, MachineLedger):
        machine_table = ledger.table
        machine_table.keep_only(ledger.row)  # what a dead predecessor held and nobody uses now
        metrics.watch_restarts(lambda: machine_table.restarts)
    metrics.watch_ledger(ledger, fleet.endpoints())
    stage_policies = {role: config.stage_policy(role) for role in config.servers()}
    metrics.watch_fleet(ledger, fleet.endpoints, health.is_healthy, stage_policies)

    rate = config.admission.rate_limit_tokens_per_second
    bucket = None
    if rate is not None:
        bucket = TokenBucket(config.admission.max_concurrent_requests, rate, trio.current_time())
    admission = Admission(config.admission, bucket, tenant_ledger)
    metrics.watch_admission(lambda: admission.queued)
    budget = BufferBudget(config.max_total_buffered_bytes)
    metrics.watch_buffers(lambda: budget.total)
    t = config.timeouts
    pump = None
    if not config.no_relay_pump:
        pump = Pump(
            max_delay=config.relay_pump_max_delay_ms / 1000,
            idle_limit=stream_timeout(t).read,
        )
        background.start_soon(pump.run)
        metrics.watch_pump(lambda: pump.streams)
    relay = DecodeRelay(
        client,
        first_byte_limit=t.first_byte_limit,
        stream_timeout=stream_timeout(t),
        max_buffered_bytes=config.max_buffered_bytes,
        budget=budget,
        release_at_headers=config.release_decode_at_headers,
        pump=pump,
    )
    background.start_soon(relay.watch)
    proxy = Proxy(
        config,
        routing=routing,
        admission=admission,
        outcomes=breakers,
        prefill=PrefillLeg(
            client,
            t.prefill_limit,
            config.upstream_api_key,
            config.max_upstream_answer_bytes,
            grace=t.prefill_grace,
            on_late_answer=metrics.late_prefill_answer,
        ),
        buffered=BufferedDecode(client, t.first_byte_limit, config.max_upstream_answer_bytes),
        relay=relay,
        reclaimer=KvReclaimer(
            client,
            ledger,
            background,
            limit=t.first_byte_limit,
            upstream_api_key=config.upstream_api_key,
            on_reclaim=metrics.stranded_kv,
            on_refused=metrics.stranded_kv_refused_by,
        ),
        rng=rng,
        tracing=tracing_for(
            config.otlp_traces_endpoint,
            config.otlp_traces_sample_ratio,
            {
                "trio_pdrouter.mode": "pd" if config.pd else "regular",
                **{
                    f"trio_pdrouter.policy.{role.value}": config.stage_policy(role)
                    for role in config.servers()
                },
            },
        ),
    )
    truth = None
    if config.engine_metrics_interval > 0 and prober:
        truth = EngineTruth(
            fleet.endpoints, ledger, client, config.engine_metrics_interval, metrics, peers
        )
    # kv_aware routes on token ids: the router (--kv-tokenizer-path) or an engine tokenizes
    path = config.kv_events.tokenizer_path
    local = LocalTokenizer.load(path) if path is not None else None
    tokens = None
    kv_roles = [role for role in config.servers() if config.stage_policy(role) == "kv_aware"]
    if kv_roles:
        at = lambda: sorted({ep.url for ep in routing.candidates(kv_roles[0])})  # noqa: E731
        first = policies[kv_roles[0]]
        tokens = PromptTokens(
            client,
            at,
            api_key=config.upstream_api_key,
            local=local,
            seen=first.seen_chars if isinstance(first, KvAware) else None,
            cut_chars=config.kv_events.cut_chars(),
            on_outcome=metrics.tokenized,
            serving=models.may_serve,
        )
    generating = Role.DECODE if config.pd else Role.REGULAR

    def serving() -> set[str]:
        return {ep.url for ep in routing.candidates(generating)}

    context = None
    if config.check_context_length:
        counter = tokens or PromptTokens(
            client,
            lambda: sorted(serving()),
            api_key=config.upstream_api_key,
            local=local,
            serving=models.may_serve,
        )
        context = ContextCheck(models, serving, counter)
    metrics.watch_models(models.served_ids, lambda: len(models.unknown()))
    inference = InferenceRoutes(config, proxy, metrics, tokens, context, models)
    admin = AdminRoutes(
        config,
        fleet=fleet,
        routing=routing,
        ledger=ledger,
        client=client,
        metrics=metrics,
        engine_truth=truth,
        peers=peers,
        kv_events=kv,
        startup=startup,
        models=models,
    )
    return RouterApp(
        config,
        fleet=fleet,
        routing=routing,
        ledger=ledger,
        proxy=proxy,
        metrics=metrics,
        health=health,
        engine_truth=truth,
        peers=peers,
        verdicts=None if prober else verdicts,
        kv_events=kv,
        context=context,
        models=models,
        inference=inference,
        admin=admin,
        startup=startup,
        tenancy=Tenancy(config.api_key, tenants_file, config.admission.tenant_header),
        tenants=tenant_ledger,
    )
