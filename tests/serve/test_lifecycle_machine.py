"""Model-based tests of the request lifecycle: no ordering of events leaks or double-releases load.

A Hypothesis state machine drives the real ASGI app (``build_app``) over a scripted in-memory
upstream. Rules make things happen — a client request arrives; prefill answers ok, 4xx, 5xx,
resets, stalls mid-body; decode sends its head, chunks, EOF, fails mid-stream; the client leaves at
any point or stops reading; time jumps past timeouts; the server shuts down — and after every rule
the app is run until every task is blocked, then the invariants are checked.

The model is what an engine could observe (docs/design.md, "The load ledger"):

* a prefill endpoint is held by each *open prefill call* (the router sent the request and has
  neither read the answer to its end nor closed it);
* a decode endpoint is held by each open decode call, plus one per open prefill call (decode is
  charged at choice, before prefill starts). With one decode endpoint that is an exact count per
  endpoint; with several (the retry machine) the decode endpoint of a request still in prefill
  is not observable, so the check is exact for the decode total and a lower bound per endpoint.

Why a helper thread: Hypothesis has no async state machines. One ``trio.run`` per
machine lives in a helper thread for the whole example; each rule is a synchronous call into it
(``trio.from_thread.run``) that performs the rule's action and then waits until every task of the
app is blocked, so the invariants always see a quiescent router. The run uses a ``MockClock``
that never moves by itself (rate 0, no autojump): time passes only in the ``time_passes`` rule,
so timeouts fire exactly when a rule says so. Under Hypothesis trio schedules deterministically
(trio registers its scheduler's random generator with Hypothesis), so failures replay and shrink.

Profiles (``tests/conftest.py``): ``ci`` by default; ``pytest --hypothesis-profile=long
tests/serve/test_lifecycle_machine.py`` for a soak with many more and longer runs.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar, TypeVar

import attrs
import httpx
import orjson
import trio
import trio.testing
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tests.harness import KV, Exchange, ScriptedBody, ScriptedUpstream, call
from trio_pdrouter.app import RouterApp
from trio_pdrouter.assemble import build_app
from trio_pdrouter.config import RetrySettings, RouterConfig, Timeouts
from trio_pdrouter.http import DONE, LegClient, client_timeout
from trio_pdrouter.http import connection as client_connection
from trio_pdrouter.serve import KvOwner, Phase, StallWatch, successors

T = TypeVar("T")

#: The router's upstream time limit in the machines, in MockClock seconds.
TIMEOUT = 10.0
#: Clients in flight at once; more adds run time, not orderings.
MAX_LIVE = 3

_PROMPT_LOGPROBS = {
    "tokens": ["a", "b", "x"],
    "token_logprobs": [None, -1.0, -0.5],
    "top_logprobs": [None, {"b": -1.0}, {"x": -0.5}],
    "text_offset": [0, 1, 2],
}
_USAGE = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}


def _answer(kv: Any, text: str, logprobs: dict[str, Any]) -> bytes:
    return orjson.dumps(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": "length",
                    "prompt_logprobs": [None, {"1": {"logprob": -1.0}}],
                }
            ],
            "usage": {**_USAGE, "prompt_tokens_details": {"cached_tokens": 0}},
            **({"kv_transfer_params": kv} if kv is not False else {}),
        }
    )


PREFILL_ANSWER = _answer(KV, "x", _PROMPT_LOGPROBS)
#: The one prefill token was a stop token: no KV to pull, decode recomputes.
PREFILL_ANSWER_NO_KV = _answer(None, "x", _PROMPT_LOGPROBS)
DECODE_ANSWER = _answer(
    False,
    "a b c",
    {
        "tokens": ["a", "b", "c"],
        "token_logprobs": [-0.1, -0.2, -0.3],
        "top_logprobs": [{"a": -0.1}, {"b": -0.2}, {"c": -0.3}],
        "text_offset": [0, 1, 2],
    },
)
EVENT = b'data: {"choices":[{"index":0,"text":"hi"}]}\n\n'
ERROR_400 = orjson.dumps({"error": {"message": "bad", "type": "BadRequestError", "code": 400}})
ERROR_503 = orjson.dumps({"error": {"message": "busy", "code": 503}})


# -- the persistent trio loop --------------------------------------------------------------------


class TrioLoopThread:
    """One ``trio.run`` in a helper thread; :meth:`run` calls into it from synchronous code."""

    def __init__(self, clock: trio.abc.Clock) -> None:
        self._clock = clock
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._stop: trio.Event | None = None
        self._failure: BaseException | None = None
        #: Tasks that outlive the call that started them run here.
        self.nursery: trio.Nursery
        self._thread = threading.Thread(target=self._main, name="trio-machine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure

    def _main(self) -> None:
        try:
            trio.run(self._serve, clock=self._clock)
        except BaseException as exc:  # reported by close(): the rule thread owns the failure
            self._failure = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def run(self, afn: Callable[[], Awaitable[T]]) -> T:
        """Run ``afn()`` in the loop and return its result (or raise its exception)."""
        return trio.from_thread.run(afn, trio_token=self._token)

    def close(self) -> None:
        if self._thread.is_alive():
            assert self._stop is not None
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            self._thread.join()
        if self._failure is not None:
            raise self._failure


# -- the scripted upstream ------------------------------------------------------------------------


class UpstreamBody(ScriptedBody):
    """A scripted response body that applies the request's read timeout to every read, as the
    router's h11 transport does, and can run a hook when its reader reaches EOF."""

    def __init__(self, read_timeout: float | None) -> None:
        super().__init__()
        self._read_timeout = read_timeout
        self.on_eof: Callable[[], None] | None = None
        self.ended = False  # no more pushes: EOF or failure was scripted

    async def __aiter__(self) -> AsyncIterator[bytes]:
        chunks = super().__aiter__()
        while True:
            try:
                with trio.fail_after(_limit(self._read_timeout)):
                    chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except trio.TooSlowError:
                raise httpx.ReadTimeout("scripted read timeout") from None
            yield chunk
        if self.on_eof is not None:
            self.on_eof()


