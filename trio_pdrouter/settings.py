"""The sections of the router's configuration: listening, time limits, retries, circuit
breakers, health checks, admission and the cluster view. Each field that a flag sets declares it
(see :mod:`trio_pdrouter.flags`); :class:`~trio_pdrouter.config.RouterConfig` holds one of each.
"""

from __future__ import annotations

import socket

import attrs

from .flags import Flag, Group, Switch, must, positive, setting

WORKER_SOCKETS = ("shared", "reuseport")


@attrs.frozen
class ServerSettings:
    """How hypercorn listens."""

    host: str = setting("127.0.0.1", Flag("--host", Group.LISTENING, "address to listen on"))
    port: int = setting(30000, Flag("--port", Group.LISTENING, "port to listen on", type=int))
    backlog: int = setting(2048, Flag("--backlog", Group.LISTENING, "listen backlog", type=int))
    keep_alive_timeout: float = setting(
        75.0,
        Flag(
            "--keep-alive-timeout-secs",
            Group.LISTENING,
            "close idle client connections after this many seconds",
            type=float,
        ),
    )
    graceful_timeout: float = setting(
        30.0,
        Flag(
            "--graceful-timeout-secs",
            Group.LISTENING,
            "on SIGTERM/SIGINT, stop accepting and let in-flight requests finish for this long;"
            " then each stream ends with an error event (503) and [DONE], every other request"
            " gets a 503, and the process exits within a second more whatever clients do",
            type=float,
        ),
    )
    workers: int = setting(
        1,
        Flag(
            "--workers",
            Group.LISTENING,
            "router processes serving the port, with one machine-wide load ledger in shared"
            " memory; a supervisor restarts any that dies. 1: a single process, no supervisor",
            type=int,
        ),
        check=must(lambda n: n >= 1, "must be at least 1"),
    )
    worker_sockets: str = setting(
        "shared",
        Flag(
            "--worker-sockets",
            Group.LISTENING,
            "with --workers N: one listening socket all workers accept from (shared), or one"
            " SO_REUSEPORT socket per worker (reuseport)",
            choices=WORKER_SOCKETS,
        ),
    )
    body_timeout: float = setting(
        60.0,
        Flag(
            "--request-body-timeout-secs",
            Group.LISTENING,
            "a request body must arrive whole within this time, else 408 and the connection"
            " closes (a body trickled byte by byte holds no slot forever)",
            type=float,
        ),
        check=positive,
    )
    write_timeout: float = setting(
        30.0,
        Flag(
            "--client-write-timeout-secs",
            Group.LISTENING,
            "a client that accepts no byte of its answer for this long is cut off: its request"
            " ends (outcome client_stalled) and its connection closes; 0: never",
            type=float,
        ),
        check=must(lambda v: v >= 0, "must be 0 (never) or more"),
    )
    #: The request line plus headers, counted as they arrived (a larger head gets 431).
    max_header_bytes: int = 64 * 1024


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

    request: float = setting(
        1800.0,
        Flag(
            "--request-timeout-secs",
            Group.REQUESTS,
            "bounds the prefill leg, the wait for decode's first byte, and every gap between"
            " decode chunks; never a stream that keeps producing",
            type=float,
        ),
        check=positive,
    )
    prefill: float | None = setting(
        None,
        Flag(
            "--prefill-timeout-secs",
            Group.REQUESTS,
            "limit on the whole prefill leg (default: --request-timeout-secs)",
            type=float,
        ),
        check=positive,
    )
    first_byte: float | None = setting(
        None,
        Flag(
            "--decode-first-byte-timeout-secs",
            Group.REQUESTS,
            "limit from sending the decode leg to its first byte; for a non-streaming request"
            " that is the whole answer (default: --request-timeout-secs)",
            type=float,
        ),
        check=positive,
    )
    idle: float | None = setting(
        None,
        Flag(
            "--decode-idle-timeout-secs",
            Group.REQUESTS,
            "longest gap between two chunks of a decode stream (default: --request-timeout-secs)",
            type=float,
        ),
        check=positive,
    )
    connect: float = setting(
        10.0,
        Flag(
            "--connect-timeout-secs",
            Group.REQUESTS,
            "time to open a connection to an upstream",
            type=float,
        ),
        check=positive,
    )

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
    max_retries: int = setting(
        5,
        Flag(
            "--retry-max-retries",
            Group.RESILIENCE,
            "attempts per request in all (1 = no retry). Prefill is retried on another"
            " endpoint after connection errors, 5xx, 429 and timeouts; decode only before the"
            " client got a byte, then on another decode with the prefill's KV blocks",
            type=int,
        ),
        switch=Switch(
            "--disable-retries",
            Group.RESILIENCE,
            "one attempt per request (as --retry-max-retries 1)",
            sets=1,
        ),
        check=must(lambda n: n >= 1, "must be at least 1 (1 = no retry)"),
    )
    initial_backoff_ms: int = setting(
        50,
        Flag(
            "--retry-initial-backoff-ms",
            Group.RESILIENCE,
            "wait before the first retry; each later wait is multiplied by"
            " --retry-backoff-multiplier",
            type=int,
        ),
    )
    max_backoff_ms: int = setting(
        30_000,
        Flag("--retry-max-backoff-ms", Group.RESILIENCE, "longest wait between attempts", type=int),
    )
    backoff_multiplier: float = setting(
        1.5,
        Flag(
            "--retry-backoff-multiplier",
            Group.RESILIENCE,
            "growth of the wait from one retry to the next",
            type=float,
        ),
    )
    jitter_factor: float = setting(
        0.2,
        Flag(
            "--retry-jitter-factor",
            Group.RESILIENCE,
            "each wait is varied at random by up to this fraction, so retries do not march in step",
            type=float,
        ),
    )


