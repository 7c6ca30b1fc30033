"""The circuit breaker: every row of the transition table, then random histories against a model."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_pdrouter.config import BreakerSettings
from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.fleet import Breakers

EP = Endpoint("http://prefill:8100", Role.PREFILL, 0)
SIBLING = Endpoint("http://prefill:8100", Role.PREFILL, 1)
SETTINGS = BreakerSettings(
    failure_threshold=3, success_threshold=2, timeout_duration_secs=10.0, window_duration_secs=20.0
)


@attrs.define
class Rig:
    breakers: Breakers
    loads: dict[Endpoint, int]
    changes: list[tuple[str, str, str]]


def rig(cfg: BreakerSettings = SETTINGS) -> Rig:
    loads: dict[Endpoint, int] = {}
    changes: list[tuple[str, str, str]] = []
    breakers = Breakers(
        cfg,
        in_flight=lambda ep: loads.get(ep, 0),
        on_change=lambda ep, old, new: changes.append((ep.key, old, new)),
    )
    return Rig(breakers, loads, changes)


def opened(r: Rig, at: float = 0.0) -> None:
    for _ in range(SETTINGS.failure_threshold):
        r.breakers.record_failure(EP, at)
    assert r.breakers.state(EP) == "open"


def half_opened(r: Rig) -> float:
    opened(r, 0.0)
    now = SETTINGS.timeout_duration_secs
    assert r.breakers.admits(EP, now)
    assert r.breakers.state(EP) == "half_open"
    return now


# --- CLOSED ---------------------------------------------------------------------------------


def test_closed_admits_and_a_success_changes_nothing() -> None:
    r = rig()
    r.breakers.record_success(EP, 0.0)
    assert r.breakers.admits(EP, 0.0)
    assert r.breakers.state(EP) == "closed"
    assert r.changes == []


def test_closed_failures_below_threshold_stay_closed() -> None:
    r = rig()
    for t in range(SETTINGS.failure_threshold - 1):
        r.breakers.record_failure(EP, float(t))
    assert r.breakers.state(EP) == "closed"
    assert r.breakers.admits(EP, 5.0)


def test_closed_failures_reaching_threshold_open() -> None:
    r = rig()
    for t in range(SETTINGS.failure_threshold):
        r.breakers.record_failure(EP, float(t))
    assert r.breakers.state(EP) == "open"
    assert r.changes == [(EP.key, "closed", "open")]


def test_closed_a_success_clears_the_streak() -> None:
    r = rig()
    for t in range(SETTINGS.failure_threshold - 1):
        r.breakers.record_failure(EP, float(t))
    r.breakers.record_success(EP, 3.0)
    for t in range(SETTINGS.failure_threshold - 1):
        r.breakers.record_failure(EP, 4.0 + t)
    assert r.breakers.state(EP) == "closed"


def test_closed_failures_older_than_the_window_do_not_count() -> None:
    r = rig()
    window = SETTINGS.window_duration_secs
    r.breakers.record_failure(EP, 0.0)
    r.breakers.record_failure(EP, 1.0)
    r.breakers.record_failure(EP, 1.0 + window + 0.5)  # the first two have left the window
    assert r.breakers.state(EP) == "closed"
    r.breakers.record_failure(EP, 1.0 + window + 1.0)
    assert r.breakers.state(EP) == "closed"
    r.breakers.record_failure(EP, 1.0 + window + 2.0)
    assert r.breakers.state(EP) == "open"


# --- OPEN -----------------------------------------------------------------------------------


def test_open_rejects_until_the_timeout() -> None:
    r = rig()
    opened(r, at=100.0)
    assert not r.breakers.admits(EP, 100.0)
    assert not r.breakers.admits(EP, 100.0 + SETTINGS.timeout_duration_secs - 0.001)
    assert r.breakers.state(EP) == "open"


def test_open_turns_half_open_at_the_timeout() -> None:
    r = rig()
    opened(r, at=100.0)
    assert r.breakers.admits(EP, 100.0 + SETTINGS.timeout_duration_secs)
    assert r.breakers.state(EP) == "half_open"
    assert r.changes[-1] == (EP.key, "open", "half_open")


@pytest.mark.parametrize("outcome", ["success", "failure"])
def test_open_ignores_outcomes_of_requests_admitted_before(outcome: str) -> None:
    r = rig()
    opened(r, at=100.0)
    record = getattr(r.breakers, f"record_{outcome}")
    for _ in range(5):
        record(EP, 105.0)
    assert r.breakers.state(EP) == "open"
    # The deadline was not pushed back by the late failures.
    assert r.breakers.admits(EP, 100.0 + SETTINGS.timeout_duration_secs)


def test_an_outcome_after_the_deadline_is_a_half_open_outcome() -> None:
    r = rig()
    opened(r, at=0.0)
    r.breakers.record_failure(EP, SETTINGS.timeout_duration_secs + 1.0)
    assert r.changes[-2:] == [(EP.key, "open", "half_open"), (EP.key, "half_open", "open")]
    assert not r.breakers.admits(EP, SETTINGS.timeout_duration_secs + 2.0)


# --- HALF_OPEN ------------------------------------------------------------------------------


def test_half_open_admits_one_trial_at_a_time() -> None:
    r = rig()
    now = half_opened(r)
    r.loads[EP] = 1  # the trial was chosen and charged
    assert not r.breakers.admits(EP, now)
    r.loads[EP] = 0  # its lease was released, outcome recorded or not
    assert r.breakers.admits(EP, now)


def test_half_open_successes_below_threshold_stay_half_open() -> None:
    r = rig()
    now = half_opened(r)
    for _ in range(SETTINGS.success_threshold - 1):
        r.breakers.record_success(EP, now)
    assert r.breakers.state(EP) == "half_open"


def test_half_open_successes_reaching_threshold_close() -> None:
    r = rig()
    now = half_opened(r)
    for _ in range(SETTINGS.success_threshold):
        r.breakers.record_success(EP, now)
    assert r.breakers.state(EP) == "closed"
    assert r.changes[-1] == (EP.key, "half_open", "closed")
    # It starts over with a clean streak.
    for _ in range(SETTINGS.failure_threshold - 1):
        r.breakers.record_failure(EP, now)
    assert r.breakers.state(EP) == "closed"


def test_half_open_any_failure_reopens_with_a_new_deadline() -> None:
    r = rig()
    now = half_opened(r)
    r.breakers.record_success(EP, now)
    r.breakers.record_failure(EP, now + 1.0)
    assert r.breakers.state(EP) == "open"
    assert not r.breakers.admits(EP, now + SETTINGS.timeout_duration_secs)
    assert r.breakers.admits(EP, now + 1.0 + SETTINGS.timeout_duration_secs)
    # Successes before the failure do not count any more.
    r.breakers.record_success(EP, now + 11.0)
    assert r.breakers.state(EP) == "half_open"


# --- keys, disabling, forgetting ------------------------------------------------------------


def test_each_dp_rank_has_its_own_breaker() -> None:
    r = rig()
    opened(r)
    assert not r.breakers.admits(EP, 1.0)
    assert r.breakers.admits(SIBLING, 1.0)
    assert r.breakers.state(SIBLING) == "closed"


def test_disabled_breaker_always_admits() -> None:
    r = rig(attrs.evolve(SETTINGS, enabled=False))
    for t in range(50):
        r.breakers.record_failure(EP, float(t))
    assert r.breakers.admits(EP, 50.0)
    assert r.breakers.state(EP) == "closed"
    assert r.changes == []


def test_forget_drops_the_state() -> None:
    r = rig()
    opened(r)
    r.breakers.forget(EP)
    assert r.breakers.state(EP) == "closed"
    assert r.breakers.admits(EP, 1.0)


# --- random histories against a model ------------------------------------------------------

ALLOWED = {
    ("closed", "open"),
    ("open", "half_open"),
    ("half_open", "open"),
    ("half_open", "closed"),
}


@attrs.define
class Model:
    """The transition table, written as plainly as possible."""

    cfg: BreakerSettings
    state: str = "closed"
    failure_times: list[float] = attrs.Factory(list)
    successes: int = 0
    opened_at: float = 0.0

    def tick(self, now: float) -> None:
        if self.state == "open" and now - self.opened_at >= self.cfg.timeout_duration_secs:
            self.state, self.successes = "half_open", 0

    def admits(self, now: float, in_flight: int) -> bool:
        self.tick(now)
        return self.state == "closed" or (self.state == "half_open" and in_flight == 0)

    def success(self, now: float) -> None:
        self.tick(now)
        if self.state == "closed":
            self.failure_times = []
        elif self.state == "half_open":
            self.successes += 1
            if self.successes == self.cfg.success_threshold:
                self.state, self.failure_times = "closed", []

    def failure(self, now: float) -> None:
        self.tick(now)
        if self.state == "closed":
            self.failure_times.append(now)
            recent = [t for t in self.failure_times if t >= now - self.cfg.window_duration_secs]
            if len(recent) >= self.cfg.failure_threshold:
                self.state, self.opened_at = "open", now
        elif self.state == "half_open":
            self.state, self.opened_at = "open", now


events = st.lists(
    st.tuples(
        st.sampled_from(["admit", "success", "failure"]),
        # Whole seconds: the model's arithmetic then agrees with any correct implementation's.
        st.integers(min_value=0, max_value=15).map(float),  # time step
        st.integers(min_value=0, max_value=2),  # requests in flight
    ),
    max_size=80,
)
configs = st.builds(
    BreakerSettings,
    enabled=st.just(True),
    failure_threshold=st.integers(1, 4),
    success_threshold=st.integers(1, 3),
    timeout_duration_secs=st.sampled_from([0.0, 5.0, 30.0]),
    window_duration_secs=st.sampled_from([0.0, 10.0, 60.0]),
)


@settings(max_examples=300, deadline=None)
@given(cfg=configs, history=events)
def test_random_histories_follow_the_model(
    cfg: BreakerSettings, history: list[tuple[str, float, int]]
) -> None:
    r = rig(cfg)
    model = Model(cfg)
    now = 0.0
    for kind, step, in_flight in history:
        now += step
        r.loads[EP] = in_flight
        if kind == "admit":
            assert r.breakers.admits(EP, now) == model.admits(now, in_flight)
        elif kind == "success":
            r.breakers.record_success(EP, now)
            model.success(now)
        else:
            r.breakers.record_failure(EP, now)
            model.failure(now)
        assert r.breakers.state(EP) == model.state
    # Transitions chain (each starts where the last ended) and all are in the table.
    state = "closed"
    for _key, old, new in r.changes:
        assert old == state
        assert (old, new) in ALLOWED
        state = new
    assert state == r.breakers.state(EP)
