"""Engine truth: what each upstream engine says it is serving, next to the router's own load.

Every ``--engine-metrics-interval`` seconds (0 turns it off) the router fetches each upstream
URL's Prometheus ``/metrics`` and reads vLLM's ``vllm:num_requests_running`` and
``vllm:num_requests_waiting``. A server running several data-parallel engines labels each series
with ``engine="<rank>"``: the endpoint ``url@rank`` gets that engine's numbers; an endpoint
without a rank gets the sum over all engines of its URL.

The engine took its numbers at some instant between the request for ``/metrics`` and the
answer, and the router's load may change in that window. So the router keeps, per endpoint, the
lowest and highest load the ledger had during the window, and records::

    engine = running + waiting                      # what the engine serves
    drift  = 0                 if low <= engine <= high
             low - engine      if engine < low      # the router counts more than runs
             high - engine     if engine > high     # the engine runs more than counted

Both appear in ``GET /get_loads`` (top-level ``"engine"`` and ``"drift"`` maps keyed like the
load maps) and as ``trio_pdrouter_engine_requests`` / ``trio_pdrouter_load_drift``.

Tokens too, where the engine tells them: ``vllm:kv_cache_usage_perc`` times the blocks and block
size of ``vllm:cache_config_info`` (``num_gpu_blocks``, ``block_size`` labels) is the KV tokens
it holds, in ``"engine_tokens"``; ``"token_drift"`` is the router's token weight on the endpoint
at the end of the scrape minus that. The router's weight is an upper bound by design (a decode
slot weighs prompt + ``max_tokens`` from the start, and a PENDING one is not on the engine yet),
so a positive token drift is expected; a persistently negative one is the alarm.

With a cluster view (``--cluster-url``) the engines serve every replica, so the router side is
this replica's visible load *plus the peers' latest visible counts*
(:class:`~trio_pdrouter.ledger.replicas.PeerLoads`, read at the start and the end of the round; the
range between counts as in the window): like with like, since a peer's PENDING slots are no more on
an engine than this replica's. The token side adds the peers' token weights the same way.
``/get_loads`` says which comparison ``"drift"`` is: ``"drift_of": "cluster"`` (own + peers) or
``"replica"`` (own only, without a cluster). Cluster drift is bounded by what the peers' snapshots
miss: up to one sync interval of their arrivals and departures.

Drift that persists is a leak somewhere: the router, an engine, or another router replica sending
to the same engine. The router side is the ledger's *visible* load: a decode slot charged at
choice whose prefill is still running is PENDING (see :mod:`trio_pdrouter.ledger.load`) and left
out, since the engine cannot know of it yet. Passing drift remains possible for a request on the
wire (sent, not yet seen by the engine; or finished by the engine, its end not yet read by the
router). An endpoint whose last scrape failed has no entry (an old number would look like truth).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import attrs
import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from ..endpoints import Endpoint
from ..http import read_capped
from ..ledger import LoadLedger, PeerLoads
from ..observe import RouterMetrics

log = logging.getLogger("trio_pdrouter.engine_truth")

#: The longest wait before scraping a failing upstream again, in seconds.
MAX_BACKOFF_S = 30.0
#: The largest /metrics answer read (a vLLM server with many engines writes about 1 MB).
MAX_SCRAPE_BYTES = 16 * 1024 * 1024

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"


@attrs.frozen
class EngineLoad:
    """One engine's (or one URL's summed) requests at a scrape."""

    running: int
    waiting: int
    #: KV tokens held (KV usage x blocks x block size), None when the engine does not say.
    kv_tokens: int | None = None

    @property
    def total(self) -> int:
        return self.running + self.waiting


class ScrapeError(Exception):
    """An upstream's ``/metrics`` could not be fetched or read."""


def parse_engine_loads(text: str) -> dict[str | None, EngineLoad]:
    """Running and waiting requests per ``engine`` label (``None`` when a series has none).

    Series of the same engine that differ in other labels (``model_name``) are summed. Raises
    :class:`ScrapeError` when the text has neither metric or a line of them is malformed.
    """
    # Only the two series are parsed: a vLLM exposition has hundreds of lines of histograms,
    # and the text parser costs tens of microseconds per line.
    lines = text.splitlines()
    wanted = [line for line in lines if _is_sample_of(line, RUNNING, WAITING)]
    if not wanted:
        raise ScrapeError(f"no {RUNNING} or {WAITING} series")
    wanted += [line for line in lines if _is_sample_of(line, KV_USAGE, CACHE_CONFIG)]
    series: dict[str, dict[str | None, float]] = {RUNNING: {}, WAITING: {}, KV_USAGE: {}}
    capacity: dict[str | None, int] = {}
    try:
        families = list(text_string_to_metric_families("\n".join(wanted) + "\n"))
        for family in families:
            for sample in family.samples:
                engine = sample.labels.get("engine")
                if sample.name == CACHE_CONFIG:
                    labels = sample.labels
                    capacity[engine] = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
                elif sample.name in series:
                    into = series[sample.name]
                    into[engine] = into.get(engine, 0.0) + sample.value
    except (ValueError, KeyError) as exc:
        raise ScrapeError(f"malformed metrics: {exc}") from None
    running, waiting, usage = series[RUNNING], series[WAITING], series[KV_USAGE]
    out: dict[str | None, EngineLoad] = {}
    for engine in running.keys() | waiting.keys():
        tokens = capacity.get(engine, capacity.get(None))
        share = usage.get(engine)
        kv = None if tokens is None or share is None else round(share * tokens)
        out[engine] = EngineLoad(
            round(running.get(engine, 0.0)), round(waiting.get(engine, 0.0)), kv
        )
    return out


