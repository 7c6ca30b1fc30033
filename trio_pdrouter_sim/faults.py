"""Fault injection: one spec syntax, three entrances.

Syntax (spaces are ignored)::

    SPEC  := FAULT ("," FAULT)*
    FAULT := KIND [":" ARG [":" ARG]] ["@" ROLE] ["~" PROBABILITY]

Kinds:

``error:STATUS``
    Answer at once with HTTP ``STATUS`` (e.g. 500, 503, 429) and a vLLM-shaped JSON error
    body; the request never reaches an engine.
``reset[:K]``
    Drop the connection abortively (SO_LINGER 0, so the peer gets a RST) after ``K``
    generated tokens. ``K`` defaults to 0, which drops it on arrival, before any response
    byte. With ``K >= 1`` a stream is cut after ``K`` token events (the client sees a
    truncated chunked body); a non-streaming request is dropped without an answer after the
    engine produced ``K`` tokens. Counted as an abort by the engine.
``stall[:K[:SECONDS]]``
    Stop after ``K`` tokens (0, the default: before the first token, after prefill) for
    ``SECONDS``, or until the client disconnects when ``SECONDS`` is absent. The request
    keeps its engine slot while stalled, as a hung vLLM request does.
``slow-prefill:SECONDS``
    Add ``SECONDS`` to the modelled prefill time.

``@prefill`` / ``@decode`` restrict a fault to one kind of request: *prefill* requests are
those carrying ``kv_transfer_params.do_remote_decode = true`` (the router's prefill leg);
every other request is a *decode* request. ``~P`` applies the fault with probability ``P``.

Entrances:

* server flag ``--fault SPEC`` (repeatable): applies to every request;
* request header ``x-sim-fault: SPEC``: applies to that request;
* ``POST /sim/faults`` with ``{"spec": SPEC, "count": N}``: applies to the next ``N``
  generation requests it matches (``count`` null or absent: every request until
  ``DELETE /sim/faults``). A new POST replaces the previous one.

"Server down" (connections refused) is not a per-request fault: ``POST /sim/down`` with
``{"seconds": S}`` closes the listening socket for ``S`` seconds (``SimServer.down()`` /
``SimServer.up()`` from Python); stopping the simulator works too.

Examples: ``error:503@prefill``, ``reset:5@decode``, ``stall:0:2.5``, ``slow-prefill:0.5~0.1``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from typing import Literal

import attrs

FaultKind = Literal["error", "reset", "stall", "slow-prefill"]
RequestRole = Literal["prefill", "decode"]

#: Statuses ``error:`` may use; anything else is rejected so a typo does not turn into a 200.
_ALLOWED_STATUS = range(400, 600)


@attrs.frozen
class Fault:
    """One parsed fault clause. ``seconds`` is ``None`` for a stall that lasts until disconnect."""

    kind: FaultKind
    status: int = 0
    after_tokens: int = 0
    seconds: float | None = None
    role: RequestRole | None = None
    probability: float = 1.0

    def applies_to(self, role: RequestRole) -> bool:
        """Whether this fault targets requests of ``role``."""
        return self.role is None or self.role == role


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what} must be a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {text!r}")
    return value


def _count(text: str, what: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{what} must be a whole number >= 0, got {text!r}")
    return int(text)


def _parse_one(clause: str) -> Fault:
    probability = 1.0
    role: RequestRole | None = None
    if "~" in clause:
        clause, _, prob_text = clause.partition("~")
        probability = _number(prob_text, "probability")
        if probability > 1:
            raise ValueError(f"probability must be within [0, 1], got {prob_text!r}")
    if "@" in clause:
        clause, _, role_text = clause.partition("@")
        if role_text not in ("prefill", "decode"):
            raise ValueError(f"fault role must be prefill or decode, got {role_text!r}")
        role = role_text  # type: ignore[assignment]
    kind, *args = clause.split(":")
    if kind == "error":
        if len(args) != 1:
            raise ValueError("error needs exactly one argument: error:STATUS")
        status = _count(args[0], "error status")
        if status not in _ALLOWED_STATUS:
            raise ValueError(f"error status must be 400-599, got {status}")
        return Fault("error", status=status, role=role, probability=probability)
    if kind == "reset":
        if len(args) > 1:
            raise ValueError("reset takes at most one argument: reset[:K]")
        k = _count(args[0], "reset token count") if args else 0
        return Fault("reset", after_tokens=k, role=role, probability=probability)
    if kind == "stall":
        if len(args) > 2:
            raise ValueError("stall takes at most two arguments: stall[:K[:SECONDS]]")
        k = _count(args[0], "stall token count") if args else 0
        seconds = _number(args[1], "stall seconds") if len(args) == 2 else None
        return Fault("stall", after_tokens=k, seconds=seconds, role=role, probability=probability)
    if kind == "slow-prefill":
        if len(args) != 1:
            raise ValueError("slow-prefill needs exactly one argument: slow-prefill:SECONDS")
        seconds = _number(args[0], "slow-prefill seconds")
        return Fault("slow-prefill", seconds=seconds, role=role, probability=probability)
    raise ValueError(f"unknown fault kind {kind!r}; expected error, reset, stall or slow-prefill")


def parse_faults(spec: str) -> tuple[Fault, ...]:
    """Parse a fault spec (see the module docstring). Raises ``ValueError`` with a clear message."""
    compact = "".join(spec.split())
    if not compact:
        raise ValueError("empty fault spec")
    return tuple(_parse_one(clause) for clause in compact.split(",") if clause)


@attrs.frozen
class FaultPlan:
    """What to do to one request: the merge of every fault that fired for it."""

    error_status: int | None = None
    reset_after: int | None = None
    stall_after: int | None = None
    stall_seconds: float | None = None
    extra_prefill_s: float = 0.0

    @property
    def empty(self) -> bool:
        """True when nothing fired."""
        return self == _NO_FAULT


_NO_FAULT = FaultPlan()


def plan_for(faults: Iterable[Fault], rng: random.Random) -> FaultPlan:
    """Merge ``faults`` (already filtered by role) into one plan, rolling each probability.

    When two faults of a kind fire, the first one listed wins, except slow-prefill, which adds.
    """
    error: int | None = None
    reset: int | None = None
    stall: tuple[int, float | None] | None = None
    extra = 0.0
    for fault in faults:
        if fault.probability < 1.0 and rng.random() >= fault.probability:
            continue
        if fault.kind == "error" and error is None:
            error = fault.status
        elif fault.kind == "reset" and reset is None:
            reset = fault.after_tokens
        elif fault.kind == "stall" and stall is None:
            stall = (fault.after_tokens, fault.seconds)
        elif fault.kind == "slow-prefill":
            extra += fault.seconds or 0.0
    return FaultPlan(
        error_status=error,
        reset_after=reset,
        stall_after=None if stall is None else stall[0],
        stall_seconds=None if stall is None else stall[1],
        extra_prefill_s=extra,
    )


class FaultBook:
    """The faults a server applies: its flag, plus faults armed with ``POST /sim/faults``."""

    def __init__(self, server_faults: Iterable[str] = ()) -> None:
        self.server_faults: tuple[Fault, ...] = tuple(
            fault for spec in server_faults for fault in parse_faults(spec)
        )
        self.armed: tuple[Fault, ...] = ()
        self.armed_spec: str | None = None
        #: Requests the armed faults still apply to; ``None`` means unlimited.
        self.armed_remaining: int | None = None
        self.injected = 0

    def arm(self, spec: str, count: int | None) -> None:
        """Apply ``spec`` to the next ``count`` matching requests (all of them if ``None``)."""
        faults = parse_faults(spec)
        if count is not None and count < 0:
            raise ValueError("count must be >= 0 or null")
        self.armed, self.armed_spec, self.armed_remaining = faults, spec, count

    def disarm(self) -> None:
        """Forget the armed faults."""
        self.armed, self.armed_spec, self.armed_remaining = (), None, None

    def faults_for(self, role: RequestRole, header_spec: str | None) -> list[Fault]:
        """The faults that target one request of ``role``; consumes one armed use if any match.

        Raises ``ValueError`` when the header spec does not parse.
        """
        chosen = [f for f in self.server_faults if f.applies_to(role)]
        if header_spec is not None:
            chosen.extend(f for f in parse_faults(header_spec) if f.applies_to(role))
        if self.armed and self.armed_remaining != 0:
            armed = [f for f in self.armed if f.applies_to(role)]
            if armed:
                chosen.extend(armed)
                if self.armed_remaining is not None:
                    self.armed_remaining -= 1
                    if self.armed_remaining == 0:
                        self.disarm()
        return chosen

    def describe(self) -> dict[str, object]:
        """JSON view for ``GET /sim/faults``."""
        return {
            "server": [attrs.asdict(f) for f in self.server_faults],
            "armed": self.armed_spec,
            "remaining": self.armed_remaining,
            "injected": self.injected,
        }
