"""vLLM's KV events, as a simulated engine (one DP rank) publishes them over ZMQ.

Each engine's :class:`~.engine.PrefixCache` reports its stores, evictions and clears to a
:class:`KvJournal`; one call of the cache (one prompt's prefill) is one scheduler step, so one
batch. The journal numbers batches from 0 (per process: a restart starts at 0 again), keeps the
last ``buffer`` of them for replay, and sends each on its PUB socket as vLLM does::

    [topic, seq as 8 bytes big-endian, msgpack([ts, events, data_parallel_rank])]

Events are maps tagged ``"type"`` (``layout="map"``, current vLLM) or positional arrays
(``layout="array"``, vLLM up to about 0.23), with vLLM's field names and order. Block hashes are
the cache's chained hashes mixed with a salt random per journal (as vLLM's root seed is random
per process), so a router cannot reproduce them and must key blocks by their tokens.

Replay (a ROUTER socket): a DEALER sends ``[b"", start_seq (8 bytes)]`` and gets every buffered
batch from ``start_seq`` on as ``[b"", topic, seq, payload]``, then the end marker
``[b"", topic, seq -1, b""]`` (``legacy_replay=True`` leaves the topic out, as older vLLM).

Fault knobs (:class:`KvFaults`): drop the next N batches on the PUB socket (still numbered and
buffered, as a lost ZMQ message is), a silent start (``join_delay_s``: batches of the first
seconds are not sent live, the slow joiner), and :meth:`KvJournal.restart` (seq back to 0, new
salt, and the caller empties the cache).

Sockets are pyzmq, driven from trio without threads: sends never block (a PUB drops past its
high-water mark), and the ROUTER is drained with ``NOBLOCK`` until ``zmq.Again`` before each
``trio.lowlevel.wait_readable`` on its edge-triggered FD.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import msgspec
import trio
import zmq

Layout = Literal["map", "array"]
_MASK = (1 << 64) - 1
_END = (-1).to_bytes(8, "big", signed=True)


@attrs.define
class KvFaults:
    """What goes wrong on purpose (see the module doc)."""

    drop_next: int = 0
    join_delay_s: float = 0.0
    dropped: int = 0


def _stored_event(
    hashes: Sequence[int], parent: int | None, tokens: Sequence[int], block_size: int
) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def _positional(event: dict[str, Any]) -> list[Any]:
    return [event["type"], *(v for k, v in event.items() if k != "type")]


def encode_batch(
    ts: float, events: Sequence[dict[str, Any]], rank: int, layout: Layout = "map"
) -> bytes:
    """One batch's msgpack payload, as vLLM encodes it."""
    body: list[Any] = list(events) if layout == "map" else [_positional(e) for e in events]
    return msgspec.msgpack.encode([ts, body, rank])


