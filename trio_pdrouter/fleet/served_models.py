"""What each server serves: its models and LoRA adapters, and its context length, learnt from its
model list.

vLLM answers ``GET /v1/models`` with one card per base model it serves (``id``, ``root``, its
``max_model_len``, ``parent`` null) followed by one per LoRA adapter loaded (``id`` the adapter's
name, ``root`` its path, ``parent`` the base model it applies to, no ``max_model_len``):
``OpenAIServingModels.show_available_models`` in vllm/entrypoints/openai/serving_models.py
(vLLM commit 075e9ba825513f0e50ae1a5185d6db0ee405f84e). A request naming any of those ids is
served; any other gets 404 ``The model `X` does not exist.`` (``_check_model`` in
vllm/entrypoints/openai/serving_engine.py, commit 0030b9ffce2b2e8b8e9f04a7b108f5877193cec0).

The rules (docs/models.md):

* Every server of the fleet is asked, in every role, once it is healthy and its list is unknown
  or due: at start, when it is added, whenever it turns healthy after being unhealthy
  (:meth:`ServedModels.relearn`: it may have restarted with another model), every
  ``--models-refresh-interval`` seconds (0: never on a schedule), and right after an adapter was
  loaded or unloaded through the router (:meth:`ServedModels.learn_now`).
* An answer replaces the server's list whole. A failure (refused, timed out, an error status, an
  answer that is not a model list) keeps the list the server last gave, if any, and asks again
  after a backoff: 1 s, doubling up to 60 s. A server's list is kept while it is unhealthy (it is
  not asked then) and forgotten when it leaves the fleet.
* A server whose list has never been read is *unknown*. It is assumed to serve only what no
  candidate with a known list serves (and requests that name no model): a request for a model
  goes to the candidates (of the stage, routable now) that list it; when none does, to the
  candidates whose list is unknown, which answer for themselves; else nowhere (503). The
  router logs a warning naming the server and that assumption when a first attempt fails, and
  counts the unknown servers in ``trio_pdrouter_servers_models_unknown``.
* A model is *unserved* — answered 404 without reaching an engine — when no server lists it and
  every server's list is known. Before that answer every healthy server is asked again (at most
  once a second, requests arriving meanwhile wait for that ask: :meth:`ServedModels.recheck`):
  an adapter may have been loaded since, through another worker of ``--workers N`` (which
  relearnt at once; this process would otherwise wait for its schedule) or on the servers
  directly.
* One server serving several models counts the largest ``max_model_len`` listed as its context
  length (:mod:`trio_pdrouter.serve.context_length`).
* The loop logs and goes on after any exception.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import attrs
import httpx
import orjson
import trio

from ..endpoints import Endpoint
from ..http import read_capped

log = logging.getLogger("trio_pdrouter.models")

#: The largest ``/v1/models`` answer read (a model list is a few hundred bytes per model).
MAX_ANSWER_BYTES = 1024 * 1024
FIRST_RETRY_S = 1.0
LAST_RETRY_S = 60.0
#: Seconds between two asks of every server prompted by a request for a model nobody lists.
RECHECK_GAP_S = 1.0
#: What an unknown server is assumed to serve, as the log line says it.
ASSUMPTION = "models no candidate with a known list serves, and requests naming no model"


@attrs.frozen(slots=False)  # a __dict__ for the cached properties: routing reads them often
class ServerModels:
    """One server's answer to ``GET /v1/models``: its cards as given, in order."""

    cards: tuple[dict[str, Any], ...]

    @classmethod
    def read(cls, answer: object) -> ServerModels | None:
        """The cards of a model list (those with a string ``id``), None if it is not one."""
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list):
            return None
        cards = tuple(c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str))
        return cls(cards)

    @functools.cached_property
    def ids(self) -> frozenset[str]:
        """Every model id the server serves: base models and adapters."""
        return frozenset(card["id"] for card in self.cards)

    @property
    def models(self) -> list[str]:
        """The base models (cards without a ``parent``)."""
        return [card["id"] for card in self.cards if not card.get("parent")]

    @functools.cached_property
    def adapters(self) -> dict[str, str]:
        """Adapter id -> the base model it applies to (cards with a ``parent``)."""
        return {card["id"]: str(card["parent"]) for card in self.cards if card.get("parent")}

    @property
    def max_model_len(self) -> int | None:
        limits = [
            c["max_model_len"]
            for c in self.cards
            if type(c.get("max_model_len")) is int and c["max_model_len"] > 0
        ]
        return max(limits, default=None)


