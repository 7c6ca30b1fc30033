"""Model-based test of the KV-event feed: the index never credits what the engine dropped.

The model is the set of blocks the engine holds (with copies), after each published batch. A
Hypothesis state machine drives the simulator's :class:`~trio_pdrouter_sim.kv_events.KvJournal`
(the publisher: numbering, a small replay buffer) and delivers its batches to a
:class:`~trio_pdrouter.kv.feed.Feed`: stores (duplicate copies included), removes, clears, lost
batches, late live copies of batches already delivered, replays served or failed (served at once, or answered now and delivered after later
live batches, as a publisher's answer can be overtaken by its next PUB frame), probes, and
restarts (announced by their first batch, seq 0:
a restart whose first batches are all lost is not detectable from sequence numbers).

Invariants after every rule, for the engine as of the feed's ``last_seq``:

* known: the index holds exactly the engine's blocks, copy for copy;
* always: every block the index holds, the engine holds (never false credit).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trio_pdrouter.kv import Batch, BlockIndex, Event, Feed, block_keys, decode_payload
from trio_pdrouter_sim.kv_events import KvJournal

BS = 2
PROMPTS = [(1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 9, 9), (7, 7, 1, 2), (1, 2)]


class RecordingIndex(BlockIndex):
    """Remembers the events it applied last (to know which engine process they came from)."""

    last_events: object = None

    def apply(self, events: Iterable[Event], *, live: bool = True) -> None:
        self.last_events = events
        super().apply(events, live=live)


class FeedMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.journal = KvJournal(0, BS, pub=None, buffer=4)
        self.index = RecordingIndex(BS, {"GPU": 1.0}, budget=10_000)
        self.feed = Feed(self.index, can_replay=True)
        self.gen = 0
        #: id of a decoded batch's events -> (engine process, seq); the batches are kept alive.
        self.origin: dict[int, tuple[int, int]] = {}
        self.decoded: list[Batch] = []
        self.truths: dict[int, dict[int, Counter[int]]] = {0: {}}
        #: block id -> (parent block id or None, its tokens, own key); copies held.
        self.blocks: dict[int, tuple[int | None, tuple[int, ...], int]] = {}
        self.copies: Counter[int] = Counter()
        self.truth: dict[int, Counter[int]] = {}
        self.asked: int | None = None
        #: A replay answered but not yet delivered: (asked from, ask number, its batches).
        self.answer: tuple[int, int, list[Batch]] | None = None
        self._next_id = 1

    def _decode(self, payload: bytes, seq: int) -> Batch:
        batch = decode_payload(payload, seq)
        self.decoded.append(batch)
        self.origin[id(batch.events)] = (self.gen, seq)
        return batch

    # -- the engine ---------------------------------------------------------------------

    def _publish(self, deliver: bool) -> None:
        seq = self.journal.next_seq
        self.journal.step()
        if self.journal.next_seq == seq:
            return
        self.truths[self.gen][seq] = Counter(
            {self.blocks[b][2]: n for b, n in self.copies.items() if n > 0}
        )
        if deliver:
            payload = self.journal.buffer[-1][1]
            self._ask(self.feed.live(self._decode(payload, seq)))

    def _ask(self, start: int | None) -> None:
        assert start == self.feed.wanted or start is None
        self.asked = self.feed.wanted

    @rule(prompt=st.sampled_from(PROMPTS), duplicate=st.booleans(), deliver=st.booleans())
    def store(self, prompt: tuple[int, ...], duplicate: bool, deliver: bool) -> None:
        keys = block_keys(prompt, BS)
        parent: int | None = None
        run: list[int] = []
        run_parent: int | None = None
        for i, key in enumerate(keys):
            tokens = prompt[i * BS : (i + 1) * BS]
            existing = next(
                (b for b, (p, t, _) in self.blocks.items() if p == parent and t == tokens), None
            )
            if existing is not None and self.copies[existing] > 0 and not duplicate:
                if run:
                    self._store_run(run, run_parent)
                    run = []
                parent = existing
                continue
            block = existing if existing is not None else self._new_block(parent, tokens, key)
            if not run:
                run_parent = parent
            run.append(block)
            self.copies[block] += 1
            parent = block
        if run:
            self._store_run(run, run_parent)
        self._publish(deliver)

    def _new_block(self, parent: int | None, tokens: tuple[int, ...], key: int) -> int:
        block = self._next_id
        self._next_id += 1
        self.blocks[block] = (parent, tokens, key)
        return block

    def _store_run(self, run: list[int], parent: int | None) -> None:
        tokens = [t for b in run for t in self.blocks[b][1]]
        self.journal.stored(run, parent, tokens)

    @precondition(lambda self: any(n > 0 for n in self.copies.values()))
    @rule(data=st.data(), deliver=st.booleans())
    def remove(self, data: st.DataObject, deliver: bool) -> None:
        held = sorted(b for b, n in self.copies.items() if n > 0)
        block = data.draw(st.sampled_from(held))
        self.copies[block] -= 1
        self.journal.removed([block])
        self._publish(deliver)

    @rule(deliver=st.booleans())
    def clear(self, deliver: bool) -> None:
        self.copies.clear()
        self.journal.cleared()
        self._publish(deliver)

    @rule(prompt=st.sampled_from(PROMPTS))
    def restart(self, prompt: tuple[int, ...]) -> None:
        self.journal.restart()
        self.copies.clear()
        self.blocks.clear()
        self.gen += 1
        self.truths[self.gen] = {}
        self.store(prompt, duplicate=False, deliver=True)

    # -- the router's side --------------------------------------------------------------

    @precondition(lambda self: self.asked is not None)
    @rule()
    def serve_replay(self) -> None:
        assert self.asked is not None
        start = self.asked
        self._ask(self.feed.replayed(start, self._replay_batches(start), ask=self.feed.asks))

    def _replay_batches(self, start: int) -> list[Batch]:
        frames = self.journal.replay_frames(start)
        return [
            self._decode(payload, int.from_bytes(seq, "big", signed=True))
            for _, _, seq, payload in frames[:-1]
        ]

    @precondition(lambda self: self.asked is not None and self.answer is None)
    @rule()
    def answer_replay(self) -> None:
        """The publisher answers now; the answer reaches the feed later (deliver_answer)."""
        assert self.asked is not None
        self.answer = (self.asked, self.feed.asks, self._replay_batches(self.asked))

    @precondition(lambda self: self.answer is not None)
    @rule()
    def deliver_answer(self) -> None:
        assert self.answer is not None
        start, ask, batches = self.answer
        self.answer = None
        if start == self.feed.wanted:
            self._ask(self.feed.replayed(start, batches, ask=ask))

    @precondition(lambda self: self.asked is not None)
    @rule()
    def fail_replay(self) -> None:
        assert self.asked is not None
        self._ask(self.feed.replay_failed(self.asked, ask=self.feed.asks))

    @precondition(lambda self: bool(self.journal.buffer))
    @rule(data=st.data())
    def late_copy(self, data: st.DataObject) -> None:
        """A batch still buffered arrives live again, as a frame the subscriber had queued
        while a replay delivered the same batch does."""
        seq, payload = data.draw(st.sampled_from(list(self.journal.buffer)))
        self._ask(self.feed.live(self._decode(payload, seq)))

    @precondition(lambda self: self.asked is None)
    @rule()
    def probe(self) -> None:
        self._ask(self.feed.probe())

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def never_false_credit(self) -> None:
        held = Counter(self.index.held_keys())
        if self.index.last_events is None:
            assert not held
            return
        gen, seq = self.origin[id(self.index.last_events)]
        truth = self.truths[gen][seq]
        assert set(held) <= set(truth), (held, truth)
        if self.feed.known:
            assert gen == self.gen and seq == self.feed.last_seq
            assert held == truth


TestFeedMachine = FeedMachine.TestCase


def test_a_probe_answered_before_the_next_batch_keeps_the_engine_known() -> None:
    """A probe from ``last + 1`` is answered empty, and the batch ``last + 1`` (published just
    after the answer) arrives live before it: nothing was lost, the feed stays exact."""
    journal = KvJournal(0, BS, pub=None, buffer=8)
    index = BlockIndex(BS, {"GPU": 1.0}, budget=100)
    feed = Feed(index, can_replay=True)

    def publish(block: int, tokens: tuple[int, ...]) -> Batch:
        seq = journal.next_seq
        journal.stored([block], None, list(tokens))
        journal.step()
        return decode_payload(journal.buffer[-1][1], seq)

    assert feed.live(publish(1, (1, 2))) is None  # seq 0: exact from the start
    start = feed.probe()
    assert start == 1
    assert len(journal.replay_frames(start)) == 1  # the answer: only the end marker
    assert feed.live(publish(2, (3, 4))) is None  # seq 1, live, buffered during the replay
    assert feed.replayed(start, [], ask=feed.asks) is None
    assert feed.known and feed.last_seq == 1
    assert set(index.held_keys()) == set(block_keys((1, 2), BS) + block_keys((3, 4), BS))


def test_late_live_copies_of_replayed_batches_are_not_a_restart() -> None:
    """At startup a replay delivers seq 0 and 1 while their live frames are still queued: the
    copies that follow are dropped; a restarted publisher's seq 0 (a later timestamp) is not."""
    journal = KvJournal(0, BS, pub=None, buffer=8)
    index = BlockIndex(BS, {"GPU": 1.0}, budget=100)
    feed = Feed(index, can_replay=True)
    for block, tokens in ((1, (1, 2)), (2, (3, 4))):
        journal.stored([block], None, list(tokens))
        journal.step()
    copies = [decode_payload(payload, seq) for seq, payload in journal.buffer]
    start = feed.probe()
    assert start == 0
    replay = [decode_payload(p, s) for s, p in journal.buffer]
    assert feed.replayed(start, replay, ask=feed.asks) is None
    held = set(index.held_keys())
    for copy in copies:
        assert feed.live(copy) is None
    assert feed.known and feed.restarts == 0 and feed.last_seq == 1
    assert set(index.held_keys()) == held
    journal.restart()
    journal.stored([7], None, [5, 6])
    journal.step()
    assert feed.live(decode_payload(journal.buffer[-1][1], 0)) is None
    assert feed.restarts == 1 and feed.known
    assert set(index.held_keys()) == set(block_keys((5, 6), BS))


