"""What sharing prefix-tree inserts between workers costs per ``cache_aware`` choice.

The routing benchmark's prompt shape (one of 63 shared 3,000-character prefixes, then a unique
160-character question) is routed through ``--workers``-like policies in one process, each
request to the next worker in turn: one tree alone, N trees that each see their own share, and
N trees that share inserts through the machine table's prefix rings (what ``--workers N``
runs). CPU time per choice is ``time.process_time`` over all choices; with the rings, a choice
also inserts what the other N - 1 workers chose since, so it costs about N inserts.

Run ``python -m benchmarks.prefix_ring [workers] [choices]`` (defaults 4 and 4000).
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.machine import MachineTable, PrefixRing
from trio_pdrouter.routing import CacheAware, PolicySettings, RoutingKey

ENDPOINTS = [Endpoint("http://10.0.0.1:8000", Role.PREFILL, rank) for rank in range(4)]


def _requests(n: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    prefixes = ["".join(rng.choice("abcdefgh ") for _ in range(3000)) for _ in range(63)]
    return [
        rng.choice(prefixes) + "".join(rng.choice("xyz?") for _ in range(160)) for _ in range(n)
    ]


def cpu_per_choice_us(workers: int, shared: bool, requests: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        table = MachineTable.create(workers, str(Path(tmp) / "lock"))
        try:
            policies = []
            for row in range(workers):
                feed = PrefixRing(table.prefixes, workers, row, "prefill") if shared else None
                policy = CacheAware(
                    PolicySettings(),
                    random.Random(row),
                    stage="prefill",
                    on_decision=lambda stage, reason: None,
                    feed=feed,
                )
                policy.set_endpoints(ENDPOINTS)
                policies.append(policy)
            loads = dict.fromkeys(ENDPOINTS, 0)
            started = time.process_time()
            for i, text in enumerate(requests):
                policies[i % workers].choose(ENDPOINTS, loads, RoutingKey(text))
            return (time.process_time() - started) / len(requests) * 1e6
        finally:
            table.destroy()


def main(argv: list[str]) -> None:
    workers = int(argv[0]) if argv else 4
    requests = _requests(int(argv[1]) if len(argv) > 1 else 4000)
    rows = [
        ("one tree", cpu_per_choice_us(1, False, requests)),
        (f"{workers} trees, each its own share", cpu_per_choice_us(workers, False, requests)),
        (f"{workers} trees sharing inserts", cpu_per_choice_us(workers, True, requests)),
    ]
    for label, us in rows:
        print(f"{label:36} {us:7.1f} µs CPU per choice")


if __name__ == "__main__":
    main(sys.argv[1:])
