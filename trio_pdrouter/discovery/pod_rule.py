"""Which servers a Kubernetes pod is: the pure rule from a pod object to router servers.

Rules of this module (nothing here does I/O or keeps state):

* A pod is a worker only if every line of :data:`ELIGIBILITY` passes, checked in that order; the
  first that fails is the reason it is not (it goes into the log line of a removal):

      reason          the pod fails when
      -------------   -----------------------------------------------------------
      terminating     ``metadata.deletionTimestamp`` is set (a graceful delete began)
      not running     ``status.phase`` is not ``Running`` (Pending, Failed, ...)
      not ready       its ``Ready`` condition is not ``True``
      no ip           ``status.podIP`` is missing or empty (evicted pods lose it)
      not selected    its labels do not match the role's selector

* A worker pod gives one server per port of ``--service-discovery-port``:
  ``http://<podIP>:<port>`` (an IPv6 address in brackets), in the role of the watch that saw it.
* A pod is known by its :class:`PodRef`: namespace/name *and* UID, so a pod recreated under the
  same name (a StatefulSet) is another pod.
* A prefill pod's ``vllm.ai/bootstrap-port`` annotation (vllm-router's) is read as a port
  number, None when missing or not one; the NIXL connector does not use it, ``/workers`` shows it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from ..config import Selector
from ..endpoints import Role
from ..fleet import PodRef

BOOTSTRAP_ANNOTATION = "vllm.ai/bootstrap-port"

#: A pod object as the API serves it (decoded JSON).
Pod = Mapping[str, Any]


@attrs.frozen
class PodServer:
    """One server a worker pod provides: its URL in one role."""

    url: str
    role: Role
    pod: PodRef
    bootstrap_port: int | None = None


def _metadata(pod: Pod) -> Mapping[str, Any]:
    return pod.get("metadata") or {}


def _status(pod: Pod) -> Mapping[str, Any]:
    return pod.get("status") or {}


def _ready(pod: Pod) -> bool:
    conditions = _status(pod).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _labels(pod: Pod) -> Mapping[str, str]:
    return _metadata(pod).get("labels") or {}


#: The checks a worker pod passes, in order, each with the reason given when it fails.
ELIGIBILITY: tuple[tuple[str, Callable[[Pod, Selector], bool]], ...] = (
    ("terminating", lambda pod, _: not _metadata(pod).get("deletionTimestamp")),
    ("not running", lambda pod, _: _status(pod).get("phase") == "Running"),
    ("not ready", lambda pod, _: _ready(pod)),
    ("no ip", lambda pod, _: bool(_status(pod).get("podIP"))),
    ("not selected", lambda pod, selector: selector.matches(_labels(pod))),
)


def pod_ref(pod: Pod) -> PodRef:
    meta = _metadata(pod)
    return PodRef(meta.get("namespace") or "", meta.get("name") or "", meta.get("uid") or "")


def ineligible(pod: Pod, selector: Selector) -> str | None:
    """Why ``pod`` is not a worker (the first failed line of :data:`ELIGIBILITY`), or None."""
    for reason, passes in ELIGIBILITY:
        if not passes(pod, selector):
            return reason
    return None


def bootstrap_port(pod: Pod) -> int | None:
    raw = (_metadata(pod).get("annotations") or {}).get(BOOTSTRAP_ANNOTATION)
    if not isinstance(raw, str) or not raw.isdigit():
        return None
    port = int(raw)
    return port if 0 < port < 65536 else None


def servers_of(
    pod: Pod, role: Role, selector: Selector, ports: tuple[int, ...]
) -> tuple[PodServer, ...]:
    """The servers ``pod`` provides in ``role``: none unless it is eligible (module doc)."""
    if ineligible(pod, selector) is not None:
        return ()
    ip = str(_status(pod)["podIP"])
    host = f"[{ip}]" if ":" in ip else ip
    ref = pod_ref(pod)
    boot = bootstrap_port(pod) if role is Role.PREFILL else None
    return tuple(PodServer(f"http://{host}:{port}", role, ref, boot) for port in ports)
