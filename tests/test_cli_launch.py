"""A vllm-router launch command with every flag vllm-router 0.1.17 has that trio-pdrouter
implements, each given a value, serves with only the program name changed (the command with
every flag, the refused ones included, exits 2: ``tests/test_cli.py``)."""

from __future__ import annotations

import os
import pathlib
import socket
import sys

import attrs
import httpx
import trio

from tests.cluster import eventually
from tests.discovery.test_discovery_e2e import kubeconfig
from tests.kube_fake import FakeKube, serve_fake
from tests.test_cli import VLLM_ROUTER_FLAGS
from trio_pdrouter_sim import SimConfig
from trio_pdrouter_sim.server import SimServer

#: Flags of vllm-router that are refused here when given a value of their own.
REFUSED = {
    "--enable-program-scheduling", "--program-scheduling-config-json", "--kv-event-source",
    "--kv-event-replay-source", "--kv-event-block-size", "--kv-event-model", "--pd-kv-events",
    "--mini-lb", "--wasm-middleware", "--wasm-middleware-sha256", "--wasm-middleware-route",
    "--enable-igw", "--vllm-discovery-address",
}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def launch_command(prefill: str, decode: str, log_dir: pathlib.Path) -> list[str]:
    return [
        "--host", "127.0.0.1", "--port", str(_free_port()), "--worker-urls",
        "--policy", "round_robin", "--prefill-policy", "cache_aware",
        "--decode-policy", "power_of_two", "--router-temperature", "0.5",
        "--kv-penalty-host", "0.7", "--kv-penalty-external", "0.5", "--kv-penalty-disk", "0.2",
        "--kv-aware-session-affinity-ttl-secs", "60", "--vllm-pd-disaggregation",
        "--prefill", prefill, "none", "--decode", decode,
        "--worker-startup-timeout-secs", "30", "--worker-startup-check-interval", "1",
        "--cache-threshold", "0.5", "--balance-abs-threshold", "32",
        "--balance-rel-threshold", "1.1", "--eviction-interval-secs", "60",
        "--max-tree-size", "1000000", "--max-payload-size", "1000000",
        "--intra-node-data-parallel-size", "2", "--api-key", "k", "--log-dir", str(log_dir),
        "--log-level", "debug", "--kv-connector", "nixl",
        "--prometheus-port", str(_free_port()), "--prometheus-host", "127.0.0.1",
        "--request-id-headers", "x-request-id", "--request-timeout-secs", "60",
        "--retry-max-retries", "3", "--retry-initial-backoff-ms", "10",
        "--retry-max-backoff-ms", "100", "--retry-backoff-multiplier", "2",
        "--retry-jitter-factor", "0.1", "--disable-retries", "--cb-failure-threshold", "5",
        "--cb-success-threshold", "2", "--cb-timeout-duration-secs", "30",
        "--cb-window-duration-secs", "60", "--disable-circuit-breaker",
        "--health-failure-threshold", "2", "--health-success-threshold", "1",
        "--health-check-timeout-secs", "2", "--health-check-interval-secs", "10",
        "--health-check-endpoint", "/health", "--max-concurrent-requests", "64",
        "--queue-size", "8", "--queue-timeout-secs", "5",
        "--rate-limit-tokens-per-second", "100", "--cors-allowed-origins", "http://ui.example",
        "--service-discovery", "--selector", "app=vllm", "--service-discovery-port", "8000",
        "--service-discovery-namespace", "default", "--prefill-selector", "role=p",
        "--decode-selector", "role=d",
    ]  # fmt: skip


async def test_a_launch_command_with_every_supported_vllm_router_flag_serves(
    tmp_path: pathlib.Path,
) -> None:
    async with trio.open_nursery() as nursery:
        kube = FakeKube()  # discovery finds no pod: the static servers serve
        await nursery.start(serve_fake, kube)
        base = SimConfig.fast(port=0, dp_size=2)
        prefill = SimServer(attrs.evolve(base, role="prefill"))
        decode = SimServer(attrs.evolve(base, role="decode"))
        for server in (prefill, decode):
            await nursery.start(server.run)
        argv = launch_command(prefill.url, decode.url, tmp_path)
        given = {arg for arg in argv if arg.startswith("--")}
        assert given == set(VLLM_ROUTER_FLAGS) - REFUSED
        port = argv[argv.index("--port") + 1]
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "KUBECONFIG": str(kubeconfig(tmp_path / "kubeconfig", kube.url))}
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "trio_pdrouter", *argv], env=env
        )
        try:
            async with httpx.AsyncClient(timeout=10) as client:

                async def serving() -> bool:
                    try:
                        return (await client.get(url + "/health")).status_code == 200
                    except httpx.HTTPError:
                        return process.poll() is not None  # exited: stop polling, fail below

                await eventually(serving, timeout=60)
                assert process.poll() is None, "the router exited"
                resp = await client.post(
                    url + "/v1/completions",
                    json={"model": "sim-model", "prompt": "hello", "max_tokens": 3},
                    headers={"authorization": "Bearer k", "origin": "http://ui.example"},
                )
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["text"] == " tok0 tok1 tok2"
                assert resp.headers["access-control-allow-origin"] == "http://ui.example"
        finally:
            process.terminate()
            await process.wait()
        assert list(await trio.Path(tmp_path).glob("trio-pdrouter.*")), (
            "the log file is in --log-dir"
        )
        assert any(
            q.get("watch") and q.get("labelSelector") == "role=d" for _, q, _ in kube.requests
        )
        nursery.cancel_scope.cancel()