def _limit(timeout: float | None) -> float:
    return float("inf") if timeout is None else timeout


@attrs.define(eq=False)
class UpstreamCall:
    """One request the router sent to an engine, and what the script made of it."""

    number: int
    stage: str  # "prefill", "decode" or "worker"
    endpoint: str
    request_id: str
    stream: bool
    #: A one-token decode that reclaims a prefill's KV blocks no decode took (the requests
    #: of the machine ask for more tokens).
    stranded: bool
    decided: trio.Event = attrs.Factory(trio.Event)
    decision: str | None = None
    body: UpstreamBody | None = None
    #: The handler ended without a response: reset, cancelled, or timed out.
    handler_done: bool = False
    #: Bytes of the answer pushed so far (a non-streaming answer goes out in slices).
    sent: int = 0

    @property
    def open(self) -> bool:
        """The engine still serves it: no answer read to its end, nothing closed."""
        if self.body is None:
            return not self.handler_done
        return not (self.body.closed or self.body.read_to_end)

    @property
    def awaiting_head(self) -> bool:
        return self.decision is None and not self.handler_done

    @property
    def streaming(self) -> bool:
        """A 200 whose body the script is still feeding."""
        return self.body is not None and not self.body.ended and not self.body.closed


@attrs.define(eq=False)
class ClientRequest:
    request_id: str
    stream: bool
    logprobs: bool
    exchange: Exchange = attrs.Factory(Exchange)
    calls: list[UpstreamCall] = attrs.Factory(list)
    ended: bool = False
    #: Ended by the server shutting down (cancelled), not by the app returning.
    by_shutdown: bool = False
    crashed: BaseException | None = None
    #: Cut off by the router's stall watch (it accepted nothing for STALL seconds).
    was_cut: bool = False

    @property
    def live(self) -> bool:
        return not self.ended

    def cut(self) -> None:
        """What cutting the connection does to the client (trio_pdrouter.http.Connection.cut)."""
        self.was_cut = True
        self.exchange.leave()


