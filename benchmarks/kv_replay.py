"""A full replay of vLLM's KV events into one router-side subscriber: memory and CPU.

``python -m benchmarks.kv_replay`` fills a simulated engine's replay buffer (vLLM's default,
10,000 batches) with prefills of 9 blocks of 16 tokens into a 20,000-block prefix cache, starts
a :class:`~trio_pdrouter.kv.subscriber.KvEvents` in front of it on 127.0.0.1, and prints the
payload bytes replayed, the blocks indexed, the process's peak RSS before and after, its RSS
once the replay is applied, and the CPU time the replay took. Runs in one process: the
engine's journal and cache are part of the "before" figure.

``--clear-after N``: the engine clears its prefix cache (``AllBlocksCleared``) after its Nth
prefill, as a reset does; the router applies the replay from that clear on.
"""

from __future__ import annotations

import argparse
import gc
import random
import resource
import time

import trio
import zmq

from trio_pdrouter.kv import EventSource, KvEvents
from trio_pdrouter_sim.engine import PrefixCache, block_hashes
from trio_pdrouter_sim.kv_events import KvJournal, serve_replay

from .procs import free_port

BLOCK_SIZE = 16
BATCHES = 10_000


def _peak_mb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def _rss_mb() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS"))
    return int(line.split()[1]) // 1024


async def main(clear_after: int | None) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub_port, replay_port = free_port(), free_port()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    journal = KvJournal(0, BLOCK_SIZE, pub=pub, buffer=BATCHES)
    cache = PrefixCache(20_000, BLOCK_SIZE, journal)
    rng = random.Random(1)
    for n in range(BATCHES):
        if n == clear_after:
            cache.clear()
        tokens = [rng.randrange(30_000) for _ in range(9 * BLOCK_SIZE)]
        cache.insert(block_hashes(tokens, BLOCK_SIZE), tokens)
    payload = sum(len(p) for _seq, p in journal.buffer)
    gc.collect()
    before = _peak_mb()
    source = EventSource(
        "http://engine",
        None,
        f"tcp://127.0.0.1:{pub_port}",
        f"tcp://127.0.0.1:{replay_port}",
    )
    events = KvEvents(
        [source],
        block_size=BLOCK_SIZE,
        weights={"GPU": 1.0},
        budget=100_000,
        probe_interval_s=60.0,
        replay_timeout_s=5.0,
        context=ctx,
    )
    feed = events.feed(source.url, None)
    assert feed is not None
    cpu = time.process_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_replay, router, journal)
        await nursery.start(events.run)
        for _ in range(6000):  # a bounded poll of the feed's own count, 60 s at most
            if feed.replays >= 1:
                break
            await trio.sleep(0.01)
        else:
            raise SystemExit("the replay did not complete within 60 s")
        nursery.cancel_scope.cancel()
    cpu = time.process_time() - cpu
    gc.collect()
    print(
        f"replayed {BATCHES} batches, {payload / 1e6:.1f} MB of payload; {len(feed.index)} blocks"
        f" indexed (known: {feed.known}); peak RSS {before} -> {_peak_mb()} MB, RSS after"
        f" {_rss_mb()} MB; CPU {cpu:.2f} s"
    )
    pub.close(linger=0)
    ctx.destroy(linger=0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--clear-after", type=int, metavar="N", help="the engine clears its cache after N prefills"
    )
    trio.run(main, parser.parse_args().clear_after)
