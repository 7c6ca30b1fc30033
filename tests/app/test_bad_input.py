"""Hostile input at the ASGI app: it always answers, never 500s, never leaks load, and never
sends a request it rejected to an engine.

Requests are driven at the app in memory with raw header bytes (as hypercorn hands them over,
latin-1 ``obs-text`` included) and bodies split over several ``http.request`` messages.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import httpx
import orjson
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.harness import ScriptedUpstream, make_app, pd_config, streaming, total_load
from trio_pdrouter.app import RouterApp
from trio_pdrouter.config import RouterConfig

API_KEY = "sk-router"
INFERENCE = ("/v1/completions", "/v1/chat/completions")
#: Statuses the router itself gives a request it refuses; such a request never goes upstream.
REFUSALS = {400, 401, 404, 405, 408, 413, 415, 429, 431, 505}

CONFIGS: dict[str, RouterConfig] = {
    "pd": pd_config(),
    "regular": RouterConfig(worker_urls=("http://worker:8000",), policy="round_robin"),
    "pd_api_key": pd_config(api_key=API_KEY),
    "pd_small_payload": pd_config(max_payload_size=64),
}


async def engine(request: httpx.Request) -> httpx.Response:
    """A healthy engine: any well-formed request gets a well-formed answer."""
    if request.method == "GET":
        return httpx.Response(200, json={"object": "list", "data": []})
    body = orjson.loads(request.content)
    if body.get("stream") is True:
        response, stream = streaming()
        stream.push(b'data: {"choices":[{"index":0,"text":"x"}]}\n\ndata: [DONE]\n\n')
        stream.end()
        return response
    answer: dict[str, Any] = {"id": "cmpl-1", "choices": [{"index": 0, "text": "x"}]}
    if "kv_transfer_params" in body:
        answer["kv_transfer_params"] = {"remote_engine_id": "e", "remote_block_ids": [1]}
    return httpx.Response(200, json=answer)


@attrs.define
class Answer:
    status: int | None = None
    body: bytearray = attrs.Factory(bytearray)
    complete: bool = False


async def drive(
    app: RouterApp, method: str, path: str, headers: list[tuple[bytes, bytes]], chunks: list[bytes]
) -> Answer:
    answer = Answer()
    pending = list(chunks)
    scope = {"type": "http", "method": method, "path": path, "headers": headers}

    async def receive() -> dict[str, Any]:
        if pending:
            chunk = pending.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending)}
        await trio.sleep_forever()  # the client stays until the response is complete
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        assert not answer.complete, f"message after the response was complete: {message}"
        if message["type"] == "http.response.start":
            assert answer.status is None, "second response start"
            answer.status = message["status"]
        elif message["type"] == "http.response.body":
            assert answer.status is not None, "body before response start"
            answer.body += message.get("body", b"")
            answer.complete = not message.get("more_body", False)

    with trio.fail_after(5):  # a wedged app fails the example instead of hanging the run
        await app(scope, receive, send)
    return answer


# --- strategies ----------------------------------------------------------------------------


def dump(value: Any) -> bytes:
    """JSON text for any generated value (integers beyond 64 bits included, unlike orjson)."""
    return json.dumps(value).encode()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
field_values = st.one_of(
    json_values,
    st.sampled_from(["hi", "", [], [1, 2], ["a", "b"], [[1], [2]], {}, True, 0, -1, None, "true"]),
    st.lists(st.fixed_dictionaries({"role": json_values, "content": json_values}), max_size=3),
)
request_objects = st.dictionaries(
    st.sampled_from(
        [
            "prompt",
            "messages",
            "stream",
            "max_tokens",
            "model",
            "logprobs",
            "echo",
            "stream_options",
            "user",
            "session_id",
            "kv_transfer_params",
            "min_tokens",
        ]
    ),
    field_values,
    max_size=6,
)
valid_objects = st.one_of(
    st.fixed_dictionaries(
        {"prompt": st.text(min_size=1, max_size=10)},
        optional={"stream": st.booleans(), "max_tokens": json_values},
    ),
    st.fixed_dictionaries(
        {
            "messages": st.lists(
                st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=10)}),
                min_size=1,
                max_size=2,
            )
        },
        optional={"stream": st.booleans(), "max_tokens": json_values},
    ),
)
bodies = st.one_of(
    st.binary(max_size=80),
    st.builds(dump, json_values),
    st.builds(dump, request_objects),
    st.builds(dump, valid_objects),
    # Invalid UTF-8 inside an otherwise valid JSON string.
    st.builds(lambda b: b'{"prompt": "' + b + b'"}', st.binary(min_size=1, max_size=8)),
    # Deep nesting, inside and outside an object.
    st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 5000).map(lambda n: b'{"prompt": ' + b"[" * n + b"1" + b"]" * n + b"}"),
    st.integers(1, 3000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
)
content_types = st.one_of(
    st.none(),
    st.sampled_from(
        [
            b"application/json",
            b"application/json; charset=utf-8",
            b"APPLICATION/JSON",
            b"text/plain",
            b"",
            b"multipart/form-data; boundary=x",
            b"application/json\xe9",
            b"application/jsonx",
        ]
    ),
    st.binary(max_size=30).map(lambda b: bytes(c for c in b if c not in b"\r\n\x00")),
)
header_names = st.one_of(
    st.sampled_from(
        [
            b"content-length",
            b"authorization",
            b"traceparent",
            b"tracestate",
            b"baggage",
            b"x-request-id",
            b"x-correlation-id",
            b"x-session-id",
            b"x-user-id",
            b"transfer-encoding",
            b"connection",
            b"host",
            b"x-data-parallel-rank",
            b"accept",
        ]
    ),
    st.text("abcdefghijklmnopqrstuvwxyz0123456789-_!#$%&'*+.^`|~", min_size=1, max_size=12).map(
        str.encode
    ),
)
# What h11 accepts in a field value: visible ASCII, obs-text (0x80-0xff), inner spaces and tabs.
header_values = st.one_of(
    st.sampled_from(
        [
            b"",
            b"0",
            b"12",
            b"99999999999",
            b"-1",
            b"\xb2",
            b"1\xb9",
            b"Bearer sk-router",
            b"Bearer \xff",
        ]
    ),
    st.binary(max_size=24).map(
        lambda b: bytes(c for c in b if (c >= 0x20 and c != 0x7F) or c == 0x09).strip()
    ),
)
headers = st.lists(st.tuples(header_names, header_values), max_size=5)


def split(body: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(body) + 1) for c in cuts})
    parts, last = [], 0
    for point in [*points, len(body)]:
        parts.append(body[last:point])
        last = point
    return parts


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(sorted(CONFIGS)),
    method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE", "HEAD", "OPTIONS"]),
    path=st.one_of(
        st.sampled_from(
            [
                *INFERENCE,
                *INFERENCE,
                "/health",
                "/readiness",
                "/get_loads",
                "/workers",
                "/v1/models",
            ]
        ),
        st.text(max_size=20).map(lambda p: "/" + p),
    ),
    content_type=content_types,
    extra_headers=headers,
    body=bodies,
    cuts=st.lists(st.integers(0, 10_000), max_size=3),
    authorized=st.booleans(),
)
async def test_hostile_requests_are_answered_without_harm(
    mode: str,
    method: str,
    path: str,
    content_type: bytes | None,
    extra_headers: list[tuple[bytes, bytes]],
    body: bytes,
    cuts: list[int],
    authorized: bool,
) -> None:
    config = CONFIGS[mode]
    raw_headers = list(extra_headers)
    if content_type is not None:
        raw_headers.append((b"content-type", content_type))
    if authorized and config.api_key is not None:
        raw_headers.append((b"authorization", f"Bearer {API_KEY}".encode()))
    # A nursery per example (Hypothesis reuses function-scoped fixtures across examples).
    async with trio.open_nursery() as background:
        app, upstream = make_app(config, engine, background)
        answer = await drive(app, method, path, raw_headers, split(body, cuts))
        check(app, upstream, path, answer)
        background.cancel_scope.cancel()


def check(app: RouterApp, upstream: ScriptedUpstream, path: str, answer: Answer) -> None:
    """The properties every request must have, whatever it was."""
    assert answer.status is not None and answer.complete, "the app did not answer completely"
    assert answer.status < 500, f"{answer.status}: {bytes(answer.body)[:300]!r}"
    assert total_load(app) == 0, app.ledger.snapshot()
    if answer.status in REFUSALS:
        assert upstream.requests == [], "a refused request was sent upstream"
        error = orjson.loads(bytes(answer.body))["error"]
        assert error["code"] == answer.status
        assert isinstance(error["message"], str) and isinstance(error["type"], str)
    if upstream.requests and path in INFERENCE:
        assert answer.status == 200


# Minimal examples of bugs the property test found, kept as named regressions.


async def test_content_length_with_a_non_ascii_digit_is_a_client_error(
    background: trio.Nursery,
) -> None:
    # "\xb2" is "²" in latin-1: str.isdigit() accepts it, int() does not.
    app, upstream = make_app(CONFIGS["pd"], engine, background)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"\xb2")]
    answer = await drive(app, "POST", "/v1/completions", headers, [b'{"prompt": "hi"}'])
    check(app, upstream, "/v1/completions", answer)


@pytest.mark.parametrize("name", [b"traceparent", b"authorization", b"x-request-id"])
async def test_non_ascii_forwarded_header_is_not_a_500(
    name: bytes, background: trio.Nursery
) -> None:
    # h11 (hence hypercorn) accepts obs-text bytes 0x80-0xff in header values.
    app, upstream = make_app(CONFIGS["pd"], engine, background)
    headers = [(b"content-type", b"application/json"), (name, b"caf\xe9")]
    answer = await drive(app, "POST", "/v1/completions", headers, [b'{"prompt": "hi"}'])
    check(app, upstream, "/v1/completions", answer)


async def test_json_nested_too_deep_to_forward_is_a_400(background: trio.Nursery) -> None:
    """orjson reads deeper nesting than it writes: such a body must be refused, not a 500."""
    from tests.harness import call

    upstream_calls: list[httpx.Request] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        upstream_calls.append(request)
        return httpx.Response(200, json={})

    app, _ = make_app(pd_config(), handler, background)
    deep = b'{"prompt": "x", "extra": ' + b"[" * 300 + b"]" * 300 + b"}"
    assert orjson.loads(deep)  # parses fine; orjson could not serialise it again
    ex = await call(
        app, "POST", "/v1/completions", raw=deep, headers={"content-type": "application/json"}
    )
    assert ex.status == 400 and "nested deeper" in ex.json()["error"]["message"]
    assert not upstream_calls
    assert total_load(app) == 0
