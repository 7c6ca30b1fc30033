"""``kv_aware``: credit from known engines' forecasts (the index and the prompts in flight),
the estimate for unknown ones, load as the balance test and the tie-break."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.kv import DOUBT_BATCHES, BlockIndex, BlockRemoved, BlockStored
from trio_pdrouter.ledger import LoadLedger
from trio_pdrouter.machine import MachineTable, PrefixRing
from trio_pdrouter.routing import KvAware, NoHealthyEndpoint, PolicySettings, Routing, RoutingKey
from trio_pdrouter.routing.policies import RoundRobin

BS = 4
EPS = [Endpoint(f"http://10.0.0.{i}:8000", Role.PREFILL) for i in range(3)]
TOKENS = tuple(range(100, 132))  # 8 blocks
TEXT = "the prompt's routing text " * 4


class View:
    block_size = BS

    def __init__(self) -> None:
        self.indexes = {ep.url: BlockIndex(BS, {"GPU": 1.0, "CPU": 0.5}, 1000) for ep in EPS}
        self.known = {ep.url: True for ep in EPS}

    def index(self, url: str, rank: int | None) -> tuple[BlockIndex, bool]:
        return self.indexes[url], self.known[url]

    def store(self, ep: Endpoint, blocks: int, medium: str = "GPU") -> None:
        hashes = tuple(range(1, blocks + 1))
        event = BlockStored(hashes, None, TOKENS[: blocks * BS], BS, medium, True)
        self.indexes[ep.url].apply([event])


def make(view: View | None, seed: int = 0, **overrides: object) -> KvAware:
    given: dict[str, object] = {
        "balance_abs_threshold": 32,
        "balance_rel_threshold": 1.5,
        "load_metric": "requests",
    }
    settings = PolicySettings(**{**given, **overrides})  # type: ignore[arg-type]
    reasons: list[str] = []
    policy = KvAware(
        settings,
        random.Random(seed),
        stage="prefill",
        on_decision=lambda _stage, reason: reasons.append(reason),
        view=view,
    )
    policy.set_endpoints(EPS)
    return policy


KEY = RoutingKey(text=TEXT, tokens=TOKENS)


def test_the_engine_holding_the_longest_prefix_wins_over_a_little_load() -> None:
    view = View()
    view.store(EPS[1], 6)
    view.store(EPS[2], 2)
    policy = make(view)
    loads = {EPS[0]: 0, EPS[1]: 5, EPS[2]: 0}
    assert policy.choose(EPS, loads, KEY) == EPS[1]
    assert policy.last.blocks == 6 and policy.last.known and policy.last.reason == "kv_hit"


def test_with_token_loads_a_hit_wins_until_the_loads_are_unbalanced() -> None:
    view = View()
    view.store(EPS[1], 6)  # 6 of the prompt's 8 blocks: 24 of 32 tokens cached
    policy = make(view, load_metric="tokens")  # --balance-token-threshold 0
    key = RoutingKey(text=TEXT, prompt_tokens=len(TOKENS), tokens=TOKENS)
    assert policy.uncached_tokens(EPS, key) == {EPS[0]: 32, EPS[1]: 8, EPS[2]: 32}
    # Loads are the tokens queued plus this request's uncached tokens there (routing's sum).
    # 198 on EPS[1] against 132: not over 1.5 times, so the hit wins.
    assert policy.choose(EPS, {EPS[0]: 100 + 32, EPS[1]: 190 + 8, EPS[2]: 100 + 32}, key) == EPS[1]
    assert policy.last.reason == "kv_hit"
    # 200: over 1.5 times, and the least loaded then finishes this prefill first.
    assert policy.choose(EPS, {EPS[0]: 100 + 32, EPS[1]: 192 + 8, EPS[2]: 100 + 32}, key) != EPS[1]
    assert policy.last.reason == "unbalanced"
    # --balance-token-threshold is the absolute part of the test, as in cache_aware.
    wide = make(view, load_metric="tokens", balance_token_threshold=100)
    assert wide.choose(EPS, {EPS[0]: 100 + 32, EPS[1]: 192 + 8, EPS[2]: 100 + 32}, key) == EPS[1]


def test_by_default_it_balances_from_1_5_times_the_least_load_as_cache_aware_does() -> None:
    view = View()
    view.store(EPS[1], 6)
    key = RoutingKey(text=TEXT, prompt_tokens=len(TOKENS), tokens=TOKENS)
    default = PolicySettings().balance_rel_threshold
    assert default == 1.5  # vllm-router's
    policy = make(view, load_metric="tokens", balance_rel_threshold=default)
    below = {EPS[0]: 100 + 32, EPS[1]: 190 + 8, EPS[2]: 100 + 32}  # 198 against 132: 1.5x
    assert policy.choose(EPS, below, key) == EPS[1]
    assert policy.last.reason == "kv_hit"
    over = {EPS[0]: 100 + 32, EPS[1]: 191 + 8, EPS[2]: 100 + 32}  # 199 against 132: 1.508x
    assert policy.choose(EPS, over, key) != EPS[1]
    assert policy.last.reason == "unbalanced"
    # The flag given holds for kv_aware as for cache_aware.
    tight = make(view, load_metric="tokens", balance_rel_threshold=1.2)
    assert tight.choose(EPS, below, key) != EPS[1]
    assert tight.last.reason == "unbalanced"


def test_between_balanced_loads_the_larger_hit_wins_and_load_decides_between_equal_ones() -> None:
    view = View()
    view.store(EPS[1], 6)
    view.store(EPS[2], 5)
    key = RoutingKey(text=TEXT, prompt_tokens=len(TOKENS), tokens=TOKENS)
    # EPS[1] holds one block more (1/8 of the prompt): it wins though a third busier.
    policy = make(view, load_metric="tokens")
    assert policy.choose(EPS, {EPS[0]: 100, EPS[1]: 150, EPS[2]: 100}, key) == EPS[1]
    view.store(EPS[2], 6)
    # Equal hits: the less loaded, by any margin (fresh policies: the choice above sent the
    # whole prompt to EPS[1], whose forecast now holds all of it).
    equal = {EPS[0]: 100, EPS[1]: 101, EPS[2]: 100}
    assert make(view, load_metric="tokens").choose(EPS, equal, key) == EPS[2]
    equal = {EPS[0]: 100, EPS[1]: 100, EPS[2]: 101}
    assert make(view, load_metric="tokens").choose(EPS, equal, key) == EPS[1]


def test_requests_following_a_miss_find_its_prompt_where_it_was_sent() -> None:
    view = View()
    policy = make(view, load_metric="tokens")
    key = RoutingKey(text=TEXT, prompt_tokens=len(TOKENS), tokens=TOKENS)
    loads = {EPS[0]: 100, EPS[1]: 130, EPS[2]: 100}
    first = policy.choose(EPS, {EPS[0]: 100, EPS[1]: 90, EPS[2]: 100}, key)
    assert first == EPS[1] and policy.last.reason == "miss"  # nothing held: the least loaded
    # Not stored yet (the index holds nothing), but computed before anything sent after it:
    # EPS[1] will hold it, busier or not.
    assert [policy.choose(EPS, loads, key) for _ in range(5)] == [EPS[1]] * 5
    assert policy.last.reason == "kv_hit" and policy.last.blocks == 8
    # A prefix sent nowhere before: the least loaded.
    other = RoutingKey(text="another routing text " * 4, prompt_tokens=32, tokens=TOKENS[::-1])
    assert policy.choose(EPS, loads, other) in (EPS[0], EPS[2])
    assert policy.last.reason == "miss"


def test_with_part_of_the_traffic_it_judges_by_the_index_and_sends_a_miss_home() -> None:
    """Where other routers send an engine work too (replicas, ``--workers``), this router's
    forecast misses their prompts: the engines are judged by what they hold now, which every
    router sees alike, and a prompt held nowhere goes where this router sent its prefix last."""
    view = View()
    policy = make(view, load_metric="tokens")
    for i, ep in enumerate(EPS):  # a prompt of its own stored on each engine: counting starts
        mine = tuple(range(700 + 10 * i, 708 + 10 * i))
        sent = RoutingKey(text=f"mine {i}", prompt_tokens=8, tokens=mine)
        assert policy.choose(EPS, {e: 0 if e == ep else 50 for e in EPS}, sent) == ep
        stored = BlockStored((801 + 2 * i, 802 + 2 * i), None, mine, BS, "GPU", True)
        view.indexes[ep.url].apply([stored])
    others = tuple(range(900, 932))
    for ep in EPS:  # every engine stores blocks this router never sent
        view.indexes[ep.url].apply([BlockStored((901, 902), None, others[:8], BS, "GPU", True)])
    key = RoutingKey(text=TEXT, prompt_tokens=len(TOKENS), tokens=TOKENS)
    loads = {EPS[0]: 100, EPS[1]: 130, EPS[2]: 100}
    first = policy.choose(EPS, {EPS[0]: 100, EPS[1]: 90, EPS[2]: 100}, key)
    assert first == EPS[1] and policy.last.reason == "miss"  # nothing held: the least loaded
    # Held nowhere yet: it goes back to EPS[1], busier or not, charged as the estimate's hit.
    assert policy.uncached_tokens(EPS, key) == {EPS[0]: 32, EPS[1]: 0, EPS[2]: 32}
    assert [policy.choose(EPS, loads, key) for _ in range(5)] == [EPS[1]] * 5
    assert policy.last.reason == "home"
    # Blocks the index shows count as they are, whatever was sent there since.
    view.store(EPS[2], 8)
    assert policy.choose(EPS, loads, key) == EPS[2] and policy.last.reason == "kv_hit"


def prefill_routing(view: View) -> tuple[Routing, LoadLedger]:
    ledger = LoadLedger(EPS)
    routing = Routing(
        {Role.PREFILL: make(view, load_metric="tokens")},
        ledger,
        (),
        None,
        by_tokens=(Role.PREFILL,),
        models=None,
    )
    routing.set_endpoints(Role.PREFILL, EPS)
    return routing, ledger


def batches_go_by(view: View) -> None:
    """Enough batches from every engine, changing nothing, for a prompt's store to have been
    read had there been one."""
    for _ in range(DOUBT_BATCHES):
        for index in view.indexes.values():
            index.apply([BlockRemoved((999_999,), "GPU")])


def test_a_prompt_sent_is_forecast_until_its_lease_ends_and_the_engine_never_stored_it() -> None:
    view = View()
    routing, _ledger = prefill_routing(view)
    key = RoutingKey(text=TEXT, prompt_tokens=len(TOKENS), tokens=TOKENS)
    lease, chosen = routing.lease_one(Role.PREFILL, key)
    expected = {e: 0 if e == chosen else 32 for e in EPS}
    batches_go_by(view)
    assert routing.weights(Role.PREFILL, EPS, key) == expected  # in flight: it will be there
    lease.release_all()  # refused, say: the engine's events never store it
    batches_go_by(view)
    assert routing.weights(Role.PREFILL, EPS, key) == dict.fromkeys(EPS, 32)
    # A choice with no lease (a decode to reclaim blocks on) forecasts nothing past the batch.
    routing.choose(Role.PREFILL, key)
    batches_go_by(view)
    assert routing.weights(Role.PREFILL, EPS, key) == dict.fromkeys(EPS, 32)


def test_a_prefill_chosen_for_a_request_no_decode_can_take_is_not_forecast() -> None:
    view = View()
    ledger = LoadLedger(EPS)
    prefill = make(view, load_metric="tokens")
    routing = Routing(
        {Role.PREFILL: prefill, Role.DECODE: RoundRobin(random.Random(0))},
        ledger,
        (),
        None,
        by_tokens=(Role.PREFILL,),
        models=None,
    )
    routing.set_endpoints(Role.PREFILL, EPS)
    key = RoutingKey(text=TEXT, prompt_tokens=len(TOKENS), tokens=TOKENS)
    with pytest.raises(NoHealthyEndpoint):
        routing.lease_pd(key)  # no decode endpoint at all
    batches_go_by(view)
    assert routing.weights(Role.PREFILL, EPS, key) == dict.fromkeys(EPS, 32)
    assert ledger.token_total() == 0


def test_prefill_is_charged_the_tokens_past_the_blocks_the_index_shows() -> None:
    view = View()
    view.store(EPS[1], 6)
    routing, ledger = prefill_routing(view)
    key = RoutingKey(text=TEXT, prompt_tokens=len(TOKENS), tokens=TOKENS)
    assert routing.weights(Role.PREFILL, EPS, key) == {EPS[0]: 32, EPS[1]: 8, EPS[2]: 32}
    lease, chosen = routing.lease_one(Role.PREFILL, key)
    assert chosen == EPS[1] and ledger.token_load(EPS[1]) == 8
    lease.release_all()
    assert ledger.token_total() == 0


def test_hits_in_flight_do_not_push_the_next_request_off_the_engine_holding_its_prefix() -> None:
    view = View()
    view.store(EPS[1], 6)
    routing, ledger = prefill_routing(view)
    key = RoutingKey(text=TEXT, prompt_tokens=len(TOKENS), tokens=TOKENS)
    # The first computes the 2 blocks EPS[1] lacks (8 tokens); those after it find the whole
    # prompt there, so EPS[1] stays the quickest (8 + 0 + 0 against 32 elsewhere).
    chosen = [routing.lease_one(Role.PREFILL, key)[1] for _ in range(3)]
    assert chosen == [EPS[1]] * 3 and ledger.token_load(EPS[1]) == 8


def test_requests_following_a_miss_are_charged_as_hits_where_it_went() -> None:
    routing, ledger = prefill_routing(View())  # the index holds nothing anywhere
    key = RoutingKey(text=TEXT, prompt_tokens=len(TOKENS), tokens=TOKENS)
    first = routing.lease_one(Role.PREFILL, key)[1]
    assert ledger.token_load(first) == 32  # held nowhere: the whole prompt
    # Until its blocks are stored, the index shows them nowhere; a request with the same prompt
    # queues behind the first and finds them, so the forecast charges it there as a hit.
    assert routing.weights(Role.PREFILL, EPS, key) == {e: 0 if e == first else 32 for e in EPS}
    # 32 + 0 there against 0 + 32 elsewhere: balanced, so it follows the first.
    assert routing.lease_one(Role.PREFILL, key)[1] == first
    assert ledger.token_load(first) == 32


def test_an_evicted_prefix_earns_nothing() -> None:
    view = View()
    view.store(EPS[1], 8)
    view.indexes[EPS[1].url].apply([BlockRemoved((1,), "GPU")])  # the root: nothing leads
    policies = [make(view, seed=i) for i in range(60)]  # fresh: no home for the prefix yet
    counts = Counter(p.choose(EPS, dict.fromkeys(EPS, 0), KEY) for p in policies)
    assert set(counts) == set(EPS)  # a miss everywhere: ties spread
    assert all(p.last.reason == "miss" for p in policies)


def test_an_off_gpu_block_counts_its_penalty() -> None:
    view = View()
    view.store(EPS[0], 8, "CPU")  # 8 * 0.5 = 4 blocks' worth
    view.store(EPS[1], 5)
    policy = make(view)
    assert policy.choose(EPS, dict.fromkeys(EPS, 0), KEY) == EPS[1]


def test_an_unknown_engine_is_judged_by_the_estimate_or_its_lower_bound() -> None:
    view = View()
    view.store(EPS[0], 2)  # what EPS[0] stored since its loss
    view.known[EPS[0].url] = False
    view.known[EPS[2].url] = False
    policy = make(view)
    loads = dict.fromkeys(EPS, 0)
    policy.estimate.tree.insert(TEXT, EPS[2])  # the estimate says EPS[2] saw this text
    assert policy.choose(EPS, loads, KEY) == EPS[2]  # the estimate's full match beats 2/8
    assert policy.last.reason == "estimate_hit" and not policy.last.known
    view.store(EPS[0], 8)
    fresh = make(view)
    fresh.estimate.tree.insert(TEXT[:20], EPS[2])  # the estimate's short match: 8/8 wins
    assert fresh.choose(EPS, loads, KEY) == EPS[0] and not fresh.last.known


def test_without_tokens_it_decides_as_cache_aware() -> None:
    policy = make(View())
    policy.estimate.tree.insert(TEXT, EPS[1])
    key = RoutingKey(text=TEXT)
    assert policy.choose(EPS, dict.fromkeys(EPS, 0), key) == EPS[1]
    assert policy.last.reason == "no_tokens"
    assert make(None).choose(EPS, dict.fromkeys(EPS, 0), KEY) in EPS


def test_an_adapters_request_is_not_looked_up_in_the_base_models_blocks() -> None:
    """vLLM hashes an adapter's blocks apart: the base model's blocks on EPS[1] are no hit for
    it; it goes where the adapter's own prompts went (its estimate tree), and is charged whole."""
    view = View()
    view.store(EPS[1], 8)  # the base model's blocks of these very tokens
    policy = make(view)
    policy.estimate.tree_of("sql-lora").insert(TEXT, EPS[2])
    key = RoutingKey(text=TEXT, tokens=TOKENS, prompt_tokens=32, model="sql-lora", adapter=True)
    even = dict.fromkeys(EPS, 0)
    assert policy.uncached_tokens(EPS, key)[EPS[1]] == 32
    assert policy.choose(EPS, even, key) == EPS[2]
    assert policy.last.reason == "adapter"
    base = RoutingKey(text=TEXT, tokens=TOKENS, model="base")
    assert policy.choose(EPS, even, base) == EPS[1]  # the base model's request: a hit
    assert policy.last.reason == "kv_hit"


