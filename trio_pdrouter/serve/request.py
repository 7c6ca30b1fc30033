"""One inference request in the router, and one attempt at serving it.

:class:`Inference` is what the client asked, parsed and validated by the app. :class:`Request`
is that request on its way through the router: its :class:`~.lifecycle.Lifecycle`, the client
side (:class:`~trio_pdrouter.http.asgi.Downstream`), and what it met (failures, timings).
:class:`Attempt` is one try: the endpoints chosen and charged for it and the request id both legs
carry.

Contract: the proxy and the legs change a request only through its methods. Each method takes
one step of the lifecycle and notes what the record will say, so the phase, the circuit
breakers, the retry loop and the access log always agree; the record is made once, at the end
(:meth:`Request.record`), from that state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs
import trio

from ..endpoints import Endpoint, Role
from ..http import Connection, Downstream, Headers, Reply, Route, errors, sse
from ..ledger import Lease
from ..observe import LegTrace, RequestRecord, RequestTrace, usage_of
from ..routing import Lesson, RoutingKey
from ..tenants import DEFAULT_TENANT, Tenant
from ..transport import SendSide
from .lifecycle import Event, KvEvent, KvOwner, Lifecycle, Phase, outcome
from .outcomes import LegFailure, Verdict


@attrs.frozen
class Inference:
    """A parsed and validated client request."""

    path: str
    route: Route
    body: dict[str, Any]
    headers: Mapping[str, str]
    stream: bool
    request_id: str
    key: RoutingKey
    #: vLLM's ``priority`` (lower is sooner): the request's place in the admission queue.
    priority: int = 0
    #: The client's address (``host:port``), for the access log.
    client: str | None = None
    #: Whose request it is (the key that authenticated it, or the gateway's header).
    tenant: Tenant = DEFAULT_TENANT

    @property
    def cost(self) -> int:
        """Its tokens as admission counts them: the prompt's estimate plus the output cap."""
        return self.key.prompt_tokens + self.key.output_tokens


class OutcomeSink(Protocol):
    """Where leg outcomes go (the circuit breakers)."""

    def record_success(self, endpoint: Endpoint, now: float) -> None: ...

    def record_failure(self, endpoint: Endpoint, now: float) -> None: ...


@attrs.frozen
class Attempt:
    """One try at serving a request: its endpoints, charged in ``lease``, and its request id.

    ``decode`` is the regular-mode worker when ``prefill`` is None. With ``reuses_kv`` the
    attempt sends only the decode leg, with the KV blocks an earlier attempt's prefill (on
    ``prefill``, not charged here) still holds. The lease releases each endpoint exactly once
    (see :mod:`trio_pdrouter.ledger.load`); the legs release theirs as they end.
    """

    number: int
    prefill: Endpoint | None
    decode: Endpoint
    lease: Lease
    request_id: str
    reuses_kv: bool = False
    #: ``kv_aware``'s view of its choice (``matched/total;known``), when it chose.
    kv_note: str | None = None
    #: What each stage's policy learnt from this attempt's choice (see :meth:`unlearn_refused`).
    lessons: Mapping[Role, Lesson] = attrs.field(factory=dict)

    @property
    def stage(self) -> str:
        """The stage name of the generating leg, as errors and metrics label it."""
        return "worker" if self.prefill is None else "decode"

    @property
    def runs_prefill(self) -> bool:
        return self.prefill is not None and not self.reuses_kv

    def unlearn_refused(self, failure: LegFailure) -> None:
        """An engine refused the attempt (a 4xx before any token): its stage's policy, and those
        of the stages after it (never reached), take back what the choice taught them. A stage
        before it (a prefill that answered) did compute the prompt, and keeps it."""
        if not failure.kind.startswith("status_4"):
            return
        after_prefill = failure.stage != "prefill"
        for role, lesson in self.lessons.items():
            if not (after_prefill and role is Role.PREFILL):
                lesson.unlearn()

    def routing_headers(self) -> Headers:
        """Response headers that explain the decision: the request id and the endpoints
        (``--expose-routing-headers`` only: see :meth:`Request.routing_headers`)."""
        rid = (b"x-request-id", self.request_id.encode("latin-1", "replace"))
        kv = [(b"x-trio-pdrouter-kv", self.kv_note.encode())] if self.kv_note else []
        if self.prefill is None:
            return [rid, (b"x-trio-pdrouter-worker", self.decode.key.encode()), *kv]
        return [
            rid,
            (b"x-trio-pdrouter-prefill", self.prefill.key.encode()),
            (b"x-trio-pdrouter-decode", self.decode.key.encode()),
            *kv,
        ]


