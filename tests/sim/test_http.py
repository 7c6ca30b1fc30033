"""The simulator over real HTTP: vLLM shapes, errors, data parallelism, stats, disconnects."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import trio

from trio_pdrouter_sim import SimConfig, SimServer

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]


@asynccontextmanager
async def running_sim(**overrides: Any) -> AsyncIterator[tuple[SimServer, httpx.AsyncClient]]:
    """A fast simulator on a free port and a client for it; both gone on exit."""
    overrides.setdefault("port", 0)
    sim = SimServer(SimConfig.fast(**overrides))
    async with trio.open_nursery() as nursery:
        url = await nursery.start(sim.run)
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            yield sim, client
        nursery.cancel_scope.cancel()


def sse_events(raw: str) -> list[Any]:
    """Decode an SSE body into JSON events, with "[DONE]" kept as a string."""
    assert raw.endswith("data: [DONE]\n\n")
    out: list[Any] = []
    for block in raw.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: ")
        payload = block[len("data: ") :]
        out.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return out


async def stats(client: httpx.AsyncClient) -> dict[str, Any]:
    resp = await client.get("/sim/stats")
    assert resp.status_code == 200
    result: dict[str, Any] = resp.json()
    return result


async def wait_for(client: httpx.AsyncClient, cond: Callable[[dict[str, Any]], bool]) -> None:
    """Poll /sim/stats until ``cond`` holds (for effects outside the test's control)."""
    with trio.fail_after(5):
        while True:
            if cond(await stats(client)):
                return
            await trio.sleep(0.01)


async def test_health_models_metrics() -> None:
    async with running_sim(model="m1", dp_size=2) as (_sim, client):
        assert (await client.get("/health")).status_code == 200
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list" and models["data"][0]["id"] == "m1"
        text = (await client.get("/metrics")).text
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
        ):
            for rank in (0, 1):
                assert f'{name}{{model_name="m1",engine="{rank}"}} 0.0' in text
        assert (await client.get("/nope")).status_code == 404
        assert (await client.get("/v1/completions")).status_code == 405


async def test_completion_non_stream_with_logprobs_echo() -> None:
    async with running_sim() as (_sim, client):
        prompt = "The quick brown fox jumps"
        resp = await client.post(
            "/v1/completions",
            json={
                "model": "sim-model",
                "prompt": prompt,
                "max_tokens": 3,
                "logprobs": 2,
                "echo": True,
                "prompt_logprobs": 1,
            },
            headers={"X-Request-Id": "abc"},
        )
        assert resp.status_code == 200 and resp.headers["x-request-id"] == "abc"
        doc = resp.json()
        assert doc["id"] == "cmpl-abc" and doc["object"] == "text_completion"
        assert doc["kv_transfer_params"] is None
        choice = doc["choices"][0]
        assert choice["text"] == prompt + " tok0 tok1 tok2"
        assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
        n_prompt = doc["usage"]["prompt_tokens"]
        assert n_prompt == 7  # 25 characters, 4 per token
        assert doc["usage"] == {
            "prompt_tokens": 7,
            "total_tokens": 10,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        lp = choice["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert len(lp["tokens"]) == n_prompt + 3
        assert "".join(lp["tokens"]) == choice["text"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
        offsets = lp["text_offset"]
        assert offsets[0] == 0 and offsets[n_prompt] == len(prompt)
        plp = choice["prompt_logprobs"]
        assert plp[0] is None and len(plp) == n_prompt


async def test_completion_stream_shapes_and_usage() -> None:
    async with running_sim() as (_sim, client):
        resp = await client.post(
            "/v1/completions",
            json={
                "prompt": "hello",
                "max_tokens": 4,
                "stream": True,
                "logprobs": 1,
                "stream_options": {"include_usage": True},
            },
        )
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.text)
        assert events[-1] == "[DONE]"
        usage_event = events[-2]
        assert usage_event["choices"] == [] and usage_event["usage"]["completion_tokens"] == 4
        chunks = events[:-2]
        assert [c["choices"][0]["text"] for c in chunks] == [" tok0", " tok1", " tok2", " tok3"]
        for c in chunks:
            assert set(c) == {"id", "object", "created", "model", "choices", "usage"}
            assert c["object"] == "text_completion" and c["usage"] is None
            assert set(c["choices"][0]) == {
                "index",
                "text",
                "logprobs",
                "finish_reason",
                "stop_reason",
            }
            assert c["choices"][0]["logprobs"]["tokens"] == [c["choices"][0]["text"]]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
        assert [c["choices"][0]["logprobs"]["text_offset"][0] for c in chunks] == [0, 5, 10, 15]


async def test_chat_stream_role_first_and_usage() -> None:
    async with running_sim() as (_sim, client):
        resp = await client.post(
            "/v1/chat/completions",
            json={
                "messages": CHAT,
                "max_tokens": 3,
                "stream": True,
                "logprobs": True,
                "top_logprobs": 2,
                "stream_options": {"include_usage": True},
            },
        )
        events = sse_events(resp.text)
        first = events[0]
        assert first["object"] == "chat.completion.chunk"
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        contents = events[1:4]
        assert [e["choices"][0]["delta"] for e in contents] == [
            {"content": " tok0"},
            {"content": " tok1"},
            {"content": " tok2"},
        ]
        entry = contents[0]["choices"][0]["logprobs"]["content"][0]
        assert entry["token"] == " tok0" and len(entry["top_logprobs"]) == 2
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert contents[-1]["choices"][0]["finish_reason"] == "length"
        assert "usage" not in contents[0]
        assert events[4]["choices"] == [] and events[4]["usage"]["total_tokens"] > 3
        assert events[5] == "[DONE]"


async def test_chat_non_stream() -> None:
    async with running_sim() as (_sim, client):
        doc = (
            await client.post(
                "/v1/chat/completions",
                json={
                    "messages": CHAT,
                    "max_completion_tokens": 2,
                    "logprobs": True,
                    "prompt_logprobs": 0,
                },
            )
        ).json()
        assert doc["object"] == "chat.completion"
        msg = doc["choices"][0]["message"]
        assert msg["role"] == "assistant" and msg["content"] == " tok0 tok1"
        assert [c["token"] for c in doc["choices"][0]["logprobs"]["content"]] == [" tok0", " tok1"]
        assert doc["prompt_logprobs"][0] is None
        assert doc["usage"]["completion_tokens"] == 2
        assert "kv_transfer_params" in doc


async def test_min_tokens_and_eos() -> None:
    async with running_sim(eos_rate=1.0) as (_sim, client):
        doc = (
            await client.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 10, "min_tokens": 3}
            )
        ).json()
        assert doc["choices"][0]["finish_reason"] == "stop"
        assert doc["usage"]["completion_tokens"] == 3
        doc = (
            await client.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 10, "ignore_eos": True}
            )
        ).json()
        assert doc["usage"]["completion_tokens"] == 10


