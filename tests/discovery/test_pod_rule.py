"""The rule from a pod to router servers: eligibility in order, URLs, roles, annotation."""

from __future__ import annotations

import pytest

from tests.pods import pod
from trio_pdrouter.config import Selector
from trio_pdrouter.discovery import ELIGIBILITY, ineligible, pod_ref, servers_of
from trio_pdrouter.endpoints import Role

VLLM = Selector.parse(("app=vllm",))


def test_a_ready_running_matching_pod_with_an_ip_is_one_server_per_port() -> None:
    p = pod("w-1", "10.0.0.7", uid="u1")
    servers = servers_of(p, Role.REGULAR, VLLM, (8000, 8001))
    assert [s.url for s in servers] == ["http://10.0.0.7:8000", "http://10.0.0.7:8001"]
    assert {s.pod for s in servers} == {pod_ref(p)}
    assert pod_ref(p).key == "default/w-1" and pod_ref(p).uid == "u1"


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"deleting": True}, "terminating"),
        ({"phase": "Failed", "ip": None}, "not running"),
        ({"phase": "Pending"}, "not running"),
        ({"ready": False}, "not ready"),
        ({"ip": None}, "no ip"),
        ({"ip": ""}, "no ip"),
        ({"labels": {"app": "other"}}, "not selected"),
        ({"labels": {}}, "not selected"),
    ],
)
def test_each_failed_check_names_its_reason_and_gives_no_server(
    changes: dict[str, object], reason: str
) -> None:
    kwargs: dict[str, object] = {"ip": "10.0.0.7", **changes}
    ip = kwargs.pop("ip")
    p = pod("w-1", ip, **kwargs)  # type: ignore[arg-type]
    assert ineligible(p, VLLM) == reason
    assert servers_of(p, Role.REGULAR, VLLM, (80,)) == ()


def test_the_checks_run_in_the_table_order() -> None:
    assert [reason for reason, _ in ELIGIBILITY] == [
        "terminating", "not running", "not ready", "no ip", "not selected",
    ]  # fmt: skip
    assert ineligible(pod("w", None, deleting=True, ready=False), VLLM) == "terminating"


def test_selector_is_an_and_of_equalities_and_items_without_equals_are_ignored() -> None:
    selector = Selector.parse(("app=vllm", "tier=gpu", "junk", "x=a=b"))
    assert selector.pairs == (("app", "vllm"), ("tier", "gpu"), ("x", "a=b"))
    assert selector.query() == "app=vllm,tier=gpu,x=a=b"
    assert selector.matches({"app": "vllm", "tier": "gpu", "x": "a=b", "more": "1"})
    assert not selector.matches({"app": "vllm", "tier": "cpu", "x": "a=b"})
    assert Selector().matches({}) and Selector().query() == ""


def test_ipv6_addresses_are_bracketed() -> None:
    (server,) = servers_of(pod("w", "fd00::7"), Role.DECODE, VLLM, (8000,))
    assert server.url == "http://[fd00::7]:8000"


@pytest.mark.parametrize(
    ("value", "port"), [("8998", 8998), ("0", None), ("70000", None), ("x", None), (None, None)]
)
def test_the_bootstrap_port_annotation_is_read_on_prefill_pods_only(
    value: str | None, port: int | None
) -> None:
    annotations = {"vllm.ai/bootstrap-port": value} if value is not None else None
    p = pod("p", "10.0.0.8", annotations=annotations)
    (prefill,) = servers_of(p, Role.PREFILL, VLLM, (80,))
    (decode,) = servers_of(p, Role.DECODE, VLLM, (80,))
    assert prefill.bootstrap_port == port and decode.bootstrap_port is None
