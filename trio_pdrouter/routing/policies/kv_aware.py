"""``kv_aware``: send a request where the engine's KV events say its prefix is cached.

Per decision, over the candidates:

* unbalanced loads (``cache_aware``'s test on ``--balance-abs-threshold``, or
  ``--balance-token-threshold`` with token loads, and ``--balance-rel-threshold``): the
  least-loaded candidate, as ``cache_aware`` does;
* no token ids for the request (``/tokenize`` failed or was not needed): ``cache_aware``'s
  decision over its estimated tree (reason ``no_tokens``); likewise for a request naming a LoRA
  adapter (reason ``adapter``): vLLM hashes an adapter's blocks with its name
  (``_gen_lora_extra_hash_keys`` in vllm/v1/core/kv_cache_utils.py, commit
  001cabc1be16a59a70d720ed61a13b678c060a18), the index keeps none of them
  (:mod:`trio_pdrouter.kv.wire` skips blocks with a LoRA), and its ids would match the base
  model's blocks instead;
* otherwise each candidate's *hit* is the share of the prompt's full blocks it will hold as a
  leading run when this prompt's turn comes (with ids of the prompt's start only,
  ``partial_tokens``: of the blocks its estimated count fills), each block weighted by its
  medium (GPU 1, ``--kv-penalty-host|external|disk`` for blocks held only off-GPU):

  - an engine whose event stream is exact (``known``) by its
    :class:`~trio_pdrouter.kv.forecast.Forecast`: what the index holds, plus the prompts sent there
    and not yet computed, less what those prompts' new blocks will evict (the engine's cache is LRU,
    its size learnt from the events). Under cache pressure a prefix held now is often gone by the
    time a request queued behind others is computed: credited from the index alone, that request was
    charged as a hit and computed as a miss, the loads routing compared were wrong by a whole
    prompt, and the queues grew uneven. Measured under cache pressure (``python -m benchmarks --only
    kv_aware``, README): with one router the forecast took TTFT p99 from above ``cache_aware``'s to
    well below it at the same hit rate. With ``--workers N`` the workers share their prompts in
    flight and their releases (``routes``: :class:`~trio_pdrouter.machine.route_ring.RouteRing`), so
    each worker's forecasts see what one router's would (measured with two workers, paired rounds
    against ``cache_aware``: TTFT p99 1.14x and 3.7 points fewer hits before, 0.87-1.13x over five
    runs and 0.2-2.8 points fewer after);
  - unless the forecasts are *partial*: a forecast sees only the prompts this router (its
    workers) sent, so where other routers send the engines work too (replicas) and more
    than :data:`~trio_pdrouter.kv.forecast.FOREIGN_SHARE` of an engine's stored blocks came from
    elsewhere, every known engine is judged by what its index holds now, which all routers
    see alike (measured: judged by forecasts that each saw half the traffic, two routers
    spread each prefix over both engines and lost 10-12 points of hits). Then a miss everywhere
    (no candidate holds even the first block) goes to the candidate the estimated tree last
    sent this prefix to (its *home*), which gets the estimate's share as its hit (reason
    ``home``): without it misses went to the least loaded engine, every engine came to hold a
    bit of every group, and the hit rate fell;
  - an engine whose event stream is not known to be exact (``known`` false: no events yet,
    history lost) by the larger of the estimate (the share of the routing text
    ``cache_aware``'s tree has seen go there) and what its index shows: after a loss the index
    is cleared and then holds only blocks stored since, whose removes are all seen, so it may
    miss blocks but never shows one the engine dropped.

* a hit at or below ``--cache-threshold`` counts as none (``cache_aware``'s rule); between
  balanced loads the largest hit wins, and load only breaks ties between equal hits (score =
  hit - a fraction of one block's share times (load - min_load) / (max_load - min_load)).
  Measured under cache pressure (``python -m benchmarks --only kv_aware``): trading hit against
  load inside the balance thresholds (score = hit - (load - min_load) / scale) left hits for
  the least loaded engine; with one router it gave TTFT p99 1.16-1.41x that of ``cache_aware``
  (whose hit wins until the loads are unbalanced), this rule 1.08-1.17x at the same hit rate
  (README).

Prefill load is in tokens by default (:meth:`~._base.PolicySettings.stage_load_metric`): a
candidate's load is the uncached tokens in flight there plus this request's uncached tokens
there, which routing charges from :meth:`KvAware.uncached_tokens` (the prompt past the blocks
credited, and on a miss everywhere judged by the indexes past the home's share), so once loads
are unbalanced the least loaded candidate is also the one that finishes this prefill first.
Measured under cache pressure in interleaved rounds, each paired with ``cache_aware``
(``BENCH_KV_PARTS=rounds python -m benchmarks --only kv_aware``, README): counting requests (the
default until 2026-12-05), ``kv_aware`` never found the loads unbalanced; its TTFT p99 ratio and
this rule's were alike (medians 1.15 and 1.16 with one router, 28 and 18 pairs), this rule 0.4
points closer in hits; counting tokens against a threshold of six prompts without the home's
credit gave 0.91 but 5 points fewer hits. The relative threshold is ``cache_aware``'s (1.5
unless given). A tighter 1.2 was the default from 2026-12-06, chosen on a simulator that
evicted a prefix's start first; on one that evicts a computed prompt's tail first, as vLLM
does, 1.5 held 0.4-1.5 points more hits than 1.2 in every setup of two runs of 8 paired rounds
(2026-12-07), its TTFT p99 0.64-0.81x of ``cache_aware``'s where 1.2 reached 1.26x with
``--workers 2`` (README); 1.0 (always the least loaded, loads with this request's uncached
tokens) gave 3-4 points of hits away.

With ``--router-temperature`` 0 the best score wins (ties at random); above 0 the choice is
drawn with probabilities softmax(score / temperature).

With ``--kv-aware-session-affinity-ttl-secs`` (decode and regular stages only), a request whose
session is bound to a candidate that is not overloaded goes there first (reason ``session``;
see :mod:`.session_affinity`); every decision binds the request's session to its choice.

The routing text also goes into the estimated tree under the chosen endpoint, so the fallback
stays warm. :attr:`KvAware.last` describes the last decision (blocks matched, whether the
chosen engine's state was known) for the routing headers and the access line.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import attrs

from ...config import PolicySettings
from ...endpoints import Endpoint
from ...kv import GPU, BlockIndex, Forecast, block_keys
from ._base import DecisionObserver, RoutingKey
from ._choice import least_loaded
from .cache_aware import CacheAware, InsertShare
from .session_affinity import SessionTable, overloaded

#: Between balanced loads, load only decides between equal hits: its part of a score is at
#: most this share of one block's.
TIE_BREAK = 1e-3


class RouteShare(Protocol):
    """The prompts in flight shared with the machine's other workers (``--workers N``:
    :class:`~trio_pdrouter.machine.route_ring.RouteRing`), so each worker's forecasts see them
    all."""

    def routed(self, key: str, keys: Sequence[int]) -> int: ...

    def released(self, prompt: int) -> None: ...

    def news(self) -> list[tuple[str, list[int], bool]]: ...


class KvView(Protocol):
    """What the policy reads of the subscriber: an engine's index and whether it is exact."""

    block_size: int

    def index(self, url: str, rank: int | None) -> tuple[BlockIndex, bool] | None: ...


