"""``docs/reference/metrics.md``: every metric family, from the registry the router builds.

The families are read from a :class:`~trio_pdrouter.observe.RouterMetrics` (what every router
exposes), with the families Kubernetes discovery and ``kv_aware``'s KV events add to the same
registry when they are on. A family's labels are those its collector declares; the KV-event
collector declares none until it has engines, so it is shown one engine (named ``ENDPOINT``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any, cast

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from trio_pdrouter.discovery import DiscoveryMetrics
from trio_pdrouter.kv import KvCollector, KvEvents
from trio_pdrouter.observe import RouterMetrics

HEADER = """\
# Metrics reference

Every metric family the router exposes at `GET /metrics` (and on `--prometheus-port` when
given), generated from the registry the router builds (`make docs-reference`); a test fails
when this page and the registry disagree. With `--workers N` every worker answers with the
machine's numbers (the load ledger is shared), except circuit breakers, which are per worker.

A counter is exposed with `_total` after its name; a histogram as `_bucket`, `_sum` and
`_count` series. What to watch and alert on: [Operations](../operations.md).
"""

SECTIONS = (
    ("Every router", "always present"),
    ("Kubernetes discovery", "present with `--service-discovery`"),
    ("KV events", "present when `kv_aware` has KV-event sources (`--kv-event-source`)"),
)


class _OneEngine:
    """What the KV-event collector reads, for one engine whose counts are all 0."""

    def snapshot(self) -> list[dict[str, object]]:
        row: defaultdict[str, object] = defaultdict(int, endpoint="ENDPOINT", known=True)
        return [row]


def render() -> str:
    router = RouterMetrics()
    discovery = CollectorRegistry(auto_describe=True)
    DiscoveryMetrics(discovery)
    kv = CollectorRegistry(auto_describe=True)
    kv.register(KvCollector(cast(KvEvents, _OneEngine())))
    out = [HEADER]
    for (title, when), registry in zip(SECTIONS, (router.registry, discovery, kv), strict=True):
        out.append(f"## {title}\n\n{when.capitalize()}.\n")
        out.append("| metric | type | labels | what it counts |\n|---|---|---|---|")
        out.extend(sorted(_rows(registry)))
        out.append("")
    return "\n".join(out)


def _rows(registry: CollectorRegistry) -> Iterable[str]:
    for collector in _collectors(registry):
        declared: tuple[str, ...] | None = getattr(collector, "_labelnames", None)
        for family in collector.collect():
            labels = declared
            if labels is None:
                labels = tuple(dict.fromkeys(k for s in family.samples for k in s.labels))
            name = family.name + ("_total" if family.type == "counter" else "")
            shown = ", ".join(f"`{label}`" for label in labels)
            yield f"| `{name}` | {family.type} | {shown} | {_cell(family.documentation)} |"


def _collectors(registry: CollectorRegistry) -> list[Collector]:
    """The collectors registered on ``registry`` (prometheus_client keeps them privately)."""
    collectors: dict[Collector, Any] = registry._collector_to_names
    return list(collectors)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
