"""The exact block index of one engine: chain keys, copies, tiers, budget, credit."""

from __future__ import annotations

from collections.abc import Sequence

from trio_pdrouter.kv import AllBlocksCleared, BlockIndex, BlockRemoved, BlockStored, block_keys

BS = 4
WEIGHTS = {"GPU": 1.0, "CPU": 0.5}


def stored(
    hashes: list[int], parent: int | None, tokens: list[int], medium: str = "GPU"
) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), BS, medium, True)


def removed(hashes: list[int], medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(tuple(hashes), medium)


TOKENS = list(range(12))
KEYS = block_keys(TOKENS, BS)


def test_a_chain_stored_in_two_events_matches_the_requests_keys() -> None:
    index = BlockIndex(BS, WEIGHTS, budget=100)
    index.apply([stored([1, 2], None, TOKENS[:8]), stored([3], 2, TOKENS[8:])])
    assert index.match(KEYS) == (3, 3.0)
    assert index.match(block_keys([*TOKENS[:8], 99, 99, 99, 99], BS)) == (2, 2.0)
    assert index.match(block_keys([7, *TOKENS[1:]], BS)) == (0, 0.0)


def test_a_duplicate_copy_is_held_until_its_last_remove() -> None:
    index = BlockIndex(BS, WEIGHTS, budget=100)
    index.apply([stored([1], None, TOKENS[:4]), stored([1], None, TOKENS[:4])])
    index.apply([removed([1])])
    assert index.match(KEYS) == (1, 1.0)
    index.apply([removed([1])])
    assert index.match(KEYS) == (0, 0.0) and len(index) == 0


def test_an_unknown_parent_is_skipped_never_guessed() -> None:
    index = BlockIndex(BS, WEIGHTS, budget=100)
    index.apply([stored([3], 2, TOKENS[8:])])
    assert len(index) == 0 and index.skipped == 1


def test_tiers_are_weighted_and_removed_separately() -> None:
    index = BlockIndex(BS, WEIGHTS, budget=100)
    index.apply([stored([1, 2], None, TOKENS[:8]), stored([1, 2], None, TOKENS[:8], "CPU")])
    index.apply([removed([2])])
    assert index.match(KEYS[:2]) == (2, 1.5)  # block 2 only on CPU now
    index.apply([removed([1, 2], "CPU"), removed([1])])
    assert index.match(KEYS) == (0, 0.0)


def test_clear_and_wrong_block_sizes() -> None:
    index = BlockIndex(BS, WEIGHTS, budget=100)
    index.apply([BlockStored((1,), None, tuple(range(16)), 16, "GPU", True)])
    assert index.skipped == 1
    index.apply([stored([1], None, TOKENS[:4]), AllBlocksCleared()])
    assert len(index) == 0


def test_the_budget_drops_the_oldest_store_first_its_tail_before_its_start() -> None:
    index = BlockIndex(BS, WEIGHTS, budget=2)
    index.apply([stored([1, 2, 3], None, TOKENS)])
    assert len(index) == 2 and index.evicted == 1
    assert index.match(KEYS) == (2, 2.0)  # the tail went first: the start keeps its credit
    assert list(index.held_keys()) == [KEYS[1], KEYS[0]]  # next to go: the second block
    other = [100, 101, 102, 103]
    index.apply([stored([4], None, other)])  # a newer store: the older one goes on first
    assert index.evicted == 2
    assert list(index.held_keys()) == [KEYS[0], *block_keys(other, BS)]


class Watcher:
    def __init__(self) -> None:
        self.stored: list[list[int]] = []

    def applied(
        self, stored: Sequence[int], removed: Sequence[int], held: int, *, live: bool
    ) -> None:
        self.stored.append(list(stored))

    def cleared(self, *, live: bool) -> None:
        pass


def test_a_batch_s_stores_reach_watchers_each_chain_tail_first() -> None:
    index = BlockIndex(BS, WEIGHTS, budget=100)
    watcher = Watcher()
    index.watch(watcher)
    other = [100 + t for t in range(8)]
    index.apply(
        [
            stored([1], None, TOKENS[:4]),  # one chain, a block per event...
            stored([2, 3], 1, TOKENS[4:]),  # ...continued
            stored([7, 8], None, other),  # another chain
            stored([9], None, TOKENS[:4], medium="CPU"),  # not the GPU tier: not told
        ]
    )
    others = block_keys(other, BS)
    assert watcher.stored == [[KEYS[2], KEYS[1], KEYS[0], others[1], others[0]]]
    index.apply([stored([4], 3, [50, 51, 52, 53])])  # extends a chain of an earlier batch
    assert watcher.stored[-1] == block_keys([50, 51, 52, 53], BS, KEYS[2])


def test_a_hundred_thousand_blocks_fit() -> None:
    index = BlockIndex(16, WEIGHTS, budget=100_000)
    tokens = list(range(16 * 1000))
    for run in range(120):
        index.apply([stored_run(run, tokens)])
    assert len(index) == 100_000 and index.evicted == 20_000


def stored_run(run: int, tokens: list[int]) -> BlockStored:
    first = run * 1000
    return BlockStored(tuple(range(first + 1, first + 1001)), None, tuple(tokens), 16, "GPU", True)
