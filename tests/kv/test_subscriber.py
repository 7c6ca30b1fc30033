"""The KV-event subscriber over real ZMQ sockets on 127.0.0.1: live, gaps, replay, loss, DP."""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Callable

import pytest
import trio
import zmq

from trio_pdrouter.kv import MAX_REPLAY_BYTES, Batch, EventSource, Feed, KvEvents, block_keys
from trio_pdrouter_sim.engine import PrefixCache, block_hashes
from trio_pdrouter_sim.kv_events import KvJournal, serve_replay

BS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Engine:
    """A publisher: an LRU prefix cache whose changes go out on a bound PUB socket."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], rank: int, buffer: int) -> None:
        self.pub_port, self.replay_port = free_port(), free_port()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.pub_port}")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.journal = KvJournal(rank, BS, pub=self.pub, buffer=buffer)
        self.cache = PrefixCache(8, BS, self.journal)

    def prefill(self, tokens: list[int]) -> None:
        self.cache.insert(block_hashes(tokens, BS), tokens)

    def source(self, url: str, rank: int | None, *, replay: bool = True) -> EventSource:
        return EventSource(
            url,
            rank,
            f"tcp://127.0.0.1:{self.pub_port}",
            f"tcp://127.0.0.1:{self.replay_port}" if replay else None,
        )


async def until(check: Callable[[], bool], tries: int = 500) -> None:
    """Poll real state, bounded (the subscriber's sockets deliver on their own schedule)."""
    for _ in range(tries):
        if check():
            return
        await trio.sleep(0.01)
    raise AssertionError("condition never held")


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


PROMPTS = [[i] * 8 + list(range(8)) for i in range(6)]


def subscriber(
    sources: list[EventSource],
    ctx: zmq.Context[zmq.Socket[bytes]],
    *,
    probe_interval_s: float = 0.05,
    max_replay_bytes: int = MAX_REPLAY_BYTES,
    replay_timeout_s: float = 0.3,
) -> KvEvents:
    return KvEvents(
        sources,
        block_size=BS,
        weights={"GPU": 1.0},
        budget=1000,
        probe_interval_s=probe_interval_s,
        replay_timeout_s=replay_timeout_s,
        max_replay_bytes=max_replay_bytes,
        context=ctx,
    )


async def start(
    nursery: trio.Nursery, sources: list[EventSource], ctx: zmq.Context[zmq.Socket[bytes]]
) -> KvEvents:
    events = subscriber(sources, ctx)
    await nursery.start(events.run)
    return events


def credited(events: KvEvents, url: str, tokens: list[int]) -> int:
    feed = events.feed(url, None)
    assert feed is not None
    return feed.index.match(block_keys(tokens, BS))[0]


def same_blocks(events: KvEvents, url: str, engine: Engine) -> bool:
    feed = events.feed(url, None)
    assert feed is not None
    return feed.known and len(feed.index) == len(engine.cache)


async def test_a_warm_engine_is_rebuilt_by_replay_then_followed_live(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    engine = Engine(ctx, 0, buffer=100)
    engine.prefill(PROMPTS[0])  # before the router: only the replay has it
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_replay, engine.router, engine.journal)
        events = await start(nursery, [engine.source("http://e", None)], ctx)
        await until(lambda: same_blocks(events, "http://e", engine))
        assert credited(events, "http://e", PROMPTS[0]) == 4
        for prompt in PROMPTS[1:]:
            engine.prefill(prompt)  # evicts: the cache holds 8 blocks
        await until(lambda: credited(events, "http://e", PROMPTS[5]) == 4)
        await until(lambda: same_blocks(events, "http://e", engine))
        assert credited(events, "http://e", PROMPTS[0]) == 0  # evicted: no credit
        nursery.cancel_scope.cancel()


async def test_a_lost_batch_inside_the_buffer_is_replayed(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    engine = Engine(ctx, 0, buffer=100)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_replay, engine.router, engine.journal)
        events = await start(nursery, [engine.source("http://e", None)], ctx)
        feed = events.feed("http://e", None)
        assert feed is not None
        await until(lambda: feed.known)
        engine.journal.faults.drop_next = 2
        engine.prefill(PROMPTS[0])
        engine.prefill(PROMPTS[1])  # both lost live; the next one shows the gap
        engine.prefill(PROMPTS[2])
        await until(lambda: same_blocks(events, "http://e", engine) and feed.last_seq == 2)
        assert feed.replays >= 1 and credited(events, "http://e", PROMPTS[1]) == 4
        nursery.cancel_scope.cancel()


async def test_history_beyond_the_buffer_makes_the_engine_unknown(
    ctx: zmq.Context[zmq.Socket[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_pdrouter.kv_events")
    engine = Engine(ctx, 0, buffer=2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_replay, engine.router, engine.journal)
        events = await start(nursery, [engine.source("http://e", None)], ctx)
        feed = events.feed("http://e", None)
        assert feed is not None
        await until(lambda: feed.known)
        engine.prefill(PROMPTS[0])
        await until(lambda: feed.last_seq == 0)
        engine.journal.faults.drop_next = 4
        for prompt in PROMPTS[1:]:
            engine.prefill(prompt)
        await until(lambda: feed.last_seq == 5)
        assert not feed.known and feed.state.value == "unknown"
        assert credited(events, "http://e", PROMPTS[0]) == 0
        engine.cache.clear()  # AllBlocksCleared: exact again from here
        await until(lambda: feed.known and len(feed.index) == 0)
        nursery.cancel_scope.cancel()
    changes = [
        (r.levelname, r.getMessage().removeprefix("kv events: "))
        for r in caplog.records
        if r.name == "trio_pdrouter.kv_events" and " is " in r.getMessage()
    ]
    # Each change of exactness is logged once: known at start, lost, known again.
    assert [level for level, _ in changes] == ["INFO", "WARNING", "INFO"], changes
    assert changes[1][1].startswith("http://e is unknown")


async def test_a_long_running_engine_is_replayed_once_and_its_blocks_are_kept(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The usual restart of a router: the engine ran longer than its replay buffer. The first
    replay shows the history gone and gives the blocks its batches stored (UNKNOWN: some may be
    missing). Probes then ask only for what follows: the buffer is not fetched again at every
    probe, and the blocks stay."""
    engine = Engine(ctx, 0, buffer=2)
    for prompt in PROMPTS:
        engine.prefill(prompt)  # 6 batches; the buffer keeps the last 2 (prompts 4 and 5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_replay, engine.router, engine.journal)
        events = await start(nursery, [engine.source("http://e", None)], ctx)
        feed = events.feed("http://e", None)
        assert feed is not None
        await until(lambda: feed.replays >= 5)  # the first replay and four probes after it
        assert feed.state.value == "unknown" and feed.last_seq == 5
        assert credited(events, "http://e", PROMPTS[5]) == 4
        assert credited(events, "http://e", PROMPTS[4]) == 4
        assert events.events["http://e"] == 4  # the two buffered batches' events, once
        nursery.cancel_scope.cancel()


async def serve_slowly(router: zmq.Socket[bytes], journal: KvJournal, gap_s: float) -> None:
    """Answer one replay request, ``gap_s`` between its frames (a long replay under load)."""
    fd = router.getsockopt(zmq.FD)
    assert isinstance(fd, int)
    while True:
        try:
            identity, _empty, start = router.recv_multipart(zmq.NOBLOCK)
            break
        except zmq.Again:
            await trio.lowlevel.wait_readable(fd)
    for reply in journal.replay_frames(int.from_bytes(start, "big", signed=True)):
        router.send_multipart([identity, *reply])
        await trio.sleep(gap_s)


async def replayed_all(
    nursery: trio.Nursery, engine: Engine, ctx: zmq.Context[zmq.Socket[bytes]]
) -> tuple[KvEvents, Feed]:
    """``engine`` publishes all of :data:`PROMPTS` before a router starts following it (which
    then has them only by replay, from whatever answers the engine's replay socket)."""
    for prompt in PROMPTS:
        engine.prefill(prompt)
    events = await start(nursery, [engine.source("http://e", None)], ctx)
    feed = events.feed("http://e", None)
    assert feed is not None
    return events, feed


async def test_a_replay_that_keeps_coming_is_not_cut_by_its_timeout(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The timeout is silence between frames: a replay of 6 batches sent over ~0.6 s is taken
    whole with a 0.3 s timeout (a whole-replay timeout failed it, and the next probe fetched it
    all again)."""
    engine = Engine(ctx, 0, buffer=100)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_slowly, engine.router, engine.journal, 0.1)
        events, feed = await replayed_all(nursery, engine, ctx)
        await until(lambda: feed.replays == 1)
        assert feed.known and feed.last_seq == 5
        assert same_blocks(events, "http://e", engine)
        nursery.cancel_scope.cancel()


async def serve_lossy(
    router: zmq.Socket[bytes],
    journal: KvJournal,
    passes: Callable[[list[list[bytes]]], list[list[bytes]]],
) -> None:
    """Answer every replay request with the frames ``passes`` lets through of the whole answer
    (a ROUTER dropping what the DEALER's pipe cannot take when it sends)."""
    fd = router.getsockopt(zmq.FD)
    assert isinstance(fd, int)
    while True:
        try:
            identity, _empty, start = router.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            await trio.lowlevel.wait_readable(fd)
            continue
        for reply in passes(journal.replay_frames(int.from_bytes(start, "big", signed=True))):
            router.send_multipart([identity, *reply])


def first_two_unless_the_rest_fits(replies: list[list[bytes]]) -> list[list[bytes]]:
    """At most 2 batches, the end marker only when the rest fits."""
    return replies if len(replies) <= 3 else replies[:2]


def without_the_third(replies: list[list[bytes]]) -> list[list[bytes]]:
    return replies[:2] + replies[3:]


async def test_a_replay_that_stops_before_its_end_is_taken_and_the_rest_asked_for(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Each answer brings 2 of the 6 batches and no end marker: the router applies what came
    and asks from there, until it has them all (it used to fail every such replay, and the
    next probe asked for the whole history again)."""
    engine = Engine(ctx, 0, buffer=100)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            serve_lossy, engine.router, engine.journal, first_two_unless_the_rest_fits
        )
        events, feed = await replayed_all(nursery, engine, ctx)
        await until(lambda: feed.last_seq == 5)
        assert feed.known and same_blocks(events, "http://e", engine)
        assert credited(events, "http://e", PROMPTS[5]) == 4
        nursery.cancel_scope.cancel()


async def test_a_replay_with_a_hole_is_taken_up_to_it_and_the_rest_asked_for(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Every answer lacks one frame in the middle: the router keeps the frames before the hole
    and asks from there, until it has all 6 batches and is exact (it used to take the hole as
    a loss, go unknown and ask for the whole history again, never to see it whole)."""
    engine = Engine(ctx, 0, buffer=100)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_lossy, engine.router, engine.journal, without_the_third)
        events, feed = await replayed_all(nursery, engine, ctx)
        await until(lambda: feed.known and feed.last_seq == 5)
        assert same_blocks(events, "http://e", engine) and feed.gaps == 0
        nursery.cancel_scope.cancel()


async def test_a_replay_over_its_byte_budget_keeps_its_newest_batches_and_no_false_credit(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Past ``max_replay_bytes`` the oldest frames go: the replay starts later than asked, the
    feed is UNKNOWN, and its index holds what the newest batches stored (here: all the engine
    holds), nothing evicted before them."""
    engine = Engine(ctx, 0, buffer=100)
    for prompt in PROMPTS:
        engine.prefill(prompt)  # 6 batches; the cache keeps prompts 4 and 5
    sizes = [len(payload) for _seq, payload in engine.journal.buffer]
    events = subscriber(
        [engine.source("http://e", None)], ctx, max_replay_bytes=sizes[-1] + sizes[-2]
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_replay, engine.router, engine.journal)
        await nursery.start(events.run)
        feed = events.feed("http://e", None)
        assert feed is not None
        await until(lambda: feed.replays >= 1)
        assert not feed.known and feed.last_seq == 5
        assert events.events["http://e"] == 4  # two batches, a store and a remove each
        assert credited(events, "http://e", PROMPTS[4]) == 4
        assert credited(events, "http://e", PROMPTS[5]) == 4
        assert all(credited(events, "http://e", p) == 0 for p in PROMPTS[:4])
        nursery.cancel_scope.cancel()


async def test_a_long_replay_is_applied_in_slices_with_live_batches_held_back(
    ctx: zmq.Context[zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay of 200 batches is applied 64 at a time (checkpoints between slices); a live
    batch published in the middle, already in the router's SUB socket, reaches the feed only
    once the replay is applied (in between, a live restart would let the rest of the old
    process's replay be credited)."""
    engine = Engine(ctx, 0, buffer=1000)
    for i in range(200):
        engine.prefill([i] * 8)
    witness = ctx.socket(zmq.SUB)  # sees the live frame when the router's SUB can
    witness.setsockopt(zmq.SUBSCRIBE, b"")
    witness.connect(f"tcp://127.0.0.1:{engine.pub_port}")
    calls: list[str] = []
    events = subscriber([engine.source("http://e", None)], ctx, probe_interval_s=60.0)
    feed = events.feed("http://e", None)
    assert feed is not None
    begins, batch, ends, live = feed.replay_begins, feed.replay_batch, feed.replay_ends, feed.live

    def spy_batch(b: Batch) -> None:
        calls.append("replay")
        if len(calls) == 2:  # the replay has begun: a live batch goes out now
            engine.prefill([7777] * 8)
            assert witness.poll(2000), "the live frame never went out"
        batch(b)

    def spy_ends(start: int, *, ask: int) -> int | None:
        calls.append("ends")
        return ends(start, ask=ask)

    def spy_live(b: Batch) -> int | None:
        calls.append("live")
        return live(b)

    def spy_begins(start: int, first: int | None, *, ask: int) -> bool:
        calls.append("begins")
        return begins(start, first, ask=ask)

    monkeypatch.setattr(feed, "replay_begins", spy_begins)
    monkeypatch.setattr(feed, "replay_batch", spy_batch)
    monkeypatch.setattr(feed, "replay_ends", spy_ends)
    monkeypatch.setattr(feed, "live", spy_live)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_replay, engine.router, engine.journal)
            await nursery.start(events.run)
            await until(lambda: feed.last_seq == 200)
            assert calls[0] == "begins" and calls.index("ends") == 201, calls[:3]
            assert "live" not in calls[: calls.index("ends")]
            assert feed.known and same_blocks(events, "http://e", engine)
            nursery.cancel_scope.cancel()
    finally:
        witness.close(linger=0)


async def test_a_replay_of_a_full_vllm_buffer_arrives_whole(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """vLLM's ROUTER sends a replay all at once and drops what the DEALER's pipe refuses: a
    replay of a full buffer (10,000 batches) must not stop at the default high-water mark
    of 1,000 frames, nor lose its end marker. The simulated engine builds all 10,000 frames
    in this test's own event loop before sending the first, which on a loaded 2-core host can
    take longer than the other tests' 0.3 s replay timeout: this one waits longer."""
    engine = Engine(ctx, 0, buffer=10_000)
    for i in range(10_000):  # each batch stores and removes 16 blocks: ~1 KB
        keys = [i * 16 + b for b in range(16)]
        engine.journal.stored(keys, None, list(range(16 * BS)))
        engine.journal.removed(keys)
        engine.journal.step()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_replay, engine.router, engine.journal)
        events = subscriber([engine.source("http://e", None)], ctx, replay_timeout_s=10.0)
        await nursery.start(events.run)
        feed = events.feed("http://e", None)
        assert feed is not None
        # Whole, or (on a host too busy to drain the pipe) in parts, each asked from the last;
        # frames dropped in the middle leave a hole, and the next probe asks for all again.
        await until(lambda: feed.known and feed.last_seq == 9999, tries=2000)
        assert len(feed.index) == 0
        assert events.events["http://e"] == 20_000
        nursery.cancel_scope.cancel()


async def test_a_restart_clears_the_engine(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    engine = Engine(ctx, 0, buffer=100)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_replay, engine.router, engine.journal)
        events = await start(nursery, [engine.source("http://e", None)], ctx)
        feed = events.feed("http://e", None)
        assert feed is not None
        for prompt in PROMPTS[:2]:
            engine.prefill(prompt)
        await until(lambda: same_blocks(events, "http://e", engine) and feed.last_seq == 1)
        engine.journal.restart()
        engine.cache = PrefixCache(8, BS, engine.journal)
        engine.prefill(PROMPTS[3])
        await until(lambda: feed.restarts == 1 and same_blocks(events, "http://e", engine))
        assert credited(events, "http://e", PROMPTS[0]) == 0
        assert credited(events, "http://e", PROMPTS[3]) == 4
        nursery.cancel_scope.cancel()


async def test_a_dead_replay_source_makes_the_engine_unknown_and_serving_goes_on(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    engine = Engine(ctx, 0, buffer=100)
    engine.prefill(PROMPTS[0])
    engine.router.close(linger=0)  # nobody answers replays
    async with trio.open_nursery() as nursery:
        events = await start(nursery, [engine.source("http://e", None)], ctx)
        feed = events.feed("http://e", None)
        assert feed is not None
        await until(lambda: feed.state.value == "unknown")
        engine.prefill(PROMPTS[1])
        await until(lambda: feed.last_seq == 1)
        assert feed.state.value == "unknown" and len(feed.index) == 4
        assert credited(events, "http://e", PROMPTS[0]) == 0
        nursery.cancel_scope.cancel()


async def test_malformed_frames_are_counted_and_ignored(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    engine = Engine(ctx, 0, buffer=100)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_replay, engine.router, engine.journal)
        events = await start(nursery, [engine.source("http://e", None)], ctx)
        feed = events.feed("http://e", None)
        assert feed is not None
        await until(lambda: feed.known)
        engine.pub.send_multipart([b"", b"\x00" * 8, b"\xc1"])
        engine.pub.send_multipart([b"only two", b"frames"])
        engine.prefill(PROMPTS[0])
        await until(lambda: events.decode_errors["http://e"] == 2 and feed.last_seq == 0)
        assert feed.known and credited(events, "http://e", PROMPTS[0]) == 4
        nursery.cancel_scope.cancel()


async def test_dp_ranks_follow_their_own_endpoints(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    ranks = [Engine(ctx, 0, buffer=100), Engine(ctx, 1, buffer=100)]
    async with trio.open_nursery() as nursery:
        for engine in ranks:
            nursery.start_soon(serve_replay, engine.router, engine.journal)
        sources = [engine.source("http://e", rank) for rank, engine in enumerate(ranks)]
        events = await start(nursery, sources, ctx)
        ranks[1].prefill(PROMPTS[1])
        ranks[0].prefill(PROMPTS[0])
        feeds = [events.feed("http://e", r) for r in (0, 1)]
        await until(lambda: all(f is not None and f.last_seq == 0 for f in feeds))
        keys0, keys1 = (block_keys(p, BS) for p in PROMPTS[:2])
        assert feeds[0] is not None and feeds[1] is not None
        assert feeds[0].index.match(keys0)[0] == 4 and feeds[0].index.match(keys1)[0] == 0
        assert feeds[1].index.match(keys1)[0] == 4 and feeds[1].index.match(keys0)[0] == 0
        rows = {row["endpoint"]: row for row in events.snapshot()}
        assert rows["http://e@1"]["blocks"] == 4 and rows["http://e@1"]["known"]
        nursery.cancel_scope.cancel()


async def test_a_replay_of_another_ranks_events_gives_no_credit(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Endpoints given in the wrong order: rank 1's publisher behind rank 0's source. Its live
    batches and its replayed ones are refused alike (counted), never credited to rank 0."""
    engine = Engine(ctx, 1, buffer=100)
    engine.prefill(PROMPTS[0])  # before the router: only the replay has it
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_replay, engine.router, engine.journal)
        events = await start(nursery, [engine.source("http://e", 0)], ctx)
        feed = events.feed("http://e", 0)
        assert feed is not None
        await until(lambda: events.decode_errors["http://e@0"] >= 1)
        engine.prefill(PROMPTS[1])
        await until(lambda: events.decode_errors["http://e@0"] >= 2)
        assert len(feed.index) == 0 and not feed.known
        assert events.events["http://e@0"] == 0
        nursery.cancel_scope.cancel()


def test_the_collector_exposes_each_engines_counts() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from trio_pdrouter.kv import KvCollector

    events = KvEvents(
        [EventSource("http://e", 1, "tcp://127.0.0.1:1")],
        block_size=BS,
        weights={"GPU": 1.0},
        budget=10,
    )
    registry = CollectorRegistry()
    registry.register(KvCollector(events))
    text = generate_latest(registry).decode()
    assert 'trio_pdrouter_kv_state_unknown{endpoint="http://e@1"} 1.0' in text
    assert 'trio_pdrouter_kv_index_blocks{endpoint="http://e@1"} 0.0' in text
    assert 'trio_pdrouter_kv_event_gaps_total{endpoint="http://e@1"} 0.0' in text


async def test_a_replay_is_applied_from_its_last_clear_on(
    ctx: zmq.Context[zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine reset since its buffer began (an operator, a benchmark): the replay's batches
    before the clear are passed over, not decoded, and the index is the engine's."""
    engine = Engine(ctx, 0, buffer=1000)
    for i in range(200):
        engine.prefill([i] * 8)
    engine.cache.clear()
    for prompt in PROMPTS[:2]:
        engine.prefill(prompt)
    events = subscriber([engine.source("http://e", None)], ctx, probe_interval_s=60.0)
    feed = events.feed("http://e", None)
    assert feed is not None
    applied: list[int] = []
    batch = feed.replay_batch

    def spy_batch(b: Batch) -> None:
        applied.append(b.seq)
        batch(b)

    monkeypatch.setattr(feed, "replay_batch", spy_batch)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_replay, engine.router, engine.journal)
        await nursery.start(events.run)
        await until(lambda: feed.last_seq == 202)
        assert applied == [200, 201, 202]  # the clear's batch and the two after it
        assert feed.known and same_blocks(events, "http://e", engine)
        assert credited(events, "http://e", PROMPTS[1]) == 4
        engine.prefill(PROMPTS[2])  # then followed live
        await until(lambda: credited(events, "http://e", PROMPTS[2]) == 4)
        nursery.cancel_scope.cancel()
