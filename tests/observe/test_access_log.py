"""The access log: one ``key=value`` line per inference request, matching the response headers."""

from __future__ import annotations

import datetime
import functools
import io
import logging
import re
import subprocess
import sys

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
from trio_pdrouter.config import RetrySettings
from trio_pdrouter.observe import JsonLines, RequestRecord, access_line, usage_of

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
    "client",
    "model",
    "prompt_tokens",
    "completion_tokens",
]

#: Fields the text line has only when they happened; the JSON object always.
OPTIONAL = ["kv", "failed_stage", "failed_upstream", "cause"]

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
        "client": "-",
        "model": "-",
        "prompt_tokens": "-",
        "completion_tokens": "-",
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


USAGE_EVENT = b'data: {"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":7}}\n\n'


async def test_the_line_names_the_client_the_model_and_the_answers_token_counts(
    caplog: pytest.LogCaptureFixture, background: trio.Nursery
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        response, body = streaming()
        body.push(EVENT)
        body.push(USAGE_EVENT)
        body.push(b"data: [DONE]\n\n")
        body.end()
        return response

    app, _ = make_app(pd_config(), handler, background)
    caplog.set_level(logging.INFO, logger="trio_pdrouter.access")
    ex = await call(app, "POST", "/v1/completions", REQUEST, client=("10.9.8.7", 50123))
    assert ex.status == 200
    [line] = access_lines(caplog)
    fields = parse(line)
    assert (fields["client"], fields["model"]) == ("10.9.8.7:50123", "m")
    assert (fields["prompt_tokens"], fields["completion_tokens"]) == ("11", "7")
    assert "failed_stage" not in fields and "cause" not in fields


@pytest.mark.parametrize(
    ("tail", "counts"),
    [
        (
            b'{"id":"c","choices":[],"usage":{"prompt_tokens":3,"total_tokens":5,'
            b'"completion_tokens":2}}',
            (3, 2),
        ),
        (b'{"output":[],"usage":{"input_tokens":9,"output_tokens":4}}', (9, 4)),
        (b'data: {"choices":[{"text":"x"}]}\n\ndata: [DONE]\n\n', (None, None)),
        (b'{"usage":{"prompt_tokens":1}}', (1, None)),
    ],
)
def test_usage_is_read_from_the_last_bytes_sent(
    tail: bytes, counts: tuple[int | None, int | None]
) -> None:
    assert usage_of(tail) == counts


async def test_a_failed_request_is_a_warning_naming_its_stage_upstream_and_cause(
    caplog: pytest.LogCaptureFixture, background: trio.Nursery
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        raise httpx.ConnectError("connect to decode:8200 failed: refused")

    app, _ = make_app(pd_config(retry=RetrySettings(max_retries=1)), handler, background)
    caplog.set_level(logging.WARNING, logger="trio_pdrouter.access")  # as --log-level warning
    ex = await call(app, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert ex.status == 502
    [record] = [r for r in caplog.records if r.name == "trio_pdrouter.access"]
    assert record.levelno == logging.WARNING
    fields = parse(record.getMessage())
    assert (fields["outcome"], fields["failed_stage"]) == ("upstream_error", "decode")
    assert fields["failed_upstream"] == "http://decode:8200"
    assert fields["cause"] == "connect: ConnectError: connect to decode:8200 failed: refused"


async def test_an_answered_request_stays_at_info(
    caplog: pytest.LogCaptureFixture, background: trio.Nursery
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        return json_response({"choices": [{"text": "ok"}]})

    app, _ = make_app(pd_config(), handler, background)
    caplog.set_level(logging.WARNING, logger="trio_pdrouter.access")
    assert (await call(app, "POST", "/v1/completions", {"prompt": "x"})).status == 200
    assert access_lines(caplog) == []


async def test_json_lines_have_stable_keys_typed_values_and_utc_times(
    background: trio.Nursery,
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        answer = {
            "choices": [{"text": "ok"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1},
        }
        return json_response(answer)

    stream = io.StringIO()
    handler_ = logging.StreamHandler(stream)
    handler_.setFormatter(JsonLines())
    access = logging.getLogger("trio_pdrouter.access")
    access.addHandler(handler_)
    access.setLevel(logging.INFO)
    try:
        app, _ = make_app(pd_config(), handler, background)
        await call(app, "POST", "/v1/completions", {"prompt": "x"}, headers={"x-request-id": "j1"})
        logging.getLogger("trio_pdrouter.other").addHandler(handler_)
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("trio_pdrouter.other").exception("it broke")
    finally:
        access.removeHandler(handler_)
        access.setLevel(logging.NOTSET)
        logging.getLogger("trio_pdrouter.other").removeHandler(handler_)
    first, second = (orjson.loads(line) for line in stream.getvalue().splitlines())
    assert list(first)[:4] == ["ts", "level", "logger", "message"]
    when = datetime.datetime.fromisoformat(first["ts"].replace("Z", "+00:00"))
    assert when.utcoffset() == datetime.timedelta(0) and first["ts"].endswith("Z")
    assert (first["level"], first["logger"], first["message"]) == (
        "info",
        "trio_pdrouter.access",
        "access",
    )
    assert list(first)[4:] == [*FIELDS[:12], *FIELDS[12:], *OPTIONAL]
    assert (first["request_id"], first["status"], first["stream"]) == ("j1", 200, False)
    assert (first["prompt_tokens"], first["completion_tokens"], first["cause"]) == (4, 1, None)
    assert isinstance(first["total_ms"], float)
    assert (second["level"], second["message"]) == ("error", "it broke")
    assert "ValueError: boom" in second["exception"]


def test_the_command_line_logs_json_lines() -> None:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "trio_pdrouter", "--port", "0", "--log-format", "json"),
            *("--worker-urls", "http://127.0.0.1:9", "--worker-startup-timeout-secs", "0.3"),
            *("--worker-startup-check-interval", "0.1", "--engine-metrics-interval", "0"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    *lines, last = done.stderr.strip().splitlines()
    assert last.startswith("trio-pdrouter: 1 server(s) did not become healthy")
    objects = [orjson.loads(line) for line in lines]
    assert objects and all(list(o)[:4] == ["ts", "level", "logger", "message"] for o in objects)
    assert any(o["message"].startswith("bound=http://127.0.0.1:") for o in objects)
