"""The life of one inference request, written down once as tables the code follows.

Rules of this module (everything that decides where a request is in its life lives here):

* A request is in exactly one :class:`Phase` at a time and moves only through
  :meth:`Lifecycle.step`, along :data:`TRANSITIONS`. An event the table does not allow in the
  current phase raises :class:`IllegalTransition`: that is a bug in the router, never something a
  client or an engine can cause.
* Who holds the prefill's KV blocks is a second, smaller machine (:class:`KvOwner`,
  :data:`KV_TRANSITIONS`), stepped by :meth:`Lifecycle.kv_step`.
* The code asks the tables, not flags: whether a failed attempt may be retried
  (:meth:`Lifecycle.allows` ``RETRY``: only before the client got a byte), whether the client
  is gone, what the access log and metrics call the outcome (:func:`outcome`), and whether a
  prefill's KV blocks are left stranded (:attr:`Lifecycle.kv`).

Theory of operation for a PD streaming request (regular mode skips the prefill phases)::

    RECEIVED -ADMIT-> ADMITTED -ROUTE-> ROUTED -SEND_PREFILL-> PREFILLING -PREFILL_ANSWERED->
    PREFILLED -SEND_DECODE-> DECODING -STREAM_STARTED-> STREAMING -ANSWERED-> ANSWERED

A failure before the client got a byte either ends the request (``FAIL`` -> FAILED, answered
with the failure) or, with attempts left and a retriable kind, waits for the next attempt
(``RETRY`` -> RETRYING -ROUTE-> ROUTED ...). After the stream started, ``FAIL`` ends it with an
error event and ``[DONE]``; there is no ``RETRY`` out of STREAMING, so nothing is ever sent twice.

``SHUT_DOWN`` ends a request whose answer is not decided yet when the router's shutdown deadline
comes: a stream gets an error event and ``[DONE]``, anything else a 503. SHUT_DOWN absorbs the
legs' late events as CLIENT_GONE does (below).

``CLIENT_LEFT`` is allowed in every phase but the final ones: the client can leave at any instant,
including after the answer was decided but before its last message went out (ANSWERED, FAILED,
UNROUTABLE and REJECTED mean *decided*; the final send follows). A request whose client left is
not answered. ``CLIENT_STALLED`` is the same end, caused by the router: the client accepted no
byte for ``--client-write-timeout-secs`` and its connection was cut
(:mod:`trio_pdrouter.serve.stalled`). CLIENT_GONE (or CLIENT_STALLED) then absorbs every later event
but ``CRASH``: the watcher that sees the client leave cancels the request's scope, but trio delivers
a cancellation only at the next checkpoint, so a leg that was just handed its result still finishes
the step it was taking (a prefill answer read in the same instant is still recorded, and its KV
blocks reclaimed).

Prefill KV ownership::

    NONE -PREFILL_HELD-> PREFILL -PULLED-> DECODE -REFUSED-> PREFILL
                         PREFILL -RECLAIM-> RECLAIMED    (a one-token decode pulls them now)
                         PREFILL -ABANDON-> ABANDONED    (left to the prefill engine's timeout)
    NONE, DECODE, RECLAIMED, ABANDONED -NEXT_ATTEMPT-> NONE

The rule follows vLLM's connectors (docs/kv-ownership.md cites the code): once the decode engine
has the request, every end of it frees the prefill's blocks. Pulled, they are freed by the read;
aborted before it was scheduled, its connector tells the prefill to free them; aborted while it
reads them, the read completes and frees them. A reclaim after that would read block ids that
may already hold another request's KV. vLLM's OpenAI server adds a request to its engine as
soon as it has read it: a stream right after sending its head (on the response generator's first
step), a non-streaming request at once. So decode owns the blocks (``PULLED``) from the moment
the decode leg's request is written whole, streaming or not; a head that the router has not
read yet proves nothing either way. (Measured with a simulator that frees as vLLM does: owning
from the head instead let 11 of 196 departed clients' blocks be reclaimed after decode freed
them, docs/kv-ownership.md.)

Before that the router owns them (``REFUSED`` when decode had taken them): the connection
failed before the whole request was written, or decode answered an error status. Those blocks
are reused by a decode retry or reclaimed.

When an attempt ends with the blocks still on the prefill engine, a retry that follows (a decode
failure before any byte) reuses them: the next attempt sends decode the same
``kv_transfer_params`` instead of running a fresh prefill. Otherwise, when the request is done
with them, they are reclaimed exactly once (``--release-stranded-kv``, on by default) or, with
that flag off, abandoned.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class Phase(enum.Enum):
    RECEIVED = "received"  # parsed and validated; waiting for an admission slot
    ADMITTED = "admitted"  # holds an admission slot; nothing chosen yet
    ROUTED = "routed"  # an attempt's endpoints are chosen and charged
    PREFILLING = "prefilling"  # the prefill leg is out
    PREFILLED = "prefilled"  # prefill answered; the decode leg goes next
    DECODING = "decoding"  # the decode (or regular) leg is out; the client has nothing yet
    STREAMING = "streaming"  # the response head went to the client; the body is relayed
    RETRYING = "retrying"  # an attempt failed before any byte; the next one waits its backoff
    # Decided: the answer is known; its last message goes out next.
    ANSWERED = "answered"  # the engine's answer, complete
    FAILED = "failed"  # a leg's failure: an engine's error passed on, or the router's own
    UNROUTABLE = "unroutable"  # no endpoint of a stage could take it
    REJECTED = "rejected"  # admission refused it (queue full, queue timeout)
    SHUT_DOWN = "shut_down"  # the router's shutdown deadline came first: answered 503
    # Final.
    CRASHED = "crashed"  # a bug in the router; answered 500 (or an error event) if possible
    CLIENT_GONE = "client_gone"  # the client left; nobody to answer
    CLIENT_STALLED = "client_stalled"  # it accepted nothing for too long: the router cut it off


class Event(enum.Enum):
    ADMIT = "admit"
    REJECT = "reject"
    ROUTE = "route"
    NO_ENDPOINT = "no_endpoint"
    SEND_PREFILL = "send_prefill"
    PREFILL_ANSWERED = "prefill_answered"
    SEND_DECODE = "send_decode"
    STREAM_STARTED = "stream_started"
    ANSWERED = "answered"
    RETRY = "retry"
    FAIL = "fail"
    CLIENT_LEFT = "client_left"
    CLIENT_STALLED = "client_stalled"
    SHUT_DOWN = "shut_down"
    CRASH = "crash"


P, E = Phase, Event

#: phase -> {event: next phase}. Everything not listed is illegal.
TRANSITIONS: Mapping[Phase, Mapping[Event, Phase]] = {
    P.RECEIVED: {E.ADMIT: P.ADMITTED, E.REJECT: P.REJECTED},
    P.ADMITTED: {E.ROUTE: P.ROUTED, E.NO_ENDPOINT: P.UNROUTABLE},
    P.ROUTED: {E.SEND_PREFILL: P.PREFILLING, E.SEND_DECODE: P.DECODING},
    P.PREFILLING: {E.PREFILL_ANSWERED: P.PREFILLED, E.RETRY: P.RETRYING, E.FAIL: P.FAILED},
    P.PREFILLED: {E.SEND_DECODE: P.DECODING},
    P.DECODING: {
        E.STREAM_STARTED: P.STREAMING,
        E.ANSWERED: P.ANSWERED,
        E.RETRY: P.RETRYING,
        E.FAIL: P.FAILED,
    },
    P.STREAMING: {E.ANSWERED: P.ANSWERED, E.FAIL: P.FAILED},
    # Out of attempts' endpoints after a failure: the answer is that failure.
    P.RETRYING: {E.ROUTE: P.ROUTED, E.NO_ENDPOINT: P.FAILED},
    P.ANSWERED: {},
    P.FAILED: {},
    P.UNROUTABLE: {},
    P.REJECTED: {},
    P.CRASHED: {},
    # Absorb every event but CRASH (see the module doc); written out by _next.
    P.CLIENT_GONE: {},
    P.CLIENT_STALLED: {},
    # Absorbs the legs' late events like CLIENT_GONE; the client may still leave.
    P.SHUT_DOWN: {},
}

#: The phases of a request with nobody left to answer.
_GONE = frozenset({P.CLIENT_GONE, P.CLIENT_STALLED})
#: Phases in which the client can still leave (or be cut off): all but the final ones.
_LEAVABLE = frozenset(TRANSITIONS) - {P.CRASHED, *_GONE}
#: Phases the shutdown deadline ends: those whose answer is not decided yet.
_UNDECIDED = frozenset(TRANSITIONS) - {
    P.ANSWERED,
    P.FAILED,
    P.UNROUTABLE,
    P.REJECTED,
    P.SHUT_DOWN,
    P.CRASHED,
    *_GONE,
}

#: The phases in which the request's answer is known (its last message may still be unsent).
DECIDED = frozenset(TRANSITIONS) - _UNDECIDED


class KvOwner(enum.Enum):
    NONE = "none"  # no prefill in this attempt, or its one token was a stop (no KV to pull)
    PREFILL = "prefill"  # held by the prefill engine, waiting for a decode to pull them
    DECODE = "decode"  # taken by the decode engine (see the module doc for when)
    RECLAIMED = "reclaimed"  # a one-token decode was sent to pull them for a departed client
    ABANDONED = "abandoned"  # left on the prefill engine until its KV timeout frees them


class KvEvent(enum.Enum):
    PREFILL_HELD = "prefill_held"
    PULLED = "pulled"
    REFUSED = "refused"
    RECLAIM = "reclaim"
    ABANDON = "abandon"
    NEXT_ATTEMPT = "next_attempt"


K, KE = KvOwner, KvEvent

KV_TRANSITIONS: Mapping[KvOwner, Mapping[KvEvent, KvOwner]] = {
    K.NONE: {KE.PREFILL_HELD: K.PREFILL, KE.NEXT_ATTEMPT: K.NONE},
    K.PREFILL: {KE.PULLED: K.DECODE, KE.RECLAIM: K.RECLAIMED, KE.ABANDON: K.ABANDONED},
    K.DECODE: {KE.REFUSED: K.PREFILL, KE.NEXT_ATTEMPT: K.NONE},
    K.RECLAIMED: {KE.NEXT_ATTEMPT: K.NONE},
    K.ABANDONED: {KE.NEXT_ATTEMPT: K.NONE},
}


class IllegalTransition(RuntimeError):
    """An event the tables do not allow in the current state: a bug in the router."""


class Lifecycle:
    """The phase of one request and the owner of its prefill's KV blocks.

    >>> life = Lifecycle()
    >>> life.step(Event.ADMIT)
    <Phase.ADMITTED: 'admitted'>
    >>> life.allows(Event.RETRY)
    False
    """

    __slots__ = ("history", "kv", "phase")

    def __init__(self) -> None:
        self.phase = Phase.RECEIVED
        self.kv = KvOwner.NONE
        #: Every phase the request has been in, in order (the first is RECEIVED).
        self.history: list[Phase] = [Phase.RECEIVED]

    def allows(self, event: Event) -> bool:
        return _next(self.phase, event) is not None

    def step(self, event: Event) -> Phase:
        """Move along :data:`TRANSITIONS`; raise :class:`IllegalTransition` if not allowed."""
        new = _next(self.phase, event)
        if new is None:
            raise IllegalTransition(f"{event.value} is not allowed in phase {self.phase.value}")
        self.phase = new
        self.history.append(new)
        return new

    def kv_step(self, event: KvEvent) -> KvOwner:
        """Move the KV owner along :data:`KV_TRANSITIONS`; raise if not allowed."""
        new = KV_TRANSITIONS[self.kv].get(event)
        if new is None:
            raise IllegalTransition(f"KV {event.value} is not allowed when held by {self.kv.value}")
        self.kv = new
        return new

    @property
    def decided(self) -> bool:
        return self.phase in DECIDED

    @property
    def client_gone(self) -> bool:
        """The client left or was cut off (the request may have crashed since, while cleaning
        up)."""
        return not _GONE.isdisjoint(self.history)

    @property
    def streaming_started(self) -> bool:
        """The client got the response head (an error can then only be an SSE event)."""
        return Phase.STREAMING in self.history

    @property
    def retries(self) -> int:
        return self.history.count(Phase.RETRYING)


def _next(phase: Phase, event: Event) -> Phase | None:
    if event is Event.CRASH:
        # A crash while answering a departed client is still logged as one.
        return Phase.CRASHED if phase is not Phase.CRASHED else None
    if event is Event.CLIENT_LEFT or event is Event.CLIENT_STALLED:
        if phase in _GONE:  # whichever came first stays
            return phase
        new = Phase.CLIENT_GONE if event is Event.CLIENT_LEFT else Phase.CLIENT_STALLED
        return new if phase in _LEAVABLE else None
    if phase in _GONE or phase is Phase.SHUT_DOWN:
        return phase
    if event is Event.SHUT_DOWN:
        return Phase.SHUT_DOWN if phase in _UNDECIDED else None
    return TRANSITIONS[phase].get(event)


#: The outcome label of the access log and ``trio_pdrouter_requests_total`` per final phase;
#: FAILED is refined by the failure's kind (:func:`outcome`).
OUTCOMES: Mapping[Phase, str] = {
    P.ANSWERED: "ok",
    P.FAILED: "upstream_error",
    P.UNROUTABLE: "no_endpoint",
    P.REJECTED: "rejected",
    P.CRASHED: "internal_error",
    P.CLIENT_GONE: "client_disconnect",
    P.CLIENT_STALLED: "client_stalled",
    P.SHUT_DOWN: "shutdown",
}


def outcome(phase: Phase, failure_kind: str | None) -> str:
    """What the access log and metrics call a request that ended in ``phase``.

    ``failure_kind`` is the kind of the failure that ended it (see :mod:`.outcomes`), if any:
    a timeout is ``timeout``, an engine's HTTP error passed on is ``upstream_status`` (a 4xx)
    and a client that fell too far behind is ``client_too_slow``.
    """
    if phase is Phase.FAILED and failure_kind is not None:
        if failure_kind == "timeout" or failure_kind == "client_too_slow":
            return failure_kind
        if failure_kind.startswith("status_4"):
            return "upstream_status"
    return OUTCOMES.get(phase, phase.value)


def successors(phase: Phase) -> frozenset[Phase]:
    """Every phase one event can move ``phase`` to."""
    return frozenset(new for event in Event if (new := _next(phase, event)) is not None)
