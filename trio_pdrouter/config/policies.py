"""The routing policies' settings: which policy each stage runs, and their tunables.

The names are the ``--policy`` choices; :data:`trio_pdrouter.routing.policies.POLICIES` holds a
factory for each (a test checks that both name the same policies). :data:`LOAD_METRICS` names
what the load-reading policies compare: in-flight requests, or their token weights
(:mod:`trio_pdrouter.ledger.cost`).
"""

from __future__ import annotations

import attrs

from .flags import Flag, Group, must, non_negative, positive, setting
from .sizes import byte_size, show_size

__all__ = ["LOAD_METRICS", "POLICY_NAMES", "PolicySettings"]

POLICY_NAMES = (
    "round_robin",
    "random",
    "power_of_two",
    "consistent_hash",
    "cache_aware",
    "kv_aware",
    "sticky_least_loaded",
)
LOAD_METRICS = ("requests", "tokens")


def _kv_penalty(spelling: str, tier: str) -> Flag:
    return Flag(
        spelling,
        Group.KV_AWARE,
        f"kv_aware: credit for KV blocks held in the {tier} tier (0.0-1.0); no effect on other"
        " policies",
        type=float,
    )


_unit = must(lambda x: 0.0 <= x <= 1.0, "must be between 0.0 and 1.0")


@attrs.frozen
class PolicySettings:
    """Tunables of the policies, with vllm-router's defaults and their flags."""

    cache_threshold: float = setting(
        0.3,
        Flag(
            "--cache-threshold",
            Group.ROUTING_POLICY,
            "cache_aware: use the best prefix match when it covers more than this share of the"
            " request text (0.0-1.0)",
            type=float,
        ),
        check=must(lambda t: 0.0 <= t <= 1.0, "must be between 0.0 and 1.0"),
    )
    balance_abs_threshold: int = setting(
        64,
        Flag(
            "--balance-abs-threshold",
            Group.ROUTING_POLICY,
            "cache_aware: loads are unbalanced (pick the least loaded) when max-min exceeds this"
            " AND max > min * --balance-rel-threshold",
            type=int,
        ),
    )
    balance_rel_threshold: float = setting(
        1.5,
        Flag(
            "--balance-rel-threshold",
            Group.ROUTING_POLICY,
            "cache_aware and kv_aware: see --balance-abs-threshold",
            type=float,
        ),
    )
    balance_token_threshold: int = setting(
        0,
        Flag(
            "--balance-token-threshold",
            Group.ROUTING_POLICY,
            "cache_aware and kv_aware on a stage whose load metric is tokens:"
            " --balance-abs-threshold in tokens (the loads include the request's own uncached"
            " tokens, so the least loaded candidate is already the cheapest including cache"
            " hits)",
            type=int,
        ),
        check=non_negative,
    )
    load_metric: str | None = setting(
        None,
        Flag(
            "--load-metric",
            Group.ROUTING_POLICY,
            "the load power_of_two, cache_aware, kv_aware and the least-loaded choice compare"
            " on every stage: in-flight requests, or their token weights (prefill: uncached"
            " prompt tokens; decode: prompt + max_tokens). Default: tokens on prefill, requests on"
            " decode and regular workers (measured: docs/routing.md)",
            choices=LOAD_METRICS,
        ),
    )
    prefill_load_metric: str | None = setting(
        None,
        Flag(
            "--prefill-load-metric",
            Group.ROUTING_POLICY,
            "override --load-metric for prefill",
            choices=LOAD_METRICS,
        ),
    )
    decode_load_metric: str | None = setting(
        None,
        Flag(
            "--decode-load-metric",
            Group.ROUTING_POLICY,
            "override --load-metric for decode",
            choices=LOAD_METRICS,
        ),
    )
    eviction_interval_secs: float = setting(
        120.0,
        Flag(
            "--eviction-interval-secs",
            Group.ROUTING_POLICY,
            "cache_aware: seconds between prefix-tree evictions",
            type=float,
        ),
    )
    max_tree_size: int = setting(
        2**25,
        Flag(
            "--max-tree-size",
            Group.ROUTING_POLICY,
            "cache_aware: text (UTF-8 bytes) each endpoint may keep in the prefix tree",
            type=byte_size,
            show=show_size,
            metavar="SIZE",
        ),
        check=positive,
    )
    # kv_aware's knobs, with vllm-router's defaults and checks; with any other policy they
    # change nothing, as in vllm-router.
    router_temperature: float = setting(
        0.0,
        Flag(
            "--router-temperature",
            Group.KV_AWARE,
            "kv_aware: softmax temperature over endpoint scores (0: the best, ties at random);"
            " no effect on other policies",
            type=float,
        ),
        check=must(lambda t: t >= 0.0, "must be 0 or more"),
    )
    kv_penalty_host: float = setting(0.8, _kv_penalty("--kv-penalty-host", "host"), check=_unit)
    kv_penalty_external: float = setting(
        0.6, _kv_penalty("--kv-penalty-external", "external"), check=_unit
    )
    kv_penalty_disk: float = setting(0.3, _kv_penalty("--kv-penalty-disk", "disk"), check=_unit)
    kv_aware_session_affinity_ttl_secs: int | None = setting(
        None,
        Flag(
            "--kv-aware-session-affinity-ttl-secs",
            Group.KV_AWARE,
            "kv_aware on decode and regular stages: a session (X-Session-ID, X-User-ID,"
            " X-Tenant-ID, or the body's session_id/user) returns to its endpoint while idle"
            " less than this many seconds, unless that endpoint is overloaded or unavailable;"
            " no effect on prefill or other policies",
            type=int,
        ),
        check=must(lambda t: 1 <= t <= 31_536_000, "must be between 1 and 31536000"),
    )
    sticky_session_ttl_secs: float = setting(
        7200.0,
        Flag(
            "--sticky-session-ttl-secs",
            Group.ROUTING_POLICY,
            "sticky_least_loaded: a session is forgotten this many seconds after its last request"
            " (vllm-router's VLLM_ROUTER_SLL_SESSION_EXPIRATION_IN_S, which is not read: give"
            " this flag)",
            type=float,
        ),
        check=must(lambda t: 0.0 < t <= 31_536_000, "must be above 0 and at most 31536000"),
    )
    sticky_max_sessions: int = setting(
        65_536,
        Flag(
            "--sticky-max-sessions",
            Group.ROUTING_POLICY,
            "sticky_least_loaded: sessions each stage's map keeps per router process; past it the"
            " least recently used is forgotten",
            type=int,
        ),
        check=positive,
    )
    virtual_nodes: int = 160

    def stage_load_metric(self, stage: str) -> str:
        """The load metric of ``stage`` ("prefill", "decode" or "regular"): its own flag, else
        ``--load-metric``, else tokens for prefill and requests for the others (``kv_aware``
        counted prefill requests until 2026-12-05; see
        :mod:`trio_pdrouter.routing.policies.kv_aware`)."""
        if stage == "prefill" and self.prefill_load_metric:
            return self.prefill_load_metric
        if stage == "decode" and self.decode_load_metric:
            return self.decode_load_metric
        if self.load_metric:
            return self.load_metric
        return "tokens" if stage == "prefill" else "requests"
