"""The OpenTelemetry SDK behind :mod:`.tracing` (imported only when tracing is on).

One :class:`~opentelemetry.sdk.trace.TracerProvider` per process (each worker of ``--workers N``
has its own, made after its process started, so no exporter thread crosses a fork), not
installed as the global provider: the router hands spans their parents explicitly, never through
the SDK's context. Its :class:`~opentelemetry.sdk.trace.export.BatchSpanProcessor` queues ended
spans (``span.end()`` appends under a lock, it never waits on the network) and exports them in
its own thread over OTLP/HTTP; a failed export is logged by the SDK and dropped.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..endpoints import Endpoint

#: Attribute values the spans carry (as :data:`.tracing.Value`, which this module cannot
#: import: :mod:`.tracing` loads this one).
Value = str | bool | int | float

if TYPE_CHECKING:
    from .record import RequestRecord

_PROPAGATOR = TraceContextTextMapPropagator()


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: ``endpoint`` as given, or with ``/v1/traces`` when it names no
    path (``http://collector:4318``)."""
    return endpoint if urlsplit(endpoint).path.strip("/") else endpoint.rstrip("/") + "/v1/traces"


class OtelLeg:
    """A CLIENT span for one upstream call."""

    __slots__ = ("_span", "traceparent")

    def __init__(self, span: Span) -> None:
        self._span = span
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=set_span_in_context(span))
        self.traceparent = carrier.get("traceparent", "")

    def end(self, outcome: str) -> None:
        span = self._span
        if not span.is_recording():
            return
        span.set_attribute("trio_pdrouter.outcome", outcome)
        if outcome != "ok":
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end()


class OtelRequest:
    """A SERVER span for one request."""

    __slots__ = ("_context", "_provider", "_span")

    def __init__(self, provider: OtelTracing, span: Span) -> None:
        self._provider = provider
        self._span = span
        self._context = set_span_in_context(span)

    def leg(self, stage: str, endpoint: Endpoint, attempt: int) -> OtelLeg:
        where = urlsplit(endpoint.url)
        attributes: dict[str, Value] = {
            "trio_pdrouter.stage": stage,
            "trio_pdrouter.endpoint": endpoint.key,
            "trio_pdrouter.attempt": attempt,
            "server.address": where.hostname or "",
            "server.port": where.port or 0,
        }
        if endpoint.rank is not None:
            attributes["trio_pdrouter.rank"] = endpoint.rank
        span = self._provider.tracer.start_span(
            stage, context=self._context, kind=SpanKind.CLIENT, attributes=attributes
        )
        return OtelLeg(span)

    def note(self, name: str, value: Value) -> None:
        self._span.set_attribute(name, value)

    def end(self, record: RequestRecord) -> None:
        span = self._span
        if not span.is_recording():
            return
        values: dict[str, Value | None] = {
            "http.response.status_code": record.status,
            "trio_pdrouter.outcome": record.outcome,
            "trio_pdrouter.stream": record.stream,
            "trio_pdrouter.request_id": record.request_id,
            "gen_ai.request.model": record.model,
            "trio_pdrouter.prefill": record.prefill,
            "trio_pdrouter.decode": record.decode,
            "trio_pdrouter.retries": record.retries,
            "trio_pdrouter.ttft_ms": record.ttfb_ms,
            "trio_pdrouter.prefill_ms": record.prefill_ms,
            "gen_ai.usage.input_tokens": record.prompt_tokens,
            "gen_ai.usage.output_tokens": record.completion_tokens,
            "trio_pdrouter.kv": record.kv,
            "trio_pdrouter.failed_stage": record.failed_stage,
            "trio_pdrouter.cause": record.cause,
        }
        span.set_attributes({k: v for k, v in values.items() if v is not None})
        if record.failed:
            span.set_status(Status(StatusCode.ERROR, record.outcome))
        span.end()


class OtelTracing:
    """The process's tracer provider, batch processor and OTLP/HTTP exporter."""

    def __init__(self, endpoint: str, sample_ratio: float, attributes: Mapping[str, Value]) -> None:
        name = os.environ.get("OTEL_SERVICE_NAME") or "trio-pdrouter"
        resource = Resource.create({SERVICE_NAME: name})
        self._provider = TracerProvider(
            resource=resource, sampler=ParentBased(TraceIdRatioBased(sample_ratio))
        )
        self._provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint)))
        )
        self.tracer = self._provider.get_tracer("trio_pdrouter")
        self._attributes = dict(attributes)

    def request(self, route: str, headers: Mapping[str, str]) -> OtelRequest:
        parent: Context | None = None
        if "traceparent" in headers:
            parent = _PROPAGATOR.extract(headers)
        attributes: dict[str, Value] = {
            "http.request.method": "POST",
            "http.route": route,
            **self._attributes,
        }
        span = self.tracer.start_span(
            f"POST {route}", context=parent, kind=SpanKind.SERVER, attributes=attributes
        )
        return OtelRequest(self, span)

    def flush(self) -> None:
        self._provider.force_flush()

    def shutdown(self) -> None:
        self._provider.shutdown()
