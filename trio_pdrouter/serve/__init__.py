"""One inference request's life, from admission to its last byte.

:class:`Proxy` admits a request (:class:`Admission`: a bounded FIFO, the rate limit), routes it,
and runs its attempts: the prefill leg, then the decode leg (:class:`DecodeRelay` relays a stream
as it arrives; :class:`BufferedDecode` answers in one piece), with retries where nothing reached
the client. :mod:`.lifecycle` writes the request's phases and who owns the prefill's KV blocks
as tables the code follows; :class:`KvReclaimer` frees KV no decode will take. Requests the
engines would refuse (sampling caps, a prompt too long for every candidate) are refused before
any engine is touched.

Contract: every path ends with the leases released exactly once and one answer to the client.
May import the fleet, routing, the ledger and below.
"""

from __future__ import annotations

from .admission import (
    QUEUE_FULL,
    QUEUE_TIMEOUT,
    RATE_LIMITED,
    REASONS,
    TENANT_CONCURRENCY,
    TENANT_SHARE,
    TENANT_TOKENS,
    Admission,
    Rejected,
)
from .buffers import PIECE_BYTES, BufferBudget, RelayBuffer, RelayOverflow
from .context_length import ContextCheck
from .legs import BufferedDecode, PrefillLeg
from .lifecycle import (
    DECIDED,
    KV_TRANSITIONS,
    TRANSITIONS,
    Event,
    IllegalTransition,
    KvEvent,
    KvOwner,
    Lifecycle,
    Phase,
    outcome,
    successors,
)
from .proxy import Proxy
from .pump import Pump
from .rate_limit import TokenBucket
from .relay import TAKEOVER_AFTER, DecodeRelay, IdleDeadline
from .request import Attempt, Inference, Request
from .stalled import StallWatch
from .stranded import KvReclaimer

__all__ = [
    "DECIDED",
    "KV_TRANSITIONS",
    "PIECE_BYTES",
    "QUEUE_FULL",
    "QUEUE_TIMEOUT",
    "RATE_LIMITED",
    "REASONS",
    "TAKEOVER_AFTER",
    "TENANT_CONCURRENCY",
    "TENANT_SHARE",
    "TENANT_TOKENS",
    "TRANSITIONS",
    "Admission",
    "Attempt",
    "BufferBudget",
    "BufferedDecode",
    "ContextCheck",
    "DecodeRelay",
    "Event",
    "IdleDeadline",
    "IllegalTransition",
    "Inference",
    "KvEvent",
    "KvOwner",
    "KvReclaimer",
    "Lifecycle",
    "Phase",
    "PrefillLeg",
    "Proxy",
    "Pump",
    "Rejected",
    "RelayBuffer",
    "RelayOverflow",
    "Request",
    "StallWatch",
    "TokenBucket",
    "outcome",
    "successors",
]
