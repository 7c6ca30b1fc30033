"""Kubernetes service discovery put together: credentials, the API client, the reconciler over
the fleet, the watch loop and its metrics.

Rules: one watcher per machine — the single process, or worker 0 of ``--workers N`` (the
machine's prober), whose fleet changes reach the other workers through the machine's server
log. The credentials are loaded before the router serves (:func:`credentials`: a bad kubeconfig
stops the start with its reason); the API client is httpx's own pool (TLS, one connection per
watch), not the upstream transport, which speaks plain HTTP to engines only.
"""

from __future__ import annotations

import logging
import random

import httpx
import trio
from prometheus_client import CollectorRegistry

from ..config import RouterConfig
from ..fleet import Fleet
from .credentials import Credentials, load
from .kube_api import PodsApi
from .metrics import DiscoveryMetrics
from .pod_watch import SERVER_TIMEOUT_SLACK, PodWatch
from .reconcile import Reconciler

log = logging.getLogger("trio_pdrouter.discovery")

#: Seconds for a connect, a write, a list page; a watch read waits for its session instead.
API_TIMEOUT = 10.0


def credentials(config: RouterConfig) -> Credentials | None:
    """The API server's credentials when discovery is on; raises
    :class:`~trio_pdrouter.discovery.credentials.NoCredentials` when there are none to use."""
    if not config.discovery.enabled:
        return None
    found = load(config.discovery.kubeconfig)
    log.info("discovery api=%s namespace=%s", found.server, config.discovery.namespace or "*")
    if found.server.startswith("http://") and found.token():
        log.warning("discovery api=%s is plain http: its token travels unencrypted", found.server)
    return found


async def follow_pods(
    config: RouterConfig,
    found: Credentials,
    fleet: Fleet,
    registry: CollectorRegistry,
    background: trio.Nursery,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Make ``fleet`` follow the pods until cancelled; started once every role has tried its
    first list (servers found then still wait for their first good probe)."""
    settings = config.discovery
    selectors = settings.selectors(config.pd)
    metrics = DiscoveryMetrics(registry)
    read = settings.resync_secs + SERVER_TIMEOUT_SLACK + API_TIMEOUT
    timeout = httpx.Timeout(API_TIMEOUT, read=read)
    verify = found.tls if found.tls is not None else True
    async with httpx.AsyncClient(timeout=timeout, verify=verify) as client:
        reconciler = Reconciler(
            fleet,
            selectors,
            settings.ports,
            serving=config.health.interval_secs == 0,
            drain_timeout=config.server.graceful_timeout,
            background=background,
            on_change=metrics.changed,
        )
        watch = PodWatch(
            PodsApi(client, found, settings.namespace),
            reconciler,
            selectors,
            resync=settings.resync_secs,
            observer=metrics,
            rng=random.Random(),
        )
        await watch.run(task_status=task_status)
