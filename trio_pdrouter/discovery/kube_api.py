"""The pods list and watch of the Kubernetes API, over httpx under trio: nothing more.

Rules of this module (the protocol of the API server's "efficient detection of changes"):

* :meth:`PodsApi.list` reads every pod the label selector matches, in pages of ``page_size``
  (``limit`` and the ``continue`` token of each page), and returns them with the list's
  ``resourceVersion``, where a watch starts. A continue token that expired answers HTTP 410:
  :class:`Expired` (the caller lists again from the start).
* :meth:`PodsApi.watch` streams changes after a resource version (``watch=1``,
  ``allowWatchBookmarks=true``, ``timeoutSeconds``): one JSON event per line, ``ADDED``,
  ``MODIFIED``, ``DELETED`` (each with the pod) and ``BOOKMARK`` (only a newer resource
  version), each handed to ``on_event`` in order; it returns the last resource version seen
  when the server ends the stream (at ``timeoutSeconds``). An ``ERROR`` event with status 410,
  or an HTTP 410, is :class:`Expired`: the version is too old and only a new list can resume.
  Any other ``ERROR`` or status is :class:`ApiError`; transport failures are httpx's.
* No deadline of its own beyond httpx's per-read timeout: the watch loop bounds each call.
* Every request carries the credentials' headers as they are at that moment (a rotated token).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import httpx
import orjson

from .credentials import Credentials
from .pod_rule import Pod

#: Called with each watch event's type and object, in stream order.
OnEvent = Callable[[str, Mapping[str, Any]], None]


class Expired(Exception):
    """410 Gone: the resource version or continue token is too old; list again."""


class ApiError(Exception):
    """The API server refused a request (status other than 2xx and 410), or sent garbage."""


@attrs.frozen
class PodList:
    items: list[Pod]
    resource_version: str
    pages: int


class PodsApi:
    """Pods of one namespace (or all, ``namespace=None``) through ``client``."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        credentials: Credentials,
        namespace: str | None,
        *,
        page_size: int = 500,
    ) -> None:
        self._client = client
        self._credentials = credentials
        self._page_size = page_size
        where = f"namespaces/{namespace}/" if namespace else ""
        self._url = f"{credentials.server}/api/v1/{where}pods"

    async def list(self, selector: str) -> PodList:
        items: list[Pod] = []
        token: str | None = None
        pages = 0
        while True:
            params = {"limit": str(self._page_size)}
            if selector:
                params["labelSelector"] = selector
            if token:
                params["continue"] = token
            resp = await self._client.get(
                self._url, params=params, headers=self._credentials.headers()
            )
            body = _json(resp)
            pages += 1
            items.extend(body.get("items") or ())
            meta = body.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                return PodList(items, str(meta.get("resourceVersion", "")), pages)

    async def watch(
        self, selector: str, resource_version: str, timeout_seconds: int, on_event: OnEvent
    ) -> str:
        params = {
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
        }
        if selector:
            params["labelSelector"] = selector
        headers = self._credentials.headers()
        async with self._client.stream("GET", self._url, params=params, headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                _json(resp)  # raises
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                resource_version = _event(line, resource_version, on_event)
        return resource_version


def _json(resp: httpx.Response) -> dict[str, Any]:
    if resp.status_code == 410:
        raise Expired(resp.text[:200])
    if not resp.is_success:
        raise ApiError(f"{resp.request.method} {resp.request.url.path}: {resp.status_code}")
    try:
        body = orjson.loads(resp.content)
    except orjson.JSONDecodeError:
        raise ApiError(f"{resp.request.url.path}: not JSON") from None
    if not isinstance(body, dict):
        raise ApiError(f"{resp.request.url.path}: not an object")
    return body


def _event(line: str, resource_version: str, on_event: OnEvent) -> str:
    """Hand one event line to ``on_event``; the resource version after it."""
    try:
        event = orjson.loads(line)
        kind, obj = event["type"], event["object"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise ApiError(f"watch: not an event: {line[:200]!r}") from None
    if kind == "ERROR":
        if obj.get("code") == 410:
            raise Expired(str(obj.get("message", "")))
        raise ApiError(f"watch error {obj.get('code')}: {obj.get('message', '')}")
    version = (obj.get("metadata") or {}).get("resourceVersion")
    on_event(kind, obj)
    return str(version) if version else resource_version