class ErrorLog(logging.Handler):
    """Collects ERROR records of the router: the app logs every exception it swallows (a
    negative load count raises inside the ledger and would otherwise only be logged)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


# -- the machine -----------------------------------------------------------------------------------

# Successes and failures are separate rules so that half the answers let a request go on (rules
# are drawn uniformly; one rule with seven answers, four of them fatal, rarely reached decode).
PREFILL_SUCCESSES = ("ok", "ok_no_kv", "ok_then_client_leaves")
PREFILL_FAILURES = ("503", "reset", "400", "stall_body")
DECODE_FAILURES = ("503", "reset", "400")
JUMPS = (TIMEOUT / 2, TIMEOUT + 0.5, 10 * TIMEOUT)
#: Longer than any retry backoff of the retry machine, far shorter than every timeout.
MOMENT = 0.1
#: --client-write-timeout-secs in the machines: shorter than some jumps, longer than others.
STALL = 8.0
#: Rules that end requests early. Each run enables a random subset ("swarm testing"): with all of
#: them on, nearly every request is cut short before its decode stream gets going, and the deep
#: states (a stream in flight, a stalled client) are rarely reached.
DISRUPTIONS = ("client_leaves", "client_stops_reading", "upstream_fails", "time_passes", "shutdown")


class LifecycleMachine(RuleBasedStateMachine):
    """The PD router with one prefill and one decode endpoint: load is exact per endpoint."""

    config: ClassVar[RouterConfig] = RouterConfig(
        pd=True,
        prefill_urls=("http://prefill-a:8100",),
        decode_urls=("http://decode-a:8200",),
        policy="round_robin",
        timeouts=Timeouts(request=TIMEOUT),
        retry=RetrySettings(max_retries=1),  # one attempt: vllm-router's meaning of 1
        # Four events across all streams: stalled clients meet the process's buffer budget.
        max_total_buffered_bytes=4 * len(EVENT),
    )
    #: Whether a live request with a draining client and no open upstream call is a bug (it is
    #: not while a retrying request sleeps its backoff).
    check_progress: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.clock = trio.testing.MockClock()
        self.loop = TrioLoopThread(self.clock)
        self.upstream = ScriptedUpstream(self._answer)
        # The same limits trio_pdrouter.http.upstream.make_client gives the real client.
        timeout = client_timeout(self.config.timeouts)
        self.client = LegClient(transport=self.upstream, timeout=timeout)
        #: The app of the server running now (each start builds one: its background nursery,
        #: where stranded-KV reclaims run, lives as long as that server).
        self.app: RouterApp
        self.stall_watch: StallWatch
        self.requests: dict[str, ClientRequest] = {}
        self.calls: list[UpstreamCall] = []
        self.errors = ErrorLog()
        logging.getLogger("trio_pdrouter").addHandler(self.errors)
        self.server_scope: trio.CancelScope | None = None
        self.server_nursery: trio.Nursery | None = None
        self.server_done = trio.Event()
        self.shut_down = False
        self.disruptions = frozenset(DISRUPTIONS)
        self._do(self._start_server)

    # -- plumbing --------------------------------------------------------------------------------

    def _step(self, action: Callable[[], None]) -> None:
        """Run one synchronous action in the loop, then let the app run until all is blocked."""

        async def step() -> None:
            action()
            await trio.testing.wait_all_tasks_blocked()

        self.loop.run(step)

    def _do(self, afn: Callable[[], Awaitable[None]]) -> None:
        async def step() -> None:
            await afn()
            await trio.testing.wait_all_tasks_blocked()

        self.loop.run(step)

    async def _start_server(self) -> None:
        done = self.server_done = trio.Event()

        async def serve(task_status: trio.TaskStatus[None]) -> None:
            try:
                with trio.CancelScope() as scope:
                    async with trio.open_nursery() as nursery:
                        self.server_scope, self.server_nursery = scope, nursery
                        self.app = build_app(self.config, self.client, nursery)
                        self.stall_watch = StallWatch(STALL, self.app.proxy.in_flight)
                        task_status.started()
                        await trio.sleep_forever()
            finally:
                done.set()

        # In the loop's own nursery: the server outlives this call, which runs as a short task.
        await self.loop.nursery.start(serve)

    async def _client(self, req: ClientRequest, body: dict[str, Any]) -> None:
        # This task's connection, as trio_pdrouter.http.expose_connections gives it.
        client_connection._CONNECTION.set(req)  # type: ignore[arg-type]
        try:
            await call(
                self.app,
                "POST",
                "/v1/completions",
                body,
                headers={"x-request-id": req.request_id},
                exchange=req.exchange,
            )
        except Exception as exc:  # an exception escaping the app is a finding, not a crash here
            req.crashed = exc
        finally:
            req.ended = True

    async def _answer(self, request: httpx.Request) -> httpx.Response:
        """The scripted engines: every request waits for a rule to decide its answer."""
        host = request.url.host
        stage = host.split("-", 1)[0]
        req = self.requests[request.headers["x-request-id"]]
        read_timeout = request.extensions.get("timeout", {}).get("read")
        upstream_call = UpstreamCall(
            number=len(self.calls),
            stage=stage,
            endpoint=f"{request.url.scheme}://{host}:{request.url.port}",
            request_id=req.request_id,
            stream=bool(orjson.loads(request.content).get("stream")),
            stranded=stage != "prefill" and orjson.loads(request.content)["max_tokens"] == 1,
        )
        self.calls.append(upstream_call)
        req.calls.append(upstream_call)
        try:
            with trio.fail_after(_limit(read_timeout)):
                await upstream_call.decided.wait()
        except trio.TooSlowError:
            upstream_call.handler_done = True
            raise httpx.ReadTimeout("scripted: no response head", request=request) from None
        except BaseException:
            upstream_call.handler_done = True
            raise
        decision = upstream_call.decision
        if decision == "reset":
            upstream_call.handler_done = True
            raise httpx.ReadError("scripted: connection reset", request=request)
        body = upstream_call.body = UpstreamBody(read_timeout)
        status = 200
        ctype = "text/event-stream" if upstream_call.stream else "application/json"
        if decision in ("400", "503"):
            status = int(decision)
            ctype = "application/json"
            body.push(ERROR_400 if status == 400 else ERROR_503)
            _end(body)
        elif stage == "prefill":
            ctype = "application/json"
            answer = PREFILL_ANSWER_NO_KV if decision == "ok_no_kv" else PREFILL_ANSWER
            if decision == "stall_body":
                body.push(answer[:10])  # the head and a few bytes, then nothing
                upstream_call.sent = 10
            else:
                body.push(answer)
                _end(body)
                if decision == "ok_then_client_leaves":
                    # Leaves the instant the router has read the answer: after prefill, before
                    # (or while) the decode leg is sent.
                    body.on_eof = req.exchange.leave
        return httpx.Response(status, headers={"content-type": ctype}, stream=body)

    # -- rules -----------------------------------------------------------------------------------

    def _live(self) -> list[ClientRequest]:
        return [r for r in self.requests.values() if r.live]

    def _pick(self, data: st.DataObject, items: list[T]) -> T:
        return data.draw(st.sampled_from(items))

    @initialize(enabled=st.frozensets(st.sampled_from(DISRUPTIONS)))
    def choose_disruptions(self, enabled: frozenset[str]) -> None:
        self.disruptions = enabled

    def _may(self, disruption: str) -> bool:
        return disruption in self.disruptions

    @precondition(lambda self: len(self._live()) < MAX_LIVE)
    @rule(stream=st.booleans(), logprobs=st.booleans())
    def client_request_arrives(self, stream: bool, logprobs: bool) -> None:
        req = ClientRequest(f"req-{len(self.requests)}", stream, logprobs)
        self.requests[req.request_id] = req
        body: dict[str, Any] = {"model": "m", "prompt": "a b", "max_tokens": 3, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if logprobs:
            body.update(logprobs=1, echo=True, prompt_logprobs=1)
        nursery = self.server_nursery
        assert nursery is not None
        self._step(lambda: nursery.start_soon(self._client, req, body))

    def _awaiting_prefill(self) -> list[UpstreamCall]:
        return [c for c in self.calls if c.awaiting_head and c.stage == "prefill"]

    @precondition(lambda self: self._awaiting_prefill())
    @rule(data=st.data(), answer=st.sampled_from(PREFILL_SUCCESSES))
    def prefill_answers(self, data: st.DataObject, answer: str) -> None:
        target = self._pick(data, self._awaiting_prefill())
        self._step(lambda: _decide(target, answer))

    @precondition(lambda self: self._may("upstream_fails") and self._awaiting_prefill())
    @rule(data=st.data(), failure=st.sampled_from(PREFILL_FAILURES))
    def prefill_fails(self, data: st.DataObject, failure: str) -> None:
        """5xx, a reset before any byte, a 4xx for the client, or a head and then silence."""
        target = self._pick(data, self._awaiting_prefill())
        self._step(lambda: _decide(target, failure))

    def _stalled_prefill(self) -> list[UpstreamCall]:
        return [c for c in self.calls if c.stage == "prefill" and c.streaming]

    @precondition(lambda self: self._stalled_prefill())
    @rule(data=st.data())
    def stalled_prefill_body_completes(self, data: st.DataObject) -> None:
        target = self._pick(data, self._stalled_prefill())

        def finish() -> None:
            assert target.body is not None
            target.body.push(PREFILL_ANSWER[target.sent :])
            _end(target.body)

        self._step(finish)

    def _generation_calls(self, predicate: Callable[[UpstreamCall], bool]) -> list[UpstreamCall]:
        return [c for c in self.calls if c.stage != "prefill" and predicate(c)]

    @precondition(lambda self: self._generation_calls(lambda c: c.awaiting_head))
    @rule(data=st.data())
    def decode_sends_headers(self, data: st.DataObject) -> None:
        target = self._pick(data, self._generation_calls(lambda c: c.awaiting_head))
        self._step(lambda: _decide(target, "200"))

    @precondition(
        lambda self: (
            self._may("upstream_fails") and self._generation_calls(lambda c: c.awaiting_head)
        )
    )
    @rule(data=st.data(), failure=st.sampled_from(DECODE_FAILURES))
    def decode_fails_before_streaming(self, data: st.DataObject, failure: str) -> None:
        target = self._pick(data, self._generation_calls(lambda c: c.awaiting_head))
        self._step(lambda: _decide(target, failure))

    @precondition(lambda self: self._generation_calls(lambda c: c.streaming))
    @rule(data=st.data())
    def decode_sends_a_chunk(self, data: st.DataObject) -> None:
        target = self._pick(data, self._generation_calls(lambda c: c.streaming))
        self._step(lambda: _push_chunk(target))

    @precondition(lambda self: self._generation_calls(lambda c: c.streaming))
    @rule(data=st.data(), complete=st.booleans(), client_leaves_too=st.booleans())
    def decode_reaches_eof(
        self, data: st.DataObject, complete: bool, client_leaves_too: bool
    ) -> None:
        """EOF with ``[DONE]`` (or a complete JSON answer), or a truncated one; optionally the
        client leaves in the same instant (after the last byte, racing the final send)."""
        target = self._pick(data, self._generation_calls(lambda c: c.streaming))
        req = self.requests[target.request_id]

        def eof() -> None:
            _push_eof(target, complete)
            if client_leaves_too:
                req.exchange.leave()

        self._step(eof)

    @precondition(
        lambda self: self._may("upstream_fails") and self._generation_calls(lambda c: c.streaming)
    )
    @rule(data=st.data())
    def decode_fails_mid_stream(self, data: st.DataObject) -> None:
        target = self._pick(data, self._generation_calls(lambda c: c.streaming))

        def fail() -> None:
            assert target.body is not None
            target.body.ended = True
            target.body.fail(httpx.ReadError("scripted: connection reset mid-stream"))

        self._step(fail)

    def _present(self) -> list[ClientRequest]:
        return [r for r in self._live() if not r.exchange.disconnect.is_set()]

    @precondition(lambda self: self._may("client_leaves") and self._present())
    @rule(data=st.data())
    def client_leaves(self, data: st.DataObject) -> None:
        req = self._pick(data, self._present())
        self._step(req.exchange.leave)

    def _reading(self) -> list[ClientRequest]:
        return [r for r in self._present() if r.exchange.draining.is_set()]

    def _stalled(self) -> list[ClientRequest]:
        return [r for r in self._live() if not r.exchange.draining.is_set()]

    @precondition(lambda self: self._may("client_stops_reading") and bool(self._reading()))
    @rule(data=st.data())
    def client_stops_reading(self, data: st.DataObject) -> None:
        req = self._pick(data, self._reading())
        self._step(req.exchange.stop_reading)

    @precondition(lambda self: bool(self._stalled()))
    @rule(data=st.data())
    def client_reads_again(self, data: st.DataObject) -> None:
        req = self._pick(data, self._stalled())
        self._step(req.exchange.resume_reading)

    def _busy(self) -> bool:
        return bool(self._live() or any(c.open for c in self.calls))

    @precondition(_busy)
    @rule()
    def a_moment_passes(self) -> None:
        """Retry backoffs end; no timeout fires. Always enabled: a retrying request may be
        waiting for nothing else."""
        self._step(lambda: self.clock.jump(MOMENT))

    @precondition(lambda self: self._may("client_stops_reading") and self._busy())
    @rule()
    def stall_watch_looks(self) -> None:
        """The watch's periodic look: clients stuck in one send for STALL seconds are cut."""
        self._step(self.stall_watch.sweep)

    @precondition(lambda self: self._may("time_passes") and self._busy())
    @rule(seconds=st.sampled_from(JUMPS))
    def time_passes(self, seconds: float) -> None:
        self._step(lambda: self.clock.jump(seconds))

    # Once per run (teardown shuts down again): everything after a shutdown starts from zero.
    @precondition(lambda self: self._may("shutdown") and self._busy() and not self.shut_down)
    @rule()
    def server_shuts_down(self) -> None:
        self.shut_down = True
        self._shutdown()
        self.check_everything_released()

    @precondition(lambda self: self._may("shutdown") and bool(self._live()))
    @rule()
    def shutdown_deadline_passes(self) -> None:
        """The graceful timeout is over: the router ends every undecided request itself."""
        self._step(self.app.proxy.shut_down)
        for req in self._live():
            if not req.exchange.draining.is_set():
                continue  # its send is blocked: it ends once the client reads again
            assert req.exchange.complete or req.exchange.disconnect.is_set(), req.request_id
            if req.exchange.status == 503:
                assert b"shutting down" in bytes(req.exchange.body)

    def _shutdown(self) -> None:
        """hypercorn's end of a graceful shutdown: every request task is cancelled."""

        async def shutdown() -> None:
            for req in self._live():
                req.by_shutdown = True
                # hypercorn closes the connections, which also ends a send blocked on a client
                # that stopped reading (that wait is shielded from the cancellation).
                req.exchange.resume_reading()
            assert self.server_scope is not None
            self.server_scope.cancel()
            await self.server_done.wait()
            await self._start_server()

        self._do(shutdown)

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def load_is_what_the_engines_are_serving(self) -> None:
        snapshot = self.app.ledger.snapshot()
        open_calls = Counter(c.endpoint for c in self.calls if c.open)
        in_prefill = sum(1 for c in self.calls if c.open and c.stage == "prefill")
        open_stranded = Counter(c.endpoint for c in self.calls if c.open and c.stranded)
        tokens = self.app.ledger.token_snapshot()
        state = self._describe()
        for role, counts in snapshot.items():
            for key, n in counts.items():
                assert n >= 0, f"{role} load of {key} is negative: {snapshot}"
                # A token weight moves with its slot: every request is "a b" (1 prompt token,
                # no cache share under round_robin) with max_tokens 3, so each prefill slot
                # weighs 1 and each decode or worker slot 1 + 3.
                # A reclaim of stranded KV weighs 1 + 1 (one token generated).
                reclaims = open_stranded[key] if role == "decode" else 0
                per_slot = 1 if role == "prefill" else 4
                weight = tokens[role][key]
                expected = (n - reclaims) * per_slot + reclaims * 2
                assert weight == expected, f"{role} {key}: {n} slots weigh {weight} {state}"
        for key, n in snapshot.get("prefill", {}).items():
            assert n == open_calls[key], f"prefill {key}: ledger {n}, open calls {state}"
        for key, n in snapshot.get("regular", {}).items():
            assert n == open_calls[key], f"worker {key}: ledger {n}, open calls {state}"
        decode = snapshot.get("decode", {})
        for key, n in decode.items():
            assert n >= open_calls[key], f"decode {key}: ledger {n} < open calls {state}"
        expected = sum(open_calls[key] for key in decode) + in_prefill
        assert sum(decode.values()) == expected, (
            f"decode total: ledger {decode}, expected {expected} "
            f"(open decode calls + requests in prefill) {state}"
        )

    @invariant()
    def no_bytes_are_held_for_requests_that_ended(self) -> None:
        """The process-wide buffer budget returns to exactly 0 once no request is served."""
        if not self.app.proxy.in_flight:
            held = self.app.metrics.registry.get_sample_value("trio_pdrouter_buffered_bytes")
            assert held == 0, f"{held} bytes still counted for clients: {self._describe()}"

    @invariant()
    def the_router_knows_where_each_request_is(self) -> None:
        """Each request the router serves moved only along the lifecycle table, and its phase
        and KV owner are what an observer of the client and the engines would say."""
        serving = {r.inf.request_id: r for r in self.app.proxy.in_flight}
        for rid, served in serving.items():
            req = self.requests[rid]
            assert not req.ended, f"{rid} ended but the router still serves it"
            history = served.life.history
            for before, after in itertools.pairwise(history):
                assert after in successors(before), f"{rid}: {before} -> {after} in {history}"
            phase = served.life.phase
            expected = self._expected_phases(req)
            assert phase in expected, f"{rid} is {phase}, expected {expected}: {self._describe()}"
            kv = self._expected_kv(req)
            if kv is not None and phase not in (Phase.CLIENT_GONE, Phase.CLIENT_STALLED):
                assert served.life.kv is kv, f"{rid}: KV held by {served.life.kv}, not {kv}"

    def _expected_phases(self, req: ClientRequest) -> frozenset[Phase]:
        if req.exchange.disconnect.is_set():
            return frozenset({Phase.CLIENT_STALLED if req.was_cut else Phase.CLIENT_GONE})
        calls = [c for c in req.calls if not c.stranded]
        last = calls[-1] if calls else None
        if last is not None and last.open:
            if last.stage == "prefill":
                return frozenset({Phase.PREFILLING})
            if last.decision == "200" and req.stream:
                return frozenset({Phase.STREAMING})
            return frozenset({Phase.DECODING})
        if req.exchange.draining.is_set():
            # Reading, and no engine works for it: only a retry's backoff is left.
            return frozenset({Phase.RETRYING})
        # A client that stopped reading holds a send: mid-stream, or the final one.
        held = {Phase.RETRYING, Phase.STREAMING, Phase.ANSWERED, Phase.FAILED, Phase.SHUT_DOWN}
        return frozenset(held)

    def _expected_kv(self, req: ClientRequest) -> KvOwner | None:
        """Who holds the current attempt's KV, when the calls tell (None: they do not)."""
        calls = [c for c in req.calls if not c.stranded]
        if not calls or calls[-1].stage == "worker":
            return KvOwner.NONE
        last = calls[-1]
        prefills = [c for c in calls if c.stage == "prefill"]
        if last.stage == "prefill" or not prefills or not last.open:
            return None
        if prefills[-1].decision == "ok_no_kv":
            return KvOwner.NONE
        # Decode has taken the blocks once its request was written whole, streaming or not
        # (trio_pdrouter.serve.lifecycle): the scripted engine has it once the call exists.
        return KvOwner.DECODE

    @invariant()
    def nothing_was_swallowed_or_escaped(self) -> None:
        assert not self.errors.records, [r.getMessage() for r in self.errors.records]
        for req in self.requests.values():
            assert req.crashed is None, f"{req.request_id} raised out of the app: {req.crashed!r}"

    @invariant()
    def ended_requests_closed_their_upstream_responses(self) -> None:
        for req in self.requests.values():
            if not req.ended:
                continue
            for c in req.calls:
                if not c.stranded:
                    assert not c.open, f"{req.request_id} ended with call {c.number} open"
                    assert c.body is None or c.body.closed, (
                        f"{req.request_id}: upstream response {c.number} was never closed"
                    )

    @invariant()
    def a_finished_exchange_is_whole(self) -> None:
        """Every client that stayed gets a complete response; a 200 stream ends with ``[DONE]``."""
        for req in self.requests.values():
            ex = req.exchange
            if not req.ended or req.by_shutdown or ex.disconnect.is_set():
                continue
            assert ex.complete, f"{req.request_id}: response not complete: {bytes(ex.body)!r}"
            if req.stream and ex.status == 200:
                assert bytes(ex.body).endswith(DONE), f"{req.request_id}: {bytes(ex.body)!r}"

    @invariant()
    def live_requests_make_progress(self) -> None:
        """A live request whose client reads either waits on an engine or is being answered."""
        if not self.check_progress:
            return
        for req in self._live():
            if not req.exchange.draining.is_set():
                continue
            waiting = any(c.open for c in req.calls)
            assert waiting, f"{req.request_id} is stuck: {self._describe()}"

    def _describe(self) -> str:
        return ", ".join(
            f"#{c.number} {c.stage} {c.request_id} {c.decision or '-'}"
            f"{' open' if c.open else ''}{' stranded' if c.stranded else ''}"
            for c in self.calls
        )

    def check_everything_released(self) -> None:
        snapshot = self.app.ledger.snapshot()
        assert self.app.ledger.total() == 0, snapshot
        assert self.app.ledger.token_total() == 0, self.app.ledger.token_snapshot()
        assert not self.app.proxy.in_flight, "the router still serves requests after shutdown"
        for c in self.calls:
            assert not c.open, f"call {c.number} still open after shutdown: {self._describe()}"
            assert c.body is None or c.body.closed, f"call {c.number} never closed"

    def teardown(self) -> None:
        try:
            self._shutdown()
            self.check_everything_released()
            self.nothing_was_swallowed_or_escaped()
        finally:
            logging.getLogger("trio_pdrouter").removeHandler(self.errors)
            self.loop.close()