def test_unbalanced_loads_go_to_the_least_loaded() -> None:
    view = View()
    view.store(EPS[1], 8)
    policy = make(view)
    loads = {EPS[0]: 100, EPS[1]: 100, EPS[2]: 1}
    assert policy.choose(EPS, loads, KEY) == EPS[2]
    assert policy.last.reason == "unbalanced"


def test_balanced_loads_never_outweigh_a_hit() -> None:
    view = View()
    view.store(EPS[1], 8)
    policy = make(view)
    loads = {EPS[0]: 32, EPS[1]: 32, EPS[2]: 0}  # 32 more: at the threshold, still balanced
    assert policy.choose(EPS, loads, KEY) == EPS[1]
    assert policy.last.reason == "kv_hit"
    assert policy.choose(EPS, {**loads, EPS[1]: 33}, KEY) == EPS[2]
    assert policy.last.reason == "unbalanced"


def test_a_hit_at_or_below_the_cache_threshold_counts_as_none() -> None:
    view = View()
    view.store(EPS[1], 2)  # 2 of 8 blocks: 0.25
    loads = {EPS[0]: 3, EPS[1]: 3, EPS[2]: 0}
    at_threshold = make(view, cache_threshold=0.25)
    assert at_threshold.choose(EPS, loads, KEY) == EPS[2]
    assert at_threshold.last.reason == "miss"
    # Chosen as the least loaded, not for its two blocks: a miss too.
    at_threshold = make(view, cache_threshold=0.25)
    assert at_threshold.choose(EPS, {**loads, EPS[1]: 0, EPS[2]: 3}, KEY) == EPS[1]
    assert at_threshold.last.reason == "miss"
    below = make(view, cache_threshold=0.2)
    assert below.choose(EPS, loads, KEY) == EPS[1]
    assert below.last.reason == "kv_hit"