class Request:
    """One inference request on its way through the router (see the module doc)."""

    __slots__ = (
        "_outcomes",
        "_prefill_sent_at",
        "attempt",
        "connection",
        "down",
        "failure",
        "inf",
        "kv_params",
        "legs",
        "life",
        "on_cancel",
        "on_leave",
        "prefill_answer",
        "prefill_answered_at",
        "prefill_ms",
        "queue_ms",
        "rejection",
        "scope",
        "shows_endpoints",
        "started",
        "trace",
        "upstream_errors",
    )

    def __init__(
        self,
        inf: Inference,
        down: Downstream,
        outcomes: OutcomeSink,
        connection: Connection | None = None,
        *,
        shows_endpoints: bool = False,
        trace: RequestTrace | None = None,
    ) -> None:
        self.inf = inf
        #: The request's span (``--otlp-traces-endpoint``), and its upstream calls' spans still
        #: open, by endpoint (each ends when its leg's outcome is recorded).
        self.trace = trace
        self.legs: dict[Endpoint, LegTrace] = {}
        #: ``--expose-routing-headers``: the answer names the endpoints chosen.
        self.shows_endpoints = shows_endpoints
        self.down = down
        #: The client's connection, when served by hypercorn (cut if the client stalls).
        self.connection = connection
        self._outcomes = outcomes
        self.life = Lifecycle()
        self.started = trio.current_time()
        #: The current (or last) attempt.
        self.attempt: Attempt | None = None
        #: The last failure recorded; the answer when the request fails.
        self.failure: LegFailure | None = None
        #: The last prefill's answer and its ``kv_transfer_params`` (None without KV to pull).
        self.prefill_answer: dict[str, Any] | None = None
        self.kv_params: Any = None
        self.upstream_errors: list[tuple[str, str, str]] = []
        self.prefill_ms: float | None = None
        #: When the last prefill answered (trio's clock): its KV blocks are held from then.
        self.prefill_answered_at = 0.0
        self._prefill_sent_at = 0.0
        self.rejection: str | None = None
        #: Milliseconds it waited for admission (set when admitted or refused).
        self.queue_ms: float | None = None
        #: The request's cancel scope, once it runs (the proxy's shutdown cancels it).
        self.scope: trio.CancelScope | None = None
        #: Called when the request is ended from outside (:meth:`stalled`, :meth:`shut_down`)
        #: while a send to the client may hold its task: the relay hands the engine's answer
        #: to a task the cancellation reaches at once (:mod:`.relay`).
        self.on_cancel: Callable[[], None] | None = None
        #: Set while the prefill leg is out: called instead of cancelling the request when the
        #: client leaves; the leg reads an answer already on its way, then ends the request
        #: (:meth:`end`), so a finished prefill's KV blocks are reclaimed, not stranded.
        self.on_leave: Callable[[], None] | None = None

    # -- the steps, in the order of the lifecycle -------------------------------------------

    def admitted(self) -> None:
        self.queue_ms = (trio.current_time() - self.started) * 1000
        self.life.step(Event.ADMIT)

    def rejected(self, reason: str) -> None:
        self.queue_ms = (trio.current_time() - self.started) * 1000
        self.rejection = reason
        self.life.step(Event.REJECT)

    def routed(self, attempt: Attempt) -> None:
        self.life.step(Event.ROUTE)
        self.attempt = attempt
        if not attempt.reuses_kv:
            self.life.kv_step(KvEvent.NEXT_ATTEMPT)
            self.prefill_answer = self.kv_params = None

    def unroutable(self) -> None:
        self.life.step(Event.NO_ENDPOINT)

    def prefill_sent(self) -> None:
        self.life.step(Event.SEND_PREFILL)
        self._prefill_sent_at = trio.current_time()

    def prefill_answered(self, answer: dict[str, Any]) -> None:
        """Prefill's answer was read; ``kv_transfer_params`` null means its token was a stop."""
        self.life.step(Event.PREFILL_ANSWERED)
        self.prefill_answered_at = trio.current_time()
        self.prefill_ms = (self.prefill_answered_at - self._prefill_sent_at) * 1000
        self.prefill_answer = answer
        self.kv_params = answer.get("kv_transfer_params")
        if self.kv_params is not None:
            self.life.kv_step(KvEvent.PREFILL_HELD)

    def decode_sent(self) -> None:
        self.life.step(Event.SEND_DECODE)

    def kv_taken(self) -> None:
        """The decode leg goes out: decode takes the prefill's KV blocks, if there are any,
        unless it proves otherwise (see :mod:`.lifecycle` for why)."""
        if self.life.kv is KvOwner.PREFILL:
            self.life.kv_step(KvEvent.PULLED)

    def kv_refused(self) -> None:
        """Decode proved it did not take the blocks (an error answer, or never reached)."""
        if self.life.kv is KvOwner.DECODE:
            self.life.kv_step(KvEvent.REFUSED)

    def kv_unless_unwritten(self, side: SendSide) -> None:
        """A decode leg failed or was cancelled: if its request was not all written, the engine
        never had it, and the blocks are still the prefill's."""
        if not side.written:
            self.kv_refused()

    def stream_started(self) -> None:
        self.life.step(Event.STREAM_STARTED)

    def answered(self) -> None:
        self.life.step(Event.ANSWERED)

    def retrying(self) -> None:
        self.life.step(Event.RETRY)

    def fail(self, failure: LegFailure) -> Reply:
        """End the request with ``failure``; return the client's answer for it."""
        self.failure = failure
        streaming = self.life.streaming_started
        self.life.step(Event.FAIL)
        return failure.reply(streaming, self.inf.request_id)

    def client_left(self) -> None:
        self.life.step(Event.CLIENT_LEFT)

    def end(self) -> None:
        """Cancel the request's scope: what a departed client leaves behind ends now."""
        if self.scope is not None:
            self.scope.cancel()

    def stalled(self) -> None:
        """The client accepted nothing for too long (:mod:`trio_pdrouter.serve.stalled`): end the
        request and cut
        its connection, which also ends a send blocked on it."""
        if self.life.allows(Event.CLIENT_STALLED):
            self.life.step(Event.CLIENT_STALLED)
        self._cancel()
        if self.connection is not None:
            self.connection.cut()

    def client_lost(self) -> None:
        """A write to the client failed (the relay pump's): the request ends as when hypercorn
        reports a disconnect, and its connection is closed."""
        if self.life.allows(Event.CLIENT_LEFT):
            self.life.step(Event.CLIENT_LEFT)
        self.end()
        if self.connection is not None:
            self.connection.cut()

    def shut_down(self) -> bool:
        """The router's shutdown deadline: end the request now, if its answer is not decided.

        Returns whether it was ended; its answer is then :meth:`shutdown_reply`.
        """
        if not self.life.allows(Event.SHUT_DOWN) or self.life.client_gone:
            return False
        self.life.step(Event.SHUT_DOWN)
        self._cancel()
        return True

    def _cancel(self) -> None:
        self.end()
        if self.on_cancel is not None:
            self.on_cancel()

    def shutdown_reply(self) -> Reply:
        error = errors.shutting_down()
        if self.life.streaming_started:
            return Reply.tail(sse.error_event(error))
        return Reply.error(error)

    def crashed(self) -> None:
        self.life.step(Event.CRASH)

    def kv_held_within(self, seconds: float) -> bool:
        """Whether the prefill engine still holds this request's KV blocks, counting on it for
        ``seconds`` after its answer (``--prefill-kv-hold-secs``)."""
        held = self.life.kv is KvOwner.PREFILL
        return held and trio.current_time() - self.prefill_answered_at < seconds

    def kv_settled(self, event: KvEvent) -> None:
        """An attempt ended with the KV still on the prefill engine: reclaimed or abandoned."""
        self.life.kv_step(event)

    def routing_headers(self) -> Headers:
        """The headers a client's answer carries: the request id, as the client sent it (or as
        the router made it), and, with ``--expose-routing-headers``, the attempt's endpoints."""
        attempt = self.attempt
        if attempt is not None and self.shows_endpoints:
            return attempt.routing_headers()
        return [(b"x-request-id", self.inf.request_id.encode("latin-1", "replace"))]

    # -- what legs met -------------------------------------------------------------------------

    def leg_traced(self, stage: str, endpoint: Endpoint, attempt: int) -> str | None:
        """A span for an upstream call to ``endpoint`` starts (when tracing): the
        ``traceparent`` the engine gets."""
        if self.trace is None:
            return None
        leg = self.legs[endpoint] = self.trace.leg(stage, endpoint, attempt)
        return leg.traceparent

    def end_trace(self, record: RequestRecord) -> None:
        """End the spans still open: the upstream calls' with the request's outcome, then the
        request's."""
        if self.trace is None:
            return
        for leg in self.legs.values():
            leg.end(record.outcome)
        self.legs.clear()
        self.trace.end(record)

    def _leg_ended(self, endpoint: Endpoint, outcome: str) -> None:
        leg = self.legs.pop(endpoint, None)
        if leg is not None:
            leg.end(outcome)

    def record_success(self, endpoint: Endpoint) -> None:
        self._outcomes.record_success(endpoint, trio.current_time())
        if self.legs:
            self._leg_ended(endpoint, "ok")

    def record_failure(self, failure: LegFailure) -> LegFailure:
        """The one place a leg's failure is recorded: metrics, breaker, the last failure."""
        self.failure = failure
        if self.legs:
            self._leg_ended(failure.endpoint, failure.kind)
        if failure.upstream_error:
            self.upstream_errors.append((failure.stage, failure.endpoint.key, failure.kind))
        if failure.verdict is Verdict.FAILURE:
            self._outcomes.record_failure(failure.endpoint, trio.current_time())
        elif failure.verdict is Verdict.SUCCESS:
            self._outcomes.record_success(failure.endpoint, trio.current_time())
        return failure

    # -- the end -----------------------------------------------------------------------------

    def record(self) -> RequestRecord:
        """What happened, for the access log and metrics (call once the request has ended)."""
        inf, down, attempt = self.inf, self.down, self.attempt
        now = trio.current_time()
        first = down.first_chunk_at
        failure = self.failure if self.life.phase is Phase.FAILED else None
        model = inf.body.get("model")
        prompt_tokens, completion_tokens = usage_of(down.tail())
        failure_kind = self.failure.kind if self.failure is not None else None
        return RequestRecord(
            inf.request_id,
            inf.path,
            inf.stream,
            self.started,
            prefill=attempt.prefill.key if attempt and attempt.prefill else None,
            decode=attempt.decode.key if attempt else None,
            kv=attempt.kv_note if attempt else None,
            status=down.status,
            outcome=outcome(self.life.phase, failure_kind),
            prefill_ms=self.prefill_ms,
            ttfb_ms=None if first is None else (first - self.started) * 1000,
            total_ms=(now - self.started) * 1000,
            bytes_out=down.bytes_sent,
            retries=self.life.retries,
            rejection=self.rejection,
            tenant=self.inf.tenant.name,
            queue_ms=self.queue_ms,
            admitted_tokens=self.inf.cost,
            upstream_errors=self.upstream_errors,
            failed_stage=None if failure is None else failure.stage,
            failed_upstream=None if failure is None else failure.endpoint.key,
            cause=None if failure is None else f"{failure.kind}: {failure.detail}",
            client=inf.client,
            model=model if isinstance(model, str) else None,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
        )
