import argparse
import functools
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from trio_pdrouter.cli import build_parser, parse_config
from trio_pdrouter.config import RouterConfig, byte_size, flags, show_size
from trio_pdrouter.endpoints import Role, normalize_url
from trio_pdrouter_sim.tokenizer_files import write_model_dir

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


def test_help_gives_each_default_except_not_given() -> None:
    text = " ".join(build_parser().format_help().split())
    assert "--balance-abs-threshold" in text and "(default: 64)" in text
    assert "see --balance-abs-threshold (default: 1.5)" in text
    assert "(default: None)" not in text


def test_help_leaves_out_defaults_that_say_nothing() -> None:
    text = " ".join(build_parser().format_help().split())
    for noise in ("(default: [])", "(default: False)", "(default: ())", "(default: None)"):
        assert noise not in text
    assert "(default: x-request-id x-correlation-id x-trace-id request-id)" in text


def test_help_shows_sizes_in_units_and_they_parse_back() -> None:
    text = " ".join(build_parser().format_help().split())
    assert "largest request body accepted (larger: 413) (default: 512MiB)" in text
    assert "536870912" not in text
    config = parse_config([*REGULAR, "--max-payload-size", "1GiB", "--max-buffered-bytes", "64KiB"])
    assert config.max_payload_size == 1 << 30
    assert config.max_buffered_bytes == 64 * 1024
    assert parse_config(REGULAR).max_payload_size == 512 * 1024 * 1024


def test_help_offers_no_refused_value_and_no_refused_flag() -> None:
    text = build_parser().format_help()
    refused_values = {
        value
        for _, _, option in DECLARED
        if isinstance(option, flags.Flag)
        for value in option.refused_choices
    }
    assert refused_values >= {"mooncake", "moriio"}
    for value in refused_values:
        assert value not in text
    listed = {line.split()[0].rstrip(",") for line in text.splitlines() if line.startswith("  -")}
    assert "--policy" in listed
    for option in REFUSED:
        assert option.spelling not in listed


def test_help_groups_are_of_a_readable_size() -> None:
    sizes = [
        len([a for a in group._group_actions if a.help != argparse.SUPPRESS])
        for group in build_parser()._action_groups
    ]
    assert max(sizes) <= 15, sizes


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


#: Every option of the parser before the flags were declared on the config fields.
FLAGS_BEFORE = [
    "--api-key", "--backlog", "--balance-abs-threshold", "--balance-rel-threshold",
    "--cache-threshold", "--cb-failure-threshold", "--cb-success-threshold",
    "--cb-timeout-duration-secs", "--cb-window-duration-secs", "--cluster-sync-ms",
    "--cluster-url", "--connect-timeout-secs",
    "--decode", "--decode-first-byte-timeout-secs", "--decode-idle-timeout-secs",
    "--decode-policy", "--disable-circuit-breaker", "--disable-retries",
    "--engine-metrics-interval", "--eviction-interval-secs", "--graceful-timeout-secs",
    "--health-check-endpoint", "--health-check-interval-secs", "--health-check-timeout-secs",
    "--health-failure-threshold", "--health-success-threshold", "--help", "--host",
    "--intra-node-data-parallel-size", "--keep-alive-timeout-secs", "--kv-connector",
    "--log-level", "--max-buffered-bytes", "--max-concurrent-requests", "--max-payload-size",
    "--max-tree-size", "--max-upstream-answer-bytes", "--no-release-stranded-kv", "--policy", "--port", "--prefill",
    "--prefill-policy", "--prefill-timeout-secs", "--prometheus-host", "--prometheus-port",
    "--queue-size", "--queue-timeout-secs", "--release-decode-at-headers",
    "--release-stranded-kv", "--replica-id", "--request-id-headers", "--request-timeout-secs",
    "--retry-backoff-multiplier", "--retry-initial-backoff-ms", "--retry-jitter-factor",
    "--retry-max-backoff-ms", "--retry-max-retries", "--upstream-api-key",
    "--upstream-transport", "--version", "--vllm-pd-disaggregation", "--worker-sockets",
    "--worker-urls", "--workers", "-h",
]  # fmt: skip


