"""The garbage collector of a router process, settled once the router serves.

A relayed event allocates a few dozen short-lived objects (trio's cancel statuses and
outcomes, hypercorn's and h11's events, the ASGI message), so at CPython's default threshold
(a young collection every 700 net container allocations) a busy router collects many times
a second, and each older-generation pass walks every long-lived object: the imported modules,
the app, the policies' trees. :func:`settle` moves what is alive once the router serves into
the permanent generation (``gc.freeze()``: never walked again, never freed, which suits what
lives as long as the process) and collects the young generation every
:data:`YOUNG_THRESHOLD` allocations instead. A garbage cycle of young objects is freed at the
next young collection, an older one at the next middle or full collection (every
:data:`OLDER_THRESHOLD` young, and middle, ones), so memory stays bounded.

Measured against the commit before it in one run (``BENCH_BASELINE=<checkout of bb1915c>
BENCH_PACED_MODES=regular,pd BENCH_PACED_C=64,256 BENCH_PACED_REPEATS=3 python -m benchmarks
--only paced``, medians of 3, README): router CPU per token-paced event at 256 streams
102.8 -> 98.3 us (the floor: 95.3), per PD request 15.57 -> 15.05 ms (the floor: 14.32); 64
streams unchanged; peak RSS unchanged. A repeat on a noisier machine lowered TTFT p50 and the
PD figure again but raised CPU per event at 256 streams by 9 % (README has all three runs).

Only the command line's processes call it (the single router and each worker): a test or an
embedding program keeps its own collector settings.
"""

from __future__ import annotations

import gc

__all__ = ["OLDER_THRESHOLD", "YOUNG_THRESHOLD", "settle"]

#: Net container allocations between two young-generation collections.
YOUNG_THRESHOLD = 20_000
#: Young collections between two middle-generation ones, and middle between two full ones.
OLDER_THRESHOLD = 20


def settle() -> None:
    """Freeze what is alive now and collect the young generation less often (module doc)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, OLDER_THRESHOLD, OLDER_THRESHOLD)