def test_temperature_spreads_choices_by_score() -> None:
    view = View()
    view.store(EPS[1], 8)
    greedy = make(view)
    assert {greedy.choose(EPS, dict.fromkeys(EPS, 0), KEY) for _ in range(30)} == {EPS[1]}
    # Fresh policies: each choice would send the prompt where it goes.
    softs = [make(view, seed=i, router_temperature=0.5) for i in range(300)]
    counts = Counter(soft.choose(EPS, dict.fromkeys(EPS, 0), KEY) for soft in softs)
    assert counts[EPS[1]] > counts[EPS[0]] > 0 and counts[EPS[2]] > 0


def test_with_workers_an_unknown_engine_is_judged_by_what_every_worker_sent_there(
    tmp_path: Path,
) -> None:
    """``--workers N``: the estimate an unknown engine is judged by learns the other workers'
    choices (without the machine's prefix feed each worker would see only its own)."""
    table = MachineTable.create(2, str(tmp_path / "lock"), slots=8)
    try:
        view = View()
        view.known = dict.fromkeys(view.known, False)  # no engine's events are known exact
        workers = []
        for row in range(2):
            policy = KvAware(
                PolicySettings(balance_abs_threshold=32, load_metric="requests"),
                random.Random(row),
                stage="prefill",
                on_decision=lambda _stage, _reason: None,
                view=view,
                feed=PrefixRing(table.prefixes, table.rows, row, "prefill"),
            )
            policy.set_endpoints(EPS)
            workers.append(policy)
        first = workers[0].choose(EPS, {EPS[0]: 3, EPS[1]: 0, EPS[2]: 3}, KEY)
        assert first == EPS[1] and workers[0].last.reason == "miss"
        even = dict.fromkeys(EPS, 0)
        assert [workers[1].choose(EPS, even, KEY) for _ in range(5)] == [EPS[1]] * 5
        assert workers[1].last.reason == "estimate_hit"
    finally:
        table.destroy()


