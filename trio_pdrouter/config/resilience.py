"""What the router does when things fail: retries, circuit breakers, health checks, admission.

Each field that a flag sets declares it (see :mod:`.flags`); :class:`~.router.RouterConfig`
holds one of each section.
"""

from __future__ import annotations

import attrs

from .flags import Flag, Group, Switch, must, positive, setting


@attrs.frozen
class RetrySettings:
    #: Attempts per request in all (vllm-router's meaning: 1 = no retry).
    max_retries: int = setting(
        5,
        Flag(
            "--retry-max-retries",
            Group.RETRIES,
            "attempts per request in all (1 = no retry). Prefill is retried on another"
            " endpoint after connection errors, 5xx, 429 and timeouts; decode only before the"
            " client got a byte, then on another decode with the prefill's KV blocks",
            type=int,
        ),
        switch=Switch(
            "--disable-retries",
            Group.RETRIES,
            "one attempt per request (as --retry-max-retries 1)",
            sets=1,
        ),
        check=must(lambda n: n >= 1, "must be at least 1 (1 = no retry)"),
    )
    initial_backoff_ms: int = setting(
        50,
        Flag(
            "--retry-initial-backoff-ms",
            Group.RETRIES,
            "wait before the first retry; each later wait is multiplied by"
            " --retry-backoff-multiplier",
            type=int,
        ),
    )
    max_backoff_ms: int = setting(
        30_000,
        Flag("--retry-max-backoff-ms", Group.RETRIES, "longest wait between attempts", type=int),
    )
    backoff_multiplier: float = setting(
        1.5,
        Flag(
            "--retry-backoff-multiplier",
            Group.RETRIES,
            "growth of the wait from one retry to the next",
            type=float,
        ),
    )
    jitter_factor: float = setting(
        0.2,
        Flag(
            "--retry-jitter-factor",
            Group.RETRIES,
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
            Group.CIRCUIT_BREAKERS,
            "failures within the window that open an endpoint's circuit",
            type=int,
        ),
    )
    success_threshold: int = setting(
        3,
        Flag(
            "--cb-success-threshold",
            Group.CIRCUIT_BREAKERS,
            "half-open successes that close the circuit again",
            type=int,
        ),
    )
    timeout_duration_secs: float = setting(
        60.0,
        Flag(
            "--cb-timeout-duration-secs",
            Group.CIRCUIT_BREAKERS,
            "how long a circuit stays open before a trial request",
            type=float,
        ),
    )
    window_duration_secs: float = setting(
        120.0,
        Flag(
            "--cb-window-duration-secs",
            Group.CIRCUIT_BREAKERS,
            "window over which failures are counted",
            type=float,
        ),
    )
    enabled: bool = setting(
        True,
        switch=Switch(
            "--disable-circuit-breaker",
            Group.CIRCUIT_BREAKERS,
            "never take an endpoint out of rotation for its failures (health checks still do)",
            sets=False,
        ),
    )


@attrs.frozen
class HealthSettings:
    endpoint: str = setting(
        "/health", Flag("--health-check-endpoint", Group.HEALTH, "path probed on upstreams")
    )
    interval_secs: float = setting(
        60.0,
        Flag(
            "--health-check-interval-secs",
            Group.HEALTH,
            "seconds between probes of each upstream server (0: no probes; every endpoint is"
            " then taken as healthy). Probes change health only, never the load ledger",
            type=float,
        ),
    )
    timeout_secs: float = setting(
        5.0,
        Flag(
            "--health-check-timeout-secs",
            Group.HEALTH,
            "a probe not answered 2xx within this is a failure",
            type=float,
        ),
    )
    failure_threshold: int = setting(
        3,
        Flag(
            "--health-failure-threshold",
            Group.HEALTH,
            "consecutive failed probes that mark an endpoint unhealthy",
            type=int,
        ),
    )
    success_threshold: int = setting(
        2,
        Flag(
            "--health-success-threshold",
            Group.HEALTH,
            "consecutive good probes that mark it healthy again",
            type=int,
        ),
    )
    startup_timeout_secs: float = setting(
        600.0,
        Flag(
            "--worker-startup-timeout-secs",
            Group.HEALTH,
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
            Group.HEALTH,
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
            Group.ADMISSION,
            "requests served at once (streams count until they end)",
            type=int,
        ),
    )
    queue_size: int = setting(
        100,
        Flag(
            "--queue-size",
            Group.ADMISSION,
            "requests waiting beyond --max-concurrent-requests (0: answer 429 at once)",
            type=int,
        ),
    )
    queue_timeout_secs: float = setting(
        60.0,
        Flag(
            "--queue-timeout-secs",
            Group.ADMISSION,
            "longest wait in the queue (then 408)",
            type=float,
        ),
    )
    priority_aging_secs: float = setting(
        1.0,
        Flag(
            "--priority-aging-secs",
            Group.ADMISSION,
            "the queue serves the lowest 'priority' first (vLLM's request field, 0 by default);"
            " each this many seconds waited counts as one level sooner (0: never ages)",
            type=float,
        ),
        check=must(lambda v: v >= 0, "must be 0 or more"),
    )
    tenants_file: str | None = setting(
        None,
        Flag(
            "--tenants-file",
            Group.ADMISSION,
            "a TOML file of tenants: each one's API keys (they authenticate, like --api-key),"
            " weight (its share of saturated capacity, in tokens), max_concurrent_requests and"
            " tokens_per_second; reloaded when it changes",
            metavar="TENANTS_FILE",
        ),
    )
    tenant_header: str | None = setting(
        None,
        Flag(
            "--tenant-header",
            Group.ADMISSION,
            "take a request's tenant from this header, set by a trusted gateway in front (a"
            " name of --tenants-file; any other value: the default tenant)",
            metavar="HEADER",
        ),
        check=must(lambda v: v.strip() != "", "must name a header"),
    )
    rate_limit_tokens_per_second: int | None = setting(
        None,
        Flag(
            "--rate-limit-tokens-per-second",
            Group.ADMISSION,
            "admit at most this many requests per second on average (a token bucket of"
            " --max-concurrent-requests tokens); beyond it, 429 with Retry-After",
            type=int,
        ),
        check=positive,
    )