def _is_sample_of(line: str, *names: str) -> bool:
    for name in names:
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            return True
    return False


def endpoint_loads(
    endpoints: Iterable[Endpoint], engines: dict[str | None, EngineLoad]
) -> dict[str, EngineLoad]:
    """Attribute one URL's per-engine loads to its endpoints (all of that URL).

    An endpoint with a DP rank gets the engine labelled with that rank, or nothing if the URL
    reported no such engine; an endpoint without a rank gets the sum over all engines.
    """
    out: dict[str, EngineLoad] = {}
    for ep in endpoints:
        if ep.rank is None:
            kv = [e.kv_tokens for e in engines.values()]
            out[ep.key] = EngineLoad(
                sum(e.running for e in engines.values()),
                sum(e.waiting for e in engines.values()),
                None if None in kv else sum(k for k in kv if k is not None),
            )
        elif (load := engines.get(str(ep.rank))) is not None:
            out[ep.key] = load
    return out


class EngineTruth:
    """The last scraped engine loads and their drift from the ledger, per endpoint key."""

    def __init__(
        self,
        endpoints: Callable[[], Iterable[Endpoint]],
        ledger: LoadLedger,
        client: httpx.AsyncClient,
        interval: float,
        metrics: RouterMetrics | None = None,
        peers: PeerLoads | None = None,
    ) -> None:
        self._ledger = ledger
        self._peers = peers
        self._client = client
        self.interval = interval
        self._metrics = metrics
        self._endpoints = endpoints
        self._failing: set[str] = set()
        #: Failing URLs: the current backoff, and when to try again.
        self._backoff: dict[str, float] = {}
        self._retry_at: dict[str, float] = {}
        self._windows: list[_Window] = []
        ledger.observe_visible(self._changed)
        #: endpoint key -> the engine's load at the last successful scrape
        self.engine: dict[str, EngineLoad] = {}
        #: endpoint key -> the router's load minus the engine's at that scrape (see above)
        self.drift: dict[str, int] = {}
        #: endpoint key -> the router's token weight minus the engine's KV tokens (see above)
        self.token_drift: dict[str, int] = {}
        #: What the router side of ``drift`` counts: this replica, or the whole cluster.
        self.drift_of = "replica" if peers is None else "cluster"

    def engine_totals(self) -> dict[str, int]:
        """Endpoint key -> running + waiting, as ``/get_loads`` shows it."""
        return {key: load.total for key, load in self.engine.items()}

    def engine_tokens(self) -> dict[str, int]:
        """Endpoint key -> KV tokens the engine holds, where it tells."""
        return {k: load.kv_tokens for k, load in self.engine.items() if load.kv_tokens is not None}

    async def run(self) -> None:
        """Scrape every upstream every ``interval`` seconds, forever."""
        next_round = trio.current_time()
        while True:
            try:
                await self.scrape()
            except Exception:  # a bug here must not end the router: log it, scrape next round
                log.exception("engine metrics round failed")
            next_round = max(next_round + self.interval, trio.current_time())
            await trio.sleep_until(next_round)

    async def scrape(self) -> None:
        """One round: every upstream URL, concurrently."""
        # Read each round: servers can be added and removed at runtime.
        endpoints = list(self._endpoints())
        by_url: dict[str, list[Endpoint]] = {}
        # A URL may serve several roles; its engines cannot tell them apart, so the router side
        # of a comparison is every endpoint with the same key.
        by_key: dict[str, list[Endpoint]] = {}
        now = trio.current_time()
        for ep in endpoints:
            if self._retry_at.get(ep.url, now) > now:
                continue  # failing: backing off
            by_url.setdefault(ep.url, []).append(ep)
            by_key.setdefault(ep.key, []).append(ep)
        for gone in self.engine.keys() - by_key.keys():
            self._forget(gone)
        window = _Window(self._ledger.visible_loads(endpoints), self._peer_loads)
        self._windows.append(window)
        try:
            async with trio.open_nursery() as nursery:
                for url, of_url in by_url.items():
                    nursery.start_soon(self._scrape_url, url, of_url, by_key, window)
        finally:
            self._windows.remove(window)

    def _peer_loads(self, endpoints: Iterable[Endpoint]) -> int:
        peers = self._peers
        return 0 if peers is None else sum(peers.visible(ep) for ep in endpoints)

    def _token_load(self, endpoint: Endpoint) -> int:
        own = self._ledger.token_load(endpoint)
        return own + (0 if self._peers is None else self._peers.token_load(endpoint))

    def _changed(self, endpoint: Endpoint, load: int) -> None:
        for window in self._windows:
            window.see(endpoint, load)

    async def _scrape_url(
        self,
        url: str,
        endpoints: list[Endpoint],
        by_key: dict[str, list[Endpoint]],
        window: _Window,
    ) -> None:
        try:
            engines = await self._fetch(url)
        except ScrapeError as exc:
            self._unknown(url, endpoints, str(exc))
            return
        if url in self._failing:
            self._failing.discard(url)
            self._retry_at.pop(url, None)
            self._backoff.pop(url, None)
            log.info("url=%s engine metrics available again", url)
        loads = endpoint_loads(endpoints, engines)
        for key in dict.fromkeys(ep.key for ep in endpoints):
            load = loads.get(key)
            if load is None:
                self._forget(key)
                continue
            drift = window.drift(by_key[key], load.total)
            self.engine[key] = load
            self.drift[key] = drift
            if load.kv_tokens is None:
                self.token_drift.pop(key, None)
            else:
                weight = sum(self._token_load(ep) for ep in by_key[key])
                self.token_drift[key] = weight - load.kv_tokens
            if self._metrics is not None:
                self._metrics.engine_seen(key, load.running, load.waiting, drift)

    async def _fetch(self, url: str) -> dict[str | None, EngineLoad]:
        limit = max(self.interval, 1.0)
        try:
            with trio.move_on_after(limit) as scope:
                async with self._client.stream("GET", url + "/metrics") as resp:
                    text = (await read_capped(resp, MAX_SCRAPE_BYTES)).decode("utf-8", "replace")
        except Exception as exc:  # any failure is a failed scrape; the loop must not die
            raise ScrapeError(f"{type(exc).__name__}: {exc}") from None
        if scope.cancelled_caught:
            raise ScrapeError(f"no answer in {limit:g}s")
        if resp.status_code != 200:
            raise ScrapeError(f"HTTP {resp.status_code}")
        return parse_engine_loads(text)

    def _unknown(self, url: str, endpoints: list[Endpoint], reason: str) -> None:
        if self._metrics is not None:
            self._metrics.engine_scrape_failed(url)
        if url not in self._failing:
            self._failing.add(url)
            log.warning("url=%s engine metrics unavailable: %s", url, reason)
        # Back off a failing URL (doubling, up to MAX_BACKOFF_S): a thousand unreachable
        # servers must not cost a core in refused connections.
        backoff = self._backoff[url] = min(
            2 * self._backoff.get(url, self.interval / 2), MAX_BACKOFF_S
        )
        self._retry_at[url] = trio.current_time() + backoff
        for ep in endpoints:
            self._forget(ep.key)

    def _forget(self, key: str) -> None:
        self.engine.pop(key, None)
        self.drift.pop(key, None)
        self.token_drift.pop(key, None)
        if self._metrics is not None:
            self._metrics.engine_unknown(key)


