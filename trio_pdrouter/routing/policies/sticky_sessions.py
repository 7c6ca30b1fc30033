"""The bounded session map of ``sticky_least_loaded``: session -> endpoint, and sessions per
endpoint.

* A session is the request's hash key (:mod:`.routing_key`), kept as a 16-byte digest.
* An entry lives ``ttl`` seconds past its last use; every use refreshes it. The entries are kept
  in order of last use, so the expired ones are always the oldest: :meth:`StickySessions.expire`
  drops them from the front (amortised O(1) per entry), and every lookup expires first, so the
  count of sessions per endpoint never includes an expired one.
* At most ``capacity`` entries: binding one more drops the least recently used.
* :meth:`StickySessions.finish` drops a session at once (``POST /finish_session``).
* :meth:`StickySessions.keep_only` drops the sessions of endpoints no longer configured.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection

from ...endpoints import Endpoint

__all__ = ["StickySessions", "session_digest"]


def session_digest(session: str) -> bytes:
    """The 16-byte digest a session is kept under (its text is never stored)."""
    return hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class StickySessions:
    """Session -> endpoint, bounded by ``ttl`` (idle seconds) and ``capacity`` (module doc).

    ``clock`` gives the time in seconds (``trio.current_time`` in the router).
    """

    def __init__(self, ttl: float, capacity: int, clock: Callable[[], float]) -> None:
        if ttl <= 0 or capacity < 1:
            raise ValueError(f"a session map needs a positive ttl and capacity: {ttl}, {capacity}")
        self.ttl = ttl
        self.capacity = capacity
        self._clock = clock
        self._entries: OrderedDict[bytes, tuple[Endpoint, float]] = OrderedDict()
        self._bound: Counter[Endpoint] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def bound(self, endpoint: Endpoint) -> int:
        """How many live sessions ``endpoint`` holds (call :meth:`expire` first for "now")."""
        return self._bound[endpoint]

    def expire(self) -> int:
        """Drop every entry idle ``ttl`` or more; return how many went."""
        deadline = self._clock() - self.ttl
        entries = self._entries
        gone = 0
        while entries:
            key, (endpoint, last) = next(iter(entries.items()))
            if last > deadline:
                break
            del entries[key]
            self._unbind(endpoint)
            gone += 1
        return gone

    def home(self, session: str) -> Endpoint | None:
        """The endpoint ``session`` is bound to, if it was used less than ``ttl`` ago."""
        self.expire()
        entry = self._entries.get(session_digest(session))
        return None if entry is None else entry[0]

    def bind(self, session: str, endpoint: Endpoint) -> None:
        """``session`` was just sent to ``endpoint``: bind it there, idle from now."""
        key = session_digest(session)
        old = self._entries.pop(key, None)
        if old is not None:
            self._unbind(old[0])
        self._entries[key] = (endpoint, self._clock())
        self._bound[endpoint] += 1
        while len(self._entries) > self.capacity:
            _, (dropped, _) = self._entries.popitem(last=False)
            self._unbind(dropped)

    def finish(self, session: str) -> bool:
        """Forget ``session``; False when it was not bound."""
        old = self._entries.pop(session_digest(session), None)
        if old is None:
            return False
        self._unbind(old[0])
        return True

    def keep_only(self, endpoints: Collection[Endpoint]) -> None:
        """Forget the sessions bound to an endpoint not in ``endpoints`` (a removed server)."""
        gone = [k for k, (ep, _) in self._entries.items() if ep not in endpoints]
        for key in gone:
            endpoint, _ = self._entries.pop(key)
            self._unbind(endpoint)

    def _unbind(self, endpoint: Endpoint) -> None:
        left = self._bound[endpoint] - 1
        if left > 0:
            self._bound[endpoint] = left
        else:
            del self._bound[endpoint]
