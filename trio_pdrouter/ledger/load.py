"""The load ledger: how many requests, and how many tokens, each endpoint is serving, exactly.

Rules of this module (everything that changes a counter lives here):

* A counter moves only through a :class:`Lease`. :meth:`LoadLedger.lease` charges every endpoint
  it is given, synchronously, so a caller that chose endpoints from :meth:`LoadLedger.loads` and
  leases them in the same synchronous step leaves no checkpoint in which another request could
  choose from stale loads, and no checkpoint at which a cancellation could skip the charge.
* Each endpoint held by a lease is released exactly once. The states of one held slot::

      PENDING --sent()--> CHARGED --release()--> RELEASED   (counter -1)
      PENDING --release()----------------------> RELEASED   (counter -1)
      CHARGED/RELEASED --sent()--> unchanged;  RELEASED --release()--> RELEASED  (no-ops)

  Every state but RELEASED counts in the load. PENDING marks a decode slot charged at choice
  whose request has not been sent yet (its prefill is running): the engine cannot see it, so
  :meth:`LoadLedger.visible` leaves it out when the router's load is compared with the engine's.
  ``Lease.__exit__``/``__aexit__`` release every slot not yet RELEASED and do so before any
  await, so no exception or cancellation can leave a slot charged once the ``with`` block is
  left, and no path can release twice.
* Beside each count the ledger keeps a token weight (:meth:`LoadLedger.token_load`): each held
  slot carries the weight it was leased with (the request's estimated tokens on that endpoint,
  see :mod:`trio_pdrouter.ledger.cost`), added when the slot is charged and subtracted when it is
  RELEASED, in the same call as the count. So a weight moves exactly when its count does, and both
  return to 0 together; PENDING changes neither.
* A slot may carry a callback (``on_release``) that runs right after its RELEASED change, so
  it too runs exactly once on every path: ``kv_aware`` learns when a prompt it forecast has
  left the prefill engine (:mod:`trio_pdrouter.kv.forecast`). It must not raise.
* Every change goes through ``_change`` (and ``_sent``), which ends in the ``_record`` hook:
  a subclass that mirrors the ledger elsewhere (the machine ledger's shared row) overrides only
  that hook, and ``_forgotten``, told when a removed endpoint's counters are dropped.
* The ledger is never reset by timers or health checks; an endpoint removed from routing keeps its
  counter until its last lease is released, so an in-flight request always releases what it took.

Theory of operation for a PD request (docs/design.md, "The load ledger")::

    lease = ledger.lease(prefill_ep, decode_ep, pending=(decode_ep,),  # chosen and charged
                         tokens={prefill_ep: uncached_prompt, decode_ep: prompt + max_tokens})
    async with lease:
        ...prefill leg...; lease.release(prefill_ep)   # body read, failed or cancelled
        lease.sent(decode_ep)                          # the decode leg goes out
        ...decode relay...; lease.release(decode_ep)   # upstream EOF, error, or client gone
    # anything still charged is released here
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from types import TracebackType

import trio

from ..endpoints import Endpoint, Role

#: Called with (endpoint, new count) after every change; used by metrics.
Observer = Callable[[Endpoint, int], None]


class LoadLedger:
    """Per-endpoint in-flight counters."""

    def __init__(self, endpoints: Iterable[Endpoint] = ()) -> None:
        self._counts: dict[Endpoint, int] = {ep: 0 for ep in endpoints}
        self._pending: dict[Endpoint, int] = {}
        self._tokens: dict[Endpoint, int] = {}
        self._observers: list[Observer] = []
        self._visible_observers: list[Observer] = []
        self._idle_waiters: dict[Endpoint, trio.Event] = {}
        #: Removed endpoints still held by leases: forgotten at their last release.
        self._retired: set[Endpoint] = set()

    def add_endpoint(self, endpoint: Endpoint) -> None:
        self._retired.discard(endpoint)  # removed while busy, added back: keep counting it
        self._counts.setdefault(endpoint, 0)

    def forget_when_idle(self, endpoint: Endpoint) -> None:
        """Drop a removed endpoint's counter now if nothing holds it, else at its last release."""
        if self._counts.get(endpoint, 0) == 0:
            if self._counts.pop(endpoint, None) is not None:
                self._forgotten(endpoint)
        else:
            self._retired.add(endpoint)

    async def wait_idle(self, endpoints: Iterable[Endpoint]) -> None:
        """Return once nothing holds any of ``endpoints`` (used to drain a removed server)."""
        for ep in endpoints:
            while self._counts.get(ep, 0):
                event = self._idle_waiters.setdefault(ep, trio.Event())
                await event.wait()

    def observe(self, observer: Observer) -> None:
        """Call ``observer(endpoint, load)`` after every change of an endpoint's load."""
        self._observers.append(observer)

    def observe_visible(self, observer: Observer) -> None:
        """Call ``observer(endpoint, visible)`` after every change of :meth:`visible`."""
        self._visible_observers.append(observer)

    def visible(self, endpoint: Endpoint) -> int:
        """Load the engine can see: the slots whose request has been sent."""
        return self._counts.get(endpoint, 0) - self._pending.get(endpoint, 0)

    def visible_loads(self, endpoints: Iterable[Endpoint]) -> dict[Endpoint, int]:
        return {ep: self.visible(ep) for ep in endpoints}

    def load(self, endpoint: Endpoint) -> int:
        return self._counts.get(endpoint, 0)

    def loads(self, endpoints: Iterable[Endpoint]) -> dict[Endpoint, int]:
        counts = self._counts
        return {ep: counts.get(ep, 0) for ep in endpoints}

    def total(self) -> int:
        return sum(self._counts.values())

    def token_load(self, endpoint: Endpoint) -> int:
        """The token weight of every slot held on ``endpoint``."""
        return self._tokens.get(endpoint, 0)

    def token_loads(self, endpoints: Iterable[Endpoint]) -> dict[Endpoint, int]:
        return {ep: self.token_load(ep) for ep in endpoints}

    def token_total(self) -> int:
        return sum(self.token_load(ep) for ep in self._counts)

    def token_snapshot(self) -> dict[str, dict[str, int]]:
        """:meth:`snapshot`'s shape with token weights instead of counts."""
        out: dict[str, dict[str, int]] = {}
        for ep in self._counts:
            out.setdefault(ep.role.value, {})[ep.key] = self.token_load(ep)
        return out

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{"prefill": {key: n}, "decode": {...}}`` (or ``"regular"``), as ``/get_loads``."""
        out: dict[str, dict[str, int]] = {}
        for ep, n in self._counts.items():
            out.setdefault(ep.role.value, {})[ep.key] = n
        return out

    def visible_snapshot(self) -> dict[str, dict[str, int]]:
        """:meth:`snapshot`'s shape with the :meth:`visible` loads (PENDING slots left out)."""
        out: dict[str, dict[str, int]] = {}
        for ep in self._counts:
            out.setdefault(ep.role.value, {})[ep.key] = self.visible(ep)
        return out

    def by_role(self, role: Role) -> dict[str, int]:
        return {ep.key: n for ep, n in self._counts.items() if ep.role is role}

    def charging(self) -> AbstractContextManager[None]:
        """Held around a choose-and-charge step. One process needs nothing (trio runs one task
        at a time and the step has no checkpoint); the machine ledger takes its lock here."""
        return _NOTHING_TO_HOLD

    def lease(
        self,
        *endpoints: Endpoint,
        pending: Iterable[Endpoint] = (),
        tokens: Mapping[Endpoint, int] | None = None,
        on_release: Mapping[Endpoint, Callable[[], None]] | None = None,
    ) -> Lease:
        """Charge each endpoint now and return the lease that will release them.

        Endpoints also named in ``pending`` start PENDING: charged, their request not yet sent.
        ``tokens`` gives an endpoint's token weight (0 when absent); a negative one is refused.
        ``on_release`` gives an endpoint's callback, run once when its slot is released.
        """
        pending = [ep for ep in pending if ep in endpoints]
        weights = [0 if tokens is None else tokens.get(ep, 0) for ep in endpoints]
        if any(w < 0 for w in weights):
            raise ValueError(f"token weights must be 0 or more: {weights}")
        for ep, weight in zip(endpoints, weights, strict=True):
            self._change(ep, +1, weight, pending=ep in pending)
        return Lease(self, endpoints, pending, weights, on_release)

    def _change(self, endpoint: Endpoint, delta: int, tokens: int, *, pending: bool) -> None:
        """One slot charged (``delta`` +1, ``tokens`` its weight) or released (-1, -weight)."""
        n = self._counts.get(endpoint, 0) + delta
        weight = self._tokens.get(endpoint, 0) + tokens
        if n < 0 or weight < 0 or (n == 0 and weight):  # pragma: no cover - a broken invariant
            raise AssertionError(f"load of {endpoint} would be {n} requests, {weight} tokens")
        self._counts[endpoint] = n
        self._tokens[endpoint] = weight
        if pending:
            self._pending[endpoint] = self._pending.get(endpoint, 0) + delta
        self._record(endpoint, delta, delta if pending else 0, tokens)
        if n == 0:
            if endpoint in self._idle_waiters:
                self._idle_waiters.pop(endpoint).set()
            if endpoint in self._retired:
                self._retired.discard(endpoint)
                del self._counts[endpoint]
                self._pending.pop(endpoint, None)
                self._tokens.pop(endpoint, None)
                self._forgotten(endpoint)
        if self._observers:
            load = self.load(endpoint)
            for observer in self._observers:
                observer(endpoint, load)
        if not pending:
            self._notify_visible(endpoint)

    def _sent(self, endpoint: Endpoint) -> None:
        self._pending[endpoint] -= 1
        self._record(endpoint, 0, -1, 0)
        self._notify_visible(endpoint)

    def _record(self, endpoint: Endpoint, count: int, pending: int, tokens: int) -> None:
        """Told every change (deltas) after this ledger applied it; mirrors override it."""

    def _forgotten(self, endpoint: Endpoint) -> None:
        """Told when a removed endpoint's counters are dropped; mirrors override it."""

    def _notify_visible(self, endpoint: Endpoint) -> None:
        if self._visible_observers:
            visible = self.visible(endpoint)
            for observer in self._visible_observers:
                observer(endpoint, visible)