@attrs.frozen
class BreakerSettings:
    failure_threshold: int = setting(
        10,
        Flag(
            "--cb-failure-threshold",
            Group.RESILIENCE,
            "failures within the window that open an endpoint's circuit",
            type=int,
        ),
    )
    success_threshold: int = setting(
        3,
        Flag(
            "--cb-success-threshold",
            Group.RESILIENCE,
            "half-open successes that close the circuit again",
            type=int,
        ),
    )
    timeout_duration_secs: float = setting(
        60.0,
        Flag(
            "--cb-timeout-duration-secs",
            Group.RESILIENCE,
            "how long a circuit stays open before a trial request",
            type=float,
        ),
    )
    window_duration_secs: float = setting(
        120.0,
        Flag(
            "--cb-window-duration-secs",
            Group.RESILIENCE,
            "window over which failures are counted",
            type=float,
        ),
    )
    enabled: bool = setting(
        True,
        switch=Switch(
            "--disable-circuit-breaker",
            Group.RESILIENCE,
            "never take an endpoint out of rotation for its failures (health checks still do)",
            sets=False,
        ),
    )


@attrs.frozen
class HealthSettings:
    endpoint: str = setting(
        "/health", Flag("--health-check-endpoint", Group.RESILIENCE, "path probed on upstreams")
    )
    interval_secs: float = setting(
        60.0,
        Flag(
            "--health-check-interval-secs",
            Group.RESILIENCE,
            "seconds between probes of each upstream server (0: no probes; every endpoint is"
            " then taken as healthy). Probes change health only, never the load ledger",
            type=float,
        ),
    )
    timeout_secs: float = setting(
        5.0,
        Flag(
            "--health-check-timeout-secs",
            Group.RESILIENCE,
            "a probe not answered 2xx within this is a failure",
            type=float,
        ),
    )
    failure_threshold: int = setting(
        3,
        Flag(
            "--health-failure-threshold",
            Group.RESILIENCE,
            "consecutive failed probes that mark an endpoint unhealthy",
            type=int,
        ),
    )
    success_threshold: int = setting(
        2,
        Flag(
            "--health-success-threshold",
            Group.RESILIENCE,
            "consecutive good probes that mark it healthy again",
            type=int,
        ),
    )
    startup_timeout_secs: float = setting(
        600.0,
        Flag(
            "--worker-startup-timeout-secs",
            Group.RESILIENCE,
            "at start, wait this long for every configured server to answer its health check;"
            " then exit 1 naming those that did not (0: start without waiting)",
            type=float,
        ),
        check=must(lambda s: s >= 0, "must be 0 (no wait) or a positive number"),
    )
    startup_check_interval: float = setting(
        30.0,
        Flag(
            "--worker-startup-check-interval",
            Group.RESILIENCE,
            "seconds between health checks while waiting for the servers at start",
            type=float,
        ),
        check=positive,
    )


