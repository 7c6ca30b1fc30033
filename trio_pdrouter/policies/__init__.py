"""Routing policies, one module each, all pure (see :mod:`._base` for the contract)."""

from __future__ import annotations

import random as _random
from collections.abc import Sequence

import trio

from ..endpoints import Endpoint
from ._base import DecisionObserver, Lesson, Policy, PolicySettings, RoutingKey
from ._labels import utf8 as utf8_size
from .cache_aware import CacheAware, InsertFeed
from .consistent_hash import ConsistentHash
from .kv_aware import KvAware, KvDecision, KvView, RouteShare
from .power_of_two import PowerOfTwo
from .radix_tree import RadixTree
from .random import Random
from .round_robin import RoundRobin
from .routing_key import routing_key
from .session_affinity import SessionTable

__all__ = [
    "POLICY_NAMES",
    "CacheAware",
    "ConsistentHash",
    "DecisionObserver",
    "InsertFeed",
    "KvAware",
    "KvDecision",
    "KvView",
    "Lesson",
    "Policy",
    "PolicySettings",
    "PowerOfTwo",
    "RadixTree",
    "Random",
    "RoundRobin",
    "RouteShare",
    "RoutingKey",
    "make_policy",
    "routing_key",
    "utf8_size",
]

POLICY_NAMES = (
    "round_robin",
    "random",
    "power_of_two",
    "consistent_hash",
    "cache_aware",
    "kv_aware",
)


def make_policy(
    name: str,
    *,
    stage: str,
    settings: PolicySettings,
    on_decision: DecisionObserver,
    endpoints: Sequence[Endpoint] = (),
    rng: _random.Random | None = None,
    feed: InsertFeed | None = None,
    kv: KvView | None = None,
    routes: RouteShare | None = None,
) -> Policy:
    """Build the policy called ``name`` for one stage over ``endpoints``.

    ``stage`` ("prefill", "decode" or "regular") labels the policy's log lines and decisions;
    ``on_decision`` is told ``(stage, reason)`` for every decision of a policy that gives
    reasons (``cache_aware``, ``kv_aware``); ``kv`` is what ``kv_aware`` reads of the KV
    events (None: it uses its estimate only); ``feed`` shares the prefix-tree inserts of
    ``cache_aware`` (and ``kv_aware``'s estimate) with the machine's other workers
    (``--workers N``), ``routes`` its prompts in flight with the other workers' ``kv_aware``
    forecasts; ``rng`` is the only source of randomness (pass a seeded one for
    reproducible tests).
    """
    rng = rng or _random.Random()
    policy: Policy
    if name == "round_robin":
        policy = RoundRobin(rng)
    elif name == "random":
        policy = Random(rng)
    elif name == "power_of_two":
        policy = PowerOfTwo(rng)
    elif name == "consistent_hash":
        policy = ConsistentHash(rng, virtual_nodes=settings.virtual_nodes)
    elif name == "cache_aware":
        policy = CacheAware(settings, rng, stage=stage, on_decision=on_decision, feed=feed)
    elif name == "kv_aware":
        ttl = settings.kv_aware_session_affinity_ttl_secs
        sessions = None  # prefill stays KV-cost based (vllm-router's rule)
        if ttl is not None and stage != "prefill":
            sessions = SessionTable(ttl, trio.current_time)
        policy = KvAware(
            settings,
            rng,
            stage=stage,
            on_decision=on_decision,
            view=kv,
            sessions=sessions,
            feed=feed,
            routes=routes,
        )
    else:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    policy.set_endpoints(endpoints)
    return policy
