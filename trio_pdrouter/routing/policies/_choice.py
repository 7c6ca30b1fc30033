"""Tie-breaking shared by the load-reading policies."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from ...endpoints import Endpoint


def least_loaded(
    candidates: Sequence[Endpoint], loads: Mapping[Endpoint, int], rng: random.Random
) -> Endpoint:
    """The candidate with the lowest load; a uniformly random one among equals.

    Picking the first of equals would pile every idle-time request onto one endpoint, which is
    exactly the skew the policies exist to avoid.
    """
    best = min(loads.get(c, 0) for c in candidates)
    tied = [c for c in candidates if loads.get(c, 0) == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)
