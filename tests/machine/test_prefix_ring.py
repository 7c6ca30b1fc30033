"""The prefix rings: each worker's tree inserts reach every other worker's tree, bounded."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.machine import STAGES, MachineTable, PrefixRing
from trio_pdrouter.machine.prefix_ring import ENTRIES, LAYOUT, MODEL_BYTES, TEXT_BYTES
from trio_pdrouter.routing import CacheAware, PolicySettings, RoutingKey

ROWS = 3
EPS = [Endpoint("http://10.0.0.1:8000", Role.PREFILL, rank) for rank in range(4)]
PREFIX = "You are a careful translator. " * 20


@pytest.fixture
def table(tmp_path: Path) -> Iterator[MachineTable]:
    t = MachineTable.create(ROWS, str(tmp_path / "lock"), slots=8)
    yield t
    t.destroy()


def feed(table: MachineTable, row: int, stage: str = "prefill") -> PrefixRing:
    return PrefixRing(table.prefixes, table.rows, row, stage)


def test_an_insert_reaches_every_other_worker_once(table: MachineTable) -> None:
    feeds = [feed(table, r) for r in range(ROWS)]
    feeds[1].publish("a", "one")
    feeds[1].publish("b", "two")
    assert feeds[0].news() == [("a", "one", ""), ("b", "two", "")]
    assert feeds[2].news() == [("a", "one", ""), ("b", "two", "")]
    assert feeds[1].news() == []  # its own
    assert [f.news() for f in feeds] == [[], [], []]


def test_stages_have_their_own_rings(table: MachineTable) -> None:
    feed(table, 0, "prefill").publish("a", "prefill text")
    assert feed(table, 1, "decode").news() == []
    assert feed(table, 1, "prefill").news() == [("a", "prefill text", "")]
    assert set(STAGES) == {role.value for role in Role}


def test_a_replacement_worker_learns_its_predecessors_and_the_others_inserts(
    table: MachineTable,
) -> None:
    dead = feed(table, 0)
    dead.publish("a", "before the crash")
    feed(table, 1).publish("b", "from a neighbour")
    again = feed(table, 0)
    assert again.news() == [("a", "before the crash", ""), ("b", "from a neighbour", "")]
    again.publish("c", "after")  # continues the row after its predecessor's entries
    neighbour = feed(table, 2)
    assert neighbour.news() == [
        ("a", "before the crash", ""),
        ("b", "from a neighbour", ""),
        ("c", "after", ""),
    ]
    assert neighbour.news() == []


def test_news_from_several_workers_comes_in_the_order_it_was_published(
    table: MachineTable,
) -> None:
    feeds = [feed(table, r) for r in range(ROWS)]
    feeds[2].publish("a", "first")
    feeds[1].publish("b", "second")
    feeds[2].publish("c", "third")
    assert feeds[0].news() == [("a", "first", ""), ("b", "second", ""), ("c", "third", "")]


def test_a_reader_far_behind_gets_the_latest_entries_only(table: MachineTable) -> None:
    writer, reader = feed(table, 0), feed(table, 1)
    for i in range(ENTRIES + 10):
        writer.publish("a", f"text {i}")
    news = reader.news()
    assert len(news) == ENTRIES
    assert news[0] == ("a", "text 10", "") and news[-1] == ("a", f"text {ENTRIES + 9}", "")


def test_long_texts_keep_their_start_and_a_cut_character_is_dropped(
    table: MachineTable,
) -> None:
    writer, reader = feed(table, 0), feed(table, 1)
    writer.publish("a", "x" * (TEXT_BYTES - 1) + "é and more")  # é is two bytes: cut in half
    writer.publish("b", "ü" * 10)
    assert reader.news() == [("a", "x" * (TEXT_BYTES - 1), ""), ("b", "ü" * 10, "")]


def test_an_entry_being_rewritten_is_skipped(table: MachineTable) -> None:
    writer, reader = feed(table, 0), feed(table, 1)
    writer.publish("a", "first")
    writer.publish("b", "second")
    # The writer is in the middle of rewriting entry 0: its seq is marked invalid.
    at = LAYOUT.entry_at(0)  # the first stage's first row: its ring starts at 0
    table.prefixes[at : at + 8] = (-1).to_bytes(8, "little", signed=True)  # entry 0's seq
    assert reader.news() == [("b", "second", "")]


def policy(table: MachineTable | None, row: int) -> CacheAware:
    settings = PolicySettings(
        cache_threshold=0.5, balance_abs_threshold=32, balance_rel_threshold=1.1
    )
    p = CacheAware(
        settings,
        random.Random(row),
        stage="prefill",
        on_decision=lambda stage, reason: None,
        feed=None if table is None else feed(table, row),
    )
    p.set_endpoints(EPS)
    return p


def test_workers_trees_follow_each_others_choices(table: MachineTable) -> None:
    workers = [policy(table, r) for r in range(ROWS)]
    loads = {EPS[0]: 3, EPS[1]: 0, EPS[2]: 3, EPS[3]: 3}  # balanced: a miss goes to EPS[1]
    first = workers[0].choose(EPS, loads, RoutingKey(PREFIX + "first question"))
    assert first == EPS[1]
    even = dict.fromkeys(EPS, 0)
    for w in workers[1:]:
        # Without the feed each would pick at random among the equally loaded endpoints.
        assert w.choose(EPS, even, RoutingKey(PREFIX + "another question")) == EPS[1]
    for w in workers:
        assert w.tree.match(PREFIX)[1] == EPS[1]


def test_token_weights_see_what_other_workers_sent_where(table: MachineTable) -> None:
    """Routing asks uncached_tokens (through held_chars) for the token weights before it asks
    choose: that read too must see the other workers' inserts."""
    a, b = policy(table, 0), policy(table, 1)
    text = PREFIX + "a question"
    loads = {EPS[0]: 3, EPS[1]: 0, EPS[2]: 3, EPS[3]: 3}
    assert a.choose(EPS, loads, RoutingKey(text)) == EPS[1]
    held = b.held_chars(EPS, text)
    assert held[EPS[1]] == len(text) and held[EPS[0]] == 0


