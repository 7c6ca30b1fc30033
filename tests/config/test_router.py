"""A config is valid by construction: an invalid one cannot be built, by hand or by evolve."""

import re
from typing import Any

import attrs
import pytest

from trio_pdrouter.cli import parse_config
from trio_pdrouter.config import ClusterSettings, ConfigError, RouterConfig, Timeouts
from trio_pdrouter.routing import PolicySettings

VALID = RouterConfig(worker_urls=("http://w:1",))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"worker_urls": ()}, "no upstream: give --worker-urls"),
        ({"pd": True}, "--vllm-pd-disaggregation needs at least one --prefill and one --decode"),
        (
            {"pd": True, "prefill_urls": ("http://p:1",), "decode_urls": ("http://d:1",)},
            "--worker-urls cannot be combined with --vllm-pd-disaggregation",
        ),
        (
            {"worker_urls": (), "decode_urls": ("http://d:1",)},
            "--prefill/--decode need --vllm-pd-disaggregation",
        ),
        ({"dp_size": 0}, "--intra-node-data-parallel-size must be at least 1"),
        ({"policy": "nope"}, "--policy 'nope' is not supported; choose from round_robin"),
        ({"decode_policy": "nope"}, "--decode-policy 'nope' is not supported"),
        ({"kv_connector": "mooncake"}, "--kv-connector 'mooncake' is not supported"),
        ({"transport": "h2"}, "--upstream-transport 'h2' is not supported"),
        ({"log_level": "loud"}, "--log-level 'loud' is not supported"),
        ({"max_payload_size": 0}, "--max-payload-size must be positive"),
        ({"engine_metrics_interval": -1.0}, "--engine-metrics-interval must be 0 (off)"),
        ({"engine_metrics_interval": float("nan")}, "--engine-metrics-interval must be 0 (off)"),
        ({"worker_urls": ("http://w",)}, "the URL needs an explicit port"),
        ({"worker_urls": ("https://w:1",)}, "https upstreams are not supported yet"),
        ({"worker_urls": ("http://w:1", "http://w:1/")}, "http://w:1 is given twice"),
    ],
)
def test_an_invalid_config_cannot_be_built(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        RouterConfig(**{"worker_urls": VALID.worker_urls, **changes})
    with pytest.raises(ConfigError, match=re.escape(message)):
        attrs.evolve(VALID, **changes)


def test_evolve_validates() -> None:
    with pytest.raises(ConfigError, match="--intra-node-data-parallel-size must be at least 1"):
        attrs.evolve(VALID, dp_size=0)
    assert attrs.evolve(VALID, dp_size=2).dp_size == 2


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Timeouts(request=0), "--request-timeout-secs must be positive"),
        (lambda: Timeouts(idle=-1.0), "--decode-idle-timeout-secs must be positive"),
        (lambda: PolicySettings(cache_threshold=1.5), "--cache-threshold must be between 0.0"),
        (lambda: PolicySettings(max_tree_size=0), "--max-tree-size must be positive"),
        (lambda: ClusterSettings(url="http://r:6379"), "--cluster-url must start with redis://"),
        (lambda: ClusterSettings(sync_ms=0), "--cluster-sync-ms must be positive"),
        (lambda: ClusterSettings(replica_id=""), "--replica-id must not be empty"),
    ],
)
def test_invalid_nested_settings_cannot_be_built(build: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build()


def test_unset_optional_settings_are_valid() -> None:
    t = Timeouts(request=5.0)
    assert (t.prefill_limit, t.first_byte_limit, t.idle_limit) == (5.0, 5.0, 5.0)


def test_cluster_flags_set_the_cluster_view_and_its_timings() -> None:
    off = parse_config(["--worker-urls", "http://w:1"])
    assert off.cluster.url is None
    cluster = ["--cluster-url", "rediss://u:p@r:6380/2", "--cluster-sync-ms", "100"]
    on = parse_config(["--worker-urls", "http://w:1", "--port", "8100", *cluster])
    assert on.cluster.url == "rediss://u:p@r:6380/2"
    assert (on.cluster.interval, on.cluster.ttl) == (0.1, 0.5)
    slow = parse_config(["--worker-urls", "http://w:1", "--cluster-sync-ms", "200"])
    assert slow.cluster.ttl == 0.8
    assert on.cluster.replica(on.server.port).endswith(":8100")
    named = attrs.evolve(on.cluster, replica_id="east-1")
    assert named.replica(8100) == "east-1"
