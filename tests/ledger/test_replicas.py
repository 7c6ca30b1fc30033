"""PeerLoads: the peers' snapshots as routing sees them (pure; a fake clock)."""

from __future__ import annotations

import random

import orjson
import pytest

from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.ledger import LoadLedger, PeerLoads, Snapshot, cluster_view
from trio_pdrouter.ledger.replicas import decode, encode
from trio_pdrouter.routing import PolicySettings, Routing, RoutingKey, make_policy

A = Endpoint("http://d:1", Role.DECODE)
B = Endpoint("http://d:2", Role.DECODE)
P = Endpoint("http://p:1", Role.PREFILL)
Q = Endpoint("http://p:2", Role.PREFILL)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def first_version_decode(raw: bytes) -> dict[str, dict[str, int]]:
    """How a replica of the first snapshot version reads a snapshot (its whole reader)."""
    data = orjson.loads(raw)
    return {
        role: {k: n for k, n in counts.items() if type(n) is int and n > 0}
        for role, counts in data.items()
        if isinstance(counts, dict)
    }


def test_decode_keeps_only_positive_numbers_and_refuses_non_objects() -> None:
    raw = b'{"decode": {"a": 2, "b": -3, "c": "x", "d": true, "e": 0}, "x": 5}'
    assert decode(raw) == Snapshot({"decode": {"a": 2}})
    raw = b'{"decode": {"a": 2}, "visible": {"decode": {"a": -1}}, "tokens": {"decode": 3}}'
    assert decode(raw) == Snapshot({"decode": {"a": 2}}, {"decode": {}}, {})
    for bad in (b"[1]", b"not json", b"3"):
        with pytest.raises(ValueError):
            decode(bad)


def test_a_snapshot_round_trips_and_either_version_reads_the_other() -> None:
    counts = {"prefill": {P.key: 1}, "decode": {A.key: 3, B.key: 1}}
    visible = {"prefill": {P.key: 1}, "decode": {A.key: 2, B.key: 1}}
    tokens = {"prefill": {P.key: 900}, "decode": {A.key: 1500, B.key: 400}}
    snapshot = Snapshot(counts, visible, tokens)
    assert decode(encode(snapshot)) == snapshot
    # A first-version replica finds the counts where it always did; the two sections look like
    # roles without counts to it, which no endpoint of its has.
    old = first_version_decode(encode(snapshot))
    assert old == {**counts, "visible": {}, "tokens": {}}
    # A first-version snapshot here: its counts, visible the same, no token weight.
    from_old = decode(orjson.dumps(counts))
    assert from_old == Snapshot(counts)
    assert from_old.visible_counts() == counts and from_old.tokens == {}


def test_peers_sum_counts_visible_counts_and_token_weights_separately() -> None:
    clock = Clock()
    peers = PeerLoads("me", valid_for=0.2, clock=clock)
    peers.update(
        {
            "r2": Snapshot({"decode": {A.key: 3}}, {"decode": {A.key: 1}}, {"decode": {A.key: 30}}),
            "r3": Snapshot({"decode": {A.key: 2, B.key: 1}}),  # first version: visible = counts
        }
    )
    assert (peers.load(A), peers.visible(A), peers.token_load(A)) == (5, 3, 30)
    assert (peers.load(B), peers.visible(B), peers.token_load(B)) == (1, 1, 0)
    assert peers.add_tokens_to({A: 7, B: 0, P: 5}) == {A: 37, B: 0, P: 5}
    clock.now += 0.3  # stale: every number is 0
    assert (peers.load(A), peers.visible(A), peers.token_load(A)) == (0, 0, 0)
    assert peers.add_tokens_to({A: 7}) == {A: 7}
    peers.update({"r2": Snapshot({"decode": {A.key: 1}}, None, {"decode": {A.key: 9}})})
    peers.forget()
    assert peers.add_tokens_to({A: 7}) == {A: 7} and peers.visible(A) == 0


def test_peers_add_their_counts_per_endpoint_and_own_id_is_never_a_peer() -> None:
    clock = Clock()
    peers = PeerLoads("me", valid_for=0.2, clock=clock)
    peers.update(
        {
            "r2": Snapshot({"decode": {A.key: 3}, "prefill": {P.key: 1}}),
            "r3": Snapshot({"decode": {A.key: 1, B.key: 4}}),
            "me": Snapshot({"decode": {A.key: 50}}),
        }
    )
    assert peers.add_to({A: 1, B: 0, P: 0}) == {A: 5, B: 4, P: 1}
    assert peers.load(A) == 4
    assert set(peers.snapshots()) == {"r2", "r3"}


