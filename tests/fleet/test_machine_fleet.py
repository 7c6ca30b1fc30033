"""The fleets of ``--workers N`` over one machine table: slots and the change log reclaimed.

A Hypothesis state machine runs three workers' fleets over a tiny machine table (few slots, a
short change log) through adds and removes in any worker, leases taken and released, workers
catching up, drains, and workers dying and being replaced. At every quiet point (each worker
caught up, its drains run) every worker serves the same servers, each endpoint's load is the
leases held on it, and the slots held are exactly those some worker uses. A refused add changes
nothing, and no exception but a refusal ever escapes.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import trio
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from trio_pdrouter.config import BreakerSettings, HealthSettings
from trio_pdrouter.endpoints import Endpoint, Role, UpstreamPolicy
from trio_pdrouter.fleet import (
    Breakers,
    DuplicateServer,
    Fleet,
    FleetFull,
    HealthBoard,
    MachineServers,
    MachineVerdicts,
)
from trio_pdrouter.ledger import Lease, MachineLedger, slot_key
from trio_pdrouter.machine import MachineTable
from trio_pdrouter.routing import PolicySettings, Routing, make_policy

STATIC = [(Role.PREFILL, "http://p:1"), (Role.DECODE, "http://d:1")]
URLS = [f"http://s:{port}" for port in range(1, 6)]
ROLES = (Role.PREFILL, Role.DECODE)
DP = 2
ROWS = 3
SLOTS = 13  # the command line's 6 (4 endpoints, 2 health), then room for about two more servers
LOG = 12
CAP = 4


class Drains:
    """The nursery a worker drains removed servers in, run at the quiet points."""

    def __init__(self) -> None:
        self.pending: list[tuple[Callable[..., Awaitable[Any]], tuple[Any, ...]]] = []

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        self.pending.append((fn, args))

    def run(self) -> None:
        while self.pending:
            batch, self.pending = self.pending, []
            trio.run(_run_all, batch)


async def _run_all(batch: list[tuple[Callable[..., Awaitable[Any]], tuple[Any, ...]]]) -> None:
    for fn, args in batch:
        await fn(*args)


class Worker:
    """One worker process's view: its table attachment, ledger, health board and fleet."""

    def __init__(self, name: str, lock_path: str, row: int) -> None:
        self.row = row
        self.table = MachineTable.attach(name, lock_path)
        self.ledger = MachineLedger(self.table, row)
        self.health = HealthBoard(
            HealthSettings(), verdicts=MachineVerdicts(self.table, row), publish=row == 0
        )
        breakers = Breakers(BreakerSettings(), in_flight=self.ledger.load)
        policies = {
            role: make_policy(
                "round_robin",
                stage=role.value,
                settings=PolicySettings(),
                on_decision=lambda stage, reason: None,
                rng=random.Random(0),
            )
            for role in ROLES
        }
        routing = Routing(policies, self.ledger, (), None, by_tokens=(), models=None)
        self.drains = Drains()
        self.fleet = Fleet(
            dp_size=DP,
            routing=routing,
            ledger=self.ledger,
            health=self.health,
            breakers=breakers,
            machine=MachineServers(self.table, self.drains, 0.0),  # type: ignore[arg-type]
            max_runtime=CAP,
            policy=UpstreamPolicy(),
        )
        for role, url in STATIC:
            self.fleet.add_at_start(url, role)
        self.fleet.catch_up()
        self.table.keep_only(row)
        self.leases: list[tuple[Lease, Endpoint]] = []

    def remove(self, url: str, role: Role | None = None) -> None:
        """``DELETE /workers``: withdrawn at once, drained at the next quiet point."""
        removed = self.fleet.withdraw(url, role)  # a remove is never refused
        if removed:
            self.drains.start_soon(self.fleet.drain, removed, 0.0)

    def uses(self) -> set[str]:
        """The machine keys this worker must hold: its servers' endpoints and health, and the
        endpoints its requests still hold."""
        eps = {*self.fleet.endpoints(), *(ep for _, ep in self.leases)}
        return {slot_key(ep) for ep in eps} | {f"health {url}" for url in self.health.urls}


