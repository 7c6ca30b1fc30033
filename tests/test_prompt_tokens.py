"""Token ids for kv_aware: one /tokenize call per new prompt, cached, never failing a request."""

from __future__ import annotations

import httpx
import orjson

from trio_pdrouter.policies import RoutingKey
from trio_pdrouter.prompt_tokens import PromptTokens, tokenize_request
from trio_pdrouter.upstream import LegClient


def tokens_for(calls: list[dict[str, object]], status: int = 200) -> PromptTokens:
    async def handler(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        calls.append(body)
        return httpx.Response(status, json={"count": 3, "tokens": [1, 2, 3]})

    client = LegClient(transport=httpx.MockTransport(handler))
    return PromptTokens(client, lambda: ["http://e:1"])


async def test_a_text_prompt_is_tokenized_once_then_cached() -> None:
    calls: list[dict[str, object]] = []
    tokens = tokens_for(calls)
    key = RoutingKey(text="hello")
    for _ in range(3):
        assert (await tokens.key_with_tokens({"prompt": "hello"}, key)).tokens == (1, 2, 3)
    assert calls == [{"prompt": "hello"}]


async def test_a_chat_sends_its_template_fields() -> None:
    calls: list[dict[str, object]] = []
    tokens = tokens_for(calls)
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"enable_thinking": False},
        "temperature": 0.2,
    }
    assert (await tokens.key_with_tokens(body, RoutingKey())).tokens == (1, 2, 3)
    assert calls == [
        {"messages": body["messages"], "chat_template_kwargs": {"enable_thinking": False}}
    ]


async def test_failures_and_token_prompts_leave_the_key_alone() -> None:
    calls: list[dict[str, object]] = []
    failing = tokens_for(calls, status=500)
    key = RoutingKey(text="x")
    assert (await failing.key_with_tokens({"prompt": "x"}, key)) is key
    assert failing.failures == 1
    given = RoutingKey(tokens=(9, 9))
    assert (await failing.key_with_tokens({"prompt": [9, 9]}, given)) is given
    unused = LegClient(transport=httpx.MockTransport(lambda r: httpx.Response(500)))
    nobody = PromptTokens(unused, lambda: [])
    assert (await nobody.key_with_tokens({"prompt": "x"}, key)) is key
    assert tokenize_request({"input": "responses api"}) is None


async def test_each_call_carries_the_upstream_api_key_and_json_type() -> None:
    seen: list[tuple[str, str | None, str | None]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(
            (
                str(request.url),
                request.headers.get("authorization"),
                request.headers.get("content-type"),
            )
        )
        return httpx.Response(200, json={"count": 1, "tokens": [4]})

    client = LegClient(transport=httpx.MockTransport(handler))
    tokens = PromptTokens(client, lambda: ["http://e:1"], api_key="sk-1")
    assert (await tokens.key_with_tokens({"prompt": "a"}, RoutingKey(text="a"))).tokens == (4,)
    assert await tokens.count({"prompt": "b"}) == 1
    assert seen == [("http://e:1/tokenize", "Bearer sk-1", "application/json")] * 2
