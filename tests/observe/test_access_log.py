"""The access log: one ``key=value`` line per inference request, matching the response headers."""

from __future__ import annotations

import functools
import logging
import re

import httpx
import orjson
import pytest
import trio

from tests.harness import (
    EVENT,
    PREFILL_ANSWER,
    REQUEST,
    Exchange,
    call,
    json_response,
    make_app,
    pd_config,
    streaming,
)
from trio_pdrouter.observe import RequestRecord, access_line

FIELDS = [
    "request_id",
    "route",
    "stream",
    "prefill",
    "decode",
    "status",
    "outcome",
    "prefill_ms",
    "ttfb_ms",
    "total_ms",
    "bytes",
    "retries",
]


PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s"]*)(?: |$)')


def parse(line: str) -> dict[str, str]:
    """Read a line as a log shipper would: ``key=value`` pairs split on single spaces, a
    double-quoted value in JSON string syntax."""
    fields: dict[str, str] = {}
    pos = 0
    while pos < len(line):
        match = PAIR.match(line, pos)
        assert match, f"not key=value at {line[pos:]!r}"
        key, raw = match.groups()
        fields[key] = orjson.loads(raw) if raw.startswith('"') else raw
        pos = match.end()
    return fields


def access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trio_pdrouter.access"]


def test_line_has_every_field_in_order_and_dashes_for_what_did_not_happen() -> None:
    rec = RequestRecord("abc-1", "/v1/completions", False, started=0.0)
    rec.status, rec.outcome, rec.total_ms = 503, "no_endpoint", 0.25
    line = access_line(rec)
    assert [pair.split("=", 1)[0] for pair in line.split(" ")] == FIELDS  # nothing quoted here
    assert parse(line) == {
        "request_id": "abc-1",
        "route": "/v1/completions",
        "stream": "false",
        "prefill": "-",
        "decode": "-",
        "status": "503",
        "outcome": "no_endpoint",
        "prefill_ms": "-",
        "ttfb_ms": "-",
        "total_ms": "0.2",
        "bytes": "0",
        "retries": "0",
    }


@pytest.mark.parametrize("rid", ['evil id="x" status=200', "tab\there", "", "nul\x00"])
def test_client_chosen_request_ids_cannot_forge_fields(rid: str) -> None:
    rec = RequestRecord(rid, "/v1/completions", True, started=0.0)
    line = access_line(rec)
    assert "\x00" not in line and "\t" not in line
    fields = parse(line)
    assert list(fields) == FIELDS
    assert fields["request_id"] == rid
    assert fields["status"] == "0"


async def test_one_line_per_streamed_pd_request_matching_the_headers(
    caplog: pytest.LogCaptureFixture,
    background: trio.Nursery,
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        response, body = streaming()
        body.push(EVENT)
        body.push(b"data: [DONE]\n\n")
        body.end()
        return response

    app, _ = make_app(pd_config(expose_routing_headers=True), handler, background)
    caplog.set_level(logging.INFO, logger="trio_pdrouter.access")
    ex = await call(app, "POST", "/v1/completions", REQUEST, headers={"x-request-id": "req-42"})
    assert ex.status == 200
    [line] = access_lines(caplog)
    fields = parse(line)
    assert fields["request_id"] == ex.headers["x-request-id"] == "req-42"
    assert fields["prefill"] == ex.headers["x-trio-pdrouter-prefill"] == "http://prefill:8100"
    assert fields["decode"] == ex.headers["x-trio-pdrouter-decode"] == "http://decode:8200"
    assert fields["route"] == "/v1/completions"
    assert (fields["stream"], fields["status"], fields["outcome"]) == ("true", "200", "ok")
    assert fields["bytes"] == str(len(ex.body))
    for timing in ("prefill_ms", "ttfb_ms", "total_ms"):
        assert float(fields[timing]) >= 0
    assert float(fields["total_ms"]) >= float(fields["ttfb_ms"])


async def test_a_client_that_leaves_mid_stream_is_logged_as_such(
    caplog: pytest.LogCaptureFixture,
    background: trio.Nursery,
) -> None:
    decode_started = trio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        response, body = streaming()
        body.push(EVENT)
        decode_started.set()
        return response

    app, _ = make_app(pd_config(), handler, background)
    caplog.set_level(logging.INFO, logger="trio_pdrouter.access")
    ex = Exchange()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            functools.partial(call, app, "POST", "/v1/completions", REQUEST, exchange=ex)
        )
        await decode_started.wait()
        await ex.started.wait()
        ex.leave()
    [line] = access_lines(caplog)
    fields = parse(line)
    assert fields["outcome"] == "client_disconnect"
    assert fields["decode"] == "http://decode:8200"


async def test_a_rejected_request_is_logged_too(
    caplog: pytest.LogCaptureFixture, background: trio.Nursery
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError("a bad request never reaches an upstream")

    app, _ = make_app(pd_config(), handler, background)
    caplog.set_level(logging.INFO, logger="trio_pdrouter.access")
    ex = await call(
        app, "POST", "/v1/chat/completions", {"messages": []}, headers={"x-request-id": "bad-1"}
    )
    assert ex.status == 400
    [line] = access_lines(caplog)
    fields = parse(line)
    assert (fields["request_id"], fields["status"], fields["outcome"]) == (
        "bad-1",
        "400",
        "bad_request",
    )
    assert (fields["route"], fields["prefill"], fields["decode"]) == (
        "/v1/chat/completions",
        "-",
        "-",
    )
    assert fields["bytes"] == str(len(ex.body))
