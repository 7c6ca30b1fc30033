"""The cluster sync loop: the exchange script on a real Redis, and the loop's resilience.

The store's behaviour (expiry, the script) is tested against a real redis-server; the loop's
rules (never dies, backoff, local counts while down, reconverge) against an in-memory store
under trio's MockClock, and once more end to end against the real server stopped and started.
"""

from __future__ import annotations

import functools

import trio
import trio.testing

from tests.redis_server import RedisServer
from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.ledger import MAX_BACKOFF, ClusterSync, LoadLedger, PeerLoads, Snapshot, connect
from trio_pdrouter.ledger.replicas import encode

A = Endpoint("http://d:1", Role.DECODE)


class Observer:
    def __init__(self) -> None:
        self.synced: list[int] = []
        self.failed = 0

    def cluster_synced(self, peers: int, seconds: float) -> None:
        self.synced.append(peers)

    def cluster_sync_failed(self) -> None:
        self.failed += 1


class MemoryStore:
    """A store in memory whose expiry follows trio's clock; ``down`` makes every call fail."""

    def __init__(self) -> None:
        self.keys: dict[str, tuple[bytes, float]] = {}
        self.down = False
        #: A crashed replica never gets to leave: its key must expire by itself.
        self.crashed = False
        self.calls = 0

    async def exchange(self, replica: str, snapshot: bytes, ttl_ms: int) -> dict[str, bytes]:
        self.calls += 1
        await trio.lowlevel.checkpoint()
        if self.down:
            raise ConnectionError("store down")
        now = trio.current_time()
        self.keys[replica] = (snapshot, now + ttl_ms / 1000)
        return {r: s for r, (s, until) in self.keys.items() if r != replica and until >= now}

    async def leave(self, replica: str) -> None:
        if not self.crashed:
            self.keys.pop(replica, None)


async def until(predicate: object, timeout: float = 5.0) -> None:  # noqa: ASYNC109
    """Bounded poll of state that only time (an expiry, another task's round) changes."""
    assert callable(predicate)
    with trio.fail_after(timeout):
        while not predicate():  # noqa: ASYNC110 - polls the store's effect, no event exists
            await trio.sleep(0.01)


# -- the exchange script on a real Redis ------------------------------------------------------


async def test_exchange_publishes_own_snapshot_and_returns_the_live_peers(
    redis_server: RedisServer,
) -> None:
    async with connect(redis_server.url, timeout=1) as store:
        assert await store.exchange("r1", b'{"decode":{"a":1}}', 60_000) == {}
        assert await store.exchange("r2", b'{"decode":{"a":2}}', 60_000) == {
            "r1": b'{"decode":{"a":1}}'
        }
        # Absolute counts: a new snapshot replaces the old one.
        assert await store.exchange("r1", b'{"decode":{"a":5}}', 60_000) == {
            "r2": b'{"decode":{"a":2}}'
        }
        await store.leave("r1")
        assert await store.exchange("r2", b"{}", 60_000) == {}


async def test_an_expired_peer_is_gone_from_the_next_exchange(redis_server: RedisServer) -> None:
    async with connect(redis_server.url, timeout=1) as store:
        await store.exchange("dead", b'{"decode":{"a":9}}', 100)
        assert "dead" in await store.exchange("alive", b"{}", 60_000)
        started = trio.current_time()
        seen: dict[str, bytes] = {"dead": b""}
        with trio.fail_after(1):
            while "dead" in seen:
                seen = await store.exchange("alive", b"{}", 60_000)
                await trio.sleep(0.01)
        assert trio.current_time() - started >= 0.09  # not before its expiry


# -- the loop's rules, in memory under MockClock ---------------------------------------------


def sync_on(store: MemoryStore, ledger: LoadLedger, replica: str) -> tuple[ClusterSync, PeerLoads]:
    peers = PeerLoads(replica, valid_for=0.2, clock=trio.current_time)
    sync = ClusterSync(
        store,
        functools.partial(Snapshot.of, ledger),
        peers,
        interval=0.05,
        ttl=0.2,
        observer=Observer(),
    )
    return sync, peers


