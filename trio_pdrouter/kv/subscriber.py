"""Following vLLM's KV events over ZMQ: one SUB (and one replay DEALER) per engine and DP rank.

:class:`KvEvents` owns one :class:`~trio_pdrouter.kv.feed.Feed` per :class:`EventSource` and the I/O
that feeds it. pyzmq runs under trio without threads, with these rules:

* One task per socket. Every socket is drained with ``NOBLOCK`` until ``zmq.Again`` before
  ``trio.lowlevel.wait_readable`` on its FD: the FD is edge-triggered, so waiting with messages
  queued would hang. ``notify_closing`` comes before every ``close``.
* Bind or connect as vLLM decides for its side (:func:`~.sockets.attach`'s rule).
* Replay: the DEALER sends ``[b"", start_seq]`` and reads ``[b"", (topic,) seq, payload]``
  frames until the end marker (seq -1); ``replay_timeout_s`` without a frame (before the first
  or between two: a long replay that keeps coming is not cut) ends it, and the DEALER is
  replaced so a late answer cannot be taken for the next one. Without any frame the replay
  failed; with some, they are taken as a replay that ends there (or at the first batch missing
  among them), and the feed asks for the rest as for any gap: vLLM's ROUTER sends a whole buffer
  at once and drops what the pipe to the DEALER cannot take at that moment (frames in the
  middle, the end marker), which a busy router or host makes likely (seen in ``python -m
  benchmarks --only kv_aware``: routers started in front of engines whose buffers were full
  stayed unknown for whole runs, each full replay losing its tail). At most ``max_replay_bytes``
  of payloads are kept, the oldest dropped first: such a replay starts later than asked, which
  the feed takes as history no longer buffered (an index that may miss blocks, never one that
  shows a block dropped). Once the replay has ended, the frames before its last batch that
  clears the cache are passed over (the feed's rule), and the rest are decoded and applied
  :data:`_DECODE_SLICE` at a time (a replay's decoded batches are several times its payload
  bytes: they never all live at once), and the feed's live batches wait in the SUB socket until
  the replay is applied: the feed takes no live batch in the middle of a replay. Besides the
  replays a gap asks for, each feed probes every ``probe_interval_s`` (a lost last batch, or a
  feed UNKNOWN whose history from seq 0 may still be buffered; once a replay shows it gone, only
  the batches after the last one are asked for).
* Whatever a source does (malformed frames, a dead publisher, a refused replay), the router
  keeps serving: the feed goes UNKNOWN and the policy falls back to its estimate.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence

import trio
import zmq

from .feed import Feed
from .index import BlockIndex
from .sockets import EventSource, attach, close, socket_fd
from .wire import Batch, MalformedFrame, decode_message, decode_payload

__all__ = ["MAX_REPLAY_BYTES", "KvEvents"]

log = logging.getLogger("trio_pdrouter.kv_events")

_END = -1
#: The name an ``AllBlocksCleared`` event carries in a payload (either layout).
_CLEARED = b"AllBlocksCleared"
#: Replayed frames decoded between checkpoints.
_DECODE_SLICE = 64
#: Replayed frames received between checkpoints.
_RECEIVE_SLICE = 1000
#: Replay frames the DEALER queues (above vLLM's default buffer of 10,000 batches).
_REPLAY_HWM = 100_000
#: Payload bytes of one replay kept at most (vLLM keeps 10,000 batches by default).
MAX_REPLAY_BYTES = 64 * 1024 * 1024


class KvEvents:
    """The feeds of every source, and the tasks that follow them (see the module doc).

    ``weights`` is each medium's credit per block (``GPU`` 1.0, the ``--kv-penalty-*`` flags
    for the others); ``budget`` bounds each engine's index.
    """

    def __init__(
        self,
        sources: Sequence[EventSource],
        *,
        block_size: int,
        weights: Mapping[str, float],
        budget: int,
        probe_interval_s: float = 5.0,
        replay_timeout_s: float = 2.0,
        max_replay_bytes: int = MAX_REPLAY_BYTES,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.sources = tuple(sources)
        self.block_size = block_size
        self._probe_interval_s = probe_interval_s
        self._replay_timeout_s = replay_timeout_s
        self._max_replay_bytes = max_replay_bytes
        self._context = context or zmq.Context.instance()
        self.feeds: dict[tuple[str, int | None], Feed] = {
            s.engine: Feed(BlockIndex(block_size, weights, budget), can_replay=s.replay is not None)
            for s in self.sources
        }
        self._wanted = {s.engine: trio.Event() for s in self.sources}
        #: Set while a replay is applied to a feed: its live batches wait (module doc).
        self._held: dict[tuple[str, int | None], trio.Event] = {}
        #: Whether each feed was exact when last looked at, to log each change once.
        self._known = dict.fromkeys(self.feeds, False)
        #: Counted per source key: malformed frames and events applied.
        self.decode_errors: dict[str, int] = {s.key: 0 for s in self.sources}
        self.events: dict[str, int] = {s.key: 0 for s in self.sources}

    def feed(self, url: str, rank: int | None) -> Feed | None:
        return self.feeds.get((url, rank))

    def index(self, url: str, rank: int | None) -> tuple[BlockIndex, bool] | None:
        """An engine's index and whether it is exact (its events known to be complete)."""
        feed = self.feeds.get((url, rank))
        return (feed.index, feed.known) if feed is not None else None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Follow every source until cancelled; started once every socket is attached."""
        async with trio.open_nursery() as nursery:
            for source in self.sources:
                await nursery.start(self._follow, source)
            task_status.started()

    async def _follow(self, source: EventSource, *, task_status: trio.TaskStatus[None]) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 100_000)
        try:
            attach(sub, source.endpoint)
        except zmq.ZMQError as exc:
            sub.close(linger=0)
            log.warning("kv events: cannot attach %s to %s: %s", source.key, source.endpoint, exc)
            task_status.started()
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._live, source, sub)
            if source.replay is not None:
                nursery.start_soon(self._replays, source, source.replay)
            task_status.started()

    def _ask(self, source: EventSource, start: int | None) -> None:
        """After the feed took a batch: wake the replay task if it wants a replay."""
        if start is not None:
            self._wanted[source.engine].set()
        self._note(source)

    def _note(self, source: EventSource) -> None:
        """Log when an engine's index becomes exact or stops being so."""
        key = source.engine
        feed = self.feeds[key]
        known = feed.known
        if known == self._known[key]:
            return
        self._known[key] = known
        if known:
            log.info("kv events: %s is known (seq %s)", source.key, feed.last_seq)
        else:
            log.warning(
                "kv events: %s is unknown: events were lost (%d gaps, %d replays, %d restarts);"
                " kv_aware judges it by its estimate until they are complete again",
                source.key,
                feed.gaps,
                feed.replays,
                feed.restarts,
            )

    async def _live(self, source: EventSource, sub: zmq.Socket[bytes]) -> None:
        key = source.engine
        feed = self.feeds[key]
        fd = socket_fd(sub)
        try:
            while True:
                held = self._held.get(key)
                if held is not None:
                    await held.wait()  # a replay is being applied
                drained = 0
                while drained < 1000:  # then let other tasks run, and drain on
                    try:
                        frames = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    drained += 1
                    batch = self._decode(source, frames)
                    if batch is not None:
                        self._ask(source, feed.live(batch))
                if drained < 1000:
                    await trio.lowlevel.wait_readable(fd)
                else:
                    await trio.lowlevel.checkpoint()
        finally:
            close(sub)

    def _decode(self, source: EventSource, frames: Sequence[bytes]) -> Batch | None:
        """A live message's batch; None (counted, logged) if malformed or another rank's."""
        try:
            batch = decode_message(frames)
        except MalformedFrame as exc:
            self._reject(source, f"malformed frame ({exc})")
            return None
        return self._accept(source, batch)

    def _decode_replayed(self, source: EventSource, seq: int, payload: bytes) -> Batch | None:
        """A replayed frame's batch; None as for :meth:`_decode`."""
        try:
            batch = decode_payload(payload, seq)
        except MalformedFrame as exc:
            self._reject(source, f"malformed replayed frame ({exc})")
            return None
        return self._accept(source, batch)

    def _accept(self, source: EventSource, batch: Batch) -> Batch | None:
        if batch.rank is not None and source.rank is not None and batch.rank != source.rank:
            self._reject(source, f"rank {batch.rank}'s events (check the endpoint order)")
            return None
        self.events[source.key] += len(batch.events)
        return batch

    def _reject(self, source: EventSource, what: str) -> None:
        self.decode_errors[source.key] += 1
        log.warning("kv events: %s from %s", what, source.key)

    async def _replays(self, source: EventSource, endpoint: str) -> None:
        key = source.engine
        feed = self.feeds[key]
        dealer = self._dealer(endpoint)
        try:
            self._ask(source, feed.probe())
            while True:
                start = feed.wanted
                if start is None:
                    with trio.move_on_after(self._probe_interval_s):
                        await self._wanted[key].wait()
                    self._wanted[key] = trio.Event()
                    if feed.wanted is None:
                        feed.probe()
                    continue
                ask = feed.asks
                frames, whole = await self._replay_frames(source, dealer, start)
                if not whole:  # a late rest of this answer must not pass for the next one's
                    close(dealer)
                    dealer = self._dealer(endpoint)
                if not frames and not whole:
                    log.warning("kv events: replay from %s failed (seq %d)", source.key, start)
                    feed.replay_failed(start, ask=ask)
                    self._note(source)
                    continue
                if not whole:
                    log.info(
                        "kv events: replay from %s (seq %d) stopped after %d batches without its"
                        " end; taking those and asking for the rest",
                        source.key,
                        start,
                        len(frames),
                    )
                await self._apply_replay(source, feed, start, frames, ask=ask)
                self._note(source)
        finally:
            close(dealer)

    def _dealer(self, endpoint: str) -> zmq.Socket[bytes]:
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        # vLLM's ROUTER sends a whole replay at once and drops what its peer's pipe cannot
        # take (a ROUTER never blocks): the default high-water mark (1,000) lost every frame
        # past it, end marker included, of a replay of a full 10,000-batch buffer.
        dealer.setsockopt(zmq.RCVHWM, _REPLAY_HWM)
        dealer.connect(endpoint)
        return dealer

    async def _apply_replay(
        self,
        source: EventSource,
        feed: Feed,
        start: int,
        frames: deque[tuple[int, bytes]],
        *,
        ask: int,
    ) -> None:
        """Decode and apply a replay's frames to ``feed`` a slice at a time (only one slice of
        decoded batches lives at once), its live batches held back meanwhile (module doc)."""
        key = source.engine
        run = _leading_run(sorted(frames, key=lambda frame: frame[0]))
        frames.clear()
        if not feed.replay_begins(start, run[0][0] if run else None, ask=ask):
            return
        ordered = deque(run[_pass_over_cleared(feed, run) :])
        del run  # the frames passed over go now, not after the replay is applied
        self._held[key] = held = trio.Event()
        try:
            applied = 0
            while ordered:
                batch = self._decode_replayed(source, *ordered.popleft())
                if batch is None:
                    feed.replay_failed(start, ask=ask)  # a hole: the replay cannot be trusted
                    return
                feed.replay_batch(batch)
                applied += 1
                if applied % _DECODE_SLICE == 0:
                    await trio.lowlevel.checkpoint()
            feed.replay_ends(start, ask=ask)
        finally:
            del self._held[key]
            held.set()

    async def _replay_frames(
        self, source: EventSource, dealer: zmq.Socket[bytes], start: int
    ) -> tuple[deque[tuple[int, bytes]], bool]:
        """The replay's (seq, payload) frames, the newest ``max_replay_bytes`` of them, and
        whether its end marker came; those that came before the answer went silent otherwise
        (none: no answer in time; module doc)."""
        fd = socket_fd(dealer)
        frames: deque[tuple[int, bytes]] = deque()
        kept = 0  # payload bytes
        timeout = self._replay_timeout_s
        with trio.CancelScope(deadline=trio.current_time() + timeout) as scope:
            try:
                dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)], zmq.NOBLOCK)
            except zmq.Again:
                return frames, False
            received = 0
            while True:
                try:
                    reply = dealer.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    await trio.lowlevel.wait_readable(fd)
                    continue
                scope.deadline = trio.current_time() + timeout  # the answer is coming
                received += 1
                if received % _RECEIVE_SLICE == 0:
                    await trio.lowlevel.checkpoint()
                if reply and reply[0] == b"":
                    reply = reply[1:]
                if len(reply) == 3:
                    reply = reply[1:]  # the topic (vLLM >= 0.26)
                if len(reply) != 2 or len(reply[0]) != 8:
                    self.decode_errors[source.key] += 1
                    continue
                seq = int.from_bytes(reply[0], "big", signed=True)
                if seq == _END:
                    return frames, True
                frames.append((seq, reply[1]))
                kept += len(reply[1])
                # The newest frame stays: a replay cut to nothing would read "none published".
                while kept > self._max_replay_bytes and len(frames) > 1:
                    kept -= len(frames.popleft()[1])
        return frames, False

    def snapshot(self) -> list[dict[str, object]]:
        """``GET /debug/kv-index``: one entry per engine and DP rank."""
        out: list[dict[str, object]] = []
        for source in self.sources:
            feed = self.feeds[source.engine]
            out.append(
                {
                    "url": source.url,
                    "endpoint": source.key,
                    "rank": source.rank if source.rank is not None else 0,
                    "blocks": len(feed.index),
                    "known": feed.known,
                    "state": feed.state.value,
                    "last_seq": feed.last_seq,
                    "gaps": feed.gaps,
                    "replays": feed.replays,
                    "restarts": feed.restarts,
                    "skipped": feed.index.skipped,
                    "evicted": feed.index.evicted,
                    "events": self.events[source.key],
                    "decode_errors": self.decode_errors[source.key],
                }
            )
        return out


def _pass_over_cleared(feed: Feed, run: Sequence[tuple[int, bytes]]) -> int:
    """Where to start applying a replay's ``run`` of frames: at its last batch that clears the
    cache, the ones before passed over (:meth:`~trio_pdrouter.kv.feed.Feed.replay_skip`). Found by
    the
    event's name in the payload, confirmed by decoding that frame alone."""
    for i in range(len(run) - 1, 0, -1):
        seq, payload = run[i]
        if _CLEARED not in payload:
            continue
        try:
            batch = decode_payload(payload, seq)
        except MalformedFrame:
            return 0  # the loop counts it and fails the replay
        if batch.clears:
            feed.replay_skip(run[0][0], seq - 1, batch.ts)
            return i
    return 0


def _leading_run(frames: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """The replay's frames up to the first one missing: those past a hole are left for the
    next replay, which the feed asks from the last one kept (module doc)."""
    for i in range(1, len(frames)):
        if frames[i][0] != frames[i - 1][0] + 1:
            return frames[:i]
    return frames