def test_a_peer_missing_from_the_next_update_counts_zero() -> None:
    peers = PeerLoads("me", valid_for=0.2, clock=Clock())
    peers.update({"r2": Snapshot({"decode": {A.key: 3}}), "r3": Snapshot({"decode": {A.key: 2}})})
    peers.update({"r3": Snapshot({"decode": {A.key: 2}})})
    assert peers.add_to({A: 0}) == {A: 2}


def test_every_peer_counts_zero_once_the_last_update_is_older_than_the_ttl() -> None:
    clock = Clock()
    peers = PeerLoads("me", valid_for=0.2, clock=clock)
    assert peers.add_to({A: 1}) == {A: 1}  # never updated
    peers.update({"r2": Snapshot({"decode": {A.key: 3}})})
    clock.now += 0.2
    assert peers.add_to({A: 1}) == {A: 4}
    clock.now += 0.001
    assert peers.add_to({A: 1}) == {A: 1}
    assert peers.snapshots() == {}
    assert peers.load(A) == 0


def test_forget_makes_every_peer_count_zero_until_the_next_update() -> None:
    peers = PeerLoads("me", valid_for=10, clock=Clock())
    peers.update({"r2": Snapshot({"decode": {A.key: 3}})})
    peers.forget()
    assert peers.add_to({A: 1}) == {A: 1} and peers.snapshots() == {}
    peers.update({"r2": Snapshot({"decode": {A.key: 2}})})
    assert peers.add_to({A: 1}) == {A: 3}


def test_cluster_view_lists_each_replica_and_the_sums() -> None:
    peers = PeerLoads("me", valid_for=1, clock=Clock())
    peers.update(
        {"r2": Snapshot({"decode": {A.key: 3}}, {"decode": {A.key: 2}}, {"decode": {A.key: 60}})}
    )
    own = Snapshot({"decode": {A.key: 1, B.key: 0}}, None, {"decode": {A.key: 20, B.key: 0}})
    view = cluster_view(own, peers)
    assert view == {
        "replica": "me",
        "replicas": {"me": {"decode": {A.key: 1, B.key: 0}}, "r2": {"decode": {A.key: 3}}},
        "total": {"decode": {A.key: 4, B.key: 0}},
        "visible": {"decode": {A.key: 3, B.key: 0}},
        "tokens": {"decode": {A.key: 80, B.key: 0}},
    }


def test_routing_chooses_on_own_plus_peer_counts_and_charges_only_its_own_ledger() -> None:
    ledger = LoadLedger([A, B])
    peers = PeerLoads("me", valid_for=1, clock=Clock())
    policy = make_policy(
        "power_of_two",
        stage="decode",
        settings=PolicySettings(),
        on_decision=lambda stage, reason: None,
        rng=random.Random(0),
    )
    routing = Routing({Role.DECODE: policy}, ledger, (), peers, by_tokens=(), models=None)
    routing.set_endpoints(Role.DECODE, [A, B])
    with ledger.lease(B):  # locally B is busier ...
        peers.update({"r2": Snapshot({"decode": {B.key: 0, A.key: 5}})})  # ... but a peer loads A
        for _ in range(20):
            lease, chosen = routing.lease_one(Role.DECODE, RoutingKey())
            with lease:
                assert chosen == B
                assert ledger.loads([A, B]) == {A: 0, B: 2}
    assert ledger.total() == 0


def test_a_token_stage_chooses_on_own_plus_peer_token_weights() -> None:
    ledger = LoadLedger([P, Q])
    peers = PeerLoads("me", valid_for=1, clock=Clock())
    policy = make_policy(
        "power_of_two",
        stage="prefill",
        settings=PolicySettings(),
        on_decision=lambda stage, reason: None,
        rng=random.Random(0),
    )
    routing = Routing(
        {Role.PREFILL: policy}, ledger, (), peers, by_tokens=(Role.PREFILL,), models=None
    )
    routing.set_endpoints(Role.PREFILL, [P, Q])
    key = RoutingKey(prompt_tokens=100)
    with ledger.lease(Q, tokens={Q: 1000}):  # locally Q carries more tokens ...
        # ... but a peer runs a long prompt on P (and fewer requests: counts would pick P)
        peers.update(
            {"r2": Snapshot({"prefill": {P.key: 1, Q.key: 2}}, None, {"prefill": {P.key: 5000}})}
        )
        for _ in range(20):
            lease, chosen = routing.lease_one(Role.PREFILL, key)
            with lease:
                assert chosen == Q
                assert ledger.token_loads([P, Q]) == {P: 0, Q: 1100}
    assert ledger.token_total() == 0
