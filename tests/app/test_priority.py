"""vLLM's request field ``priority``: checked as vLLM reads it, forwarded as given."""

from __future__ import annotations

import httpx
import orjson
import trio

from tests.harness import PREFILL_ANSWER, call, json_response, make_app, pd_config


async def handler(request: httpx.Request) -> httpx.Response:
    if request.url.port == 8100:
        return json_response(PREFILL_ANSWER)
    return json_response({"choices": [{"text": "ok"}]})


async def test_priority_must_be_an_integer_as_vllm_reads_it(background: trio.Nursery) -> None:
    app, upstream = make_app(pd_config(), handler, background)
    for bad in ["high", 1.5, True, None]:
        ex = await call(app, "POST", "/v1/completions", {"prompt": "x", "priority": bad})
        assert ex.status == 400 and ex.json()["error"]["param"] == "priority", bad
    assert not upstream.requests
    for good in [-10, 3.0]:
        ex = await call(app, "POST", "/v1/completions", {"prompt": "x", "priority": good})
        assert ex.status == 200, good
    sent = [orjson.loads(r.content) for r in upstream.requests]
    assert [body["priority"] for body in sent] == [-10, -10, 3.0, 3.0]  # both legs, unchanged
