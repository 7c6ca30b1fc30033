"""``random``: a uniformly random healthy candidate."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from ...endpoints import Endpoint
from ._base import RoutingKey


class Random:
    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(
        self, candidates: Sequence[Endpoint], loads: Mapping[Endpoint, int], key: RoutingKey
    ) -> Endpoint:
        return self._rng.choice(candidates)

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        pass

    def maintain(self) -> bool:
        return False
