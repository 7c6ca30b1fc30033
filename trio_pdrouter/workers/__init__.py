"""``--workers N``: a supervisor process and N worker processes over one machine ledger.

:func:`supervise` binds the listening sockets, creates the machine table, starts a worker per
row and restarts one that dies (:class:`WorkersKeepDying` when they keep dying at start);
each worker (:mod:`.worker`, run as ``python -m``) serves the router over its row.

Contract: processes and sockets; the router inside each worker is :mod:`trio_pdrouter.server`'s.
"""

from __future__ import annotations

from .supervisor import WorkersKeepDying, supervise

__all__ = [
    "WorkersKeepDying",
    "supervise",
]
