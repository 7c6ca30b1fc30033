"""Every setting of the router as frozen values, valid by construction.

Each field that a command-line flag sets declares that flag, its default, help and check in one
place (see :mod:`trio_pdrouter.config.flags` for the rules); the fields of :class:`RouterConfig` are
in the order of ``--help``. Building any of these classes, ``attrs.evolve`` included, validates it
and raises :class:`ConfigError` with a message fit for users.
"""

from __future__ import annotations

import argparse
import ipaddress
from typing import Any

import attrs

from ..endpoints import Endpoint, Role, UpstreamPolicy, expand, normalize_url
from .cluster import ClusterSettings
from .discovery import DiscoverySettings
from .flags import ConfigError, Flag, Group, must, non_negative, positive, section, setting
from .kv_events import KvEventSettings
from .listening import ServerSettings, Timeouts
from .policies import POLICY_NAMES, PolicySettings
from .refused import (
    OTHER_CONNECTORS,
    ExtensionSettings,
    ZmqDiscoverySettings,
)
from .resilience import AdmissionSettings, BreakerSettings, HealthSettings, RetrySettings
from .sizes import byte_size, show_size

__all__ = ["RouterConfig"]

KV_CONNECTORS = ("nixl", "p2p_nccl")
TRANSPORTS = ("h11", "httpx")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
#: vllm-router's metrics listener when no --prometheus-host/--prometheus-port is given.
METRICS_HOST = "127.0.0.1"
METRICS_PORT = 29000


def _upstream_urls(instance: Any, field: attrs.Attribute[Any], urls: tuple[str, ...]) -> None:
    """The check of upstream URLs: :func:`normalize_url`'s, as for ``POST /workers``; and each
    server once per role."""
    seen: set[str] = set()
    for url in urls:
        try:
            normalized = normalize_url(url)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if normalized in seen:
            raise ConfigError(f"{normalized} is given twice for the same role")
        seen.add(normalized)


def _networks(instance: Any, field: attrs.Attribute[Any], networks: tuple[str, ...]) -> None:
    for net in networks:
        try:
            ipaddress.ip_network(net, strict=False)
        except ValueError as exc:
            raise ConfigError(f"--allowed-upstream-networks: {exc}") from None


def _prefill_urls(groups: list[list[str]]) -> tuple[str, ...]:
    """``--prefill URL [BOOTSTRAP_PORT]``, repeated: the URLs (the port is vllm-router's)."""
    for group in groups:
        if len(group) > 2:
            raise ConfigError(f"--prefill takes a URL and an optional bootstrap port, got {group}")
    return tuple(group[0] for group in groups)


def _lower_case(names: list[str]) -> tuple[str, ...]:
    return tuple(name.lower() for name in names)


