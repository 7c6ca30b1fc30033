"""Running the router: hypercorn's trio worker, the upstream client, background housekeeping."""

from __future__ import annotations

import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import cast

import attrs
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from hypercorn.typing import Framework

from . import collector
from .app import RouterApp
from .assemble import build_app
from .config import ClusterSettings, RouterConfig
from .discovery import Credentials, credentials, follow_pods
from .endpoints import normalize_url
from .fleet import PROBER_ROW, StartupTimeout, wait_until_healthy
from .http import (
    BindError,
    LegClient,
    close_connections_when_clients_leave,
    expose_connections,
    listening_sockets,
    make_client,
    reuse_keep_alive_timers,
    serve_http1_only,
)
from .ledger import ClusterSync, LoadLedger, MachineLedger, Snapshot, connect, exchange_timeout
from .observe import MetricsApp, RouterMetrics, Tracing
from .routing import Routing
from .serve import StallWatch

log = logging.getLogger("trio_pdrouter.server")

#: Seconds between a worker's looks at the machine's server changes (``--workers N``).
FOLLOW_INTERVAL = 0.05
#: After the graceful timeout: how long hypercorn waits for the router's last answers to go out,
#: and when the command line's process exits whatever is still running (seconds).
ANSWER_FLUSH_S = 0.5
EXIT_DEADLINE_S = 0.9
#: At exit: how long the spans still queued may take to export (``--otlp-traces-endpoint``).
TRACES_FLUSH_S = 2.0


@attrs.frozen
class RunningRouter:
    """What :func:`run_router` reports once it listens (tests and the demo use it)."""

    url: str
    ledger: LoadLedger
    app: RouterApp
    #: The separate ``/metrics`` listener's address, when ``--prometheus-port`` is set.
    metrics_url: str | None = None


def hypercorn_config(config: RouterConfig) -> HypercornConfig:
    s = config.server
    hc = HypercornConfig()
    hc.bind = [f"[{s.host}]:{s.port}" if ":" in s.host else f"{s.host}:{s.port}"]
    hc.backlog = s.backlog
    hc.keep_alive_timeout = s.keep_alive_timeout
    # The router ends its own requests at the graceful timeout (see run_router); hypercorn
    # waits a little longer, so those last answers go out before it cancels what is left.
    hc.graceful_timeout = s.graceful_timeout + ANSWER_FLUSH_S
    # Bounds the request line plus headers that hypercorn buffers before it gives up.
    hc.h11_max_incomplete_size = s.max_header_bytes
    hc.accesslog = None  # the router writes its own access line per request
    hc.errorlog = logging.getLogger("hypercorn.error")
    return hc


async def wait_for_signal() -> None:
    """Return on SIGINT or SIGTERM: the start of a graceful shutdown."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("signal=%s shutting down", signal.Signals(signum).name)
            return


async def run_router(
    config: RouterConfig,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    ledger: LoadLedger | None = None,
    listener: socket.socket | None = None,
    metrics_fd: int | None = None,
    exit_by_deadline: bool = False,
    settle_heap: bool = False,
    task_status: trio.TaskStatus[RunningRouter] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until ``shutdown_trigger`` returns (or forever); report a :class:`RunningRouter`.

    A worker of ``--workers N`` passes its machine ledger and the listening sockets the
    supervisor made (``listener``, ``metrics_fd`` for the metrics listener); otherwise the
    router binds its ports itself. Either way the router owns ``listener``: it closes it as its
    drain starts (hypercorn stops accepting on its own copy), so the port, once every process
    has closed its copies, refuses new connections rather than leaving them in the backlog.

    Binds its ports first (raising :class:`~trio_pdrouter.http.BindError` when it cannot) and
    serves at once; then waits for the configured servers to be healthy
    (:mod:`trio_pdrouter.fleet.startup`: meanwhile ``/readiness`` answers 503) and reports
    once they are; raises :class:`~trio_pdrouter.fleet.startup.StartupTimeout` when they are
    not in time, and
    :class:`~trio_pdrouter.discovery.credentials.NoCredentials` when ``--service-discovery`` has no
    API server.

    Shutdown: once the trigger returns, the router stops accepting connections and lets the
    requests in flight finish for ``--graceful-timeout-secs``; then it ends each one whose
    answer is not decided (a stream with an error event and ``[DONE]``, anything else with a
    503) and hypercorn closes what is left. With ``exit_by_deadline`` (the command line) the
    process exits ``EXIT_DEADLINE_S`` after that even if clients that stopped reading still
    hold sends that nothing can cancel.

    ``settle_heap`` (the command line's processes): once serving, the garbage collector is
    settled (:func:`trio_pdrouter.collector.settle`).
    """
    close_connections_when_clients_leave()
    reuse_keep_alive_timers()
    serve_http1_only()
    expose_connections()
    # A worker of --workers N serves the supervisor's sockets (or no metrics listener).
    worker = isinstance(ledger, MachineLedger)
    bound_listener, metrics_listener = _bind(
        config, listener is None, metrics_fd is None and not worker
    )
    listener = listener or bound_listener
    assert listener is not None
    bound = [sock for sock in (listener, metrics_listener) if sock is not None]
    listen_fd = listener.fileno()
    metrics_fd = metrics_listener.fileno() if metrics_listener is not None else metrics_fd
    if shutdown_trigger is not None:
        shutdown_trigger = _then_close(shutdown_trigger, listener)

    try:
        async with make_client(config) as client:
            prober = not isinstance(ledger, MachineLedger) or ledger.row == PROBER_ROW
            kube = credentials(config) if prober else None
            urls = [normalize_url(url) for urls in config.servers().values() for url in urls]
            failure: StartupTimeout | None = None
            running: RunningRouter | None = None
            try:
                async with trio.open_nursery() as nursery:
                    seat = (ledger, listen_fd, metrics_fd, kube)
                    running = await nursery.start(
                        _run, config, client, nursery, shutdown_trigger, exit_by_deadline, seat
                    )
                    try:
                        await wait_until_healthy(client, urls, config.health, running.app.startup)
                    except StartupTimeout as exc:
                        failure = exc
                        nursery.cancel_scope.cancel()
                    else:
                        if not isinstance(ledger, MachineLedger):  # a worker's supervisor says it
                            log.info("%s", starting_line(config, running.url, running.metrics_url))
                        if settle_heap:
                            collector.settle()
                        task_status.started(running)
            finally:
                if running is not None and running.app.proxy.tracing is not None:
                    await _stop_tracing(running.app.proxy.tracing)
            if failure is not None:
                raise failure
    finally:
        for sock in bound:
            sock.close()


