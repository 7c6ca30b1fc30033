"""What one engine's prefix cache will hold when the prompts sent to it are computed (no I/O).

The index (:mod:`.kv_index`) says which blocks an engine holds now. Under cache pressure that is
not what a request finds: it waits behind the prompts already sent there, and their new blocks
evict the least recently used ones (vLLM's prefix cache frees blocks in LRU order), so a prefix
held now may be gone by the time the request is computed, while a prefix sent there a moment
ago, not stored yet, will be there. A :class:`Forecast` is an LRU of the router's own block keys
for one engine (and DP rank), in the order the engine will have touched them once it has
computed every prompt sent to it:

* It starts from what the index holds, in the order the blocks were stored.
* :meth:`Forecast.route`: a prompt is sent there. Its blocks become the most recent (the engine
  stores or touches every block of a prompt it computes) and are *awaited* until its
  :meth:`Forecast.release`. Past the capacity the least recent go: the eviction the events will
  report later. A key that goes while a prompt in flight awaits it is *expected*: that prompt
  is computed before the eviction happens, and its store event is no news, so it does not
  bring the key back.
* :meth:`Forecast.release`: the prompt's prefill ended (answered, failed, cancelled). Its keys
  no other prompt in flight awaits, that are expected or that the index does not hold, are
  *settling* for the engine's next :data:`DOUBT_BATCHES` live batches (a replay's batches
  are history, applied while the live ones wait, the stores of prompts just computed among
  them: measured, settling through a long replay at a router's start dropped those prompts,
  and their stores, read after, came in as traffic from elsewhere): the answer and the events
  travel apart, so the store of a prompt just computed may arrive after its answer. Then an
  expected key is forgotten, and a key the index does not hold is dropped (an engine that
  refused the prompt never stores it).
* :meth:`Forecast.applied` (the index's batches, :class:`~.kv_index.IndexWatcher`): a key the
  engine evicted goes unless a prompt in flight awaits it (that prompt stores it again); a key
  stored that the forecast neither holds nor expects (traffic from elsewhere: another
  replica, a client that reaches the engine directly, a replay) comes in as the most recent.
  The engine stored it now, before the prompts in flight will touch theirs:
  past the capacity, the keys they await are kept over it.
* The capacity is learnt from the index: the most GPU blocks it held after a batch, once the
  engine has been seen evicting; until then the index's budget. vLLM's evictable pool is the
  GPU's blocks less those of running requests, so this errs on the large side, where the
  forecast keeps more than the engine will, as the index alone would.
* :meth:`Forecast.cleared`: the index was cleared (a loss, a restart, ``AllBlocksCleared``):
  every key held goes; awaited keys stay awaited.
* :attr:`Forecast.complete`: whether the router sends the engine (nearly) all it computes.
  Stores of blocks the forecast neither held nor expected come from elsewhere; past
  :data:`FOREIGN_SHARE` of the recent stores, the forecast misses other routers' prompts and
  their evictions, and the policy judges by the index instead. Replayed batches are history,
  not traffic: they are not counted; nor are the stores before the first of a prompt the
  router sent, or the first after a clear: they are the queue the engine had before (a
  previous router's prompts, computed after it stopped; measured: a router started behind
  them found its view partial for its first seconds) or blocks held before a loss.

A forecast only ever holds keys the index holds or a prompt in flight was sent with: it never
credits a block the engine dropped that nothing will store again. Memory: at most the capacity
in held keys, and about twice the keys of the prompts in flight and of those released in the
last :data:`DOUBT_BATCHES` batches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from .kv_index import BlockIndex
from .kv_wire import GPU

__all__ = ["Forecast"]

#: Batches an engine may apply after a prompt's release before its blocks, not stored by then,
#: are dropped: the router may still have that many batches of the engine's to read when the
#: prompt's answer arrives (a busy router reads its sockets late), and a prompt the engine
#: refused keeps its credit that long.
DOUBT_BATCHES = 32
#: The share of an engine's stored blocks from traffic the router did not send above which
#: its view is partial (:attr:`Forecast.complete`), over about the last :data:`STORES_SEEN`.
FOREIGN_SHARE = 0.1
STORES_SEEN = 4096


class Forecast:
    """One engine's prefix cache once the prompts in flight are computed (see the module doc).

    It watches ``index`` from construction until :meth:`close`. ``learn``, if given, is called
    before each batch of the index is taken in: the prompts other processes sent (``--workers
    N``, :mod:`.route_ring`) are routed first, so their stores are not taken for traffic from
    elsewhere.
    """

    def __init__(self, index: BlockIndex, *, learn: Callable[[], None] | None = None) -> None:
        self._index = index
        self._learn = learn
        #: Held keys, least recently touched first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        #: Keys the forecast evicted while a prompt in flight awaited them: their store is
        #: expected and is no news.
        self._expected: dict[int, None] = {}
        #: Key -> prompts in flight awaiting it.
        self._awaited: dict[int, int] = {}
        #: Keys of released prompts no prompt awaits any more, expected or not stored at the
        #: release -> batches left to settle.
        self._settling: dict[int, int] = {}
        #: Blocks stored that the forecast held or expected, and blocks it did not (traffic
        #: the router did not send), halved past :data:`STORES_SEEN`.
        self._own_stores = 0
        self._foreign_stores = 0
        #: Whether stores are counted: from the first batch that stores a block the forecast
        #: held or expected (see the module doc).
        self._counting = False
        #: The most GPU blocks the index held after a batch since the engine first evicted (0
        #: before).
        self._most_held = 0
        for key in index.held_keys(GPU):  # what it holds already, in the order stored
            self._lru[key] = None
        index.watch(self)

    def close(self) -> None:
        """Stop watching the index."""
        self._index.unwatch(self)

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def capacity(self) -> int:
        """Blocks the engine's prefix cache holds (learnt; see the module doc)."""
        return self._most_held or self._index.budget

    def match(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` the engine will hold."""
        lru = self._lru
        n = 0
        for key in keys:
            if key not in lru:
                break
            n += 1
        return n

    def route(self, keys: Sequence[int]) -> None:
        """A prompt with these block keys was sent to the engine."""
        lru, awaited = self._lru, self._awaited
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
            awaited[key] = awaited.get(key, 0) + 1
        self._trim()

    def release(self, keys: Sequence[int]) -> None:
        """The prefill of a prompt :meth:`route` was told of has ended."""
        awaited, settling, index = self._awaited, self._settling, self._index
        for key in keys:
            left = awaited.get(key, 0) - 1
            if left > 0:
                awaited[key] = left
                continue
            awaited.pop(key, None)
            if key in self._expected or not index.holds(key):  # else stored: nothing to settle
                settling[key] = DOUBT_BATCHES

    def applied(
        self, stored: Sequence[int], removed: Sequence[int], held: int, *, live: bool
    ) -> None:
        if self._learn is not None:
            self._learn()
        lru, expected, awaited = self._lru, self._expected, self._awaited
        for key in removed:
            if key not in awaited:
                lru.pop(key, None)
        if (removed or self._most_held) and held > self._most_held:
            self._most_held = held
        foreign = 0
        for key in stored:
            if key not in lru and key not in expected:
                lru[key] = None
                foreign += key not in awaited
        if live and (self._counting or len(stored) > foreign):
            self._counting = True
            self._count_stores(len(stored) - foreign, foreign)
        if live:  # a replay's batches are history: a prompt released now has its store later
            self._settle()
        # What the engine stored now comes before what the prompts in flight will touch: past
        # the capacity, the least recent keys no prompt awaits go first.
        need = len(lru) - self.capacity
        if need > 0:
            victims: list[int] = []
            for key in lru:
                if key not in awaited:
                    victims.append(key)
                    if len(victims) == need:
                        break
            for key in victims:
                del lru[key]
        self._trim()

    @property
    def complete(self) -> bool:
        """Whether the router sends this engine (nearly) all it computes: at most
        :data:`FOREIGN_SHARE` of the blocks it stored lately came from elsewhere."""
        return self._foreign_stores <= FOREIGN_SHARE * (self._own_stores + self._foreign_stores)

    def state(self) -> dict[str, object]:
        """For ``GET /debug/kv-index``: keys held and the capacity (``learnt`` once the engine
        was seen evicting), keys awaited by prompts in flight, the share of recent stores from
        elsewhere and whether that leaves the forecast :attr:`complete`."""
        stores = self._own_stores + self._foreign_stores
        return {
            "held": len(self._lru),
            "capacity": self.capacity,
            "learnt": self._most_held > 0,
            "awaited": len(self._awaited),
            "foreign_share": round(self._foreign_stores / stores, 3) if stores else 0.0,
            "complete": self.complete,
        }

    def _count_stores(self, own: int, foreign: int) -> None:
        self._own_stores += own
        self._foreign_stores += foreign
        if self._own_stores + self._foreign_stores > STORES_SEEN:
            self._own_stores //= 2
            self._foreign_stores //= 2

    def _settle(self) -> None:
        """One more batch for the settling keys: those awaited again are in flight once more;
        those out of batches are no longer expected, and go unless the index holds them."""
        settling, index, awaited = self._settling, self._index, self._awaited
        for key, left in list(settling.items()):
            if key in awaited:
                del settling[key]
            elif left > 1:
                settling[key] = left - 1
            else:
                del settling[key]
                self._expected.pop(key, None)
                if not index.holds(key):
                    self._lru.pop(key, None)

    def cleared(self) -> None:
        self._lru.clear()
        self._counting = False

    def _trim(self) -> None:
        lru, awaited = self._lru, self._awaited
        capacity = self.capacity
        while len(lru) > capacity:
            key, _ = lru.popitem(last=False)
            if key in awaited:
                self._expected[key] = None
