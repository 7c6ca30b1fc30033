"""The start-up wait for the configured servers, and its timeout."""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx
import pytest
import trio
import trio.testing

from trio_pdrouter.config import HealthSettings
from trio_pdrouter.fleet import StartupTimeout, wait_until_healthy

SETTINGS = HealthSettings(startup_timeout_secs=60, startup_check_interval=5)


def _client(healthy_after: dict[str, int], probes: dict[str, int]) -> httpx.AsyncClient:
    """Each server answers 503 to its first ``healthy_after[host]`` probes, then 200."""

    async def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        probes[host] = probes.get(host, 0) + 1
        assert request.url.path == "/health"
        return httpx.Response(200 if probes[host] > healthy_after[host] else 503)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def test_start_waits_until_every_server_is_healthy(
    autojump_clock: trio.testing.MockClock,
) -> None:
    probes: dict[str, int] = {}
    started = trio.current_time()
    async with _client({"a": 0, "b": 3}, probes) as client:
        await wait_until_healthy(client, ["http://a:1", "http://b:1"], SETTINGS)
    assert probes == {"a": 1, "b": 4}, "a healthy server is not probed again"
    assert trio.current_time() - started == pytest.approx(3 * 5)


async def test_servers_not_healthy_in_time_are_named(
    autojump_clock: trio.testing.MockClock,
) -> None:
    probes: dict[str, int] = {}
    async with _client({"a": 0, "b": 1000}, probes) as client:
        with pytest.raises(StartupTimeout) as info:
            await wait_until_healthy(client, ["http://a:1", "http://b:1"], SETTINGS)
    assert info.value.unready == ["http://b:1"]
    assert "did not become healthy within 60s" in str(info.value)
    assert probes["b"] == 12  # at 0, 5, ..., 55 s: the deadline comes before a 13th


async def test_a_zero_timeout_does_not_wait() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError("no probe without a wait")

    no_wait = HealthSettings(startup_timeout_secs=0)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        await wait_until_healthy(client, ["http://a:1"], no_wait)


def test_the_command_line_exits_1_naming_the_servers_that_never_came_up() -> None:
    with socket.socket() as sock:  # a port nothing listens on while the router waits
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        done = subprocess.run(
            [
                *(sys.executable, "-m", "trio_pdrouter", "--port", "0", "--worker-urls", url),
                *("--worker-startup-timeout-secs", "1", "--worker-startup-check-interval", "0.2"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1
    assert done.stderr.strip().endswith(
        f"trio-pdrouter: 1 server(s) did not become healthy within 1s"
        f" (--worker-startup-timeout-secs): {url}"
    )
