"""The router against real simulators over 127.0.0.1: a PD request end to end."""

from __future__ import annotations

import httpx
import orjson
import pytest
import trio

from tests.cluster import eventually, held_streams, start_cluster
from trio_pdrouter.config import HealthSettings
from trio_pdrouter_sim.config import SimConfig

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "Say hello " * 20}]}
COMPLETION = {"model": "sim-model", "prompt": "Once upon a time " * 20}


def sse_events(body: bytes) -> list[bytes]:
    return [e for e in body.split(b"\n\n") if e]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [True, False])
async def test_pd_roundtrip_pulls_kv_on_decode(route: str, stream: bool) -> None:
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery)
        body = {
            **(CHAT if "chat" in route else COMPLETION),
            "max_tokens": 12,
            "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        }
        resp = await c.client.post(c.url + route, json=body)
        assert resp.status_code == 200, resp.text
        if stream:
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = sse_events(resp.content)
            assert events[-1] == b"data: [DONE]"
            usage = orjson.loads(events[-2][len(b"data: ") :])
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
        else:
            answer = resp.json()
            assert answer["usage"]["completion_tokens"] == 12
        decode = (await c.stats(c.decode[0]))["totals"]
        prefill = (await c.stats(c.prefill[0]))["totals"]
        assert decode["pd_ok"] == 1 and decode["pd_missing"] == 0
        assert prefill["completed"] == 1
        assert c.router.ledger.total() == 0
        nursery.cancel_scope.cancel()


async def test_dp_rank_header_reaches_the_chosen_engine() -> None:
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery, dp_size=4, expose_routing_headers=True)
        for _ in range(8):
            resp = await c.client.post(
                c.url + "/v1/completions", json={**COMPLETION, "max_tokens": 2}
            )
            assert resp.status_code == 200
            rank = int(resp.headers["x-trio-pdrouter-decode"].rsplit("@", 1)[1])
            assert 0 <= rank < 4
        engines = (await c.stats(c.decode[0]))["engines"]
        # round_robin over 4 ranks: each engine got exactly its two requests.
        assert [e["requests"] for e in engines] == [2, 2, 2, 2]
        assert [e["pd_ok"] for e in engines] == [2, 2, 2, 2]
        nursery.cancel_scope.cancel()


async def test_client_disconnect_mid_stream_aborts_the_engine_and_releases_load() -> None:
    slow = SimConfig(port=0, itl_base_s=0.02, prefill_base_s=0.0, prefill_per_token_s=0.0)
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery, sim=slow)
        body = {**COMPLETION, "max_tokens": 5000, "stream": True}
        async with c.client.stream("POST", c.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for _chunk in resp.aiter_raw():
                break  # one chunk arrived: the engine is generating
            assert (await c.get_loads())["decode"] == {c.decode[0].url: 1}
        # Leaving the block closed our connection mid-stream.

        async def engine_aborted() -> bool:
            totals = (await c.stats(c.decode[0]))["totals"]
            return bool(totals["aborted"] == 1 and totals["running"] == 0)

        await eventually(engine_aborted)
        await eventually(c.all_idle)
        loads = await c.get_loads()
        assert {role: loads[role] for role in ("prefill", "decode")} == {
            "prefill": {c.prefill[0].url: 0},
            "decode": {c.decode[0].url: 0},
        }
        nursery.cancel_scope.cancel()


async def test_prefill_4xx_is_passed_through() -> None:
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery)
        resp = await c.client.post(c.url + "/v1/completions", json={**COMPLETION, "max_tokens": -5})
        assert resp.status_code == 400
        assert resp.json()["error"]["code"] == 400
        assert (await c.stats(c.decode[0]))["totals"]["requests"] == 0
        assert c.router.ledger.total() == 0
        nursery.cancel_scope.cancel()


async def test_prefill_5xx_reaches_the_client_as_the_engine_sent_it() -> None:
    async with trio.open_nursery() as nursery:
        c = await start_cluster(
            nursery, prefill_sim=SimConfig.fast(port=0, role="prefill", faults=("error:503",))
        )
        resp = await c.client.post(c.url + "/v1/completions", json=COMPLETION)
        assert resp.status_code == 503
        error = resp.json()["error"]
        assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
        assert error["message"] == "simulated fault: HTTP 503"
        assert c.router.ledger.total() == 0
        nursery.cancel_scope.cancel()


async def test_prefill_connection_refused_becomes_502() -> None:
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery)
        c.prefill[0].down()
        await eventually(lambda: _refused(c.prefill[0].url))
        resp = await c.client.post(
            c.url + "/v1/completions", json=COMPLETION, headers={"x-request-id": "r-502"}
        )
        assert resp.status_code == 502
        message = resp.json()["error"]["message"]
        assert message == "the prefill upstream could not be reached (request id r-502)"
        assert c.router.ledger.total() == 0
        nursery.cancel_scope.cancel()