#: Every option of vllm-router 0.1.17 (``vllm-router --help``).
VLLM_ROUTER_FLAGS = [
    "--api-key", "--balance-abs-threshold", "--balance-rel-threshold", "--cache-threshold",
    "--cb-failure-threshold", "--cb-success-threshold", "--cb-timeout-duration-secs",
    "--cb-window-duration-secs", "--cors-allowed-origins", "--decode", "--decode-policy",
    "--decode-selector", "--disable-circuit-breaker", "--disable-retries", "--enable-igw",
    "--enable-program-scheduling", "--eviction-interval-secs", "--health-check-endpoint",
    "--health-check-interval-secs", "--health-check-timeout-secs", "--health-failure-threshold",
    "--health-success-threshold", "--host", "--intra-node-data-parallel-size",
    "--kv-aware-session-affinity-ttl-secs", "--kv-connector", "--kv-event-block-size",
    "--kv-event-model", "--kv-event-replay-source", "--kv-event-source", "--kv-penalty-disk",
    "--kv-penalty-external", "--kv-penalty-host", "--log-dir", "--log-level",
    "--max-concurrent-requests", "--max-payload-size", "--max-tree-size", "--mini-lb",
    "--pd-kv-events", "--policy", "--port", "--prefill", "--prefill-policy", "--prefill-selector",
    "--program-scheduling-config-json", "--prometheus-host", "--prometheus-port", "--queue-size",
    "--queue-timeout-secs", "--rate-limit-tokens-per-second", "--request-id-headers",
    "--request-timeout-secs", "--retry-backoff-multiplier", "--retry-initial-backoff-ms",
    "--retry-jitter-factor", "--retry-max-backoff-ms", "--retry-max-retries",
    "--router-temperature", "--selector", "--service-discovery", "--service-discovery-namespace",
    "--service-discovery-port", "--vllm-discovery-address", "--vllm-pd-disaggregation",
    "--wasm-middleware", "--wasm-middleware-route", "--wasm-middleware-sha256",
    "--worker-startup-check-interval", "--worker-startup-timeout-secs", "--worker-urls",
]  # fmt: skip


def test_no_flag_was_lost_and_every_vllm_router_flag_is_declared() -> None:
    spellings = {s for action in build_parser()._actions for s in action.option_strings}
    assert set(FLAGS_BEFORE) <= spellings
    assert set(VLLM_ROUTER_FLAGS) <= spellings


REGULAR = ["--worker-urls", "http://w:1"]
PD = ["--vllm-pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:2"]


def _tenants_file() -> Path:
    path = Path(tempfile.mkdtemp()) / "tenants.toml"
    path.write_text('[tenants.sample]\nkeys = ["sk-sample"]\n')
    return path


#: Values for flags whose value is a name, by metavar: a URL, a header, a bootstrap port.
SAMPLES = {
    "URL": "http://sample:9",
    "HEADER": "X-Sample",
    "BOOTSTRAP_PORT": "8998",
    "ORIGIN": "http://sample.example",
    "PATH": "/v1/sample",
    "KEY=VALUE": "app=sample",
    "URL=ENDPOINT[,ENDPOINT...]": "http://sample:9=tcp://sample:5557",
    "REDIS_URL": "redis://sample:6379/0",
    "ID": "replica-sample",
    "CIDR": "10.0.0.0/8",
    # a real tenants file: the flag loads it
    "TENANTS_FILE": str(_tenants_file()),
    # a real model directory: the flag loads it
    "TOKENIZER_PATH": str(write_model_dir(Path(tempfile.mkdtemp()) / "m", ["a b"], vocab_size=260)),
}


def sample(option: flags.Flag | flags.Switch, default: Any) -> list[str]:
    """A command line that gives ``option`` a valid value other than its field's default."""
    if isinstance(option, flags.Switch) or option.action == "store_true":
        return [option.spelling]
    if option.action is argparse.BooleanOptionalAction:
        return ["--no-" + option.spelling[2:] if default else option.spelling]
    if option.choices is not None:
        return [option.spelling, next(c for c in reversed(option.choices) if c != default)]
    if option.type is byte_size:  # in a unit, as a person writes it
        return [option.spelling, show_size(default * 2)]
    if option.type is int and isinstance(default, tuple):  # several numbers
        return [option.spelling, *(str(n * 2) for n in default), "3"]
    if option.type is int:
        return [option.spelling, str(default * 2 if default else 3)]
    if option.type is float:
        return [option.spelling, str(default / 2 if default else 2.5)]
    if option.metavar is not None:
        names = option.metavar if isinstance(option.metavar, tuple) else (option.metavar,)
        return [option.spelling, *(SAMPLES[name] for name in names)]
    return [option.spelling, "sample" if default is None else f"{default}-sample"]


DECLARED = list(flags.declared(RouterConfig))
SUPPORTED = [d for d in DECLARED if isinstance(d[2], flags.Switch) or d[2].refused is None]
REFUSED = [option for _, _, option in DECLARED if isinstance(option, flags.Flag) and option.refused]


