"""Health verdicts shared by the workers of ``--workers N``: one prober per machine.

Rules of this module: the prober (worker 0, :data:`PROBER_ROW`) writes a URL's verdict in the
:data:`~trio_pdrouter.machine.table.VERDICT` column of the URL's own slot (key ``"health URL"``) in
its own row; every worker reads it there. 0 means no verdict: the prober has not changed the URL's
state since it started, or it died and its row was zeroed, and readers keep what they have. Each
worker holds the URL's slot while its health board watches the URL (:meth:`MachineVerdicts.hold`,
:meth:`MachineVerdicts.let_go`); a URL it does not hold has no verdict to publish or read.
"""

from __future__ import annotations

from ..machine import VERDICT, MachineTable
from .health import Health

PROBER_ROW = 0
_CODES = {Health.HEALTHY: 1, Health.UNHEALTHY: 2, Health.PENDING: 3}
_HEALTH = {code: health for health, code in _CODES.items()}


def health_key(url: str) -> str:
    """The name of ``url``'s verdict slot in the machine table."""
    return f"health {url}"


class MachineVerdicts:
    """The machine's health verdicts per URL, in ``table``, seen by worker ``row``."""

    def __init__(self, table: MachineTable, row: int) -> None:
        self._table = table
        self._row = row
        self._slots: dict[str, int] = {}

    def hold(self, url: str) -> None:
        if url not in self._slots:
            self._slots[url] = self._table.hold(self._row, health_key(url))

    def let_go(self, url: str) -> None:
        if self._slots.pop(url, None) is not None:
            self._table.let_go(self._row, health_key(url))

    def publish(self, url: str, health: Health) -> None:
        slot = self._slots.get(url)
        if slot is not None:
            self._table.put(PROBER_ROW, slot, VERDICT, _CODES[health])

    def read(self, url: str) -> Health | None:
        slot = self._slots.get(url)
        return None if slot is None else _HEALTH.get(self._table.cell(PROBER_ROW, slot, VERDICT))