def test_an_endpoint_the_worker_does_not_know_is_not_learnt(table: MachineTable) -> None:
    feed(table, 1).publish("http://gone:1@0", PREFIX)
    worker = policy(table, 0)
    worker.choose(EPS, dict.fromkeys(EPS, 0), RoutingKey("unrelated text"))
    assert worker.tree.match(PREFIX) == (0, None)


PROMPTS = [PREFIX[:300], PREFIX[:300] + "other", "Summarise this report. " * 15, "Q" * 200]
request = st.tuples(
    st.integers(0, ROWS - 1),  # the worker the kernel gave the connection to
    st.sampled_from(PROMPTS),
    st.text("abc", max_size=30),  # the part after the shared prefix
    st.permutations(range(len(EPS))),  # distinct loads: no random tie-breaks
    st.sampled_from([1, 40]),  # scale: 40 makes some decisions unbalanced
)


@given(st.lists(request, max_size=40))
def test_workers_sharing_inserts_choose_as_one_tree_would(
    tmp_path_factory: pytest.TempPathFactory,
    requests: list[tuple[int, str, str, list[int], int]],
) -> None:
    table = MachineTable.create(ROWS, str(tmp_path_factory.mktemp("t") / "lock"), slots=8)
    try:
        workers = [policy(table, r) for r in range(ROWS)]
        alone = policy(None, 0)
        for row, prompt, suffix, order, scale in requests:
            loads = {ep: n * scale for ep, n in zip(EPS, order, strict=True)}
            key = RoutingKey(prompt + suffix)
            assert workers[row].choose(EPS, loads, key) == alone.choose(EPS, loads, key)
    finally:
        table.destroy()


def test_an_insert_travels_with_its_model(table: MachineTable) -> None:
    writer, reader = feed(table, 0), feed(table, 1)
    writer.publish("a", "text", "llama-lora")
    writer.publish("b", "text")
    writer.publish("c", "text", "m" * (MODEL_BYTES + 1))  # too long to name its tree: kept home
    assert reader.news() == [("a", "text", "llama-lora"), ("b", "text", "")]


def test_workers_learn_each_models_inserts_into_that_models_tree(table: MachineTable) -> None:
    a, b = policy(table, 0), policy(table, 1)
    loads = {EPS[0]: 3, EPS[1]: 0, EPS[2]: 3, EPS[3]: 3}  # balanced: a miss goes to EPS[1]
    assert a.choose(EPS, loads, RoutingKey(PREFIX + "q", model="one")) == EPS[1]
    b.choose(EPS, dict.fromkeys(EPS, 0), RoutingKey("unrelated"))  # reads the news
    assert b.tree_of("one").match(PREFIX)[1] == EPS[1]
    assert b.tree_of("two").match(PREFIX) == (0, None)
    assert b.tree.match(PREFIX) == (0, None)