async def _refused(url: str) -> bool:
    try:
        async with httpx.AsyncClient() as client:
            await client.get(url + "/health")
    except httpx.ConnectError:
        return True
    return False


async def test_decode_reset_mid_stream_gives_error_event_and_done() -> None:
    async with trio.open_nursery() as nursery:
        decode = SimConfig.fast(port=0, role="decode", faults=("reset:3",))
        c = await start_cluster(nursery, decode_sim=decode)
        resp = await c.client.post(
            c.url + "/v1/completions", json={**COMPLETION, "max_tokens": 50, "stream": True}
        )
        assert resp.status_code == 200
        events = sse_events(resp.content)
        assert events[-1] == b"data: [DONE]"
        error = orjson.loads(events[-2][len(b"data: ") :])
        assert error["error"]["code"] == 502
        tokens = [e for e in events[:-2] if b'"text"' in e]
        assert len(tokens) == 3
        await eventually(c.all_idle)
        nursery.cancel_scope.cancel()


async def test_logprobs_echo_merge_on_real_answers() -> None:
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery)
        body = {
            **COMPLETION,
            "prompt": "alpha beta gamma delta",
            "max_tokens": 3,
            "echo": True,
            "logprobs": 1,
            "prompt_logprobs": 1,
        }
        resp = await c.client.post(c.url + "/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        lp = answer["choices"][0]["logprobs"]
        # vLLM puts a completion's prompt_logprobs on the choice: one entry per prompt token.
        prompt_tokens = answer["usage"]["prompt_tokens"]
        assert len(answer["choices"][0]["prompt_logprobs"]) == prompt_tokens
        # Prompt tokens first (from prefill), then the three generated by decode.
        assert len(lp["tokens"]) == answer["usage"]["prompt_tokens"] + 3
        assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["text_offset"])
        assert lp["text_offset"] == sorted(lp["text_offset"])
        nursery.cancel_scope.cancel()


async def test_openai_client_streams_through_the_router() -> None:
    import openai

    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery)

        def run_client() -> str:
            client = openai.OpenAI(base_url=c.url + "/v1", api_key="unused")
            parts = []
            stream = client.chat.completions.create(
                model="sim-model",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
            return "".join(parts)

        text = await trio.to_thread.run_sync(run_client)
        assert text
        nursery.cancel_scope.cancel()


async def test_get_loads_matches_engines_during_50_streams() -> None:
    sim = SimConfig(port=0, itl_base_s=0.01, prefill_base_s=0.0, prefill_per_token_s=0.0)
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery, sim=sim, dp_size=2, n_decode=2, client_connections=200)
        body = {**COMPLETION, "max_tokens": 400, "stream": True}
        async with held_streams(c, 50, body):
            loads = await c.get_loads()
            truth: dict[str, int] = {}
            for sim_server in c.decode:
                for engine in (await c.stats(sim_server))["engines"]:
                    truth[f"{sim_server.url}@{engine['rank']}"] = (
                        engine["running"] + engine["waiting"]
                    )
            assert sum(loads["decode"].values()) == 50
            for key, n in loads["decode"].items():
                assert abs(n - truth[key]) <= 1, (key, n, truth[key])
        await eventually(c.all_idle, timeout=20)
        loads = await c.get_loads()
        assert all(n == 0 for role in ("prefill", "decode") for n in loads[role].values())
        nursery.cancel_scope.cancel()


async def test_oversized_request_headers_are_refused_before_the_app() -> None:
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery)
        host, port = c.url.split("//")[1].split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        request = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nX-Big: " + b"a" * 200_000
        await stream.send_all(request + b"\r\nContent-Length: 2\r\n\r\n{}")
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 431")
        await stream.aclose()
        assert (await c.stats(c.decode[0]))["totals"]["requests"] == 0
        assert c.router.ledger.total() == 0
        nursery.cancel_scope.cancel()


async def test_models_come_from_the_servers_routable_now_never_a_500() -> None:
    health = HealthSettings(
        interval_secs=0.05, timeout_secs=2.0, failure_threshold=1, success_threshold=1
    )
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery, n_decode=2, health=health)
        c.decode[0].down()
        await eventually(lambda: _refused(c.decode[0].url))
        resp = await c.client.get(c.url + "/v1/models")
        assert resp.status_code == 200
        assert resp.json()["data"][0]["id"] == "sim-model"
        for sim in [c.decode[1], *c.prefill]:
            sim.down()
            await eventually(lambda sim=sim: _refused(sim.url))

        async def none_routable() -> bool:
            return not any(
                c.router.app.routing.candidates(role) for role in c.router.app.routing.roles
            )

        await eventually(none_routable)  # the probes saw them all go
        resp = await c.client.get(c.url + "/v1/models")
        assert resp.status_code == 503
        assert resp.json()["error"]["type"] == "service_unavailable"
        nursery.cancel_scope.cancel()
