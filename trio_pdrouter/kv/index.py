"""The exact prefix-cache contents of one engine (one DP rank), from its KV events (no I/O).

vLLM's block hashes are not reproducible outside the engine (pickle-sha256 by default, a root
seed random per process), so blocks are keyed by the router's own chain: :func:`block_keys`
hashes each ``block_size``-token slice together with the key before it. A ``BlockStored``
event carries its blocks' tokens and its parent's engine hash, so each new block's own key is
its parent's own key chained over its tokens; :class:`BlockIndex` keeps the map
``engine hash -> own key`` to follow parents and to apply removes.

The rules:

* Only ``indexable`` stores of the index's block size count (see :mod:`trio_pdrouter.kv.wire`); a
  store whose parent the index does not hold is skipped (missed events), never guessed. Both are
  counted in :attr:`BlockIndex.skipped`.
* vLLM does not de-duplicate: one hash may be stored (and later removed) once per physical
  copy. Copies are counted; a block is held until its last copy is removed.
* Each medium (``GPU``, ``CPU``, ...) is its own tier; a remove names its medium.
* vLLM frees a finished request's blocks in reverse, so a prefix loses its end before its
  start (its start is what a match credits). Entries are kept in that order: stores in the
  order they came, a store's blocks tail first; and the keys a batch stored reach the
  watchers each chain tail first (a store that extends the batch's previous one, as when
  each block comes in its own event, continues its chain).
* Memory is bounded: past ``budget`` entries the first in that order goes, all its copies
  with it (:attr:`BlockIndex.evicted`). Dropping an entry only loses credit.
* :meth:`BlockIndex.match` credits the longest run of leading keys held in some tier, each
  block weighted by the best tier holding it; it never credits a block the events removed.
* Watchers (:meth:`BlockIndex.watch`) are told, after each batch, which own keys came to be held
  in the GPU tier and which stopped being held there, with the tier's entry count and whether
  the batch is live or replayed, and told when the index is cleared
  (:class:`~trio_pdrouter.kv.forecast.Forecast` follows the engine this way). Entries dropped for
  the budget are not engine evictions and are not told.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from .wire import GPU, AllBlocksCleared, BlockRemoved, BlockStored, Event

__all__ = ["ROOT_KEY", "BlockIndex", "IndexWatcher", "block_keys"]

#: The own key a chain starts from (the parent of a prompt's first block).
ROOT_KEY = 0x6B76_6576_656E_7473


class IndexWatcher(Protocol):
    """Told how an index's GPU tier changed (see the module doc)."""

    def applied(
        self, stored: Sequence[int], removed: Sequence[int], held: int, *, live: bool
    ) -> None:
        """After a batch: own keys now held that were not, keys no longer held, the GPU tier's
        entry count, and whether the batch is live (else replayed: history)."""

    def cleared(self, *, live: bool) -> None:
        """The index was cleared: by a live ``AllBlocksCleared``, a loss or a restart (``live``),
        or by a replayed ``AllBlocksCleared`` (history)."""


def block_keys(tokens: Sequence[int], block_size: int, parent: int = ROOT_KEY) -> list[int]:
    """Own keys of the full ``block_size`` blocks of ``tokens``, chained from ``parent``."""
    keys: list[int] = []
    for block in zip(*[iter(tokens)] * block_size, strict=False):  # a partial block: left out
        parent = hash((parent, block))
        keys.append(parent)
    return keys