class _Window:
    """The lowest and highest router load of each endpoint while one scrape round runs; the
    peers' part (``peer_loads``, 0 without a cluster) is read at the start and at the end."""

    __slots__ = ("high", "low", "peer_loads", "peers_at_start")

    def __init__(
        self, loads: dict[Endpoint, int], peer_loads: Callable[[Iterable[Endpoint]], int]
    ) -> None:
        self.low = loads
        self.high = dict(loads)
        self.peer_loads = peer_loads
        self.peers_at_start = {ep: peer_loads((ep,)) for ep in loads}

    def see(self, endpoint: Endpoint, load: int) -> None:
        if endpoint in self.low:  # an endpoint added mid-round is compared from the next one
            self.low[endpoint] = min(self.low[endpoint], load)
            self.high[endpoint] = max(self.high[endpoint], load)

    def drift(self, endpoints: list[Endpoint], engine: int) -> int:
        """The distance from ``engine`` to the range the router's load had, signed."""
        at_start = sum(self.peers_at_start.get(ep, 0) for ep in endpoints)
        at_end = self.peer_loads(endpoints)
        low = sum(self.low.get(ep, 0) for ep in endpoints) + min(at_start, at_end)
        high = sum(self.high.get(ep, 0) for ep in endpoints) + max(at_start, at_end)
        if engine < low:
            return low - engine
        if engine > high:
            return high - engine
        return 0
