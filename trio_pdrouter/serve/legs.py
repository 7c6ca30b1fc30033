"""The two legs that answer in one piece: the prefill leg, and a non-streaming decode.

Each leg sends one upstream request, releases its endpoint's load the moment the answer has been
read (or failed, or was cancelled), and returns either what it got or a
:class:`~.outcomes.LegFailure` — already recorded on the request, not yet decided: the proxy
chooses between retrying and failing. The streaming decode leg is :class:`.relay.DecodeRelay`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import httpx
import orjson
import trio

from ..endpoints import Endpoint
from ..http import (
    JSON,
    Answer,
    AnswerTooLarge,
    LegClient,
    Reply,
    passed_on,
    post_capped,
    with_default,
)
from ..transport import SendSide
from . import bodies, logprobs, outcomes
from .outcomes import LegFailure
from .request import Attempt, Request


@attrs.frozen
class UpstreamCall:
    """One leg's request, ready to send."""

    stage: str
    endpoint: Endpoint
    url: str
    content: bytes
    headers: dict[bytes, bytes]

    @classmethod
    def build(
        cls,
        req: Request,
        attempt: Attempt,
        endpoint: Endpoint,
        body: dict[str, Any],
        upstream_api_key: str | None,
        stage: str,
    ) -> UpstreamCall:
        inf = req.inf
        headers = bodies.upstream_headers(
            inf.headers, attempt.request_id, endpoint, upstream_api_key
        )
        if req.trace is not None:  # the engine joins the span of this call, not the client's
            traceparent = req.leg_traced(stage, endpoint, attempt.number)
            if traceparent:
                headers[b"traceparent"] = traceparent.encode()
        return cls(
            stage=stage,
            endpoint=endpoint,
            url=endpoint.url + inf.path,
            content=orjson.dumps(body),
            headers=headers,
        )


class PrefillLeg:
    """Sends the prefill leg (one token, KV transfer requested) and reads its JSON answer.

    The prefill endpoint's load is released when the answer has been read, when the leg fails,
    or when it is cancelled; ``limit`` bounds the whole leg. A client that leaves while the leg
    is out does not cancel it at once: the leg stops sending (the engine sees the client go and
    aborts a prefill still running) and reads for ``grace`` seconds an answer already on its
    way, whose KV blocks the proxy then reclaims; ``on_late_answer`` counts those answers.
    """

    def __init__(
        self,
        client: LegClient,
        limit: float,
        upstream_api_key: str | None,
        cap: int,
        *,
        grace: float,
        on_late_answer: Callable[[], None],
    ) -> None:
        self._client = client
        self._limit = limit
        self._upstream_api_key = upstream_api_key
        #: The largest answer read (``--max-upstream-answer-bytes``).
        self._cap = cap
        self._grace = grace
        self._on_late_answer = on_late_answer

    async def run(self, req: Request, attempt: Attempt) -> dict[str, Any] | LegFailure:
        ep = attempt.prefill
        assert ep is not None
        call = UpstreamCall.build(
            req,
            attempt,
            ep,
            bodies.prefill_body(req.inf.body, req.inf.path),
            self._upstream_api_key,
            "prefill",
        )
        await trio.lowlevel.checkpoint_if_cancelled()  # a client gone already: send nothing
        req.prefill_sent()
        side = SendSide()
        resp: Answer | LegFailure | None = None
        with trio.CancelScope() as leg:

            def leave() -> None:
                """The client left: stop sending (the engine aborts a prefill still running),
                but read for ``grace`` seconds an answer already on its way."""
                side.close()
                leg.deadline = min(leg.deadline, trio.current_time() + self._grace)

            req.on_leave = leave
            try:
                resp = await _post(self._client, call, self._limit, self._cap, side)
            finally:
                req.on_leave = None
                attempt.lease.release(ep)
        if req.life.client_gone:
            req.end()  # the client left during the leg: nothing is sent after it
            if not isinstance(resp, Answer):
                await trio.lowlevel.checkpoint()  # cancelled: raises, nothing recorded
            self._on_late_answer()
        if resp is None:
            raise AssertionError("a prefill leg's grace ends only for a client that left")
        if isinstance(resp, LegFailure):
            return req.record_failure(resp)
        if resp.status_code != 200:
            return req.record_failure(status_failure("prefill", ep, resp, resp.content))
        try:
            answer = orjson.loads(resp.content)
        except orjson.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            return req.record_failure(
                outcomes.invalid("prefill", ep, "answer is not a JSON object")
            )
        req.record_success(ep)
        req.prefill_answered(answer)
        return answer


class BufferedDecode:
    """A non-streaming decode (or regular) leg: the whole answer in one piece.

    The decode load is held until the answer has been read; ``limit`` bounds the wait for it.
    The prefill's KV blocks are decode's once the leg is sent, unless decode answers an error
    or the connection fails before the whole request went out (see :mod:`.lifecycle`).
    When the client asked for prompt logprobs or echo, the prefill's prompt-side fields are
    merged into the answer (:mod:`.logprobs`).
    """

    def __init__(self, client: LegClient, limit: float, cap: int) -> None:
        self._client = client
        self._limit = limit
        #: The largest answer read (``--max-upstream-answer-bytes``).
        self._cap = cap

    async def run(
        self, req: Request, attempt: Attempt, call: UpstreamCall, prefill: dict[str, Any] | None
    ) -> Reply | LegFailure:
        ep = call.endpoint
        attempt.lease.sent(ep)
        req.decode_sent()
        req.kv_taken()  # the engine's once it has the whole request (see lifecycle)
        side = SendSide()
        try:
            resp = await _post(self._client, call, self._limit, self._cap, side)
        except BaseException:
            req.kv_unless_unwritten(side)
            raise
        finally:
            attempt.lease.release(ep)
        if isinstance(resp, LegFailure):
            req.kv_unless_unwritten(side)
            return req.record_failure(resp)
        if resp.status_code != 200:
            req.kv_refused()
            return req.record_failure(status_failure(call.stage, ep, resp, resp.content))
        content = resp.content
        if prefill is not None and logprobs.needs_merge(req.inf.body):
            try:
                merged = logprobs.merge(req.inf.body, prefill, orjson.loads(content))
            except orjson.JSONDecodeError:
                return req.record_failure(outcomes.invalid(call.stage, ep, "answer is not JSON"))
            content = orjson.dumps(merged)
        req.record_success(ep)
        return Reply(200, with_default(passed_on(resp.headers), b"content-type", JSON), content)


async def _post(
    client: LegClient, call: UpstreamCall, limit: float, cap: int, side: SendSide
) -> Answer | LegFailure:
    """Send ``call`` and read its whole answer, within ``limit`` seconds and ``cap`` bytes.

    A failure is classified, not recorded: the caller records it once its load is released.
    """
    ep = call.endpoint
    try:
        with trio.move_on_after(limit) as scope:
            resp = await post_capped(
                client, call.url, content=call.content, headers=call.headers, cap=cap, side=side
            )
    except AnswerTooLarge as exc:
        return outcomes.invalid(call.stage, ep, str(exc))
    except httpx.HTTPError as exc:
        return outcomes.transport_failure(call.stage, ep, exc)
    if scope.cancelled_caught:
        return outcomes.timeout(call.stage, ep, f"no answer in {limit:g}s")
    return resp


def status_failure(
    stage: str, ep: Endpoint, resp: httpx.Response | Answer, body: bytes
) -> LegFailure:
    """The engine answered ``resp.status_code`` (not 200) with ``body``."""
    return outcomes.status(stage, ep, resp.status_code, passed_on(resp.headers), body)
