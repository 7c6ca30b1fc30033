"""Per-endpoint circuit breakers fed by real request outcomes (``--cb-*`` flags).

A breaker stops routing to an endpoint whose requests keep failing, then lets a little traffic
through to find out whether it recovered. It is a pure state machine: every method takes the
current time as ``now`` (seconds on any monotonic clock; the router passes
``trio.current_time()``), so tests drive it without a clock and nothing here awaits.

States and transitions (``settings`` is :class:`~trio_pdrouter.config.router.BreakerSettings`)::

    state       event      condition                                   next state
    ---------   --------   -----------------------------------------   ----------
    CLOSED      success    -                                           CLOSED     (streak cleared)
    CLOSED      failure    streak in window < failure_threshold        CLOSED
    CLOSED      failure    streak in window reaches failure_threshold  OPEN
    OPEN        time       now >= opened_at + timeout_duration_secs    HALF_OPEN
    OPEN        success    -                                           OPEN       (ignored)
    OPEN        failure    -                                           OPEN       (ignored)
    HALF_OPEN   success    successes < success_threshold               HALF_OPEN
    HALF_OPEN   success    successes reach success_threshold           CLOSED
    HALF_OPEN   failure    -                                           OPEN       (timer restarts)

    admission:  CLOSED admits; OPEN rejects; HALF_OPEN admits only while the endpoint has no
                request in flight (one trial at a time).

Details of the table:

* The *streak* is the failures since the endpoint's last success that happened within the last
  ``window_duration_secs``: vllm-router's threshold counts consecutive failures, and the window
  keeps a few failures spread over hours from adding up to an open breaker.
* ``time`` is not an event anyone sends: the first call at or after the deadline (usually the
  :meth:`Breakers.admits` of the next request) performs OPEN -> HALF_OPEN before handling its own
  event. :meth:`Breakers.state` therefore reports OPEN until that call.
* Outcomes recorded while OPEN belong to requests admitted before the breaker opened; they say
  nothing about the endpoint after the failures that opened it, so they neither close it nor
  push its deadline back.
* One trial at a time in HALF_OPEN: the breaker does not know yet whether the endpoint is back,
  and an endpoint that hangs rather than refuses would hold every request admitted to it until
  its timeout. Admitting one request at a time bounds the cost of a wrong guess to one request;
  recovery costs ``success_threshold`` sequential round trips. "In flight" is read from the load
  ledger (``in_flight=ledger.load``), which routing charges in the same synchronous step that
  chooses the endpoint, so two arrivals can never both take the trial, and a trial whose outcome
  is never recorded (its client left) still frees the slot when its lease is released.
  Requests admitted before the breaker opened count as in flight too, so a trial waits for them.

Breakers are keyed by :class:`~trio_pdrouter.endpoints.Endpoint`, so each DP rank of a URL has
its own: outcomes are recorded per rank, and one rank can fail alone (its engine died) while its
siblings serve, which a per-URL breaker would take out with it. A whole server going down fails
every rank's requests, so every rank's breaker opens after its own ``failure_threshold``; the
per-URL health check (:mod:`trio_pdrouter.fleet.health`) covers that case too.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable

from ..config import BreakerSettings
from ..endpoints import Endpoint


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


#: Called with (endpoint, old state, new state) after every transition; used by metrics.
OnChange = Callable[[Endpoint, str, str], None]

#: Requests currently in flight on an endpoint (``LoadLedger.load``).
InFlight = Callable[[Endpoint], int]


class _Breaker:
    """One endpoint's state; transitions only through :class:`Breakers`."""

    __slots__ = ("failures", "opened_at", "state", "successes")

    def __init__(self) -> None:
        self.state = BreakerState.CLOSED
        #: CLOSED: times of the current failure streak, oldest first.
        self.failures: deque[float] = deque()
        #: HALF_OPEN: consecutive successes so far.
        self.successes = 0
        #: OPEN: when it opened.
        self.opened_at = 0.0


class Breakers:
    """The circuit breakers of every endpoint, created on first use.

    ``in_flight`` gives an endpoint's current number of requests (pass ``ledger.load``);
    ``on_change`` is told about every transition. With ``settings.enabled`` false every endpoint
    is admitted and outcomes are ignored.
    """

    def __init__(
        self,
        settings: BreakerSettings,
        in_flight: InFlight,
        on_change: OnChange | None = None,
    ) -> None:
        self._settings = settings
        self._in_flight = in_flight
        self._on_change = on_change
        self._breakers: dict[Endpoint, _Breaker] = {}

    def state(self, endpoint: Endpoint) -> str:
        """``"closed"``, ``"open"`` or ``"half_open"`` as of the last call that saw the time."""
        breaker = self._breakers.get(endpoint)
        return BreakerState.CLOSED.value if breaker is None else breaker.state.value

    def admits(self, endpoint: Endpoint, now: float) -> bool:
        """May a new request go to ``endpoint``? Changes nothing but the passage of time."""
        if not self._settings.enabled:
            return True
        breaker = self._breakers.get(endpoint)
        if breaker is None:
            return True
        self._advance(endpoint, breaker, now)
        if breaker.state is BreakerState.CLOSED:
            return True
        if breaker.state is BreakerState.OPEN:
            return False
        return self._in_flight(endpoint) == 0

    def record_success(self, endpoint: Endpoint, now: float) -> None:
        if not self._settings.enabled:
            return
        breaker = self._breakers.get(endpoint)
        if breaker is None:
            return  # a CLOSED breaker with no streak: a success changes nothing
        self._advance(endpoint, breaker, now)
        if breaker.state is BreakerState.CLOSED:
            breaker.failures.clear()
        elif breaker.state is BreakerState.HALF_OPEN:
            breaker.successes += 1
            if breaker.successes >= self._settings.success_threshold:
                self._move(endpoint, breaker, BreakerState.CLOSED)

    def record_failure(self, endpoint: Endpoint, now: float) -> None:
        if not self._settings.enabled:
            return
        breaker = self._breakers.get(endpoint)
        if breaker is None:
            breaker = self._breakers[endpoint] = _Breaker()
        self._advance(endpoint, breaker, now)
        if breaker.state is BreakerState.CLOSED:
            failures = breaker.failures
            failures.append(now)
            horizon = now - self._settings.window_duration_secs
            while failures[0] < horizon:
                failures.popleft()
            if len(failures) >= self._settings.failure_threshold:
                self._open(endpoint, breaker, now)
        elif breaker.state is BreakerState.HALF_OPEN:
            self._open(endpoint, breaker, now)

    def forget(self, endpoint: Endpoint) -> None:
        """Drop a removed endpoint's breaker (no callback: the endpoint is gone)."""
        self._breakers.pop(endpoint, None)

    def _advance(self, endpoint: Endpoint, breaker: _Breaker, now: float) -> None:
        if (
            breaker.state is BreakerState.OPEN
            and now >= breaker.opened_at + self._settings.timeout_duration_secs
        ):
            self._move(endpoint, breaker, BreakerState.HALF_OPEN)

    def _open(self, endpoint: Endpoint, breaker: _Breaker, now: float) -> None:
        breaker.opened_at = now
        self._move(endpoint, breaker, BreakerState.OPEN)

    def _move(self, endpoint: Endpoint, breaker: _Breaker, new: BreakerState) -> None:
        old = breaker.state
        breaker.state = new
        breaker.failures.clear()
        breaker.successes = 0
        if self._on_change is not None:
            self._on_change(endpoint, old.value, new.value)
