"""The forecast of an engine's prefix cache: the index, plus the prompts sent there and not yet
computed, less what their new blocks evict."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trio_pdrouter.kv import (
    DOUBT_BATCHES,
    AllBlocksCleared,
    BlockIndex,
    BlockRemoved,
    BlockStored,
    Event,
    Forecast,
    block_keys,
)

BS = 2


class Engine:
    """An LRU prefix cache of ``capacity`` blocks publishing its changes to an index, as the
    simulator's does: a prompt computed stores or touches every block, its first block last
    (vLLM evicts a request's tail first), then evicts."""

    def __init__(self, capacity: int, budget: int = 1000) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self.index = BlockIndex(BS, {"GPU": 1.0}, budget)

    def compute(self, tokens: tuple[int, ...], *, publish: bool = True) -> list[Event]:
        events: list[Event] = []
        keys = block_keys(tokens, BS)
        parent: int | None = None
        for i, key in enumerate(keys):
            block = tokens[i * BS : (i + 1) * BS]
            if key not in self.blocks:
                self.blocks[key] = block
                events.append(BlockStored((key,), parent, block, BS, "GPU", True))
            parent = key
        for key in reversed(keys):
            self.blocks.move_to_end(key)
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        if evicted:
            events.append(BlockRemoved(tuple(evicted), "GPU"))
        if publish:
            self.index.apply(events)
        return events

    def clear(self) -> list[Event]:
        self.blocks.clear()
        return [AllBlocksCleared()]


def prompt(group: int, blocks: int = 3) -> tuple[int, ...]:
    return tuple(1000 * group + i for i in range(blocks * BS))


def keys(group: int, blocks: int = 3) -> list[int]:
    return block_keys(prompt(group, blocks), BS)


def warm(engine: Engine) -> None:
    """Fill the engine past its capacity so the forecast learns it."""
    for group in range(1, 5):
        engine.compute(prompt(100 + group))


def warmed() -> tuple[Engine, Forecast]:
    """An engine of 6 blocks, full, and a forecast that learnt its size."""
    engine = Engine(capacity=6)
    forecast = Forecast(engine.index)
    warm(engine)
    assert forecast.capacity == 6
    return engine, forecast


def test_it_starts_from_what_the_index_holds_and_learns_the_capacity_from_evictions() -> None:
    engine = Engine(capacity=6)
    engine.compute(prompt(1))
    forecast = Forecast(engine.index)
    assert forecast.match(keys(1)) == 3
    assert forecast.capacity == engine.index.budget  # nothing evicted yet: no bound learnt
    warm(engine)
    assert forecast.capacity == 6
    assert forecast.match(keys(1)) == 0  # evicted, and no prompt in flight brings it back


def test_a_prefix_held_now_is_gone_for_a_request_queued_behind_prompts_that_evict_it() -> None:
    engine, forecast = warmed()
    engine.compute(prompt(1))
    assert forecast.match(keys(1)) == 3
    # Two new prompts of 3 blocks each are sent there first: computed, they evict group 1.
    forecast.route(keys(2))
    forecast.route(keys(3))
    assert engine.index.held_keys()  # the index still shows it...
    assert forecast.match(keys(1)) == 0  # ...but by this request's turn it is gone
    # A prompt sent there is held for those after it, stored or not.
    assert forecast.match(keys(3)) == 3


def test_a_prefix_loses_its_end_before_its_start_as_vllm_evicts() -> None:
    engine, forecast = warmed()
    engine.compute(prompt(1))
    engine.compute(prompt(2))  # the engine holds groups 1 and 2, group 1 older
    forecast.route(keys(3, blocks=1))  # one new block evicts one: group 1's last
    assert forecast.match(keys(1)) == 2 and forecast.match(keys(2)) == 3
    engine.compute(prompt(3, blocks=1))
    forecast.release(keys(3, blocks=1))
    assert [engine.index.holds(k) for k in keys(1)] == [True, True, False]
    assert list(forecast._history) + list(forecast._lru) == list(engine.blocks)


def test_a_prompt_in_flight_keeps_its_blocks_through_the_engine_evicting_them() -> None:
    engine, forecast = warmed()
    engine.compute(prompt(1))
    forecast.route(keys(1))  # sent again: the engine will touch or store them again
    engine.compute(prompt(2))
    engine.compute(prompt(3))  # other traffic evicts group 1 meanwhile
    assert not any(engine.index.holds(k) for k in keys(1))
    assert forecast.match(keys(1)) == 3
    assert forecast.match(keys(3)) == 3  # and what the engine holds after it stays
    assert forecast.match(keys(2)) == 0  # but group 1, computed, evicts group 2
    engine.compute(prompt(1))  # computed: stored again
    forecast.release(keys(1))
    assert forecast.match(keys(1)) == 3
    engine.compute(prompt(4))
    engine.compute(prompt(5))  # evicted, and nothing in flight awaits it: gone
    assert forecast.match(keys(1)) == 0


def test_a_prompt_the_engine_never_stored_is_dropped_a_few_batches_later() -> None:
    engine = Engine(capacity=60)
    forecast = Forecast(engine.index)
    forecast.route(keys(1))
    forecast.release(keys(1))  # refused: never computed
    for _ in range(DOUBT_BATCHES - 1):  # its store may still be on the way
        engine.index.apply([])
        assert forecast.match(keys(1)) == 3
    engine.index.apply([])  # the engine's batches since did not store it
    assert forecast.match(keys(1)) == 0


def test_a_store_arriving_after_the_answer_keeps_the_prompt() -> None:
    engine, forecast = warmed()
    forecast.route(keys(1))
    engine.compute(prompt(1), publish=False)
    forecast.release(keys(1))  # the answer came first...
    for _ in range(DOUBT_BATCHES - 1):  # ...then batches the router had not read yet...
        engine.index.apply([])
    engine.index.apply([BlockStored(tuple(keys(1)), None, prompt(1), BS, "GPU", True)])
    assert forecast.match(keys(1)) == 3  # ...then its store
    for _ in range(DOUBT_BATCHES):
        engine.index.apply([])
    assert forecast.match(keys(1)) == 3


def test_a_replay_applied_meanwhile_does_not_run_down_a_released_prompt_s_doubt() -> None:
    """At a router's start a long replay is applied while live batches wait: a prompt answered
    meanwhile keeps its credit through it, and its store, read after, is its own."""
    engine = Engine(capacity=60)
    forecast = Forecast(engine.index)
    forecast.route(keys(1))
    engine.compute(prompt(1))  # counting starts
    forecast.release(keys(1))
    forecast.route(keys(2))
    forecast.release(keys(2))  # answered; its store waits behind the replay
    for _ in range(3 * DOUBT_BATCHES):
        engine.index.apply([], live=False)
    assert forecast.match(keys(2)) == 3
    engine.index.apply([BlockStored(tuple(keys(2)), None, prompt(2), BS, "GPU", True)])
    assert forecast.match(keys(2)) == 3
    assert forecast.state()["foreign_share"] == 0.0


def start_behind_a_replay(history: list[int | None], sent: list[int]) -> tuple[Engine, Forecast]:
    """A router starts in front of an engine of 6 blocks that computed ``history`` (groups;
    None: the engine cleared its cache) before it: while the replay of those batches is applied, the router's prompts ``sent`` are
    computed, their batches waiting behind the replay; all but the first are answered before
    the replay is applied (the first after, so the router's counting of stores has begun)."""
    engine = Engine(capacity=6)
    forecast = Forecast(engine.index)
    engine.index.unwatch(forecast)  # the router has read nothing yet
    replay = [
        engine.compute(prompt(group), publish=False) if group else engine.clear()
        for group in history
    ]
    engine.index.watch(forecast)
    live = []
    for group in sent:
        forecast.route(keys(group))
        live.append(engine.compute(prompt(group), publish=False))
    for group in sent[1:]:
        forecast.release(keys(group))
    for batch in replay:
        engine.index.apply(batch, live=False)
    for batch in live:
        engine.index.apply(batch)
    forecast.release(keys(sent[0]))
    return engine, forecast


def test_a_replay_s_stores_are_history_behind_the_prompts_sent_since() -> None:
    """The replay's stores are older than anything the router sent: past the capacity they go
    before the prompts answered during the replay, whose stores, read after, are its own."""
    engine, forecast = start_behind_a_replay([101, 102, 103, 104], [1, 2])
    assert forecast.capacity == 6
    assert forecast.match(keys(1)) == 3 and forecast.match(keys(2)) == 3
    assert forecast.state()["foreign_share"] == 0.0
    assert list(forecast._history) + list(forecast._lru) == list(engine.blocks)


def test_a_replayed_eviction_of_a_block_sent_since_is_history() -> None:
    """A block the engine evicted before the router started and stored again for one of its
    prompts: the replayed removal does not take it from the forecast, and its store is the
    router's own."""
    engine, forecast = start_behind_a_replay([1, 101, 102, 103], [104, 1])
    assert forecast.match(keys(1)) == 3
    assert forecast.state()["foreign_share"] == 0.0
    assert list(forecast._history) + list(forecast._lru) == list(engine.blocks)
    for _ in range(DOUBT_BATCHES):  # stored: it stays once its doubt has run out
        engine.index.apply([])
    assert forecast.match(keys(1)) == 3


def test_a_replayed_clear_is_history_too() -> None:
    """The engine emptied its cache before the router started: the replayed clear forgets what
    it held then, not the prompts sent since."""
    engine, forecast = start_behind_a_replay([101, 102, None, 103], [104, 1])
    assert forecast.match(keys(1)) == 3 and forecast.match(keys(104)) == 3
    assert forecast.state()["foreign_share"] == 0.0
    assert list(forecast._history) + list(forecast._lru) == list(engine.blocks)


def test_a_replayed_eviction_of_a_block_the_engine_never_stored_again_settles() -> None:
    """...but if the prompt never reached the engine, the block goes once its doubt ran out."""
    engine = Engine(capacity=6)
    forecast = Forecast(engine.index)
    engine.index.unwatch(forecast)
    replay = [engine.compute(prompt(group), publish=False) for group in (1, 101, 102, 103)]
    engine.index.watch(forecast)
    engine.index.apply(replay[0], live=False)  # the index holds it when the prompt ends...
    forecast.route(keys(1))
    forecast.release(keys(1))  # ...refused
    for batch in replay[1:]:
        engine.index.apply(batch, live=False)
    for _ in range(DOUBT_BATCHES):
        assert forecast.match(keys(1)) == 3
        engine.index.apply([])
    assert forecast.match(keys(1)) == 0


def test_blocks_stored_by_traffic_the_router_did_not_send_come_in() -> None:
    engine, forecast = warmed()
    engine.compute(prompt(7))  # another replica's request
    assert forecast.match(keys(7)) == 3


def test_a_late_store_of_a_block_the_forecast_evicted_does_not_bring_it_back() -> None:
    engine, forecast = warmed()
    forecast.route(keys(1))
    forecast.route(keys(2))
    forecast.route(keys(3))  # group 1 will be evicted by groups 2 and 3
    engine.compute(prompt(1))  # group 1 computed and stored: its turn came first
    assert forecast.match(keys(1)) == 0
    forecast.release(keys(1))
    assert forecast.match(keys(1)) == 0


def test_a_clear_forgets_what_is_held_but_not_what_is_in_flight() -> None:
    engine, forecast = warmed()
    forecast.route(keys(1))
    engine.index.apply([AllBlocksCleared()])
    assert len(forecast) == 0
    engine.compute(prompt(1))
    forecast.release(keys(1))
    assert forecast.match(keys(1)) == 3


def test_a_router_that_sends_only_part_of_an_engine_s_traffic_has_a_partial_view() -> None:
    engine = Engine(capacity=6)
    forecast = Forecast(engine.index)
    assert forecast.complete  # nothing stored yet: nothing from elsewhere either
    history = [BlockStored((k,), None, (k, k), BS, "GPU", True) for k in range(500, 520)]
    engine.index.apply(history, live=False)  # a replay: history, not traffic from elsewhere
    assert forecast.complete and forecast.match([block_keys((500, 500), BS)[0]]) == 1
    for group in range(1, 21):  # all sent by this router
        forecast.route(keys(group))
        engine.compute(prompt(group))
        forecast.release(keys(group))
    assert forecast.complete
    for group in range(21, 24):  # 3 prompts of 23 from elsewhere: more than a tenth
        engine.compute(prompt(group))
    assert not forecast.complete
    for group in range(24, 60):  # the router's again
        forecast.route(keys(group))
        engine.compute(prompt(group))
        forecast.release(keys(group))
    assert forecast.complete


def test_stores_before_the_router_s_first_prompt_is_stored_are_not_counted() -> None:
    """A router started behind the engine's queue (a previous router's prompts, computed after
    it stopped) is not partial for those; nor for blocks stored again after a loss."""
    engine = Engine(capacity=6)
    forecast = Forecast(engine.index)
    forecast.route(keys(1))
    for group in range(30, 40):  # queued before this router's first prompt
        engine.compute(prompt(group))
    assert forecast.complete
    engine.compute(prompt(1))  # its first prompt: counting starts
    forecast.release(keys(1))
    for group in range(40, 42):  # 2 prompts from elsewhere against 1 of its own
        engine.compute(prompt(group))
    assert not forecast.complete
    for group in range(2, 40):
        forecast.route(keys(group))
        engine.compute(prompt(group))
        forecast.release(keys(group))
    assert forecast.complete
    engine.index.apply([AllBlocksCleared()])  # a loss: counting waits for its next prompt
    for group in range(50, 60):
        engine.compute(prompt(group))
    assert forecast.complete


def test_close_stops_watching() -> None:
    engine = Engine(capacity=6)
    forecast = Forecast(engine.index)
    forecast.close()
    engine.compute(prompt(1))
    assert forecast.match(keys(1)) == 0


class ForecastMachine(RuleBasedStateMachine):
    """Prompts sent, computed in order (published or not), answered, refused, traffic from
    elsewhere and clears, in any interleaving: the forecast never holds a block that neither
    the engine holds nor a prompt in flight will store, once the engine has published a batch
    since; and with every prompt computed in the order sent and every batch published, it
    holds exactly what the engine holds."""

    def __init__(self) -> None:
        super().__init__()
        self.engine = Engine(capacity=8, budget=64)
        self.forecast = Forecast(self.engine.index)
        self.queue: list[tuple[int, ...]] = []  # sent, not computed
        self.computed: list[tuple[int, ...]] = []  # computed, not answered
        self.exact = True  # every change so far happened in the order the forecast assumes
        self.behind: list[list[Event]] | None = None  # batches the router has not read yet

    def publish(self, events: list[Event]) -> None:
        if self.behind is None:
            self.engine.index.apply(events)
        else:
            self.behind.append(events)

    @rule(group=st.integers(1, 6), blocks=st.integers(1, 4))
    def send(self, group: int, blocks: int) -> None:
        tokens = prompt(group, blocks)
        self.forecast.route(block_keys(tokens, BS))
        self.queue.append(tokens)

    @precondition(lambda self: self.queue)
    @rule()
    def compute(self) -> None:
        tokens = self.queue.pop(0)
        self.publish(self.engine.compute(tokens, publish=False))
        self.computed.append(tokens)

    @precondition(lambda self: self.computed)
    @rule()
    def answer(self) -> None:
        self.forecast.release(block_keys(self.computed.pop(0), BS))

    @precondition(lambda self: self.queue)
    @rule()
    def refuse(self) -> None:
        self.forecast.release(block_keys(self.queue.pop(0), BS))
        self.exact = False

    @rule(group=st.integers(1, 6))
    def elsewhere(self, group: int) -> None:
        self.publish(self.engine.compute(prompt(group, 2), publish=False))
        self.exact = False

    @rule()
    def clear(self) -> None:
        self.engine.blocks.clear()
        self.publish([AllBlocksCleared()])
        self.exact = False

    @precondition(lambda self: self.behind is None)
    @rule()
    def fall_behind(self) -> None:
        """Batches are lost to the router from here until :meth:`replay`."""
        self.behind = []

    @precondition(lambda self: self.behind is not None)
    @rule()
    def replay(self) -> None:
        assert self.behind is not None
        for events in self.behind:
            self.engine.index.apply(events, live=False)
        self.behind = None
        self.exact = False

    @invariant()
    def never_credits_what_nothing_will_store(self) -> None:
        if self.behind is not None:  # the router cannot know yet
            return
        awaited = {k for tokens in self.queue + self.computed for k in block_keys(tokens, BS)}
        held = set(self.forecast._history) | set(self.forecast._lru)
        settling = set(self.forecast._settling)
        assert held <= set(self.engine.blocks) | awaited | settling

    @invariant()
    def bounded(self) -> None:
        forecast = self.forecast
        assert len(forecast) <= forecast.capacity
        awaited = {k for tokens in self.queue + self.computed for k in block_keys(tokens, BS)}
        assert set(forecast._awaited) == awaited
        assert set(forecast._expected) <= awaited | set(forecast._settling)

    @invariant()
    def exact_when_the_order_holds(self) -> None:
        forecast = self.forecast
        unsettled = any(not self.engine.index.holds(k) for k in forecast._settling)
        if not self.exact or self.queue or self.computed or unsettled:
            return
        if forecast.capacity != 8:  # not learnt yet
            return
        assert list(forecast._history) + list(forecast._lru) == list(self.engine.blocks)


ForecastMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40)
TestForecastMachine = ForecastMachine.TestCase