@pytest.mark.parametrize(
    ("path", "field", "option"), SUPPORTED, ids=[option.spelling for _, _, option in SUPPORTED]
)
def test_every_flag_sets_its_field(
    path: tuple[str, ...], field: Any, option: flags.Flag | flags.Switch
) -> None:
    argv = sample(option, field.default)
    # the flag may need PD mode, or may not go with it, or need upstreams given as addresses
    # (and --tenant-header names tenants of a tenants file)
    with_tenants = [*REGULAR, "--tenants-file", SAMPLES["TENANTS_FILE"]]
    for base in (REGULAR, PD, ["--worker-urls", "http://10.0.0.1:1"], with_tenants):
        try:
            config = parse_config([*base, *argv])
            break
        except SystemExit:
            continue
    else:
        pytest.fail(f"{argv} is refused with both {REGULAR} and {PD}")
    args = build_parser().parse_args([*base, *argv])
    expected = option.sets if isinstance(option, flags.Switch) else option.value(args)
    value = functools.reduce(getattr, path, config)
    assert value == expected
    assert value != field.default


def test_a_switch_wins_wherever_it_stands() -> None:
    for argv in (
        ["--disable-retries", "--retry-max-retries", "3"],
        ["--retry-max-retries", "3", "--disable-retries"],
    ):
        assert parse_config([*REGULAR, *argv]).retry.max_retries == 1
    assert parse_config([*REGULAR, "--retry-max-retries", "3"]).retry.max_retries == 3


def test_more_than_a_bootstrap_port_after_a_prefill_url_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_config([*PD, "--prefill", "http://p:2", "8998", "extra"])
    assert info.value.code == 2
    assert "--prefill takes a URL and an optional bootstrap port" in capsys.readouterr().err


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


@pytest.mark.parametrize("host", ["127.1", "0x7f.0.0.1", "2130706433", "0177.0.0.1", "1.2.3.04"])
def test_numeric_hosts_in_forms_resolvers_read_differently_are_refused(host: str) -> None:
    with pytest.raises(ValueError, match="write it as four decimal numbers"):
        normalize_url(f"http://{host}:8000")
    assert normalize_url("http://10.1.2.3:8000") == "http://10.1.2.3:8000"
    assert normalize_url("http://engine-0.pd.svc:8000") == "http://engine-0.pd.svc:8000"


def test_command_line_servers_must_be_inside_the_allowed_networks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    allowed = ["--allowed-upstream-networks", "10.0.0.0/8", "fd00::/8"]
    config = parse_config(["--worker-urls", "http://10.1.2.3:8000", *allowed])
    assert config.upstream_policy().allowed[0].prefixlen == 8
    for url, why in [
        ("http://127.0.0.1:8000", "outside --allowed-upstream-networks"),
        ("http://engine:8000", "must be an IP address"),
    ]:
        with pytest.raises(SystemExit) as info:
            parse_config(["--worker-urls", url, *allowed])
        assert info.value.code == 2 and why in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(
            ["--worker-urls", "http://10.1.2.3:8000", "--allowed-upstream-networks", "10.0.0.0/33"]
        )
    assert "--allowed-upstream-networks" in capsys.readouterr().err


