"""What the processes of one machine share with ``--workers N``: shared memory and its lock.

:class:`MachineTable` is one shared-memory block the supervisor creates: a row of load cells per
worker (the machine ledger reads every row and writes its own), the servers' change log,
shared health verdicts, and two regions of single-writer rings (:mod:`.ring`): the workers'
recent prefix-tree inserts (:class:`PrefixRing`) and their prompts in flight
(:class:`RouteRing`), so each worker's policies learn what the others routed. Writers never wait
for readers; a reader that falls behind loses hints, never correctness.

Contract: layouts and bytes only, no knowledge of requests or policies; the code that reads or
writes a region is the module that owns its layout. Imports nothing else of the router.
"""

from __future__ import annotations

from .prefix_ring import PrefixRing
from .ring import STAGES
from .route_ring import RouteRing
from .table import (
    COUNT,
    DEFAULT_LOG_ENTRIES,
    DEFAULT_SLOTS,
    HELD,
    PENDING,
    TOKENS,
    VERDICT,
    Changes,
    MachineTable,
    TableFull,
)

__all__ = [
    "COUNT",
    "DEFAULT_LOG_ENTRIES",
    "DEFAULT_SLOTS",
    "HELD",
    "PENDING",
    "STAGES",
    "TOKENS",
    "VERDICT",
    "Changes",
    "MachineTable",
    "PrefixRing",
    "RouteRing",
    "TableFull",
]
