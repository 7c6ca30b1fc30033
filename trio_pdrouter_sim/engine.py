"""One simulated vLLM engine (a data-parallel rank): scheduler, timing model, prefix cache.

Theory of operation. A request's life on an engine has these states, and only
:class:`Engine` moves it between them::

    arrive --acquire()--> WAITING --(slot free, FIFO)--> RUNNING --release()--> done
                              \\-- cancelled --> gone         \\-- ok / aborted counted

``running`` never exceeds ``max_num_seqs``. A released slot is handed to the oldest waiter in
the same step (no checkpoint), so a burst cannot overtake the queue. Every counter the
``/sim/stats`` endpoint reports is a field of :class:`EngineCounters`, changed only here.

All time goes through trio (``trio.sleep``), so in-memory tests may use ``MockClock``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

import attrs
import trio

from .config import SimConfig
from .kv_events import KvJournal


class PrefixCache:
    """An LRU set of block hashes: the engine's automatic prefix cache.

    A prompt's blocks are hashed as a chain (each hash covers the whole prefix up to that
    block, as vLLM does), so a hit on block ``n`` implies the whole prefix matched. Only full
    blocks are cached. A prompt computed makes its blocks the most recent tail first, its first
    block last: vLLM frees a finished request's blocks in reverse order so that the tail is
    evicted first, and a prefix loses its end before its start. With a ``journal`` every change
    is also published as KV events (one batch per :meth:`insert` or :meth:`clear`, see
    :mod:`.kv_events`).
    """

    def __init__(
        self, capacity_blocks: int, block_size: int = 16, journal: KvJournal | None = None
    ) -> None:
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.journal = journal
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading ``hashes`` present; those blocks become most recently used (the
        first last, as :meth:`insert` orders them)."""
        hits = 0
        for h in hashes:
            if h not in self._blocks:
                break
            hits += 1
        for h in reversed(hashes[:hits]):
            self._blocks.move_to_end(h)
        return hits

    def insert(self, hashes: Sequence[int], ids: Sequence[int] = ()) -> None:
        """Remember ``hashes`` (the blocks of token ``ids``) as most recently used, the first
        last (see the class doc), evicting the least recently used."""
        journal = self.journal
        blocks = self._blocks
        run: list[int] = []
        for i, h in enumerate(hashes):
            if journal is not None and h not in blocks:
                run.append(i)
            elif run and journal is not None:
                self._publish_run(hashes, ids, run)
                run = []
            blocks[h] = None
        if run and journal is not None:
            self._publish_run(hashes, ids, run)
        for h in reversed(hashes):
            blocks.move_to_end(h)
        evicted: list[int] = []
        while len(blocks) > self.capacity:
            evicted.append(blocks.popitem(last=False)[0])
        if journal is not None:
            if evicted:
                journal.removed(evicted)
            journal.step()

    def _publish_run(self, hashes: Sequence[int], ids: Sequence[int], run: list[int]) -> None:
        assert self.journal is not None
        bs = self.block_size
        first, last = run[0], run[-1]
        self.journal.stored(
            [hashes[i] for i in run],
            hashes[first - 1] if first > 0 else None,
            ids[first * bs : (last + 1) * bs],
        )

    def clear(self, *, publish: bool = True) -> None:
        """Forget every block (``publish=False``: silently, as a restarted engine starts)."""
        self._blocks.clear()
        if self.journal is not None and publish:
            self.journal.cleared()
            self.journal.step()

    def held(self) -> list[int]:
        """Every cached block, least recently used first."""
        return list(self._blocks)


