"""The flags of Kubernetes service discovery: vllm-router 0.1.17's, with its spellings and
defaults, and the few it lacks (resync period, kubeconfig).

Rules (vllm-router's): the role selectors count only in PD mode (``--vllm-pd-disaggregation``),
``--selector`` only in regular mode; a selector is ``k=v`` pairs, all of which must match;
without ``--service-discovery`` none of these flags does anything.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ..endpoints import Role
from .flags import Flag, Group, as_tuple, must, positive, setting


def _ports(values: list[int] | int) -> tuple[int, ...]:
    return tuple(values) if isinstance(values, list) else (values,)


def _selector(spelling: str, help: str) -> tuple[str, ...]:
    return setting(
        (),
        Flag(spelling, Group.DISCOVERY, help, nargs="+", metavar="KEY=VALUE", parse=as_tuple),
    )


def _valid_ports(ports: tuple[int, ...]) -> bool:
    return bool(ports) and all(0 < p < 65536 for p in ports) and len(set(ports)) == len(ports)


@attrs.frozen
class Selector:
    """Equality label selector: every pair must match (vllm-router's ``--selector k=v ...``)."""

    pairs: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, items: tuple[str, ...]) -> Selector:
        """``k=v`` items split on the first ``=``; items without one are ignored, as vllm-router
        does."""
        pairs = [tuple(item.split("=", 1)) for item in items if "=" in item]
        return cls(tuple((k, v) for k, v in pairs))

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in self.pairs)

    def query(self) -> str:
        """The ``labelSelector`` parameter the API server filters with (empty: every pod)."""
        return ",".join(f"{key}={value}" for key, value in self.pairs)


@attrs.frozen
class DiscoverySettings:
    """Which pods are workers, where to find them, and how often to list them again."""

    enabled: bool = setting(
        False,
        Flag(
            "--service-discovery",
            Group.DISCOVERY,
            "follow Kubernetes pods: a pod that is Running, Ready, has an IP and matches the"
            " selector is a server at http://<podIP>:<port>; it leaves routing (and drains) on"
            " delete, deletion timestamp, not ready, relabel, a lost IP or a new UID/IP."
            " Servers given on the command line stay whatever the pods do",
            action="store_true",
        ),
    )
    selector: tuple[str, ...] = _selector(
        "--selector", "regular mode: labels of worker pods (all must match; none: every pod)"
    )
    ports: tuple[int, ...] = setting(
        (80,),
        Flag(
            "--service-discovery-port",
            Group.DISCOVERY,
            "port of the engine in discovered pods (vllm-router's default, 80); several ports"
            " (data-parallel engines in one pod) make one server each",
            type=int,
            nargs="+",
            metavar="PORT",
            parse=_ports,
        ),
        check=must(_valid_ports, "must be distinct ports from 1 to 65535"),
    )
    namespace: str | None = setting(
        None,
        Flag(
            "--service-discovery-namespace",
            Group.DISCOVERY,
            "namespace to watch; unset: every namespace (which needs a ClusterRole)",
        ),
    )
    prefill_selector: tuple[str, ...] = _selector(
        "--prefill-selector",
        "PD mode: labels of prefill pods (their vllm.ai/bootstrap-port annotation is shown in"
        " /workers); a role without a selector is not discovered",
    )
    decode_selector: tuple[str, ...] = _selector(
        "--decode-selector", "PD mode: labels of decode pods"
    )
    resync_secs: float = setting(
        30.0,
        Flag(
            "--service-discovery-resync-secs",
            Group.DISCOVERY,
            "list the pods again this often, and on every reconnect and 410: a change whose"
            " watch event was lost takes effect within this; also the longest a silent watch"
            " is trusted",
            type=float,
            metavar="SECS",
        ),
        check=positive,
    )
    kubeconfig: str | None = setting(
        None,
        Flag(
            "--kubeconfig",
            Group.DISCOVERY,
            "kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then the pod's"
            " service account)",
            metavar="PATH",
        ),
    )

    def selectors(self, pd: bool) -> dict[Role, Selector]:
        """The roles discovery fills and each one's selector (module doc)."""
        if not self.enabled:
            return {}
        if not pd:
            return {Role.REGULAR: Selector.parse(self.selector)}
        found = {
            Role.PREFILL: Selector.parse(self.prefill_selector),
            Role.DECODE: Selector.parse(self.decode_selector),
        }
        return {role: selector for role, selector in found.items() if selector.pairs}
