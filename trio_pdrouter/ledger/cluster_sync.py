"""Keeping :class:`~trio_pdrouter.ledger.replicas.PeerLoads` fresh: one round trip to Redis/Valkey
per sync interval.

Rules of this module:

* One round trip per interval, one server-side script (:data:`EXCHANGE`): write this replica's
  snapshot to its own key with an expiry (``PX``), then read every other live replica's key.
  Redis expires a key the instant its time is up (a read checks it), so a replica that died
  counts 0 for its peers within the expiry plus one of their intervals: no phantoms.
* :meth:`ClusterSync.run` never dies of the store: any failure (unreachable, timeout, a bad
  reply) is counted in a metric, logged once as a warning when the store goes down (and once
  when it comes back), and retried with a doubling backoff capped at :data:`MAX_BACKOFF`.
  Meanwhile routing runs on local counts (a failed exchange forgets the peers) and reconverges
  at the first exchange that succeeds.
* On a clean stop the replica deletes its key, so peers drop its charges at their next round.
* The client is coredis, native on trio through anyio: a round costs what redis-py's sync client
  in ``trio.to_thread`` costs (~0.4 ms of CPU, measured in ``benchmarks/cluster.py``), and unlike
  a thread a hung store can be cancelled. It is imported when a store is opened, not with this
  module: importing it costs ~0.4 s of CPU (half a worker's start-up), which routers without
  ``--cluster-url`` should not pay.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Protocol

import trio

from .replicas import PeerLoads, Snapshot, decode, encode

if TYPE_CHECKING:
    import coredis

log = logging.getLogger("trio_pdrouter.cluster")

#: Prefix of every key this router writes: ``<prefix><replica id>``, and the set of replica ids.
KEY_PREFIX = "trio-pdrouter:replica:"
MEMBERS = "trio-pdrouter:replicas"

#: The longest wait between two attempts while the store is unreachable.
MAX_BACKOFF = 0.5

#: KEYS[1]: the members set. ARGV: key prefix, own id, own snapshot, expiry in ms.
#: Returns ``[id, snapshot, id, snapshot, ...]`` of the other live replicas; forgets dead ones.
EXCHANGE = """
redis.call('SET', ARGV[1] .. ARGV[2], ARGV[3], 'PX', ARGV[4])
redis.call('SADD', KEYS[1], ARGV[2])
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if id ~= ARGV[2] then
    local snapshot = redis.call('GET', ARGV[1] .. id)
    if snapshot then
      out[#out + 1] = id
      out[#out + 1] = snapshot
    else
      redis.call('SREM', KEYS[1], id)
    end
  end
end
return out
"""


class Store(Protocol):
    """Where replicas meet: publish one snapshot, get the others back, in one step."""

    async def exchange(self, replica: str, snapshot: bytes, ttl_ms: int) -> dict[str, bytes]:
        """Write ``replica``'s snapshot (expiring after ``ttl_ms``); every other live one."""
        ...

    async def leave(self, replica: str) -> None:
        """Delete ``replica``'s snapshot at once."""
        ...


class RedisStore:
    """:class:`Store` on a Redis or Valkey server through coredis (open with :func:`connect`)."""

    def __init__(self, client: coredis.Redis[bytes]) -> None:
        self._client = client
        self._exchange = client.register_script(EXCHANGE)

    async def exchange(self, replica: str, snapshot: bytes, ttl_ms: int) -> dict[str, bytes]:
        reply: object = await self._exchange(
            keys=[MEMBERS], args=[KEY_PREFIX, replica, snapshot, ttl_ms]
        )
        if not isinstance(reply, list) or len(reply) % 2:
            raise ValueError(f"unexpected reply to the exchange script: {reply!r:.200}")
        items = [item if isinstance(item, bytes) else str(item).encode() for item in reply]
        return {items[i].decode(): items[i + 1] for i in range(0, len(items), 2)}

    async def leave(self, replica: str) -> None:
        await self._client.delete([KEY_PREFIX + replica])
        await self._client.srem(MEMBERS, [replica])


@asynccontextmanager
async def connect(url: str, timeout: float) -> AsyncIterator[RedisStore]:  # noqa: ASYNC109
    """A :class:`RedisStore` on ``url``; ``timeout`` bounds connecting and each reply.

    Connecting is lazy: an unreachable store is not an error here but at each exchange.
    """
    import coredis
    import coredis.retry

    client: coredis.Redis[bytes] = coredis.Redis.from_url(
        url,
        retry_policy=coredis.retry.NoRetryPolicy(),  # ClusterSync retries, with backoff
        connect_timeout=timeout,
        stream_timeout=timeout,
    )
    async with client:
        yield RedisStore(client)


class SyncObserver(Protocol):
    """What the sync loop reports (the router's metrics)."""

    def cluster_synced(self, peers: int, seconds: float) -> None: ...

    def cluster_sync_failed(self) -> None: ...


def exchange_timeout(ttl: float) -> float:
    """How long one exchange may take before it counts as failed (and the peers are forgotten)."""
    return max(ttl, 0.5)


class ClusterSync:
    """Publishes ``snapshot()`` and refreshes ``peers`` every ``interval`` seconds (see the
    module doc); ``peers.replica`` is the id it publishes under."""

    def __init__(
        self,
        store: Store,
        snapshot: Callable[[], Snapshot],
        peers: PeerLoads,
        *,
        interval: float,
        ttl: float,
        observer: SyncObserver,
    ) -> None:
        self._store = store
        self._snapshot = snapshot
        self._peers = peers
        self._interval = interval
        self._ttl_ms = max(1, math.ceil(ttl * 1000))
        self._timeout = exchange_timeout(ttl)
        self._observer = observer
        #: False from the first failed exchange until the next that succeeds.
        self.connected = True

    async def run(self) -> None:
        """Exchange every interval until cancelled; then leave the store (best effort)."""
        try:
            backoff = self._interval
            while True:
                if await self.sync_once():
                    backoff = self._interval
                else:
                    backoff = min(backoff * 2, max(MAX_BACKOFF, self._interval))
                await trio.sleep(self._interval if self.connected else backoff)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(self._timeout):
                try:
                    await self._store.leave(self._peers.replica)
                except Exception as exc:
                    log.info("cluster leave failed: %r (peers drop this replica on expiry)", exc)

    async def sync_once(self) -> bool:
        """One exchange; True if it succeeded. Never raises but for cancellation."""
        started = trio.current_time()
        try:
            with trio.fail_after(self._timeout):
                raw = await self._store.exchange(
                    self._peers.replica, encode(self._snapshot()), self._ttl_ms
                )
            snapshots: dict[str, Snapshot] = {}
            for replica, blob in raw.items():
                try:
                    snapshots[replica] = decode(blob)
                except ValueError:
                    log.warning("cluster peer=%s published an unreadable snapshot", replica)
        except Exception as exc:  # the store, the network, a timeout: keep serving, retry
            self._peers.forget()
            self._observer.cluster_sync_failed()
            if self.connected:
                log.warning(
                    "cluster store unreachable, routing on local counts: %r", exc, exc_info=False
                )
            self.connected = False
            return False
        self._peers.update(snapshots)
        self._observer.cluster_synced(len(snapshots), trio.current_time() - started)
        if not self.connected:
            log.warning("cluster store reachable again: peers=%d", len(snapshots))
        self.connected = True
        return True
