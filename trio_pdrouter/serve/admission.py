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
"""

from __future__ import annotations

import heapq
import itertools
from types import TracebackType

import trio

from ..config import AdmissionSettings
from ..http import RouterError, errors
from .rate_limit import TokenBucket

QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
RATE_LIMITED = "rate_limited"


class Rejected(Exception):
    """The request was refused admission; answer ``error`` to the client.

    ``reason`` is :data:`QUEUE_FULL`, :data:`QUEUE_TIMEOUT` or :data:`RATE_LIMITED`.
    """

    def __init__(self, error: RouterError, reason: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.reason = reason


class _Waiter:
    __slots__ = ("granted", "left", "woken")

    def __init__(self) -> None:
        self.woken = trio.Event()
        #: Set with ``woken`` by the request that handed this waiter its slot.
        self.granted = False
        #: It left the queue (cancelled or timed out); the heap drops it when it surfaces.
        self.left = False


class Admission:
    """The concurrency cap and its queue (see the module doc); ``bucket`` limits the rate of
    arrivals (None: no rate limit)."""

    def __init__(self, settings: AdmissionSettings, bucket: TokenBucket | None = None) -> None:
        self._settings = settings
        self._bucket = bucket
        self._in_flight = 0
        # (place, arrival number, waiter): the smallest is the head. A waiter that leaves is
        # marked and dropped when it reaches the head; ``_waiting`` counts those still in line.
        self._queue: list[tuple[float, int, _Waiter]] = []
        self._arrivals = itertools.count()
        self._waiting = 0
        self.rejections: dict[str, int] = {QUEUE_FULL: 0, QUEUE_TIMEOUT: 0, RATE_LIMITED: 0}

    @property
    def in_flight(self) -> int:
        """Slots in use, including slots handed to waiters that have not resumed yet."""
        return self._in_flight

    @property
    def queued(self) -> int:
        return self._waiting

    def slot(self, priority: int = 0) -> Slot:
        """An async context manager holding one slot for its block; raises :class:`Rejected`.
        ``priority``: the request's place in the queue (lower is sooner; see the module doc)."""
        return Slot(self, priority)

    def _place(self, priority: int) -> float:
        aging = self._settings.priority_aging_secs
        return priority + trio.current_time() / aging if aging > 0 else float(priority)

    async def _acquire(self, priority: int) -> None:
        s = self._settings
        if self._bucket is not None:
            wait = self._bucket.take(trio.current_time())
            if wait is not None:
                self.rejections[RATE_LIMITED] += 1
                rate = s.rate_limit_tokens_per_second
                message = f"the router admits at most {rate} requests per second"
                raise Rejected(errors.too_many_requests(message, retry_after=wait), RATE_LIMITED)
        if self._in_flight < s.max_concurrent_requests and not self._waiting:
            self._in_flight += 1
            return
        if self._waiting >= s.queue_size:
            self.rejections[QUEUE_FULL] += 1
            limit = s.max_concurrent_requests
            queue = f"its queue of {s.queue_size} is full" if s.queue_size else "it queues none"
            raise Rejected(
                errors.too_many_requests(
                    f"the router is serving its limit of {limit} requests and {queue}"
                ),
                QUEUE_FULL,
            )
        waiter = _Waiter()
        heapq.heappush(self._queue, (self._place(priority), next(self._arrivals), waiter))
        self._waiting += 1
        try:
            with trio.move_on_after(s.queue_timeout_secs):
                await waiter.woken.wait()
        except BaseException:
            # Cancelled from outside (the client left). A slot handed over in the same instant
            # is ours to pass on; otherwise just leave the queue.
            if waiter.granted:
                self._release()
            else:
                self._leave(waiter)
            raise
        # A slot handed over in the same instant as the deadline is kept: the wait is over.
        if not waiter.granted:
            self._leave(waiter)
            self.rejections[QUEUE_TIMEOUT] += 1
            raise Rejected(errors.queue_timeout(s.queue_timeout_secs), QUEUE_TIMEOUT)

    def _leave(self, waiter: _Waiter) -> None:
        waiter.left = True
        self._waiting -= 1

    def _release(self) -> None:
        """Hand the slot to the head of the queue, or free it. Never awaits."""
        queue = self._queue
        while queue:
            waiter = heapq.heappop(queue)[2]
            if not waiter.left:
                self._waiting -= 1
                waiter.granted = True
                waiter.woken.set()
                return
        self._in_flight -= 1


class Slot:
    """One admitted request's slot: taken on entry, released exactly once on exit."""

    __slots__ = ("_admission", "_held", "_priority")

    def __init__(self, admission: Admission, priority: int) -> None:
        self._admission = admission
        self._priority = priority
        self._held = False

    async def __aenter__(self) -> Slot:
        await self._admission._acquire(self._priority)
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
            self._admission._release()
