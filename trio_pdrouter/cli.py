"""``trio-pdrouter``: the command line, flag for flag compatible with vllm-router.

A vllm-router launch command works with only the program name changed. Flags of vllm-router that
trio-pdrouter does not implement (service discovery, WASM middleware, KV events, ...) are
rejected by name rather than silently ignored.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import trio

from . import __version__
from .config import (
    KV_CONNECTORS,
    TRANSPORTS,
    AdmissionSettings,
    BreakerSettings,
    ConfigError,
    HealthSettings,
    RetrySettings,
    RouterConfig,
    ServerSettings,
    Timeouts,
)
from .policies import POLICY_NAMES, PolicySettings

DESCRIPTION = """\
A vLLM router for prefill/decode (PD) disaggregated serving and plain load balancing, built on
trio. Per-endpoint load is exact: a decode stream counts until its last byte, until the client
leaves, or until anything fails.

PD mode:      trio-pdrouter --vllm-pd-disaggregation --prefill URL --decode URL [...]
Regular mode: trio-pdrouter --worker-urls URL [URL ...]
"""

EPILOG = """\
routes: POST /v1/completions, POST /v1/chat/completions (streaming or not); GET /v1/models,
/health, /liveness, /readiness, /get_loads (the load ledger), /workers, /metrics.
"""


def build_parser() -> argparse.ArgumentParser:
    d = RouterConfig()
    ps = PolicySettings()
    p = argparse.ArgumentParser(
        prog="trio-pdrouter",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"trio-pdrouter {__version__}")

    g = p.add_argument_group("listening")
    g.add_argument("--host", default=d.server.host, help="address to listen on")
    g.add_argument("--port", type=int, default=d.server.port, help="port to listen on")
    g.add_argument("--backlog", type=int, default=d.server.backlog, help="listen backlog")
    g.add_argument(
        "--keep-alive-timeout-secs",
        type=float,
        default=d.server.keep_alive_timeout,
        help="close idle client connections after this many seconds",
    )
    g.add_argument(
        "--graceful-timeout-secs",
        type=float,
        default=d.server.graceful_timeout,
        help="on SIGTERM/SIGINT, let in-flight requests finish for this long, then cancel them",
    )

    g = p.add_argument_group("upstreams")
    g.add_argument(
        "--vllm-pd-disaggregation",
        action="store_true",
        help="PD mode: every request runs a prefill leg, then a decode leg (NIXL handshake)",
    )
    g.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        default=[],
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="prefill server URL; repeat for several. A bootstrap port after the URL is accepted"
        " for compatibility and ignored (the NIXL connector does not use it)",
    )
    g.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL",
        help="decode server URL; repeat for several",
    )
    g.add_argument(
        "--worker-urls",
        nargs="*",
        default=[],
        metavar="URL",
        help="regular mode: servers that take whole requests",
    )
    g.add_argument(
        "--intra-node-data-parallel-size",
        type=int,
        default=d.dp_size,
        help="data-parallel engines per server: each URL becomes endpoints url@0..url@N-1,"
        " each with its own load, addressed with the X-data-parallel-rank header",
    )
    g.add_argument(
        "--kv-connector",
        choices=KV_CONNECTORS,
        default=d.kv_connector,
        help="vLLM KV connector: nixl (pull-based), or p2p_nccl (request ids carry both"
        " peers' addresses)",
    )
    g.add_argument(
        "--upstream-transport",
        choices=TRANSPORTS,
        default=d.transport,
        help="HTTP client pool for upstreams: h11 (ours; closes a connection the moment its"
        " request is abandoned) or httpx (httpx's stock pool, for comparison)",
    )

    g = p.add_argument_group("routing policy")
    g.add_argument("--policy", choices=POLICY_NAMES, default=d.policy, help="policy of every stage")
    g.add_argument(
        "--prefill-policy", choices=POLICY_NAMES, default=None, help="override --policy for prefill"
    )
    g.add_argument(
        "--decode-policy", choices=POLICY_NAMES, default=None, help="override --policy for decode"
    )
    g.add_argument(
        "--cache-threshold",
        type=float,
        default=ps.cache_threshold,
        help="cache_aware: use the best prefix match when it covers more than this share of the"
        " request text (0.0-1.0)",
    )
    g.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=ps.balance_abs_threshold,
        help="cache_aware: loads are unbalanced (pick the least loaded) when max-min exceeds this"
        " AND max > min * --balance-rel-threshold",
    )
    g.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=ps.balance_rel_threshold,
        help="cache_aware: see --balance-abs-threshold",
    )
    g.add_argument(
        "--eviction-interval-secs",
        type=float,
        default=ps.eviction_interval_secs,
        help="cache_aware: seconds between prefix-tree evictions",
    )
    g.add_argument(
        "--max-tree-size",
        type=int,
        default=ps.max_tree_size,
        help="cache_aware: characters each endpoint may keep in the prefix tree",
    )

    g = p.add_argument_group("requests")
    g.add_argument(
        "--max-payload-size",
        type=int,
        default=d.max_payload_size,
        help="largest request body accepted, in bytes (larger: 413)",
    )
    g.add_argument(
        "--request-timeout-secs",
        type=float,
        default=d.timeouts.request,
        help="bounds the prefill leg, the wait for decode's first byte, and every gap between"
        " decode chunks; never a stream that keeps producing",
    )
    g.add_argument(
        "--prefill-timeout-secs",
        type=float,
        default=None,
        help="limit on the whole prefill leg (default: --request-timeout-secs)",
    )
    g.add_argument(
        "--decode-first-byte-timeout-secs",
        type=float,
        default=None,
        help="limit from sending the decode leg to its first byte; for a non-streaming request"
        " that is the whole answer (default: --request-timeout-secs)",
    )
    g.add_argument(
        "--decode-idle-timeout-secs",
        type=float,
        default=None,
        help="longest gap between two chunks of a decode stream (default: --request-timeout-secs)",
    )
    g.add_argument(
        "--release-stranded-kv",
        action=argparse.BooleanOptionalAction,
        default=d.release_stranded_kv,
        help="when a client leaves after prefill answered but before decode did, send decode a"
        " one-token request so the prefill engine frees the KV blocks at once",
    )
    g.add_argument(
        "--connect-timeout-secs",
        type=float,
        default=d.timeouts.connect,
        help="time to open a connection to an upstream",
    )
    g.add_argument(
        "--request-id-headers",
        nargs="*",
        default=list(d.request_id_headers),
        metavar="HEADER",
        help="client headers to take the request id from, first present wins",
    )
    g.add_argument(
        "--max-buffered-bytes",
        type=int,
        default=d.max_buffered_bytes,
        help="decode output held for a client reading slower than the engine writes; past it"
        " the request is aborted upstream",
    )

    g = p.add_argument_group("resilience")
    r = d.retry
    g.add_argument(
        "--retry-max-retries",
        type=int,
        default=r.max_retries,
        help="attempts per request in all (1 = no retry). Prefill is retried on another"
        " endpoint after connection errors, 5xx, 429 and timeouts; decode only before the"
        " client got a byte, and then with a fresh prefill",
    )
    g.add_argument(
        "--retry-initial-backoff-ms",
        type=int,
        default=r.initial_backoff_ms,
        help="wait before the first retry; each later wait is multiplied by"
        " --retry-backoff-multiplier",
    )
    g.add_argument(
        "--retry-max-backoff-ms",
        type=int,
        default=r.max_backoff_ms,
        help="longest wait between attempts",
    )
    g.add_argument(
        "--retry-backoff-multiplier",
        type=float,
        default=r.backoff_multiplier,
        help="growth of the wait from one retry to the next",
    )
    g.add_argument(
        "--retry-jitter-factor",
        type=float,
        default=r.jitter_factor,
        help="each wait is varied at random by up to this fraction, so retries do not march in"
        " step",
    )
    g.add_argument(
        "--disable-retries",
        action="store_true",
        help="one attempt per request (as --retry-max-retries 1)",
    )
    b = d.breaker
    g.add_argument(
        "--cb-failure-threshold",
        type=int,
        default=b.failure_threshold,
        help="failures within the window that open an endpoint's circuit",
    )
    g.add_argument(
        "--cb-success-threshold",
        type=int,
        default=b.success_threshold,
        help="half-open successes that close the circuit again",
    )
    g.add_argument(
        "--cb-timeout-duration-secs",
        type=float,
        default=b.timeout_duration_secs,
        help="how long a circuit stays open before a trial request",
    )
    g.add_argument(
        "--cb-window-duration-secs",
        type=float,
        default=b.window_duration_secs,
        help="window over which failures are counted",
    )
    g.add_argument(
        "--disable-circuit-breaker",
        action="store_true",
        help="never take an endpoint out of rotation for its failures (health checks still do)",
    )
    h = d.health
    g.add_argument("--health-check-endpoint", default=h.endpoint, help="path probed on upstreams")
    g.add_argument(
        "--health-check-interval-secs",
        type=float,
        default=h.interval_secs,
        help="seconds between probes of each upstream server (0: no probes; every endpoint is"
        " then taken as healthy). Probes change health only, never the load ledger",
    )
    g.add_argument(
        "--health-check-timeout-secs",
        type=float,
        default=h.timeout_secs,
        help="a probe not answered 2xx within this is a failure",
    )
    g.add_argument(
        "--health-failure-threshold",
        type=int,
        default=h.failure_threshold,
        help="consecutive failed probes that mark an endpoint unhealthy",
    )
    g.add_argument(
        "--health-success-threshold",
        type=int,
        default=h.success_threshold,
        help="consecutive good probes that mark it healthy again",
    )
    a = d.admission
    g.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=a.max_concurrent_requests,
        help="requests served at once (streams count until they end)",
    )
    g.add_argument(
        "--queue-size",
        type=int,
        default=a.queue_size,
        help="requests waiting beyond --max-concurrent-requests (0: answer 429 at once)",
    )
    g.add_argument(
        "--queue-timeout-secs",
        type=float,
        default=a.queue_timeout_secs,
        help="longest wait in the queue (then 408)",
    )

    g = p.add_argument_group("security")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health, /liveness and"
        " /readiness",
    )
    g.add_argument(
        "--upstream-api-key",
        default=None,
        help="send 'Authorization: Bearer KEY' to upstreams instead of the client's header",
    )

    g = p.add_argument_group("observability")
    g.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error", "critical"),
        default=d.log_level,
        help="info: one access line per request; debug: also every routing decision"
        " (stage=... max_load=... min_load=... is_unbalanced=...)",
    )
    g.add_argument(
        "--prometheus-host", default=None, help="also serve /metrics on a separate listener here"
    )
    g.add_argument(
        "--prometheus-port", type=int, default=None, help="port of the separate /metrics listener"
    )
    g.add_argument(
        "--engine-metrics-interval",
        type=float,
        default=d.engine_metrics_interval,
        metavar="SECS",
        help="scrape each upstream's /metrics this often and compare the engines' running and"
        " waiting requests with the router's load ('engine' and 'drift' in /get_loads,"
        " trio_pdrouter_load_drift); 0 turns it off",
    )
    p.add_argument("--release-decode-at-headers", action="store_true", help=argparse.SUPPRESS)
    return p


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    prefill_urls = []
    for group in args.prefill:
        if len(group) > 2:
            raise ConfigError(f"--prefill takes a URL and an optional bootstrap port, got {group}")
        prefill_urls.append(group[0])
    policy_settings = PolicySettings(
        cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        eviction_interval_secs=args.eviction_interval_secs,
        max_tree_size=args.max_tree_size,
    )
    return RouterConfig(
        pd=args.vllm_pd_disaggregation,
        prefill_urls=tuple(prefill_urls),
        decode_urls=tuple(args.decode),
        worker_urls=tuple(args.worker_urls),
        dp_size=args.intra_node_data_parallel_size,
        policy=args.policy,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        policy_settings=policy_settings,
        server=ServerSettings(
            host=args.host,
            port=args.port,
            backlog=args.backlog,
            keep_alive_timeout=args.keep_alive_timeout_secs,
            graceful_timeout=args.graceful_timeout_secs,
        ),
        timeouts=Timeouts(
            connect=args.connect_timeout_secs,
            request=args.request_timeout_secs,
            prefill=args.prefill_timeout_secs,
            first_byte=args.decode_first_byte_timeout_secs,
            idle=args.decode_idle_timeout_secs,
        ),
        release_stranded_kv=args.release_stranded_kv,
        retry=RetrySettings(
            max_retries=1 if args.disable_retries else args.retry_max_retries,
            initial_backoff_ms=args.retry_initial_backoff_ms,
            max_backoff_ms=args.retry_max_backoff_ms,
            backoff_multiplier=args.retry_backoff_multiplier,
            jitter_factor=args.retry_jitter_factor,
        ),
        breaker=BreakerSettings(
            enabled=not args.disable_circuit_breaker,
            failure_threshold=args.cb_failure_threshold,
            success_threshold=args.cb_success_threshold,
            timeout_duration_secs=args.cb_timeout_duration_secs,
            window_duration_secs=args.cb_window_duration_secs,
        ),
        health=HealthSettings(
            endpoint=args.health_check_endpoint,
            interval_secs=args.health_check_interval_secs,
            timeout_secs=args.health_check_timeout_secs,
            failure_threshold=args.health_failure_threshold,
            success_threshold=args.health_success_threshold,
        ),
        admission=AdmissionSettings(
            max_concurrent_requests=args.max_concurrent_requests,
            queue_size=args.queue_size,
            queue_timeout_secs=args.queue_timeout_secs,
        ),
        max_payload_size=args.max_payload_size,
        api_key=args.api_key,
        upstream_api_key=args.upstream_api_key,
        request_id_headers=tuple(h.lower() for h in args.request_id_headers),
        kv_connector=args.kv_connector,
        transport=args.upstream_transport,
        max_buffered_bytes=args.max_buffered_bytes,
        prometheus_host=args.prometheus_host,
        prometheus_port=args.prometheus_port,
        engine_metrics_interval=args.engine_metrics_interval,
        log_level=args.log_level,
        release_decode_at_headers=args.release_decode_at_headers,
    ).validate()


def parse_config(argv: Sequence[str] | None = None) -> RouterConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return config_from_args(args)
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> None:
    from .server import run_router, wait_for_signal

    config = parse_config(argv)
    configure_logging(config.log_level)
    trio.run(lambda: run_router(config, shutdown_trigger=wait_for_signal))
