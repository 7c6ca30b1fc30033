"""What a failed leg means, decided in one pure step: for the client, the retry, the breaker.

Every way a leg can fail becomes one :class:`LegFailure` through one of the constructors below;
nothing here has side effects. The request records it in one place
(:meth:`trio_pdrouter.serve.request.Request.record_failure`): the access log and metrics learn its
kind, the endpoint's circuit breaker its :class:`Verdict`, and the retry loop whether it may try
again.

    kind            when                                        retriable  breaker   upstream error
    -------------   -----------------------------------------   ---------  --------  --------------
    connect         the connection could not be opened          yes        failure   yes
    reset           the connection broke (reset, closed early)  yes        failure   yes
    timeout         a time limit passed                         yes        failure   yes
    status_5xx      the engine answered 5xx                     yes        failure   yes
    status_429      the engine is saturated                     yes        -         yes
    status_4xx      the engine refused the request itself       no         success   no
    invalid         an answer the router cannot use             no         failure   yes
    client_too_slow the client fell too far behind the engine   no         -         no

Where the engine answered (every ``status_*`` kind), the client gets that answer once the
request fails (at once for a 4xx; after the last attempt, or with ``--disable-retries``, for a
5xx or 429): the engine's status, body and headers (as :mod:`trio_pdrouter.http.response_headers`
passes them on), as vllm-router does; an engine's 429 gets ``Retry-After: 1`` if it sent none. Every
other failure is answered with the router's own error in the OpenAI shape (502, or 504 for
timeouts): it names the stage, how it failed and the request id, never the endpoint or the
exception, which :attr:`LegFailure.detail` keeps for the log.
"""

from __future__ import annotations

import enum

import attrs
import httpx

from ..endpoints import Endpoint
from ..http import JSON, Headers, Reply, RouterError, error_event, errors, with_default


class Verdict(enum.Enum):
    """What a leg's outcome tells the endpoint's circuit breaker."""

    SUCCESS = "success"
    FAILURE = "failure"
    NOTHING = "nothing"


@attrs.frozen
class LegFailure:
    """A leg that failed; see the module's table."""

    stage: str
    endpoint: Endpoint
    kind: str
    #: The router's error, or the engine's own answer to pass on.
    answer: RouterError | Reply
    retriable: bool
    verdict: Verdict
    #: Counted in ``trio_pdrouter_upstream_errors_total``.
    upstream_error: bool = True
    #: What happened, for the router's log only (it may name addresses).
    detail: str = ""

    def reply(self, streaming: bool, request_id: str) -> Reply:
        """The client's answer: the whole response, or the tail of a stream already started."""
        answer = self.answer
        if isinstance(answer, Reply):
            return answer
        error = answer.for_request(request_id)
        return Reply.tail(error_event(error)) if streaming else Reply.error(error)


def transport_failure(stage: str, ep: Endpoint, exc: httpx.HTTPError) -> LegFailure:
    """The connection failed: refused, reset, timed out by httpx."""
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        return timeout(stage, ep, detail)
    if isinstance(exc, httpx.ConnectError):
        error = errors.upstream_failed(stage, "could not be reached")
        return LegFailure(stage, ep, "connect", error, True, Verdict.FAILURE, detail=detail)
    error = errors.upstream_failed(stage, "dropped the connection")
    return LegFailure(stage, ep, "reset", error, True, Verdict.FAILURE, detail=detail)


def timeout(stage: str, ep: Endpoint, detail: str) -> LegFailure:
    error = errors.upstream_timeout(stage)
    return LegFailure(stage, ep, "timeout", error, True, Verdict.FAILURE, detail=detail)


def status(stage: str, ep: Endpoint, code: int, headers: Headers, body: bytes) -> LegFailure:
    """The engine answered ``code`` (not 200) with ``headers`` (those the client may get) and
    ``body``."""
    kind = f"status_{code}"
    detail = f"answered {code}"
    if code == 429:
        reply = Reply(code, with_default(headers, b"retry-after", b"1"), body)
        return LegFailure(stage, ep, kind, reply, True, Verdict.NOTHING, detail=detail)
    reply = Reply(code, with_default(headers, b"content-type", JSON), body)
    if 400 <= code < 500:
        # The engine is healthy; the request was not.
        return LegFailure(
            stage, ep, kind, reply, False, Verdict.SUCCESS, upstream_error=False, detail=detail
        )
    return LegFailure(stage, ep, kind, reply, True, Verdict.FAILURE, detail=detail)


def invalid(stage: str, ep: Endpoint, detail: str) -> LegFailure:
    """An answer the router cannot use (not JSON, a stream without ``[DONE]``, ...)."""
    error = errors.upstream_failed(stage, "gave an answer the router cannot use")
    return LegFailure(stage, ep, "invalid", error, False, Verdict.FAILURE, detail=detail)


def client_too_slow(stage: str, ep: Endpoint, detail: str) -> LegFailure:
    error = errors.RouterError(
        502, f"the client fell too far behind the {stage} upstream", "upstream_error"
    )
    return LegFailure(
        stage,
        ep,
        "client_too_slow",
        error,
        False,
        Verdict.NOTHING,
        upstream_error=False,
        detail=detail,
    )