def _journal_past_its_buffer(published: int, buffer: int) -> KvJournal:
    """A publisher that stored one root block per batch, ``published`` batches, keeping the
    last ``buffer``: its history from seq 0 is gone once ``published > buffer``."""
    journal = KvJournal(0, BS, pub=None, buffer=buffer)
    for block in range(1, published + 1):
        journal.stored([block], None, [block, block])
        journal.step()
    return journal


def _replay(journal: KvJournal, start: int) -> list[Batch]:
    return [
        decode_payload(payload, int.from_bytes(seq, "big", signed=True))
        for _, _, seq, payload in journal.replay_frames(start)[:-1]
    ]


def test_history_beyond_the_buffer_is_replayed_once_then_probes_ask_only_for_what_follows() -> None:
    """A router started in front of an engine that ran longer than its replay buffer: the
    replay from seq 0 starts later, so the feed is UNKNOWN, its index what the buffered batches
    show. Asking from 0 again cannot help (the publisher's history only moves on): the next
    probes ask from ``last + 1`` and keep the index, instead of re-reading the whole buffer
    every probe interval and emptying the index each time."""
    journal = _journal_past_its_buffer(published=8, buffer=4)
    index = BlockIndex(BS, {"GPU": 1.0}, budget=100)
    feed = Feed(index, can_replay=True)
    assert feed.probe() == 0
    assert feed.replayed(0, _replay(journal, 0), ask=feed.asks) is None
    buffered = {key for block in range(5, 9) for key in block_keys((block, block), BS)}
    assert not feed.known and feed.last_seq == 7
    assert set(index.held_keys()) == buffered
    for _ in range(3):
        start = feed.probe()
        assert start == 8
        assert feed.replayed(start, _replay(journal, start), ask=feed.asks) is None
        assert not feed.known and set(index.held_keys()) == buffered
    # A gap is filled from where it starts, not from 0, and the index stays what it was.
    journal.stored([9], None, [9, 9])
    journal.step()  # seq 8, lost
    journal.stored([10], None, [10, 10])
    journal.step()  # seq 9
    assert feed.live(decode_payload(journal.buffer[-1][1], 9)) == 8
    assert feed.replayed(8, _replay(journal, 8), ask=feed.asks) is None
    more = buffered | set(block_keys((9, 9), BS)) | set(block_keys((10, 10), BS))
    assert feed.last_seq == 9 and set(index.held_keys()) == more and not feed.known


