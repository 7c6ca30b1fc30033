import subprocess
import sys

import pytest

from trio_pdrouter.cli import parse_config
from trio_pdrouter.endpoints import Role, normalize_url

SEED = (
    "--vllm-pd-disaggregation --host 0.0.0.0 --port 29100 --policy cache_aware"
    " --cache-threshold 0.5 --balance-abs-threshold 32 --balance-rel-threshold 1.1"
    " --intra-node-data-parallel-size 4 --prefill http://0.0.0.0:18000"
    " --decode http://0.0.0.0:28000 --log-level debug"
).split()


def test_seed_command_line_parses_unchanged() -> None:
    config = parse_config(SEED)
    assert config.pd and config.dp_size == 4
    assert config.server.host == "0.0.0.0" and config.server.port == 29100
    s = config.policy_settings
    assert (s.cache_threshold, s.balance_abs_threshold, s.balance_rel_threshold) == (0.5, 32, 1.1)
    eps = config.endpoints()
    assert [ep.key for ep in eps[Role.DECODE]] == [f"http://0.0.0.0:28000@{r}" for r in range(4)]
    assert len(eps[Role.PREFILL]) == 4
    assert config.log_level == "debug"


def test_vllm_router_defaults() -> None:
    config = parse_config(["--worker-urls", "http://127.0.0.1:8000"])
    assert config.policy == "cache_aware"
    s = config.policy_settings
    assert (s.cache_threshold, s.balance_abs_threshold, s.balance_rel_threshold) == (0.3, 64, 1.5)
    assert (s.eviction_interval_secs, s.max_tree_size) == (120, 2**25)
    assert config.max_payload_size == 512 * 1024 * 1024
    assert config.timeouts.request == 1800
    assert config.server.port == 30000 and config.server.host == "127.0.0.1"
    r = config.retry
    assert (r.max_retries, r.initial_backoff_ms, r.max_backoff_ms) == (5, 50, 30000)
    b = config.breaker
    assert (b.failure_threshold, b.success_threshold, b.timeout_duration_secs) == (10, 3, 60)
    h = config.health
    assert (h.failure_threshold, h.success_threshold, h.interval_secs) == (3, 2, 60)
    a = config.admission
    assert (a.max_concurrent_requests, a.queue_size, a.queue_timeout_secs) == (32768, 100, 60)


def test_repeated_urls_and_bootstrap_port() -> None:
    config = parse_config(
        "--vllm-pd-disaggregation --prefill http://a:1 9000 --prefill http://b:2/"
        " --decode http://c:3 --decode http://d:4 --policy round_robin".split()
    )
    assert config.prefill_urls == ("http://a:1", "http://b:2/")
    assert [ep.key for ep in config.endpoints()[Role.PREFILL]] == ["http://a:1", "http://b:2"]
    assert config.decode_urls == ("http://c:3", "http://d:4")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no upstream"),
        (["--vllm-pd-disaggregation", "--prefill", "http://a:1"], "at least one --prefill"),
        (["--worker-urls", "ftp://a:1"], "must start with http://"),
        (["--worker-urls", "http://a"], "explicit port"),
        (["--worker-urls", "http://a:1", "--cache-threshold", "2"], "between 0.0 and 1.0"),
        (["--prefill", "http://a:1", "--decode", "http://b:1"], "need --vllm-pd-disaggregation"),
    ],
)
def test_bad_settings_fail_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_config(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_documents_the_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "trio_pdrouter", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in [
        "--vllm-pd-disaggregation",
        "--intra-node-data-parallel-size",
        "--cache-threshold",
        "--request-timeout-secs",
        "--upstream-transport",
        "--api-key",
    ]:
        assert flag in out
    assert "--release-decode-at-headers" not in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--worker-urls", "https://w:1"],
        ["--vllm-pd-disaggregation", "--prefill", "https://p:1", "--decode", "http://d:2"],
        ["--vllm-pd-disaggregation", "--prefill", "http://p:1", "--decode", "https://d:2"],
    ],
)
def test_https_upstreams_are_refused_at_start(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "trio_pdrouter", *argv], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "https upstreams are not supported yet" in done.stderr
    assert "use http://" in done.stderr


def test_normalize_url_refuses_https_clearly() -> None:
    with pytest.raises(ValueError) as info:
        normalize_url("https://a:1")
    assert str(info.value) == (
        "'https://a:1': https upstreams are not supported yet: the upstream transport speaks"
        " plain HTTP; use http://"
    )
    with pytest.raises(ValueError, match="must start with http://"):
        normalize_url("ftp://a:1")
    assert normalize_url("http://a:1/") == "http://a:1"