def _then_close(
    trigger: Callable[[], Awaitable[None]], listener: socket.socket
) -> Callable[[], Awaitable[None]]:
    """``trigger``, then ``listener`` closed (see :func:`run_router`)."""

    async def closing() -> None:
        await trigger()
        listener.close()

    return closing


async def _stop_tracing(tracing: Tracing) -> None:
    """Export the spans still queued, in a thread, for at most :data:`TRACES_FLUSH_S` (also when
    cancelled: shutting down)."""
    with trio.move_on_after(TRACES_FLUSH_S) as scope:
        scope.shield = True
        await trio.to_thread.run_sync(tracing.shutdown, abandon_on_cancel=True)


def _bind(
    config: RouterConfig, listener: bool, metrics: bool
) -> tuple[socket.socket | None, socket.socket | None]:
    """The sockets the router still has to bind (before anything else: a port in use shows at
    once, as :class:`~trio_pdrouter.http.BindError`): its listener unless given, and the
    separate ``/metrics`` listener (:func:`metrics_socket`) unless given or not this process's."""
    s = config.server
    main = None
    if listener:
        (main,) = listening_sockets(s.host, s.port, s.backlog, 1, reuseport=False)
    if not metrics:
        return main, None
    try:
        side = metrics_socket(config, s.backlog)
    except BindError:
        if main is not None:
            main.close()
        raise
    return main, side


def starting_line(config: RouterConfig, url: str, metrics_url: str | None) -> str:
    """The one start-up line, once ready: where it listens, the processes, the mode, the
    policies, the servers, and where metrics and traces go."""
    policies = ",".join(f"{role.value}:{config.stage_policy(role)}" for role in config.servers())
    servers = " ".join(f"{role.value}={len(urls)}" for role, urls in config.servers().items())
    metrics = f"{url}/metrics" + (f" and {metrics_url}/metrics" if metrics_url else "")
    traces = config.otlp_traces_endpoint or "off"
    return (
        f"listening={url} workers={config.server.workers} mode={'pd' if config.pd else 'regular'}"
        f" policy={policies} {servers} metrics={metrics} traces={traces}"
    )


