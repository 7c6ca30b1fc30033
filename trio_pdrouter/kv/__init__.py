"""vLLM's KV events: what each engine's prefix cache holds, as the engines say it.

A pipeline, pure at its core: :mod:`.wire` decodes the engines' frames, :class:`Feed` puts one
engine's stream in order (gaps, replays, restarts), :class:`BlockIndex` keeps its cache's blocks,
:class:`Forecast` adds what the prompts sent to it will store. :class:`KvEvents` follows every
source over ZMQ (with ``--workers N``, :class:`KvFanout` subscribes once for the machine and fans
frames out to the workers); :func:`kv_events_for` builds it from the settings.

Contract: the index gives less credit on any doubt, never false credit. May import the config
and the endpoints; the policies read it, it never reads them.
"""

from __future__ import annotations

from .fanout import KvFanout, relay_endpoint, relayed
from .feed import Feed
from .forecast import DOUBT_BATCHES, Forecast
from .index import BlockIndex, block_keys
from .metrics import KvCollector
from .sockets import EventSource
from .sources import kv_events_for, sources_for
from .subscriber import MAX_REPLAY_BYTES, KvEvents
from .wire import (
    GPU,
    AllBlocksCleared,
    Batch,
    BlockRemoved,
    BlockStored,
    Event,
    MalformedFrame,
    decode_message,
    decode_payload,
    fold_hash,
)

__all__ = [
    "DOUBT_BATCHES",
    "GPU",
    "MAX_REPLAY_BYTES",
    "AllBlocksCleared",
    "Batch",
    "BlockIndex",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventSource",
    "Feed",
    "Forecast",
    "KvCollector",
    "KvEvents",
    "KvFanout",
    "MalformedFrame",
    "block_keys",
    "decode_message",
    "decode_payload",
    "fold_hash",
    "kv_events_for",
    "relay_endpoint",
    "relayed",
    "sources_for",
]