@pytest.mark.parametrize("option", REFUSED, ids=[option.spelling for option in REFUSED])
def test_a_refused_flag_parses_and_is_refused_by_name(
    option: flags.Flag, capsys: pytest.CaptureFixture[str]
) -> None:
    field = next(f for _, f, o in DECLARED if o is option)
    with pytest.raises(SystemExit) as info:
        parse_config([*REGULAR, *sample(option, field.default)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" not in err and "usage:" not in err
    assert f"  {option.spelling}" in err and option.refused is not None
    assert option.refused in err


def test_vllm_router_sticky_least_loaded_is_a_policy_of_every_stage() -> None:
    config = parse_config([*PD, "--policy", "sticky_least_loaded", "--sticky-max-sessions", "9"])
    assert config.stage_policy(Role.PREFILL) == config.stage_policy(Role.DECODE)
    assert config.stage_policy(Role.DECODE) == "sticky_least_loaded"
    assert config.policy_settings.sticky_max_sessions == 9
    assert config.policy_settings.sticky_session_ttl_secs == 7200.0


def test_a_refused_flag_given_its_default_is_accepted() -> None:
    config = parse_config([*REGULAR, "--kv-event-block-size", "16"])
    assert config.kv_events.block_size == 16


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--kv-connector", "mooncake"], "--kv-connector mooncake"),
        (["--kv-connector", "moriio"], "--kv-connector moriio"),
    ],
)
def test_vllm_router_choices_we_lack_are_refused_by_name(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_config([*PD, *argv])
    assert info.value.code == 2
    assert named in capsys.readouterr().err


#: A vllm-router launch command giving every one of its flags a value (other than its default
#: where it has one), with only the program name changed.
EVERY_VLLM_ROUTER_FLAG = [
    "--host", "127.0.0.1", "--port", "0", "--worker-urls", "--enable-program-scheduling",
    "--program-scheduling-config-json", "{}", "--policy", "kv_aware",
    "--prefill-policy", "cache_aware", "--decode-policy", "sticky_least_loaded",
    "--router-temperature", "0.5", "--kv-penalty-host", "0.7", "--kv-penalty-external", "0.5",
    "--kv-penalty-disk", "0.2", "--kv-aware-session-affinity-ttl-secs", "60",
    "--kv-event-source", "http://p:1=tcp://p:5557", "--kv-event-replay-source",
    "http://p:1=tcp://p:5558", "--kv-event-block-size", "32", "--kv-event-model", "m",
    "--pd-kv-events", "http://p:1=tcp://p:5557", "--mini-lb", "--vllm-pd-disaggregation",
    "--prefill", "http://p:1", "8998", "--prefill", "http://p:2", "none", "--decode", "http://d:1",
    "--worker-startup-timeout-secs", "5", "--worker-startup-check-interval", "1",
    "--cache-threshold", "0.5", "--balance-abs-threshold", "32", "--balance-rel-threshold", "1.1",
    "--eviction-interval-secs", "60", "--max-tree-size", "1000000", "--max-payload-size",
    "1000000", "--wasm-middleware", "/m.wasm", "--wasm-middleware-sha256", "ab",
    "--wasm-middleware-route", "/v1/completions", "--intra-node-data-parallel-size", "2",
    "--enable-igw", "--api-key", "k", "--log-dir", "/tmp/logs", "--log-level", "debug",
    "--service-discovery", "--selector", "app=vllm", "--service-discovery-port", "8000",
    "--service-discovery-namespace", "ns", "--prefill-selector", "role=p", "--decode-selector",
    "role=d", "--vllm-discovery-address", "0.0.0.0:30001", "--kv-connector", "mooncake",
    "--prometheus-port", "0", "--prometheus-host", "127.0.0.1", "--request-id-headers",
    "x-request-id", "--request-timeout-secs", "60", "--retry-max-retries", "3",
    "--retry-initial-backoff-ms", "10", "--retry-max-backoff-ms", "100",
    "--retry-backoff-multiplier", "2", "--retry-jitter-factor", "0.1", "--disable-retries",
    "--cb-failure-threshold", "5", "--cb-success-threshold", "2", "--cb-timeout-duration-secs",
    "30", "--cb-window-duration-secs", "60", "--disable-circuit-breaker",
    "--health-failure-threshold", "2", "--health-success-threshold", "1",
    "--health-check-timeout-secs", "2", "--health-check-interval-secs", "10",
    "--health-check-endpoint", "/health", "--max-concurrent-requests", "64", "--queue-size", "8",
    "--queue-timeout-secs", "5", "--rate-limit-tokens-per-second", "100",
    "--cors-allowed-origins", "http://ui.example",
]  # fmt: skip


def test_a_launch_command_with_every_vllm_router_flag_exits_2_with_one_message() -> None:
    given = {arg for arg in EVERY_VLLM_ROUTER_FLAG if arg.startswith("--")}
    assert given == set(VLLM_ROUTER_FLAGS)
    done = subprocess.run(
        [sys.executable, "-m", "trio_pdrouter", *EVERY_VLLM_ROUTER_FLAG],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert (
        lines[0] == "trio-pdrouter: error: vllm-router flags that trio-pdrouter does not support:"
    )
    named = {name.split()[0] for line in lines[1:] for name in line.split(": ", 1)[0].split(", ")}
    refused = {option.spelling for option in REFUSED} | {"--kv-connector"}
    assert named == refused & given


def test_discovery_takes_vllm_router_spellings_and_makes_servers_optional() -> None:
    config = parse_config(
        [
            "--vllm-pd-disaggregation", "--service-discovery", "--prefill-selector", "role=p",
            "--decode-selector", "role=d", "app=x", "--service-discovery-port", "8000",
        ]
    )  # fmt: skip
    assert config.discovery.ports == (8000,) and config.discovery.resync_secs == 30
    selectors = config.discovery.selectors(pd=True)
    assert [s.query() for s in selectors.values()] == ["role=p", "role=d,app=x"]
    regular = parse_config(["--service-discovery", "--service-discovery-port", "8000", "8001"])
    assert regular.discovery.ports == (8000, 8001) and regular.discovery.namespace is None
    assert parse_config([*REGULAR]).discovery.ports == (80,)  # vllm-router 0.1.17's default


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--vllm-pd-disaggregation", "--service-discovery", "--prefill-selector", "r=p"],
            "--decode",
        ),
        (["--selector", "app=x"], "no upstream"),
        (["--service-discovery", "--service-discovery-port", "0"], "distinct ports"),
        (["--service-discovery", "--service-discovery-port", "80", "80"], "distinct ports"),
    ],
)
def test_discovery_refuses_what_cannot_work(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_config(argv)
    assert message in capsys.readouterr().err