class FleetsOverOneTable(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.workers: list[Worker] = []
        self.table: MachineTable | None = None

    @initialize()
    def start(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="fleets-")
        lock = Path(self.tmp) / "lock"
        self.table = MachineTable.create(ROWS, str(lock), slots=SLOTS, log_entries=LOG)
        self.workers = [Worker(self.table.name, self.table.lock_path, r) for r in range(ROWS)]

    def teardown(self) -> None:
        for w in self.workers:
            w.table.close()
        if self.table is not None:
            self.table.destroy()
            shutil.rmtree(self.tmp)

    @rule(
        w=st.integers(0, ROWS - 1),
        url=st.sampled_from([*URLS, "http://d:1"]),
        role=st.sampled_from(ROLES),
    )
    def add(self, w: int, url: str, role: Role) -> None:
        worker = self.workers[w]
        assert self.table is not None
        worker.fleet.catch_up()
        before, held = worker.fleet.servers(), self.table.holders()
        try:
            worker.fleet.add(url, role, serving=True)
        except DuplicateServer:
            assert (role, url) in before
        except FleetFull:
            assert worker.fleet.servers() == before, "a refused add changed the servers"
            assert self.table.holders() == held, "a refused add held slots"
        else:
            assert (role, url) in worker.fleet.servers()

    @rule(
        w=st.integers(0, ROWS - 1),
        url=st.sampled_from([*URLS, "http://p:1", "http://d:1"]),
        role=st.sampled_from([None, *ROLES]),
    )
    def remove(self, w: int, url: str, role: Role | None) -> None:
        worker = self.workers[w]
        worker.remove(url, role)
        assert all((r, u) != (role or r, url) for r, u in worker.fleet.servers())

    @rule(w=st.integers(0, ROWS - 1), data=st.data())
    def lease(self, w: int, data: st.DataObject) -> None:
        worker = self.workers[w]
        eps = worker.fleet.endpoints()
        if eps:
            ep = data.draw(st.sampled_from(eps))
            worker.leases.append((worker.ledger.lease(ep), ep))

    @rule(w=st.integers(0, ROWS - 1), data=st.data())
    def release(self, w: int, data: st.DataObject) -> None:
        worker = self.workers[w]
        if worker.leases:
            i = data.draw(st.integers(0, len(worker.leases) - 1))
            lease, _ = worker.leases.pop(i)
            lease.release_all()

    @rule(w=st.integers(0, ROWS - 1))
    def follow(self, w: int) -> None:
        self.workers[w].fleet.catch_up()

    @rule(w=st.integers(0, ROWS - 1))
    def drain(self, w: int) -> None:
        self.workers[w].drains.run()

    @rule(w=st.integers(0, ROWS - 1))
    def restart(self, w: int) -> None:
        """The worker dies (its leases with it); the supervisor zeroes its row and starts a
        replacement, which catches up and lets go of what its predecessor held and it does not."""
        assert self.table is not None
        dead = self.workers[w]
        dead.table.close()
        self.table.zero_row(w)
        self.workers[w] = Worker(self.table.name, self.table.lock_path, w)

    @rule()
    def quiet_point(self) -> None:
        assert self.table is not None
        for _ in range(2):  # a drain's forget may free room another worker's catch-up needs
            for worker in self.workers:
                worker.fleet.catch_up()
                worker.drains.run()
        views = [set(w.fleet.servers()) for w in self.workers]
        assert all(view == views[0] for view in views), views
        expected: dict[str, int] = {}
        for worker in self.workers:
            for key in worker.uses():
                expected[key] = expected.get(key, 0) + 1
        assert self.table.holders() == expected

    @invariant()
    def loads_are_the_leases_held(self) -> None:
        held: dict[Endpoint, int] = {}
        for worker in self.workers:
            for _, ep in worker.leases:
                held[ep] = held.get(ep, 0) + 1
        for worker in self.workers:
            for ep in worker.fleet.endpoints():
                assert worker.ledger.load(ep) == held.get(ep, 0), ep

    @invariant()
    def runtime_servers_within_the_cap(self) -> None:
        for worker in self.workers:
            runtime = [key for key in worker.fleet.servers() if key not in STATIC]
            assert len(runtime) <= CAP


TestFleetsOverOneTable = FleetsOverOneTable.TestCase
TestFleetsOverOneTable.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)


def test_a_worker_that_fell_behind_compactions_converges(tmp_path: Path) -> None:
    table = MachineTable.create(2, str(tmp_path / "lock"), slots=64, log_entries=LOG)
    a, b = (Worker(table.name, table.lock_path, row) for row in range(2))
    try:
        a.fleet.add("http://s:1", Role.DECODE, serving=True)
        b.fleet.catch_up()
        assert (Role.DECODE, "http://s:1") in b.fleet.servers()
        a.remove("http://s:1")  # b knew it: it must learn it is gone
        a.remove("http://p:1", Role.PREFILL)  # a command-line server removed
        a.fleet.add("http://s:2", Role.PREFILL, serving=True)
        for _ in range(LOG):  # churn: the log is compacted several times meanwhile
            a.fleet.add("http://s:3", Role.DECODE, serving=True)
            a.remove("http://s:3")
        assert table.changes(0).reset, "the log was compacted"
        b.fleet.catch_up()
        assert (
            set(b.fleet.servers())
            == set(a.fleet.servers())
            == {
                (Role.DECODE, "http://d:1"),
                (Role.PREFILL, "http://s:2"),
            }
        )
        for w in (a, b):
            w.drains.run()
        expected: dict[str, int] = {}
        for w in (a, b):
            for key in w.uses():
                expected[key] = expected.get(key, 0) + 1
        assert table.holders() == expected
    finally:
        for w in (a, b):
            w.table.close()
        table.destroy()
