"""Token ids for kv_aware: one /tokenize call per new prompt, cached, never failing a request."""

from __future__ import annotations

import random

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from trio_pdrouter.http import LegClient
from trio_pdrouter.ledger import prompt_tokens
from trio_pdrouter.routing import (
    CUT_MARGIN_TOKENS,
    MIN_CUT_CHARS,
    PromptTokens,
    RoutingKey,
    tokenize_request,
)
from trio_pdrouter_sim.tokenizer_files import write_model_dir


def tokens_for(
    calls: list[dict[str, object]], status: int = 200, outcomes: list[str] | None = None
) -> PromptTokens:
    async def handler(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        calls.append(body)
        return httpx.Response(status, json={"count": 3, "tokens": [1, 2, 3]})

    client = LegClient(transport=httpx.MockTransport(handler))
    report = outcomes.append if outcomes is not None else lambda _o: None
    return PromptTokens(client, lambda: ["http://e:1"], on_outcome=report)


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


def answering(calls: list[dict[str, object]], ids_per_char: float = 0.25) -> LegClient:
    """An engine whose /tokenize gives one id per 1/ids_per_char characters."""

    async def handler(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        calls.append(body)
        count = int(len(str(body["prompt"])) * ids_per_char)
        return httpx.Response(200, json={"count": count, "tokens": list(range(count))})

    return LegClient(transport=httpx.MockTransport(handler))


DOC = "a shared document " * 60  # 1,080 characters


async def test_a_prompt_whose_start_was_routed_before_is_tokenized_up_to_that_start() -> None:
    calls: list[dict[str, object]] = []
    seen = {"chars": 0}
    tokens = PromptTokens(
        answering(calls), lambda: ["http://e:1"], seen=lambda _t: seen["chars"], cut_chars=32
    )
    first = DOC + "first question"
    # Nothing of it routed before: asked whole, every id known.
    whole = await tokens.key_with_tokens({"prompt": first}, RoutingKey(text=first))
    assert calls == [{"prompt": first}] and not whole.partial_tokens
    assert whole.tokens == tuple(range(len(first) // 4)) and whole.prompt_tokens == len(first) // 4
    # The router has sent the document before: the start, cut at a multiple of 32
    # characters, is asked once; the next prompts with that start find it cached.
    seen["chars"] = len(DOC) + 1
    for i in range(3):
        prompt = DOC + f"question {i}, longer than the first"
        key = await tokens.key_with_tokens({"prompt": prompt}, RoutingKey(text=prompt))
        assert key.partial_tokens
        assert key.tokens == tuple(range(1056 // 4 - CUT_MARGIN_TOKENS))
        assert key.prompt_tokens == 1056 // 4 + prompt_tokens(prompt[1056:])
    assert calls[1:] == [{"prompt": DOC[:1056]}]


async def test_short_shared_starts_repeats_and_chats_are_tokenized_whole() -> None:
    calls: list[dict[str, object]] = []
    tokens = PromptTokens(answering(calls), lambda: ["http://e:1"], seen=len, cut_chars=32)
    # The whole prompt was routed before: asked whole (then cached whole).
    for _ in range(2):
        assert not (
            await tokens.key_with_tokens({"prompt": DOC}, RoutingKey(text=DOC))
        ).partial_tokens
    short = PromptTokens(
        answering(calls), lambda: ["http://e:1"], seen=lambda _t: MIN_CUT_CHARS - 1
    )
    key = await short.key_with_tokens({"prompt": DOC}, RoutingKey(text=DOC))
    off = PromptTokens(answering(calls), lambda: ["http://e:1"], seen=len)  # the default
    again = await off.key_with_tokens({"prompt": DOC + "?"}, RoutingKey(text=DOC + "?"))
    assert not key.partial_tokens and not again.partial_tokens
    assert calls == [{"prompt": DOC}, {"prompt": DOC}, {"prompt": DOC + "?"}]


async def test_the_cache_holds_at_most_its_token_budget() -> None:
    calls: list[dict[str, object]] = []
    tokens = PromptTokens(
        answering(calls, ids_per_char=1.0), lambda: ["http://e:1"], cache_tokens=250
    )
    for prompt in ("a" * 100, "b" * 100, "c" * 100):
        await tokens.key_with_tokens({"prompt": prompt}, RoutingKey(text=prompt))
    assert tokens.cached_tokens == 200  # "a" dropped to make room for "c"
    await tokens.key_with_tokens({"prompt": "c" * 100}, RoutingKey(text="c" * 100))
    await tokens.key_with_tokens({"prompt": "a" * 100}, RoutingKey(text="a" * 100))
    assert [c["prompt"] for c in calls] == ["a" * 100, "b" * 100, "c" * 100, "a" * 100]
    big = "d" * 300  # more than the whole budget: answered, never cached
    assert (await tokens.key_with_tokens({"prompt": big}, RoutingKey(text=big))).tokens
    assert tokens.cached_tokens <= 250


WORDS = (
    "the prefix cache holds blocks of tokens routing engines answer Alpha BETA naïve don't it's"
    " co-operate 3.14 2026 http://example.org/a?b=c snake_case camelCase 日本語 emoji🙂"
).split()


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    corpus = [" ".join(random.Random(g).choices(WORDS, k=300)) for g in range(8)]
    model = write_model_dir(tmp_path_factory.mktemp("bpe"), corpus, vocab_size=600)
    return Tokenizer.from_file(str(model / "tokenizer.json"))


_PIECES = st.sampled_from([*WORDS, " ", "  ", "\n", "\n\n", ", ", ". ", "42", "é"])


@given(st.lists(_PIECES, min_size=30, max_size=200), st.floats(0.3, 1.0))
@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_a_start_less_its_margin_tokenizes_as_the_whole_prompt_begins(
    bpe: Tokenizer, pieces: list[str], where: float
) -> None:
    text = "".join(pieces)
    cut = int(len(text) * where)
    start = bpe.encode(text[:cut]).ids[:-CUT_MARGIN_TOKENS]
    assert bpe.encode(text).ids[: len(start)] == start


async def test_each_lookup_reports_where_its_ids_came_from() -> None:
    outcomes: list[str] = []
    calls: list[dict[str, object]] = []
    tokens = PromptTokens(answering(calls), lambda: ["http://e:1"], on_outcome=outcomes.append)
    for _ in range(2):
        await tokens.key_with_tokens({"prompt": DOC}, RoutingKey(text=DOC))
    failing = tokens_for(calls, status=500, outcomes=outcomes)
    await failing.key_with_tokens({"prompt": "x"}, RoutingKey(text="x"))
    assert outcomes == ["engine", "cached", "failed"]


async def test_a_named_model_is_tokenized_by_a_server_that_serves_it_and_cached_apart() -> None:
    asked: list[tuple[str, dict[str, object]]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        asked.append((request.url.host, body))
        ids = [7, 7] if body.get("model") == "beta" else [1, 2, 3]
        return httpx.Response(200, json={"count": len(ids), "tokens": ids})

    serves = {"a": {"alpha"}, "b": {"beta"}}
    tokens = PromptTokens(
        LegClient(transport=httpx.MockTransport(handler)),
        lambda: ["http://a:1", "http://b:1"],
        serving=lambda url, model: model in serves[httpx.URL(url).host],
    )
    for _ in range(2):  # the second round from the cache
        for model, ids in (("alpha", (1, 2, 3)), ("beta", (7, 7))):
            key = await tokens.key_with_tokens({"model": model, "prompt": "hi"}, RoutingKey())
            assert key.tokens == ids
    assert asked == [
        ("a", {"model": "alpha", "prompt": "hi"}),
        ("b", {"model": "beta", "prompt": "hi"}),
    ]
    # a model no server is known to serve: any server (it answers for itself)
    await tokens.key_with_tokens({"model": "gamma", "prompt": "hi"}, RoutingKey())
    assert len(asked) == 3
