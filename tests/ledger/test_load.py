"""The ledger alone: every lease releases each endpoint exactly once, whatever the order."""

import pytest
import trio
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.ledger import Lease, LoadLedger

P = [Endpoint("http://p:1", Role.PREFILL, r) for r in range(2)]
D = [Endpoint("http://d:1", Role.DECODE, r) for r in range(3)]


def test_lease_charges_at_once_and_releases_each_endpoint_once() -> None:
    ledger = LoadLedger([*P, *D])
    lease = ledger.lease(P[0], D[1])
    assert ledger.load(P[0]) == 1 and ledger.load(D[1]) == 1
    lease.release(P[0])
    lease.release(P[0])
    assert ledger.load(P[0]) == 0
    with lease:
        pass
    assert ledger.total() == 0
    lease.release(D[1])
    assert ledger.total() == 0


def test_token_weights_move_with_their_slots_and_return_to_zero() -> None:
    ledger = LoadLedger([*P, *D])
    a = ledger.lease(P[0], D[0], pending=(D[0],), tokens={P[0]: 300, D[0]: 428})
    b = ledger.lease(D[0], tokens={D[0]: 16_128})
    assert ledger.token_load(P[0]) == 300 and ledger.token_load(D[0]) == 16_556
    a.sent(D[0])  # sending moves no weight
    assert ledger.token_load(D[0]) == 16_556
    a.release(P[0])
    a.release(P[0])
    assert ledger.token_load(P[0]) == 0 and ledger.load(P[0]) == 0
    b.release_all()
    assert ledger.token_snapshot()["decode"]["http://d:1@0"] == 428
    with a:
        pass
    assert ledger.token_total() == 0 and ledger.total() == 0
    with pytest.raises(ValueError, match="0 or more"):
        ledger.lease(D[1], tokens={D[1]: -1})
    assert ledger.total() == 0, "a refused lease charges nothing"


def test_a_retired_endpoint_forgets_its_tokens_with_its_count() -> None:
    ledger = LoadLedger(D)
    lease = ledger.lease(D[0], tokens={D[0]: 50})
    ledger.forget_when_idle(D[0])
    assert ledger.token_load(D[0]) == 50
    lease.release_all()
    assert ledger.token_load(D[0]) == 0 and "http://d:1@0" not in ledger.token_snapshot()["decode"]


def test_snapshot_is_grouped_by_role_with_url_at_rank_keys() -> None:
    ledger = LoadLedger([*P, *D, Endpoint("http://w:1", Role.REGULAR)])
    ledger.lease(D[2])
    assert ledger.snapshot() == {
        "prefill": {"http://p:1@0": 0, "http://p:1@1": 0},
        "decode": {"http://d:1@0": 0, "http://d:1@1": 0, "http://d:1@2": 1},
        "regular": {"http://w:1": 0},
    }


async def test_async_exit_releases_even_when_cancelled() -> None:
    ledger = LoadLedger(D)
    with trio.CancelScope() as scope:
        async with ledger.lease(D[0]):
            scope.cancel()
            await trio.sleep_forever()
    assert ledger.total() == 0


async def test_exception_inside_the_block_releases() -> None:
    ledger = LoadLedger(D)
    with pytest.raises(RuntimeError):
        async with ledger.lease(D[0], D[1]) as lease:
            lease.release(D[0])
            raise RuntimeError("boom")
    assert ledger.total() == 0


def test_pending_decode_counts_in_load_but_not_in_visible_until_sent() -> None:
    ledger = LoadLedger([*P, *D])
    visible: list[tuple[str, int]] = []
    ledger.observe_visible(lambda ep, n: visible.append((ep.key, n)))
    lease = ledger.lease(P[0], D[0], pending=(D[0],))
    assert ledger.load(D[0]) == 1 and ledger.visible(D[0]) == 0
    lease.sent(D[0])
    assert ledger.visible(D[0]) == 1
    lease.sent(D[0])  # once only
    lease.release_all()
    assert ledger.visible(D[0]) == 0 and ledger.total() == 0
    decode_seen = [n for key, n in visible if key == "http://d:1@0"]
    assert decode_seen == [1, 0]  # visible only once sent, then released
    # A pending slot released without being sent never becomes visible.
    ledger.lease(D[1], pending=(D[1],)).release_all()
    assert ledger.visible(D[1]) == 0 and ledger.load(D[1]) == 0


def test_observers_see_every_change() -> None:
    ledger = LoadLedger(D)
    seen: list[tuple[str, int]] = []
    ledger.observe(lambda ep, n: seen.append((ep.key, n)))
    with ledger.lease(D[0]):
        pass
    assert seen == [("http://d:1@0", 1), ("http://d:1@0", 0)]