async def test_bad_requests_are_vllm_400s() -> None:
    async with running_sim(dp_size=2) as (_sim, client):
        cases: list[tuple[str, dict[str, Any]]] = [
            ("/v1/completions", {"content": b"{not json"}),
            ("/v1/completions", {"json": {"max_tokens": 3}}),
            ("/v1/chat/completions", {"json": {"max_tokens": 3}}),
            ("/v1/completions", {"json": {"prompt": "x", "max_tokens": -1}}),
            (
                "/v1/completions",
                {"json": {"prompt": "x", "stream_options": {"include_usage": True}}},
            ),
            (
                "/v1/completions",
                {"json": {"prompt": "x"}, "headers": {"X-data-parallel-rank": "2"}},
            ),
            ("/v1/completions", {"json": {"prompt": "x"}, "headers": {"x-sim-fault": "bogus"}}),
        ]
        for path, kwargs in cases:
            resp = await client.post(path, **kwargs)
            assert resp.status_code == 400, (path, kwargs)
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["type"] == "BadRequestError" and err["code"] == 400 and err["message"]
        resp = await client.post("/v1/completions", json={"prompt": "x", "model": "zz"})
        assert resp.status_code == 404
        assert (await stats(client))["totals"]["requests"] == 0


async def test_dp_rank_pinning_and_least_loaded() -> None:
    async with running_sim(dp_size=3) as (_sim, client):
        for rank in (2, 2, 0):
            resp = await client.post(
                "/v1/completions",
                json={"prompt": "x", "max_tokens": 1},
                headers={"X-data-parallel-rank": str(rank)},
            )
            assert resp.status_code == 200
        s = await stats(client)
        assert [e["requests"] for e in s["engines"]] == [1, 0, 2]

        # Three stalled requests without a rank: each goes to an idle engine.
        async def stalled() -> None:
            await client.post(
                "/v1/completions", json={"prompt": "x"}, headers={"x-sim-fault": "stall"}
            )

        async with trio.open_nursery() as nursery:
            for n in range(1, 4):
                nursery.start_soon(stalled)
                await wait_for(client, lambda s, n=n: s["totals"]["running"] == n)
            s = await stats(client)
            assert [e["running"] for e in s["engines"]] == [1, 1, 1]
            nursery.cancel_scope.cancel()
        await wait_for(client, lambda s: s["totals"]["running"] == 0)
        assert (await stats(client))["totals"]["aborted"] == 3


async def test_max_num_seqs_queues_requests() -> None:
    async with running_sim(max_num_seqs=1) as (_sim, client):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: client.post(
                    "/v1/completions", json={"prompt": "x"}, headers={"x-sim-fault": "stall"}
                )
            )
            await wait_for(client, lambda s: s["totals"]["running"] == 1)
            nursery.start_soon(lambda: client.post("/v1/completions", json={"prompt": "y"}))
            await wait_for(client, lambda s: s["totals"]["waiting"] == 1)
            text = (await client.get("/metrics")).text
            assert 'vllm:num_requests_waiting{model_name="sim-model",engine="0"} 1.0' in text
            nursery.cancel_scope.cancel()
        await wait_for(client, lambda s: s["totals"]["running"] + s["totals"]["waiting"] == 0)


