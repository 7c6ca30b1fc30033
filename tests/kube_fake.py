"""A fake Kubernetes API server for pods, on 127.0.0.1: the list and watch protocol, faithfully.

What it serves (the shapes of the API concepts' "efficient detection of changes"):

* ``GET /api/v1/pods`` and ``/api/v1/namespaces/{ns}/pods``: a ``PodList`` with
  ``metadata.resourceVersion``; ``labelSelector`` (``k=v``, ``k==v``, ``k!=v``, ``k``, comma =
  AND); ``limit`` pages with a ``continue`` token, each page from the snapshot the first page
  was cut from; a token :meth:`FakeKube.expire_continue_tokens` expired answers HTTP 410
  ``Expired``. ``GET .../pods/{name}`` one pod.
* ``watch=1``: a chunked stream of one JSON event per line from ``resourceVersion`` on —
  ``ADDED``, ``MODIFIED``, ``DELETED`` as the selector sees them (a pod relabelled out of it is
  ``DELETED``, into it ``ADDED``), ``BOOKMARK`` on :meth:`FakeKube.bookmark` when
  ``allowWatchBookmarks=true``; a version older than the compacted history gets an in-stream
  ``ERROR`` with a ``Status`` of code 410; the stream ends at ``timeoutSeconds`` (capped by
  :attr:`FakeKube.max_watch_seconds`). :meth:`FakeKube.break_watches` cuts every open stream
  mid-chunk; :attr:`FakeKube.stall` makes new watches send their head and then nothing.
* ``/version``, ``/api``, ``/apis``, ``/api/v1`` for clients that discover first (kubectl).
* Pod lifecycles as the API server shows them: :meth:`FakeKube.put` (create or update),
  :meth:`FakeKube.delete` (graceful: ``deletionTimestamp`` and not ready, then gone; or forced:
  gone at once), each a new resource version.

Every request is recorded in :attr:`FakeKube.requests` (path, query, authorization header).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

import hypercorn.trio
import orjson
import trio
from hypercorn.config import Config

Pod = dict[str, Any]
Scope = dict[str, Any]


def parse_selector(text: str) -> Callable[[dict[str, str]], bool]:
    tests: list[Callable[[dict[str, str]], bool]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            tests.append(lambda labels, k=key, v=value: labels.get(k) != v)
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            tests.append(lambda labels, k=key, v=value: labels.get(k) == v)
        else:
            tests.append(lambda labels, k=term: k in labels)
    return lambda labels: all(test(labels) for test in tests)


def _labels(pod: Pod | None) -> dict[str, str]:
    return {} if pod is None else pod["metadata"].get("labels") or {}


class FakeKube:
    """The pods of a cluster behind a fake API server (module doc)."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], Pod] = {}
        self.version = 1000
        #: (resource version, old object or None, new object or None), oldest first.
        self.history: list[tuple[int, Pod | None, Pod | None]] = []
        self.compacted = 0  # versions at or below this are gone from the history
        self.max_watch_seconds = 3600.0
        self.stall = False
        self.requests: list[tuple[str, dict[str, str], str | None]] = []
        self.fail_lists = 0  # answer this many next lists with a 500
        self._changed = trio.Event()
        self._snapshots: dict[str, tuple[int, list[Pod]]] = {}
        self._tokens = itertools.count(1)
        self._breaks = 0
        self._bookmarks = 0
        self.watches_open = 0
        self.stalled = 0  # watches that went silent under :attr:`stall`
        self.url = ""

    # -- the cluster -------------------------------------------------------------------------

    def _commit(self, old: Pod | None, new: Pod | None) -> int:
        self.version += 1
        obj = new if new is not None else old
        assert obj is not None
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.history.append((self.version, copy.deepcopy(old), copy.deepcopy(new)))
        self._notify()
        return self.version

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def put(self, pod: Pod) -> int:
        """Create or update ``pod`` (its namespace/name); returns the new resource version."""
        pod = copy.deepcopy(pod)
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        old = self.pods.get(key)
        self.pods[key] = pod
        return self._commit(old, pod)

    def delete(self, namespace: str, name: str, *, force: bool = False) -> None:
        """Force: gone at once (one DELETED). Graceful: terminating and not ready, then gone."""
        old = self.pods[(namespace, name)]
        if not force:
            terminating = copy.deepcopy(old)
            terminating["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
            for condition in terminating["status"].get("conditions", []):
                if condition["type"] == "Ready":
                    condition["status"] = "False"
            self.put(terminating)
            old = self.pods[(namespace, name)]
        del self.pods[(namespace, name)]
        self._commit(old, None)

    def compact(self) -> None:
        """Forget the history up to now: watches from older versions get 410."""
        self.compacted = self.version
        self.history.clear()

    def expire_continue_tokens(self) -> None:
        self._snapshots.clear()

    def break_watches(self) -> None:
        """Cut every open watch stream mid-chunk."""
        self._breaks += 1
        self._notify()

    def bookmark(self) -> None:
        """Send a BOOKMARK on every open watch that asked for them."""
        self._bookmarks += 1
        self._notify()

    # -- HTTP --------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].removeprefix("lifespan.")
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["type"] != "http":
            return
        query = {k: v[0] for k, v in parse_qs(scope["query_string"].decode()).items()}
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization")
        path: str = scope["path"]
        self.requests.append((path, query, auth.decode() if auth else None))
        parts = path.strip("/").split("/")
        if path == "/version":
            await _json(send, 200, {"major": "1", "minor": "32", "gitVersion": "v1.32.0-fake"})
        elif path == "/api":
            await _json(send, 200, {"kind": "APIVersions", "versions": ["v1"]})
        elif path == "/apis":
            await _json(send, 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": []})
        elif path == "/api/v1":
            await _json(send, 200, RESOURCES)
        elif parts[:2] == ["api", "v1"] and parts[-1] == "pods" and len(parts) in (3, 5):
            namespace = parts[3] if len(parts) == 5 else None
            if query.get("watch") in ("1", "true"):
                await self._watch(send, namespace, query)
            else:
                await self._list(send, namespace, query)
        elif parts[:2] == ["api", "v1"] and len(parts) == 6 and parts[4] == "pods":
            pod = self.pods.get((parts[3], parts[5]))
            if pod is None:
                await _json(send, 404, _status(404, "NotFound", f'pods "{parts[5]}" not found'))
            else:
                await _json(send, 200, pod)
        else:
            await _json(send, 404, _status(404, "NotFound", "the server could not find it"))

    def _selected(self, namespace: str | None, query: dict[str, str]) -> Callable[[Pod], bool]:
        matches = parse_selector(query.get("labelSelector", ""))
        return lambda pod: (
            namespace in (None, pod["metadata"]["namespace"]) and matches(_labels(pod))
        )

    async def _list(self, send: Any, namespace: str | None, query: dict[str, str]) -> None:
        if self.fail_lists:
            self.fail_lists -= 1
            await _json(send, 500, _status(500, "InternalError", "injected failure"))
            return
        token = query.get("continue")
        if token:
            if token not in self._snapshots:
                message = "The provided continue parameter is too old to display a consistent list"
                await _json(send, 410, _status(410, "Expired", message))
                return
            version, rest = self._snapshots.pop(token)
        else:
            selected = self._selected(namespace, query)
            version = self.version
            rest = [copy.deepcopy(p) for _, p in sorted(self.pods.items()) if selected(p)]
        limit = int(query.get("limit", "0") or 0)
        page, rest = (rest[:limit], rest[limit:]) if limit else (rest, [])
        metadata: dict[str, Any] = {"resourceVersion": str(version)}
        if rest:
            token = f"c{next(self._tokens)}"
            self._snapshots[token] = (version, rest)
            metadata["continue"] = token
            metadata["remainingItemCount"] = len(rest)
        body = {"kind": "PodList", "apiVersion": "v1", "metadata": metadata, "items": page}
        await _json(send, 200, body)

    async def _watch(self, send: Any, namespace: str | None, query: dict[str, str]) -> None:
        selected = self._selected(namespace, query)
        since = int(query.get("resourceVersion") or self.version)
        bookmarks = query.get("allowWatchBookmarks") == "true"
        seconds = min(float(query.get("timeoutSeconds") or 1800), self.max_watch_seconds)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        self.watches_open += 1
        try:
            with trio.move_on_after(seconds):
                if self.stall:
                    self.stalled += 1
                    await trio.sleep_forever()
                await self._stream(send, selected, since, bookmarks)
        finally:
            self.watches_open -= 1
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _stream(
        self, send: Any, selected: Callable[[Pod], bool], since: int, bookmarks: bool
    ) -> None:
        async def event(kind: str, obj: Pod) -> None:
            line = orjson.dumps({"type": kind, "object": obj}) + b"\n"
            await send({"type": "http.response.body", "body": line, "more_body": True})

        if since < self.compacted:
            message = f"too old resource version: {since} ({self.compacted})"
            await event("ERROR", _status(410, "Expired", message))
            return
        breaks, marks = self._breaks, self._bookmarks
        while True:
            changed = self._changed  # set by any change from now on, even during the sends
            if self._breaks != breaks:
                # half a chunk, then the connection goes: the client sees a broken stream
                await send(
                    {"type": "http.response.body", "body": b'{"type":"MOD', "more_body": True}
                )
                raise ConnectionAbortedError("watch broken on purpose")
            for version, old, new in [h for h in self.history if h[0] > since]:
                since = version
                was, now = old is not None and selected(old), new is not None and selected(new)
                if was and now:
                    await event("MODIFIED", new)  # type: ignore[arg-type]
                elif now:
                    await event("ADDED", new)  # type: ignore[arg-type]
                elif was:  # deleted, or relabelled out of the selector: the last state seen
                    gone = copy.deepcopy(new if new is not None else old)
                    assert gone is not None
                    gone["metadata"]["resourceVersion"] = str(version)
                    await event("DELETED", gone)
            if self._bookmarks != marks:
                marks = self._bookmarks
                if bookmarks:
                    mark = {"kind": "Pod", "apiVersion": "v1"}
                    await event("BOOKMARK", {**mark, "metadata": {"resourceVersion": str(since)}})
            await changed.wait()


RESOURCES = {
    "kind": "APIResourceList",
    "apiVersion": "v1",
    "groupVersion": "v1",
    "resources": [
        {
            "name": "pods",
            "singularName": "pod",
            "namespaced": True,
            "kind": "Pod",
            "verbs": ["get", "list", "watch"],
            "shortNames": ["po"],
        }
    ],
}


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


async def _json(send: Any, status: int, body: Any) -> None:
    raw = orjson.dumps(body)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw, "more_body": False})


async def serve_fake(
    fake: FakeKube, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve ``fake`` on 127.0.0.1 (a free port) until cancelled; reports its base URL."""
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.graceful_timeout = 0.1

    async def run(task_status: trio.TaskStatus[list[str]]) -> None:
        await hypercorn.trio.serve(fake, config, task_status=task_status)  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(run)
        fake.url = binds[0]
        task_status.started(binds[0])
