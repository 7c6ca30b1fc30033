"""Engine truth: parsing vLLM's gauges, attributing them to endpoints, drift against the ledger."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
import trio
import trio.testing

from tests.cluster import eventually, held_streams, start_cluster
from tests.serve.test_integration_pd import COMPLETION
from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.fleet import (
    EngineLoad,
    EngineTruth,
    ScrapeError,
    endpoint_loads,
    parse_engine_loads,
)
from trio_pdrouter.ledger import LoadLedger, PeerLoads, Snapshot
from trio_pdrouter.observe import RouterMetrics
from trio_pdrouter_sim.config import SimConfig

URL = "http://decode:8200"
#: "Once upon a time " * 20 at 4 characters a token.
PROMPT_TOKENS = 85


def exposition(per_engine: dict[str, tuple[int, int]], model: str = "m") -> str:
    """vLLM-shaped text: both gauges per engine plus a noisy neighbour series."""
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
    ]
    for engine, (running, _) in per_engine.items():
        lines.append(
            f'vllm:num_requests_running{{model_name="{model}",engine="{engine}"}} {running}.0'
        )
    lines.append("# TYPE vllm:num_requests_waiting gauge")
    for engine, (_, waiting) in per_engine.items():
        lines.append(
            f'vllm:num_requests_waiting{{model_name="{model}",engine="{engine}"}} {waiting}.0'
        )
    lines.append('vllm:num_requests_waiting_by_reason{engine="0",reason="x"} 99.0')
    lines.append('vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0"} 7.0')
    return "\n".join(lines) + "\n"


def test_parse_reads_both_gauges_per_engine_and_ignores_lookalikes() -> None:
    loads = parse_engine_loads(exposition({"0": (3, 1), "1": (0, 2)}))
    assert loads == {"0": EngineLoad(3, 1), "1": EngineLoad(0, 2)}


def test_parse_the_simulators_own_exposition() -> None:
    from trio_pdrouter_sim.app import SimState

    state = SimState(SimConfig.fast(port=0, dp_size=3))
    assert parse_engine_loads(state.metrics_text()) == {
        "0": EngineLoad(0, 0, 0),
        "1": EngineLoad(0, 0, 0),
        "2": EngineLoad(0, 0, 0),
    }


def test_parse_turns_kv_usage_into_tokens_with_the_cache_config() -> None:
    text = exposition({"0": (1, 0), "1": (2, 0)}) + (
        'vllm:kv_cache_usage_perc{engine="0"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.5\n'
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="200"} 1.0\n'
    )
    loads = parse_engine_loads(text)
    assert loads == {"0": EngineLoad(1, 0, 400), "1": EngineLoad(2, 0, 1600)}
    whole = endpoint_loads([Endpoint(URL, Role.DECODE)], loads)
    assert whole == {URL: EngineLoad(3, 0, 2000)}
    # Without the cache config the usage cannot be converted: no token figure.
    assert parse_engine_loads(exposition({"0": (1, 0)}) + "vllm:kv_cache_usage_perc 0.5\n") == {
        "0": EngineLoad(1, 0)
    }


def test_parse_sums_series_of_one_engine_and_handles_escaped_labels() -> None:
    text = (
        'vllm:num_requests_running{model_name="a \\"quoted\\", model",engine="0"} 2\n'
        'vllm:num_requests_running{model_name="b",engine="0"} 1\n'
        "vllm:num_requests_waiting 4\n"
    )
    assert parse_engine_loads(text) == {"0": EngineLoad(3, 0), None: EngineLoad(0, 4)}


@pytest.mark.parametrize(
    "text",
    [
        "",
        "# only comments\nvllm:kv_cache_usage_perc 0.5\n",
        "vllm:num_requests_running{engine=0} x\n",
    ],
)
def test_parse_refuses_text_without_the_gauges_or_malformed(text: str) -> None:
    with pytest.raises(ScrapeError):
        parse_engine_loads(text)


def test_endpoint_loads_by_rank_and_summed_for_a_url_without_ranks() -> None:
    engines = {"0": EngineLoad(3, 1), "1": EngineLoad(2, 0)}
    ranked = [Endpoint(URL, Role.DECODE, r) for r in range(3)]
    assert endpoint_loads(ranked, engines) == {
        f"{URL}@0": EngineLoad(3, 1),
        f"{URL}@1": EngineLoad(2, 0),
        # rank 2 reported nothing: unknown, not zero
    }
    assert endpoint_loads([Endpoint(URL, Role.DECODE)], engines) == {URL: EngineLoad(5, 1)}


class MetricsServer:
    """An upstream whose /metrics the test scripts: text, a status, or a connection error."""

    def __init__(self) -> None:
        self.text = exposition({"0": (0, 0), "1": (0, 0)})
        self.status = 200
        self.refuse = False
        self.scrapes = 0
        #: Runs while a scrape is in flight (the engine answering).
        self.during: Callable[[], object] | None = None

    async def handle(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/metrics"
        self.scrapes += 1
        if self.during is not None:
            self.during()
        if self.refuse:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(self.status, text=self.text)


def truth_over(
    server: MetricsServer, interval: float = 1.0
) -> tuple[EngineTruth, LoadLedger, list[Endpoint], RouterMetrics]:
    endpoints = [Endpoint(URL, Role.DECODE, r) for r in range(2)]
    ledger = LoadLedger(endpoints)
    metrics = RouterMetrics()
    client = httpx.AsyncClient(transport=httpx.MockTransport(server.handle))
    truth = EngineTruth(lambda: endpoints, ledger, client, interval, metrics)
    return truth, ledger, endpoints, metrics


async def test_drift_is_router_load_minus_engine_load_at_the_scrape() -> None:
    server = MetricsServer()
    truth, ledger, (ep0, ep1), metrics = truth_over(server)
    lease = ledger.lease(ep0, ep0, ep1)  # router: 2 on rank 0, 1 on rank 1
    server.text = exposition({"0": (1, 1), "1": (0, 0)})  # engine: 2 on rank 0, 0 on rank 1
    await truth.scrape()
    assert truth.engine_totals() == {ep0.key: 2, ep1.key: 0}
    assert truth.drift == {ep0.key: 0, ep1.key: 1}
    value = metrics.registry.get_sample_value
    assert value("trio_pdrouter_load_drift", {"endpoint": ep1.key}) == 1
    assert value("trio_pdrouter_engine_requests", {"endpoint": ep0.key, "state": "waiting"}) == 1
    lease.release_all()
    await truth.scrape()
    assert truth.drift == {ep0.key: -2, ep1.key: 0}


async def test_with_a_cluster_the_engines_are_compared_with_own_plus_peers_counts() -> None:
    server = MetricsServer()
    endpoints = [Endpoint(URL, Role.DECODE, r) for r in range(2)]
    ep0, ep1 = endpoints
    ledger = LoadLedger(endpoints)
    peers = PeerLoads("r1", valid_for=60.0, clock=lambda: 0.0)
    client = httpx.AsyncClient(transport=httpx.MockTransport(server.handle))
    truth = EngineTruth(lambda: endpoints, ledger, client, 1.0, peers=peers)
    assert truth.drift_of == "cluster"
    ledger.lease(ep0)  # this replica: 1 on rank 0
    peers.update({"r2": Snapshot({"decode": {ep0.key: 2, ep1.key: 1}})})
    server.text = exposition({"0": (3, 0), "1": (1, 0)})  # the engines serve both replicas
    await truth.scrape()
    assert truth.drift == {ep0.key: 0, ep1.key: 0}
    # A peer's count that changes while the engines answer is a range, not drift.
    server.during = lambda: peers.update({"r2": Snapshot({"decode": {ep0.key: 4}})})
    server.text = exposition({"0": (4, 0), "1": (0, 0)})
    await truth.scrape()
    assert truth.drift == {ep0.key: 0, ep1.key: 0}
    # Beyond it, drift: the engines run 2 more than the cluster's counts say.
    server.during = None
    server.text = exposition({"0": (7, 0), "1": (0, 0)})
    await truth.scrape()
    assert truth.drift == {ep0.key: -2, ep1.key: 0}
    # Without a cluster the same engines show the peers' share as drift.
    alone = EngineTruth(lambda: endpoints, ledger, client, 1.0)
    await alone.scrape()
    assert alone.drift_of == "replica" and alone.drift == {ep0.key: -6, ep1.key: 0}


async def test_a_peers_pending_slots_are_left_out_and_its_token_weights_added() -> None:
    server = MetricsServer()
    endpoints = [Endpoint(URL, Role.DECODE, r) for r in range(2)]
    ep0, ep1 = endpoints
    ledger = LoadLedger(endpoints)
    peers = PeerLoads("r1", valid_for=60.0, clock=lambda: 0.0)
    client = httpx.AsyncClient(transport=httpx.MockTransport(server.handle))
    truth = EngineTruth(lambda: endpoints, ledger, client, 1.0, peers=peers)
    ledger.lease(ep0, tokens={ep0: 100})  # this replica: 1 sent on rank 0
    ledger.lease(ep1, pending=(ep1,), tokens={ep1: 50})  # ... and 1 PENDING on rank 1
    # The peer has 3 on rank 0, one of them PENDING; its weights are 300 and 0.
    counts, visible = {"decode": {ep0.key: 3}}, {"decode": {ep0.key: 2}}
    peers.update({"r2": Snapshot(counts, visible, {"decode": {ep0.key: 300}})})
    cache = 'vllm:cache_config_info{block_size="1",engine="%s",num_gpu_blocks="1000"} 1.0\n'
    server.text = exposition({"0": (3, 0), "1": (0, 0)}) + (
        'vllm:kv_cache_usage_perc{engine="0"} 0.3\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.0\n' + cache % "0" + cache % "1"
    )
    await truth.scrape()
    # The engines see what was sent, by either replica: no drift.
    assert truth.drift == {ep0.key: 0, ep1.key: 0}
    # Tokens: own 100 + the peer's 300 on rank 0 against 300 held; own PENDING 50 on rank 1.
    assert truth.token_drift == {ep0.key: 100, ep1.key: 50}


async def test_load_changing_during_the_scrape_is_not_drift_but_an_offset_beyond_it_is() -> None:
    server = MetricsServer()
    truth, ledger, (ep0, ep1), _ = truth_over(server)
    # While each scrape is in flight two requests arrive on rank 0: the engine's snapshot
    # (taken at an unknown instant of the window) may or may not include them.
    server.during = lambda: ledger.lease(ep0, ep0)
    server.text = exposition({"0": (1, 0), "1": (0, 0)})  # the engine saw one of them
    await truth.scrape()
    assert truth.drift == {ep0.key: 0, ep1.key: 0}
    server.text = exposition({"0": (0, 0), "1": (3, 0)})  # rank 0 saw none; rank 1 runs 3
    await truth.scrape()  # router range on rank 0 during this scrape: 2..4
    assert truth.drift == {ep0.key: 2, ep1.key: -3}


async def test_endpoints_are_read_each_round() -> None:
    server = MetricsServer()
    truth, _, endpoints, _ = truth_over(server)
    await truth.scrape()
    assert set(truth.drift) == {f"{URL}@0", f"{URL}@1"}
    endpoints.pop()  # the server's rank 1 was removed from routing
    await truth.scrape()
    assert set(truth.drift) == set(truth.engine) == {f"{URL}@0"}


@pytest.mark.parametrize("failure", ["status", "refused", "garbage"])
async def test_a_failed_scrape_forgets_the_urls_numbers_until_it_recovers(
    failure: str, autojump_clock: trio.testing.MockClock
) -> None:
    server = MetricsServer()
    truth, _, (ep0, _), metrics = truth_over(server)
    await truth.scrape()
    assert set(truth.drift) == {f"{URL}@0", f"{URL}@1"}
    if failure == "status":
        server.status = 500
    elif failure == "refused":
        server.refuse = True
    else:
        server.text = "<html>not metrics</html>"
    await truth.scrape()
    assert truth.engine == {} and truth.drift == {}
    value = metrics.registry.get_sample_value
    assert value("trio_pdrouter_load_drift", {"endpoint": ep0.key}) is None
    assert value("trio_pdrouter_engine_scrape_errors_total", {"url": URL}) == 1
    server.status, server.refuse, server.text = 200, False, exposition({"0": (4, 0), "1": (0, 0)})
    await trio.sleep(truth.interval)  # the failing URL's first backoff
    await truth.scrape()
    assert truth.drift == {f"{URL}@0": -4, f"{URL}@1": 0}


async def test_a_failing_upstream_is_scraped_with_a_doubling_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = MetricsServer()
    server.refuse = True
    truth, *_ = truth_over(server, interval=1.0)
    with trio.move_on_after(100):
        await truth.run()
    # Tried at 0, 1, 3, 7, 15, then every 30 s (the cap) instead of 100 times.
    assert server.scrapes == 8, server.scrapes
    server.refuse = False
    with trio.move_on_after(31):
        await truth.run()
    assert truth.drift, "scraped again once it answers"


async def test_run_scrapes_once_per_interval(mock_clock: trio.testing.MockClock) -> None:
    server = MetricsServer()
    truth, *_ = truth_over(server, interval=0.5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(truth.run)
        await trio.testing.wait_all_tasks_blocked()
        assert server.scrapes == 1
        mock_clock.jump(0.49)
        await trio.testing.wait_all_tasks_blocked()
        assert server.scrapes == 1
        mock_clock.jump(0.01)
        await trio.testing.wait_all_tasks_blocked()
        assert server.scrapes == 2
        nursery.cancel_scope.cancel()


async def test_drift_is_zero_while_50_streams_run_on_real_simulators() -> None:
    """The acceptance check: with exact accounting, router load equals engine load."""
    sim = SimConfig(port=0, itl_base_s=0.01, prefill_base_s=0.0, prefill_per_token_s=0.0)
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery, sim=sim, dp_size=2, n_decode=2, client_connections=200)
        truth = c.router.app.engine_truth
        assert truth is not None
        body = {**COMPLETION, "max_tokens": 400, "stream": True}
        async with held_streams(c, 50, body):
            await truth.scrape()  # a scrape now, with every stream past its first byte
            loads = await c.get_loads()
            assert sum(loads["decode"].values()) == 50
            decode_keys = set(loads["decode"])
            assert {k: loads["engine"][k] for k in decode_keys} == loads["decode"]
            assert set(loads["drift"]) == decode_keys | set(loads["prefill"])
            assert all(d == 0 for d in loads["drift"].values()), loads["drift"]
            # Tokens: each stream weighs prompt + max_tokens on decode, an upper bound of the
            # KV the engines hold, so the token drift is never negative.
            assert sum(loads["tokens"]["decode"].values()) == 50 * (PROMPT_TOKENS + 400)
            assert set(loads["engine_tokens"]) >= decode_keys
            assert all(loads["token_drift"][k] >= 0 for k in decode_keys), loads["token_drift"]
            assert loads["drift_of"] == "replica"
            metrics = (await c.client.get(c.url + "/metrics")).text
            for key in decode_keys:
                assert f'trio_pdrouter_load_drift{{endpoint="{key}"}} 0.0' in metrics
        await eventually(c.all_idle, timeout=20)
        await truth.scrape()
        loads = await c.get_loads()
        assert set(loads["engine"].values()) == {0} and set(loads["drift"].values()) == {0}
        nursery.cancel_scope.cancel()


async def test_drift_exposes_the_historic_early_release_bug() -> None:
    """With decode released at its response headers (the bug this router exists to fix), the
    engines keep running what the router no longer counts: drift goes negative."""
    sim = SimConfig(port=0, itl_base_s=0.01, prefill_base_s=0.0, prefill_per_token_s=0.0)
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery, sim=sim, release_decode_at_headers=True)
        truth = c.router.app.engine_truth
        assert truth is not None
        body = {**COMPLETION, "max_tokens": 2000, "stream": True}
        async with c.client.stream("POST", c.url + "/v1/completions", json=body) as resp:
            chunks = resp.aiter_raw()
            await chunks.__anext__()
            await truth.scrape()
            loads = await c.get_loads()
        decode = c.decode[0].url
        assert loads["decode"] == {decode: 0}
        assert loads["engine"][decode] == 1
        assert loads["drift"][decode] == -1
        nursery.cancel_scope.cancel()


async def test_engine_truth_off_leaves_get_loads_as_it_was() -> None:
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery, engine_metrics_interval=0)
        assert c.router.app.engine_truth is None
        assert set(await c.get_loads()) == {"prefill", "decode", "tokens"}
        nursery.cancel_scope.cancel()


def test_command_line_interval_and_its_validation() -> None:
    from trio_pdrouter.cli import parse_config

    base = ["--worker-urls", "http://w:1"]
    assert parse_config(base).engine_metrics_interval == 1.0
    assert parse_config([*base, "--engine-metrics-interval", "0"]).engine_metrics_interval == 0
    with pytest.raises(SystemExit):
        parse_config([*base, "--engine-metrics-interval", "-1"])
