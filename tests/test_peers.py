"""PeerLoads: the peers' snapshots as routing sees them (pure; a fake clock)."""

from __future__ import annotations

import random

import pytest

from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.load import LoadLedger
from trio_pdrouter.peers import PeerLoads, cluster_view, decode, encode
from trio_pdrouter.policies import PolicySettings, RoutingKey, make_policy
from trio_pdrouter.routing import Routing

A = Endpoint("http://d:1", Role.DECODE)
B = Endpoint("http://d:2", Role.DECODE)
P = Endpoint("http://p:1", Role.PREFILL)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_decode_keeps_only_positive_counts_and_refuses_non_objects() -> None:
    raw = b'{"decode": {"a": 2, "b": -3, "c": "x", "d": true, "e": 0}, "x": 5}'
    assert decode(raw) == {"decode": {"a": 2}}
    assert decode(encode({"prefill": {"p": 1}})) == {"prefill": {"p": 1}}
    for bad in (b"[1]", b"not json", b"3"):
        with pytest.raises(ValueError):
            decode(bad)


def test_peers_add_their_counts_per_endpoint_and_own_id_is_never_a_peer() -> None:
    clock = Clock()
    peers = PeerLoads("me", valid_for=0.2, clock=clock)
    peers.update(
        {
            "r2": {"decode": {A.key: 3}, "prefill": {P.key: 1}},
            "r3": {"decode": {A.key: 1, B.key: 4}},
            "me": {"decode": {A.key: 50}},
        }
    )
    assert peers.add_to({A: 1, B: 0, P: 0}) == {A: 5, B: 4, P: 1}
    assert peers.load(A) == 4
    assert set(peers.snapshots()) == {"r2", "r3"}


def test_a_peer_missing_from_the_next_update_counts_zero() -> None:
    peers = PeerLoads("me", valid_for=0.2, clock=Clock())
    peers.update({"r2": {"decode": {A.key: 3}}, "r3": {"decode": {A.key: 2}}})
    peers.update({"r3": {"decode": {A.key: 2}}})
    assert peers.add_to({A: 0}) == {A: 2}


def test_every_peer_counts_zero_once_the_last_update_is_older_than_the_ttl() -> None:
    clock = Clock()
    peers = PeerLoads("me", valid_for=0.2, clock=clock)
    assert peers.add_to({A: 1}) == {A: 1}  # never updated
    peers.update({"r2": {"decode": {A.key: 3}}})
    clock.now += 0.2
    assert peers.add_to({A: 1}) == {A: 4}
    clock.now += 0.001
    assert peers.add_to({A: 1}) == {A: 1}
    assert peers.snapshots() == {}
    assert peers.load(A) == 0


def test_forget_makes_every_peer_count_zero_until_the_next_update() -> None:
    peers = PeerLoads("me", valid_for=10, clock=Clock())
    peers.update({"r2": {"decode": {A.key: 3}}})
    peers.forget()
    assert peers.add_to({A: 1}) == {A: 1} and peers.snapshots() == {}
    peers.update({"r2": {"decode": {A.key: 2}}})
    assert peers.add_to({A: 1}) == {A: 3}


def test_cluster_view_lists_each_replica_and_the_sum() -> None:
    peers = PeerLoads("me", valid_for=1, clock=Clock())
    peers.update({"r2": {"decode": {A.key: 3}}})
    view = cluster_view({"decode": {A.key: 1, B.key: 0}}, peers)
    assert view == {
        "replica": "me",
        "replicas": {"me": {"decode": {A.key: 1, B.key: 0}}, "r2": {"decode": {A.key: 3}}},
        "total": {"decode": {A.key: 4, B.key: 0}},
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
    routing = Routing({Role.DECODE: policy}, ledger, (), peers, by_tokens=())
    routing.set_endpoints(Role.DECODE, [A, B])
    with ledger.lease(B):  # locally B is busier ...
        peers.update({"r2": {"decode": {B.key: 0, A.key: 5}}})  # ... but a peer loads A
        for _ in range(20):
            lease, chosen = routing.lease_one(Role.DECODE, RoutingKey())
            with lease:
                assert chosen == B
                assert ledger.loads([A, B]) == {A: 0, B: 2}
    assert ledger.total() == 0
