"""A prompt no decode engine could hold is refused before any engine runs it."""

from __future__ import annotations

import httpx
import orjson
import pytest
import trio
import trio.testing

from tests.cluster import Cluster, start_cluster
from tests.harness import call, json_response, make_app, pd_config
from trio_pdrouter.fleet import ServedModels, ServerModels
from trio_pdrouter.http import LegClient
from trio_pdrouter.routing import RoutingKey, prompt_tokens, utf8_size
from trio_pdrouter.serve import ContextCheck
from trio_pdrouter_sim.config import SimConfig

LIMIT = 1024  # the simulators' max_model_len, in tokens (4 characters each)
GENERATION = ("/v1/completions", "/v1/chat/completions")


async def small_context_cluster(nursery: trio.Nursery) -> Cluster:
    c = await start_cluster(nursery, sim=SimConfig.fast(port=0, max_model_len=LIMIT))
    context = c.router.app.context
    assert context is not None
    await context.models.learn_due()  # what its loop does first; done here to know it is done
    assert context.bound() == LIMIT
    return c


async def received(c: Cluster) -> dict[str, int]:
    """Requests per path that reached any simulator, refused ones included."""
    out: dict[str, int] = {}
    for sim in [*c.prefill, *c.decode]:
        for path, n in (await c.stats(sim))["received"].items():
            if path in (*GENERATION, "/tokenize"):
                out[path] = out.get(path, 0) + n
    return out