async def test_peers_see_each_other_and_drop_a_stopped_replica_within_expiry_plus_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    ledger1, ledger2 = LoadLedger([A]), LoadLedger([A])
    sync1, _ = sync_on(store, ledger1, "r1")
    sync2, peers2 = sync_on(store, ledger2, "r2")
    async with trio.open_nursery() as nursery:
        crash = trio.CancelScope()

        async def replica1() -> None:
            with crash:
                await sync1.run()

        nursery.start_soon(replica1)
        nursery.start_soon(sync2.run)
        with ledger1.lease(A), ledger1.lease(A):
            await until(lambda: peers2.load(A) == 2)
            store.crashed = True
            crash.cancel()
            died = trio.current_time()
            await until(lambda: peers2.load(A) == 0)
            assert trio.current_time() - died <= 0.2 + 0.05 + 0.01
        nursery.cancel_scope.cancel()


async def test_store_down_routes_on_local_counts_backs_off_and_reconverges(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    ledger1, ledger2 = LoadLedger([A]), LoadLedger([A])
    sync1, _ = sync_on(store, ledger1, "r1")
    sync2, peers2 = sync_on(store, ledger2, "r2")
    observer2 = sync2._observer
    assert isinstance(observer2, Observer)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sync1.run)
        nursery.start_soon(sync2.run)
        with ledger1.lease(A):
            await until(lambda: peers2.load(A) == 1)
            store.down = True
            went_down = trio.current_time()
            await until(lambda: peers2.load(A) == 0)  # stale peers stop counting ...
            assert trio.current_time() - went_down <= 0.2 + 0.05 + 0.01
            assert not sync2.connected and observer2.failed >= 1
            # ... and the loop keeps trying, at most MAX_BACKOFF apart.
            calls = store.calls
            await trio.sleep(10)
            assert store.calls - calls >= 2 * 10 / MAX_BACKOFF - 2
            assert store.calls - calls <= 2 * 10 / 0.05 / 2  # it did back off
            store.down = False
            back = trio.current_time()
            await until(lambda: peers2.load(A) == 1)
            assert sync2.connected
            assert trio.current_time() - back <= MAX_BACKOFF + 0.01
        nursery.cancel_scope.cancel()


async def test_a_clean_stop_leaves_the_store_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    sync, _ = sync_on(store, LoadLedger([A]), "r1")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sync.run)
        await until(lambda: "r1" in store.keys)
        nursery.cancel_scope.cancel()
    assert "r1" not in store.keys


async def test_an_unreadable_peer_snapshot_is_skipped_not_fatal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    store.keys["bad"] = (b"\xff not json", 1e9)
    store.keys["good"] = (encode(Snapshot({"decode": {A.key: 3}})), 1e9)
    sync, peers = sync_on(store, LoadLedger([A]), "r1")
    assert await sync.sync_once()
    assert peers.load(A) == 3 and set(peers.snapshots()) == {"good"}


# -- the loop against a real Redis that stops and comes back ----------------------------------


async def test_real_redis_stopped_and_restarted(redis_server: RedisServer) -> None:
    ledger1, ledger2 = LoadLedger([A]), LoadLedger([A])
    async with (
        connect(redis_server.url, timeout=0.5) as store1,
        connect(redis_server.url, timeout=0.5) as store2,
        trio.open_nursery() as nursery,
    ):
        peers2 = PeerLoads("r2", valid_for=0.2, clock=trio.current_time)
        for store, ledger, peers in (
            (store1, ledger1, PeerLoads("r1", valid_for=0.2, clock=trio.current_time)),
            (store2, ledger2, peers2),
        ):
            sync = ClusterSync(
                store,
                functools.partial(Snapshot.of, ledger),
                peers,
                interval=0.05,
                ttl=0.2,
                observer=Observer(),
            )
            nursery.start_soon(sync.run)
        with ledger1.lease(A):
            await until(lambda: peers2.load(A) == 1)
            await redis_server.stop()
            await until(lambda: peers2.load(A) == 0, timeout=2)  # local counts only
            await redis_server.start()  # empty: every replica republishes
            back = trio.current_time()
            await until(lambda: peers2.load(A) == 1, timeout=5)
            # Within the backoff cap plus one interval of the first exchange (plus CPU slack).
            assert trio.current_time() - back <= MAX_BACKOFF + 0.05 + 0.5
        nursery.cancel_scope.cancel()