def test_a_restart_after_history_was_lost_makes_replays_from_zero_useful_again() -> None:
    """Once the publisher restarts (seq goes back), its new history starts at 0 again: a batch
    lost right after the restart is asked from 0, and the feed is exact again."""
    journal = _journal_past_its_buffer(published=8, buffer=4)
    index = BlockIndex(BS, {"GPU": 1.0}, budget=100)
    feed = Feed(index, can_replay=True)
    feed.probe()
    feed.replayed(0, _replay(journal, 0), ask=feed.asks)
    journal.restart()
    for block in (20, 21):
        journal.stored([block], None, [block, block])
        journal.step()
    # seq 0 of the new process is lost; seq 1 shows the restart.
    assert feed.live(decode_payload(journal.buffer[-1][1], 1)) == 0
    assert feed.replayed(0, _replay(journal, 0), ask=feed.asks) is None
    assert feed.known and feed.restarts == 1
    assert set(index.held_keys()) == {
        key for block in (20, 21) for key in block_keys((block, block), BS)
    }


def test_a_probe_from_zero_that_finds_history_lost_rebuilds_what_the_buffer_shows() -> None:
    """An UNKNOWN feed that already applied live batches (its first replay failed) probes from
    0 and finds the history gone: the replayed batches still rebuild the index (what they show
    the engine holding), rather than all being skipped as already seen."""
    journal = _journal_past_its_buffer(published=8, buffer=4)
    index = BlockIndex(BS, {"GPU": 1.0}, budget=100)
    feed = Feed(index, can_replay=True)
    assert feed.live(decode_payload(journal.buffer[-1][1], 7)) == 0
    assert feed.replay_failed(0, ask=feed.asks) is None
    assert not feed.known and feed.last_seq == 7
    assert feed.probe() == 0
    assert feed.replayed(0, _replay(journal, 0), ask=feed.asks) is None
    assert set(index.held_keys()) == {
        key for block in range(5, 9) for key in block_keys((block, block), BS)
    }
    assert feed.probe() == 8


