"""Routing policies, one module each, all pure (see :mod:`._base` for the contract).

A policy chooses one endpoint among candidates from the loads it is handed and what it learnt of
earlier requests; it does no I/O, awaits nothing and reads no clock it was not given, so the
router charges its choice in the same step. :data:`POLICIES` names each policy's factory, and
:func:`make_policy` builds one by name. ``cache_aware`` keeps a radix tree of request text per
endpoint (:class:`RadixTree`); ``kv_aware`` reads vLLM's KV events (:class:`KvView`) and
forecasts what each engine will hold. With ``--workers N`` both share what they learn through the
machine's rings (:class:`InsertShare`, :class:`RouteShare`: protocols, the rings implement them).
``sticky_least_loaded`` keeps each session on the endpoint it was first sent to
(:class:`StickySessions`, one map per process).

May import the config, the KV events, the ledger's cost and the endpoints.
"""

from __future__ import annotations

import random as _random
import time
from collections.abc import Callable, Mapping, Sequence

import attrs
import trio

from ...config import POLICY_NAMES, PolicySettings
from ...endpoints import Endpoint
from ._base import DecisionObserver, Lesson, Policy, RoutingKey
from ._labels import utf8 as utf8_size
from .cache_aware import CacheAware, InsertShare
from .consistent_hash import ConsistentHash
from .kv_aware import KvAware, KvDecision, KvView, RouteShare
from .power_of_two import PowerOfTwo
from .radix_tree import RadixTree
from .random import Random
from .round_robin import RoundRobin
from .routing_key import routing_key
from .session_affinity import SessionTable
from .sticky_least_loaded import StickyLeastLoaded
from .sticky_sessions import StickySessions

__all__ = [
    "POLICIES",
    "POLICY_NAMES",
    "CacheAware",
    "ConsistentHash",
    "DecisionObserver",
    "InsertShare",
    "KvAware",
    "KvDecision",
    "KvView",
    "Lesson",
    "Policy",
    "PolicyParts",
    "PolicySettings",
    "PowerOfTwo",
    "RadixTree",
    "Random",
    "RoundRobin",
    "RouteShare",
    "RoutingKey",
    "SessionTable",
    "StickyLeastLoaded",
    "StickySessions",
    "make_policy",
    "routing_key",
    "utf8_size",
]


@attrs.frozen
class PolicyParts:
    """What :func:`make_policy` builds a policy from, for the factories of :data:`POLICIES`."""

    stage: str
    settings: PolicySettings
    on_decision: DecisionObserver
    rng: _random.Random
    feed: InsertShare | None
    kv: KvView | None
    routes: RouteShare | None


def _kv_aware(parts: PolicyParts) -> Policy:
    ttl = parts.settings.kv_aware_session_affinity_ttl_secs
    sessions = None  # prefill stays KV-cost based (vllm-router's rule)
    if ttl is not None and parts.stage != "prefill":
        sessions = SessionTable(ttl, trio.current_time)
    return KvAware(
        parts.settings,
        parts.rng,
        stage=parts.stage,
        on_decision=parts.on_decision,
        view=parts.kv,
        sessions=sessions,
        feed=parts.feed,
        routes=parts.routes,
    )


def _sticky_least_loaded(parts: PolicyParts) -> Policy:
    settings = parts.settings
    # The process's monotonic clock (trio's differs by an offset only): sessions age in real time.
    sessions = StickySessions(
        settings.sticky_session_ttl_secs, settings.sticky_max_sessions, time.monotonic
    )
    return StickyLeastLoaded(parts.rng, sessions, stage=parts.stage, on_decision=parts.on_decision)


#: Each ``--policy`` name and the factory of its policy; the names are those the config accepts
#: (:data:`~trio_pdrouter.config.POLICY_NAMES`, which cannot import this table).
POLICIES: Mapping[str, Callable[[PolicyParts], Policy]] = {
    "round_robin": lambda parts: RoundRobin(parts.rng),
    "random": lambda parts: Random(parts.rng),
    "power_of_two": lambda parts: PowerOfTwo(parts.rng),
    "consistent_hash": lambda parts: ConsistentHash(
        parts.rng, virtual_nodes=parts.settings.virtual_nodes
    ),
    "cache_aware": lambda parts: CacheAware(
        parts.settings,
        parts.rng,
        stage=parts.stage,
        on_decision=parts.on_decision,
        feed=parts.feed,
    ),
    "kv_aware": _kv_aware,
    "sticky_least_loaded": _sticky_least_loaded,
}


def make_policy(
    name: str,
    *,
    stage: str,
    settings: PolicySettings,
    on_decision: DecisionObserver,
    endpoints: Sequence[Endpoint] = (),
    rng: _random.Random | None = None,
    feed: InsertShare | None = None,
    kv: KvView | None = None,
    routes: RouteShare | None = None,
) -> Policy:
    """Build the policy called ``name`` for one stage over ``endpoints``.

    ``stage`` ("prefill", "decode" or "regular") labels the policy's log lines and decisions;
    ``on_decision`` is told ``(stage, reason)`` for every decision of a policy that gives
    reasons (``cache_aware``, ``kv_aware``, ``sticky_least_loaded``); ``kv`` is what
    ``kv_aware`` reads of the KV events (None: it uses its estimate only); ``feed`` shares the
    prefix-tree inserts of ``cache_aware`` (and ``kv_aware``'s estimate) with the machine's
    other workers (``--workers N``), ``routes`` its prompts in flight with the other workers'
    ``kv_aware`` forecasts; ``rng`` is the only source of randomness (pass a seeded one for
    reproducible tests).
    """
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    parts = PolicyParts(stage, settings, on_decision, rng or _random.Random(), feed, kv, routes)
    policy = factory(parts)
    policy.set_endpoints(endpoints)
    return policy
