"""``cache_aware``: send a request where its prefix is probably cached, unless that skews load.

Per decision, over the candidates' ledger loads (as vllm-router decides)::

    is_unbalanced = (max_load - min_load) > balance_abs_threshold
                    and max_load > min_load * balance_rel_threshold

* unbalanced: the least-loaded candidate (random among equals);
* balanced: the candidate owning the longest prefix of the routing text in the
  :class:`~.radix_tree.RadixTree`; if ``matched_chars / len(text) > cache_threshold`` it wins,
  otherwise the least-loaded candidate does;
* empty routing text: the least-loaded candidate.

The loads are the stage's ``--load-metric``: request counts, or token weights, in which case
``--balance-token-threshold`` stands for ``balance_abs_threshold``.
:meth:`CacheAware.uncached_tokens` tells routing, per candidate, the prompt tokens past what
the tree expects it to hold (:meth:`CacheAware.held_chars`): the prefill's token weight
(:mod:`trio_pdrouter.ledger.cost`).

The text is then inserted under the chosen endpoint, so the tree follows where prompts went
(and concurrent requests with one prefix follow each other before the first has finished).
The choice leaves a :class:`~._base.Lesson` in :attr:`CacheAware.lesson`; the router calls it
when that endpoint's engine refused the request (4xx before any token), which retracts the
insert: the endpoint's share of the tree goes back to what it held before, except where a later
insert wanted the same text (:meth:`~.radix_tree.RadixTree.retract`). The tree is budgeted in
UTF-8 bytes.
With a ``feed`` (``--workers N``: :class:`~trio_pdrouter.machine.prefix_ring.PrefixRing`) each
choice first inserts what the other workers inserted since, then publishes its own insert, so every
worker's tree follows where all the machine's prompts went. Retractions stay in their worker: the
other trees have inserted the text with stamps of their own, which a retraction message could not
name without a log of marks per published insert; what they hold of a refused prompt ages out under
their byte budget like any text that is not used again. :meth:`CacheAware.maintain` trims every
endpoint to ``max_tree_size`` bytes (least recently used first) and :meth:`CacheAware.set_endpoints`
forgets endpoints that left the stage.

Prefix state is kept per model (:attr:`~._base.RoutingKey.model`): one tree per model named, one
for requests that name none, so two models' identical prompts never attract each other (an
adapter's prefix cache is its own in vLLM too). A tree is made at the first request of its
model; at most :data:`MAX_TREES` are kept, the least recently used dropped beyond that (a client
naming ever new models cannot grow the router's memory), and each tree holds at most
``max_tree_size`` bytes per endpoint. With a ``feed`` each insert travels with its model.

Each decision logs one debug line on ``trio_pdrouter.policy``::

    stage=decode max_load=9 min_load=2 is_unbalanced=false match_rate=0.812 chosen=http://h:8000@1
    reason=cache_hit

(one line in the log; wrapped here).

``reason`` is one of ``unbalanced``, ``cache_hit``, ``cache_miss``, ``empty_text``. ``match_rate``
is always computed, so it also shows what an unbalanced decision gave up.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Protocol

from ...config import PolicySettings
from ...endpoints import Endpoint
from ...ledger import uncached
from ._base import DecisionObserver, Lesson, RoutingKey
from ._choice import least_loaded
from .radix_tree import Inserted, RadixTree

logger = logging.getLogger("trio_pdrouter.policy")

#: Tree nodes one eviction slice may examine: the event loop runs requests between slices
#: instead of stalling for a whole eviction (measured: at most 2.2 ms a slice, against 77 ms
#: in one piece; ``python -m benchmarks.radix_tree quick``).
EVICTION_SLICE = 256
#: Trees kept at most (one per model; see the module doc).
MAX_TREES = 64


class InsertShare(Protocol):
    """Inserts shared with the other prefix trees of the machine (see the module doc)."""

    def publish(self, key: str, text: str, model: str = "") -> None: ...

    def news(self) -> list[tuple[str, str, str]]: ...


class CacheAware:
    """Prefix-cache affinity guarded by a load-balance check; see the module docstring."""

    name = "cache_aware"

    def __init__(
        self,
        settings: PolicySettings,
        rng: random.Random,
        *,
        stage: str,
        on_decision: DecisionObserver,
        feed: InsertShare | None = None,
    ) -> None:
        self._settings = settings
        self._rng = rng
        self._stage = stage
        #: Model ("" for requests naming none) -> its tree, least recently used first.
        self._trees: OrderedDict[str, RadixTree[Endpoint]] = OrderedDict()
        self._endpoints: dict[str, Endpoint] = {}
        self._feed = feed
        self._on_decision = on_decision
        #: What the last choice taught the tree (None without routing text); read by routing
        #: right after it chose, in the same synchronous step.
        self.lesson: Lesson | None = None
        #: What :meth:`uncached_tokens` read of the tree for a key and candidates, which the
        #: :meth:`choose` that follows it in the same synchronous step uses instead of a walk.
        self._read: tuple[RoutingKey, Sequence[Endpoint], int, Endpoint | None] | None = None
        tokens = settings.stage_load_metric(stage) == "tokens"
        self._abs_threshold = (
            settings.balance_token_threshold if tokens else settings.balance_abs_threshold
        )

    @property
    def tree(self) -> RadixTree[Endpoint]:
        """The tree of requests that name no model."""
        return self.tree_of(None)

    def tree_of(self, model: str | None) -> RadixTree[Endpoint]:
        """The tree of ``model`` (made at its first use; see the module doc)."""
        name = model or ""
        trees = self._trees
        tree = trees.get(name)
        if tree is None:
            tree = trees[name] = RadixTree()
            while len(trees) > MAX_TREES:
                trees.popitem(last=False)
        else:
            trees.move_to_end(name)
        return tree

    def _learn(self) -> None:
        """Apply the other workers' inserts since the last look (``--workers N`` only), so
        every read of a tree sees them."""
        if self._feed is not None:
            endpoints = self._endpoints
            for ep_key, learnt, model in self._feed.news():
                ep = endpoints.get(ep_key)
                if ep is not None:
                    self.tree_of(model).insert(learnt, ep)

    def endpoint(self, key: str) -> Endpoint | None:
        """The current endpoint named ``key`` (:attr:`~trio_pdrouter.endpoints.Endpoint.key`), if
        any."""
        return self._endpoints.get(key)

    def match(
        self, text: str, eligible: frozenset[Endpoint] | None, model: str | None = None
    ) -> tuple[int, Endpoint | None]:
        """The longest match of ``text`` among ``eligible`` (all endpoints if None;
        ``RadixTree.match``) in ``model``'s tree, the other workers' inserts applied first."""
        self._learn()
        return self.tree_of(model).match(text, eligible)

    def remember(self, text: str, chosen: Endpoint, model: str | None = None) -> tuple[int, int]:
        """``text`` of ``model`` went to ``chosen``: into its tree, and to the other workers.
        Returns the tree's mark of the insert (for a :class:`Lesson`)."""
        mark = self.tree_of(model).insert(text, chosen)
        if self._feed is not None:
            self._feed.publish(chosen.key, text, model or "")
        return mark

    def held_chars(
        self, candidates: Sequence[Endpoint], text: str, model: str | None = None
    ) -> dict[Endpoint, int]:
        """How many leading characters of ``text`` each candidate is expected to hold cached
        (in ``model``'s tree)."""
        self._learn()
        return self.tree_of(model).match_each(text, frozenset(candidates))

    def uncached_tokens(
        self, candidates: Sequence[Endpoint], key: RoutingKey
    ) -> dict[Endpoint, int]:
        """The prompt tokens each candidate would compute, past the characters it is expected
        to hold (the whole prompt when there is no routing text)."""
        if not key.text:
            return dict.fromkeys(candidates, key.prompt_tokens)
        self._learn()
        tree = self.tree_of(key.model)
        held, matched_chars, matched = tree.match_with_each(key.text, frozenset(candidates))
        self._read = (key, candidates, matched_chars, matched)
        chars = len(key.text)
        return {ep: uncached(key.prompt_tokens, held[ep], chars) for ep in candidates}

    def unbalanced(self, max_load: int, min_load: int) -> bool:
        """The balance test of the module doc, on the stage's load metric."""
        return (
            max_load - min_load > self._abs_threshold
            and max_load > min_load * self._settings.balance_rel_threshold
        )

    def choose(
        self, candidates: Sequence[Endpoint], loads: Mapping[Endpoint, int], key: RoutingKey
    ) -> Endpoint:
        s = self._settings
        self._learn()
        values = [loads.get(c, 0) for c in candidates]
        max_load, min_load = max(values), min(values)
        is_unbalanced = self.unbalanced(max_load, min_load)
        text = key.text
        match_rate = 0.0
        matched: Endpoint | None = None
        read, self._read = self._read, None
        if text:
            if read is not None and read[0] is key and read[1] is candidates:
                matched_chars, matched = read[2], read[3]  # this step's walk, for the weights
            else:
                tree = self.tree_of(key.model)
                matched_chars, matched = tree.match(text, eligible=frozenset(candidates))
            match_rate = matched_chars / len(text)
        if not text:
            reason = "empty_text"
        elif is_unbalanced:
            reason = "unbalanced"
        elif matched is not None and match_rate > s.cache_threshold:
            reason = "cache_hit"
        else:
            reason = "cache_miss"
        if reason == "cache_hit":
            assert matched is not None
            chosen = matched
        else:
            chosen = least_loaded(candidates, loads, self._rng)
        self.lesson = None
        if text:
            model = key.model
            mark = self.remember(text, chosen, model)
            self.lesson = Lesson(lambda: self._retract(text, chosen, mark, model))
        self._on_decision(self._stage, reason)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "stage=%s max_load=%d min_load=%d is_unbalanced=%s match_rate=%.3f chosen=%s "
                "reason=%s",
                self._stage,
                max_load,
                min_load,
                "true" if is_unbalanced else "false",
                match_rate,
                chosen.key,
                reason,
            )
        return chosen

    def _retract(self, text: str, endpoint: Endpoint, mark: Inserted, model: str | None) -> None:
        tree = self._trees.get(model or "")
        removed = 0 if tree is None else tree.retract(text, endpoint, mark)
        logger.debug("stage=%s retracted=%d bytes endpoint=%s", self._stage, removed, endpoint.key)

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        current = frozenset(endpoints)
        for tree in self._trees.values():
            # Tenants can also be endpoints the tree saw but this object was never told about.
            known = frozenset(self._endpoints.values()) | frozenset(tree.tenants())
            for gone in known - current:
                tree.remove_tenant(gone)
        self._endpoints = {ep.key: ep for ep in endpoints}

    def maintain(self) -> bool:
        """Evict least-recently-used text so each endpoint keeps at most ``max_tree_size``
        bytes in each tree, one bounded slice per call (the first tree over budget); True
        while more remains to evict."""
        budget = self._settings.max_tree_size
        over = [tree for tree in self._trees.values() if tree.over_budget(budget)]
        if not over:
            return False
        over[0].evict(budget, max_steps=EVICTION_SLICE)
        return len(over) > 1 or over[0].over_budget(budget)