async def _run(
    config: RouterConfig,
    client: LegClient,
    nursery: trio.Nursery,
    shutdown_trigger: Callable[[], Awaitable[None]] | None,
    exit_by_deadline: bool,
    seat: tuple[LoadLedger | None, int, int | None, Credentials | None],
    task_status: trio.TaskStatus[RunningRouter],
) -> None:
    """The router over ``client``, its background work in ``nursery``, until shutdown;
    ``seat`` is the ledger (a worker's machine ledger, else None), the listening socket's fd,
    the metrics listener's (None without one), and the Kubernetes credentials of the machine's
    one pod watcher."""
    ledger, listen_fd, metrics_fd, kube = seat
    hc = hypercorn_config(config)
    app = build_app(config, client, nursery, ledger=ledger, starting=_starts_unknown(config))
    nursery.start_soon(
        _maintain_policies, app.routing, config.policy_settings.eviction_interval_secs
    )
    nursery.start_soon(app.fleet.follow, FOLLOW_INTERVAL)
    if app.kv_events is not None:
        await nursery.start(app.kv_events.run)
    if config.server.write_timeout > 0:
        nursery.start_soon(StallWatch(config.server.write_timeout, app.proxy.in_flight).run)
    if app.engine_truth is not None:
        nursery.start_soon(app.engine_truth.run)
    nursery.start_soon(app.models.run)
    if config.health.interval_secs > 0 and app.verdicts is not None:
        nursery.start_soon(app.health.follow, FOLLOW_INTERVAL)
    elif config.health.interval_secs > 0:
        await nursery.start(app.health.run, client)
    if app.peers is not None:
        await nursery.start(_sync_cluster, config.cluster, app)
    if kube is not None:
        await nursery.start(follow_pods, config, kube, app.fleet, app.metrics.registry, nursery)
    metrics_url = None
    if metrics_fd is not None:
        metrics_binds: list[str] = await nursery.start(
            _serve_metrics, config, metrics_fd, app.metrics
        )
        metrics_url = metrics_binds[0]

    trigger = None
    if shutdown_trigger is not None:
        inner = shutdown_trigger

        async def trigger() -> None:
            await inner()
            deadline = config.server.graceful_timeout
            nursery.start_soon(_end_requests_at, app, deadline, exit_by_deadline)

    async def _serve(task_status: trio.TaskStatus[list[str]]) -> None:
        await serve(
            cast(Framework, app),
            hc,
            shutdown_trigger=trigger,
            task_status=task_status,
        )
        nursery.cancel_scope.cancel()

    hc.bind = [f"fd://{os.dup(listen_fd)}"]  # hypercorn's socket owns (and closes) the copy
    binds: list[str] = await nursery.start(_serve)
    log.info("bound=%s serving /health; ready once the servers are", binds[0])
    task_status.started(RunningRouter(binds[0], app.ledger, app, metrics_url))


def _starts_unknown(config: RouterConfig) -> bool:
    """Whether the command line's servers start unknown (no traffic until a probe passes): yes
    unless nothing would ever probe them (no start-up wait, no health probes)."""
    return config.health.startup_timeout_secs > 0 or config.health.interval_secs > 0


async def _end_requests_at(app: RouterApp, deadline: float, exit_by_deadline: bool) -> None:
    """The graceful timeout is over: answer every request still undecided, then (with
    ``exit_by_deadline``) make sure the process ends soon whatever clients do."""
    await trio.sleep(deadline)
    ended = app.proxy.shut_down()
    log.warning("graceful timeout over: ended=%d requests in flight", ended)
    if not exit_by_deadline:
        return
    # A send blocked on a client that stopped reading cannot be cancelled (hypercorn shields
    # it), so serving could wait for it forever. Still here by now: account and exit.
    await trio.sleep(EXIT_DEADLINE_S)
    stuck = len(app.proxy.in_flight)
    app.account_unfinished()
    log.warning("exiting: requests=%d still held by clients that do not read", stuck)
    logging.shutdown()
    os._exit(0)


def metrics_socket(config: RouterConfig, backlog: int) -> socket.socket | None:
    """The separate ``/metrics`` listener's socket, bound and listening (see
    :meth:`RouterConfig.metrics_listener`): None when it is turned off, or when vllm-router's
    default port is taken (a warning says so). A port given that cannot be bound raises
    :class:`~trio_pdrouter.http.BindError` naming it."""
    where = config.metrics_listener()
    if where is None:
        return None
    host, port, required = where
    try:
        (sock,) = listening_sockets(host, port, backlog, 1, reuseport=False)
    except BindError as exc:
        if required:
            raise BindError(f"--prometheus-port: {exc}") from None
        log.warning(
            "metrics listener not opened: %s (give --prometheus-port to choose one;"
            " /metrics is on the main port)",
            exc,
        )
        return None
    return sock


async def _serve_metrics(
    config: RouterConfig,
    fd: int,
    metrics: RouterMetrics,
    task_status: trio.TaskStatus[list[str]],
) -> None:
    """The separate ``/metrics`` listener on the listening socket ``fd``."""
    hc = hypercorn_config(config)
    hc.bind = [f"fd://{os.dup(fd)}"]  # hypercorn's socket owns (and closes) the copy
    await serve(cast(Framework, MetricsApp(metrics)), hc, task_status=task_status)


async def _sync_cluster(
    settings: ClusterSettings, app: RouterApp, task_status: trio.TaskStatus[None]
) -> None:
    """Share loads with the other replicas until cancelled; started once the first exchange
    has been tried (so the first requests already see the peers, when the store is up)."""
    assert settings.url is not None and app.peers is not None
    async with connect(settings.url, timeout=exchange_timeout(settings.ttl)) as store:
        sync = ClusterSync(
            store,
            lambda: Snapshot.of(app.ledger, app.tenants.snapshot()),
            app.peers,
            interval=settings.interval,
            ttl=settings.ttl,
            observer=app.metrics,
        )
        await sync.sync_once()
        log.info("cluster replica=%s connected=%s", app.peers.replica, sync.connected)
        task_status.started()
        await sync.run()


async def _maintain_policies(routing: Routing, interval: float) -> None:
    while True:
        await trio.sleep(interval)
        more = True
        while more:
            try:
                more = routing.maintain()
            except Exception:  # a bug in a policy must not end the router; try next round
                log.exception("policy maintenance failed")
                more = False
            await trio.lowlevel.checkpoint()  # let requests run between eviction slices
