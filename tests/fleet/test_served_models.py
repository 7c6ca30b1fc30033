"""What each server serves, learnt from its model list: kept, refreshed, and what routing makes
of it."""

from __future__ import annotations

import itertools
import logging

import httpx
import pytest
import trio
import trio.testing

from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.fleet import ServedModels, ServerModels

BASE = {"id": "llama", "root": "/m/llama", "parent": None, "max_model_len": 4096}
ADAPTER = {"id": "sql-lora", "root": "/a/sql", "parent": "llama", "max_model_len": None}
OTHER = {"id": "qwen", "root": "/m/qwen", "parent": None, "max_model_len": 8192}


def models(*cards: dict[str, object]) -> ServerModels:
    return ServerModels(tuple(dict(c) for c in cards))


def endpoints(*urls: str) -> list[Endpoint]:
    return [Endpoint(url, Role.DECODE) for url in urls]


def served(known: dict[str, ServerModels | None]) -> ServedModels:
    s = ServedModels(httpx.AsyncClient(), lambda: list(known), lambda url: True)
    s._known = {url: m for url, m in known.items() if m is not None}
    return s


def test_a_model_list_is_read_as_vllm_gives_it() -> None:
    read = ServerModels.read({"object": "list", "data": [BASE, ADAPTER, {"no": "id"}, 3]})
    assert read is not None
    assert read.ids == {"llama", "sql-lora"}
    assert read.models == ["llama"]
    assert read.adapters == {"sql-lora": "llama"}
    assert read.max_model_len == 4096  # the adapter's card has none
    assert ServerModels.read({"data": "x"}) is None
    assert ServerModels.read([BASE]) is None


def test_a_request_goes_only_to_servers_that_list_its_model() -> None:
    a, b, c = endpoints("http://a:1", "http://b:1", "http://c:1")
    s = served({a.url: models(BASE, ADAPTER), b.url: models(OTHER), c.url: None})
    assert s.serving([a, b, c], "llama") == [a]
    assert s.serving([a, b, c], "sql-lora") == [a]
    assert s.serving([a, b, c], "qwen") == [b]
    # no candidate lists it (its server is not a candidate now, or serves another stage):
    # the unknown server is assumed to (it answers for itself), never one that lists others
    assert s.serving([b, c], "llama") == [c]
    assert s.serving([b], "llama") == []
    assert s.serving([a, b, c], "mistral") == [c]
    assert not s.unserved("mistral")  # c might serve it
    assert s.unknown() == [c.url]


def test_a_model_is_unserved_only_when_every_list_is_known() -> None:
    s = served({"http://a:1": models(BASE), "http://b:1": models(OTHER)})
    assert s.unserved("mistral")
    assert not s.unserved("llama")
    assert not served({}).unserved("llama")  # no server at all: not the model's fault
    assert s.served_ids() == {"llama", "qwen"}


def test_the_union_keeps_one_card_per_id() -> None:
    s = served({"http://a:1": models(BASE, ADAPTER), "http://b:1": models(BASE, OTHER)})
    assert [card["id"] for card in s.cards(["http://a:1", "http://b:1"])] == [
        "llama",
        "sql-lora",
        "qwen",
    ]
    assert [card["id"] for card in s.cards(["http://b:1", "http://c:1"])] == ["llama", "qwen"]


async def test_lists_are_learnt_retried_with_backoff_and_relearnt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    answers: list[httpx.Response | Exception] = []
    asked: list[float] = []
    all_asked = trio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        asked.append(trio.current_time())
        answer = answers.pop(0)
        if not answers:
            all_asked.set()
        if isinstance(answer, Exception):
            raise answer
        return answer

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    s = ServedModels(client, lambda: ["http://d:1"], lambda url: True, interval_s=0)
    answers += [
        httpx.ConnectError("refused"),
        httpx.Response(200, content=b"not json"),
        httpx.Response(500, json={"error": "x"}),
        httpx.Response(200, json={"data": [BASE, {**OTHER, "max_model_len": 8192}]}),
    ]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(s.run)
        await all_asked.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert s.limit("http://d:1") == 8192  # the largest model the server lists
        # 1 s, 2 s, 4 s between the tries
        assert [round(b - a) for a, b in itertools.pairwise(asked)] == [1, 2, 4]
        all_asked = trio.Event()
        answers.append(httpx.Response(200, json={"data": [BASE, ADAPTER]}))
        s.relearn("http://d:1")
        await all_asked.wait()
        await trio.testing.wait_all_tasks_blocked()
        served_now = s.of("http://d:1")
        assert served_now is not None and served_now.adapters == {"sql-lora": "llama"}
        assert s.limit("http://d:1") == 4096
        nursery.cancel_scope.cancel()