def test_removed_endpoint_is_forgotten_at_its_last_release() -> None:
    ledger = LoadLedger(D)
    first, second = ledger.lease(D[0]), ledger.lease(D[0], pending=(D[0],))
    ledger.forget_when_idle(D[0])
    assert ledger.snapshot()["decode"]["http://d:1@0"] == 2, "held: still counted"
    first.release_all()
    assert ledger.load(D[0]) == 1
    second.release_all()
    assert "http://d:1@0" not in ledger.snapshot()["decode"]
    ledger.forget_when_idle(D[1])  # idle: forgotten at once
    assert "http://d:1@1" not in ledger.snapshot()["decode"]


def test_a_slot_s_callback_runs_once_right_after_its_release_on_every_path() -> None:
    ledger = LoadLedger([*P, *D])
    seen: list[tuple[str, int]] = []

    def note(name: str, ep: Endpoint) -> None:
        seen.append((name, ledger.load(ep)))  # runs after the slot's release

    lease = ledger.lease(P[0], D[0], on_release={P[0]: lambda: note("p", P[0])})
    lease.release(P[0])
    lease.release(P[0])
    lease.release_all()
    assert seen == [("p", 0)]
    with (
        pytest.raises(RuntimeError),
        ledger.lease(P[1], on_release={P[1]: lambda: note("x", P[1])}),
    ):
        raise RuntimeError("boom")
    assert seen == [("p", 0), ("x", 0)]


class LedgerMachine(RuleBasedStateMachine):
    """Model: each open lease is the set of endpoints it still holds; a prefill slot's release
    callback has run once if it was released, never while held."""

    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.ledger = LoadLedger([*P, *D])
        self.model: dict[int, list[Endpoint]] = {}
        self.pending: dict[int, list[Endpoint]] = {}
        self.weights: dict[int, dict[Endpoint, int]] = {}
        #: Per lease with a prefill slot: that endpoint and its callback's runs.
        self.callbacks: dict[int, tuple[Endpoint, list[int]]] = {}

    @rule(target=leases, p=st.sampled_from(P), d=st.sampled_from(D), weight=st.integers(0, 9999))
    def open_pd(self, p: Endpoint, d: Endpoint, weight: int) -> Lease:
        runs: list[int] = []
        lease = self.ledger.lease(
            p,
            d,
            pending=(d,),
            tokens={p: weight, d: weight + 7},
            on_release={p: lambda: runs.append(1)},
        )
        self.callbacks[id(lease)] = (p, runs)
        self.model[id(lease)] = [p, d]
        self.pending[id(lease)] = [d]
        self.weights[id(lease)] = {p: weight, d: weight + 7}
        return lease

    @rule(lease=leases, which=st.sampled_from([*P, *D]))
    def send(self, lease: Lease, which: Endpoint) -> None:
        lease.sent(which)
        pending = self.pending.get(id(lease), [])
        if which in pending:
            pending.remove(which)

    @rule(target=leases, d=st.sampled_from(D))
    def open_regular(self, d: Endpoint) -> Lease:
        lease = self.ledger.lease(d)  # no weights given: 0 tokens
        self.model[id(lease)] = [d]
        self.weights[id(lease)] = {}
        return lease

    @rule(lease=leases, which=st.sampled_from([*P, *D]))
    def release_one(self, lease: Lease, which: Endpoint) -> None:
        lease.release(which)
        held = self.model[id(lease)]
        if which in held:
            held.remove(which)
            pending = self.pending.get(id(lease), [])
            if which in pending:
                pending.remove(which)

    @rule(lease=consumes(leases))
    def leave_block(self, lease: Lease) -> None:
        with lease:
            pass
        self.model[id(lease)] = []
        self.pending[id(lease)] = []

    @rule(lease=leases)
    def leave_block_twice(self, lease: Lease) -> None:
        lease.release_all()
        lease.release_all()
        self.model[id(lease)] = []
        self.pending[id(lease)] = []

    @invariant()
    def counts_equal_the_model(self) -> None:
        for ep in [*P, *D]:
            expected = sum(held.count(ep) for held in self.model.values())
            assert self.ledger.load(ep) == expected >= 0
            unsent = sum(p.count(ep) for p in self.pending.values())
            assert self.ledger.visible(ep) == expected - unsent >= 0
            tokens = sum(
                self.weights[lease].get(ep, 0) * held.count(ep)
                for lease, held in self.model.items()
            )
            assert self.ledger.token_load(ep) == tokens >= 0
        assert self.ledger.token_total() == sum(self.ledger.token_load(ep) for ep in [*P, *D])
        for lease, (p, runs) in self.callbacks.items():
            assert len(runs) == (0 if p in self.model[lease] else 1)

    def teardown(self) -> None:
        for held in self.model.values():
            held.clear()
        for pending in self.pending.values():
            pending.clear()


TestLedgerMachine = LedgerMachine.TestCase