async def test_a_token_prompt_over_the_limit_is_refused_before_any_engine() -> None:
    async with trio.open_nursery() as nursery:
        c = await small_context_cluster(nursery)
        body = {"model": "sim-model", "prompt": list(range(1, 1101)), "max_tokens": 8}
        resp = await c.client.post(c.url + "/v1/completions", json=body)
        assert resp.status_code == 400
        assert resp.json() == {
            "error": {
                "message": "This model's maximum context length is 1024 tokens. However, you"
                " requested 1108 tokens (1100 in the messages, 8 in the completion). Please"
                " reduce the length of the messages or completion.",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        }
        assert await received(c) == {}  # counted exactly: not even /tokenize
        assert c.router.ledger.total() == 0
        nursery.cancel_scope.cancel()


async def test_a_text_prompt_over_the_limit_is_refused_on_the_engines_count() -> None:
    async with trio.open_nursery() as nursery:
        c = await small_context_cluster(nursery)
        body = {"model": "sim-model", "prompt": "abcd" * 1100}  # 1100 tokens + 16 by default
        resp = await c.client.post(c.url + "/v1/completions", json=body)
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["message"].startswith(
            "This model's maximum context length is 1024 tokens. However, you requested 1116"
            " tokens (1100 in the messages, 16 in the completion)."
        )
        assert await received(c) == {"/tokenize": 1}
        nursery.cancel_scope.cancel()


async def test_a_chat_without_cap_is_refused_when_its_prompt_fills_the_context() -> None:
    async with trio.open_nursery() as nursery:
        c = await small_context_cluster(nursery)
        chat = {"model": "sim-model", "messages": [{"role": "user", "content": "abcd" * 1100}]}
        resp = await c.client.post(c.url + "/v1/chat/completions", json=chat)
        assert resp.status_code == 400
        assert "tokens in the messages, Please reduce" in resp.json()["error"]["message"]
        assert await received(c) == {"/tokenize": 1}
        nursery.cancel_scope.cancel()


async def test_a_prompt_far_below_the_limit_is_not_tokenized() -> None:
    async with trio.open_nursery() as nursery:
        c = await small_context_cluster(nursery)
        body = {"model": "sim-model", "prompt": "abcd" * 100, "max_tokens": 4}
        resp = await c.client.post(c.url + "/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        assert await received(c) == {"/v1/completions": 2}  # prefill and decode, no /tokenize
        nursery.cancel_scope.cancel()


async def test_a_prompt_near_the_limit_that_fits_is_served_after_one_count() -> None:
    async with trio.open_nursery() as nursery:
        c = await small_context_cluster(nursery)
        # 1000 tokens + 24 = the whole context: its bytes could not fit, the engine's count does
        body = {"model": "sim-model", "prompt": "abcd" * 1000, "max_tokens": 24}
        resp = await c.client.post(c.url + "/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        assert await received(c) == {"/tokenize": 1, "/v1/completions": 2}
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("tokenize", ["status", "shape", "unreachable"])
async def test_a_failing_count_lets_the_request_through(
    background: trio.Nursery, tokenize: str
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return json_response({"data": [{"id": "m", "max_model_len": 16}]})
        if request.url.path == "/tokenize":
            if tokenize == "unreachable":
                raise httpx.ConnectError("refused", request=request)
            if tokenize == "shape":
                return json_response({"tokens": [1] * 100, "count": 100})
            return json_response({"error": "down"}, status=500)
        return json_response({"choices": [{"text": "x"}]}, status=400)

    app, upstream = make_app(pd_config(), handler, background)
    assert app.context is not None
    await app.context.models.learn_due()
    assert app.context.bound() == 16
    ex = await call(app, "POST", "/v1/completions", {"prompt": "x" * 400})
    paths = [r.url.path for r in upstream.requests]
    assert paths.count("/tokenize") == 1
    assert "/v1/completions" in paths  # the engine decides (and here refuses)
    assert ex.status == 400


async def test_the_check_can_be_turned_off(background: trio.Nursery) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return json_response({})

    app, _ = make_app(pd_config(check_context_length=False), handler, background)
    assert app.context is None


# -- the parts -------------------------------------------------------------------------------


def served(limits: dict[str, int | None]) -> ServedModels:
    """What the servers serve: one model each, with its limit (None: never read)."""
    known = ServedModels(httpx.AsyncClient(), lambda: list(limits), lambda url: True)
    for url, n in limits.items():
        if n is not None:
            known._known[url] = ServerModels(({"id": "m", "max_model_len": n},))
    return known


def check(limits: dict[str, int | None]) -> ContextCheck:
    return ContextCheck(served(limits), lambda: list(limits), None)


def test_the_bound_is_the_largest_candidates_and_only_when_all_are_known() -> None:
    assert check({"a": 100, "b": 300}).bound() == 300
    assert check({"a": 100, "b": None}).bound() is None
    assert check({}).bound() is None


async def test_the_bound_is_among_the_servers_of_the_requests_model() -> None:
    models = served({"a": 100, "b": 300})
    models._known["a"] = ServerModels(({"id": "small", "max_model_len": 100},))
    c = ContextCheck(models, lambda: ["a", "b"], None)
    assert c.bound("small") == 100 and c.bound("m") == 300 and c.bound() == 300
    assert c.bound("other") == 300  # served by none known: every candidate counts
    key = RoutingKey(tokens=tuple(range(200)), model="small")
    refused = await c.refusal("/v1/completions", {"max_tokens": 50}, key)
    assert refused is not None and "maximum context length is 100 tokens" in refused.message


async def test_a_prompt_one_candidate_could_hold_is_not_refused() -> None:
    c = check({"a": 100, "b": 300})
    key = RoutingKey(tokens=tuple(range(200)))
    assert await c.refusal("/v1/completions", {"max_tokens": 50}, key) is None
    refused = await c.refusal("/v1/completions", {"max_tokens": 101}, key)
    assert refused is not None and "requested 301 tokens" in refused.message


async def test_other_routes_and_unknown_limits_refuse_nothing() -> None:
    key = RoutingKey(tokens=tuple(range(500)))
    assert await check({"a": 100}).refusal("/v1/embeddings", {}, key) is None
    assert await check({"a": None}).refusal("/v1/completions", {}, key) is None


@pytest.mark.parametrize("text", ["", "abc", "é" * 10, "日本" * 3, "x" * 5 + "\U0001f600"])
def test_utf8_size(text: str) -> None:
    assert utf8_size(text) == len(text.encode())


def test_utf8_bytes_of_a_long_text_in_slices() -> None:
    text = "é" * (3 << 20) + "a"
    assert utf8_size(text) == 2 * (3 << 20) + 1


@pytest.mark.parametrize(
    "request_body",
    [
        {"prompt": 'a"b\\c\nd\te\x01 é 日本 \U0001f600 ' * 7},
        {"prompt": ""},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "hi"}], "prompt": "x"},
        {"model": "sql-lora", "prompt": 'a"b\\c é ' * 9},
        {"model": 3, "prompt": "x"},
    ],
)
async def test_a_count_sends_the_same_json_in_slices(
    monkeypatch: pytest.MonkeyPatch, request_body: dict[str, object]
) -> None:
    monkeypatch.setattr(prompt_tokens, "SLICE_CHARS", 5)
    sent = b"".join([part async for part in prompt_tokens._json_in_slices(request_body)])
    assert orjson.loads(sent) == request_body
    assert sent == orjson.dumps(request_body)


async def test_ids_of_a_prompts_start_only_are_not_its_count() -> None:
    async def engine(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"count": 400, "tokens": list(range(400))})

    counter = prompt_tokens.PromptTokens(
        LegClient(transport=httpx.MockTransport(engine)), lambda: ["http://e:1"]
    )
    c = ContextCheck(served({"a": 300}), lambda: ["a"], counter)
    text = "x" * 2000
    # kv_aware knew the ids of the first 50 tokens only: the engine's count decides.
    key = RoutingKey(text=text, tokens=tuple(range(50)), partial_tokens=True)
    refused = await c.refusal("/v1/completions", {"prompt": text, "max_tokens": 10}, key)
    assert refused is not None and "requested 410 tokens" in refused.message
