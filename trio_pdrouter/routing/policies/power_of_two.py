"""``power_of_two``: sample two distinct candidates, send to the less loaded one.

Two random choices give most of the benefit of always picking the global minimum while avoiding
the herd behaviour of every request chasing the same least-loaded endpoint.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from ...endpoints import Endpoint
from ._base import RoutingKey


class PowerOfTwo:
    """Two distinct random candidates; the lower load wins, a random one of the two on a tie."""

    name = "power_of_two"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(
        self, candidates: Sequence[Endpoint], loads: Mapping[Endpoint, int], key: RoutingKey
    ) -> Endpoint:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        load_a, load_b = loads.get(a, 0), loads.get(b, 0)
        if load_a != load_b:
            return a if load_a < load_b else b
        return a if self._rng.random() < 0.5 else b

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        pass

    def maintain(self) -> bool:
        return False
