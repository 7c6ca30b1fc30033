"""Load, exactly: what each endpoint is serving, held by leases released once on every path.

:class:`LoadLedger` counts requests and token weights per endpoint; a :class:`Lease` is the async
context manager that holds a charge and releases it in its ``__aexit__`` before any await, so
no cancellation can skip or repeat it. :mod:`.cost` estimates what one request costs an
endpoint before it is routed. With ``--workers N`` a worker's :class:`MachineLedger` writes its
charges to its row of the machine table and reads loads machine-wide; with ``--cluster-url``
:class:`PeerLoads` holds the other replicas' latest snapshots and :class:`ClusterSync` exchanges
them through Redis/Valkey.

Contract: synchronous charge and release; nothing here chooses. May import the config, the
machine table and the endpoints.
"""

from __future__ import annotations

from .cluster_sync import (
    EXCHANGE,
    KEY_PREFIX,
    MAX_BACKOFF,
    MEMBERS,
    ClusterSync,
    connect,
    exchange_timeout,
)
from .cost import (
    CAPS,
    DEFAULT_OUTPUT_TOKENS,
    TOKEN_MARK,
    output_tokens,
    prompt_tokens,
    token_count,
    uncached,
)
from .load import Lease, LoadLedger
from .machine import MachineLedger, slot_key
from .replicas import PeerLoads, Snapshot, cluster_view

__all__ = [
    "CAPS",
    "DEFAULT_OUTPUT_TOKENS",
    "EXCHANGE",
    "KEY_PREFIX",
    "MAX_BACKOFF",
    "MEMBERS",
    "TOKEN_MARK",
    "ClusterSync",
    "Lease",
    "LoadLedger",
    "MachineLedger",
    "PeerLoads",
    "Snapshot",
    "cluster_view",
    "connect",
    "exchange_timeout",
    "output_tokens",
    "prompt_tokens",
    "slot_key",
    "token_count",
    "uncached",
]
