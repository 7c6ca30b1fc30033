"""Admission control: at most ``--max-concurrent-requests`` responses at once, a queue behind.

A request takes a slot before anything is chosen or charged and holds it until its response is
finished, streams included::

    try:
        async with admission.slot():
            ...serve the request...
    except Rejected as exc:
        ...answer exc.error (429 queue full, 408 queue timeout)...

With ``--rate-limit-tokens-per-second``, a request first takes a token from a
:class:`~.rate_limit.TokenBucket`; without one it is refused at once with 429 and
``Retry-After``.

When every slot is taken, a request waits in a queue of ``--queue-size`` places for at most
``--queue-timeout-secs``. A full queue (or ``queue_size`` 0) refuses at once with 429; a wait
that times out is refused with 408.

The queue is ordered by the request's ``priority`` (vLLM's field: lower is sooner, 0 by
default), then by arrival; waiting ages a request: every ``--priority-aging-secs`` it has waited
counts as one level sooner, so nothing waits forever behind a stream of sooner requests. Its
place is fixed when it arrives — ``priority + arrival / aging`` — since every waiter ages at the
same rate; with aging 0 the order is by priority alone. All at priority 0: FIFO.

The head is strict: a finished request hands its slot straight to the head of the queue, so the
number of slots in use never dips while someone waits and a newcomer can never overtake a
waiter of the same or a sooner place. A waiter whose client leaves simply leaves the queue; one
that was handed a slot in the same instant it was cancelled passes the slot on to the next
waiter. Releasing a slot never awaits, so no cancellation can skip it, and it happens exactly
once per admitted request.

**Tenants.** Every request is some tenant's (:mod:`trio_pdrouter.tenants`; without a tenants
file, all are the default tenant's and the above is the whole story). Each tenant waits in its own
line, ordered as above; between tenants, a slot that frees goes to the waiting tenant with the
smallest virtual counter — the tokens admitted for it divided by its weight — so capacity is
shared by weight in tokens, not in requests: priority orders a tenant's own requests, fairness
chooses between tenants. A request's tokens are its prompt's estimate plus its output cap
(:mod:`trio_pdrouter.ledger.cost`), counted when it is admitted, and corrected to what it used
when its answer reports ``usage`` (:meth:`Admission.settle`). Before it may wait, a request
passes its tenant's limits, each refused at once with 429 and ``Retry-After``:
``max_concurrent_requests`` counts the tenant's requests in flight and queued (so those that
wait always fit when admitted), ``tokens_per_second`` its token pace. When the queue is full, a
newcomer pushes out the last waiter of the tenant holding the most places per weight, if that
tenant holds more than the newcomer's would with it; that waiter gets 429 (over its tenant's
share), else the newcomer does (queue full). No tenant ever takes a slot another was handed.
The tenants' numbers live in a :class:`~trio_pdrouter.tenants.TenantLedger` (machine-wide with
``--workers N``), read and changed under its lock, released with the slot and never awaited.
"""

from __future__ import annotations

import heapq
import itertools
from types import TracebackType

import trio

from ..config import AdmissionSettings
from ..http import RouterError, errors
from ..tenants import DEFAULT_TENANT, Tenant, TenantLedger, share
from .rate_limit import TokenBucket

QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
RATE_LIMITED = "rate_limited"
#: A tenant's limits: its requests in flight and queued, its tokens per second.
TENANT_CONCURRENCY = "tenant_concurrency"
TENANT_TOKENS = "tenant_tokens"
#: Pushed out of a full queue: its tenant held more than its share of the places.
TENANT_SHARE = "tenant_share"
REASONS = (QUEUE_FULL, QUEUE_TIMEOUT, RATE_LIMITED, TENANT_CONCURRENCY, TENANT_TOKENS, TENANT_SHARE)


