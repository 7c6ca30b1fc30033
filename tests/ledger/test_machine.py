"""The machine ledger: N workers' rows in one shared block, summed by whoever reads."""

from __future__ import annotations

import fcntl
import os
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.ledger import Lease, MachineLedger
from trio_pdrouter.machine import COUNT, PENDING, MachineTable, TableFull
from trio_pdrouter.routing import PolicySettings, Routing, RoutingKey, make_policy

P = Endpoint("http://p:1", Role.PREFILL)
D = [Endpoint("http://d:1", Role.DECODE, r) for r in range(2)]
SHARED = Endpoint("http://p:1", Role.DECODE)  # the same URL in another role: its own column
EPS = [P, *D, SHARED]
WORKERS = 3


@pytest.fixture
def table(tmp_path: Path) -> Iterator[MachineTable]:
    t = MachineTable.create(WORKERS, str(tmp_path / "lock"), slots=8)
    yield t
    t.destroy()


@pytest.fixture
def attach(table: MachineTable) -> Iterator[Callable[[], MachineTable]]:
    """Another worker's view of ``table``."""
    views: list[MachineTable] = []

    def view() -> MachineTable:
        views.append(MachineTable.attach(table.name, table.lock_path))
        return views[-1]

    yield view
    for v in views:
        v.close()


def test_every_worker_reads_the_sum_of_all_rows(attach: Callable[[], MachineTable]) -> None:
    a = MachineLedger(attach(), 0, EPS)
    b = MachineLedger(attach(), 1, reversed(EPS))
    lease_a = a.lease(P, D[0], pending=(D[0],))
    lease_b = b.lease(D[0])
    for ledger in (a, b):
        assert ledger.load(D[0]) == 2 and ledger.visible(D[0]) == 1 and ledger.load(P) == 1
        assert ledger.load(SHARED) == 0
        assert ledger.snapshot()["decode"] == {
            "http://d:1@0": 2,
            "http://d:1@1": 0,
            "http://p:1": 0,
        }
    assert a.own(D[0]) == 1 and b.own(D[0]) == 1
    lease_a.release_all()
    lease_b.release_all()
    assert a.total() == 0 and b.total() == 0


def test_the_supervisor_zeroes_a_dead_workers_row(
    table: MachineTable, attach: Callable[[], MachineTable]
) -> None:
    dead = MachineLedger(attach(), 2, EPS)
    alive = MachineLedger(attach(), 0, EPS)
    dead.lease(D[1], pending=(D[1],))
    kept = alive.lease(D[1])
    assert alive.load(D[1]) == 2
    table.zero_row(2)
    assert alive.load(D[1]) == 1 and alive.visible(D[1]) == 1
    kept.release_all()
    assert alive.load(D[1]) == 0


def test_a_removed_endpoint_gives_its_slot_back_at_its_last_release(
    table: MachineTable, attach: Callable[[], MachineTable]
) -> None:
    a = MachineLedger(attach(), 0, D)
    b = MachineLedger(attach(), 1, D)
    lease = a.lease(D[0])
    for ledger in (a, b):
        ledger.forget_when_idle(D[0])
    assert "decode " + D[0].key in table.holders()  # a's lease still holds it
    lease.release_all()
    assert table.holders() == {"decode " + D[1].key: 2}
    assert a.load(D[0]) == 0 and b.load(D[0]) == 0


def test_a_full_table_refuses_an_endpoint_and_changes_nothing(
    table: MachineTable, attach: Callable[[], MachineTable]
) -> None:
    ledger = MachineLedger(attach(), 0)
    for i in range(table.slots):
        ledger.add_endpoint(Endpoint(f"http://d:{i + 1}", Role.DECODE))
    with pytest.raises(TableFull):
        ledger.add_endpoint(Endpoint("http://d:99", Role.DECODE))
    assert len(table.holders()) == table.slots
    assert "decode http://d:99" not in table.holders()


def test_the_lock_excludes_another_open_of_the_lock_file(table: MachineTable) -> None:
    other = os.open(table.lock_path, os.O_RDWR)
    try:
        # reentrant within the holder, exclusive for everyone else
        with table.locked(), table.locked(), pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free once the holder leaves
        fcntl.flock(other, fcntl.LOCK_UN)
    finally:
        os.close(other)


