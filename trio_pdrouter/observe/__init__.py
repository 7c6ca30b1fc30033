"""What the router tells its operators: Prometheus metrics, the access line, the log files.

:class:`RouterMetrics` owns the router's registry (``trio_pdrouter_*`` families, and the
collectors other subsystems register); :class:`RequestRecord` is what happened to one request as
the access line and the metrics see it; :func:`configure_logging` sends the log to stderr and,
with ``--log-dir``, to a file a day.

Contract: observes, never decides. May import the ledger (to watch it), HTTP shapes and below.
"""

from __future__ import annotations

from .log_files import DailyLogFile, configure_logging
from .metrics import CONTENT_TYPE, MetricsApp, RouterMetrics
from .record import RequestRecord, access_line

__all__ = [
    "CONTENT_TYPE",
    "DailyLogFile",
    "MetricsApp",
    "RequestRecord",
    "RouterMetrics",
    "access_line",
    "configure_logging",
]
