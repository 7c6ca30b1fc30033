"""What happened to one request, as the access log and the metrics see it.

A :class:`RequestRecord` is made once, when a request ends (:meth:`Request.record
<trio_pdrouter.serve.request.Request.record>`, or the app for a request refused before it was
parsed), from the request's final state; nothing writes to it while the request runs. It feeds
:func:`access_line` and :meth:`RouterMetrics.observe_request
<trio_pdrouter.observe.metrics.RouterMetrics.observe_request>`.
"""

from __future__ import annotations

from typing import Any

import attrs
import orjson


@attrs.define
class RequestRecord:
    """What happened to one request."""

    request_id: str
    route: str
    stream: bool
    started: float
    prefill: str | None = None
    decode: str | None = None
    status: int = 0
    #: See :func:`trio_pdrouter.serve.lifecycle.outcome`; ``bad_request`` for a request refused
    #: before it was parsed, ``unknown_model`` for one naming a model no server serves.
    outcome: str = "ok"
    prefill_ms: float | None = None
    ttfb_ms: float | None = None
    total_ms: float | None = None
    bytes_out: int = 0
    retries: int = 0
    #: Why admission refused it (``queue_full``, ``queue_timeout``), if it did.
    rejection: str | None = None
    #: Every upstream failure seen, as (stage, endpoint key, kind); kind is ``connect``,
    #: ``timeout``, ``reset``, ``status_<code>`` or ``invalid``.
    upstream_errors: list[tuple[str, str, str]] = attrs.Factory(list)
    #: ``kv_aware``'s view of its choice: blocks matched/total and whether the state was known.
    kv: str | None = None
    #: The failure that decided the answer, if one did: its stage, the endpoint it came from,
    #: and its cause (kind and detail, as clients never see them).
    failed_stage: str | None = None
    failed_upstream: str | None = None
    cause: str | None = None
    #: The client's address (``host:port``), the model it named, and the token counts of the
    #: answer's ``usage`` when it had one.
    client: str | None = None
    model: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    #: Whose request it was, how long it waited for admission, and the tokens admission
    #: counted for it (the prompt's estimate plus the output cap).
    tenant: str | None = None
    queue_ms: float | None = None
    admitted_tokens: int | None = None

    @property
    def failed(self) -> bool:
        """Whether the router or an upstream failed the request (the access line is then a
        warning): not answered, and not the client's own doing (a bad request, an engine
        refusing it with a 4xx, a client that left)."""
        return self.outcome not in SERVED


#: Outcomes where nothing failed on the router's side.
SERVED = frozenset({"ok", "bad_request", "unknown_model", "upstream_status", "client_disconnect"})


def access_fields(rec: RequestRecord) -> dict[str, Any]:
    """The access line's fields, in order, with their values (None: did not happen); the JSON
    log writes them as they are, the text line as ``key=value``."""
    fields: dict[str, Any] = {
        "request_id": rec.request_id,
        "route": rec.route,
        "stream": rec.stream,
        "prefill": rec.prefill,
        "decode": rec.decode,
        "status": rec.status,
        "outcome": rec.outcome,
        "prefill_ms": _round(rec.prefill_ms),
        "ttfb_ms": _round(rec.ttfb_ms),
        "total_ms": _round(rec.total_ms),
        "bytes": rec.bytes_out,
        "retries": rec.retries,
        "client": rec.client,
        "model": rec.model,
        "prompt_tokens": rec.prompt_tokens,
        "completion_tokens": rec.completion_tokens,
        "kv": rec.kv,
        "failed_stage": rec.failed_stage,
        "failed_upstream": rec.failed_upstream,
        "cause": rec.cause,
    }
    if rec.tenant is not None and rec.tenant != "default":
        fields["tenant"] = rec.tenant
    return fields


def _round(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 1)


def access_line(rec: RequestRecord) -> str:
    """The access log line of one request: ``key=value`` pairs, ``-`` for what did not happen,
    values with spaces, quotes or ``=`` in JSON quotes; ``kv`` and the failure's fields only
    when there are some."""
    fields = (
        ("request_id", _quoted(rec.request_id)),
        ("route", rec.route),
        ("stream", "true" if rec.stream else "false"),
        ("prefill", rec.prefill or "-"),
        ("decode", rec.decode or "-"),
        ("status", str(rec.status)),
        ("outcome", rec.outcome),
        ("prefill_ms", _ms(rec.prefill_ms)),
        ("ttfb_ms", _ms(rec.ttfb_ms)),
        ("total_ms", _ms(rec.total_ms)),
        ("bytes", str(rec.bytes_out)),
        ("retries", str(rec.retries)),
    )
    line = " ".join(f"{key}={value}" for key, value in fields)
    line += (
        f" client={_quoted(rec.client or '-')} model={_quoted(rec.model or '-')}"
        f" prompt_tokens={_count(rec.prompt_tokens)}"
        f" completion_tokens={_count(rec.completion_tokens)}"
    )
    if rec.tenant is not None and rec.tenant != "default":
        line += f" tenant={rec.tenant}"
    if rec.kv is not None:
        line += f" kv={rec.kv}"
    if rec.cause is not None:
        line += (
            f" failed_stage={rec.failed_stage or '-'} failed_upstream={rec.failed_upstream or '-'}"
            f" cause={_quoted(rec.cause)}"
        )
    return line


def _quoted(value: str) -> str:
    # Request ids come from clients: keep the line splittable on spaces whatever they send.
    if value and all(c.isprintable() and not c.isspace() and c not in '"=' for c in value):
        return value
    return orjson.dumps(value).decode()


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
