"""Admission control: at most ``--max-concurrent-requests`` responses at once, a FIFO queue behind.

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

When every slot is taken, a request waits in a FIFO queue of ``--queue-size`` places for at
most ``--queue-timeout-secs``. A full queue (or ``queue_size`` 0) refuses at once with 429; a
wait that times out is refused with 408.

FIFO is strict: a finished request hands its slot straight to the head of the queue, so the
number of slots in use never dips while someone waits and a newcomer can never overtake a
waiter. A waiter whose client leaves simply leaves the queue; one that was handed a slot in the
same instant it was cancelled passes the slot on to the next waiter. Releasing a slot never
awaits, so no cancellation can skip it, and it happens exactly once per admitted request.
"""

from __future__ import annotations

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
    __slots__ = ("granted", "woken")

    def __init__(self) -> None:
        self.woken = trio.Event()
        #: Set with ``woken`` by the request that handed this waiter its slot.
        self.granted = False


class Admission:
    """The concurrency cap and its queue (see the module doc); ``bucket`` limits the rate of
    arrivals (None: no rate limit)."""

    def __init__(self, settings: AdmissionSettings, bucket: TokenBucket | None = None) -> None:
        self._settings = settings
        self._bucket = bucket
        self._in_flight = 0
        # Insertion-ordered: the first key is the head of the queue; removal by key is O(1).
        self._queue: dict[_Waiter, None] = {}
        self.rejections: dict[str, int] = {QUEUE_FULL: 0, QUEUE_TIMEOUT: 0, RATE_LIMITED: 0}

    @property
    def in_flight(self) -> int:
        """Slots in use, including slots handed to waiters that have not resumed yet."""
        return self._in_flight

    @property
    def queued(self) -> int:
        return len(self._queue)

    def slot(self) -> Slot:
        """An async context manager holding one slot for its block; raises :class:`Rejected`."""
        return Slot(self)

    async def _acquire(self) -> None:
        s = self._settings
        if self._bucket is not None:
            wait = self._bucket.take(trio.current_time())
            if wait is not None:
                self.rejections[RATE_LIMITED] += 1
                rate = s.rate_limit_tokens_per_second
                message = f"the router admits at most {rate} requests per second"
                raise Rejected(errors.too_many_requests(message, retry_after=wait), RATE_LIMITED)
        if self._in_flight < s.max_concurrent_requests and not self._queue:
            self._in_flight += 1
            return
        if len(self._queue) >= s.queue_size:
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
        self._queue[waiter] = None
        try:
            with trio.move_on_after(s.queue_timeout_secs):
                await waiter.woken.wait()
        except BaseException:
            # Cancelled from outside (the client left). A slot handed over in the same instant
            # is ours to pass on; otherwise just leave the queue.
            if waiter.granted:
                self._release()
            else:
                del self._queue[waiter]
            raise
        # A slot handed over in the same instant as the deadline is kept: the wait is over.
        if not waiter.granted:
            del self._queue[waiter]
            self.rejections[QUEUE_TIMEOUT] += 1
            raise Rejected(errors.queue_timeout(s.queue_timeout_secs), QUEUE_TIMEOUT)

    def _release(self) -> None:
        """Hand the slot to the head of the queue, or free it. Never awaits."""
        if self._queue:
            waiter = next(iter(self._queue))
            del self._queue[waiter]
            waiter.granted = True
            waiter.woken.set()
        else:
            self._in_flight -= 1


class Slot:
    """One admitted request's slot: taken on entry, released exactly once on exit."""

    __slots__ = ("_admission", "_held")

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._held = False

    async def __aenter__(self) -> Slot:
        await self._admission._acquire()
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
