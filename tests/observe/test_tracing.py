"""Tracing: the router's spans reach an OTLP/HTTP receiver, joined to the client's trace, and
each engine receives the traceparent of the call that reached it."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import trio
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.cluster import Cluster, start_cluster
from tests.otlp_receiver import OtlpReceiver
from trio_pdrouter.config import RetrySettings

TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE}-{CLIENT_SPAN}-01"


def _attributes(span: Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


async def _flush(c: Cluster) -> None:
    tracing = c.router.app.proxy.tracing
    assert tracing is not None
    await trio.to_thread.run_sync(tracing.flush)  # returns once the receiver answered


async def test_a_request_joins_the_client_trace_and_each_engine_gets_its_legs_span() -> None:
    with OtlpReceiver().running() as receiver:
        async with trio.open_nursery() as nursery:
            c = await start_cluster(nursery, otlp_traces_endpoint=receiver.url)
            body = {"model": "sim-model", "prompt": "hello", "max_tokens": 3, "stream": True}
            resp = await c.client.post(
                c.url + "/v1/completions", json=body, headers={"traceparent": TRACEPARENT}
            )
            assert resp.status_code == 200
            await _flush(c)
            received = {
                "prefill": (await c.stats(c.prefill[0]))["traceparents"],
                "decode": (await c.stats(c.decode[0]))["traceparents"],
            }
            nursery.cancel_scope.cancel()
    assert receiver.posts and set(receiver.posts) == {"/v1/traces"}
    [server] = [s for s in receiver.spans if s.kind == Span.SPAN_KIND_SERVER]
    assert server.trace_id.hex() == TRACE
    assert server.parent_span_id.hex() == CLIENT_SPAN
    attributes = _attributes(server)
    assert attributes["http.route"] == "/v1/completions"
    assert attributes["trio_pdrouter.outcome"] == "ok"
    assert attributes["http.response.status_code"] == 200
    assert attributes["gen_ai.request.model"] == "sim-model"
    assert attributes["trio_pdrouter.decode"] == c.decode[0].url
    assert attributes["trio_pdrouter.policy.decode"] == "round_robin"
    assert "trio_pdrouter.queue_wait_ms" in attributes and "trio_pdrouter.ttft_ms" in attributes
    legs = {s.name: s for s in receiver.spans if s.kind == Span.SPAN_KIND_CLIENT}
    assert set(legs) == {"prefill", "decode"}
    for stage, leg in legs.items():
        assert leg.trace_id.hex() == TRACE
        assert leg.parent_span_id == server.span_id
        assert _attributes(leg)["trio_pdrouter.attempt"] == 1
        # The engine joins the leg's span, not the client's.
        assert received[stage] == [f"00-{TRACE}-{leg.span_id.hex()}-01"]


async def test_every_attempt_has_its_own_span() -> None:
    """A prefill that answers 503 once, then succeeds: two prefill spans, the first an error."""
    with OtlpReceiver().running() as receiver:
        async with trio.open_nursery() as nursery:
            c = await start_cluster(
                nursery,
                otlp_traces_endpoint=receiver.url,
                retry=RetrySettings(max_retries=2, initial_backoff_ms=1),
            )
            armed = await c.client.post(
                c.prefill[0].url + "/sim/faults", json={"spec": "error:503@prefill", "count": 1}
            )
            armed.raise_for_status()
            body = {"model": "sim-model", "prompt": "hello", "max_tokens": 2}
            resp = await c.client.post(c.url + "/v1/completions", json=body)
            assert resp.status_code == 200
            await _flush(c)
            nursery.cancel_scope.cancel()
    prefills = sorted(
        (s for s in receiver.spans if s.name == "prefill"),
        key=lambda s: _attributes(s)["trio_pdrouter.attempt"],
    )
    assert [_attributes(s)["trio_pdrouter.outcome"] for s in prefills] == ["status_503", "ok"]
    assert prefills[0].status.code == prefills[0].status.STATUS_CODE_ERROR
    [server] = [s for s in receiver.spans if s.kind == Span.SPAN_KIND_SERVER]
    assert all(s.parent_span_id == server.span_id for s in prefills)
    assert len(server.parent_span_id) == 0  # no client trace: the router's span is the root


def test_off_by_default_the_sdk_is_never_imported() -> None:
    code = (
        "import sys, trio\n"
        "from trio_pdrouter.assemble import build_app\n"
        "from trio_pdrouter.config import RouterConfig\n"
        "from trio_pdrouter.http import make_client\n"
        "async def main():\n"
        "    async with trio.open_nursery() as n:\n"
        "        config = RouterConfig(worker_urls=('http://a:1',))\n"
        "        build_app(config, make_client(config), n)\n"
        "        n.cancel_scope.cancel()\n"
        "trio.run(main)\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"


def test_the_flag_without_the_sdk_is_one_line_and_exit_2() -> None:
    code = (
        "import sys\n"
        "sys.modules['opentelemetry.exporter'] = None  # as if the otel extra were missing\n"
        "from trio_pdrouter.cli import main\n"
        "main(['--worker-urls', 'http://a:1', '--otlp-traces-endpoint', 'http://c:4318'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--otlp-traces-endpoint needs the OpenTelemetry SDK" in done.stderr
    assert "pip install 'trio-pdrouter[otel]'" in done.stderr
    assert "Traceback" not in done.stderr
