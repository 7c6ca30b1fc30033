"""deploy/kubernetes/: every manifest validates against the Kubernetes schemas (strict: an unknown
field fails), the kustomization lists them all, the router's container arguments parse with the
router's own parser into the settings the rest of the manifests assume, and the probes' paths
answer on a running router."""

from __future__ import annotations

import copy
import json
import pathlib
import re
from typing import Any

import kubernetes_validate
import pytest
import trio
import yaml

from tests.cluster import start_cluster
from trio_pdrouter import __version__
from trio_pdrouter.cli import parse_config
from trio_pdrouter.config import RouterConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
#: The oldest Kubernetes release the manifests are meant for, and the newest the schemas know.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
#: Kinds of custom resources, which no bundled schema covers: checked field by field below.
CUSTOM = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def kustomization() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    return loaded


def resources() -> list[dict[str, Any]]:
    return [
        doc
        for name in kustomization()["resources"]
        for doc in yaml.safe_load_all((MANIFESTS / name).read_text())
    ]


def one(kind: str) -> dict[str, Any]:
    (found,) = (doc for doc in resources() if doc["kind"] == kind)
    return found


def router_container() -> dict[str, Any]:
    (container,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["name"] == "router"
    return container


def entrypoint_args() -> list[str]:
    """The arguments the Containerfile's ENTRYPOINT puts before the container's own."""
    text = (ROOT / "Containerfile").read_text()
    (line,) = re.findall(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    program, *args = json.loads(line)
    assert program == "trio-pdrouter"
    return list(args)


def expanded(args: list[str], env: dict[str, str]) -> list[str]:
    """``$(NAME)`` in container arguments replaced as the kubelet does, from the container's env."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m[1]], arg) for arg in args]


def router_config() -> RouterConfig:
    container = router_container()
    namespace = kustomization()["namespace"]
    env = {}
    for var in container["env"]:
        assert var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
        env[var["name"]] = namespace
    return parse_config(entrypoint_args() + expanded(container["args"], env))


def cpus(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def test_the_kustomization_lists_every_manifest_in_the_directory() -> None:
    listed = set(kustomization()["resources"])
    present = {path.name for path in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_strictly(version: str) -> None:
    kinds = set()
    for doc in resources():
        kinds.add(doc["kind"])
        if (doc["apiVersion"], doc["kind"]) in CUSTOM:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, version, strict=True)
        else:
            kubernetes_validate.validate(doc, version, strict=True)
    expected = {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"}
    assert kinds >= expected | {"ServiceMonitor", "PodDisruptionBudget"}


def test_strict_validation_refuses_a_misspelt_field() -> None:
    deployment = copy.deepcopy(one("Deployment"))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["livenessProbes"] = container.pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)


def test_the_router_arguments_parse_into_what_the_manifests_assume() -> None:
    config = router_config()
    container = router_container()
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert config.server.host == "0.0.0.0"
    assert config.server.port == ports["http"]
    assert config.prometheus_port == ports["metrics"]
    # one router process per CPU of the limit, and the limit granted in full
    resources = container["resources"]
    assert config.server.workers == cpus(resources["limits"]["cpu"])
    assert cpus(resources["requests"]["cpu"]) == cpus(resources["limits"]["cpu"])
    # in-flight streams finish within the grace period the kubelet gives
    pod = one("Deployment")["spec"]["template"]["spec"]
    assert config.server.graceful_timeout < pod["terminationGracePeriodSeconds"]
    # discovery watches the pod's own namespace, the one the Role grants
    assert config.pd and config.discovery.enabled
    assert config.discovery.namespace == kustomization()["namespace"]
    assert config.discovery.prefill_selector and config.discovery.decode_selector


def test_the_image_runs_as_the_user_the_pod_requires() -> None:
    text = (ROOT / "Containerfile").read_text()
    (user,) = re.findall(r"^USER (\d+):(\d+)$", text, re.M)
    context = one("Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert context["runAsNonRoot"] is True
    assert (str(context["runAsUser"]), str(context["runAsGroup"])) == user
    assert router_container()["image"] == f"trio-pdrouter:{__version__}"


def test_discovery_is_granted_list_and_watch_of_pods_in_its_namespace() -> None:
    (rule,) = one("Role")["rules"]
    assert (rule["apiGroups"], rule["resources"]) == ([""], ["pods"])
    assert set(rule["verbs"]) == {"list", "watch"}
    binding = one("RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": one("Role")["metadata"]["name"],
    }
    (subject,) = binding["subjects"]
    assert subject == {
        "kind": "ServiceAccount",
        "name": one("ServiceAccount")["metadata"]["name"],
        "namespace": kustomization()["namespace"],
    }
    pod = one("Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == subject["name"]


def test_the_service_pdb_and_service_monitor_select_the_router_pods() -> None:
    deployment = one("Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    service = one("Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    container_ports = {port["name"] for port in router_container()["ports"]}
    assert {port["targetPort"] for port in service["spec"]["ports"]} == container_ports
    pdb = one("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]
    # The ServiceMonitor by hand (a custom resource): it selects the Service by its labels and
    # scrapes the Service's metrics port by name, at the path the router serves.
    monitor = one("ServiceMonitor")
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(monitor["spec"]) == {"selector", "endpoints"}
    labels = monitor["spec"]["selector"]["matchLabels"]
    assert labels.items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert re.fullmatch(r"\d+(ms|s|m)", endpoint["interval"])
    assert "metrics" in {port["name"] for port in service["spec"]["ports"]}


async def test_the_probe_paths_answer_on_a_running_router() -> None:
    container = router_container()
    paths = [container[probe]["httpGet"]["path"] for probe in ("livenessProbe", "readinessProbe")]
    async with trio.open_nursery() as nursery:
        cluster = await start_cluster(nursery)
        for path in paths:
            resp = await cluster.client.get(cluster.url + path)
            assert resp.status_code == 200, (path, resp.text)
        nursery.cancel_scope.cancel()