_NOTHING_TO_HOLD = contextlib.nullcontext()


class Lease:
    """The right to one unit of load (and its token weight) on each of a few endpoints,
    released exactly once each.

    Use it as a (sync or async) context manager so that leaving the block releases whatever is
    still held; release individual endpoints earlier with :meth:`release` as their legs end.
    """

    __slots__ = ("_held", "_ledger", "_on_release", "_pending", "_weights")

    def __init__(
        self,
        ledger: LoadLedger,
        endpoints: Iterable[Endpoint],
        pending: Iterable[Endpoint],
        weights: Iterable[int],
        on_release: Mapping[Endpoint, Callable[[], None]] | None = None,
    ) -> None:
        self._ledger = ledger
        self._held: list[Endpoint] = list(endpoints)
        self._pending: list[Endpoint] = list(pending)
        #: The token weight of each held slot, in ``_held``'s order.
        self._weights: list[int] = list(weights)
        self._on_release = dict(on_release) if on_release else None

    def sent(self, endpoint: Endpoint) -> None:
        """PENDING -> CHARGED: the request to ``endpoint`` is going out now."""
        if endpoint in self._pending:
            self._pending.remove(endpoint)
            self._ledger._sent(endpoint)

    def release(self, endpoint: Endpoint) -> None:
        """PENDING/CHARGED -> RELEASED for ``endpoint``; a no-op if it was already released."""
        try:
            at = self._held.index(endpoint)
        except ValueError:
            return
        del self._held[at]
        weight = self._weights.pop(at)
        pending = endpoint in self._pending
        if pending:
            self._pending.remove(endpoint)
        self._ledger._change(endpoint, -1, -weight, pending=pending)
        if self._on_release is not None:
            callback = self._on_release.pop(endpoint, None)
            if callback is not None:
                callback()

    def release_all(self) -> None:
        while self._held:
            self.release(self._held[-1])

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release_all()

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # No await before (or after) the release: a cancelled scope cannot interrupt it.
        self.release_all()
