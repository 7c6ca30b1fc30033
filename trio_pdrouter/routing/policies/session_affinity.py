"""``--kv-aware-session-affinity-ttl-secs``: a session stays on its engine while it keeps coming.

vllm-router 0.1.17's meaning (its ``--help``: "Enable kv_aware session affinity with an idle TTL
in seconds ... P/D uses decode-only soft affinity based on pending plus active decode requests.
Prefill remains token-cost based"), built here as:

* The session is the request's hash key (``X-Session-ID``, ``X-User-ID``, ``X-Tenant-ID``, then
  the body's ``session_id`` or ``user``: :mod:`.routing_key`). A request without one is routed
  as if affinity were off.
* :class:`SessionTable` binds a session to the endpoint ``kv_aware`` last sent it to. While the
  session's idle time (since its last request) is under the TTL, its next request goes to that
  endpoint again, unless the endpoint is no candidate now (unhealthy, breaker open, removed) or
  is *overloaded* (soft affinity, :func:`overloaded`); then ``kv_aware`` decides as without
  affinity and the session is bound to its choice. Every request of a session refreshes it.
* Only decode and regular stages are sticky: prefill's choice stays the KV-cost decision (the
  index already says where a session's prefix lives).
* Memory is bounded: at most ``max_sessions`` entries of a 16-byte digest and an endpoint; past
  it the least recently used session goes. An expired entry goes when it is looked up.
* With ``--workers N`` each worker keeps its own table (a session whose requests reach two
  workers may be bound once in each).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping

from ...endpoints import Endpoint

__all__ = ["MAX_SESSIONS", "SessionTable", "overloaded"]

#: Sessions one table remembers; past it the least recently used goes.
MAX_SESSIONS = 65_536


def _digest(session: str) -> bytes:
    return hashlib.blake2b(session.encode(), digest_size=16).digest()


class SessionTable:
    """Session -> endpoint, each entry living ``ttl`` seconds past its last use (module doc).

    ``clock`` gives the time in seconds (``trio.current_time`` in the router).
    """

    def __init__(
        self, ttl: float, clock: Callable[[], float], *, max_sessions: int = MAX_SESSIONS
    ) -> None:
        self.ttl = ttl
        self._clock = clock
        self._max = max_sessions
        self._entries: OrderedDict[bytes, tuple[Endpoint, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def home(self, session: str) -> Endpoint | None:
        """The endpoint ``session`` is bound to, if it was used less than ``ttl`` ago."""
        key = _digest(session)
        entry = self._entries.get(key)
        if entry is None:
            return None
        endpoint, last = entry
        if self._clock() - last >= self.ttl:
            del self._entries[key]
            return None
        return endpoint

    def bind(self, session: str, endpoint: Endpoint) -> None:
        """``session`` was just sent to ``endpoint``: bind it there, its idle time from now."""
        key = _digest(session)
        self._entries[key] = (endpoint, self._clock())
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def keep_only(self, endpoints: Collection[Endpoint]) -> None:
        """Forget the sessions bound to an endpoint not in ``endpoints`` (a removed server)."""
        gone = [k for k, (ep, _) in self._entries.items() if ep not in endpoints]
        for key in gone:
            del self._entries[key]


def overloaded(
    home: Endpoint,
    loads: Mapping[Endpoint, int],
    *,
    by_tokens: bool,
    prompt_tokens: int,
    abs_threshold: int,
    rel_threshold: float,
) -> bool:
    """Whether a session's ``home`` is too loaded to keep it (the soft part of the affinity).

    In requests (decode: pending plus active requests), ``cache_aware``'s unbalanced test: its
    load exceeds the least loaded candidate's by more than ``--balance-abs-threshold`` and more
    than ``--balance-rel-threshold`` times. In tokens, ``kv_aware``'s own trade: its queue is
    longer than the least loaded's by more than the whole prompt.
    """
    load, least = loads.get(home, 0), min(loads.values(), default=0)
    if by_tokens:
        return load - least > max(prompt_tokens, 1)
    return load - least > abs_threshold and load > least * rel_threshold
