"""Admission between tenants: shares by weight in tokens while saturated, each tenant's limits
(429 with Retry-After), a full queue that pushes out the tenant most over its share, and the
tenants' numbers exact on every path."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_pdrouter.config import AdmissionSettings
from trio_pdrouter.serve import (
    QUEUE_FULL,
    QUEUE_TIMEOUT,
    TENANT_CONCURRENCY,
    TENANT_SHARE,
    TENANT_TOKENS,
    Admission,
    Rejected,
)
from trio_pdrouter.tenants import Tenant, TenantLedger

HEAVY = Tenant("heavy")
LIGHT = Tenant("light")


def admission(limit: int = 1, queue: int = 100, timeout: float = 1e6) -> Admission:
    return Admission(AdmissionSettings(limit, queue, timeout, priority_aging_secs=0))


def assert_settled(adm: Admission, *tenants: Tenant) -> None:
    assert (adm.in_flight, adm.queued) == (0, 0)
    for t in tenants:
        assert (adm.tenants.in_flight(t.name), adm.tenants.queued(t.name)) == (0, 0), t


async def _saturate(
    adm: Admission, clients: dict[Tenant, int], costs: dict[Tenant, int], rounds: int
) -> list[str]:
    """Each tenant's clients ask again as soon as they are answered, ``rounds`` times each; a
    request holds its slot one (virtual) second. The tenants admitted while every tenant had a
    waiter, in order."""
    admitted: list[str] = []
    names = [t.name for t in clients]

    async def client(tenant: Tenant) -> None:
        for _ in range(rounds):
            async with adm.slot(0, tenant, costs[tenant]):
                if all(adm.queued_of(n) for n in names):
                    admitted.append(tenant.name)
                await trio.sleep(1)

    async with trio.open_nursery() as nursery:
        for tenant, n in clients.items():
            for _ in range(n):
                nursery.start_soon(client, tenant)
    assert_settled(adm, *clients)
    return admitted


async def test_two_equal_tenants_share_admissions_whatever_their_clients(
    autojump_clock: trio.testing.MockClock,
) -> None:
    costs = {HEAVY: 100, LIGHT: 100}
    admitted = await _saturate(admission(limit=2), {HEAVY: 20, LIGHT: 2}, costs, rounds=10)
    assert len(admitted) > 20
    share = admitted.count("light") / len(admitted)
    assert 0.45 <= share <= 0.55, share
    # One tenant for all (what one FIFO does): the light clients get their count's share.
    fifo = admission(limit=2)
    one = Tenant("one")
    order: list[int] = []

    async def client(i: int) -> None:
        for _ in range(10):
            async with fifo.slot(0, one, 100):
                if fifo.queued:
                    order.append(i)
                await trio.sleep(1)

    async with trio.open_nursery() as nursery:
        for i in range(22):
            nursery.start_soon(client, i)
    assert sum(1 for i in order if i >= 20) / len(order) < 0.15


async def test_shares_are_by_weight(autojump_clock: trio.testing.MockClock) -> None:
    gold, bronze = Tenant("gold", weight=3), Tenant("bronze", weight=1)
    admitted = await _saturate(
        admission(limit=2), {gold: 6, bronze: 6}, {gold: 10, bronze: 10}, rounds=20
    )
    share = admitted.count("gold") / len(admitted)
    assert 0.7 <= share <= 0.8, share


async def test_shares_are_in_tokens_so_long_prompts_do_not_starve_short_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    costs = {HEAVY: 1000, LIGHT: 100}
    admitted = await _saturate(admission(limit=1), {HEAVY: 4, LIGHT: 4}, costs, rounds=30)
    tokens = {
        name: admitted.count(name) * costs[t] for t, name in ((HEAVY, "heavy"), (LIGHT, "light"))
    }
    light_share = tokens["light"] / (tokens["light"] + tokens["heavy"])
    assert 0.4 <= light_share <= 0.6, tokens
    assert admitted.count("light") >= 8 * admitted.count("heavy")


async def test_priority_orders_a_tenants_own_line() -> None:
    adm = admission(limit=1)
    order: list[str] = []
    release = trio.Event()

    async def hold(name: str, tenant: Tenant, priority: int, until: trio.Event) -> None:
        async with adm.slot(priority, tenant, 10):
            order.append(name)
            await until.wait()

    done = trio.Event()
    done.set()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, "holder", HEAVY, 0, release)
        await trio.testing.wait_all_tasks_blocked()
        for name, tenant, priority in [
            ("h-late", HEAVY, 5),
            ("h-soon", HEAVY, -10),
            ("l-late", LIGHT, 5),
            ("l-soon", LIGHT, -10),
        ]:
            nursery.start_soon(hold, name, tenant, priority, done)
            await trio.testing.wait_all_tasks_blocked()
        release.set()
    # Each tenant's sooner request first; the tenants alternate. light came back idle and was
    # lifted to heavy's counter, so it holds no credit: a tie, which goes by name.
    assert order == ["holder", "h-soon", "l-soon", "h-late", "l-late"]
    assert_settled(adm, HEAVY, LIGHT)


async def test_a_tenant_at_its_concurrency_limit_gets_429_and_others_still_pass() -> None:
    capped = Tenant("capped", max_concurrent_requests=2)
    adm = admission(limit=10)
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(_hold_until, adm, capped, release)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(Rejected) as refused:
            async with adm.slot(0, capped, 1):
                pass
        assert refused.value.reason == TENANT_CONCURRENCY
        assert refused.value.error.status == 429 and refused.value.error.retry_after == 1
        async with adm.slot(0, LIGHT, 1):
            assert adm.in_flight == 3
        release.set()
    async with adm.slot(0, capped, 1):  # its requests ended: room again
        pass
    assert_settled(adm, capped, LIGHT)


async def test_queued_requests_count_against_the_concurrency_limit() -> None:
    capped = Tenant("capped", max_concurrent_requests=2)
    adm = admission(limit=1)
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_hold_until, adm, LIGHT, release)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(2):
            nursery.start_soon(_hold_until, adm, capped, release)
        await trio.testing.wait_all_tasks_blocked()
        assert adm.tenants.queued("capped") == 2
        with pytest.raises(Rejected) as refused:
            async with adm.slot(0, capped, 1):
                pass
        assert refused.value.reason == TENANT_CONCURRENCY
        release.set()
    assert_settled(adm, capped, LIGHT)


async def test_a_tenant_over_its_token_pace_gets_429_with_the_seconds_to_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    paced = Tenant("paced", tokens_per_second=100)
    adm = admission(limit=10)
    # A second's worth passes at once, and one request more than a second's budget too.
    async with adm.slot(0, paced, 100):
        pass
    async with adm.slot(0, paced, 250):  # pace now 3.5 s ahead
        pass
    with pytest.raises(Rejected) as refused:
        async with adm.slot(0, paced, 1):
            pass
    assert refused.value.reason == TENANT_TOKENS
    assert refused.value.error.retry_after == 3
    async with adm.slot(0, LIGHT, 10_000):  # another tenant is not slowed
        pass
    await trio.sleep(2.5)
    async with adm.slot(0, paced, 1):
        pass
    assert adm.rejections[TENANT_TOKENS] == 1


async def test_a_request_not_served_gives_its_tokens_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    paced = Tenant("paced", tokens_per_second=100)
    adm = admission(limit=1, timeout=5.0)
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_hold_until, adm, LIGHT, release)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(3):  # each waits its 5 s and is refused: 408, its 90 tokens given back
            with pytest.raises(Rejected) as refused:
                async with adm.slot(0, paced, 90):
                    pass
            assert refused.value.reason == QUEUE_TIMEOUT
        release.set()
    # Had the 270 tokens been kept, the pace would still be over a second ahead.
    async with adm.slot(0, paced, 90):
        pass
    assert_settled(adm, paced, LIGHT)


async def test_a_full_queue_pushes_out_the_last_waiter_of_the_tenant_over_its_share() -> None:
    adm = admission(limit=1, queue=3)
    release = trio.Event()
    outcomes: dict[str, str] = {}

    async def ask(name: str, tenant: Tenant) -> None:
        try:
            async with adm.slot(0, tenant, 1):
                outcomes[name] = "admitted"
                await release.wait()
        except Rejected as exc:
            outcomes[name] = exc.reason

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, "holder", HEAVY)
        await trio.testing.wait_all_tasks_blocked()
        for i in range(3):
            nursery.start_soon(ask, f"h{i}", HEAVY)
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(ask, "l0", LIGHT)
        await trio.testing.wait_all_tasks_blocked()
        assert outcomes == {"holder": "admitted", "h2": TENANT_SHARE}
        assert adm.queued == 3 and adm.tenants.queued("heavy") == 2
        nursery.start_soon(ask, "l1", LIGHT)  # 2 heavy, 1 light: 2 light would not be fewer
        await trio.testing.wait_all_tasks_blocked()
        assert outcomes["l1"] == QUEUE_FULL
        release.set()
    assert outcomes == {
        "holder": "admitted",
        "h0": "admitted",
        "h1": "admitted",
        "h2": TENANT_SHARE,
        "l0": "admitted",
        "l1": QUEUE_FULL,
    }
    assert_settled(adm, HEAVY, LIGHT)


async def test_an_idle_tenant_cannot_bank_credit(autojump_clock: trio.testing.MockClock) -> None:
    adm = admission(limit=1)
    # light is served alone for a long time (its counter grows), heavy asks nothing meanwhile.
    for _ in range(50):
        async with adm.slot(0, LIGHT, 100):
            pass
    ledger = adm.tenants
    assert ledger.served("light") > 0 and ledger.served("heavy") == 0
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_hold_until, adm, LIGHT, release)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(_hold_until, adm, HEAVY, release)  # comes back: lifted
        await trio.testing.wait_all_tasks_blocked()
        assert ledger.served("heavy") >= ledger.served("light") - 100 * 1000
        release.set()


async def test_a_cancelled_waiter_leaves_its_tenants_numbers_exact() -> None:
    adm = admission(limit=1)
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_hold_until, adm, HEAVY, release)
        await trio.testing.wait_all_tasks_blocked()
        with trio.CancelScope() as leaving:
            async with trio.open_nursery() as inner:
                inner.start_soon(_hold_until, adm, LIGHT, release)
                await trio.testing.wait_all_tasks_blocked()
                assert adm.tenants.queued("light") == 1
                leaving.cancel()
        assert adm.tenants.queued("light") == 0 and adm.queued == 0
        release.set()
    assert_settled(adm, HEAVY, LIGHT)


async def _hold_until(adm: Admission, tenant: Tenant, release: trio.Event) -> None:
    async with adm.slot(0, tenant, 1):
        await release.wait()


def test_a_ledger_refuses_to_go_negative() -> None:
    ledger = TenantLedger(lambda: 0.0)
    ledger.change("a", in_flight=1)
    with pytest.raises(AssertionError):
        ledger.change("a", in_flight=-2)


async def test_what_a_request_used_corrects_its_tenants_counter_and_pace(
    autojump_clock: trio.testing.MockClock,
) -> None:
    paced = Tenant("paced", weight=2, tokens_per_second=100)
    adm = admission(limit=10)
    async with adm.slot(0, paced, 300):  # counted 300: the pace is 3 s ahead
        pass
    assert adm.tenants.served("paced") == 300 * 1000 // 2
    adm.settle(paced, 300, 60)  # it used 60
    assert adm.tenants.served("paced") == 60 * 1000 // 2
    async with adm.slot(0, paced, 1):  # 0.6 s ahead now: within the burst
        pass
    adm.settle(paced, 1, 400)  # used far more than counted: the pace moves on by it
    with pytest.raises(Rejected) as refused:
        async with adm.slot(0, paced, 1):
            pass
    assert refused.value.reason == TENANT_TOKENS
