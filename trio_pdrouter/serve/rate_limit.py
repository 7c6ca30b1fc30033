"""``--rate-limit-tokens-per-second``: vllm-router's token bucket on arriving requests.

The bucket holds up to ``capacity`` tokens (``--max-concurrent-requests``, as in vllm-router) and
starts full; it refills at ``rate`` tokens a second. Every request that arrives takes one token
before it may be admitted; with none left it is refused at once with 429 and a
``Retry-After`` of the seconds until the next token (at least 1). So bursts of up to
``capacity`` pass, and over time at most ``rate`` requests a second.

Difference from vllm-router: there, the same bucket is also the concurrency limit (a finished
request gives its token back) and a request without a token waits in the queue. Here the
concurrency limit is :mod:`.admission`'s, exact for streams, and the bucket only bounds the
rate of arrivals, so a token is never given back.

Pure and synchronous: ``take`` is called with the current time and never awaits.
"""

from __future__ import annotations

import math


class TokenBucket:
    """``capacity`` tokens, refilled at ``rate`` a second (see the module doc)."""

    __slots__ = ("_capacity", "_rate", "_tokens", "_updated")

    def __init__(self, capacity: int, rate: float, now: float) -> None:
        self._capacity = float(capacity)
        self._rate = rate
        self._tokens = float(capacity)
        self._updated = now

    def take(self, now: float) -> int | None:
        """Take one token: None if there was one, else the seconds to wait for the next."""
        elapsed = max(0.0, now - self._updated)
        self._tokens = min(self._capacity, self._tokens + elapsed * self._rate)
        self._updated = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return None
        return max(1, math.ceil((1.0 - self._tokens) / self._rate))
