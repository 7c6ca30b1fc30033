"""The watch loop of discovery: one watch per role, re-listing whenever it may have missed news.

Rules of this module:

* Each role's loop runs sessions. A session lists the role's pods (server-side label selector)
  and hands the whole list to the reconciler, which drops whatever the list no longer has (a
  delete missed while the watch was down), then watches from the list's resource version,
  applying each event as it arrives. A watch the server closes (its ``timeoutSeconds``) is
  resumed from the last resource version seen, bookmarks included.
* A session lasts at most ``resync`` seconds (``--service-discovery-resync-secs``); then the
  loop lists again. That is the periodic resync, and it also bounds a silent watch: one that
  sends nothing, not even a bookmark, is cut and replaced within ``resync`` seconds.
* A session that fails (410 Expired, a refused request, a broken connection, garbage) is
  followed by a new one after a short jittered backoff: ``BACKOFF_MIN`` doubling to
  ``BACKOFF_MAX`` seconds while failures follow each other, back to ``BACKOFF_MIN`` after a
  session that listed successfully. Never a minute, as vllm-router 0.1.17 waits.
* Nothing here waits for a pod's health: the reconciler adds servers, the health board probes
  them in its own tasks. Every event is applied synchronously where it is read.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import httpx
import trio

from ..config import Selector
from ..endpoints import Role
from .kube_api import ApiError, Expired, PodsApi
from .reconcile import Reconciler

log = logging.getLogger("trio_pdrouter.discovery")

BACKOFF_MIN = 0.1
BACKOFF_MAX = 5.0
#: Added to a session's length for the server's own ``timeoutSeconds``, so the server, not the
#: router, normally ends the last watch of a session.
SERVER_TIMEOUT_SLACK = 5


class WatchObserver(Protocol):
    """What the loop reports (:class:`~trio_pdrouter.discovery.metrics.DiscoveryMetrics`)."""

    def listed(self, role: Role, pods: int, pages: int) -> None: ...
    def restarted(self, role: Role, reason: str) -> None: ...
    def applied(self, role: Role, kind: str, seconds: float) -> None: ...


class PodWatch:
    """The watches of every role the reconciler knows, until cancelled (module doc)."""

    def __init__(
        self,
        api: PodsApi,
        reconciler: Reconciler,
        selectors: Mapping[Role, Selector],
        *,
        resync: float,
        observer: WatchObserver,
        rng: random.Random,
    ) -> None:
        self._api = api
        self._reconciler = reconciler
        self._selectors = dict(selectors)
        self._resync = resync
        self._observer = observer
        self._rng = rng

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch every role; reports started once each has tried its first list."""
        async with trio.open_nursery() as nursery:
            for role in self._selectors:
                await nursery.start(self._follow, role)
            task_status.started()

    async def _follow(self, role: Role, task_status: trio.TaskStatus[None]) -> None:
        delay = BACKOFF_MIN
        first = True
        while True:
            listed = False

            def on_listed() -> None:
                nonlocal listed, first
                listed = True
                if first:  # the first list is in: the router may serve
                    first = False
                    task_status.started()

            try:
                await self._session(role, on_listed)
                reason = "resync"
            except Expired as exc:
                reason = "expired"
                log.info("discovery role=%s watch expired (410): %s", role.value, exc)
            except (httpx.HTTPError, ApiError, OSError, ValueError) as exc:
                reason = type(exc).__name__
                log.warning("discovery role=%s watch failed: %s: %s", role.value, reason, exc)
            if first:  # the first list failed: serve anyway, and keep trying
                first = False
                task_status.started()
            self._observer.restarted(role, reason)
            if reason == "resync":
                continue
            delay = BACKOFF_MIN if listed else min(delay * 2, BACKOFF_MAX)
            await trio.sleep(delay * self._rng.uniform(0.5, 1.0))

    async def _session(self, role: Role, on_listed: Callable[[], None]) -> None:
        """List, then watch until ``resync`` seconds are over; raises what ended it early."""
        selector = self._selectors[role].query()
        with trio.move_on_after(self._resync):
            pods = await self._api.list(selector)
            self._reconciler.replace(role, pods.items)
            self._reconciler.sync()
            self._observer.listed(role, len(pods.items), pods.pages)
            log.debug("discovery role=%s listed pods=%d", role.value, len(pods.items))
            on_listed()
            version = pods.resource_version
            timeout = math.ceil(self._resync) + SERVER_TIMEOUT_SLACK

            def on_event(kind: str, obj: Mapping[str, Any]) -> None:
                if kind not in ("ADDED", "MODIFIED", "DELETED"):
                    return  # BOOKMARK: only its resource version counts
                start = trio.current_time()
                self._reconciler.apply(role, kind, obj)
                self._reconciler.sync()
                self._observer.applied(role, kind, trio.current_time() - start)

            while True:
                version = await self._api.watch(selector, version, timeout, on_event)