@attrs.frozen
class RouterConfig:
    # -- listening
    server: ServerSettings = section(ServerSettings)
    # -- upstreams
    pd: bool = setting(
        False,
        Flag(
            "--vllm-pd-disaggregation",
            Group.UPSTREAMS,
            "PD mode: every request runs a prefill leg, then a decode leg (NIXL handshake)",
            action="store_true",
        ),
    )
    prefill_urls: tuple[str, ...] = setting(
        (),
        Flag(
            "--prefill",
            Group.UPSTREAMS,
            "prefill server URL; repeat for several. A bootstrap port after the URL is accepted"
            " for compatibility and ignored (the NIXL connector does not use it)",
            nargs="+",
            action="append",
            metavar=("URL", "BOOTSTRAP_PORT"),
            parse=_prefill_urls,
        ),
        check=_upstream_urls,
    )
    decode_urls: tuple[str, ...] = setting(
        (),
        Flag(
            "--decode",
            Group.UPSTREAMS,
            "decode server URL; repeat for several",
            action="append",
            metavar="URL",
            parse=tuple,
        ),
        check=_upstream_urls,
    )
    worker_urls: tuple[str, ...] = setting(
        (),
        Flag(
            "--worker-urls",
            Group.UPSTREAMS,
            "regular mode: servers that take whole requests",
            nargs="*",
            metavar="URL",
            parse=tuple,
        ),
        check=_upstream_urls,
    )
    dp_size: int = setting(
        1,
        Flag(
            "--intra-node-data-parallel-size",
            Group.UPSTREAMS,
            "data-parallel engines per server: each URL becomes endpoints url@0..url@N-1,"
            " each with its own load, addressed with the X-data-parallel-rank header",
            type=int,
        ),
        check=must(lambda n: n >= 1, "must be at least 1"),
    )
    max_runtime_servers: int = setting(
        256,
        Flag(
            "--max-runtime-servers",
            Group.UPSTREAMS,
            "servers (a URL in one role) that POST /workers and --service-discovery may add,"
            " per process; past it an add answers 503 and discovery logs the pod it skipped",
            type=int,
        ),
        check=must(lambda n: n >= 0, "must be 0 or more"),
    )
    kv_connector: str = setting(
        "nixl",
        Flag(
            "--kv-connector",
            Group.UPSTREAMS,
            "vLLM KV connector: nixl (pull-based), or p2p_nccl (request ids carry both"
            " peers' addresses)",
            choices=KV_CONNECTORS,
            refused_choices={"mooncake": OTHER_CONNECTORS, "moriio": OTHER_CONNECTORS},
        ),
    )
    transport: str = setting(
        "h11",
        Flag(
            "--upstream-transport",
            Group.UPSTREAMS,
            "HTTP client pool for upstreams: h11 (ours; closes a connection the moment its"
            " request is abandoned) or httpx (httpx's stock pool, for comparison)",
            choices=TRANSPORTS,
        ),
    )
    # -- routing policy
    policy: str = setting(
        "cache_aware",
        Flag(
            "--policy",
            Group.ROUTING_POLICY,
            "policy of every stage",
            choices=POLICY_NAMES,
        ),
    )
    prefill_policy: str | None = setting(
        None,
        Flag(
            "--prefill-policy",
            Group.ROUTING_POLICY,
            "override --policy for prefill",
            choices=POLICY_NAMES,
        ),
    )
    decode_policy: str | None = setting(
        None,
        Flag(
            "--decode-policy",
            Group.ROUTING_POLICY,
            "override --policy for decode",
            choices=POLICY_NAMES,
        ),
    )
    policy_settings: PolicySettings = section(PolicySettings)
    # -- requests
    max_payload_size: int = setting(
        512 * 1024 * 1024,
        Flag(
            "--max-payload-size",
            Group.REQUESTS,
            "largest request body accepted (larger: 413)",
            type=byte_size,
            show=show_size,
            metavar="SIZE",
        ),
        check=positive,
    )
    timeouts: Timeouts = section(Timeouts)
    #: If the client leaves after prefill answered but before decode answered, send decode a
    #: one-token request with the prefill's KV params, so the prefill engine frees its blocks
    #: now instead of at vLLM's KV timeout.
    release_stranded_kv: bool = setting(
        True,
        Flag(
            "--release-stranded-kv",
            Group.REQUESTS,
            "when a request is done with a prefill's KV blocks that no decode took (decode"
            " refused or failed, the client left), send a decode a one-token request with the"
            " same kv_transfer_params so the prefill engine frees them at once",
            action=argparse.BooleanOptionalAction,
        ),
    )
    models_refresh_interval: float = setting(
        30.0,
        Flag(
            "--models-refresh-interval",
            Group.UPSTREAMS,
            "ask every healthy server's GET /v1/models (its models and LoRA adapters) this"
            " often; they are also asked when a server turns healthy and after an adapter is"
            " loaded or unloaded through the router; 0: not on a schedule",
            type=float,
            metavar="SECS",
        ),
        check=must(lambda s: s >= 0, "must be 0 (off) or a positive number"),
    )
    check_context_length: bool = setting(
        True,
        Flag(
            "--check-context-length",
            Group.REQUESTS,
            "refuse (vLLM's 400) a completion or chat whose prompt + max_tokens fits no"
            " candidate's max_model_len (from GET /v1/models), before any engine runs it;"
            " text is counted by an engine's /tokenize, only when its bytes could not fit",
            action=argparse.BooleanOptionalAction,
        ),
    )
    request_id_headers: tuple[str, ...] = setting(
        ("x-request-id", "x-correlation-id", "x-trace-id", "request-id"),
        Flag(
            "--request-id-headers",
            Group.REQUESTS,
            "client headers to take the request id from, first present wins",
            nargs="*",
            metavar="HEADER",
            parse=_lower_case,
        ),
    )
    #: Bytes of decode output the router buffers for a client that reads slower than the engine
    #: writes; past it the client is treated as gone (the engine is aborted, the load released).
    max_buffered_bytes: int = setting(
        4 * 1024 * 1024,
        Flag(
            "--max-buffered-bytes",
            Group.REQUESTS,
            "decode output held for a client reading slower than the engine writes; past it"
            " the request is aborted upstream",
            type=byte_size,
            show=show_size,
            metavar="SIZE",
        ),
    )
    max_total_buffered_bytes: int = setting(
        256 * 1024 * 1024,
        Flag(
            "--max-total-buffered-bytes",
            Group.REQUESTS,
            "decode output held for all clients together; past it the streams furthest"
            " behind are ended (aborted upstream) until the total fits",
            type=byte_size,
            show=show_size,
            metavar="SIZE",
        ),
        check=positive,
    )
    max_upstream_answer_bytes: int = setting(
        64 * 1024 * 1024,
        Flag(
            "--max-upstream-answer-bytes",
            Group.REQUESTS,
            "largest answer read from an engine in one piece (a prefill answer, a non-streaming"
            " answer); past it the leg fails with a 502 instead of filling the router's memory",
            type=byte_size,
            show=show_size,
            metavar="SIZE",
        ),
        check=positive,
    )
    #: Pass-through streams after their first event go through one task per process (the
    #: relay pump) instead of each request's own task.
    no_relay_pump: bool = setting(
        False,
        Flag(
            "--no-relay-pump",
            Group.REQUESTS,
            "relay every stream from its own request's task instead of the per-process pump",
            action="store_true",
        ),
    )
    relay_pump_max_delay_ms: float = setting(
        2.0,
        Flag(
            "--relay-pump-max-delay-ms",
            Group.REQUESTS,
            "longest the relay pump holds an event to batch it with others under heavy load"
            " (0: forward each at once)",
            type=float,
            metavar="MS",
        ),
        check=non_negative,
    )
    #: Test-only: reproduce the historic bug (decode load released when its headers arrive).
    release_decode_at_headers: bool = setting(
        False,
        Flag(
            "--release-decode-at-headers",
            Group.REQUESTS,
            "release decode load at its response headers (a historic bug, for tests)",
            action="store_true",
            hidden=True,
        ),
    )
    # -- resilience
    retry: RetrySettings = section(RetrySettings)
    breaker: BreakerSettings = section(BreakerSettings)
    health: HealthSettings = section(HealthSettings)
    admission: AdmissionSettings = section(AdmissionSettings)
    # -- cluster
    cluster: ClusterSettings = section(ClusterSettings)
    # -- kubernetes service discovery
    discovery: DiscoverySettings = section(DiscoverySettings)
    # -- security
    api_key: str | None = setting(
        None,
        Flag(
            "--api-key",
            Group.SECURITY,
            "require 'Authorization: Bearer KEY' on every route but /health, /healthcheck,"
            " /liveness and /readiness",
        ),
    )
    admin_api_key: str | None = setting(
        None,
        Flag(
            "--admin-api-key",
            Group.SECURITY,
            "require 'Authorization: Bearer KEY' (this key, not --api-key's) on the routes that"
            " change the router (POST /workers, DELETE /workers/...) and on /debug/*; without"
            " it those routes answer 403, unless --admin-from-loopback",
        ),
    )
    admin_from_loopback: bool = setting(
        False,
        Flag(
            "--admin-from-loopback",
            Group.SECURITY,
            "allow the admin routes from 127.0.0.0/8 and ::1 without --admin-api-key's key",
            action="store_true",
        ),
    )
    allowed_upstream_networks: tuple[str, ...] = setting(
        (),
        Flag(
            "--allowed-upstream-networks",
            Group.SECURITY,
            "networks (CIDR) servers added at run time must be in (POST /workers, discovered"
            " pods; names are then refused); command-line servers must be in them too. Link-local"
            " (cloud metadata), unspecified, broadcast and multicast addresses are refused at run"
            " time whatever this says",
            nargs="*",
            metavar="CIDR",
            parse=tuple,
        ),
        check=_networks,
    )
    cors_allowed_origins: tuple[str, ...] = setting(
        (),
        Flag(
            "--cors-allowed-origins",
            Group.SECURITY,
            "origins browsers may call the router from (CORS headers and preflight answers);"
            " none given: any origin, as in vllm-router",
            nargs="*",
            metavar="ORIGIN",
            parse=tuple,
        ),
    )
    upstream_api_key: str | None = setting(
        None,
        Flag(
            "--upstream-api-key",
            Group.SECURITY,
            "send 'Authorization: Bearer KEY' to upstreams instead of the client's header",
        ),
    )
    # -- observability
    log_level: str = setting(
        "info",
        Flag(
            "--log-level",
            Group.OBSERVABILITY,
            "info: one access line per request; debug: also every routing decision"
            " (stage=... max_load=... min_load=... is_unbalanced=...)",
            choices=LOG_LEVELS,
        ),
    )
    otlp_traces_endpoint: str | None = setting(
        None,
        Flag(
            "--otlp-traces-endpoint",
            Group.OBSERVABILITY,
            "export a span per request and per upstream call to this OTLP/HTTP collector"
            " (http://host:4318, or its full /v1/traces URL), and send each engine the"
            " traceparent of its call; OTEL_* variables configure the exporter. Needs the"
            " otel extra (pip install 'trio-pdrouter[otel]')",
        ),
    )
    otlp_traces_sample_ratio: float = setting(
        1.0,
        Flag(
            "--otlp-traces-sample-ratio",
            Group.OBSERVABILITY,
            "share of new traces sampled (0 to 1); a client's traceparent decides for its own",
            type=float,
        ),
        check=must(lambda r: 0.0 <= r <= 1.0, "must be between 0 and 1"),
    )
    log_format: str = setting(
        "text",
        Flag(
            "--log-format",
            Group.OBSERVABILITY,
            "text: one line of key=value pairs per event; json: one JSON object per line"
            " (ts in UTC, level, logger, message, and each access line's fields as keys)",
            choices=("text", "json"),
        ),
    )
    log_dir: str | None = setting(
        None,
        Flag(
            "--log-dir",
            Group.OBSERVABILITY,
            "also write the log to <dir>/trio-pdrouter.<YYYY-MM-DD>, a file per UTC day",
        ),
    )
    expose_routing_headers: bool = setting(
        False,
        Flag(
            "--expose-routing-headers",
            Group.OBSERVABILITY,
            "add x-trio-pdrouter-prefill/-decode/-worker (the endpoints chosen, internal"
            " addresses) and x-trio-pdrouter-kv to every answer; off: a client sees x-request-id"
            " only",
            action="store_true",
        ),
    )
    prometheus_host: str = setting(
        METRICS_HOST,
        Flag(
            "--prometheus-host",
            Group.OBSERVABILITY,
            "address of the separate /metrics listener (vllm-router's default)",
        ),
    )
    prometheus_port: int | None = setting(
        None,
        Flag(
            "--prometheus-port",
            Group.OBSERVABILITY,
            f"port of the separate /metrics listener (0: any free port). Not given:"
            f" {METRICS_PORT}, vllm-router's default, opened when free (a warning says so when"
            f" not); given: the router does not start without it",
            type=int,
        ),
        check=must(lambda p: 0 <= p <= 65535, "must be a port number (0-65535)"),
    )
    prometheus_listener: bool = setting(
        True,
        Flag(
            "--prometheus-listener",
            Group.OBSERVABILITY,
            "open the separate /metrics listener (--no-prometheus-listener: /metrics on the"
            " main port only)",
            action=argparse.BooleanOptionalAction,
        ),
    )
    #: Seconds between scrapes of each upstream's ``/metrics`` (engine truth); 0 = off.
    engine_metrics_interval: float = setting(
        1.0,
        Flag(
            "--engine-metrics-interval",
            Group.OBSERVABILITY,
            "scrape each upstream's /metrics this often and compare the engines' running and"
            " waiting requests with the router's load ('engine' and 'drift' in /get_loads,"
            " trio_pdrouter_load_drift); 0 turns it off",
            type=float,
            metavar="SECS",
        ),
        check=must(lambda s: s >= 0, "must be 0 (off) or a positive number"),  # refuses NaN
    )
    kv_events: KvEventSettings = section(KvEventSettings)
    # -- vllm-router flags for what is not implemented (see trio_pdrouter.config.refused)
    zmq_discovery: ZmqDiscoverySettings = section(ZmqDiscoverySettings)
    extensions: ExtensionSettings = section(ExtensionSettings)

    def __attrs_post_init__(self) -> None:
        """The checks that involve several fields: which upstreams the mode needs (a role's
        servers come from the command line, or from discovery with that role's selector), the
        command line's servers inside --allowed-upstream-networks, and a metrics port given
        with the listener turned off."""
        if self.prometheus_port is not None and not self.prometheus_listener:
            raise ConfigError("--prometheus-port cannot be combined with --no-prometheus-listener")
        policy = self.upstream_policy()
        for urls in (self.prefill_urls, self.decode_urls, self.worker_urls):
            for url in urls:
                try:
                    policy.check_configured(normalize_url(url))
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
        discovered = self.discovery.selectors(self.pd)
        if self.pd:
            if not (self.prefill_urls or Role.PREFILL in discovered) or not (
                self.decode_urls or Role.DECODE in discovered
            ):
                raise ConfigError(
                    "--vllm-pd-disaggregation needs at least one --prefill and one --decode URL"
                    " (or --service-discovery with --prefill-selector and --decode-selector)"
                )
            if self.worker_urls:
                raise ConfigError("--worker-urls cannot be combined with --vllm-pd-disaggregation")
        elif not self.worker_urls and not discovered:
            if self.prefill_urls or self.decode_urls:
                raise ConfigError("--prefill/--decode need --vllm-pd-disaggregation")
            raise ConfigError(
                "no upstream: give --worker-urls URL..., or --vllm-pd-disaggregation with"
                " --prefill URL and --decode URL, or --service-discovery"
            )

    def upstream_policy(self) -> UpstreamPolicy:
        """Which upstream addresses may be added (``--allowed-upstream-networks``)."""
        nets = self.allowed_upstream_networks
        return UpstreamPolicy(tuple(ipaddress.ip_network(net, strict=False) for net in nets))

    def metrics_listener(self) -> tuple[str, int, bool] | None:
        """Where the separate ``/metrics`` listener goes: host, port and whether it must open
        (a port given); None with ``--no-prometheus-listener``."""
        if self.prometheus_port is not None:
            return self.prometheus_host, self.prometheus_port, True
        if not self.prometheus_listener:
            return None
        return self.prometheus_host, METRICS_PORT, False

    def stage_policy(self, role: Role) -> str:
        if role is Role.PREFILL and self.prefill_policy:
            return self.prefill_policy
        if role is Role.DECODE and self.decode_policy:
            return self.decode_policy
        return self.policy

    def token_roles(self) -> list[Role]:
        """The roles whose load metric is ``tokens``."""
        metric = self.policy_settings.stage_load_metric
        return [role for role in self.servers() if metric(role.value) == "tokens"]

    def servers(self) -> dict[Role, tuple[str, ...]]:
        """The server URLs of each role of this mode, as given."""
        if self.pd:
            return {Role.PREFILL: self.prefill_urls, Role.DECODE: self.decode_urls}
        return {Role.REGULAR: self.worker_urls}

    def endpoints(self) -> dict[Role, tuple[Endpoint, ...]]:
        """Every endpoint per role, DP ranks expanded."""
        return {role: expand(urls, role, self.dp_size) for role, urls in self.servers().items()}