class _Tier:
    """The blocks of one medium: engine hash -> own key (in eviction order, see the module
    doc), copies."""

    __slots__ = ("copies", "held", "own")

    def __init__(self) -> None:
        self.own: dict[int, int] = {}
        #: Copies beyond the first, only for hashes stored more than once.
        self.copies: dict[int, int] = {}
        #: Own key -> number of engine hashes (with all their copies) holding it.
        self.held: dict[int, int] = {}

    def store(self, engine_hash: int, key: int) -> bool:
        """Add a copy; True if this is a new entry."""
        if engine_hash in self.own:
            self.copies[engine_hash] = self.copies.get(engine_hash, 0) + 1
            return False
        self.own[engine_hash] = key
        self.held[key] = self.held.get(key, 0) + 1
        return True

    def remove(self, engine_hash: int, *, all_copies: bool = False) -> bool:
        """Drop a copy (or all); True if the entry is gone."""
        extra = self.copies.get(engine_hash, 0)
        if extra and not all_copies:
            if extra == 1:
                del self.copies[engine_hash]
            else:
                self.copies[engine_hash] = extra - 1
            return False
        self.copies.pop(engine_hash, None)
        key = self.own.pop(engine_hash, None)
        if key is None:
            return False
        left = self.held[key] - 1
        if left:
            self.held[key] = left
        else:
            del self.held[key]
        return True


