"""One inference request's life: admission, attempts with retries, the final answer.

Structure (one request = one nursery; docs/design.md)::

    async with trio.open_nursery() as nursery:           # the request's cancel scope
        nursery.start_soon(watch_disconnect, ...)        # client gone -> cancel everything
        async with admission slot:                       # held for the whole response
            for each attempt:
                attempt = routing.lease_pd(key)          # chosen and charged, no checkpoint
                async with attempt.lease:                # releases what is left, on any exit
                    prefill leg                          # prefill released when its body is read
                    decode leg: the request's task reads # decode released at upstream EOF/error;
                      and sends each event; a reader     # a client that accepts nothing delays
                      of its own takes over reading      # that by at most 1.5 x takeover_after
                      if one send stalls (relay module)
                retry only if the lifecycle allows it (no byte sent) and the failure is retriable
            reclaim KV blocks no decode took             # once, by the KV owner's state
        nursery.cancel_scope.cancel()                    # stop the watcher *before* the final send
    send the final message

The request's state is its :class:`~.lifecycle.Lifecycle` (see that module's table); every step
goes through :class:`~.request.Request`. Cancelling the nursery (client disconnect) unwinds the
upstream response, whose close is synchronous in our transport: the engine sees its connection
close and aborts the request.

Retries: the prefill leg is retried on another endpoint after a connection error, a timeout, a
5xx or a 429; a decode failure is retried only before any byte reached the client, with the same
prefill's KV blocks when decode did not take them (a decode-only attempt), else with a fresh
prefill. Each attempt charges and releases its own endpoints. KV blocks no decode took are
reclaimed once, when the request is done with them (see :mod:`.lifecycle`).
"""

from __future__ import annotations

import contextlib
import logging
import random

import trio

from ..config import RouterConfig
from ..endpoints import Role
from ..http import (
    Downstream,
    Receive,
    Reply,
    Send,
    current_connection,
    errors,
    sse,
)
from ..observe import RequestRecord, Tracing
from ..routing import NoHealthyEndpoint, Routing
from . import bodies
from .admission import Admission, Rejected
from .legs import BufferedDecode, PrefillLeg, UpstreamCall
from .lifecycle import Event, KvEvent, KvOwner, Phase
from .outcomes import LegFailure
from .relay import DecodeRelay
from .request import Attempt, Inference, OutcomeSink, Request
from .stranded import KvReclaimer

log = logging.getLogger("trio_pdrouter.proxy")


