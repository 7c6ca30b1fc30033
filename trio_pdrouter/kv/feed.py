"""One engine's (one DP rank's) KV-event stream put in order: gaps, replays, restarts (no I/O).

A :class:`Feed` owns one :class:`~trio_pdrouter.kv.index.BlockIndex` and decides, batch by batch,
whether it
is exact. Its states::

    state      next batch    gap / first seq > 0       probe                 replay     failed
    FRESH      KNOWN (seq 0) REPLAYING from 0          REPLAYING from 0      -          -
    KNOWN      KNOWN         REPLAYING from last+1     REPLAYING from last+1 -          -
    REPLAYING  (buffered)    (buffered)                -                     see below  UNKNOWN
    UNKNOWN    UNKNOWN       REPLAYING from 0 (*)      REPLAYING from 0 (*)  see below  UNKNOWN

(*) from ``last+1`` once a replay from 0 found the publisher's history gone (below).

A replay is complete when its first batch is the one asked for (or, asked from 0, nothing was
published yet), counting the live batches buffered meanwhile: the publisher may answer before
it publishes the batch asked for, whose live frame then arrives first. From 0 it rebuilds the
index from scratch (KNOWN); from ``last+1`` it fills the gap (the state before it stays).
Incomplete, it leaves the feed UNKNOWN, its index rebuilt from the batches it did deliver.
Without a replay source, every row's "REPLAYING" is UNKNOWN.

The rules:

* A batch whose seq goes backwards is a publisher restart: the index is cleared and the new
  stream starts (KNOWN if it starts at seq 0, else a replay from 0 is asked). Unless it is a
  late copy: a live frame of a batch a replay already delivered (the subscriber had it queued
  while the replay answered, typically at startup) has the seq *and* timestamp of a batch
  applied, and is dropped; a restarted publisher's batch has a later timestamp.
* A gap asks for a replay from the first missing seq; live batches meanwhile are buffered (at
  most ``max_pending``; beyond, the replay is abandoned and the feed is UNKNOWN).
* A replay whose first batch is later than asked (history no longer buffered), or that fails, or
  no replay source at all: the index is cleared and the feed is UNKNOWN. It goes on applying
  the batches it gets (never false credit: every block it holds was stored after the clear, and
  its removes are seen) but the policy does not trust it until an ``AllBlocksCleared``, a
  restart or a complete replay makes it KNOWN again.
* A replay from 0 that starts later shows the publisher's history from 0 gone for good (vLLM
  keeps its last ``buffer_steps`` batches; an engine that ran longer than that is the usual
  case in front of a restarted router). Asking from 0 again would fetch the whole buffer to no
  avail, and skip it all as already seen: until the publisher restarts, probes and gaps ask
  from ``last+1``, which keeps the index's blocks true without re-reading the buffer.
* A replay's batches before the last one that clears the cache (``AllBlocksCleared``) are
  passed over, not applied: nothing they did outlasts the clear (a replay of a full buffer
  costs about a second of CPU; engines reset for a benchmark, or by an operator, hold one).
  Their late live copies are known by seq and by a timestamp no later than the clear's.
* Asking for a replay is the caller's job: :meth:`Feed.live` returns the seq to ask from.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence

from .index import BlockIndex
from .wire import Batch

__all__ = ["Feed", "FeedState"]

#: Applied batches remembered by seq and timestamp (see :meth:`Feed.live`).
RECENT = 1024


class FeedState(enum.Enum):
    FRESH = "fresh"
    KNOWN = "known"
    REPLAYING = "replaying"
    UNKNOWN = "unknown"


class Feed:
    """The ordered stream of one engine and rank (see the module doc).

    ``can_replay`` says whether a replay source exists for it.
    """

    def __init__(self, index: BlockIndex, *, can_replay: bool, max_pending: int = 10_000) -> None:
        self.index = index
        self.can_replay = can_replay
        self.max_pending = max_pending
        self.last_seq: int | None = None
        self.gaps = 0
        self.replays = 0
        self.restarts = 0
        self._exact = False
        self._seen = False
        #: A replay from 0 started later: this publisher's history from 0 is gone (module doc).
        self._history_gone = False
        self._replay_from: int | None = None
        #: How many replays were asked: an answer names the ask it answers, so an answer to
        #: one asked before a restart is not taken for a later ask from the same seq.
        self.asks = 0
        self._pending: list[Batch] = []
        #: seq -> timestamp of the batches applied last (at most :data:`RECENT`), to know a
        #: late live copy of a replayed batch from a restarted publisher's batch.
        self._applied: OrderedDict[int, float] = OrderedDict()
        #: The batches a replay passed over (:meth:`replay_skip`): first and last seq, and the
        #: timestamp of the batch after them that cleared the cache.
        self._passed: tuple[int, int, float] | None = None

    @property
    def state(self) -> FeedState:
        if self._replay_from is not None:
            return FeedState.REPLAYING
        if self._exact:
            return FeedState.KNOWN
        return FeedState.UNKNOWN if self._seen else FeedState.FRESH

    @property
    def known(self) -> bool:
        """True when the index is exactly what the engine held at ``last_seq``. A replay in
        flight does not change that: the index lags (as it always does, by the batches in
        transit), it does not lie."""
        return self._exact

    def live(self, batch: Batch) -> int | None:
        """Take one live batch; returns the seq to replay from when one is needed."""
        self._seen = True
        if self._applied.get(batch.seq) == batch.ts:
            return None  # a late live copy of a batch a replay already applied
        passed = self._passed
        if passed is not None and passed[0] <= batch.seq <= passed[1] and batch.ts <= passed[2]:
            return None  # ...or passed over: older than the clear after it
        if self._replay_from is not None:
            before = self._pending[-1].seq if self._pending else self.last_seq
            if before is not None and batch.seq <= before:
                # A restart while we wait: the replay may answer for either process.
                self._replay_from = None
                self._pending = []
                self._lose()
                self._history_gone = False
            elif len(self._pending) < self.max_pending:
                self._pending.append(batch)
                return None
            else:
                self._replay_from = None  # too far behind: give up on this replay
                self._pending = []
                self._lose()
        last = self.last_seq
        if last is not None and batch.seq <= last:
            self.restarts += 1
            self._exact = False
            self._history_gone = False
            self.index.clear()
            self.last_seq = last = None
        if last is None:
            if batch.seq == 0:
                self.index.clear()
                self._exact = True
                self._apply(batch)
                return None
            if self._history_gone:  # nothing before it can be had: go on from this batch
                self._apply(batch)
                return None
            return self._need(0, batch)
        if batch.seq == last + 1:
            self._apply(batch)
            return None
        self.gaps += 1
        return self._need(last + 1 if self._exact or self._history_gone else 0, batch)

    def probe(self) -> int | None:
        """Ask for the history this feed may lack (at startup, then now and then): from
        ``last_seq + 1`` when exact (finds a lost last batch) or when the history from 0 is
        gone, else from 0 (a complete replay rebuilds the index). Returns the seq to replay
        from, or None."""
        if not self.can_replay or self._replay_from is not None:
            return None
        after = self._exact or self._history_gone
        start = self.last_seq + 1 if after and self.last_seq is not None else 0
        self._replay_from = start
        self.asks += 1
        return start

    @property
    def wanted(self) -> int | None:
        """The seq a replay is wanted from (None: no replay wanted)."""
        return self._replay_from

    def replayed(self, start: int, batches: Sequence[Batch], *, ask: int) -> int | None:
        """The batches, in order up to the end marker, of replay number ``ask`` (:attr:`asks`
        when it was sent), asked from ``start``; an answer to any other ask is ignored. The live
        batches buffered meanwhile are then taken as :meth:`live` takes them; returns the seq
        to replay from if that needs another replay. All at once: :meth:`replay_begins`, those
        before its last clear to :meth:`replay_skip`, the rest to :meth:`replay_batch`,
        :meth:`replay_ends`."""
        ordered = sorted(batches, key=lambda b: b.seq)
        if not self.replay_begins(start, ordered[0].seq if ordered else None, ask=ask):
            return None
        last_clear = max((i for i, batch in enumerate(ordered) if batch.clears), default=0)
        if last_clear:
            cleared = ordered[last_clear]
            self.replay_skip(ordered[0].seq, cleared.seq - 1, cleared.ts)
        for batch in ordered[last_clear:]:
            self.replay_batch(batch)
        return self.replay_ends(start, ask=ask)

    def replay_begins(self, start: int, first: int | None, *, ask: int) -> bool:
        """Replay number ``ask``, asked from ``start``, is about to be applied; ``first`` is the
        seq of its first batch (None: it has none). False for an answer to another ask (to be
        ignored). Its batches then go, in seq order, to :meth:`replay_batch`, and
        :meth:`replay_ends` closes it; no live batch may be given in between (a caller that
        applies a long replay in slices holds its live batches back meanwhile)."""
        if start != self._replay_from or ask != self.asks:
            return False
        # The first batch from ``start`` on may be live, not replayed: the publisher answered
        # before publishing it, and its PUB frame overtook the answer on the other socket.
        if first is None and self._pending:
            first = self._pending[0].seq
        if first is not None and first > start:
            self._lose()  # history no longer buffered
            if start == 0:
                # Gone for good: rebuild from what the buffer shows (nothing of it was applied
                # since the clear), and ask from last+1 from now on.
                self._history_gone = True
                self.last_seq = None
        elif start == 0:
            # From the very first batch (or nothing published yet): rebuild exactly.
            self.index.clear()
            self.last_seq = None
            self._exact = True
        return True

    def replay_skip(self, first: int, last: int, ts: float) -> None:
        """The batches ``first`` to ``last`` of the replay :meth:`replay_begins` opened are
        passed over: the one after them, stamped ``ts``, clears the engine's cache, so nothing
        they did outlasts it (module doc). It goes to :meth:`replay_batch` next."""
        self._seen = True
        self._passed = (first, last, ts)
        if self.last_seq is None or last > self.last_seq:
            self.last_seq = last

    def replay_batch(self, batch: Batch) -> None:
        """Apply one batch of the replay :meth:`replay_begins` opened."""
        self._seen = True
        self._apply_in_order(batch)

    def replay_ends(self, start: int, *, ask: int) -> int | None:
        """Close the replay :meth:`replay_begins` opened: take the live batches buffered
        meanwhile; returns the seq to replay from if that needs another replay."""
        if start != self._replay_from or ask != self.asks:
            return None
        self._replay_from = None
        self.replays += 1
        pending, self._pending = self._pending, []
        restarted = _restart_in(pending)
        if restarted is not None:
            # The publisher restarted while we waited: the replay may be of either process.
            self._lose()
            self._history_gone = False
            self.last_seq = None
            return self._take(pending[restarted:], covered=False)
        return self._take(pending, covered=True)

    def replay_failed(self, start: int, *, ask: int) -> int | None:
        """Replay number ``ask``, from ``start``, got no answer: whatever was asked is lost."""
        if start != self._replay_from or ask != self.asks:
            return None
        self._replay_from = None
        self._seen = True
        pending, self._pending = self._pending, []
        self._lose()
        restarted = _restart_in(pending)
        if restarted is not None:
            self._history_gone = False
        pending = pending[restarted or 0 :]
        if pending:
            # Go on from the first live batch after the loss, as if no earlier one existed.
            self.last_seq = pending[0].seq - 1 if pending[0].seq > 0 else None
        return self._take(pending, covered=False)

    def _take(self, pending: Sequence[Batch], *, covered: bool) -> int | None:
        """Take the live batches buffered during a replay (those it ``covered`` are skipped)."""
        asked: int | None = None
        last = self.last_seq
        for batch in pending:
            if (
                covered
                and last is not None
                and batch.seq <= last
                and self._replay_from is None
                and batch.seq not in self._applied
            ):
                continue  # the replay delivered it, too long ago to compare timestamps
            # live() drops a copy of a batch the replay applied (same seq and timestamp) and
            # takes another batch under such a seq as the restart it is (the replay was of
            # the process before it).
            again = self.live(batch)
            asked = asked if asked is not None else again
        return asked

    def _need(self, start: int, batch: Batch) -> int | None:
        if self.can_replay:
            self._replay_from = start
            self.asks += 1
            self._pending = [batch]
            return start
        self._lose()
        self._apply(batch)
        return None

    def _lose(self) -> None:
        self.index.clear()
        self._exact = False

    def _apply_in_order(self, batch: Batch) -> None:
        """Apply a replayed ``batch`` unless already applied; a hole before it loses
        exactness."""
        last = self.last_seq
        if last is not None and batch.seq <= last:
            return
        if (last is None and batch.seq != 0) or (last is not None and batch.seq != last + 1):
            self.gaps += 1
            self._lose()
        self._apply(batch, live=False)

    def _apply(self, batch: Batch, *, live: bool = True) -> None:
        self.index.apply(batch.events, live=live)
        self.last_seq = batch.seq
        applied = self._applied
        applied[batch.seq] = batch.ts
        applied.move_to_end(batch.seq)
        if len(applied) > RECENT:
            applied.popitem(last=False)
        if not self._exact and batch.clears:
            # The engine emptied its cache and every event since is seen: exact again.
            self._exact = True


def _restart_in(pending: Sequence[Batch]) -> int | None:
    """Where the buffered live batches go back in seq (a publisher restart), if they do."""
    found = None
    for i in range(1, len(pending)):
        if pending[i].seq <= pending[i - 1].seq:
            found = i
    return found
