"""Each server's context length (``max_model_len``), learnt from its model list.

vLLM answers ``GET /v1/models`` with ``{"data": [{"id": ..., "max_model_len": N, ...}]}``; the
router asks every server it may send a generation to (the decode or regular servers that are
healthy now) and keeps the answer, so that a prompt no engine could take is refused before any
engine is touched (:mod:`trio_pdrouter.serve.context_length`).

The rules:

* A server is asked once it is healthy and its limit is unknown: at start, when it is added, and
  again whenever it turns healthy after being unhealthy (:meth:`ModelLimits.relearn`: it may
  have restarted with another model or ``--max-model-len``).
* One server serving several models (LoRA adapters beside their base) counts the largest limit
  listed: the router refuses only what no model of that server could take.
* Any failure (refused, timed out, an error status, an answer without ``max_model_len``) leaves
  the limit unknown and the server is asked again after a backoff: 1 s, doubling up to 60 s.
  An unknown limit refuses nothing. The loop logs and goes on after any exception.
* Servers that left the set (removed, unhealthy) are forgotten.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

import httpx
import orjson
import trio

from ..http import read_capped

log = logging.getLogger("trio_pdrouter.model_limits")

#: The largest ``/v1/models`` answer read (a model list is a few hundred bytes per model).
MAX_ANSWER_BYTES = 1024 * 1024
FIRST_RETRY_S = 1.0
LAST_RETRY_S = 60.0


class ModelLimits:
    """``max_model_len`` per server URL, kept by :meth:`run` for the URLs ``urls`` gives."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        urls: Callable[[], Collection[str]],
        *,
        timeout_s: float = 5.0,
        api_key: str | None = None,
    ) -> None:
        self._client = client
        self._urls = urls
        self._timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._limits: dict[str, int] = {}
        #: url -> (failures in a row, trio time of the next try)
        self._retry: dict[str, tuple[int, float]] = {}
        self._wake = trio.Event()

    def of(self, url: str) -> int | None:
        """The server's ``max_model_len``, None while unknown."""
        return self._limits.get(url)

    def relearn(self, url: str) -> None:
        """Ask ``url`` again now (it turned healthy)."""
        self._limits.pop(url, None)
        self._retry.pop(url, None)
        self._wake.set()

    async def run(self) -> None:
        """Learn every limit, for ever (see the module doc)."""
        while True:
            try:
                await self.learn_due()
            except Exception:  # a bug here must not end the router: try again later
                log.exception("learning model limits failed")
            with trio.move_on_at(self._next_due()):
                await self._wake.wait()
            self._wake = trio.Event()

    async def learn_due(self) -> None:
        """One pass: ask every server whose limit is unknown and whose retry is due."""
        urls = set(self._urls())
        for gone in (set(self._limits) | set(self._retry)) - urls:
            self._limits.pop(gone, None)
            self._retry.pop(gone, None)
        now = trio.current_time()
        for url in sorted(urls):
            failures, due = self._retry.get(url, (0, now))
            if url in self._limits or due > now:
                continue
            limit = await self._ask(url)
            if limit is None:
                delay = min(FIRST_RETRY_S * 2**failures, LAST_RETRY_S)
                self._retry[url] = (failures + 1, trio.current_time() + delay)
            else:
                self._retry.pop(url, None)
                self._limits[url] = limit
                log.info("url=%s max_model_len=%d", url, limit)

    def _next_due(self) -> float:
        # At least once a second, for servers that became healthy without a health change
        # (another worker's fleet added them, health checks are off).
        soon = trio.current_time() + 1.0
        return min([soon, *(due for _, due in self._retry.values())])

    async def _ask(self, url: str) -> int | None:
        try:
            with trio.fail_after(self._timeout_s):
                async with self._client.stream(
                    "GET", url + "/v1/models", headers=self._headers, timeout=self._timeout_s
                ) as resp:
                    if resp.status_code != 200:
                        log.debug("models url=%s status=%d", url, resp.status_code)
                        return None
                    raw = await read_capped(resp, MAX_ANSWER_BYTES)
            return _largest_limit(orjson.loads(raw))
        except Exception as exc:  # any failure (AnswerTooLarge too) leaves the limit unknown
            log.debug("models url=%s failed=%r", url, exc)
            return None


def _largest_limit(answer: object) -> int | None:
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        return None
    limits = [
        m["max_model_len"]
        for m in data
        if isinstance(m, dict) and type(m.get("max_model_len")) is int and m["max_model_len"] > 0
    ]
    return max(limits, default=None)