class Rejected(Exception):
    """The request was refused admission; answer ``error`` to the client.

    ``reason`` is one of :data:`REASONS`.
    """

    def __init__(self, error: RouterError, reason: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.reason = reason


class _Waiter:
    __slots__ = ("cost", "granted", "left", "refusal", "tenant", "woken")

    def __init__(self, tenant: Tenant, cost: int) -> None:
        self.woken = trio.Event()
        self.tenant = tenant
        self.cost = cost
        #: Set with ``woken`` by the request that handed this waiter its slot.
        self.granted = False
        #: It left the queue (cancelled, timed out, pushed out); dropped when it surfaces.
        self.left = False
        #: Set with ``woken`` when it was pushed out of a full queue: its answer.
        self.refusal: RouterError | None = None


class _Line:
    """One tenant's waiters in this process: a heap of (place, arrival number, waiter)."""

    __slots__ = ("heap", "waiting", "weight")

    def __init__(self, weight: float) -> None:
        self.heap: list[tuple[float, int, _Waiter]] = []
        #: Waiters still in line (the heap also holds those that left, until they surface).
        self.waiting = 0
        self.weight = weight


class Admission:
    """The concurrency cap and its queue (see the module doc); ``bucket`` limits the rate of
    arrivals (None: no rate limit); ``tenants`` holds every tenant's numbers."""

    def __init__(
        self,
        settings: AdmissionSettings,
        bucket: TokenBucket | None = None,
        tenants: TenantLedger | None = None,
    ) -> None:
        self._settings = settings
        self._bucket = bucket
        self.tenants = tenants if tenants is not None else TenantLedger()
        self._in_flight = 0
        self._lines: dict[str, _Line] = {}
        self._arrivals = itertools.count()
        self._waiting = 0
        self.rejections: dict[str, int] = dict.fromkeys(REASONS, 0)

    @property
    def in_flight(self) -> int:
        """Slots in use, including slots handed to waiters that have not resumed yet."""
        return self._in_flight

    @property
    def queued(self) -> int:
        return self._waiting

    def queued_of(self, tenant: str) -> int:
        """Waiters of ``tenant`` in this process."""
        line = self._lines.get(tenant)
        return 0 if line is None else line.waiting

    def slot(self, priority: int = 0, tenant: Tenant = DEFAULT_TENANT, cost: int = 0) -> Slot:
        """An async context manager holding one slot for its block; raises :class:`Rejected`.
        ``priority``: the request's place in its tenant's line (lower is sooner); ``cost``: its
        tokens (see the module doc)."""
        return Slot(self, priority, tenant, cost)

    def _place(self, priority: int) -> float:
        aging = self._settings.priority_aging_secs
        return priority + trio.current_time() / aging if aging > 0 else float(priority)

    def _refuse(self, reason: str, error: RouterError) -> Rejected:
        self.rejections[reason] += 1
        return Rejected(error, reason)

    async def _acquire(self, priority: int, tenant: Tenant, cost: int) -> None:
        s = self._settings
        if self._bucket is not None:
            wait = self._bucket.take(trio.current_time())
            if wait is not None:
                rate = s.rate_limit_tokens_per_second
                message = f"the router admits at most {rate} requests per second"
                raise self._refuse(RATE_LIMITED, errors.too_many_requests(message, wait))
        name, ledger = tenant.name, self.tenants
        with ledger.locked():
            limit = tenant.max_concurrent_requests
            if limit is not None and ledger.in_flight(name) + ledger.queued(name) >= limit:
                message = f"tenant {name!r} has its limit of {limit} requests in flight or queued"
                raise self._refuse(TENANT_CONCURRENCY, errors.too_many_requests(message))
            rate = tenant.tokens_per_second
            if rate is not None:
                wait = ledger.pace(name, cost, rate)
                if wait is not None:
                    message = f"tenant {name!r} has used its {rate} tokens per second"
                    raise self._refuse(TENANT_TOKENS, errors.too_many_requests(message, wait))
            ledger.lift(name)
            if self._in_flight < s.max_concurrent_requests and not self._waiting:
                self._in_flight += 1
                ledger.change(name, in_flight=1, served=share(cost, tenant.weight))
                return
            if self._waiting >= s.queue_size:
                victim = self._victim(tenant)
                if victim is None:
                    self._give_back(tenant, cost)
                    limit = s.max_concurrent_requests
                    queue = (
                        f"its queue of {s.queue_size} is full" if s.queue_size else "it queues none"
                    )
                    message = f"the router is serving its limit of {limit} requests and {queue}"
                    raise self._refuse(QUEUE_FULL, errors.too_many_requests(message))
                self._push_out(victim)
            waiter = _Waiter(tenant, cost)
            line = self._lines.get(name)
            if line is None:
                line = self._lines[name] = _Line(tenant.weight)
            line.weight = tenant.weight
            heapq.heappush(line.heap, (self._place(priority), next(self._arrivals), waiter))
            line.waiting += 1
            self._waiting += 1
            ledger.change(name, queued=1)
        try:
            with trio.move_on_after(s.queue_timeout_secs):
                await waiter.woken.wait()
        except BaseException:
            # Cancelled from outside (the client left). A slot handed over in the same instant
            # is ours to pass on; otherwise just leave the queue (if not pushed out already).
            if waiter.granted:
                self._release(name)
            elif waiter.refusal is None:
                self._leave(waiter)
            raise
        if waiter.refusal is not None:  # pushed out: counted and given back by the pusher
            raise Rejected(waiter.refusal, TENANT_SHARE)
        # A slot handed over in the same instant as the deadline is kept: the wait is over.
        if not waiter.granted:
            self._leave(waiter)
            raise self._refuse(QUEUE_TIMEOUT, errors.queue_timeout(s.queue_timeout_secs))

    def settle(self, tenant: Tenant, counted: int, used: int) -> None:
        """A request admitted with ``counted`` tokens used ``used`` (its answer's ``usage``):
        its tenant's virtual counter and pace are corrected by the difference. Never awaits."""
        if used == counted:
            return
        name = tenant.name
        with self.tenants.locked():
            self.tenants.change(
                name, served=share(used, tenant.weight) - share(counted, tenant.weight)
            )
            if tenant.tokens_per_second is not None:
                self.tenants.refund(name, counted - used, tenant.tokens_per_second)

    def _give_back(self, tenant: Tenant, cost: int) -> None:
        """What the tenant's pace took for a request that will not be served."""
        if tenant.tokens_per_second is not None:
            self.tenants.refund(tenant.name, cost, tenant.tokens_per_second)

    def _victim(self, tenant: Tenant) -> str | None:
        """The tenant whose last waiter a newcomer of ``tenant`` pushes out of a full queue:
        the one with the most places per weight, if more than ``tenant`` would hold with the
        newcomer; None if there is none (the newcomer is refused)."""
        own = self._lines.get(tenant.name)
        mine = ((own.waiting if own else 0) + 1) / tenant.weight
        most, victim = mine, None
        for name, line in self._lines.items():
            if name != tenant.name and line.waiting and line.waiting / line.weight > most:
                most, victim = line.waiting / line.weight, name
        return victim

    def _push_out(self, name: str) -> None:
        line = self._lines[name]
        _, _, waiter = max((e for e in line.heap if not e[2].left), key=lambda e: (e[0], e[1]))
        self._leave(waiter)
        waiter.refusal = errors.too_many_requests(
            f"the router's queue is full and tenant {name!r} holds more than its share of it"
        )
        self.rejections[TENANT_SHARE] += 1
        waiter.woken.set()

    def _leave(self, waiter: _Waiter) -> None:
        waiter.left = True
        self._lines[waiter.tenant.name].waiting -= 1
        self._waiting -= 1
        with self.tenants.locked():
            self.tenants.change(waiter.tenant.name, queued=-1)
            self._give_back(waiter.tenant, waiter.cost)

    def _release(self, tenant: str) -> None:
        """Hand the slot to the head of the next tenant's line, or free it. Never awaits."""
        ledger = self.tenants
        with ledger.locked():
            ledger.change(tenant, in_flight=-1)
            line = self._next_line()
            while line is not None:
                entry = heapq.heappop(line.heap)
                waiter = entry[2]
                if waiter.left:
                    continue
                line.waiting -= 1
                self._waiting -= 1
                t = waiter.tenant
                ledger.change(t.name, queued=-1, in_flight=1, served=share(waiter.cost, t.weight))
                waiter.granted = True
                waiter.woken.set()
                return
            self._in_flight -= 1

    def _next_line(self) -> _Line | None:
        """The line of the waiting tenant with the smallest virtual counter (ties: by name)."""
        ledger = self.tenants
        best: tuple[int, str] | None = None
        for name, line in self._lines.items():
            if line.waiting:
                key = (ledger.served(name), name)
                if best is None or key < best:
                    best = key
        return None if best is None else self._lines[best[1]]


class Slot:
    """One admitted request's slot: taken on entry, released exactly once on exit."""

    __slots__ = ("_admission", "_cost", "_held", "_priority", "_tenant")

    def __init__(self, admission: Admission, priority: int, tenant: Tenant, cost: int) -> None:
        self._admission = admission
        self._priority = priority
        self._tenant = tenant
        self._cost = cost
        self._held = False

    async def __aenter__(self) -> Slot:
        await self._admission._acquire(self._priority, self._tenant, self._cost)
        self._held = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # No await: a cancelled scope cannot interrupt the release.
        if self._held:
            self._held = False
            self._admission._release(self._tenant.name)
