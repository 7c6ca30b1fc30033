"""The pods client against the fake API server: paging, selectors, watch events, 410s, the
token read on every request, kubeconfig and in-cluster credentials; and the fake itself
checked with kubectl, where it is installed."""

from __future__ import annotations

import base64
import pathlib
import shutil
import subprocess
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import pytest
import trio

from tests.kube_fake import FakeKube, serve_fake
from tests.pods import pod
from trio_pdrouter.discovery import (
    Credentials,
    Expired,
    NoCredentials,
    PodsApi,
    from_kubeconfig,
    load,
)


@pytest.fixture
async def fake(nursery: trio.Nursery) -> AsyncIterator[FakeKube]:
    kube = FakeKube()
    await nursery.start(serve_fake, kube)
    yield kube


def api(fake: FakeKube, namespace: str | None = "default", page_size: int = 500) -> PodsApi:
    client = httpx.AsyncClient(timeout=10)
    return PodsApi(client, Credentials(fake.url, static_token="t0"), namespace, page_size=page_size)


async def test_list_pages_with_continue_and_filters_by_label_selector(fake: FakeKube) -> None:
    for i in range(7):
        fake.put(pod(f"w-{i}", f"10.0.0.{i}", labels={"app": "vllm" if i % 3 else "other"}))
    fake.put(pod("elsewhere", "10.0.1.1", namespace="ns2"))
    listed = await api(fake, page_size=2).list("app=vllm")
    assert sorted(p["metadata"]["name"] for p in listed.items) == ["w-1", "w-2", "w-4", "w-5"]
    assert listed.pages == 2 and listed.resource_version == str(fake.version)
    pages = [q for path, q, _ in fake.requests if path == "/api/v1/namespaces/default/pods"]
    assert pages[0] == {"limit": "2", "labelSelector": "app=vllm"}
    assert pages[1]["continue"] and pages[1]["labelSelector"] == "app=vllm"
    everywhere = await api(fake, namespace=None).list("")
    assert len(everywhere.items) == 8


async def test_an_expired_continue_token_is_expired(fake: FakeKube) -> None:
    for i in range(3):
        fake.put(pod(f"w-{i}", f"10.0.0.{i}"))
    client = httpx.AsyncClient(timeout=10)
    first = await client.get(fake.url + "/api/v1/namespaces/default/pods", params={"limit": 1})
    token = first.json()["metadata"]["continue"]
    fake.expire_continue_tokens()
    second = await client.get(
        fake.url + "/api/v1/namespaces/default/pods", params={"limit": 1, "continue": token}
    )
    assert second.status_code == 410 and second.json()["reason"] == "Expired"

    lister = api(fake, page_size=1)
    real_get = lister._client.get

    async def get_then_expire(*args: Any, **kwargs: Any) -> httpx.Response:
        resp = await real_get(*args, **kwargs)
        fake.expire_continue_tokens()
        return resp

    lister._client.get = get_then_expire  # type: ignore[method-assign]
    with pytest.raises(Expired):
        await lister.list("")


async def test_watch_delivers_events_in_order_from_the_version_and_resumes(
    fake: FakeKube,
) -> None:
    fake.put(pod("a", "10.0.0.1", uid="ua"))
    pods = api(fake)
    listed = await pods.list("app=vllm")
    events: list[tuple[str, str]] = []

    def on_event(kind: str, obj: Mapping[str, Any]) -> None:
        events.append((kind, obj["metadata"]["name"]))

    fake.max_watch_seconds = 0.5  # the server ends each watch at its timeout
    fake.put(pod("b", "10.0.0.2"))
    fake.put(pod("a", "10.0.0.1", uid="ua", ready=False))
    fake.put(pod("b", "10.0.0.2", labels={"app": "moved"}))  # out of the selector: DELETED
    version = await pods.watch("app=vllm", listed.resource_version, 30, on_event)
    assert events == [("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b")]
    assert version == str(fake.version)
    watch = [q for path, q, _ in fake.requests if q.get("watch")][-1]
    assert watch == {
        "watch": "1",
        "resourceVersion": listed.resource_version,
        "allowWatchBookmarks": "true",
        "timeoutSeconds": "30",
        "labelSelector": "app=vllm",
    }
    fake.delete("default", "a", force=True)
    events.clear()
    assert await pods.watch("app=vllm", version, 30, on_event) == str(fake.version)
    assert events == [("DELETED", "a")]


async def test_a_bookmark_moves_the_version_on(fake: FakeKube) -> None:
    fake.put(pod("a", "10.0.0.1"))
    fake.put(pod("x", "10.0.0.9", labels={"app": "other"}))  # a newer version, not selected
    pods = api(fake)
    kinds: list[str] = []
    fake.max_watch_seconds = 1
    async with trio.open_nursery() as nursery:

        async def mark() -> None:
            while not fake.watches_open:  # noqa: ASYNC110 - bounded by the watch's timeout
                await trio.sleep(0.01)
            fake.bookmark()

        nursery.start_soon(mark)
        version = await pods.watch("app=vllm", "1001", 30, lambda kind, obj: kinds.append(kind))
    assert kinds == ["BOOKMARK"] and version == str(fake.version)