def _decide(target: UpstreamCall, decision: str) -> None:
    target.decision = decision
    target.decided.set()


def _end(body: UpstreamBody) -> None:
    body.ended = True
    body.end()


def _push_chunk(target: UpstreamCall) -> None:
    assert target.body is not None
    if target.stream:
        target.body.push(EVENT)
        target.sent += len(EVENT)
        return
    # A non-streaming answer arrives in slices; keep the last byte for the EOF rule.
    piece = DECODE_ANSWER[target.sent : min(target.sent + 40, len(DECODE_ANSWER) - 1)]
    target.body.push(piece)
    target.sent += len(piece)


def _push_eof(target: UpstreamCall, complete: bool) -> None:
    assert target.body is not None
    if complete:
        if target.stream:
            # [DONE] is output too: decode ran the request, so it took the KV blocks.
            target.body.push(DONE)
            target.sent += len(DONE)
        else:
            target.body.push(DECODE_ANSWER[target.sent :])
    _end(target.body)


class RegularModeMachine(LifecycleMachine):
    """Non-PD mode: one worker endpoint, one leg per request."""

    config = RouterConfig(
        pd=False,
        worker_urls=("http://worker-a:8300",),
        policy="round_robin",
        timeouts=Timeouts(request=TIMEOUT),
        retry=RetrySettings(max_retries=1),
        max_total_buffered_bytes=4 * len(EVENT),
    )


class RetryingMachine(LifecycleMachine):
    """Two endpoints per stage and retries: each attempt charges and releases its own endpoints."""

    config = RouterConfig(
        pd=True,
        prefill_urls=("http://prefill-a:8100", "http://prefill-b:8100"),
        decode_urls=("http://decode-a:8200", "http://decode-b:8200"),
        policy="round_robin",
        timeouts=Timeouts(request=TIMEOUT),
        retry=RetrySettings(max_retries=3),
        max_total_buffered_bytes=4 * len(EVENT),
    )
    check_progress = False


TestLifecycle = LifecycleMachine.TestCase
TestRegularMode = RegularModeMachine.TestCase
TestRetrying = RetryingMachine.TestCase
