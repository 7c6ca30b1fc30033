"""The lifecycle tables: what they allow, what they refuse, and what the outcome of each end is."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_pdrouter.serve import (
    DECIDED,
    KV_TRANSITIONS,
    TRANSITIONS,
    Event,
    IllegalTransition,
    KvEvent,
    KvOwner,
    Lifecycle,
    Phase,
    outcome,
    successors,
)

PD_STREAM = [
    Event.ADMIT,
    Event.ROUTE,
    Event.SEND_PREFILL,
    Event.PREFILL_ANSWERED,
    Event.SEND_DECODE,
    Event.STREAM_STARTED,
    Event.ANSWERED,
]


def test_a_pd_stream_walks_the_table_to_answered() -> None:
    life = Lifecycle()
    for event in PD_STREAM:
        life.step(event)
    assert life.phase is Phase.ANSWERED and life.decided and life.streaming_started
    assert life.history[0] is Phase.RECEIVED and len(life.history) == len(PD_STREAM) + 1


@pytest.mark.parametrize(
    ("events", "event"),
    [
        ([], Event.ROUTE),  # not admitted yet
        ([Event.ADMIT], Event.SEND_PREFILL),  # nothing chosen
        ([Event.ADMIT, Event.ROUTE], Event.PREFILL_ANSWERED),  # never sent
        (PD_STREAM[:6], Event.RETRY),  # the client has bytes: never retried
        (PD_STREAM, Event.FAIL),  # answered already
        (PD_STREAM, Event.ROUTE),
    ],
)
def test_an_illegal_step_raises_and_changes_nothing(events: list[Event], event: Event) -> None:
    life = Lifecycle()
    for e in events:
        life.step(e)
    before = (life.phase, list(life.history))
    assert not life.allows(event)
    with pytest.raises(IllegalTransition, match=event.value):
        life.step(event)
    assert (life.phase, life.history) == before


def test_no_retry_out_of_streaming_or_any_decided_phase() -> None:
    assert Event.RETRY not in TRANSITIONS[Phase.STREAMING]
    for phase in DECIDED:
        assert Event.RETRY not in TRANSITIONS[phase]
        assert Phase.RETRYING not in successors(phase)


def test_decided_phases_lead_nowhere_but_client_gone_or_crashed() -> None:
    for phase in DECIDED:
        assert successors(phase) <= {
            phase,
            Phase.CLIENT_GONE,
            Phase.CLIENT_STALLED,
            Phase.CRASHED,
        }


def test_every_phase_is_in_the_table_and_reachable() -> None:
    assert set(TRANSITIONS) == set(Phase)
    seen, todo = {Phase.RECEIVED}, [Phase.RECEIVED]
    while todo:
        for new in successors(todo.pop()) - seen:
            seen.add(new)
            todo.append(new)
    assert seen == set(Phase)


@given(st.lists(st.sampled_from(Event), max_size=30))
def test_any_event_sequence_either_follows_the_table_or_raises(events: list[Event]) -> None:
    life = Lifecycle()
    for event in events:
        before = life.phase
        if life.allows(event):
            assert life.step(event) in successors(before)
        else:
            with pytest.raises(IllegalTransition):
                life.step(event)
            assert life.phase is before


def test_client_gone_absorbs_late_steps_but_a_crash() -> None:
    life = Lifecycle()
    life.step(Event.ADMIT)
    life.step(Event.ROUTE)
    life.step(Event.SEND_PREFILL)
    life.step(Event.CLIENT_LEFT)
    # The prefill answer was handed over in the same instant: recorded, nothing moves.
    assert life.step(Event.PREFILL_ANSWERED) is Phase.CLIENT_GONE
    assert life.client_gone
    assert life.step(Event.CRASH) is Phase.CRASHED
    assert life.client_gone, "a crash after the client left still knows it left"
    with pytest.raises(IllegalTransition):
        life.step(Event.CRASH)


@pytest.mark.parametrize("first", [Event.CLIENT_LEFT, Event.CLIENT_STALLED])
def test_a_stalled_client_is_gone_and_whichever_end_came_first_stays(first: Event) -> None:
    life = Lifecycle()
    for event in PD_STREAM[:6]:
        life.step(event)
    gone = life.step(first)
    assert life.client_gone
    other = Event.CLIENT_STALLED if first is Event.CLIENT_LEFT else Event.CLIENT_LEFT
    assert life.step(other) is gone and life.step(Event.ANSWERED) is gone
    assert (
        outcome(gone, None)
        == {
            Event.CLIENT_LEFT: "client_disconnect",
            Event.CLIENT_STALLED: "client_stalled",
        }[first]
    )


def test_kv_owner_table() -> None:
    life = Lifecycle()
    with pytest.raises(IllegalTransition):
        life.kv_step(KvEvent.PULLED)  # nothing held
    life.kv_step(KvEvent.PREFILL_HELD)
    with pytest.raises(IllegalTransition):
        life.kv_step(KvEvent.NEXT_ATTEMPT)  # a held prefill must be settled first
    assert life.kv_step(KvEvent.RECLAIM) is KvOwner.RECLAIMED
    with pytest.raises(IllegalTransition):
        life.kv_step(KvEvent.RECLAIM)  # exactly once
    assert life.kv_step(KvEvent.NEXT_ATTEMPT) is KvOwner.NONE
    assert set(KV_TRANSITIONS) == set(KvOwner)


@pytest.mark.parametrize(
    ("phase", "kind", "expected"),
    [
        (Phase.ANSWERED, None, "ok"),
        (Phase.FAILED, "timeout", "timeout"),
        (Phase.FAILED, "status_400", "upstream_status"),
        (Phase.FAILED, "status_429", "upstream_status"),
        (Phase.FAILED, "status_503", "upstream_error"),
        (Phase.FAILED, "reset", "upstream_error"),
        (Phase.FAILED, "client_too_slow", "client_too_slow"),
        (Phase.UNROUTABLE, None, "no_endpoint"),
        (Phase.REJECTED, None, "rejected"),
        (Phase.CRASHED, None, "internal_error"),
        (Phase.CLIENT_GONE, "reset", "client_disconnect"),
    ],
)
def test_outcome_labels(phase: Phase, kind: str | None, expected: str) -> None:
    assert outcome(phase, kind) == expected