class KvJournal:
    """One engine's published KV events: numbering, replay buffer, PUB socket (module doc).

    ``pub`` is the bound PUB socket (None: record only, for tests); ``clock`` gives the
    seconds since start that ``join_delay_s`` compares with.
    """

    def __init__(
        self,
        rank: int,
        block_size: int,
        *,
        pub: zmq.Socket[bytes] | None,
        layout: Layout = "map",
        buffer: int = 10_000,
        topic: bytes = b"",
        faults: KvFaults | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.rank = rank
        self.block_size = block_size
        self.layout = layout
        self.topic = topic
        self.faults = faults or KvFaults()
        self._pub = pub
        self._rng = rng or random.Random()
        self._salt = self._rng.getrandbits(64)
        self._seq = 0
        self._started = time.monotonic()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._events: list[dict[str, Any]] = []

    @property
    def next_seq(self) -> int:
        return self._seq

    def engine_hash(self, block: int) -> int:
        """The hash published for the cache's block ``block`` (salted, uint64)."""
        return (block ^ self._salt) & _MASK

    def stored(self, hashes: Sequence[int], parent: int | None, tokens: Sequence[int]) -> None:
        """Blocks ``hashes`` became cached; ``tokens`` are exactly theirs."""
        self._events.append(
            _stored_event(
                [self.engine_hash(h) for h in hashes],
                None if parent is None else self.engine_hash(parent),
                tokens,
                self.block_size,
            )
        )

    def removed(self, hashes: Sequence[int]) -> None:
        self._events.append(
            {
                "type": "BlockRemoved",
                "block_hashes": [self.engine_hash(h) for h in hashes],
                "medium": "GPU",
                "group_idx": 0,
            }
        )

    def cleared(self) -> None:
        self._events.append({"type": "AllBlocksCleared"})

    def step(self) -> None:
        """End of a scheduler step: publish what it produced as one batch (nothing: no batch)."""
        if not self._events:
            return
        payload = encode_batch(time.time(), self._events, self.rank, self.layout)
        self._events = []
        seq = self._seq
        self._seq += 1
        self.buffer.append((seq, payload))
        faults = self.faults
        if faults.drop_next > 0:
            faults.drop_next -= 1
            faults.dropped += 1
            return
        if time.monotonic() - self._started < faults.join_delay_s:
            faults.dropped += 1
            return
        if self._pub is not None:
            try:
                self._pub.send_multipart(
                    [self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
                )
            except zmq.Again:
                faults.dropped += 1

    def restart(self) -> None:
        """The engine process restarted: numbering from 0, a new salt, nothing buffered."""
        self._seq = 0
        self._salt = self._rng.getrandbits(64)
        self.buffer.clear()
        self._events = []
        self._started = time.monotonic()

    def replay_frames(self, start: int, *, legacy: bool = False) -> list[list[bytes]]:
        """The replies to a replay request from ``start``, end marker included."""
        head = [b""] if legacy else [b"", self.topic]
        out = [
            [*head, seq.to_bytes(8, "big"), payload] for seq, payload in self.buffer if seq >= start
        ]
        out.append([*head, _END, b""])
        return out


async def serve_replay(
    router: zmq.Socket[bytes], journal: KvJournal, *, legacy: bool = False
) -> None:
    """Answer replay requests on the bound ROUTER socket ``router`` until cancelled."""
    fd = router.getsockopt(zmq.FD)
    assert isinstance(fd, int)
    try:
        while True:
            while True:
                try:
                    frames = router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue
                identity = frames[0]
                start = int.from_bytes(frames[2], "big", signed=True)
                for reply in journal.replay_frames(start, legacy=legacy):
                    try:
                        router.send_multipart([identity, *reply], flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
            await trio.lowlevel.wait_readable(fd)
    finally:
        trio.lowlevel.notify_closing(fd)
        router.close(linger=0)


class KvPublishers:
    """The PUB (and replay ROUTER) sockets of every DP rank of one server, and their journals.

    Rank ``r`` binds ``host:pub_port + r`` (and ``host:replay_port + r``), as vLLM offsets its
    ports per rank; a port of 0 binds any free port per rank. With ``connect``
    (``tcp://HOST:PORT``) each rank's PUB connects to ``PORT + r`` instead (vLLM's way for an
    endpoint without ``*``); the replay ROUTER is bound either way, as vLLM binds it.
    :attr:`endpoints` and :attr:`replay_endpoints` give what was bound (or connected to).
    :meth:`run` answers replays until cancelled, then closes every socket.
    """

    def __init__(
        self,
        *,
        host: str,
        dp_size: int,
        block_size: int,
        pub_port: int,
        replay_port: int | None,
        connect: str | None = None,
        layout: Layout = "map",
        buffer: int = 10_000,
        join_delay_s: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.journals: list[KvJournal] = []
        self.endpoints: list[str] = []
        self.replay_endpoints: list[str] = []
        self._routers: list[zmq.Socket[bytes]] = []
        self._pubs: list[zmq.Socket[bytes]] = []
        for rank in range(dp_size):
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            if connect is None:
                self.endpoints.append(_bind(pub, host, pub_port, rank))
            else:
                base, _, port = connect.rpartition(":")
                self.endpoints.append(f"{base}:{int(port) + rank}")
                pub.connect(self.endpoints[-1])
            self._pubs.append(pub)
            if replay_port is not None:
                router = ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                self.replay_endpoints.append(_bind(router, host, replay_port, rank))
                self._routers.append(router)
            self.journals.append(
                KvJournal(
                    rank,
                    block_size,
                    pub=pub,
                    layout=layout,
                    buffer=buffer,
                    faults=KvFaults(join_delay_s=join_delay_s),
                    rng=rng,
                )
            )

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                for router, journal in zip(self._routers, self.journals, strict=False):
                    nursery.start_soon(serve_replay, router, journal)
                await trio.sleep_forever()
        finally:
            for pub in self._pubs:
                pub.close(linger=0)

    def describe(self) -> list[dict[str, Any]]:
        """Per rank: endpoints, next seq, batches buffered, batches dropped on purpose."""
        return [
            {
                "rank": j.rank,
                "endpoint": self.endpoints[j.rank],
                "replay_endpoint": (
                    self.replay_endpoints[j.rank] if self.replay_endpoints else None
                ),
                "next_seq": j.next_seq,
                "buffered": len(j.buffer),
                "dropped": j.faults.dropped,
            }
            for j in self.journals
        ]


def _bind(sock: zmq.Socket[bytes], host: str, base: int, rank: int) -> str:
    address = f"tcp://[{host}]" if ":" in host else f"tcp://{host}"
    if base == 0:
        port = sock.bind_to_random_port(address)
    else:
        port = base + rank
        sock.bind(f"{address}:{port}")
    return f"{address}:{port}"
