"""Tenants through the app: a tenant's key lets it in and names it, its limits answer 429 with
Retry-After, the engines never see a router key, and the metrics count per tenant."""

from __future__ import annotations

from pathlib import Path

import attrs
import httpx
import orjson
import trio
from prometheus_client import generate_latest

from tests.harness import PREFILL_ANSWER, call, json_response, make_app, pd_config
from trio_pdrouter.config import AdmissionSettings, RouterConfig

ASK = {"model": "m", "prompt": "hello there", "max_tokens": 8}
FILE = """
[tenants.alice]
keys = ["sk-alice"]
max_concurrent_requests = 1

[tenants.bob]
keys = ["sk-bob"]
"""


async def handler(request: httpx.Request) -> httpx.Response:
    if request.url.port == 8100:
        return json_response(PREFILL_ANSWER)
    return json_response(
        {"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    )


def config(tmp_path: Path, **admission: object) -> RouterConfig:
    path = tmp_path / "tenants.toml"
    path.write_text(FILE)
    settings = attrs.evolve(AdmissionSettings(), tenants_file=str(path), **admission)
    return pd_config(admission=settings)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_a_tenants_key_lets_it_in_and_any_other_key_is_refused(
    background: trio.Nursery, tmp_path: Path
) -> None:
    app, upstream = make_app(config(tmp_path), handler, background)
    assert (await call(app, "POST", "/v1/completions", ASK)).status == 401
    bad = await call(app, "POST", "/v1/completions", ASK, headers=bearer("sk-carol"))
    assert bad.status == 401 and not upstream.requests
    good = await call(app, "POST", "/v1/completions", ASK, headers=bearer("sk-bob"))
    assert good.status == 200
    assert all("authorization" not in r.headers for r in upstream.requests)
    # Counted 3 + 8 tokens at admission; the answer's usage says 5: bob is charged 5.
    assert app.tenants.served("bob") == 5 * 1000
    assert (await call(app, "GET", "/health")).status == 200  # open routes stay open


async def test_a_tenant_at_its_limit_gets_429_with_retry_after_and_others_pass(
    background: trio.Nursery, tmp_path: Path
) -> None:
    gate = trio.Event()

    async def slow(request: httpx.Request) -> httpx.Response:
        if request.url.port == 8200 and orjson.loads(request.content).get("user") == "wait":
            await gate.wait()
        return await handler(request)

    app, _ = make_app(config(tmp_path), slow, background)
    answers = {}

    async def first() -> None:
        answers["first"] = await call(
            app, "POST", "/v1/completions", {**ASK, "user": "wait"}, headers=bearer("sk-alice")
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await trio.testing.wait_all_tasks_blocked()
        second = await call(app, "POST", "/v1/completions", ASK, headers=bearer("sk-alice"))
        assert second.status == 429 and second.headers["retry-after"] == "1"
        assert "alice" in second.json()["error"]["message"]
        other = await call(app, "POST", "/v1/completions", ASK, headers=bearer("sk-bob"))
        assert other.status == 200
        gate.set()
    assert answers["first"].status == 200
    text = generate_latest(app.metrics.registry).decode()
    rejections = 'trio_pdrouter_tenant_rejections_total{reason="tenant_concurrency",tenant="alice"}'
    assert f"{rejections} 1.0" in text
    assert 'trio_pdrouter_tenant_requests_total{tenant="alice"} 2.0' in text
    assert 'trio_pdrouter_tenant_tokens_total{kind="used",tenant="bob"} 5.0' in text
    assert 'trio_pdrouter_tenant_queue_wait_seconds_count{tenant="bob"} 1.0' in text


async def test_a_trusted_gateways_header_names_the_tenant(
    background: trio.Nursery, tmp_path: Path
) -> None:
    app, _ = make_app(config(tmp_path, tenant_header="X-Tenant"), handler, background)
    named = {**bearer("sk-bob"), "x-tenant": "alice"}
    await call(app, "POST", "/v1/completions", ASK, headers=named)
    await call(app, "POST", "/v1/completions", ASK, headers={**bearer("sk-bob"), "x-tenant": "zed"})
    text = generate_latest(app.metrics.registry).decode()
    assert 'trio_pdrouter_tenant_requests_total{tenant="alice"} 1.0' in text
    assert 'trio_pdrouter_tenant_requests_total{tenant="default"} 1.0' in text
    assert 'tenant="zed"' not in text and 'tenant="bob"' not in text
