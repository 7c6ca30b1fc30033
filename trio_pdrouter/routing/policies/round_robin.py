"""``round_robin``: each healthy candidate in turn, whatever its load."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from ...endpoints import Endpoint
from ._base import RoutingKey


class RoundRobin:
    name = "round_robin"

    def __init__(self, rng: random.Random) -> None:
        # Start at a random offset so that several router replicas do not march in step.
        self._next = rng.randrange(1 << 30)

    def choose(
        self, candidates: Sequence[Endpoint], loads: Mapping[Endpoint, int], key: RoutingKey
    ) -> Endpoint:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return chosen

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        pass

    def maintain(self) -> bool:
        return False