async def test_a_too_old_version_is_an_in_stream_410_and_expired(fake: FakeKube) -> None:
    fake.put(pod("a", "10.0.0.1"))
    old = str(fake.version)
    fake.put(pod("a", "10.0.0.1", ready=False))
    fake.compact()
    async with httpx.AsyncClient(timeout=10) as client:
        resp = await client.get(
            fake.url + "/api/v1/namespaces/default/pods",
            params={"watch": "1", "resourceVersion": old},
        )
    assert resp.status_code == 200  # the API server answers 410 inside the stream
    assert '"code":410' in resp.text and '"type":"ERROR"' in resp.text
    with pytest.raises(Expired):
        await api(fake).watch("", old, 30, lambda kind, obj: None)


async def test_a_broken_watch_is_an_http_error(fake: FakeKube) -> None:
    pods = api(fake)
    listed = await pods.list("")
    failures: list[Exception] = []

    async def watch() -> None:
        try:
            await pods.watch("", listed.resource_version, 30, lambda kind, obj: None)
        except httpx.HTTPError as exc:
            failures.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        while not fake.watches_open:  # noqa: ASYNC110 - bounded by pytest-trio's timeout
            await trio.sleep(0.01)
        fake.break_watches()
    assert [type(f) for f in failures] == [httpx.RemoteProtocolError]


async def test_the_token_is_read_again_for_every_request(
    fake: FakeKube, tmp_path: pathlib.Path
) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    pods = PodsApi(
        httpx.AsyncClient(timeout=10), Credentials(fake.url, token_file=token), "default"
    )
    await pods.list("")
    token.write_text("rotated")
    await pods.list("")
    assert [auth for _, _, auth in fake.requests] == ["Bearer first", "Bearer rotated"]


def _kubeconfig(tmp_path: pathlib.Path, server: str, user: str) -> pathlib.Path:
    path = tmp_path / "config"
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: c
  cluster:
    server: {server}
users:
- name: u
  user:
{user}
contexts:
- name: ctx
  context: {{cluster: c, user: u, namespace: team}}
current-context: ctx
"""
    )
    return path


def test_kubeconfig_gives_server_token_and_namespace(tmp_path: pathlib.Path) -> None:
    path = _kubeconfig(tmp_path, "http://127.0.0.1:1/", "    token: abc")
    creds = from_kubeconfig(path)
    assert creds.server == "http://127.0.0.1:1" and creds.tls is None
    assert creds.headers() == {"authorization": "Bearer abc"} and creds.namespace == "team"
    (tmp_path / "tok").write_text("from-file")
    creds = from_kubeconfig(_kubeconfig(tmp_path, "http://h:1", "    tokenFile: tok"))
    assert creds.token() == "from-file"
    assert load(None, {"KUBECONFIG": str(path)}).server == "http://h:1"  # the same file, rewritten


def test_kubeconfig_with_https_builds_a_tls_context_and_refuses_exec(
    tmp_path: pathlib.Path,
) -> None:
    creds = from_kubeconfig(
        _kubeconfig(tmp_path, "https://k:6443", "    token: abc")
    )  # no CA given: the system's
    assert creds.tls is not None
    with pytest.raises(NoCredentials, match="exec"):
        from_kubeconfig(_kubeconfig(tmp_path, "https://k:6443", "    exec: {command: aws}"))
    bad_ca = base64.b64encode(b"not a certificate").decode()
    path = _kubeconfig(tmp_path, "https://k:6443", "    token: abc")
    path.write_text(
        path.read_text().replace(
            "server: https://k:6443",
            f"server: https://k:6443\n    certificate-authority-data: {bad_ca}",
        )
    )
    with pytest.raises(Exception):  # noqa: B017 - ssl's own error for a bad CA
        from_kubeconfig(path)


def test_in_cluster_credentials_when_there_is_no_kubeconfig(tmp_path: pathlib.Path) -> None:
    env = {"HOME": str(tmp_path), "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    with pytest.raises(FileNotFoundError):  # no service account files here: the CA is missing
        load(None, env)
    with pytest.raises(NoCredentials, match="not running in a pod"):
        load(None, {"HOME": str(tmp_path)})


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
async def test_kubectl_lists_in_chunks_and_watches_the_fake(
    fake: FakeKube, tmp_path: pathlib.Path
) -> None:
    for i in range(5):
        fake.put(pod(f"w-{i}", f"10.0.0.{i}"))
    config = _kubeconfig(tmp_path, fake.url, "    token: abc").read_text()
    path = tmp_path / "config"
    path.write_text(config.replace("namespace: team", "namespace: default"))
    kubectl = ["kubectl", "--kubeconfig", str(path)]
    done = await trio.run_process(
        [*kubectl, "get", "pods", "--chunk-size=2", "-o", "name"], capture_stdout=True
    )
    assert done.stdout.decode().split() == [f"pod/w-{i}" for i in range(5)]
    lists = [q for p, q, _ in fake.requests if p.endswith("/pods") and not q.get("watch")]
    assert [q.get("limit") for q in lists] == ["2", "2", "2"] and "continue" in lists[1]
    process = await trio.lowlevel.open_process(
        [*kubectl, "get", "pods", "--watch", "-o", "name"], stdout=subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        seen = b""
        with trio.fail_after(20):
            while seen.count(b"\n") < 5:
                seen += await process.stdout.receive_some()
            fake.put(pod("w-9", "10.0.0.9"))
            fake.delete("default", "w-1", force=True)
            while seen.count(b"\n") < 7:
                seen += await process.stdout.receive_some()
        assert seen.decode().split()[5:] == ["pod/w-9", "pod/w-1"]
        assert any(
            q.get("watch") == "true" and q.get("resourceVersion") for _, q, _ in fake.requests
        )
    finally:
        process.terminate()
        await process.wait()
