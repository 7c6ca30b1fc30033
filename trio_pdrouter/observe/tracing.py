"""Tracing: a SERVER span per request and a CLIENT span per upstream call, exported over
OTLP/HTTP (``--otlp-traces-endpoint``, vLLM's own flag name).

Off by default, and then free: :func:`tracing_for` returns None, the request path checks for
None once per request and once per leg, and the OpenTelemetry SDK is never imported. On, the
SDK (the ``otel`` extra) is loaded by :mod:`.otel`:

* a request's span joins the client's ``traceparent`` (and ``tracestate``) when it sends one;
* each upstream call (prefill, decode, every retry, a reclaim of stranded KV) gets a CLIENT span
  under it, and the ``traceparent`` the engine receives carries that span, so a vLLM engine
  started with ``--otlp-traces-endpoint`` hangs its own spans under the leg that called it;
* ``--otlp-traces-sample-ratio`` samples new traces (a client's sampled flag is obeyed);
* the standard ``OTEL_*`` variables configure the exporter and the batching
  (``OTEL_EXPORTER_OTLP_TRACES_HEADERS``, ``OTEL_SERVICE_NAME``, ``OTEL_BSP_*``, ...);
* spans are queued in memory and exported by the SDK's batch processor in a thread of its own:
  an export that is slow or fails never blocks or fails a request (a full queue drops spans).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from ..endpoints import Endpoint

if TYPE_CHECKING:
    from .record import RequestRecord

#: Attribute values the spans carry.
Value = str | bool | int | float


class LegTrace(Protocol):
    """One upstream call's CLIENT span."""

    #: The ``traceparent`` header the engine gets: this span's context.
    traceparent: str

    def end(self, outcome: str) -> None:
        """End the span (once; later calls do nothing)."""


class RequestTrace(Protocol):
    """One request's SERVER span."""

    def leg(self, stage: str, endpoint: Endpoint, attempt: int) -> LegTrace:
        """A CLIENT span for a call to ``endpoint`` (started now, under the request's)."""

    def note(self, name: str, value: Value) -> None:
        """Set an attribute on the request's span."""

    def end(self, record: RequestRecord) -> None:
        """End the span with what the request's record says."""


class Tracing(Protocol):
    """Where spans come from (:class:`~trio_pdrouter.observe.otel.OtelTracing`)."""

    def request(self, route: str, headers: Mapping[str, str]) -> RequestTrace:
        """A SERVER span for a request, joined to the client's ``traceparent`` if any."""

    def flush(self) -> None:
        """Export what is queued (blocking: call it in a thread)."""

    def shutdown(self) -> None:
        """Flush and stop the exporter (blocking: call it in a thread)."""


class TracingUnavailable(Exception):
    """Tracing was asked for, but the OpenTelemetry SDK is not installed."""


def check_tracing_available() -> None:
    """Raise :class:`TracingUnavailable` unless the SDK and its OTLP/HTTP exporter import."""
    try:
        from . import otel  # noqa: F401
    except ImportError as exc:
        raise TracingUnavailable(
            f"--otlp-traces-endpoint needs the OpenTelemetry SDK ({exc.name} is missing):"
            " pip install 'trio-pdrouter[otel]'"
        ) from None


def tracing_for(
    endpoint: str | None, sample_ratio: float, attributes: Mapping[str, Value]
) -> Tracing | None:
    """The tracing the settings ask for: None without an endpoint (nothing imported), else the
    SDK's, with ``attributes`` on every request span (mode, policies)."""
    if endpoint is None:
        return None
    check_tracing_available()
    from .otel import OtelTracing

    return OtelTracing(endpoint, sample_ratio, attributes)
