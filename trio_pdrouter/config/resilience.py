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