@attrs.frozen
class KvDecision:
    """What one decision saw of its chosen endpoint."""

    blocks: int
    total_blocks: int
    known: bool
    reason: str

    def note(self) -> str:
        """``matched/total;known`` (or ``;estimate``), for the routing header and access line."""
        return f"{self.blocks}/{self.total_blocks};{'known' if self.known else 'estimate'}"


#: A key, its block keys, each candidate's (hit share, blocks credited, known), on a miss
#: everywhere judged by the indexes each candidate's home share (:meth:`KvAware._homes`), and
#: whether known engines are judged by their forecasts (:meth:`KvAware._ahead`).
_Read = tuple[
    RoutingKey,
    list[int],
    dict[Endpoint, tuple[float, int, bool]],
    dict[Endpoint, float] | None,
    bool,
]


class KvAware:
    """Exact prefix-cache affinity from KV events, traded against load (module doc)."""

    name = "kv_aware"

    def __init__(
        self,
        settings: PolicySettings,
        rng: random.Random,
        *,
        stage: str,
        on_decision: DecisionObserver,
        view: KvView | None,
        sessions: SessionTable | None = None,
        feed: InsertShare | None = None,
        routes: RouteShare | None = None,
    ) -> None:
        self._settings = settings
        self._rng = rng
        self._stage = stage
        self._on_decision = on_decision
        self._view = view
        self._sessions = sessions
        self.estimate = CacheAware(
            settings,
            rng,
            stage=stage,
            on_decision=lambda _s, _r: None,
            feed=feed,
        )
        self._by_tokens = settings.stage_load_metric(stage) == "tokens"
        self.last = KvDecision(0, 0, False, "none")
        #: What :meth:`uncached_tokens` read for a key, which the :meth:`choose` that follows it
        #: in the same synchronous step uses instead of reading the index again (and the
        #: forecast of the engine chosen is told the same block keys).
        self._read: _Read | None = None
        # : Each engine's forecast (:mod:`trio_pdrouter.kv.forecast`), from its first decision with
        # an index.
        self._forecasts: dict[Endpoint, Forecast] = {}
        self._routes = routes
        #: For routing: the last choice's callback for when its request leaves the endpoint
        #: (:class:`~trio_pdrouter.routing.choose.Forecasts`), None if it forecast nothing.
        self.on_release: Callable[[], None] | None = None

    def choose(
        self, candidates: Sequence[Endpoint], loads: Mapping[Endpoint, int], key: RoutingKey
    ) -> Endpoint:
        self.on_release = None
        sessions, session = self._sessions, key.hash_key
        if sessions is None or session is None:
            chosen = self._choose(candidates, loads, key)
        else:
            home = sessions.home(session)
            if home is not None and home in candidates and not self._overloaded(home, loads, key):
                self._remember(key, home)
                self._decided("session", 0, 0, known=False)
                chosen = home
            else:
                chosen = self._choose(candidates, loads, key)
            sessions.bind(session, chosen)
        self._route(chosen, key)
        self._read = None
        return chosen

    def _route(self, chosen: Endpoint, key: RoutingKey) -> None:
        """Tell the chosen engine's forecast the prompt goes there, until its lease slot is
        released (:attr:`on_release`)."""
        view = self._view
        if view is None or key.tokens is None or key.adapter:  # an adapter's blocks: not these
            return
        forecast = self._forecast(chosen)
        if forecast is None:
            return
        read = self._read
        keys = (
            read[1]
            if read is not None and read[0] is key
            else block_keys(key.tokens, view.block_size)
        )
        if not keys:
            return
        forecast.route(keys)
        routes = self._routes
        if routes is None:
            self.on_release = lambda: forecast.release(keys)
            return
        prompt = routes.routed(chosen.key, keys)

        def release() -> None:
            forecast.release(keys)
            routes.released(prompt)

        self.on_release = release

    def _learn_routes(self) -> None:
        """Apply the other workers' prompts sent and released since the last look
        (``--workers N`` only) to the forecasts."""
        if self._routes is None:
            return
        for ep_key, keys, routed in self._routes.news():
            endpoint = self.estimate.endpoint(ep_key)
            forecast = None if endpoint is None else self._forecast(endpoint)
            if forecast is None:
                continue
            if routed:
                forecast.route(keys)
            else:
                forecast.release(keys)

    def _forecast(self, endpoint: Endpoint) -> Forecast | None:
        forecast = self._forecasts.get(endpoint)
        if forecast is None:
            assert self._view is not None
            found = self._view.index(endpoint.url, endpoint.rank)
            if found is None:
                return None
            learn = self._learn_routes if self._routes is not None else None
            forecast = self._forecasts[endpoint] = Forecast(found[0], learn=learn)
        return forecast

    def forecast_states(self) -> dict[str, dict[str, object]]:
        """Each engine's forecast (:meth:`~trio_pdrouter.kv.forecast.Forecast.state`), by endpoint
        key."""
        return {endpoint.key: f.state() for endpoint, f in self._forecasts.items()}

    def _overloaded(self, home: Endpoint, loads: Mapping[Endpoint, int], key: RoutingKey) -> bool:
        return overloaded(
            home,
            loads,
            by_tokens=self._by_tokens,
            prompt_tokens=key.prompt_tokens,
            abs_threshold=self._settings.balance_abs_threshold,
            rel_threshold=self._settings.balance_rel_threshold,
        )

    def _choose(
        self, candidates: Sequence[Endpoint], loads: Mapping[Endpoint, int], key: RoutingKey
    ) -> Endpoint:
        view = self._view
        if view is None or key.tokens is None or key.adapter:
            chosen = self.estimate.choose(candidates, loads, key)
            self._decided("adapter" if key.adapter else "no_tokens", 0, 0, known=False)
            return chosen
        s = self._settings
        values = [loads.get(c, 0) for c in candidates]
        max_load, min_load = max(values), min(values)
        unbalanced = self.estimate.unbalanced(max_load, min_load)
        read = self._read
        if read is None or read[0] is not key:
            self._learn_routes()
            keys = block_keys(key.tokens, view.block_size)
            read = self._read = (key, keys, {}, None, self._ahead(candidates))
        _key, keys, hits, homes, ahead = read
        total = self._blocks(key, keys)
        if unbalanced:
            chosen = least_loaded(candidates, loads, self._rng)
            self._remember(key, chosen)
            self._decided("unbalanced", 0, total, known=False)
            return chosen
        shares: list[float] = []
        seen: list[tuple[int, bool]] = []
        for candidate in candidates:
            found = hits.get(candidate)
            hit, blocks, known = (
                found if found is not None else self._hit(candidate, key, keys, total, ahead)
            )
            seen.append((blocks, known))
            shares.append(hit)
        if not ahead and key.text and not any(blocks for blocks, _known in seen):
            if homes is None or any(c not in homes for c in candidates):
                homes = self._homes(candidates, key.text, key.model)
            shares = [homes[c] for c in candidates]
        # Load breaks ties only: its term stays below TIE_BREAK of one block's share.
        tie = TIE_BREAK / (total + 1) / max(max_load - min_load, 1)
        floor = s.cache_threshold
        scores = [
            (share if share > floor else 0.0) - (load - min_load) * tie
            for share, load in zip(shares, values, strict=True)
        ]
        index = self._pick(scores)
        chosen = candidates[index]
        self._remember(key, chosen)
        blocks, known = seen[index]
        if shares[index] <= floor:  # chosen by load: what it holds earned nothing
            reason = "miss"
        elif blocks:
            reason = "kv_hit" if known else "estimate_hit"
        else:
            reason = "home"
        self._decided(reason, blocks, total, known=known)
        return chosen

    def uncached_tokens(
        self, candidates: Sequence[Endpoint], key: RoutingKey
    ) -> dict[Endpoint, int]:
        """The prompt tokens each candidate would compute: those past the blocks its hit
        credits, and the estimate's count when the request has no token ids."""
        view = self._view
        if view is None or key.tokens is None or key.adapter:
            return self.estimate.uncached_tokens(candidates, key)
        self._learn_routes()
        keys = block_keys(key.tokens, view.block_size)
        total = self._blocks(key, keys)
        ahead = self._ahead(candidates)
        hits = {c: self._hit(c, key, keys, total, ahead) for c in candidates}
        shares = {candidate: hit for candidate, (hit, _blocks, _known) in hits.items()}
        homes = None
        if not ahead and key.text and not any(blocks for _hit, blocks, _known in hits.values()):
            homes = shares = self._homes(candidates, key.text, key.model)
        self._read = (key, keys, hits, homes, ahead)
        cached_per_hit = total * view.block_size
        return {
            candidate: max(key.prompt_tokens - round(share * cached_per_hit), 0)
            for candidate, share in shares.items()
        }

    def _ahead(self, candidates: Sequence[Endpoint]) -> bool:
        """Whether to judge known engines by their forecasts: when this router sends each of
        them (nearly) all it computes. Otherwise by their indexes, and a miss everywhere by the
        home rule (module doc)."""
        assert self._view is not None
        for candidate in candidates:
            forecast = self._forecast(candidate)
            if forecast is not None and not forecast.complete:
                return False
        return True

    def _hit(
        self, candidate: Endpoint, key: RoutingKey, keys: list[int], total: int, ahead: bool
    ) -> tuple[float, int, bool]:
        """(hit share of the prompt's ``total`` blocks, blocks credited, known) of one
        candidate; ``ahead``: a known engine by its forecast, else by its index."""
        assert self._view is not None
        found = self._view.index(candidate.url, candidate.rank)
        if found is not None and found[1] and ahead:
            index = found[0]
            forecast = self._forecast(candidate)
            assert forecast is not None
            # The GPU blocks it will still hold when this prompt's turn comes, then what
            # other media hold of the rest.
            blocks = forecast.match(keys)
            credit = blocks * index.weight(GPU)
            if blocks < len(keys):
                more, more_credit = index.match(keys[blocks:], skip=GPU)
                blocks, credit = blocks + more, credit + more_credit
            return (credit / total if total else 0.0), blocks, True
        blocks, credit = found[0].match(keys) if found is not None and keys else (0, 0.0)
        lower = credit / total if total else 0.0
        if found is not None and found[1]:
            return lower, blocks, True
        # Unknown: what its index still shows is true (stored since the loss, removes seen) but
        # may be missing blocks, so the estimate may say more.
        share = 0.0
        if key.text:
            chars, _owner = self.estimate.match(key.text, frozenset((candidate,)), key.model)
            share = chars / len(key.text)
        if share > lower:
            return share, round(share * total), False
        return lower, blocks, False

    def _blocks(self, key: RoutingKey, keys: list[int]) -> int:
        """The prompt's full blocks: those of its ids, or when they are its start's only
        (``partial_tokens``), as many as its estimated token count fills."""
        assert self._view is not None
        if key.partial_tokens:
            return max(len(keys), key.prompt_tokens // self._view.block_size)
        return len(keys)

    def seen_chars(self, text: str) -> int:
        """Leading characters of ``text`` this router has sent somewhere before (the estimated
        tree's longest match, any endpoint): the start it shares with earlier prompts."""
        return self.estimate.match(text, None)[0]

    def _homes(
        self, candidates: Sequence[Endpoint], text: str, model: str | None
    ) -> dict[Endpoint, float]:
        """On a miss everywhere: the share of the text the estimated tree last sent to one
        candidate (its *home*; 0 for the others, and for all when the share is not above
        ``--cache-threshold``), so a prefix whose blocks were evicted is stored again where its
        group lives and the engines keep holding different groups."""
        chars, home = self.estimate.match(text, frozenset(candidates), model)
        share = chars / len(text)
        if home is None or share <= self._settings.cache_threshold:
            share = 0.0
        return {c: share if c == home else 0.0 for c in candidates}

    def _pick(self, scores: list[float]) -> int:
        temperature = self._settings.router_temperature
        if temperature <= 0:
            best = max(scores)
            ties = [i for i, v in enumerate(scores) if v >= best - 1e-12]
            return ties[0] if len(ties) == 1 else self._rng.choice(ties)
        top = max(scores)
        weights = [math.exp((v - top) / temperature) for v in scores]
        return self._rng.choices(range(len(scores)), weights=weights)[0]

    def _remember(self, key: RoutingKey, chosen: Endpoint) -> None:
        if key.text:
            self.estimate.remember(key.text, chosen, key.model)

    def _decided(self, reason: str, blocks: int, total: int, *, known: bool) -> None:
        self.last = KvDecision(blocks, total, known, reason)
        self._on_decision(self._stage, reason)

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        self.estimate.set_endpoints(endpoints)
        for gone in set(self._forecasts) - set(endpoints):
            self._forecasts.pop(gone).close()
        if self._sessions is not None:
            self._sessions.keep_only(frozenset(endpoints))

    def maintain(self) -> bool:
        return self.estimate.maintain()
