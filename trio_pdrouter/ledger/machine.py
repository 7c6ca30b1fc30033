"""The load ledger of one worker among ``--workers N``: its charges in its row, loads machine-wide.

Rules of this module:

* :class:`MachineLedger` is a :class:`~trio_pdrouter.ledger.load.LoadLedger` whose every change is
  also written to this worker's row of the :class:`~trio_pdrouter.machine.table.MachineTable`, and
  whose every read (``load``, ``loads``, ``visible`` and ``visible_snapshot``, ``total``,
  ``snapshot``, ``by_role``, and the token weights: ``token_load`` and what builds on it) is the sum
  over all rows: the machine's load, whichever worker is asked. Leases, the slot states, the
  exactly-once release and the order of a change are the base class's: this class only overrides
  ``_record``, which writes each change's deltas (count, pending, tokens) to the worker's row.
* :meth:`MachineLedger.charging` is the machine lock. Routing holds it over choose-and-charge;
  releases take no lock: a release only lowers a cell of the worker's own row, and a chooser that
  reads the cell just before it chooses from a load one too high, never too low.
* Observers get the machine-wide load of the endpoint that changed. Changes made by other
  workers notify nobody here; readers that mirror loads (metrics) re-read on demand.
* What this worker itself holds (``wait_idle``, ``forget_when_idle``, the never-negative check)
  is its own row: a worker can wait only for the requests it runs.
* The worker holds an endpoint's slot (:meth:`~trio_pdrouter.machine.table.MachineTable.hold`)
  from ``add_endpoint`` until the base class forgets the endpoint (a removed server, at its last
  release here), then lets it go: a slot no worker holds goes back to the machine's pool.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager

from ..endpoints import Endpoint, Role
from ..machine import COUNT, PENDING, TOKENS, MachineTable
from .load import LoadLedger


def slot_key(endpoint: Endpoint) -> str:
    """The name of an endpoint in the machine table (one URL may serve several roles)."""
    return f"{endpoint.role.value} {endpoint.key}"


class MachineLedger(LoadLedger):
    """Row ``row`` of ``table`` (see the module doc); ``row`` is this worker's index."""

    def __init__(self, table: MachineTable, row: int, endpoints: Iterable[Endpoint] = ()) -> None:
        if not 0 <= row < table.rows:
            raise ValueError(f"row {row} is outside the table's {table.rows} rows")
        self._table = table
        self._row = row
        self._slots: dict[Endpoint, int] = {}
        super().__init__(())
        for ep in endpoints:
            self.add_endpoint(ep)

    @property
    def table(self) -> MachineTable:
        return self._table

    @property
    def row(self) -> int:
        """This worker's row (its index among the workers)."""
        return self._row

    def add_endpoint(self, endpoint: Endpoint) -> None:
        if endpoint not in self._slots:
            self._slots[endpoint] = self._table.hold(self._row, slot_key(endpoint))
        super().add_endpoint(endpoint)

    def charging(self) -> AbstractContextManager[None]:
        return self._table.locked()

    # -- machine-wide reads --------------------------------------------------------------------

    def load(self, endpoint: Endpoint) -> int:
        slot = self._slots.get(endpoint)
        return 0 if slot is None else self._table.total(slot, COUNT)

    def loads(self, endpoints: Iterable[Endpoint]) -> dict[Endpoint, int]:
        return {ep: self.load(ep) for ep in endpoints}

    def visible(self, endpoint: Endpoint) -> int:
        slot = self._slots.get(endpoint)
        if slot is None:
            return 0
        # The two columns are read one after the other while other workers write them (a
        # charge writes COUNT then PENDING): between the reads the sum can skew by a slot, so
        # the PENDING read is capped by the COUNT read, never making the visible load negative.
        count = self._table.total(slot, COUNT)
        return count - min(self._table.total(slot, PENDING), count)

    def total(self) -> int:
        return sum(self.load(ep) for ep in self._counts)

    def token_load(self, endpoint: Endpoint) -> int:
        slot = self._slots.get(endpoint)
        return 0 if slot is None else self._table.total(slot, TOKENS)

    def snapshot(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for ep in self._counts:
            out.setdefault(ep.role.value, {})[ep.key] = self.load(ep)
        return out

    def by_role(self, role: Role) -> dict[str, int]:
        return {ep.key: self.load(ep) for ep in self._counts if ep.role is role}

    def own(self, endpoint: Endpoint) -> int:
        """What this worker alone holds on ``endpoint``."""
        return self._counts.get(endpoint, 0)

    # -- this worker's row ---------------------------------------------------------------------

    def _forgotten(self, endpoint: Endpoint) -> None:
        if self._slots.pop(endpoint, None) is not None:
            self._table.let_go(self._row, slot_key(endpoint))

    def _record(self, endpoint: Endpoint, count: int, pending: int, tokens: int) -> None:
        slot = self._slots.get(endpoint)
        if slot is None:  # an endpoint leased without add_endpoint (tests, a removed server)
            self.add_endpoint(endpoint)
            slot = self._slots[endpoint]
        table, row = self._table, self._row
        if count:
            table.add(row, slot, COUNT, count)
        if pending:
            table.add(row, slot, PENDING, pending)
        if tokens:
            table.add(row, slot, TOKENS, tokens)
