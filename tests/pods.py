"""Pod objects as the Kubernetes API serves them, for discovery's tests and the fake API."""

from __future__ import annotations

import uuid
from typing import Any


def pod(
    name: str,
    ip: str | None,
    *,
    namespace: str = "default",
    uid: str | None = None,
    labels: dict[str, str] | None = None,
    ready: bool = True,
    phase: str = "Running",
    deleting: bool = False,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A v1 Pod: ``ip`` None is a pod without an address (pending, or evicted)."""
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": uid or str(uuid.uuid4()),
        "labels": dict(labels if labels is not None else {"app": "vllm"}),
    }
    if annotations:
        metadata["annotations"] = dict(annotations)
    if deleting:
        metadata["deletionTimestamp"] = "2026-12-01T00:00:00Z"
        metadata["deletionGracePeriodSeconds"] = 30
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [
            {"type": "Initialized", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }
    if ip is not None:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": {}, "status": status}
