"""The two legs that answer in one piece: the prefill leg, and a non-streaming decode.

Each leg sends one upstream request, releases its endpoint's load the moment the answer has been
read (or failed, or was cancelled), and returns either what it got or a
:class:`~.outcomes.LegFailure` — already recorded on the request, not yet decided: the proxy
chooses between retrying and failing. The streaming decode leg is :class:`.relay.DecodeRelay`.
"""

from __future__ import annotations

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
        return cls(
            stage=stage,
            endpoint=endpoint,
            url=endpoint.url + inf.path,
            content=orjson.dumps(body),
            headers=bodies.upstream_headers(
                inf.headers, attempt.request_id, endpoint, upstream_api_key
            ),
        )


class PrefillLeg:
    """Sends the prefill leg (one token, KV transfer requested) and reads its JSON answer.

    The prefill endpoint's load is released when the answer has been read, when the leg fails,
    or when it is cancelled; ``limit`` bounds the whole leg.
    """

    def __init__(
        self, client: LegClient, limit: float, upstream_api_key: str | None, cap: int
    ) -> None:
        self._client = client
        self._limit = limit
        self._upstream_api_key = upstream_api_key
        #: The largest answer read (``--max-upstream-answer-bytes``).
        self._cap = cap

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
        req.prefill_sent()
        try:
            resp = await _post(self._client, call, self._limit, self._cap)
        finally:
            attempt.lease.release(ep)
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
    The prefill's KV blocks count as taken once the leg is sent, unless decode answers an
    error or the connection fails before the request goes out (see :mod:`.lifecycle`).
    When the client asked for prompt logprobs or echo, the prefill's prompt-side fields are
    merged into the answer (SPEC §6).
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
        req.kv_taken()  # nothing will show when decode schedules it (see lifecycle)
        try:
            resp = await _post(self._client, call, self._limit, self._cap)
        finally:
            attempt.lease.release(ep)
        if isinstance(resp, LegFailure):
            if resp.kind == "connect":
                req.kv_refused()  # the request never went out
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
    client: LegClient, call: UpstreamCall, limit: float, cap: int
) -> Answer | LegFailure:
    """Send ``call`` and read its whole answer, within ``limit`` seconds and ``cap`` bytes.

    A failure is classified, not recorded: the caller records it once its load is released.
    """
    ep = call.endpoint
    try:
        with trio.move_on_after(limit) as scope:
            resp = await post_capped(
                client, call.url, content=call.content, headers=call.headers, cap=cap
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
