"""Kubernetes discovery's Prometheus metrics, in the router's registry, all
``trio_pdrouter_discovery_*``:

* ``lists_total{role}`` and ``listed_pods{role}``: every full list (start, reconnect, 410,
  resync) and the pods it held;
* ``watch_restarts_total{role,reason}``: every end of a list-and-watch session; ``reason`` is
  ``resync`` (the period is over: the normal case), ``expired`` (a 410) or the error's name;
* ``server_changes_total{change,reason}``: servers added (``ready``) and removed (``deleted``,
  ``terminating``, ``not ready``, ``no ip``, ``not selected``, ``not running``,
  ``absent from the pod list``, ``changed``);
* ``event_apply_seconds``: from a watch event read to the routing change made (the removal,
  or the addition of a server that then takes traffic at its first good probe).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..endpoints import Role
from .pod_rule import PodServer

PREFIX = "trio_pdrouter_discovery_"


class DiscoveryMetrics:
    """What the watch loop and the reconciler report (module doc)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._lists = Counter(PREFIX + "lists_total", "full pod lists", ["role"], registry=registry)
        self._listed = Gauge(
            PREFIX + "listed_pods", "pods in the last full list", ["role"], registry=registry
        )
        self._restarts = Counter(
            PREFIX + "watch_restarts_total",
            "ends of a list-and-watch session, by reason",
            ["role", "reason"],
            registry=registry,
        )
        self._changes = Counter(
            PREFIX + "server_changes_total",
            "servers added or removed by discovery",
            ["change", "reason"],
            registry=registry,
        )
        self._apply = Histogram(
            PREFIX + "event_apply_seconds",
            "from a pod event read to the routing change made",
            buckets=(1e-5, 1e-4, 1e-3, 0.01, 0.1, 1.0),
            registry=registry,
        )

    def listed(self, role: Role, pods: int, pages: int) -> None:
        self._lists.labels(role.value).inc()
        self._listed.labels(role.value).set(pods)

    def restarted(self, role: Role, reason: str) -> None:
        self._restarts.labels(role.value, reason).inc()

    def applied(self, role: Role, kind: str, seconds: float) -> None:
        self._apply.observe(seconds)

    def changed(self, change: str, server: PodServer, reason: str) -> None:
        self._changes.labels(change, reason).inc()
