"""The ``vllm_router_*`` families are vllm-router 0.1.17's: names, types and label sets as the
checked-in list (``vllm_router_families.txt``, which says how it was made) has them; what they
count; and (slow, ``make bench``) the list against a live vllm-router."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import attrs
import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import eventually
from tests.test_cli_launch import _free_port as free_port
from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.ledger import LoadLedger
from trio_pdrouter.observe import RequestRecord, RouterMetrics
from trio_pdrouter_sim import SimConfig
from trio_pdrouter_sim.server import SimServer

LIST = Path(__file__).with_name("vllm_router_families.txt")
VLLM_ROUTER = (
    Path(__file__).resolve().parents[2] / ".venv-bench-vllm-router" / "bin" / "vllm-router"
)
SUFFIXES = ("", "_bucket", "_sum", "_count")


class Family(NamedTuple):
    name: str
    type: str
    labels: frozenset[str]
    modes: frozenset[str]
    served: bool


def families() -> list[Family]:
    out = []
    for line in LIST.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, kind, labels, seen, *rest = line.split(maxsplit=4)
        names = frozenset() if labels == "-" else frozenset(labels.split(","))
        modes = frozenset(seen.split(","))
        out.append(Family(name, kind, names, modes, not rest))
    return out


def seen(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """Sample name -> (family type, label names without le/quantile) of an exposition."""
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = frozenset(sample.labels) - {"le", "quantile"}
            out[sample.name] = (family.type, labels)
    return out


def matches(family: Family, samples: dict[str, tuple[str, frozenset[str]]]) -> bool:
    found = [samples[family.name + s] for s in SUFFIXES if family.name + s in samples]
    return bool(found) and all(
        kind == family.type and labels == family.labels for kind, labels in found
    )


PREFILL = (Endpoint("http://p:1", Role.PREFILL, 0), Endpoint("http://p:1", Role.PREFILL, 1))
DECODE = (Endpoint("http://d:2", Role.DECODE, 0), Endpoint("http://d:2", Role.DECODE, 1))
REGULAR = (Endpoint("http://w:3", Role.REGULAR),)


def record(
    route: str, prefill: Endpoint | None, decode: Endpoint, **fields: object
) -> RequestRecord:
    rec = RequestRecord("r", route, True, started=0.0)
    rec.prefill = None if prefill is None else prefill.key
    rec.decode = decode.key
    rec.status, rec.ttfb_ms, rec.total_ms = 200, 30.0, 90.0
    return attrs.evolve(rec, **fields)


def pd_metrics() -> tuple[RouterMetrics, LoadLedger]:
    ledger = LoadLedger([*PREFILL, *DECODE])
    m = RouterMetrics(pd=True, attempts=3)
    policies = {Role.PREFILL: "cache_aware", Role.DECODE: "power_of_two"}
    m.watch_fleet(ledger, lambda: [*PREFILL, *DECODE], lambda ep: ep != DECODE[1], policies)
    return m, ledger


def test_pd_families_have_vllm_routers_names_types_and_labels() -> None:
    m, _ = pd_metrics()
    m.observe_request(record("/v1/completions", PREFILL[0], DECODE[1], prefill_ms=20.0))
    failed = [("prefill", PREFILL[1].key, "status_503"), ("decode", DECODE[0].key, "reset")]
    m.observe_request(
        record("/v1/chat/completions", PREFILL[0], DECODE[0], status=502,
               outcome="upstream_error", retries=2, upstream_errors=failed)
    )  # fmt: skip
    m.policy_decision("prefill", "cache_hit")
    m.breaker_state(DECODE[0].key, "open")
    samples = seen(m.exposition().decode())
    expected = [f for f in families() if f.served and f.modes & {"pd", "source"}]
    assert [f.name for f in expected if not matches(f, samples)] == []


def test_regular_families_have_vllm_routers_names_types_and_labels() -> None:
    ledger = LoadLedger(REGULAR)
    m = RouterMetrics(pd=False, attempts=2)
    m.watch_fleet(ledger, lambda: list(REGULAR), lambda ep: True, {Role.REGULAR: "cache_aware"})
    failed = [("regular", REGULAR[0].key, "status_500")] * 2
    m.observe_request(record("/v1/completions", None, REGULAR[0]))
    m.observe_request(
        record("/v1/completions", None, REGULAR[0], status=500, outcome="upstream_error",
               retries=1, upstream_errors=failed)
    )  # fmt: skip
    m.policy_decision("regular", "cache_miss")
    m.breaker_state(REGULAR[0].key, "half_open")
    samples = seen(m.exposition().decode())
    expected = [f for f in families() if f.served and f.modes & {"regular", "source"}]
    assert [f.name for f in expected if not matches(f, samples)] == []


def test_what_the_pd_families_count() -> None:
    m, ledger = pd_metrics()
    get = m.registry.get_sample_value
    with ledger.lease(
        PREFILL[1], DECODE[1], pending=(DECODE[1],), tokens={PREFILL[1]: 700}
    ) as lease:
        m.exposition()
        at = {"worker": "http://d:2", "rank": "1"}
        assert get("vllm_router_pd_pending_decode_requests", at) == 1
        assert get("vllm_router_pd_active_decode_requests", at) == 0
        prefill = {"worker": "http://p:1", "rank": "1"}
        assert get("vllm_router_pd_prefill_occupancy", prefill) == 1
        assert get("vllm_router_pd_active_prefill_tokens", prefill) == 700
        lease.release(PREFILL[1])
        lease.sent(DECODE[1])
        m.exposition()
        assert get("vllm_router_pd_pending_decode_requests", at) == 0
        assert get("vllm_router_pd_active_decode_requests", at) == 1
        assert get("vllm_router_pd_prefill_occupancy", prefill) == 0
    m.observe_request(record("/v1/completions", PREFILL[0], DECODE[1], prefill_ms=20.0))
    failed = [("prefill", PREFILL[1].key, "connect")] * 2 + [("prefill", PREFILL[0].key, "connect")]
    m.observe_request(
        record("/v1/completions", PREFILL[0], DECODE[1], status=502, outcome="upstream_error",
               retries=2, upstream_errors=failed)
    )  # fmt: skip
    m.exposition()
    route = {"route": "/v1/completions"}
    assert get("vllm_router_pd_requests_total", route) == 2
    assert get("vllm_router_pd_request_duration_seconds_count", route) == 2
    assert get("vllm_router_pd_request_duration_seconds_sum", route) == 0.06  # to the first byte
    assert get("vllm_router_pd_decode_pending_seconds_sum") == 0.02
    assert get("vllm_router_processed_requests_total", {"worker": "http://p:1"}) == 2
    assert get("vllm_router_pd_decode_requests_total", {"worker": "http://d:2"}) == 2
    assert get("vllm_router_pd_prefill_errors_total", {"worker": "http://p:1"}) == 3
    assert (
        get(
            "vllm_router_policy_decisions_total", {"policy": "power_of_two", "worker": "http://d:2"}
        )
        == 2
    )
    assert get("vllm_router_retries_total", route) == 2
    assert get("vllm_router_retries_exhausted_total", route) == 1
    assert get("vllm_router_request_errors_total", {**route, "error_type": "upstream_error"}) == 1
    assert get("vllm_router_worker_health", {"worker": "http://d:2"}) == 1  # one rank is healthy
    m.breaker_state(DECODE[0].key, "open")
    assert get("vllm_router_cb_state", {"worker": "http://d:2"}) == 1  # vllm-router's: 1 open
    assert get("trio_pdrouter_circuit_breaker_state", {"endpoint": DECODE[0].key}) == 2  # ours: 2
    m.policy_decision("decode", "unbalanced")
    outcome = {"policy": "power_of_two", "stage": "decode", "outcome": "load_balanced"}
    assert get("vllm_router_prefix_routing_decisions_total", outcome) == 1


def test_process_metrics_and_build_info() -> None:
    from trio_pdrouter import __version__

    samples = seen(RouterMetrics().exposition().decode())
    assert "process_cpu_seconds_total" in samples and "process_resident_memory_bytes" in samples
    assert samples["trio_pdrouter_build_info"] == ("gauge", frozenset({"version", "python"}))
    assert (
        RouterMetrics().registry.get_sample_value(
            "trio_pdrouter_build_info",
            {"version": __version__, "python": sys.version.split()[0]},
        )
        == 1
    )


# -- the list against the real vllm-router (slow: make bench installs it) --------------------


@pytest.fixture
def vllm_router() -> Iterator[Path]:
    if not VLLM_ROUTER.exists():
        pytest.fail(f"{VLLM_ROUTER} is missing: run make bench-vllm-router")
    yield VLLM_ROUTER


async def scrape_vllm_router(
    program: Path, mode_args: list[str], sims: list[SimServer], failures: int
) -> str:
    """Its metrics after a few requests, ``failures`` armed on each server in turn."""
    port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [str(program), "--host", "127.0.0.1", "--port", str(port), "--prometheus-port",
            str(metrics_port), "--policy", "cache_aware", *mode_args]  # fmt: skip
    quiet = subprocess.DEVNULL
    proc = await trio.lowlevel.open_process(argv, stdout=quiet, stderr=quiet)
    try:
        async with httpx.AsyncClient(timeout=30) as client:

            async def up() -> bool:
                try:
                    return (await client.get(url + "/health")).status_code == 200
                except httpx.HTTPError:
                    return proc.poll() is not None

            await eventually(up, timeout=60)
            assert proc.poll() is None, "vllm-router exited"
            body = {"model": "sim-model", "prompt": "hello there", "max_tokens": 3}
            for stream in (False, True):
                await client.post(url + "/v1/completions", json={**body, "stream": stream})
            for sim in sims:
                fault = {"spec": "error:503", "count": failures}
                await client.post(sim.url + "/sim/faults", json=fault)
                await client.post(url + "/v1/completions", json=body)
            await client.post(
                url + "/v1/chat/completions",
                json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]},
            )
            return (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
    finally:
        proc.terminate()
        await proc.wait()


@pytest.mark.slow
async def test_the_list_matches_a_live_vllm_router(vllm_router: Path) -> None:
    base = SimConfig.fast(port=0)
    async with trio.open_nursery() as nursery:
        prefill = SimServer(attrs.evolve(base, role="prefill"))
        decode = SimServer(attrs.evolve(base, role="decode"))
        both = SimServer(attrs.evolve(base, role="both"))
        for sim in (prefill, decode, both):
            await nursery.start(sim.run)
        pd_args = ["--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url]
        pd = seen(await scrape_vllm_router(vllm_router, pd_args, [prefill, decode], 1))
        # every attempt fails once: retries, then retries exhausted (vllm-router retries 5 times)
        regular_args = ["--worker-urls", both.url]
        regular = seen(await scrape_vllm_router(vllm_router, regular_args, [both], 6))
        nursery.cancel_scope.cancel()
    listed = families()
    for mode, samples in (("pd", pd), ("regular", regular)):
        # Every family served here shows; one shown only on some paths has the listed shape.
        present = [f for f in listed if any(f.name + s in samples for s in SUFFIXES)]
        expected = [f for f in listed if mode in f.modes and f.served]
        assert [f.name for f in {*expected, *present} if not matches(f, samples)] == [], mode
        names = {f.name for f in listed}
        unlisted = {
            n for n in samples
            if n.startswith("vllm_router_") and not any(n.removesuffix(s) in names for s in SUFFIXES if n.endswith(s))
        }  # fmt: skip
        assert unlisted == set(), mode
