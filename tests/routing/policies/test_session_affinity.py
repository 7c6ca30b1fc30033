"""``--kv-aware-session-affinity-ttl-secs``: sticky while the session keeps coming, soft on load,
never on prefill, bounded memory (time from trio's MockClock)."""

from __future__ import annotations

import random
from collections import Counter

import trio
import trio.testing

from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.routing import KvAware, PolicySettings, RoutingKey, make_policy
from trio_pdrouter.routing.policies import SessionTable

EPS = [Endpoint(f"http://10.0.0.{i}:8000", Role.DECODE) for i in range(3)]
TTL = 60
IDLE = dict.fromkeys(EPS, 0)


def settings(**overrides: object) -> PolicySettings:
    given: dict[str, object] = {
        "balance_abs_threshold": 8,
        "balance_rel_threshold": 1.5,
        "kv_aware_session_affinity_ttl_secs": TTL,
        **overrides,
    }
    return PolicySettings(**given)  # type: ignore[arg-type]


def decode_policy(seed: int = 0, **overrides: object) -> KvAware:
    policy = make_policy(
        "kv_aware",
        stage="decode",
        settings=settings(**overrides),
        on_decision=lambda _s, _r: None,
        endpoints=EPS,
        rng=random.Random(seed),
    )
    assert isinstance(policy, KvAware)
    return policy


def text(i: int) -> str:
    """Texts sharing no prefix, so the estimated tree does not stick them together."""
    return chr(0x4E00 + i) * 8


def session(name: str, prompt: str = "hello") -> RoutingKey:
    return RoutingKey(text=prompt, hash_key=name)


async def test_a_session_sticks_while_it_keeps_coming_and_is_free_once_idle_past_the_ttl(
    autojump_clock: trio.testing.MockClock,
) -> None:
    policy = decode_policy()
    home = policy.choose(EPS, IDLE, session("s1"))
    for _ in range(5):  # each request refreshes it: 5 x 50 s is far past one TTL
        await trio.sleep(TTL - 10)
        assert policy.choose(EPS, IDLE, session("s1", "other text")) == home
        assert policy.last.reason == "session"
    await trio.sleep(TTL)  # idle for a whole TTL: decided afresh
    seen = Counter(policy.choose(EPS, IDLE, session(f"later{i}", text(i))) for i in range(60))
    assert set(seen) == set(EPS)  # fresh sessions spread (no text in the tree yet)
    policy.choose(EPS, IDLE, session("s1", text(99)))
    assert policy.last.reason != "session"


async def test_the_affinity_is_soft_an_overloaded_or_missing_home_is_left_and_rebound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    policy = decode_policy()
    home = policy.choose(EPS, IDLE, session("s1"))
    others = [ep for ep in EPS if ep != home]
    # Above the least loaded, but within the balance thresholds: kept.
    assert policy.choose(EPS, {**IDLE, home: 8}, session("s1")) == home
    # Past both thresholds (pending plus active requests): left, and bound to the new choice.
    moved = policy.choose(EPS, {**IDLE, home: 20}, session("s1"))
    assert moved != home
    assert policy.choose(EPS, IDLE, session("s1")) == moved
    assert policy.last.reason == "session"
    # Its home no candidate (unhealthy, breaker open): another, which it then sticks to.
    survivors = [ep for ep in EPS if ep != moved]
    elsewhere = policy.choose(survivors, {ep: 0 for ep in survivors}, session("s1"))
    assert elsewhere in survivors
    assert policy.choose(EPS, IDLE, session("s1")) == elsewhere
    assert others  # three endpoints: there was always somewhere to go


def test_without_a_session_key_or_the_flag_nothing_sticks() -> None:
    policy = decode_policy()
    anonymous = Counter(policy.choose(EPS, IDLE, RoutingKey(text=text(i))) for i in range(60))
    assert len(anonymous) == 3
    plain = decode_policy(kv_aware_session_affinity_ttl_secs=None)
    bound = Counter(plain.choose(EPS, IDLE, session("s1", text(i))) for i in range(60))
    assert len(bound) == 3


def test_prefill_stays_kv_cost_based() -> None:
    policy = make_policy(
        "kv_aware",
        stage="prefill",
        settings=settings(load_metric="requests"),
        on_decision=lambda _s, _r: None,
        endpoints=EPS,
        rng=random.Random(0),
    )
    seen = Counter(policy.choose(EPS, IDLE, session("s1", text(i))) for i in range(60))
    assert len(seen) == 3


def test_a_removed_server_forgets_its_sessions() -> None:
    table = SessionTable(TTL, lambda: 0.0)
    table.bind("a", EPS[0])
    table.bind("b", EPS[1])
    table.keep_only(frozenset(EPS[1:]))
    assert table.home("a") is None and table.home("b") == EPS[1]


def test_memory_is_bounded_the_least_recently_used_session_goes_first() -> None:
    table = SessionTable(TTL, lambda: 0.0, max_sessions=3)
    for name in "abc":
        table.bind(name, EPS[0])
    table.bind("a", EPS[1])  # used again: now the most recent
    table.bind("d", EPS[2])
    assert len(table) == 3
    assert table.home("b") is None
    assert (table.home("a"), table.home("c"), table.home("d")) == (EPS[1], EPS[0], EPS[2])
