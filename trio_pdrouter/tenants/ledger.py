"""What each tenant holds and has been given: the numbers admission decides on, held exactly.

Rules of this module (synchronous: nothing here awaits):

* Per tenant, four numbers: ``in_flight`` (admitted requests not finished), ``queued`` (requests
  waiting for admission), ``served`` (its virtual token counter: the tokens admitted for it
  divided by its weight, in thousandths, see :func:`share`) and its **pace** (the time at which
  its token budget is used up: a token bucket kept as one time, see :meth:`TenantLedger.pace`).
* Admission changes them by deltas (:meth:`TenantLedger.change`), each counted once: a request
  adds 1 to ``queued`` when it starts waiting and takes it back when it stops waiting (admitted,
  timed out, pushed out or cancelled), adds 1 to ``in_flight`` when admitted and takes it back at
  its release. Every decision reads and changes them under :meth:`TenantLedger.locked`.
* **Virtual counters**: a tenant that was idle (nothing in flight, nothing queued) is lifted, when
  it comes back, to the smallest counter among the tenants that are not idle
  (:meth:`TenantLedger.lift`): it cannot bank credit while it asks for nothing.
* **Pace** (``tokens_per_second``): a request may start while the tenant's pace is at most one
  second ahead of now; it then moves the pace on by its cost divided by the rate. So a burst of
  one second's tokens passes, over time at most the rate, and one request larger than a second's
  budget still passes (it puts the tenant in debt for what it costs). Refused: the seconds until
  the pace is back within a second of now (``Retry-After``). A request that is not served after
  all (refused later, its client gone while queued) gives its cost back.
* :class:`TenantLedger` keeps them in this process. :class:`MachineTenantLedger` keeps them in the
  machine table (``--workers N``): one slot per tenant (its key ``tenant NAME``), each worker
  writing its own row, readers summing the rows — ``in_flight`` in the :data:`COUNT` column,
  ``queued`` in :data:`PENDING`, ``served`` in :data:`TOKENS` and the pace, in microseconds of the
  system's monotonic clock, in :data:`VERDICT`. The pace is the largest of the rows' (a worker
  that moves it writes a pace ahead of every row's), so no cell has two writers. A worker that
  dies has its row zeroed by the supervisor like its endpoint charges: its in-flight and queued
  requests no longer count, its share of ``served`` is forgotten (the tenants it served are
  favoured a little), and if it held the furthest pace the tenant's pace falls back to the next
  row's (a little more burst).
* With ``--cluster-url``, ``peers`` (:class:`~trio_pdrouter.ledger.PeerLoads`) holds the other
  replicas' published numbers: ``in_flight``, ``queued`` and ``served`` read as this replica's
  own plus the peers' latest (at most one sync interval old), so the concurrency limit and the
  shares hold across replicas within one interval. Each replica publishes only its own
  (:meth:`TenantLedger.snapshot`) and changes only its own. The pace is not shared: each replica
  keeps its own, so a tenant's ``tokens_per_second`` holds per replica.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

import trio

from ..ledger import PeerLoads
from ..machine import COUNT, PENDING, TOKENS, VERDICT, MachineTable

#: The burst a tenant's pace allows: this many seconds of its tokens.
BURST_SECONDS = 1.0
#: ``served`` counts thousandths of a token per unit of weight.
SERVED_SCALE = 1000

IN_FLIGHT, QUEUED, SERVED, PACE = COUNT, PENDING, TOKENS, VERDICT


def share(tokens: int, weight: float) -> int:
    """What ``tokens`` add to the virtual counter of a tenant of ``weight``."""
    return math.ceil(tokens * SERVED_SCALE / weight)


def _retry_after(ahead: float) -> int:
    return max(1, math.ceil(ahead - BURST_SECONDS))


class TenantLedger:
    """Every tenant's numbers in this process (see the module doc). ``clock``: seconds."""

    def __init__(
        self, clock: Callable[[], float] = trio.current_time, peers: PeerLoads | None = None
    ) -> None:
        self._clock = clock
        self._peers = peers
        self._in_flight: dict[str, int] = {}
        self._queued: dict[str, int] = {}
        self._served: dict[str, int] = {}
        self._pace: dict[str, float] = {}

    def locked(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def know(self, names: Iterable[str]) -> None:
        """The tenants of the file (a worker holds their slots: see the subclass)."""

    # -- what admission reads: this process's (or machine's) own numbers plus the peers' ----

    def in_flight(self, name: str) -> int:
        return self.own(name, IN_FLIGHT) + self._peer(name, "in_flight")

    def queued(self, name: str) -> int:
        return self.own(name, QUEUED) + self._peer(name, "queued")

    def served(self, name: str) -> int:
        return self.own(name, SERVED) + self._peer(name, "served")

    def _peer(self, name: str, field: str) -> int:
        return 0 if self._peers is None else self._peers.tenant(name, field)

    def busy(self) -> list[str]:
        """The tenants with something in flight or queued (here or at a peer)."""
        names = self._names() | (set() if self._peers is None else self._peers.tenant_names())
        return [n for n in names if self.in_flight(n) or self.queued(n)]

    # -- this process's (or machine's) own numbers ------------------------------------------

    def own(self, name: str, column: int) -> int:
        """One of the tenant's numbers (:data:`IN_FLIGHT`, :data:`QUEUED`, :data:`SERVED`)
        without the peers'."""
        table = {IN_FLIGHT: self._in_flight, QUEUED: self._queued, SERVED: self._served}[column]
        return table.get(name, 0)

    def _names(self) -> set[str]:
        return set(self._in_flight) | set(self._queued) | set(self._served)

    def change(self, name: str, in_flight: int = 0, queued: int = 0, served: int = 0) -> None:
        """Add this process's deltas."""
        for table, delta in ((self._in_flight, in_flight), (self._queued, queued)):
            if delta:
                n = table.get(name, 0) + delta
                if n < 0:
                    raise AssertionError(f"tenant {name!r} would hold {n}")
                table[name] = n
        if served:
            self._served[name] = self._served.get(name, 0) + served

    def lift(self, name: str) -> None:
        """An idle tenant comes back: up to the smallest counter of the busy ones."""
        if self.in_flight(name) or self.queued(name):
            return
        others = [self.served(n) for n in self.busy() if n != name]
        if others:
            floor = min(others)
            mine = self.served(name)
            if floor > mine:
                self.change(name, served=floor - mine)

    def pace(self, name: str, cost: int, rate: int) -> int | None:
        """Take ``cost`` tokens of a budget of ``rate`` a second: None, or the seconds to wait."""
        now = self._clock()
        ahead = max(self._pace.get(name, now), now) - now
        if ahead > BURST_SECONDS:
            return _retry_after(ahead)
        self._pace[name] = now + ahead + cost / rate
        return None

    def refund(self, name: str, cost: int, rate: int) -> None:
        """Give back what :meth:`pace` took for a request that was not served (or, ``cost``
        negative, take what a request used beyond what it was counted)."""
        if name in self._pace:
            self._pace[name] -= cost / rate

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{tenant: {"in_flight", "queued", "served"}}``, this replica's own numbers (what it
        publishes to its peers), for every tenant it knows."""
        return {
            n: {
                "in_flight": self.own(n, IN_FLIGHT),
                "queued": self.own(n, QUEUED),
                "served": self.own(n, SERVED),
            }
            for n in sorted(self._names())
        }


def tenant_key(name: str) -> str:
    """A tenant's slot in the machine table."""
    return f"tenant {name}"