async def test_prefix_cache_hits_for_shared_prefix() -> None:
    async with running_sim() as (_sim, client):
        shared = "A long shared system prompt. " * 20
        for suffix in ("first question", "second question"):
            doc = (
                await client.post(
                    "/v1/completions", json={"prompt": shared + suffix, "max_tokens": 1}
                )
            ).json()
        assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
        s = await stats(client)
        assert (
            s["totals"]["prefix_cache_hits"]
            == doc["usage"]["prompt_tokens_details"]["cached_tokens"]
        )
        assert s["totals"]["prefix_cache_queries"] > s["totals"]["prefix_cache_hits"]


async def test_disconnect_mid_stream_aborts() -> None:
    async with running_sim(itl_base_s=0.01) as (_sim, client):
        async with client.stream(
            "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 10_000, "stream": True}
        ) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    break
        await wait_for(client, lambda s: s["totals"]["aborted"] == 1)
        s = await stats(client)
        assert s["totals"]["running"] == 0 and s["totals"]["completed"] == 0
        assert s["totals"]["generation_tokens"] < 10_000


async def test_disconnect_non_stream_aborts() -> None:
    async with running_sim() as (_sim, client):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: client.post(
                    "/v1/completions", json={"prompt": "x"}, headers={"x-sim-fault": "stall"}
                )
            )
            await wait_for(client, lambda s: s["totals"]["running"] == 1)
            nursery.cancel_scope.cancel()  # closes the client's connection
        await wait_for(client, lambda s: s["totals"]["running"] == 0)
        assert (await stats(client))["totals"]["aborted"] == 1


async def test_normal_completion_is_not_an_abort() -> None:
    async with running_sim() as (_sim, client):
        for stream in (True, False):
            for _ in range(5):
                resp = await client.post(
                    "/v1/chat/completions",
                    json={"messages": CHAT, "max_tokens": 2, "stream": stream},
                )
                assert resp.status_code == 200
        s = await stats(client)
        assert s["totals"]["completed"] == 10 and s["totals"]["aborted"] == 0


async def test_stats_series_reset_and_connections() -> None:
    async with running_sim(dp_size=2) as (sim, client):
        await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        s = await stats(client)
        assert s["role"] == "both" and s["url"] == sim.url and s["model"] == "sim-model"
        assert s["series"]["interval_ms"] == 50
        assert len(s["series"]["t"]) == len(s["series"]["running"]) >= 1
        assert all(len(row) == 2 for row in s["series"]["running"])
        for key in (
            "running",
            "waiting",
            "peak_running",
            "completed",
            "aborted",
            "pd_ok",
            "pd_missing",
            "kv_blocks_held",
            "kv_blocks_leaked",
            "prefix_cache_hits",
            "prefix_cache_queries",
            "requests",
        ):
            assert key in s["totals"] and key in s["engines"][0]
        assert s["totals"]["completed"] == 1
        assert s["connections"] >= 1
        assert (await client.post("/sim/reset")).status_code == 200
        s = await stats(client)
        assert s["totals"]["completed"] == 0 and s["totals"]["requests"] == 0

        # connections: a second client's keep-alive connection is counted until it closes.
        async with httpx.AsyncClient(base_url=sim.url) as other:
            await other.get("/health")
            await wait_for(client, lambda s: s["connections"] == 2)
        await wait_for(client, lambda s: s["connections"] == 1)


async def test_lora_adapters_are_listed_served_loaded_and_unloaded() -> None:
    async with running_sim(model="base", lora_modules=("sql=/a/sql", "chat")) as (_sim, client):
        listed = (await client.get("/v1/models")).json()["data"]
        assert [(m["id"], m["parent"], m["root"]) for m in listed] == [
            ("base", None, "base"),
            ("sql", "base", "/a/sql"),
            ("chat", "base", "chat"),
        ]
        body = {"model": "sql", "prompt": "hi", "max_tokens": 2}
        answer = (await client.post("/v1/completions", json=body)).json()
        assert answer["model"] == "sql"
        missing = await client.post("/v1/completions", json={**body, "model": "new"})
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == "The model `new` does not exist."

        load = {"lora_name": "new", "lora_path": "/a/new"}
        loaded = await client.post("/v1/load_lora_adapter", json=load)
        assert loaded.status_code == 200
        assert loaded.text == "Success: LoRA adapter 'new' added successfully."
        assert "content-type" not in loaded.headers  # vLLM's plain Response
        assert (await client.post("/v1/completions", json={**body, "model": "new"})).is_success
        twice = await client.post("/v1/load_lora_adapter", json=load)
        assert twice.status_code == 400 and twice.json()["error"]["type"] == "InvalidUserInput"
        no_path = await client.post("/v1/load_lora_adapter", json={"lora_name": "x"})
        assert no_path.status_code == 400

        gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": "new"})
        assert gone.text == "Success: LoRA adapter 'new' removed successfully."
        again = await client.post("/v1/unload_lora_adapter", json={"lora_name": "new"})
        assert again.status_code == 404 and again.json()["error"]["type"] == "NotFoundError"
        assert "new" not in [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
