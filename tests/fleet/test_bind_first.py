"""Start-up binds first and tells the truth: the port is bound before the upstreams are waited
for, ``/health`` answers meanwhile, ``/readiness`` and ``/workers`` follow real probes, and an
address the router cannot listen on ends it at once with one line and exit status 2."""

from __future__ import annotations

import socket
import subprocess
import sys
from functools import partial

import httpx
import pytest
import trio

from trio_pdrouter.config import HealthSettings, RouterConfig, ServerSettings
from trio_pdrouter.http import BindError, listening_sockets
from trio_pdrouter.server import RunningRouter, run_router
from trio_pdrouter_sim.config import SimConfig
from trio_pdrouter_sim.server import SimServer


def _router(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trio_pdrouter", "--worker-urls", "http://127.0.0.1:9", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_port_in_use_is_one_line_and_exit_2(workers: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _router("--host", "127.0.0.1", "--port", str(port), "--workers", workers)
    assert done.returncode == 2
    assert done.stderr == (
        f"trio-pdrouter: cannot listen on 127.0.0.1:{port}:"
        " the address is already in use (another process listens there)\n"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--port", "99999"), "--port must be a port number, 0 to 65535"),
        (("--port", "-1"), "--port must be a port number, 0 to 65535"),
        (("--host", "no-such-host.invalid", "--port", "0"), "the host does not resolve"),
        (("--host", "192.0.2.1", "--port", "0"), "no interface of this machine has that address"),
        (("--port", "0", "--prometheus-port", "70000"), "--prometheus-port must be a port"),
    ],
)
def test_an_address_it_cannot_use_is_one_line_and_exit_2(
    args: tuple[str, ...], message: str
) -> None:
    for workers in ("1", "2"):
        done = _router(*args, "--workers", workers)
        assert done.returncode == 2, done.stderr
        assert message in done.stderr
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_the_metrics_port_in_use_is_named() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BindError, match=f"cannot listen on 127.0.0.1:{port}: the address"):
            listening_sockets("127.0.0.1", port, 16, 1, reuseport=False)
        done = _router("--port", "0", "--prometheus-port", str(port))
    assert done.returncode == 2
    assert done.stderr.startswith(
        f"trio-pdrouter: --prometheus-port: cannot listen on 127.0.0.1:{port}:"
    )


async def test_upstreams_down_at_start_health_answers_readiness_says_why(
    nursery: trio.Nursery,
) -> None:
    """Bound before any upstream answers: /health 200, /readiness 503 naming the server it
    waits for, /workers not healthy, a request 503; once the server is up, ready."""
    down = socket.socket()  # holds the upstream's port, refusing connections, until it starts
    down.bind(("127.0.0.1", 0))
    upstream_port = down.getsockname()[1]
    upstream = f"http://127.0.0.1:{upstream_port}"
    (listener,) = listening_sockets("127.0.0.1", 0, 16, 1, reuseport=False)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    config = RouterConfig(
        worker_urls=(upstream,),
        server=ServerSettings(host="127.0.0.1", port=0),
        health=HealthSettings(startup_timeout_secs=120, startup_check_interval=0.05),
    )
    ready = trio.Event()

    async def run() -> None:
        running: RunningRouter = await nursery.start(partial(run_router, config, listener=listener))
        assert running.url == url
        ready.set()

    nursery.start_soon(run)
    async with httpx.AsyncClient(timeout=30) as client:
        for path in ("/health", "/liveness"):
            assert (await client.get(url + path)).status_code == 200
        readiness = await client.get(url + "/readiness")
        assert readiness.status_code == 503
        assert readiness.json() == {"status": "starting", "waiting_for": [upstream]}
        (worker,) = (await client.get(url + "/workers")).json()["workers"]
        assert worker["healthy"] is False and worker["routable"] is False
        assert worker["health"] == "pending"
        request = {"prompt": "hi", "max_tokens": 2}
        refused = await client.post(url + "/v1/completions", json=request)
        assert refused.status_code == 503
        assert not ready.is_set()

        down.close()
        sim = SimServer(SimConfig.fast(port=upstream_port))
        await nursery.start(sim.run)
        await ready.wait()
        assert (await client.get(url + "/readiness")).json() == {"status": "ready"}
        (worker,) = (await client.get(url + "/workers")).json()["workers"]
        assert worker["healthy"] is True and worker["health"] == "healthy"
        assert (await client.post(url + "/v1/completions", json=request)).status_code == 200
    listener.close()  # the router serves its own copy of it
    nursery.cancel_scope.cancel()


async def test_without_a_start_up_wait_an_unprobed_server_is_not_ready(
    nursery: trio.Nursery,
) -> None:
    """--worker-startup-timeout-secs 0 and every engine refusing connections: the servers are
    unknown, not healthy, until a probe passes, so readiness says so and /workers agrees."""
    down = socket.socket()
    down.bind(("127.0.0.1", 0))
    upstream = f"http://127.0.0.1:{down.getsockname()[1]}"
    config = RouterConfig(
        worker_urls=(upstream,),
        server=ServerSettings(host="127.0.0.1", port=0),
        health=HealthSettings(startup_timeout_secs=0),
    )
    running: RunningRouter = await nursery.start(run_router, config)
    async with httpx.AsyncClient(timeout=30) as client:
        readiness = await client.get(running.url + "/readiness")
        assert readiness.status_code == 503
        assert readiness.json() == {"status": "not_ready", "no_healthy_endpoint": ["regular"]}
        (worker,) = (await client.get(running.url + "/workers")).json()["workers"]
        assert worker["healthy"] is False
    down.close()
    nursery.cancel_scope.cancel()
