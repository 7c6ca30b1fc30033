"""The prefix tree keeps only prompts an engine accepted, through the whole app."""

from __future__ import annotations

import httpx
import pytest
import trio

from tests.harness import (
    PREFILL_ANSWER,
    Exchange,
    ScriptedBody,
    call,
    json_response,
    make_app,
    pd_config,
    streaming,
)
from trio_pdrouter.app import RouterApp
from trio_pdrouter.config import RouterConfig
from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.ledger import LoadLedger
from trio_pdrouter.routing import (
    CacheAware,
    NoHealthyEndpoint,
    PolicySettings,
    Routing,
    RoutingKey,
    make_policy,
)

DECODES = ("http://decode-a:8200", "http://decode-b:8200")
REFUSAL = {"error": {"message": "no", "type": "BadRequestError", "param": None, "code": 400}}


def config() -> RouterConfig:
    return pd_config(decode_urls=DECODES, policy="cache_aware", expose_routing_headers=True)


def tree_of(app: RouterApp, role: Role) -> CacheAware:
    policy = app.routing._policies[role]
    assert isinstance(policy, CacheAware)
    return policy


def owned(app: RouterApp, role: Role) -> dict[str, int]:
    """Bytes of the tree per endpoint of ``role``."""
    tree = tree_of(app, role).tree
    return {ep.key: tree.tenant_bytes(ep) for ep in app.routing.endpoints(role)}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_decode_refused_leaves_the_decode_tree(
    background: trio.Nursery, stream: bool
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        return json_response(REFUSAL, status=400)

    app, _ = make_app(config(), handler, background)
    accepted = "accepted by prefill " * 10
    assert (await call(app, "POST", "/v1/completions", {"prompt": accepted})).status == 400
    assert sum(owned(app, Role.DECODE).values()) == 0  # decode refused: its insert went back
    assert sum(owned(app, Role.PREFILL).values()) == len(accepted)  # prefill computed it
    text = "refused prompt é" * 50  # counted in bytes
    body = {"prompt": text, "max_tokens": 2, "stream": stream}
    assert (await call(app, "POST", "/v1/completions", body)).status == 400
    assert sum(owned(app, Role.DECODE).values()) == 0
    assert sum(owned(app, Role.PREFILL).values()) == len(accepted) + len(text.encode())
    tree_of(app, Role.DECODE).tree._check_invariants()


async def test_a_prompt_prefill_refused_leaves_both_trees(background: trio.Nursery) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return json_response(REFUSAL, status=400)

    app, upstream = make_app(config(), handler, background)
    ex = await call(app, "POST", "/v1/completions", {"prompt": "p" * 300, "max_tokens": 2})
    assert ex.status == 400
    assert len(upstream.requests) == 1  # decode was never sent anything
    assert sum(owned(app, Role.PREFILL).values()) == 0
    assert sum(owned(app, Role.DECODE).values()) == 0


async def test_an_accepted_prompt_stays(background: trio.Nursery) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        return json_response({"choices": [{"text": "ok"}]})

    app, _ = make_app(config(), handler, background)
    ex = await call(app, "POST", "/v1/completions", {"prompt": "a" * 300, "max_tokens": 2})
    assert ex.status == 200
    assert sorted(owned(app, Role.DECODE).values()) == [0, 300]  # the chosen one only
    assert sum(owned(app, Role.PREFILL).values()) == 300


async def test_concurrent_requests_with_one_prefix_follow_the_first(
    background: trio.Nursery,
) -> None:
    bodies: list[ScriptedBody] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        response, body = streaming()
        bodies.append(body)
        return response

    app, _ = make_app(config(), handler, background)
    prompt = {"prompt": "shared system prompt " * 20, "max_tokens": 2, "stream": True}
    exchanges = [Exchange() for _ in range(3)]

    async def client(ex: Exchange) -> None:
        await call(app, "POST", "/v1/completions", prompt, exchange=ex)

    async with trio.open_nursery() as clients:
        for ex in exchanges:
            clients.start_soon(client, ex)
            await ex.started.wait()  # each one's decode is streaming; none has finished
        decodes = {ex.headers["x-trio-pdrouter-decode"] for ex in exchanges}
        assert len(decodes) == 1
        for body in bodies:
            body.push(b'data: {"choices":[{"text":"hi"}]}\n\ndata: [DONE]\n\n')
            body.end()


def test_a_request_no_decode_can_take_leaves_the_prefill_tree() -> None:
    settings = PolicySettings()
    policies = {
        role: make_policy(
            "cache_aware", stage=role.value, settings=settings, on_decision=lambda *_: None
        )
        for role in (Role.PREFILL, Role.DECODE)
    }
    prefill = Endpoint("http://p:1", Role.PREFILL, 0)
    routing = Routing(policies, LoadLedger([prefill]), (), None, by_tokens=(), models=None)
    routing.set_endpoints(Role.PREFILL, [prefill])
    with pytest.raises(NoHealthyEndpoint):
        routing.lease_pd(RoutingKey("never sent " * 10))
    prefill_tree = policies[Role.PREFILL]
    assert isinstance(prefill_tree, CacheAware)
    assert prefill_tree.tree.tenant_bytes(prefill) == 0