@attrs.frozen
class AdmissionSettings:
    max_concurrent_requests: int = setting(
        32768,
        Flag(
            "--max-concurrent-requests",
            Group.RESILIENCE,
            "requests served at once (streams count until they end)",
            type=int,
        ),
    )
    queue_size: int = setting(
        100,
        Flag(
            "--queue-size",
            Group.RESILIENCE,
            "requests waiting beyond --max-concurrent-requests (0: answer 429 at once)",
            type=int,
        ),
    )
    queue_timeout_secs: float = setting(
        60.0,
        Flag(
            "--queue-timeout-secs",
            Group.RESILIENCE,
            "longest wait in the queue (then 408)",
            type=float,
        ),
    )
    rate_limit_tokens_per_second: int | None = setting(
        None,
        Flag(
            "--rate-limit-tokens-per-second",
            Group.RESILIENCE,
            "admit at most this many requests per second on average (a token bucket of"
            " --max-concurrent-requests tokens); beyond it, 429 with Retry-After",
            type=int,
        ),
        check=positive,
    )


#: What ``--cluster-url`` may start with (coredis' URL schemes; ``rediss`` is TLS).
CLUSTER_SCHEMES = ("redis://", "rediss://", "unix://")


@attrs.frozen
class ClusterSettings:
    """The cluster-wide load view across replicas through one Redis/Valkey (off without a URL).

    Every ``sync_ms`` each replica writes its ledger's counts to its own key, which expires after
    :attr:`ttl`, and reads its peers' keys in the same round trip.
    """

    url: str | None = setting(
        None,
        Flag(
            "--cluster-url",
            Group.CLUSTER,
            "share loads with the other replicas through this Redis or Valkey"
            " (redis://[user:password@]host:port/db; rediss:// for TLS); unset: this replica"
            " routes on its own counts only",
            metavar="REDIS_URL",
        ),
        check=must(
            lambda u: u.startswith(CLUSTER_SCHEMES),
            "must start with redis://, rediss:// or unix://",
        ),
    )
    sync_ms: int = setting(
        50,
        Flag(
            "--cluster-sync-ms",
            Group.CLUSTER,
            "publish this replica's loads and read the peers' this often (milliseconds); a"
            " replica that stops publishing counts 0 after 4 intervals (at least 0.5 s)",
            type=int,
            metavar="MS",
        ),
        check=positive,
    )
    replica_id: str | None = setting(
        None,
        Flag(
            "--replica-id",
            Group.CLUSTER,
            "this replica's name in the store and in /get_loads (default: hostname:port); every"
            " replica needs its own",
            metavar="ID",
        ),
        check=must(bool, "must not be empty"),
    )

    @property
    def interval(self) -> float:
        return self.sync_ms / 1000

    @property
    def ttl(self) -> float:
        """How long a published snapshot counts: four sync intervals, and at least 0.5 s, so a
        replica whose event loop is busy for a moment does not vanish from its peers' view."""
        return max(4 * self.interval, 0.5)

    def replica(self, port: int) -> str:
        return self.replica_id or f"{socket.gethostname()}:{port}"