async def test_lists_are_asked_again_on_the_schedule_and_a_failure_keeps_the_last(
    autojump_clock: trio.testing.MockClock,
) -> None:
    answers: list[httpx.Response] = [
        httpx.Response(200, json={"data": [BASE]}),
        httpx.Response(503),
        httpx.Response(200, json={"data": [BASE, ADAPTER]}),
    ]
    asked: list[float] = []
    done = trio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        asked.append(trio.current_time())
        answer = answers.pop(0)
        if not answers:
            done.set()
        return answer

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    s = ServedModels(client, lambda: ["http://d:1"], lambda url: True, interval_s=30)
    ids: list[frozenset[str]] = []

    async def watch() -> None:
        while True:
            await trio.sleep(0.5)
            known = s.of("http://d:1")
            ids.append(frozenset() if known is None else known.ids)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(s.run)
        nursery.start_soon(watch)
        await done.wait()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert [round(t) for t in asked] == [0, 30, 31]  # the schedule, then the failure's backoff
    assert frozenset({"llama"}) in ids
    # the failed ask at 30 s did not forget what the server served
    after_first = ids[ids.index(frozenset({"llama"})) :]
    assert frozenset() not in after_first
    assert s.of("http://d:1") == models(BASE, ADAPTER)


async def test_an_unhealthy_server_is_not_asked_but_keeps_its_list(
    autojump_clock: trio.testing.MockClock,
) -> None:
    asked: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url))
        return httpx.Response(200, json={"data": [BASE]})

    healthy = {"http://a:1": False}
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    s = ServedModels(client, lambda: list(healthy), lambda url: healthy[url], interval_s=30)
    s._known["http://a:1"] = models(OTHER)
    await s.learn_due()
    assert asked == [] and s.of("http://a:1") == models(OTHER)
    healthy["http://a:1"] = True
    s.relearn("http://a:1")
    await s.learn_due()
    assert asked == ["http://a:1/v1/models"] and s.of("http://a:1") == models(BASE)


async def test_an_unknown_server_is_named_in_the_log_with_what_it_is_assumed_to_serve(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    s = ServedModels(client, lambda: ["http://d:1"], lambda url: True)
    with caplog.at_level(logging.WARNING, "trio_pdrouter.models"):
        await s.learn_due()
        await trio.sleep(2)
        await s.learn_due()  # the retry: logged once, not at every failure
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "url=http://d:1 models=unknown" in lines[0]
    assert "models no candidate with a known list serves" in lines[0]
    assert s.unknown() == ["http://d:1"]


async def test_the_learning_loop_survives_a_bug(autojump_clock: trio.testing.MockClock) -> None:
    calls = 0
    again = trio.Event()

    def urls() -> list[str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug")
        again.set()
        return []

    s = ServedModels(httpx.AsyncClient(), urls, lambda url: True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(s.run)
        await again.wait()  # the pass after the one that raised
        nursery.cancel_scope.cancel()


def test_a_removed_server_is_forgotten() -> None:
    urls = {"http://a:1"}
    s = ServedModels(httpx.AsyncClient(), lambda: urls, lambda url: True)
    s._known["http://a:1"] = models(BASE)
    urls.clear()
    trio.run(s.learn_due)
    assert s.of("http://a:1") is None


async def test_a_model_nobody_lists_is_asked_about_again_before_the_404(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Another worker (or the operator, on the servers) may have loaded it since."""
    lists = {"http://a:1": [BASE]}
    asked: list[float] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        asked.append(trio.current_time())
        await trio.sleep(0.1)
        return httpx.Response(200, json={"data": lists[f"http://{request.url.netloc.decode()}"]})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    s = ServedModels(client, lambda: list(lists), lambda url: True)
    s._known["http://a:1"] = models(BASE)
    lists["http://a:1"] = [BASE, ADAPTER]  # loaded behind this process's back
    assert not await s.recheck("llama")  # listed: nothing asked
    assert asked == []
    assert not await s.recheck("sql-lora")  # asked, and now known
    assert len(asked) == 1
    results: list[bool] = []

    async def one(model: str) -> None:
        results.append(await s.recheck(model))

    await trio.sleep(5)
    async with trio.open_nursery() as nursery:  # concurrent requests share one ask
        for _ in range(3):
            nursery.start_soon(one, "gamma")
    assert results == [True] * 3 and len(asked) == 2
    assert await s.recheck("gamma")  # within a second of the last ask: not asked again
    assert len(asked) == 2