def test_ids_of_the_start_only_count_against_the_whole_prompt() -> None:
    view = View()
    view.store(EPS[1], 6)  # the start's 6 blocks of 4 tokens
    routing, ledger = prefill_routing(view)
    # The ids of the prompt's first 24 tokens are known, the prompt counts 48 (12 blocks).
    key = RoutingKey(text=TEXT, prompt_tokens=48, tokens=TOKENS[:24], partial_tokens=True)
    assert routing.weights(Role.PREFILL, EPS, key) == {EPS[0]: 48, EPS[1]: 24, EPS[2]: 48}
    lease, chosen = routing.lease_one(Role.PREFILL, key)
    assert chosen == EPS[1] and ledger.token_load(EPS[1]) == 24
    lease.release_all()
    # Half the prompt held: a hit above --cache-threshold 0.3, none at 0.5.
    idle = dict.fromkeys(EPS, 0)
    assert make(view, cache_threshold=0.3).choose(EPS, idle, key) == EPS[1]
    policy = make(view, cache_threshold=0.5)
    policy.choose(EPS, idle, key)
    assert policy.last.reason == "miss" and policy.last.total_blocks == 12
    # Had those 24 ids been the whole prompt, all of it would be held.
    whole = RoutingKey(text=TEXT, prompt_tokens=24, tokens=TOKENS[:24])
    assert policy.choose(EPS, idle, whole) == EPS[1] and policy.last.note() == "6/6;known"