class MachineTenantLedger(TenantLedger):
    """The tenants' numbers in row ``row`` of ``table``, read machine-wide (module doc)."""

    def __init__(self, table: MachineTable, row: int, peers: PeerLoads | None = None) -> None:
        super().__init__(time.monotonic, peers)
        self._table = table
        self._row = row
        self._slots: dict[str, int] = {}

    def locked(self) -> AbstractContextManager[None]:
        return self._table.locked()

    def know(self, names: Iterable[str]) -> None:
        for name in names:
            self._slot(name)

    def _slot(self, name: str) -> int:
        slot = self._slots.get(name)
        if slot is None:
            slot = self._slots[name] = self._table.hold(self._row, tenant_key(name))
        return slot

    def own(self, name: str, column: int) -> int:
        return self._table.total(self._slot(name), column)

    def _names(self) -> set[str]:
        return set(self._slots)

    def change(self, name: str, in_flight: int = 0, queued: int = 0, served: int = 0) -> None:
        slot, table, row = self._slot(name), self._table, self._row
        for column, delta in ((IN_FLIGHT, in_flight), (QUEUED, queued), (SERVED, served)):
            if delta:
                table.add(row, slot, column, delta)
        if table.cell(row, slot, IN_FLIGHT) < 0 or table.cell(row, slot, QUEUED) < 0:
            raise AssertionError(f"tenant {name!r} holds a negative count in row {row}")

    def _furthest(self, slot: int) -> int:
        return max(self._table.cell(r, slot, PACE) for r in range(self._table.rows))

    def pace(self, name: str, cost: int, rate: int) -> int | None:
        slot = self._slot(name)
        now = int(self._clock() * 1_000_000)
        with self.locked():
            ahead = max(self._furthest(slot), now) - now
            if ahead > BURST_SECONDS * 1_000_000:
                return _retry_after(ahead / 1_000_000)
            self._table.put(self._row, slot, PACE, now + ahead + math.ceil(cost * 1e6 / rate))
        return None

    def refund(self, name: str, cost: int, rate: int) -> None:
        slot = self._slot(name)
        with self.locked():
            own = self._table.cell(self._row, slot, PACE)
            self._table.put(self._row, slot, PACE, max(0, own - cost * 1_000_000 // rate))
