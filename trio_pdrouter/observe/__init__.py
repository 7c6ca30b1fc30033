"""What the router tells its operators: Prometheus metrics, the access line, the log files.

:class:`RouterMetrics` owns the router's registry (``trio_pdrouter_*`` families, and the
collectors other subsystems register); :class:`RequestRecord` is what happened to one request as
the access line and the metrics see it; :func:`configure_logging` sends the log to stderr and,
with ``--log-dir``, to a file a day, as text or (``--log-format json``) one JSON object a line;
:func:`tracing_for` makes the OpenTelemetry spans of ``--otlp-traces-endpoint``.

Contract: observes, never decides. May import the ledger (to watch it), HTTP shapes and below.
"""

from __future__ import annotations

from .json_log import ACCESS, JsonLines
from .log_files import DailyLogFile, configure_logging
from .metrics import CONTENT_TYPE, MetricsApp, RouterMetrics
from .record import RequestRecord, access_fields, access_line
from .tracing import (
    LegTrace,
    RequestTrace,
    Tracing,
    TracingUnavailable,
    check_tracing_available,
    tracing_for,
)
from .usage import usage_of

__all__ = [
    "ACCESS",
    "CONTENT_TYPE",
    "DailyLogFile",
    "JsonLines",
    "LegTrace",
    "MetricsApp",
    "RequestRecord",
    "RequestTrace",
    "RouterMetrics",
    "Tracing",
    "TracingUnavailable",
    "access_fields",
    "access_line",
    "check_tracing_available",
    "configure_logging",
    "tracing_for",
    "usage_of",
]
