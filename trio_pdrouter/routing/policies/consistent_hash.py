"""``consistent_hash``: the same session goes to the same endpoint while that endpoint is healthy.

Every endpoint of the stage (healthy or not) owns ``virtual_nodes`` points on a 64-bit ring,
placed by a stable hash of ``f"{endpoint.key}#{i}"`` so every router process and restart agrees.
A request's point is the hash of its :attr:`RoutingKey.hash_key`; it goes to the owner of the first
ring point at or clockwise after it *whose owner is among the candidates*. An unhealthy owner
therefore hands its sessions to the next endpoint on the ring (spreading them over the survivors)
rather than to one fixed fallback, and adding or removing an endpoint moves only about 1/N of the
keys.

Requests without a ``hash_key`` are placed by a hash of their routing text, so identical prompts
still meet the same prefix cache; requests with neither go to the least-loaded candidate.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Mapping, Sequence

from ...endpoints import Endpoint
from ._base import RoutingKey
from ._choice import least_loaded


def ring_point(value: str) -> int:
    """A stable 64-bit point on the ring (Python's ``hash()`` is salted per process)."""
    digest = hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class ConsistentHash:
    """A hash ring with ``virtual_nodes`` points per endpoint; see the module docstring."""

    name = "consistent_hash"

    def __init__(self, rng: random.Random, *, virtual_nodes: int = 160) -> None:
        if virtual_nodes < 1:
            raise ValueError("virtual_nodes must be at least 1")
        self._rng = rng
        self._virtual_nodes = virtual_nodes
        self._points: list[int] = []
        self._owners: list[Endpoint] = []

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        ring = sorted(
            # The key breaks the (astronomically unlikely) tie of two equal points stably.
            (ring_point(f"{ep.key}#{i}"), ep.key, ep)
            for ep in set(endpoints)
            for i in range(self._virtual_nodes)
        )
        self._points = [point for point, _, _ in ring]
        self._owners = [ep for _, _, ep in ring]

    def choose(
        self, candidates: Sequence[Endpoint], loads: Mapping[Endpoint, int], key: RoutingKey
    ) -> Endpoint:
        if key.hash_key is not None:
            point = ring_point(key.hash_key)
        elif key.text:
            point = ring_point(key.text)
        else:
            return least_loaded(candidates, loads, self._rng)
        allowed = set(candidates)
        owners = self._owners
        size = len(owners)
        start = bisect.bisect_left(self._points, point)
        for step in range(size):
            owner = owners[(start + step) % size]
            if owner in allowed:
                return owner
        # Only reachable when the router offers candidates it never passed to set_endpoints.
        return least_loaded(candidates, loads, self._rng)

    def maintain(self) -> bool:
        return False