def test_a_replay_answered_before_a_restart_and_delivered_after_it_gives_no_false_credit() -> None:
    """The engine answers a replay from 0, restarts, and its new seq 0 arrives live before the
    answer: the new seq 0 is not the batch the answer carried (another timestamp), so it is
    taken as the restart it is, not skipped as already replayed (which left the old process's
    blocks credited as exact). Found by the state machine."""
    journal = KvJournal(0, BS, pub=None, buffer=8)
    index = BlockIndex(BS, {"GPU": 1.0}, budget=100)
    feed = Feed(index, can_replay=True)
    assert feed.probe() == 0
    journal.stored([1], None, [1, 2])
    journal.step()  # old process, seq 0: not delivered live
    answer = _replay(journal, 0)
    journal.restart()
    journal.stored([2], None, [3, 4])
    journal.step()  # new process, seq 0: delivered live while the answer is on its way
    assert feed.live(decode_payload(journal.buffer[-1][1], 0)) is None
    feed.replayed(0, answer, ask=feed.asks)
    assert set(index.held_keys()) == set(block_keys((3, 4), BS))
    assert feed.known and feed.restarts == 1


def test_a_replay_passes_over_the_batches_a_clear_in_it_wiped() -> None:
    """An engine that cleared its cache (a reset) since its buffer began: the replay applies
    the clear and what follows only, and the index is the engine's. The live copies of the
    batches passed over, still queued, are no restart; a restarted publisher's batch under one
    of their seqs (a later timestamp) is."""
    journal = KvJournal(0, BS, pub=None, buffer=8)
    for block in range(1, 4):
        journal.stored([block], None, [block, block])
        journal.step()
    journal.cleared()
    journal.step()
    journal.stored([9], None, [9, 9])
    journal.step()
    copies = [decode_payload(payload, seq) for seq, payload in journal.buffer]
    index = RecordingIndex(BS, {"GPU": 1.0}, budget=100)
    applied: list[object] = []
    original = index.apply

    def counting(events: Iterable[Event], *, live: bool = True) -> None:
        applied.append(events)
        original(events, live=live)

    index.apply = counting  # type: ignore[method-assign]
    feed = Feed(index, can_replay=True)
    assert feed.probe() == 0
    assert feed.replayed(0, _replay(journal, 0), ask=feed.asks) is None
    assert len(applied) == 2  # the clear's batch and the one after it
    assert feed.known and feed.last_seq == 4
    assert set(index.held_keys()) == set(block_keys((9, 9), BS))
    for copy in copies:
        assert feed.live(copy) is None
    assert feed.restarts == 0 and feed.known
    assert set(index.held_keys()) == set(block_keys((9, 9), BS))
    journal.restart()
    journal.stored([7], None, [5, 6])
    journal.step()
    journal.stored([8], None, [6, 6])
    journal.step()
    assert feed.live(decode_payload(journal.buffer[-1][1], 1)) == 0  # seq 1 again: a restart
    assert feed.restarts == 1
