"""Every POST route vllm-router serves: generation routes through PD (the Responses API and
``/inference/v1/generate`` included), the others whole to one server, in both modes."""

from __future__ import annotations

import attrs
import httpx
import openai
import orjson
import pytest
import trio

from tests.cluster import start_cluster
from tests.harness import (
    KV,
    PREFILL_ANSWER,
    call,
    json_response,
    make_app,
    pd_config,
    streaming,
    total_load,
)
from trio_pdrouter.config import RouterConfig
from trio_pdrouter.http import DONE, ROUTES

NON_GENERATION = [path for path, route in ROUTES.items() if not route.split]


# -- the Responses API through PD, against simulators -------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_through_pd(stream: bool) -> None:
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery)
        body = {"model": "sim-model", "input": "Tell me", "max_output_tokens": 4, "stream": stream}
        resp = await c.client.post(c.url + "/v1/responses", json=body)
        assert resp.status_code == 200, resp.text
        if stream:
            events = [e for e in resp.content.split(b"\n\n") if e]
            types = [e.split(b"\n", 1)[0].removeprefix(b"event: ") for e in events]
            assert types[0] == b"response.created" and types[-1] == b"response.completed"
            assert types.count(b"response.output_text.delta") == 4
            assert DONE not in resp.content  # the Responses API has none, and needs none
            last = orjson.loads(events[-1].split(b"data: ", 1)[1])
            assert last["response"]["output"][0]["content"][0]["text"] == " tok0 tok1 tok2 tok3"
        else:
            answer = resp.json()
            assert answer["object"] == "response"
            assert answer["output"][0]["content"][0]["text"] == " tok0 tok1 tok2 tok3"
        decode = (await c.stats(c.decode[0]))["totals"]
        assert decode["pd_ok"] == 1 and decode["pd_missing"] == 0
        assert c.router.ledger.total() == 0
        nursery.cancel_scope.cancel()


def _openai_responses(base_url: str) -> tuple[str, str, list[str]]:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    try:
        whole = client.responses.create(model="sim-model", input="hi", max_output_tokens=3)
        streamed = ""
        types = []
        for event in client.responses.create(
            model="sim-model", input="hi", max_output_tokens=3, stream=True
        ):
            types.append(event.type)
            if event.type == "response.output_text.delta":
                streamed += event.delta
        return whole.output_text, streamed, types
    finally:
        client.close()


async def test_the_openai_client_uses_responses_through_the_router() -> None:
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery)
        whole, streamed, types = await trio.to_thread.run_sync(_openai_responses, c.url)
        assert whole == streamed == " tok0 tok1 tok2"
        assert types[-1] == "response.completed"
        assert c.router.ledger.total() == 0
        nursery.cancel_scope.cancel()


# -- the legs' shapes, in memory ----------------------------------------------------------------


async def test_responses_prefill_gets_one_output_token_and_decode_the_kv(
    background: trio.Nursery,
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        response, body = streaming()
        body.push(b'event: response.completed\ndata: {"type":"response.completed"}\n\n')
        body.end()
        return response

    app, upstream = make_app(pd_config(), handler, background)
    client_body = {"model": "m", "input": "hi", "max_output_tokens": 50, "stream": True}
    ex = await call(app, "POST", "/v1/responses", client_body)
    assert ex.status == 200 and bytes(ex.body).endswith(b'"response.completed"}\n\n')
    prefill, decode = upstream.json_of(0), upstream.json_of(1)
    assert [r.url.path for r in upstream.requests] == ["/v1/responses"] * 2
    assert prefill["max_output_tokens"] == 1 and prefill["stream"] is False
    assert "max_tokens" not in prefill
    assert decode == {**client_body, "kv_transfer_params": KV}
    assert total_load(app) == 0


async def test_generate_runs_through_pd(background: trio.Nursery) -> None:
    answer = {"choices": [{"token_ids": [7, 8]}]}

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        return json_response(answer)

    app, upstream = make_app(pd_config(), handler, background)
    client_body = {"model": "m", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 8}}
    ex = await call(app, "POST", "/inference/v1/generate", client_body)
    assert ex.status == 200 and ex.json() == answer
    prefill, decode = upstream.json_of(0), upstream.json_of(1)
    assert prefill["sampling_params"] == {"max_tokens": 1}
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert decode == {**client_body, "kv_transfer_params": KV}
    assert total_load(app) == 0


@pytest.mark.parametrize("path", NON_GENERATION)
@pytest.mark.parametrize("pd", [True, False])
async def test_non_generation_routes_go_whole_to_one_server(
    path: str, pd: bool, background: trio.Nursery
) -> None:
    answer = {"data": [{"index": 0, "score": 0.5}]}
    seen: list[dict[str, int]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(app.ledger.by_role(role))
        return httpx.Response(200, json=answer, headers={"x-engine-note": "pooled"})

    regular = RouterConfig(worker_urls=("http://worker:8000",), policy="round_robin")
    config = pd_config() if pd else regular
    role = next(r for r in config.endpoints() if r.value in ("decode", "regular"))
    app, upstream = make_app(config, handler, background)
    body = {"model": "m", "query": "q", "documents": ["a", "b"], "input": "x", "prompt": "p"}
    ex = await call(app, "POST", path, body)
    assert ex.status == 200 and ex.json() == answer
    assert ex.headers["x-engine-note"] == "pooled"
    assert [r.url.host for r in upstream.requests] == ["decode" if pd else "worker"]
    assert upstream.requests[0].url.path == path
    assert upstream.json_of(0) == body, "sent unchanged"
    assert list(seen[0].values()) == [1], "the server was charged while it worked"
    assert total_load(app) == 0


@pytest.mark.parametrize(
    ("path", "body", "missing"),
    [
        ("/v1/responses", {"model": "m"}, "input"),
        ("/inference/v1/generate", {"model": "m", "token_ids": []}, "token_ids"),
        ("/v1/rerank", {"model": "m", "documents": ["a"]}, "query"),
        ("/rerank", {"model": "m", "query": "q"}, "documents"),
    ],
)
async def test_required_fields_are_checked_before_routing(
    path: str, body: dict[str, object], missing: str, background: trio.Nursery
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError("a bad request reached an engine")

    app, _ = make_app(pd_config(), handler, background)
    ex = await call(app, "POST", path, body)
    assert ex.status == 400 and ex.json()["error"]["param"] == missing


async def test_healthcheck_is_an_alias_of_health(background: trio.Nursery) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError("no upstream call")

    config = attrs.evolve(pd_config(), api_key="secret")
    app, _ = make_app(config, handler, background)
    ex = await call(app, "GET", "/healthcheck")
    assert ex.status == 200 and ex.json() == {"status": "ok"}
