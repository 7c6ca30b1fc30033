"""The route rings: each worker's prompts in flight reach every other worker's forecasts, and a
loss releases what the reader can no longer be sure of, never leaving a prompt in flight."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.routing.policies.test_kv_aware import BS, EPS, TEXT, TOKENS, View, batches_go_by
from trio_pdrouter.kv import BlockStored
from trio_pdrouter.machine import STAGES, MachineTable, RouteRing
from trio_pdrouter.machine.route_ring import ENTRIES, LAYOUT, MAX_KEYS
from trio_pdrouter.routing import KvAware, PolicySettings, RoutingKey

ROWS = 3


@pytest.fixture
def table(tmp_path: Path) -> Iterator[MachineTable]:
    t = MachineTable.create(ROWS, str(tmp_path / "lock"), slots=8)
    yield t
    t.destroy()


def feed(table: MachineTable, row: int, stage: str = "prefill") -> RouteRing:
    return RouteRing(table.routes, table.rows, row, stage)


def test_a_route_and_its_release_reach_every_other_worker_once(table: MachineTable) -> None:
    feeds = [feed(table, r) for r in range(ROWS)]
    one = feeds[1].routed("a", [1, 2, 3])
    feeds[1].routed("b", [4])
    feeds[1].released(one)
    expected = [("a", [1, 2, 3], True), ("b", [4], True), ("a", [1, 2, 3], False)]
    assert feeds[0].news() == expected
    assert feeds[2].news() == expected
    assert feeds[1].news() == []  # its own
    assert [f.news() for f in feeds] == [[], [], []]


def test_workers_news_come_in_the_order_published(table: MachineTable) -> None:
    feeds = [feed(table, r) for r in range(ROWS)]
    a = feeds[1].routed("a", [1])
    feeds[2].routed("b", [2])
    feeds[1].released(a)
    assert feeds[0].news() == [("a", [1], True), ("b", [2], True), ("a", [1], False)]


def test_stages_have_their_own_rings(table: MachineTable) -> None:
    feed(table, 0, "prefill").routed("a", [1])
    assert feed(table, 1, "decode").news() == []
    assert set(STAGES) == {"prefill", "decode", "regular"}


def test_a_release_of_a_route_never_read_is_ignored(table: MachineTable) -> None:
    writer = feed(table, 0)
    prompt = writer.routed("a", [1])
    late = feed(table, 1)  # starts at the head: the route is before its time
    writer.released(prompt)
    assert late.news() == []


def test_a_long_prompt_is_shared_by_its_first_blocks(table: MachineTable) -> None:
    writer, reader = feed(table, 0), feed(table, 1)
    writer.routed("a", list(range(MAX_KEYS + 10)))
    assert reader.news() == [("a", list(range(MAX_KEYS)), True)]


def test_a_reader_that_fell_behind_releases_what_it_held_of_that_row(table: MachineTable) -> None:
    writer, reader = feed(table, 0), feed(table, 1)
    writer.routed("a", [1])
    assert reader.news() == [("a", [1], True)]
    for i in range(ENTRIES + 1):  # its release may be among the entries overwritten
        writer.routed("b", [i + 100])
    news = reader.news()
    assert news[0] == ("a", [1], False)
    assert [change for change in news[1:] if not change[2]] == []
    assert len(news) == 1 + ENTRIES  # then the last ENTRIES routes


def test_an_entry_overwritten_while_read_releases_what_was_held(table: MachineTable) -> None:
    writer, reader = feed(table, 0), feed(table, 1)
    writer.routed("a", [1])
    assert reader.news() == [("a", [1], True)]
    writer.routed("b", [2])
    # Entry 1's seq as a writer in the middle of filling it leaves it (invalid).
    entry_at = LAYOUT.entry_at(1)  # the first stage's first row: its ring starts at 0
    table.routes[entry_at : entry_at + 8] = (-1).to_bytes(8, "little", signed=True)
    assert reader.news() == [("a", [1], False)]


def test_a_replacement_worker_ends_its_predecessor_s_prompts_only(table: MachineTable) -> None:
    dead, reader = feed(table, 0), feed(table, 1)
    dead.routed("a", [1])
    assert reader.news() == [("a", [1], True)]
    again = feed(table, 0)  # the supervisor's replacement for row 0
    prompt = again.routed("b", [2])
    assert reader.news() == [("b", [2], True), ("a", [1], False)]
    dead_prompt_number = 1 << 40  # the first number the old writer gave: never the new one's
    assert prompt != dead_prompt_number + 1
    again.released(prompt)
    assert reader.news() == [("b", [2], False)]


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["route", "release", "read", "restart", "burst"]), st.integers(0, 7)
        ),
        max_size=60,
    )
)
def test_a_reader_never_holds_a_prompt_that_is_not_in_flight(
    tmp_path_factory: pytest.TempPathFactory, steps: list[tuple[str, int]]
) -> None:
    """Whatever it misses (bursts past the ring, a restarted writer), what a reader holds in
    flight is a subset of what is; and all of it while it missed nothing."""
    table = MachineTable.create(2, str(tmp_path_factory.mktemp("t") / "lock"), slots=8)
    try:
        writer, reader = feed(table, 0), feed(table, 1)
        flying: dict[int, list[int]] = {}  # the truth: prompt -> keys
        held: list[list[int]] = []  # the reader's view, as the changes it applied say
        missed = False
        serial = 0

        def read() -> None:
            for _key, keys, routed in reader.news():
                if routed:
                    held.append(keys)
                else:
                    held.remove(keys)

        for op, n in steps:
            if op == "route":
                serial += 1
                keys = [serial]
                flying[writer.routed("a", keys)] = keys
            elif op == "release" and flying:
                prompt = sorted(flying)[n % len(flying)]
                del flying[prompt]
                writer.released(prompt)
            elif op == "read":
                read()
            elif op == "restart":
                flying.clear()  # the dead worker's prompts end with it
                writer = feed(table, 0)
            elif op == "burst":
                missed = True
                for _ in range(ENTRIES // 2 + n):
                    serial += 1
                    prompt = writer.routed("a", [serial])
                    writer.released(prompt)
        read()
        assert all(keys in flying.values() for keys in held)
        assert len(held) == len({k[0] for k in held})
        if not missed:
            assert sorted(held) == sorted(flying.values())
    finally:
        table.destroy()


def worker(view: View, table: MachineTable, row: int, *, share: bool = True) -> KvAware:
    policy = KvAware(
        PolicySettings(balance_abs_threshold=32, load_metric="requests"),
        random.Random(row),
        stage="prefill",
        on_decision=lambda _stage, _reason: None,
        view=view,
        routes=RouteRing(table.routes, table.rows, row, "prefill") if share else None,
    )
    policy.set_endpoints(EPS)
    return policy


@pytest.mark.parametrize("share", [True, False])
def test_each_worker_forecasts_the_prompts_the_others_have_in_flight(
    table: MachineTable, share: bool
) -> None:
    """With two workers, a prompt one sent (not stored yet) is credited where it went by the
    other; the engine's store of it is not foreign to the other's forecast, which stays
    complete; and its release with no store ends the credit in both (without the rings, the
    other credits nothing and finds the engine's stores foreign)."""
    views = [View(), View()]  # each worker's index, fed the same events
    workers = [worker(views[r], table, r, share=share) for r in range(2)]
    key = RoutingKey(text=TEXT, prompt_tokens=len(TOKENS), tokens=TOKENS)
    # Worker 1's forecasts start with a prompt of its own, stored on EPS[1] and answered.
    mine = tuple(range(700, 708))
    sent = RoutingKey(text="mine", prompt_tokens=8, tokens=mine)
    assert workers[1].choose(EPS, {EPS[0]: 3, EPS[1]: 0, EPS[2]: 3}, sent) == EPS[1]
    release_mine = workers[1].on_release
    assert release_mine is not None
    for view in views:
        view.indexes[EPS[1].url].apply([BlockStored((801, 802), None, mine, BS, "GPU", True)])
    release_mine()
    assert workers[0].choose(EPS, {EPS[0]: 3, EPS[1]: 0, EPS[2]: 3}, key) == EPS[1]
    release_first = workers[0].on_release
    assert release_first is not None
    busy_1 = {EPS[0]: 0, EPS[1]: 3, EPS[2]: 0}
    chosen = workers[1].choose(EPS, busy_1, key)
    assert (chosen == EPS[1]) is share
    assert workers[1].last.reason == ("kv_hit" if share else "miss")
    # The engine stores the first prompt (both workers' indexes hear it); it is released.
    for view in views:
        event = BlockStored(tuple(range(1, 9)), None, TOKENS, BS, "GPU", True)
        view.indexes[EPS[1].url].apply([event])
    release_first()
    # Worker 0 sends another prompt to EPS[2]: worker 1 credits it there only if its
    # forecasts are complete (the store above was its own) and hear of it.
    other_tokens = tuple(range(500, 532))
    other = RoutingKey(text="other text " * 8, prompt_tokens=32, tokens=other_tokens)
    assert workers[0].choose(EPS, {EPS[0]: 3, EPS[1]: 3, EPS[2]: 0}, other) == EPS[2]
    release_other = workers[0].on_release
    assert release_other is not None
    busy_2 = {EPS[0]: 0, EPS[1]: 0, EPS[2]: 3}
    assert (workers[1].choose(EPS, busy_2, other) == EPS[2]) is share
    if share:  # worker 1's own prompt of it ends too
        assert workers[1].on_release is not None
        workers[1].on_release()
    # The engine never stores it (refused): once worker 0 releases it, no worker credits it.
    release_other()
    workers[1].uncached_tokens(EPS, RoutingKey(text="", prompt_tokens=4, tokens=(1, 2, 3, 4)))
    batches_go_by(views[1])
    assert workers[1].choose(EPS, busy_2, other) != EPS[2]
    # (Without the rings worker 1's view is partial: a miss everywhere goes home.)
    assert workers[1].last.reason == ("miss" if share else "home")


def test_a_store_read_before_the_route_it_comes_from_is_not_foreign(table: MachineTable) -> None:
    """Worker 1 takes in the engine's batch before its next choice would read worker 0's
    route: the forecast reads the routes first, so the store is worker 0's, not foreign."""
    views = [View(), View()]
    workers = [worker(views[r], table, r) for r in range(2)]
    mine = tuple(range(700, 708))
    sent = RoutingKey(text="mine", prompt_tokens=8, tokens=mine)
    assert workers[1].choose(EPS, {EPS[0]: 3, EPS[1]: 0, EPS[2]: 3}, sent) == EPS[1]
    for view in views:
        view.indexes[EPS[1].url].apply([BlockStored((801, 802), None, mine, BS, "GPU", True)])
    key = RoutingKey(text=TEXT, prompt_tokens=len(TOKENS), tokens=TOKENS)
    assert workers[0].choose(EPS, {EPS[0]: 3, EPS[1]: 0, EPS[2]: 3}, key) == EPS[1]
    for view in views:  # stored before worker 1 chooses again
        event = BlockStored(tuple(range(1, 9)), None, TOKENS, BS, "GPU", True)
        view.indexes[EPS[1].url].apply([event])
    state = workers[1].forecast_states()[EPS[1].key]
    assert state["foreign_share"] == 0.0 and state["complete"]