def block_hashes(ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full ``block_size``-token blocks of ``ids``."""
    out: list[int] = []
    prev = 0
    for start in range(0, len(ids) - block_size + 1, block_size):
        prev = hash((prev, tuple(ids[start : start + block_size])))
        out.append(prev)
    return out


@attrs.define
class EngineCounters:
    """The per-engine counters of ``/sim/stats`` that ``POST /sim/reset`` zeroes."""

    peak_running: int = 0
    completed: int = 0
    aborted: int = 0
    pd_ok: int = 0
    pd_missing: int = 0
    kv_blocks_leaked: int = 0
    kv_blocks_freed: int = 0
    kv_second_pulls: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_queries: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


class _Waiter:
    __slots__ = ("event", "granted")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.granted = False


class Engine:
    """One data-parallel rank. See the module docstring for the state machine."""

    def __init__(self, rank: int, config: SimConfig, journal: KvJournal | None = None) -> None:
        self.rank = rank
        self.config = config
        self.running = 0
        self._waiters: deque[_Waiter] = deque()
        self.counters = EngineCounters()
        self.cache = PrefixCache(config.prefix_cache_blocks, config.block_size, journal)
        #: Blocks held for a remote decode (prefill side of NIXL), not yet pulled.
        self.kv_blocks_held = 0
        #: Blocks of the requests now running.
        self.kv_blocks_active = 0

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiters)

    @property
    def load(self) -> int:
        """What the least-loaded choice compares: running plus waiting."""
        return self.running + len(self._waiters)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use (running requests plus blocks held for decode)."""
        used = self.kv_blocks_active + self.kv_blocks_held
        return min(1.0, used / self.config.num_gpu_blocks)

    async def acquire(self) -> None:
        """Wait for a running slot, first come first served. Counts the request."""
        self.counters.requests += 1
        if self.running < self.config.max_num_seqs and not self._waiters:
            self._start_running()
            try:
                await trio.lowlevel.checkpoint()
            except BaseException:  # cancelled as it started: the slot goes back
                self._free_slot()
                raise
            return
        waiter = _Waiter()
        self._waiters.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                # The slot was handed over in the same step we were cancelled: pass it on.
                self._free_slot()
            else:
                self._waiters.remove(waiter)
            raise

    def _start_running(self) -> None:
        self.running += 1
        self.counters.peak_running = max(self.counters.peak_running, self.running)

    def _free_slot(self) -> None:
        if self._waiters:
            waiter = self._waiters.popleft()
            waiter.granted = True
            waiter.event.set()  # the slot moves to the waiter: running is unchanged
        else:
            self.running -= 1

    def release(self, *, completed: bool, blocks: int) -> None:
        """Give the slot back; count the request as completed or aborted."""
        self.kv_blocks_active -= blocks
        if completed:
            self.counters.completed += 1
        else:
            self.counters.aborted += 1
        self._free_slot()

    def lookup_prefix(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """Cached prompt tokens for a prompt with these block hashes (counts hits/queries).

        Like vLLM, at least the last prompt token is always computed.
        """
        hit_blocks = self.cache.match(hashes)
        cached = min(hit_blocks * self.config.block_size, max(prompt_tokens - 1, 0))
        self.counters.prefix_cache_queries += prompt_tokens
        self.counters.prefix_cache_hits += cached
        return cached

    def prefill_seconds(self, uncached_tokens: int) -> float:
        """Modelled prefill duration."""
        return self.config.prefill_base_s + self.config.prefill_per_token_s * uncached_tokens

    def token_seconds(self) -> float:
        """Modelled time to the next token at the current batch size."""
        return self.config.itl_base_s + self.config.itl_per_running_s * self.running

    def reset_counters(self) -> None:
        """Zero the counters (``POST /sim/reset``); in-flight requests are untouched."""
        self.counters = EngineCounters(peak_running=self.running)

    def stats(self) -> dict[str, int | float]:
        """This engine's part of ``/sim/stats``."""
        c = self.counters
        return {
            "rank": self.rank,
            "running": self.running,
            "waiting": self.waiting,
            "peak_running": c.peak_running,
            "completed": c.completed,
            "aborted": c.aborted,
            "pd_ok": c.pd_ok,
            "pd_missing": c.pd_missing,
            "kv_blocks_held": self.kv_blocks_held,
            "kv_blocks_leaked": c.kv_blocks_leaked,
            "kv_blocks_freed": c.kv_blocks_freed,
            "kv_second_pulls": c.kv_second_pulls,
            "prefix_cache_hits": c.prefix_cache_hits,
            "prefix_cache_queries": c.prefix_cache_queries,
            "requests": c.requests,
            "prompt_tokens": c.prompt_tokens,
            "generation_tokens": c.generation_tokens,
            "kv_cache_usage_perc": round(self.kv_cache_usage, 6),
        }