class MachineLedgerMachine(RuleBasedStateMachine):
    """N writers over one block: charges, sends, releases and kills in any order; every worker
    reads exactly the model's sum, never a negative count."""

    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(os.environ.get("TMPDIR", "/tmp"))
        self.table = MachineTable.create(WORKERS, str(self.dir / f"ml-{os.getpid()}-{id(self)}"))
        self.views: list[MachineTable] = []
        self.ledgers: list[MachineLedger] = []
        # the model: per worker, the lease -> (endpoints held, endpoints pending)
        self.held: list[dict[int, tuple[set[Endpoint], set[Endpoint]]]] = []
        # and the token weight each lease charged each endpoint with
        self.weights: dict[int, dict[Endpoint, int]] = {}
        self.generation = [0] * WORKERS

    @initialize()
    def start_workers(self) -> None:
        for row in range(WORKERS):
            self._start(row)

    def _start(self, row: int) -> None:
        view = MachineTable.attach(self.table.name, self.table.lock_path)
        ledger = MachineLedger(view, row, EPS if row % 2 else reversed(EPS))
        if row < len(self.ledgers):
            self.views[row].close()
            self.views[row], self.ledgers[row], self.held[row] = view, ledger, {}
        else:
            self.views.append(view)
            self.ledgers.append(ledger)
            self.held.append({})
        self.generation[row] += 1

    @rule(
        target=leases,
        row=st.integers(0, WORKERS - 1),
        eps=st.lists(st.sampled_from(EPS), min_size=1, max_size=3, unique=True),
        data=st.data(),
    )
    def charge(self, row: int, eps: list[Endpoint], data: st.DataObject) -> tuple[int, int, Lease]:
        pending = set(data.draw(st.lists(st.sampled_from(eps), unique=True)))
        weights = {ep: data.draw(st.integers(0, 40_000)) for ep in eps}
        ledger = self.ledgers[row]
        with ledger.charging():
            lease = ledger.lease(*eps, pending=pending, tokens=weights)
        self.held[row][id(lease)] = (set(eps), pending)
        self.weights[id(lease)] = weights
        return row, self.generation[row], lease

    @rule(held=leases, data=st.data())
    def send_or_release(self, held: tuple[int, int, Lease], data: st.DataObject) -> None:
        row, generation, lease = held
        if generation != self.generation[row]:
            return  # its worker died: the process that could release it is gone
        eps, pending = self.held[row][id(lease)]
        ep = data.draw(st.sampled_from(EPS))
        if data.draw(st.booleans()):
            lease.sent(ep)
            pending.discard(ep)
        else:
            lease.release(ep)
            eps.discard(ep)
            pending.discard(ep)

    @rule(held=consumes(leases))
    def leave_block(self, held: tuple[int, int, Lease]) -> None:
        row, generation, lease = held
        if generation == self.generation[row]:
            with lease:
                pass
            self.held[row][id(lease)] = (set(), set())

    @precondition(lambda self: bool(self.ledgers))
    @rule(row=st.integers(0, WORKERS - 1))
    def kill_and_replace(self, row: int) -> None:
        self.table.zero_row(row)
        self._start(row)

    def _model(self, ep: Endpoint) -> tuple[int, int, int]:
        count = pending = tokens = 0
        for worker in self.held:
            for lease, (eps, pend) in worker.items():
                count += ep in eps
                pending += ep in pend
                tokens += self.weights[lease][ep] if ep in eps else 0
        return count, pending, tokens

    @invariant()
    def every_worker_reads_the_model(self) -> None:
        for ep in EPS:
            count, pending, tokens = self._model(ep)
            for ledger in self.ledgers:
                assert ledger.load(ep) == count >= 0
                assert ledger.visible(ep) == count - pending >= 0
                assert ledger.token_load(ep) == tokens >= 0
                assert count or not tokens
        for row, ledger in enumerate(self.ledgers):
            for ep in EPS:
                own = sum(ep in eps for eps, _ in self.held[row].values())
                assert ledger.own(ep) == own >= 0

    def teardown(self) -> None:
        for view in self.views:
            view.close()
        self.table.destroy()


TestMachineLedgerMachine = MachineLedgerMachine.TestCase


def _waiting_on(path: str) -> bool:
    """True once some process or thread waits for the flock on ``path`` (``/proc/locks``)."""
    inode = os.stat(path).st_ino
    with open("/proc/locks") as locks:
        return any("->" in line and line.split()[6].endswith(f":{inode}") for line in locks)


def test_another_worker_chooses_only_once_a_charging_worker_has_charged(
    attach: Callable[[], MachineTable],
) -> None:
    """Two workers never both see an endpoint idle: a choose-and-charge in worker b waits for
    the one worker a is in, and then sees a's charge."""
    a = MachineLedger(attach(), 0, D)
    b = MachineLedger(attach(), 1, D)
    policy = make_policy(
        "consistent_hash",  # a request with no key goes to the least-loaded endpoint
        stage="decode",
        settings=PolicySettings(),
        on_decision=lambda stage, reason: None,
        rng=random.Random(0),
    )
    routing_b = Routing({Role.DECODE: policy}, b, (), None, by_tokens=(), models=None)
    routing_b.set_endpoints(Role.DECODE, D)
    chosen: list[Endpoint] = []

    def worker_b() -> None:
        chosen.append(routing_b.lease_one(Role.DECODE, RoutingKey("", None))[1])

    thread = threading.Thread(target=worker_b)
    with a.charging():  # worker a has read the loads (all idle) and is about to charge D[0]
        thread.start()
        for _ in range(500):  # bounded poll of real state: b is blocked on the machine lock
            if _waiting_on(a._table.lock_path):
                break
            thread.join(0.01)
        assert not chosen, "worker b chose while worker a held the machine lock"
        a.lease(D[0])
    thread.join(10)
    assert chosen == [D[1]]


def test_a_retired_endpoint_is_forgotten_at_its_last_release(
    attach: Callable[[], MachineTable],
) -> None:
    ledger = MachineLedger(attach(), 0, D)
    lease = ledger.lease(D[0])
    ledger.forget_when_idle(D[0])
    assert ledger.snapshot()["decode"] == {"http://d:1@0": 1, "http://d:1@1": 0}
    lease.release_all()
    assert ledger.snapshot()["decode"] == {"http://d:1@1": 0}
    assert ledger.load(D[0]) == 0


def test_the_visible_load_read_mid_charge_of_another_worker_is_never_negative(
    table: MachineTable, attach: Callable[[], MachineTable]
) -> None:
    ledger = MachineLedger(attach(), 0, D)
    # Worker 1 half-way through charging a PENDING slot as worker 0 reads COUNT, then PENDING:
    # the PENDING cell already written, its COUNT not read back yet.
    slot = table.hold(1, "decode " + D[0].key)
    table.add(1, slot, PENDING, 1)
    assert ledger.visible(D[0]) == 0
    assert ledger.visible_snapshot()["decode"] == {D[0].key: 0, D[1].key: 0}
    table.add(1, slot, COUNT, 1)
    assert ledger.visible(D[0]) == 0 and ledger.load(D[0]) == 1
    table.add(1, slot, PENDING, -1)  # sent
    assert ledger.visible(D[0]) == 1
