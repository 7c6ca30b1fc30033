"""The shipped Grafana dashboard and alert rules (``deploy/monitoring/``) against a real
Prometheus scraping a router under load from the simulators: the rules pass ``promtool check
rules`` and load in Prometheus, and every dashboard query and every rule expression parses and
returns series from the live data (an alert's expression is read without its threshold, as
``X > bool N``).

Prometheus is Debian's ``prometheus`` package, installed by the Makefile's set-up. The router
runs as the command line runs it (PD mode, KV events from the simulators, pod discovery from a
fake API server, a small admission limit), and the load includes admission refusals and a
failed request, so the error series exist.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Any

import attrs
import httpx
import trio

from tests.cluster import eventually
from tests.discovery.test_discovery_e2e import kubeconfig
from tests.kube_fake import FakeKube, serve_fake
from tests.test_cli_launch import _free_port as free_port
from trio_pdrouter_sim import SimConfig
from trio_pdrouter_sim.server import SimServer

ROOT = pathlib.Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "monitoring" / "trio-pdrouter-alerts.yml"
DASHBOARD = ROOT / "deploy" / "monitoring" / "trio-pdrouter-dashboard.json"
#: An alert's expression: a query, a comparison, a number.
THRESHOLD = re.compile(r"\s(==|!=|>=|<=|>|<)\s*(-?[0-9.]+(?:e[0-9]+)?)\s*$")
#: Requests sent at once against --max-concurrent-requests 2 --queue-size 1: some refused.
BURST = 8


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path is not None, f"{name} is missing: make install puts Debian's prometheus package"
    return path


def dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def rule_queries() -> list[tuple[str, str]]:
    """(name, query) of every rule: a recording rule's expression, an alert's as ``bool``."""
    import yaml

    out = []
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            expr = " ".join(rule["expr"].split())
            if "alert" in rule:
                assert THRESHOLD.search(expr), f"{rule['alert']}: not 'query <op> number'"
                expr = THRESHOLD.sub(r" \1 bool \2", expr)
            out.append((rule.get("alert") or rule["record"], expr))
    return out


def test_the_rules_pass_promtool() -> None:
    result = subprocess.run(
        [tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def prometheus_config(tmp: pathlib.Path, target: str) -> pathlib.Path:
    path = tmp / "prometheus.yml"
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "trio-pdrouter", "static_configs": [{"targets": [target]}]}
        ],
    }
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


async def load(client: httpx.AsyncClient, url: str, prefill: SimServer) -> int:
    """Bounded load: a burst past the admission limit, streams and whole answers, one failure.
    Returns the requests answered."""
    body = {"model": "sim-model", "max_tokens": 8}
    statuses: list[int] = []

    async def one(i: int, stream: bool) -> None:
        prompt = f"request {i} about routing and caching " * 4
        resp = await client.post(
            url + "/v1/completions", json={**body, "prompt": prompt, "stream": stream}
        )
        statuses.append(resp.status_code)

    async with trio.open_nursery() as nursery:
        for i in range(BURST):
            nursery.start_soon(one, i, i % 2 == 0)
    for i in range(4):
        await one(100 + i, i % 2 == 0)
    # one failure: prefill answers 503 to every attempt (--retry-max-retries 2)
    await client.post(prefill.url + "/sim/faults", json={"spec": "error:503", "count": 2})
    await one(200, False)
    assert statuses.count(200) >= 4, statuses
    refused = [s for s in statuses[:BURST] if s != 200]
    assert refused and set(refused) <= {429, 503}, statuses  # admission refused some
    assert statuses[-1] == 503, statuses
    return len(statuses)


async def query(client: httpx.AsyncClient, prom: str, expr: str) -> list[Any]:
    resp = await client.get(prom + "/api/v1/query", params={"query": expr})
    assert resp.status_code == 200, f"{expr}: {resp.text}"
    result: list[Any] = resp.json()["data"]["result"]
    return result


async def test_every_panel_and_rule_returns_series_on_a_live_prometheus(
    tmp_path: pathlib.Path,
) -> None:
    prometheus = tool("prometheus")
    async with trio.open_nursery() as nursery:
        kube = FakeKube()
        await nursery.start(serve_fake, kube)
        sim = SimConfig.fast(port=0, kv_events_port=0, itl_base_s=0.02)
        prefill = SimServer(attrs.evolve(sim, role="prefill"))
        decode = SimServer(attrs.evolve(sim, role="decode"))
        for server in (prefill, decode):
            await nursery.start(server.run)
        sources = []
        for server in (prefill, decode):
            assert server.state.kv_events is not None
            sources += ["--kv-event-source", f"{server.url}={server.state.kv_events.endpoints[0]}"]
        port, metrics_port, prom_port = free_port(), free_port(), free_port()
        url, prom = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{prom_port}"
        argv = [
            sys.executable, "-m", "trio_pdrouter", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(metrics_port), "--vllm-pd-disaggregation",
            "--prefill", prefill.url, "--decode", decode.url, "--policy", "cache_aware",
            *sources, "--max-concurrent-requests", "2", "--queue-size", "1",
            "--retry-max-retries", "2", "--retry-initial-backoff-ms", "10",
            "--service-discovery", "--prefill-selector", "role=p", "--decode-selector", "role=d",
            "--service-discovery-port", "8000", "--log-level", "warning",
        ]  # fmt: skip
        env = {**os.environ, "KUBECONFIG": str(kubeconfig(tmp_path / "kubeconfig", kube.url))}
        router = await trio.lowlevel.open_process(argv, env=env)
        config = prometheus_config(tmp_path, f"127.0.0.1:{metrics_port}")
        server = await trio.lowlevel.open_process(
            [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            async with httpx.AsyncClient(timeout=30) as client:

                async def answers(address: str) -> bool:
                    try:
                        return (await client.get(address)).status_code == 200
                    except httpx.HTTPError:
                        return False

                await eventually(lambda: answers(url + "/readiness"), timeout=30)
                await eventually(lambda: answers(prom + "/-/ready"), timeout=30)
                answered = await load(client, url, prefill)

                async def scraped() -> bool:
                    # the whole load is in, and enough samples after it for every rate
                    total = await query(client, prom, "sum(trio_pdrouter_requests_total)")
                    if not total or float(total[0]["value"][1]) < answered:
                        return False
                    n = await query(client, prom, "count_over_time(trio_pdrouter_build_info[1m])")
                    return bool(n) and float(n[0]["value"][1]) >= 5

                await eventually(scraped, timeout=30)
                empty = []
                for expr in dashboard_queries():
                    if not await query(client, prom, expr):
                        empty.append(expr)
                for name, expr in rule_queries():
                    if not await query(client, prom, expr):
                        empty.append(f"{name}: {expr}")
                assert empty == []
                groups = (await client.get(prom + "/api/v1/rules")).json()["data"]["groups"]
                rules = [r for g in groups for r in g["rules"]]
                assert len(rules) == len(rule_queries())
                assert [r["name"] for r in rules if r["health"] == "err"] == []
        finally:
            for proc in (router, server):
                proc.terminate()
            with trio.move_on_after(10):
                await router.wait()
                await server.wait()
            for proc in (router, server):
                if proc.returncode is None:
                    proc.kill()
        nursery.cancel_scope.cancel()
