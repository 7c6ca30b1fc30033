"""Health verdicts shared by the workers of ``--workers N``: one prober per machine.

Rules of this module: the prober (worker 0, :data:`PROBER_ROW`) writes a URL's verdict in the
:data:`~trio_pdrouter.machine.table.VERDICT` column of the URL's own slot (key ``"health URL"``) in
its own row; every worker reads it there. 0 means no verdict: the prober has not changed the URL's
state since it started, or it died and its row was zeroed, and readers keep what they have.
"""

from __future__ import annotations

from ..machine import VERDICT, MachineTable
from .health import Health

PROBER_ROW = 0
_CODES = {Health.HEALTHY: 1, Health.UNHEALTHY: 2, Health.PENDING: 3}
_HEALTH = {code: health for health, code in _CODES.items()}


class MachineVerdicts:
    """The machine's health verdicts per URL, in ``table`` (see the module doc)."""

    def __init__(self, table: MachineTable) -> None:
        self._table = table

    def publish(self, url: str, health: Health) -> None:
        slot = self._table.slot(f"health {url}")
        self._table.put(PROBER_ROW, slot, VERDICT, _CODES[health])

    def read(self, url: str) -> Health | None:
        slot = self._table.slot(f"health {url}")
        return _HEALTH.get(self._table.cell(PROBER_ROW, slot, VERDICT))
