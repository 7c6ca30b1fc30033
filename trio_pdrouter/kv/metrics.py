"""The KV-event subscriber's Prometheus metrics, read from its feeds at scrape time.

Per engine and DP rank (label ``endpoint``, ``url`` or ``url@rank``):

* ``trio_pdrouter_kv_events_total``: events applied (live and replayed);
* ``trio_pdrouter_kv_event_gaps_total``, ``trio_pdrouter_kv_event_replays_total``,
  ``trio_pdrouter_kv_event_restarts_total``: sequence gaps seen, replays done, publisher
  restarts seen;
* ``trio_pdrouter_kv_event_decode_errors_total``: malformed frames (counted, then ignored);
* ``trio_pdrouter_kv_index_blocks``: blocks indexed; ``trio_pdrouter_kv_index_evicted_total``:
  entries dropped to keep within the budget; ``trio_pdrouter_kv_index_skipped_total``: stores
  not indexed (LoRA, multimodal, unknown parent, ...);
* ``trio_pdrouter_kv_state_unknown``: 1 while the index is not known to be exact (the policy
  then uses its estimate for that engine).

Nothing is counted twice: the numbers live on the feeds, this only reads them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .subscriber import KvEvents

_P = "trio_pdrouter_"


class KvCollector(Collector):
    """Exposes one :class:`~trio_pdrouter.kv.subscriber.KvEvents`' counts (register it on a
    registry)."""

    def __init__(self, events: KvEvents) -> None:
        self._events = events

    def collect(self) -> Iterator[Metric]:
        rows = self._events.snapshot()
        counters = {
            "events": ("kv_events", "KV events applied, live and replayed."),
            "gaps": ("kv_event_gaps", "Gaps in an engine's event sequence numbers."),
            "replays": ("kv_event_replays", "Replays of an engine's buffered events."),
            "restarts": ("kv_event_restarts", "Publisher restarts seen (seq went back)."),
            "decode_errors": ("kv_event_decode_errors", "Malformed KV-event frames ignored."),
            "evicted": ("kv_index_evicted", "Index entries dropped to keep within the budget."),
            "skipped": ("kv_index_skipped", "Stored blocks not indexed (LoRA, unknown parent)."),
        }
        for field, (name, doc) in counters.items():
            family = CounterMetricFamily(_P + name, doc, labels=["endpoint"])
            for row in rows:
                family.add_metric([_key(row)], float(row[field]))  # type: ignore[arg-type]
            yield family
        blocks = GaugeMetricFamily(
            _P + "kv_index_blocks", "Blocks in an engine's KV index.", labels=["endpoint"]
        )
        unknown = GaugeMetricFamily(
            _P + "kv_state_unknown",
            "1 while an engine's KV index is not known to be exact.",
            labels=["endpoint"],
        )
        for row in rows:
            blocks.add_metric([_key(row)], float(row["blocks"]))  # type: ignore[arg-type]
            unknown.add_metric([_key(row)], 0.0 if row["known"] else 1.0)
        yield blocks
        yield unknown


def _key(row: dict[str, object]) -> str:
    return str(row["endpoint"])