class ServedModels:
    """Each fleet server's :class:`ServerModels`, kept by :meth:`run` (see the module doc).

    ``servers`` gives the URLs of the fleet (every role); ``may_ask`` says whether one is healthy
    now; ``interval_s`` is ``--models-refresh-interval``.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        servers: Callable[[], Collection[str]],
        may_ask: Callable[[str], bool],
        *,
        interval_s: float = 30.0,
        timeout_s: float = 5.0,
        api_key: str | None = None,
    ) -> None:
        self._client = client
        self._servers = servers
        self._may_ask = may_ask
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._known: dict[str, ServerModels] = {}
        #: url -> (failures in a row, trio time of the next ask)
        self._due: dict[str, tuple[int, float]] = {}
        #: Unknown servers whose assumption was logged (once each until they are known).
        self._warned: set[str] = set()
        #: The last :meth:`recheck`'s ask of every server: when it began, and its end.
        self._rechecked_at = -math.inf
        self._recheck_done: trio.Event | None = None
        self._wake = trio.Event()

    # -- reading ---------------------------------------------------------------------------

    def of(self, url: str) -> ServerModels | None:
        """What ``url`` serves, None while unknown."""
        return self._known.get(url)

    def limit(self, url: str) -> int | None:
        """The server's ``max_model_len``, None while unknown."""
        known = self._known.get(url)
        return None if known is None else known.max_model_len

    def unknown(self) -> list[str]:
        """The fleet's servers whose list was never read."""
        return sorted(url for url in self._servers() if url not in self._known)

    def may_serve(self, url: str, model: str) -> bool:
        """``url`` lists ``model``, or its list is unknown."""
        known = self._known.get(url)
        return known is None or model in known.ids

    def serving(self, candidates: Sequence[Endpoint], model: str) -> list[Endpoint]:
        """Those of ``candidates`` a request for ``model`` may go to (module doc)."""
        known = self._known
        listed = [ep for ep in candidates if ep.url in known and model in known[ep.url].ids]
        return listed or [ep for ep in candidates if ep.url not in known]

    def unserved(self, model: str) -> bool:
        """No server lists ``model`` and every server's list is known: vLLM's 404."""
        known = self._known
        if any(model in served.ids for served in known.values()):
            return False
        urls = self._servers()
        return bool(urls) and all(url in known for url in urls)

    async def recheck(self, model: str) -> bool:
        """:meth:`unserved`, after asking every healthy server again when it is (module doc)."""
        if not self.unserved(model):
            return False
        done = self._recheck_done
        if done is not None:
            await done.wait()
        elif trio.current_time() - self._rechecked_at >= RECHECK_GAP_S:
            self._rechecked_at = trio.current_time()
            self._recheck_done = done = trio.Event()
            try:
                await self.learn_now(url for url in self._servers() if self._may_ask(url))
            finally:
                self._recheck_done = None
                done.set()
        return self.unserved(model)

    def is_adapter(self, model: str) -> bool:
        """Some server lists ``model`` as a LoRA adapter (a card with a ``parent``)."""
        return any(model in served.adapters for served in self._known.values())

    def served_ids(self) -> frozenset[str]:
        """Every model id some known server lists."""
        return frozenset(i for served in self._known.values() for i in served.ids)

    def cards(self, urls: Collection[str]) -> list[dict[str, Any]]:
        """The union of the cards of ``urls`` (those known), the first card of each id (servers
        in URL order)."""
        out: dict[str, dict[str, Any]] = {}
        for url in sorted(set(urls) & set(self._known)):
            for card in self._known[url].cards:
                out.setdefault(card["id"], card)
        return list(out.values())

    # -- learning --------------------------------------------------------------------------

    def relearn(self, url: str) -> None:
        """Ask ``url`` again now (it turned healthy); its last list stays until the answer."""
        self._due[url] = (0, -math.inf)
        self._wake.set()

    async def learn_now(self, urls: Iterable[str]) -> None:
        """Ask ``urls`` now, and come back once each answered or failed (after an adapter was
        loaded or unloaded: the next request routes on the new lists)."""
        async with trio.open_nursery() as nursery:
            for url in set(urls):
                nursery.start_soon(self._learn, url)

    async def run(self) -> None:
        """Learn every server's list, for ever (see the module doc)."""
        while True:
            try:
                await self.learn_due()
            except Exception:  # a bug here must not end the router: try again later
                log.exception("learning the served models failed")
            with trio.move_on_at(self._next_due()):
                await self._wake.wait()
            self._wake = trio.Event()

    async def learn_due(self) -> None:
        """One pass: ask every healthy server whose list is unknown or due."""
        urls = set(self._servers())
        for gone in (set(self._known) | set(self._due)) - urls:
            self._known.pop(gone, None)
            self._due.pop(gone, None)
            self._warned.discard(gone)
        now = trio.current_time()
        due = [
            url
            for url in sorted(urls)
            if self._due.get(url, (0, -math.inf))[1] <= now and self._may_ask(url)
        ]
        async with trio.open_nursery() as nursery:
            for url in due:
                nursery.start_soon(self._learn, url)

    async def _learn(self, url: str) -> None:
        served = await self._ask(url)
        now = trio.current_time()
        if served is None:
            failures = self._due.get(url, (0, now))[0]
            delay = min(FIRST_RETRY_S * 2**failures, LAST_RETRY_S)
            self._due[url] = (failures + 1, now + delay)
            if url not in self._known and url not in self._warned:
                self._warned.add(url)
                log.warning(
                    "url=%s models=unknown assumed=%r (its /v1/models could not be read)",
                    url,
                    ASSUMPTION,
                )
            return
        self._due[url] = (0, now + self._interval_s if self._interval_s > 0 else math.inf)
        self._warned.discard(url)
        if self._known.get(url) != served:
            log.info(
                "url=%s models=%s adapters=%s max_model_len=%s",
                url,
                ",".join(served.models) or "-",
                ",".join(f"{a}<{p}" for a, p in served.adapters.items()) or "-",
                served.max_model_len,
            )
        self._known[url] = served

    def _next_due(self) -> float:
        # At least once a second, for servers that became healthy without a health change
        # (another worker's fleet added them, health checks are off).
        now = trio.current_time()
        return min([now + 1.0, *(due for _, due in self._due.values() if due > now)])

    async def _ask(self, url: str) -> ServerModels | None:
        try:
            with trio.fail_after(self._timeout_s):
                async with self._client.stream(
                    "GET", url + "/v1/models", headers=self._headers, timeout=self._timeout_s
                ) as resp:
                    if resp.status_code != 200:
                        log.debug("models url=%s status=%d", url, resp.status_code)
                        return None
                    raw = await read_capped(resp, MAX_ANSWER_BYTES)
            return ServerModels.read(orjson.loads(raw))
        except Exception as exc:  # any failure (AnswerTooLarge too) keeps what was known
            log.debug("models url=%s failed=%r", url, exc)
            return None