class BlockIndex:
    """What one engine's prefix cache holds, kept exact by :meth:`apply` (see the module doc).

    ``weights`` gives each medium's credit per block; a medium not listed gets the weight of
    ``"*"`` (0 if that is not listed either: not credited).
    """

    def __init__(self, block_size: int, weights: Mapping[str, float], budget: int) -> None:
        if budget < 1:
            raise ValueError("budget must be at least 1")
        self.block_size = block_size
        self.budget = budget
        self._weights = dict(weights)
        self._tiers: dict[str, _Tier] = {}
        self._size = 0
        #: Stores or blocks skipped: not indexable, wrong block size, unknown parent.
        self.skipped = 0
        #: Entries dropped to keep within the budget.
        self.evicted = 0
        self._watchers: list[IndexWatcher] = []
        #: Own keys the current batch made held in the GPU tier, by chain (a store that extends
        #: the batch's previous one adds to its run), first block first, and the keys it
        #: stopped holding there (kept only while someone watches).
        self._runs: list[list[int]] = []
        self._removed: list[int] = []
        #: The engine hash the batch's last GPU store ended with.
        self._chain_end: int | None = None

    def watch(self, watcher: IndexWatcher) -> None:
        """Tell ``watcher`` of every change from now on (see the module doc)."""
        self._watchers.append(watcher)

    def unwatch(self, watcher: IndexWatcher) -> None:
        if watcher in self._watchers:
            self._watchers.remove(watcher)

    def holds(self, key: int, medium: str = GPU) -> bool:
        """Whether own ``key`` is held in ``medium``."""
        tier = self._tiers.get(medium)
        return tier is not None and key in tier.held

    def __len__(self) -> int:
        """Entries held (engine hashes, any medium; copies count once)."""
        return self._size

    def apply(self, events: Iterable[Event], *, live: bool = True) -> None:
        """Apply one batch's events in order; ``live`` (the watchers are told) when the batch
        is news, not a replay of history."""
        watched = bool(self._watchers)
        for event in events:
            if isinstance(event, BlockStored):
                self._store(event, watched=watched)
            elif isinstance(event, BlockRemoved):
                tier = self._tiers.get(event.medium)
                if tier is not None:
                    gone = self._removed if watched and event.medium == GPU else None
                    for engine_hash in event.block_hashes:
                        key = tier.own.get(engine_hash)
                        if tier.remove(engine_hash):
                            self._size -= 1
                            if gone is not None and key is not None and key not in tier.held:
                                gone.append(key)
            elif isinstance(event, AllBlocksCleared):
                self.clear(live=live)
        if watched:
            self._tell(live)

    def _tell(self, live: bool) -> None:
        """Tell the watchers the batch's net change in the GPU tier."""
        tier = self._tiers.get(GPU)
        held = tier.held if tier is not None else {}
        # Each chain tail first: the order the engine will evict them (module doc).
        ordered = (key for run in self._runs for key in reversed(run))
        stored = [k for k in dict.fromkeys(ordered) if k in held]
        removed = [k for k in dict.fromkeys(self._removed) if k not in held]
        self._runs.clear()
        self._removed.clear()
        self._chain_end = None
        size = len(tier.own) if tier is not None else 0
        for watcher in tuple(self._watchers):  # a watcher may start another one
            watcher.applied(stored, removed, size, live=live)

    def clear(self, *, live: bool = True) -> None:
        """Forget everything (the engine cleared its cache, restarted, or events were lost);
        ``live``: now, else a replay's ``AllBlocksCleared`` (the watchers are told which)."""
        self._tiers.clear()
        self._size = 0
        self._runs.clear()
        self._removed.clear()
        self._chain_end = None
        for watcher in tuple(self._watchers):
            watcher.cleared(live=live)

    def _store(self, event: BlockStored, *, watched: bool) -> None:
        if not event.indexable or event.block_size != self.block_size:
            self.skipped += 1
            return
        tier = self._tiers.get(event.medium)
        if tier is None:
            tier = self._tiers[event.medium] = _Tier()
        if event.parent_block_hash is None:
            parent = ROOT_KEY
        else:
            found = self._parent_key(event.parent_block_hash, tier)
            if found is None:
                self.skipped += 1
                return
            parent = found
        keys = block_keys(event.token_ids, self.block_size, parent)
        if watched and event.medium == GPU:
            self._note_stored(event, [key for key in keys if key not in tier.held])
        # Tail first: the order of eviction.
        for engine_hash, key in zip(reversed(event.block_hashes), reversed(keys), strict=True):
            if tier.store(engine_hash, key):
                self._size += 1
        while self._size > self.budget:
            self._evict_oldest()

    def _note_stored(self, event: BlockStored, new: list[int]) -> None:
        """Keep the GPU keys a store made held for the watchers, in the run of its chain."""
        parent = event.parent_block_hash
        if self._runs and parent is not None and parent == self._chain_end:
            self._runs[-1].extend(new)
        else:
            self._runs.append(new)
        self._chain_end = event.block_hashes[-1] if event.block_hashes else None

    def _parent_key(self, engine_hash: int, tier: _Tier) -> int | None:
        key = tier.own.get(engine_hash)
        if key is not None:
            return key
        for other in self._tiers.values():  # a CPU block may extend a GPU prefix
            key = other.own.get(engine_hash)
            if key is not None:
                return key
        return None

    def _evict_oldest(self) -> None:
        tier = max(self._tiers.values(), key=lambda t: len(t.own))
        oldest = next(iter(tier.own))
        tier.remove(oldest, all_copies=True)
        self._size -= 1
        self.evicted += 1

    def weight(self, medium: str) -> float:
        """The credit of one block held in ``medium``."""
        return self._weights.get(medium, self._weights.get("*", 0.0))

    def match(self, keys: Sequence[int], *, skip: str | None = None) -> tuple[int, float]:
        """Leading ``keys`` held and their weighted credit (each block: its best tier; with
        ``skip``, its best tier but that medium)."""
        tiers = [(self.weight(m), t) for m, t in self._tiers.items() if m != skip]
        tiers = [(w, t) for w, t in tiers if w > 0]
        tiers.sort(key=lambda wt: -wt[0])
        blocks = 0
        credit = 0.0
        for key in keys:
            for weight, tier in tiers:
                if key in tier.held:
                    blocks += 1
                    credit += weight
                    break
            else:
                break
        return blocks, credit

    def held_keys(self, medium: str = "GPU") -> dict[int, int]:
        """Own key -> copies held in ``medium``, in the order the engine will evict them (see
        the module doc)."""
        tier = self._tiers.get(medium)
        if tier is None:
            return {}
        out: dict[int, int] = {}
        for engine_hash, key in tier.own.items():
            out[key] = out.get(key, 0) + 1 + tier.copies.get(engine_hash, 0)
        return out
