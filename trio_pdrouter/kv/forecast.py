"""What one engine's prefix cache will hold when the prompts sent to it are computed (no I/O).

The index (:mod:`trio_pdrouter.kv.index`) says which blocks an engine holds now. Under cache
pressure that is not what a request finds: it waits behind the prompts already sent there, and their
new blocks evict the least recently used ones (vLLM's prefix cache frees blocks in LRU order), so a
prefix held now may be gone by the time the request is computed, while a prefix sent there a moment
ago, not stored yet, will be there. A :class:`Forecast` is an LRU of the router's own block keys for
one engine (and DP rank), in the order the engine will have touched them once it has computed every
prompt sent to it:

* It starts from what the index holds, in the order the engine will evict it: *history*, older
  than anything the router touches after (routes, or live batches store).
* :meth:`Forecast.route`: a prompt is sent there. Its blocks become the most recent (the engine
  stores or touches every block of a prompt it computes), its first block last (vLLM frees a
  finished request's blocks in reverse, so the tail is evicted first and a prefix loses its
  end before its start; the index orders stores alike), and are *awaited* until its
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
* :meth:`Forecast.applied` (the index's batches, :class:`~trio_pdrouter.kv.index.IndexWatcher`): a
  key the engine evicted goes unless a prompt in flight awaits it (that prompt stores it again); a
  key stored that the forecast neither holds nor expects (traffic from elsewhere: another replica, a
  client that reaches the engine directly) comes in as the most recent. The engine stored it now,
  before the prompts in flight will touch theirs: past the capacity, the keys they await are kept
  over it. A replay's batches are history (at a router's start, 10,000 of them are applied while the
  prompts it sends are answered and their batches wait): a replayed store enters behind every key
  the router touched, so past the capacity it goes first, and a replayed eviction of a key the
  router touched since does not remove it but has it settle as a released prompt's key does (else
  replayed stores push out the prompts answered during the replay, and replayed evictions remove
  blocks their prompts stored again: read after, those prompts' stores come in as traffic from
  elsewhere and the view goes partial).
* The capacity is learnt from the index: the most GPU blocks it held after a batch, once the
  engine has been seen evicting; until then the index's budget. vLLM's evictable pool is the
  GPU's blocks less those of running requests, so this errs on the large side, where the
  forecast keeps more than the engine will, as the index alone would.
* :meth:`Forecast.cleared`: the index was cleared (a loss, a restart, ``AllBlocksCleared``):
  every key held goes; awaited keys stay awaited. A replayed ``AllBlocksCleared`` is history:
  it takes the history; the keys the router touched since settle, as after a replayed eviction
  (in front of an engine whose buffer holds a clear, e.g. a reset before a benchmark's run).
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

from .index import BlockIndex
from .wire import GPU

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
    N``, :mod:`trio_pdrouter.machine.route_ring`) are routed first, so their stores are not taken
    for traffic from elsewhere.
    """

    def __init__(self, index: BlockIndex, *, learn: Callable[[], None] | None = None) -> None:
        self._index = index
        self._learn = learn
        #: Held keys the engine stored before the router's era (held at construction, or
        #: replayed), least recent first: all older than those in ``_lru``.
        self._history: OrderedDict[int, None] = OrderedDict()
        #: Held keys touched since: routed, or stored by a live batch; least recent first.
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
        for key in index.held_keys(GPU):  # what it holds already, in the order of eviction
            self._history[key] = None
        index.watch(self)

    def close(self) -> None:
        """Stop watching the index."""
        self._index.unwatch(self)

    def __len__(self) -> int:
        return len(self._history) + len(self._lru)

    @property
    def capacity(self) -> int:
        """Blocks the engine's prefix cache holds (learnt; see the module doc)."""
        return self._most_held or self._index.budget

    def match(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` the engine will hold."""
        lru, history = self._lru, self._history
        n = 0
        for key in keys:
            if key not in lru and key not in history:
                break
            n += 1
        return n

    def route(self, keys: Sequence[int]) -> None:
        """A prompt with these block keys was sent to the engine."""
        lru, history, awaited = self._lru, self._history, self._awaited
        for key in reversed(keys):  # its first block last: the engine evicts the tail first
            if key in lru:
                lru.move_to_end(key)
            else:
                history.pop(key, None)
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
        lru, history, expected = self._lru, self._history, self._expected
        awaited, settling = self._awaited, self._settling
        for key in removed:
            if key in awaited:
                continue
            if key in history:
                del history[key]
            elif live:
                lru.pop(key, None)
            elif key in lru:  # a replayed eviction is older than the router's touch of the key
                settling.setdefault(key, DOUBT_BATCHES)
        if (removed or self._most_held) and held > self._most_held:
            self._most_held = held
        foreign = 0
        for key in stored:
            if key not in lru and key not in history and key not in expected:
                if live:
                    lru[key] = None
                    foreign += key not in awaited
                else:
                    history[key] = None
        if live:  # a replay's batches are history: not traffic, and a prompt released now
            # has its store later
            if self._counting or len(stored) > foreign:
                self._counting = True
                self._count_stores(len(stored) - foreign, foreign)
            self._settle()
        # What the engine stored now comes before what the prompts in flight will touch: past
        # the capacity, history goes first, then the least recent keys no prompt awaits.
        need = self._drop_history()
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
            "held": len(self),
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
                    self._history.pop(key, None)

    def cleared(self, *, live: bool) -> None:
        self._history.clear()
        if live:
            self._lru.clear()
            self._counting = False
            return
        # A replayed clear is older than every key the router touched: as a replayed eviction.
        awaited, settling = self._awaited, self._settling
        for key in self._lru:
            if key not in awaited:
                settling.setdefault(key, DOUBT_BATCHES)

    def _drop_history(self) -> int:
        """Past the capacity, history goes first; how many keys are still past it."""
        history = self._history
        excess = len(history) + len(self._lru) - self.capacity
        while excess > 0 and history:
            history.popitem(last=False)
            excess -= 1
        return excess

    def _trim(self) -> None:
        lru, awaited = self._lru, self._awaited
        for _ in range(self._drop_history()):
            key = lru.popitem(last=False)[0]
            if key in awaited:
                self._expected[key] = None