class Proxy:
    """Serves inference requests from admission to the last byte (see the module doc).

    Every collaborator is given here: the admission cap, the routing (choose and charge), the
    circuit breakers that learn each leg's outcome, the three legs, the reclaimer of stranded
    KV, and the tracing (None: off). :attr:`in_flight` holds the requests being served.
    """

    def __init__(
        self,
        config: RouterConfig,
        *,
        routing: Routing,
        admission: Admission,
        outcomes: OutcomeSink,
        prefill: PrefillLeg,
        buffered: BufferedDecode,
        relay: DecodeRelay,
        reclaimer: KvReclaimer,
        tracing: Tracing | None,
        rng: random.Random | None = None,
    ) -> None:
        self._config = config
        self._routing = routing
        self._admission = admission
        self._outcomes = outcomes
        self._prefill = prefill
        self._buffered = buffered
        self._relay = relay
        self._reclaimer = reclaimer
        self._rng = rng or random.Random()
        #: ``--otlp-traces-endpoint``: the spans of each request (None: off).
        self.tracing = tracing
        #: The requests being served now.
        self.in_flight: set[Request] = set()

    async def handle(self, inf: Inference, receive: Receive, send: Send) -> RequestRecord:
        trace = None
        if self.tracing is not None:
            trace = self.tracing.request(inf.path, inf.headers)
            trace.note("trio_pdrouter.stream", inf.stream)
            trace.note("trio_pdrouter.prompt_tokens_estimated", inf.key.prompt_tokens)
            trace.note("trio_pdrouter.output_tokens_estimated", inf.key.output_tokens)
            if inf.key.tokens is not None:
                trace.note("trio_pdrouter.prompt_token_ids_known", len(inf.key.tokens))
        connection = current_connection()
        req = Request(
            inf,
            Downstream(send, connection),
            self._outcomes,
            connection,
            shows_endpoints=self._config.expose_routing_headers,
            trace=trace,
        )
        self.in_flight.add(req)
        try:
            await self._serve(req, receive)
        except Exception:
            # A bug, not an upstream failure (those are answered where they happen). Answer
            # in the shape the client expects; the leases were released on the way out.
            log.exception("request_id=%s unexpected error", inf.request_id)
            gone = req.life.client_gone
            req.crashed()
            if not gone:
                error = errors.internal("the router failed while serving this request")
                error = error.for_request(inf.request_id)
                started = req.down.started
                await req.down.finish(
                    Reply.tail(sse.error_event(error)) if started else Reply.error(error)
                )
        finally:
            self.in_flight.discard(req)
        record = req.record()
        if record.rejection is None and record.prompt_tokens is not None:
            # The answer said what the request really used: its tenant is charged that.
            used = record.prompt_tokens + (record.completion_tokens or 0)
            self._admission.settle(req.inf.tenant, req.inf.cost, used)
        if trace is not None:
            req.end_trace(record)
        return record

    async def _serve(self, req: Request, receive: Receive) -> None:
        reply: Reply | None = None
        async with trio.open_nursery() as nursery:
            req.scope = nursery.cancel_scope
            nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope, req)
            # Admission waits inside the request's scope: a client that leaves while queued
            # gives its place up at once.
            try:
                inf = req.inf
                async with self._admission.slot(inf.priority, inf.tenant, inf.cost):
                    req.admitted()
                    if req.trace is not None:
                        req.trace.note("trio_pdrouter.queue_wait_ms", req.queue_ms or 0.0)
                    reply = await self._attempts(req)
            except Rejected as exc:
                req.rejected(exc.reason)
                reply = Reply.error(exc.error)
            nursery.cancel_scope.cancel()
        if req.life.client_gone:
            return
        if req.life.phase is Phase.SHUT_DOWN:
            reply = req.shutdown_reply()
        assert reply is not None
        await req.down.finish(reply)

    async def _attempts(self, req: Request) -> Reply:
        """Run attempts until one answers, the failure is final, or attempts run out."""
        try:
            return await self._try(req)
        finally:
            # However the request ends (answered, failed, client gone, cancelled while
            # waiting to retry), KV blocks no decode took are reclaimed now, exactly once.
            self._settle_kv(req)

    async def _try(self, req: Request) -> Reply:
        attempts = self._config.retry.max_retries
        avoid_urls: list[str] = []
        for number in range(1, attempts + 1):
            try:
                attempt = self._choose(req, number, avoid_urls)
            except NoHealthyEndpoint as exc:
                req.unroutable()
                if req.life.phase is Phase.FAILED and req.failure is not None:
                    # The breakers closed the last door after a failure: answer that failure.
                    return _with_routing_headers(
                        req, req.failure.reply(streaming=False, request_id=req.inf.request_id)
                    )
                return Reply.error(errors.no_healthy_endpoint(exc.role.value))
            async with attempt.lease:
                # First inside the block: nothing between the charge and the lease's guard.
                req.routed(attempt)
                result = await self._attempt(req, attempt)
            if isinstance(result, Reply):
                req.answered()
                return _with_routing_headers(req, result)
            attempt.unlearn_refused(result)
            if result.retriable and number < attempts and req.life.allows(Event.RETRY):
                req.retrying()  # a prefill's KV blocks still held are reused by the next attempt
                avoid_urls.append(result.endpoint.url)
                await trio.sleep(self._backoff(number))
                continue
            return _with_routing_headers(req, req.fail(result))
        raise AssertionError("unreachable: the last attempt answers or fails")

    def shut_down(self) -> int:
        """The shutdown deadline: end every request whose answer is not decided yet (a stream
        with an error event and ``[DONE]``, anything else with a 503); never awaits. Returns
        how many were ended."""
        return sum(req.shut_down() for req in list(self.in_flight))

    def _choose(self, req: Request, number: int, avoid_urls: list[str]) -> Attempt:
        """Choose and charge the attempt's endpoints (synchronously: no checkpoint).

        After a decode failure that left the prefill's KV blocks held, only a decode endpoint
        is chosen: the attempt sends it the same ``kv_transfer_params`` — while the prefill
        engine can be counted on to hold them (``--prefill-kv-hold-secs``); later they are left
        to the engine and the attempt runs a fresh prefill.
        """
        key = req.inf.key
        rid = req.inf.request_id
        routing = self._routing
        if not self._config.pd:
            lease, decode = routing.lease_one(Role.REGULAR, key, avoid_urls)
            kv = routing.kv_note(Role.REGULAR)
            lessons = routing.lessons(Role.REGULAR)
            return Attempt(number, None, decode, lease, rid, kv_note=kv, lessons=lessons)
        if not req.inf.route.split:  # nothing to generate, nothing to split: one decode server
            lease, decode = routing.lease_one(Role.DECODE, key, avoid_urls)
            return Attempt(number, None, decode, lease, rid, lessons=routing.lessons(Role.DECODE))
        last = req.attempt
        hold = self._config.timeouts.prefill_kv_hold
        if req.life.kv is KvOwner.PREFILL and not req.kv_held_within(hold):
            req.kv_settled(KvEvent.ABANDON)  # the engine has let them go: a fresh prefill
        if last is not None and last.prefill is not None and req.life.kv is KvOwner.PREFILL:
            lease, decode = routing.lease_one(Role.DECODE, key, avoid_urls)
            return Attempt(
                number,
                last.prefill,
                decode,
                lease,
                last.request_id,
                reuses_kv=True,
                lessons=routing.lessons(Role.DECODE),
            )
        lease, prefill, decode = routing.lease_pd(key, avoid_urls)
        kv = routing.kv_note(Role.PREFILL)
        lessons = routing.lessons(Role.PREFILL, Role.DECODE)
        if self._config.kv_connector == "p2p_nccl":
            rid = bodies.p2p_nccl_request_id(prefill, decode)
        return Attempt(number, prefill, decode, lease, rid, kv_note=kv, lessons=lessons)

    async def _attempt(self, req: Request, attempt: Attempt) -> Reply | LegFailure:
        inf = req.inf
        body = inf.body
        if attempt.runs_prefill:
            answer = await self._prefill.run(req, attempt)
            if isinstance(answer, LegFailure):
                return answer
            # The client may have left while the prefill's answer was read: no decode then.
            await trio.lowlevel.checkpoint_if_cancelled()
        if attempt.prefill is not None:
            body = bodies.decode_body(inf.body, req.kv_params)
        api_key = self._config.upstream_api_key
        call = UpstreamCall.build(req, attempt, attempt.decode, body, api_key, attempt.stage)
        if inf.stream:
            return await self._relay.run(req, attempt, call)
        return await self._buffered.run(req, attempt, call, req.prefill_answer)

    def _settle_kv(self, req: Request) -> None:
        """The request is done with a prefill's KV blocks no decode took: reclaim them on a
        decode endpoint that can take a request (never awaits)."""
        attempt = req.attempt
        if req.life.kv is not KvOwner.PREFILL or attempt is None:
            return
        target = attempt.decode
        failure = req.failure
        if (
            failure is not None
            and failure.endpoint == target
            and not failure.kind.startswith("status_4")
        ):
            # That decode broke: ask another (the blocks do not care who pulls them).
            with contextlib.suppress(NoHealthyEndpoint):
                target = self._routing.choose(Role.DECODE, req.inf.key, (target.url,))
        hold = self._config.timeouts.prefill_kv_hold
        if self._config.release_stranded_kv and req.kv_held_within(hold):
            req.kv_settled(KvEvent.RECLAIM)
            self._reclaimer.reclaim(req, attempt, target)
        else:
            req.kv_settled(KvEvent.ABANDON)

    def _backoff(self, attempt: int) -> float:
        r = self._config.retry
        base = min(r.initial_backoff_ms * r.backoff_multiplier ** (attempt - 1), r.max_backoff_ms)
        jitter = 1.0 + r.jitter_factor * self._rng.uniform(-1.0, 1.0)
        return max(0.0, base * jitter) / 1000


async def _watch_disconnect(receive: Receive, scope: trio.CancelScope, req: Request) -> None:
    # hypercorn never cancels the app when the client leaves; it only queues http.disconnect.
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            req.client_left()
            if req.on_leave is not None:
                req.on_leave()  # the prefill leg ends the request once its answer is settled
            else:
                scope.cancel()
            return


def _with_routing_headers(req: Request, reply: Reply) -> Reply:
    """A whole response carries the routing headers of the attempt that produced it."""
    if req.down.started or req.attempt is None:
        return reply
    return Reply(reply.status, [*reply.headers, *req.routing_headers()], reply.body)
