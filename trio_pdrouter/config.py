"""Every setting of the router as frozen values, validated once with messages fit for users."""

from __future__ import annotations

import attrs

from .endpoints import Endpoint, Role, expand
from .policies import POLICY_NAMES, PolicySettings

KV_CONNECTORS = ("nixl", "p2p_nccl")
TRANSPORTS = ("h11", "httpx")


class ConfigError(ValueError):
    """A setting that cannot work; the message says which and why."""


@attrs.frozen
class Timeouts:
    """Upstream time limits in seconds.

    ``--request-timeout-secs`` is the default of the three limits below; none of them bounds a
    stream that keeps producing, however long it runs:

    * ``prefill``: the whole prefill leg (request sent, JSON answer read);
    * ``first_byte``: from sending the decode leg to its response head (for a non-streaming
      request, which vLLM answers in one piece, that is the whole answer);
    * ``idle``: the longest gap between two reads of a decode stream.

    A limit hit before the client got a byte is a 504 (and may be retried); after, the stream
    ends with an SSE error event and ``[DONE]``.
    """

    connect: float = 10.0
    request: float = 1800.0
    prefill: float | None = None
    first_byte: float | None = None
    idle: float | None = None

    @property
    def prefill_limit(self) -> float:
        return self.request if self.prefill is None else self.prefill

    @property
    def first_byte_limit(self) -> float:
        return self.request if self.first_byte is None else self.first_byte

    @property
    def idle_limit(self) -> float:
        return self.request if self.idle is None else self.idle


@attrs.frozen
class RetrySettings:
    #: Attempts per request in all (vllm-router's meaning: 1 = no retry).
    max_retries: int = 5
    initial_backoff_ms: int = 50
    max_backoff_ms: int = 30_000
    backoff_multiplier: float = 1.5
    jitter_factor: float = 0.2


@attrs.frozen
class BreakerSettings:
    enabled: bool = True
    failure_threshold: int = 10
    success_threshold: int = 3
    timeout_duration_secs: float = 60.0
    window_duration_secs: float = 120.0


@attrs.frozen
class HealthSettings:
    endpoint: str = "/health"
    interval_secs: float = 60.0
    timeout_secs: float = 5.0
    failure_threshold: int = 3
    success_threshold: int = 2


@attrs.frozen
class AdmissionSettings:
    max_concurrent_requests: int = 32768
    queue_size: int = 100
    queue_timeout_secs: float = 60.0


@attrs.frozen
class ServerSettings:
    """How hypercorn listens."""

    host: str = "127.0.0.1"
    port: int = 30000
    backlog: int = 2048
    keep_alive_timeout: float = 75.0
    graceful_timeout: float = 30.0
    max_header_bytes: int = 64 * 1024


@attrs.frozen
class RouterConfig:
    pd: bool = False
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    worker_urls: tuple[str, ...] = ()
    dp_size: int = 1
    policy: str = "cache_aware"
    prefill_policy: str | None = None
    decode_policy: str | None = None
    policy_settings: PolicySettings = attrs.field(factory=PolicySettings)
    server: ServerSettings = attrs.field(factory=ServerSettings)
    timeouts: Timeouts = attrs.field(factory=Timeouts)
    retry: RetrySettings = attrs.field(factory=RetrySettings)
    breaker: BreakerSettings = attrs.field(factory=BreakerSettings)
    health: HealthSettings = attrs.field(factory=HealthSettings)
    admission: AdmissionSettings = attrs.field(factory=AdmissionSettings)
    max_payload_size: int = 512 * 1024 * 1024
    api_key: str | None = None
    upstream_api_key: str | None = None
    request_id_headers: tuple[str, ...] = ("x-request-id", "x-correlation-id", "x-trace-id")
    kv_connector: str = "nixl"
    transport: str = "h11"
    #: Bytes of decode output the router buffers for a client that reads slower than the engine
    #: writes; past it the client is treated as gone (the engine is aborted, the load released).
    max_buffered_bytes: int = 16 * 1024 * 1024
    #: If the client leaves after prefill answered but before decode answered, send decode a
    #: one-token request with the prefill's KV params, so the prefill engine frees its blocks
    #: now instead of at vLLM's KV timeout.
    release_stranded_kv: bool = True
    prometheus_host: str | None = None
    prometheus_port: int | None = None
    #: Seconds between scrapes of each upstream's ``/metrics`` (engine truth); 0 = off.
    engine_metrics_interval: float = 1.0
    log_level: str = "info"
    #: Test-only: reproduce the historic bug (decode load released when its headers arrive).
    release_decode_at_headers: bool = False

    def stage_policy(self, role: Role) -> str:
        if role is Role.PREFILL and self.prefill_policy:
            return self.prefill_policy
        if role is Role.DECODE and self.decode_policy:
            return self.decode_policy
        return self.policy

    def servers(self) -> dict[Role, tuple[str, ...]]:
        """The server URLs of each role of this mode, as given."""
        if self.pd:
            return {Role.PREFILL: self.prefill_urls, Role.DECODE: self.decode_urls}
        return {Role.REGULAR: self.worker_urls}

    def endpoints(self) -> dict[Role, tuple[Endpoint, ...]]:
        """Every endpoint per role, DP ranks expanded."""
        return {role: expand(urls, role, self.dp_size) for role, urls in self.servers().items()}

    def validate(self) -> RouterConfig:
        """Raise :class:`ConfigError` for settings that cannot work; return self."""
        if self.pd:
            if not self.prefill_urls or not self.decode_urls:
                raise ConfigError(
                    "--vllm-pd-disaggregation needs at least one --prefill and one --decode URL"
                )
            if self.worker_urls:
                raise ConfigError("--worker-urls cannot be combined with --vllm-pd-disaggregation")
        elif not self.worker_urls:
            if self.prefill_urls or self.decode_urls:
                raise ConfigError("--prefill/--decode need --vllm-pd-disaggregation")
            raise ConfigError(
                "no upstream: give --worker-urls URL..., or --vllm-pd-disaggregation with"
                " --prefill URL and --decode URL"
            )
        if self.dp_size < 1:
            raise ConfigError("--intra-node-data-parallel-size must be at least 1")
        for name in (self.policy, self.prefill_policy, self.decode_policy):
            if name is not None and name not in POLICY_NAMES:
                raise ConfigError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
        s = self.policy_settings
        if not 0.0 <= s.cache_threshold <= 1.0:
            raise ConfigError("--cache-threshold must be between 0.0 and 1.0")
        if s.max_tree_size < 1:
            raise ConfigError("--max-tree-size must be positive")
        if self.kv_connector not in KV_CONNECTORS:
            raise ConfigError(
                f"--kv-connector {self.kv_connector!r} is not supported; choose from"
                f" {', '.join(KV_CONNECTORS)}"
            )
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"--upstream-transport must be one of {', '.join(TRANSPORTS)}")
        if self.max_payload_size < 1:
            raise ConfigError("--max-payload-size must be positive")
        t = self.timeouts
        if min(t.request, t.connect, t.prefill_limit, t.first_byte_limit, t.idle_limit) <= 0:
            raise ConfigError("timeouts must be positive")
        if self.retry.max_retries < 1:
            raise ConfigError("--retry-max-retries must be at least 1 (1 = no retry)")
        if not self.engine_metrics_interval >= 0:  # also refuses NaN
            raise ConfigError("--engine-metrics-interval must be 0 (off) or a positive number")
        try:
            self.endpoints()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return self
