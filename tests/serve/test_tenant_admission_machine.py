"""Admission of several tenants by two workers sharing one machine table, driven by Hypothesis
through arrivals (any tenant, priority and cost), finishes, cancellations (queued or admitted)
and time passing (aging the queue, timing waiters out): after every step each tenant's numbers
read machine-wide are exactly what the requests hold, its limits hold, no waiter waits while a
slot of its worker is free; at the end everything is back to zero — and so after a worker died
with requests in flight and queued."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from trio_pdrouter.config import AdmissionSettings
from trio_pdrouter.machine import MachineTable
from trio_pdrouter.serve import REASONS, Admission, Rejected
from trio_pdrouter.tenants import MachineTenantLedger, Tenant, TenantLedger

LIMIT, QUEUE, TIMEOUT = 2, 3, 5.0
TENANTS = (
    Tenant("a", 1.0, max_concurrent_requests=3),
    Tenant("b", 2.0, tokens_per_second=400),
    Tenant("c", 1.0),
)
WORKERS = 2

arrive = st.tuples(
    st.just("arrive"),
    st.integers(0, WORKERS - 1),
    st.integers(0, len(TENANTS) - 1),
    st.integers(-3, 3),
    st.integers(1, 600),
)
finish = st.tuples(st.just("finish"), st.integers(0, 20))
cancel = st.tuples(st.just("cancel"), st.integers(0, 20))
wait = st.tuples(st.just("wait"), st.sampled_from([0.5, 1.0, 3.0, 6.0]))
OPS = st.lists(
    st.one_of(arrive, arrive, arrive, arrive, finish, cancel, wait), min_size=8, max_size=40
)


class _Gone(TenantLedger):
    """A dead worker's ledger: it changes nothing any more."""

    def change(self, name: str, in_flight: int = 0, queued: int = 0, served: int = 0) -> None:
        pass


class _Ask:
    def __init__(self, worker: int, tenant: Tenant) -> None:
        self.worker = worker
        self.tenant = tenant
        self.state = "waiting"
        self.done = trio.Event()
        self.scope = trio.CancelScope()


class Workers:
    """Two workers' admissions over one machine table (this process plays both)."""

    def __init__(self, directory: Path) -> None:
        self.table = MachineTable.create(WORKERS, str(directory / f"tam-{id(self)}"), slots=16)
        self.views = [MachineTable.attach(self.table.name, self.table.lock_path) for _ in "ab"]
        self.settings = AdmissionSettings(LIMIT, QUEUE, TIMEOUT, priority_aging_secs=1.0)
        self.admissions = [self._admission(row) for row in range(WORKERS)]
        self.asks: list[_Ask] = []
        self.refused: dict[str, int] = dict.fromkeys(REASONS, 0)

    def _admission(self, row: int) -> Admission:
        ledger = MachineTenantLedger(self.views[row], row)
        ledger.know(t.name for t in TENANTS)
        return Admission(self.settings, tenants=ledger)

    def close(self) -> None:
        for view in self.views:
            view.close()
        self.table.destroy()

    async def ask(self, ask: _Ask, priority: int, cost: int) -> None:
        with ask.scope:
            try:
                async with self.admissions[ask.worker].slot(priority, ask.tenant, cost):
                    ask.state = "admitted"
                    await ask.done.wait()
            except Rejected as exc:
                self.refused[exc.reason] += 1
        ask.state = "over"

    def live(self) -> list[_Ask]:
        return [a for a in self.asks if a.state != "over"]

    def check(self) -> None:
        ledger = self.admissions[0].tenants
        for t in TENANTS:
            mine = [a for a in self.live() if a.tenant == t]
            admitted = sum(a.state == "admitted" for a in mine)
            waiting = sum(a.state == "waiting" for a in mine)
            for adm in self.admissions:  # every worker reads the same, machine-wide
                assert adm.tenants.in_flight(t.name) == admitted, t
                assert adm.tenants.queued(t.name) == waiting, t
            if t.max_concurrent_requests is not None:
                assert admitted + waiting <= t.max_concurrent_requests
        assert ledger.served("c") >= 0
        for w, adm in enumerate(self.admissions):
            here = [a for a in self.live() if a.worker == w]
            assert adm.in_flight == sum(a.state == "admitted" for a in here) <= LIMIT
            assert adm.queued == sum(a.state == "waiting" for a in here) <= QUEUE
            if adm.queued:
                assert adm.in_flight == LIMIT  # the head is strict: no slot idles while one waits


@pytest.mark.parametrize("die", [False, True])
@given(ops=OPS)
def test_the_tenants_numbers_stay_exact_across_workers(die: bool, ops: list[tuple]) -> None:  # type: ignore[type-arg]
    workers = Workers(Path(os.environ.get("TMPDIR", "/tmp")))
    clock = trio.testing.MockClock()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for op in ops:
                if op[0] == "arrive":
                    _, worker, tenant, priority, cost = op
                    ask = _Ask(worker, TENANTS[tenant])
                    workers.asks.append(ask)
                    nursery.start_soon(workers.ask, ask, priority, cost)
                elif op[0] in ("finish", "cancel"):
                    live = workers.live()
                    if live:
                        ask = live[op[1] % len(live)]
                        if op[0] == "cancel":
                            ask.scope.cancel()
                        elif ask.state == "admitted":
                            ask.done.set()
                else:
                    clock.jump(op[1])
                await trio.testing.wait_all_tasks_blocked()
                workers.check()
            if die:
                # Worker 0 dies with whatever it holds: the supervisor zeroes its row, and
                # worker 1 reads only its own requests from then on.
                workers.table.zero_row(0)
                for ask in workers.live():
                    if ask.worker == 0:
                        ask.state = "over"
                ledger = workers.admissions[1].tenants
                for t in TENANTS:
                    mine = [a for a in workers.live() if a.tenant == t]
                    assert ledger.in_flight(t.name) == sum(a.state == "admitted" for a in mine)
                    assert ledger.queued(t.name) == sum(a.state == "waiting" for a in mine)
                # The dead worker's tasks end here without touching the table (a dead process
                # writes nothing).
                workers.admissions[0].tenants = _Gone()
                nursery.cancel_scope.cancel()
                return
            for ask in workers.asks:
                ask.done.set()
        workers.check()
        for t in TENANTS:
            assert workers.admissions[1].tenants.in_flight(t.name) == 0
            assert workers.admissions[1].tenants.queued(t.name) == 0

    try:
        trio.run(main, clock=clock)
    finally:
        workers.close()
