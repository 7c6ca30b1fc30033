"""``sticky_least_loaded``: a new session goes to the least loaded endpoint, and stays there.

vllm-router 0.1.17's policy of that name. Read in its source (github.com/vllm-project/router,
``src/policies/sticky_least_loaded.rs`` at commits 335c57e2 and 861c578e, and
``src/policies/hash_key.rs``) and watched in the 0.1.17 wheel against the simulators (its log
lines name a later revision, which also drops an idle session when it is looked up). There a
session is bound to the endpoint with the fewest sessions bound (ties: a rendezvous hash), kept
while that endpoint is healthy and configured, dropped 2 hours after its last request (swept once
a minute) or by ``POST /finish_session?session_id=ID``; prefill and decode keep separate maps.
Built here as:

* **The session** is the request's hash key (``X-Session-ID``, ``X-User-ID``, ``X-Tenant-ID``,
  then the body's ``session_id`` or ``user``: :mod:`.routing_key`), as ``consistent_hash`` and
  ``kv_aware``'s session affinity read it. (vllm-router 0.1.17 reads headers only for this
  policy, and also ``X-Correlation-ID``, ``X-Request-ID`` and ``X-Trace-ID``: a per-request id
  would make each request a session of its own.)
* **A bound session** goes to its endpoint while that endpoint is a candidate, whatever the
  loads: the stickiness is hard, as in vllm-router (no overload escape; ``kv_aware`` with
  ``--kv-aware-session-affinity-ttl-secs`` is the soft kind). Every request refreshes it.
* **A new session**, or one whose endpoint is no candidate now (unhealthy, breaker open,
  removed, or failed in an earlier attempt of this request), goes to the candidate with the
  least load in the stage's metric (the ledger's exact in-flight count or token weight, which is
  where this differs from vllm-router, whose load is the number of sessions bound); ties go to
  the fewest sessions bound, then to the highest rendezvous hash of session and endpoint, so a
  session meeting equal candidates picks the same one in every process. It is then bound there.
* **A request without a session** goes to the least loaded candidate (ties: fewest sessions,
  then at random) and binds nothing.
* **Memory** (:class:`~.sticky_sessions.StickySessions`): an entry lives
  ``--sticky-session-ttl-secs`` past its last use (vllm-router: 2 hours, or its
  ``VLLM_ROUTER_SLL_SESSION_EXPIRATION_IN_S``), at most ``--sticky-max-sessions`` per stage (the
  least recently used goes; vllm-router has no bound); ``POST /finish_session?session_id=ID``
  drops one at once.
* **PD mode**: prefill and decode each run their own policy, so each keeps its own map, as in
  vllm-router; ``/finish_session`` drops the session from both.
* **``--workers N``**: each worker process keeps its own map. The ledger the loads come from is
  the machine's, but a session whose requests reach two workers (they arrive on different
  connections) may be bound once in each, to different endpoints when the loads changed between
  its first requests there; a ``/finish_session`` reaches only the worker that answers it (the
  others drop the session after the TTL). Several replicas likewise keep a map each.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence

from ...endpoints import Endpoint
from ._base import DecisionObserver, RoutingKey
from .sticky_sessions import StickySessions

__all__ = ["REASONS", "StickyLeastLoaded"]


def _rendezvous(session: str, endpoint: Endpoint) -> bytes:
    return hashlib.blake2b(
        f"{session}\0{endpoint.key}".encode("utf-8", "surrogatepass"), digest_size=8
    ).digest()


#: The reasons of its decisions (``trio_pdrouter_policy_decisions_total``): a bound session sent
#: to its endpoint, a new one placed, a bound one placed again (its endpoint no candidate), a
#: request without a session.
REASONS = ("session_kept", "session_placed", "session_moved", "no_session")


class StickyLeastLoaded:
    """See the module doc; ``sessions`` is this stage's session map, ``on_decision`` is told
    ``(stage, reason)`` of every decision (:data:`REASONS`)."""

    name = "sticky_least_loaded"

    def __init__(
        self,
        rng: random.Random,
        sessions: StickySessions,
        *,
        stage: str = "regular",
        on_decision: DecisionObserver | None = None,
    ) -> None:
        self._rng = rng
        self.sessions = sessions
        self._stage = stage
        self._on_decision = on_decision

    def choose(
        self, candidates: Sequence[Endpoint], loads: Mapping[Endpoint, int], key: RoutingKey
    ) -> Endpoint:
        sessions = self.sessions
        session = key.hash_key
        if session is None:
            sessions.expire()
            tied = self._least_loaded(candidates, loads)
            self._decided("no_session")
            return tied[0] if len(tied) == 1 else self._rng.choice(tied)
        home = sessions.home(session)  # expires first
        if home is not None and home in candidates:
            sessions.bind(session, home)  # refreshes it
            self._decided("session_kept")
            return home
        tied = self._least_loaded(candidates, loads)
        chosen = tied[0] if len(tied) == 1 else max(tied, key=lambda c: _rendezvous(session, c))
        sessions.bind(session, chosen)
        self._decided("session_placed" if home is None else "session_moved")
        return chosen

    def _decided(self, reason: str) -> None:
        if self._on_decision is not None:
            self._on_decision(self._stage, reason)

    def _least_loaded(
        self, candidates: Sequence[Endpoint], loads: Mapping[Endpoint, int]
    ) -> list[Endpoint]:
        """The candidates of least load and, among those, fewest sessions bound."""
        best = min(loads.get(c, 0) for c in candidates)
        tied = [c for c in candidates if loads.get(c, 0) == best]
        if len(tied) > 1:
            bound = self.sessions.bound
            fewest = min(bound(c) for c in tied)
            tied = [c for c in tied if bound(c) == fewest]
        return tied

    def finish(self, session: str) -> bool:
        """Forget ``session`` (``POST /finish_session``); False when it was not bound."""
        return self.sessions.finish(session)

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        self.sessions.keep_only(frozenset(endpoints))

    def maintain(self) -> bool:
        self.sessions.expire()
        return False
