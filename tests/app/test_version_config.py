"""``GET /version`` and ``GET /admin/config`` against a router over real simulators."""

from __future__ import annotations

import trio

from tests.cluster import start_cluster
from tests.test_cli_launch import _free_port as free_port
from trio_pdrouter import __version__
from trio_pdrouter.config import REDACTED


async def test_version_names_the_router_and_each_engines_own_version() -> None:
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery, admin_from_loopback=True)
        resp = await c.client.get(c.url + "/version")
        assert resp.status_code == 200
        body = resp.json()
        assert body["name"] == "trio-pdrouter" and body["version"] == __version__
        sims = [
            (await c.client.get(s.url + "/version")).json()["version"]
            for s in [*c.prefill, *c.decode]
        ]
        assert body["engine_versions"] == {sims[0]: len(sims)} and len(set(sims)) == 1
        assert body["engines_unanswered"] == 0
        assert not any(s.url.split("//")[1] in resp.text for s in [*c.prefill, *c.decode])
        down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        added = await c.client.post(c.url + "/workers", json={"url": down, "role": "decode"})
        assert added.status_code == 201
        body = (await c.client.get(c.url + "/version")).json()
        assert body["engines_unanswered"] == 1  # did not answer: counted, never a failure
        nursery.cancel_scope.cancel()


async def test_admin_config_shows_effective_flags_with_secrets_redacted() -> None:
    async with trio.open_nursery() as nursery:
        c = await start_cluster(
            nursery,
            api_key="router-secret",
            admin_api_key="admin-secret",
            upstream_api_key="engine-secret",
            policy="power_of_two",
        )
        assert (await c.client.get(c.url + "/admin/config")).status_code == 401
        client = {"authorization": "Bearer router-secret"}
        assert (await c.client.get(c.url + "/admin/config", headers=client)).status_code == 401
        admin = {"authorization": "Bearer admin-secret"}
        resp = await c.client.get(c.url + "/admin/config", headers=admin)
        assert resp.status_code == 200
        flags = resp.json()["flags"]
        assert flags["--policy"] == "power_of_two"
        assert flags["--prefill"] == [s.url for s in c.prefill]
        assert flags["--api-key"] == REDACTED and flags["--upstream-api-key"] == REDACTED
        assert flags["--admin-api-key"] == REDACTED
        assert "secret" not in resp.text
        assert "--vllm-discovery-address" not in flags  # refused flags are left out
        assert (await c.client.get(c.url + "/version")).status_code == 401
        assert (await c.client.get(c.url + "/version", headers=client)).status_code == 200
        nursery.cancel_scope.cancel()
