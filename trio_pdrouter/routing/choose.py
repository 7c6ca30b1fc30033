"""Choosing endpoints and charging them, in one synchronous step.

:class:`Routing` holds each stage's policy, the endpoints the
:class:`~trio_pdrouter.fleet.servers.Fleet` gave it per role, and the checks that say which may take
traffic. :meth:`Routing.lease_pd` and :meth:`Routing.lease_one` read the ledger, ask the policies,
and charge the chosen endpoints without an await in between, so concurrent arrivals always see each
other's load and a cancellation can never fall between choice and charge. With a cluster view
(``--cluster-url``) the policies see this replica's exact counts plus the peers' latest snapshots,
read from memory (:class:`~trio_pdrouter.ledger.replicas.PeerLoads`), so choosing stays synchronous.
Both hold ``ledger.charging()`` over the step: with ``--workers N`` that is the machine lock, so
arrivals in other workers see it too.

Every charge carries the request's token weight on the endpoint chosen
(:mod:`trio_pdrouter.ledger.cost`): prefill, the prompt tokens that endpoint is not expected to hold
(a policy that knows what each candidate caches tells, synchronously: :class:`KnowsCachedPrompts`;
``cache_aware`` from its prefix tree, ``kv_aware`` from the engines' KV index, so the charge is what
the policy credits); decode and regular, prompt + output tokens. A stage whose load metric is
``tokens`` gives its policy, for each candidate, the token weight in flight there plus this
request's weight there: the load it would have if chosen. With a cluster view the peers' loads are
added in either metric: their counts in ``requests``, their token weights in ``tokens``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol, runtime_checkable

from ..endpoints import Endpoint, Role
from ..ledger import Lease, LoadLedger, PeerLoads
from .policies import KvDecision, Lesson, Policy, RoutingKey


class NoHealthyEndpoint(Exception):
    def __init__(self, role: Role) -> None:
        super().__init__(f"no healthy {role.value} endpoint")
        self.role = role


@runtime_checkable
class KnowsCachedPrompts(Protocol):
    """A policy that knows which prefixes each endpoint holds (``cache_aware``, ``kv_aware``)."""

    def uncached_tokens(
        self, candidates: Sequence[Endpoint], key: RoutingKey
    ) -> Mapping[Endpoint, int]:
        """The prompt tokens of ``key`` each candidate would have to compute."""
        ...


@runtime_checkable
class Teaches(Protocol):
    """A policy whose choice teaches it something an engine's refusal takes back
    (``cache_aware``'s insert): ``lesson`` is its last choice's, None if it learnt nothing."""

    lesson: Lesson | None


@runtime_checkable
class Forecasts(Protocol):
    """A policy that forecasts what its choice makes the endpoint hold (``kv_aware``):
    ``on_release`` is its last choice's callback for when the request leaves that endpoint
    (the lease slot's release: :mod:`trio_pdrouter.ledger.load`), None if it forecast nothing."""

    on_release: Callable[[], None] | None

    def forecast_states(self) -> dict[str, dict[str, object]]:
        """Each endpoint's forecast, by endpoint key (``GET /debug/kv-index``)."""
        ...


@runtime_checkable
class KeepsSessions(Protocol):
    """A policy that binds sessions to endpoints and forgets one on request
    (``sticky_least_loaded``: ``POST /finish_session``)."""

    def finish(self, session: str) -> bool:
        """Forget ``session``; False when it was not bound."""
        ...


class ServesModels(Protocol):
    """Which endpoints serve a model (:class:`~trio_pdrouter.fleet.ServedModels`)."""

    def serving(self, candidates: Sequence[Endpoint], model: str) -> list[Endpoint]:
        """Those of ``candidates`` a request naming ``model`` may go to."""
        ...


#: Extra admission test per endpoint (health, circuit breaker); True = may take traffic.
Admits = Callable[[Endpoint], bool]


class Routing:
    """The policies of the stages over their endpoints (see the module doc).

    ``policies`` names the roles of this mode (prefill and decode, or regular); ``admits`` are
    the checks every candidate must pass; ``peers``, when given, adds the other replicas' loads
    to this one's in every choice (charges still go to this replica's ledger only);
    ``by_tokens`` names the roles whose load metric is tokens; ``models``, when given, keeps a
    request that names a model on the endpoints that serve it (in PD mode both legs). The
    endpoint lists start empty and change only through :meth:`set_endpoints`, which the fleet
    calls.
    """

    def __init__(
        self,
        policies: Mapping[Role, Policy],
        ledger: LoadLedger,
        admits: Sequence[Admits],
        peers: PeerLoads | None,
        *,
        by_tokens: Collection[Role],
        models: ServesModels | None,
    ) -> None:
        self._ledger = ledger
        self._models = models
        self._peers = peers
        self._by_tokens = frozenset(by_tokens)
        self._prefixes = {
            role: policy
            for role, policy in policies.items()
            if isinstance(policy, KnowsCachedPrompts)
        }
        # Decided once: an isinstance check against a runtime-checkable protocol costs more
        # than the rest of a choice.
        self._teachers = {
            role: policy for role, policy in policies.items() if isinstance(policy, Teaches)
        }
        self._forecasters = {
            role: policy for role, policy in policies.items() if isinstance(policy, Forecasts)
        }
        self._session_keepers = [
            policy for policy in policies.values() if isinstance(policy, KeepsSessions)
        ]
        self._policies = dict(policies)
        self._admits = tuple(admits)
        self._endpoints: dict[Role, tuple[Endpoint, ...]] = {role: () for role in policies}

    @property
    def roles(self) -> tuple[Role, ...]:
        return tuple(self._endpoints)

    def endpoints(self, role: Role) -> tuple[Endpoint, ...]:
        """Every endpoint of ``role``, routable or not."""
        return self._endpoints.get(role, ())

    def set_endpoints(self, role: Role, endpoints: Sequence[Endpoint]) -> None:
        """The endpoints of ``role`` from now on (the fleet's call)."""
        self._endpoints[role] = tuple(endpoints)
        self._policies[role].set_endpoints(endpoints)

    def candidates(self, role: Role) -> list[Endpoint]:
        """Endpoints of ``role`` that may take traffic now (healthy, circuit not open)."""
        admits = self._admits
        return [ep for ep in self._endpoints.get(role, ()) if all(a(ep) for a in admits)]

    def choose(self, role: Role, key: RoutingKey, avoid_urls: Collection[str] = ()) -> Endpoint:
        """Ask the stage's policy; servers in ``avoid_urls`` (failed in an earlier attempt) are
        skipped while any other candidate remains."""
        chosen, _weight, on_release = self._choose(role, key, avoid_urls)
        if on_release is not None:
            on_release()  # nothing is leased: no request waits there on this choice's account
        return chosen

    def _choose(
        self, role: Role, key: RoutingKey, avoid_urls: Collection[str]
    ) -> tuple[Endpoint, int, Callable[[], None] | None]:
        """The endpoint chosen, the token weight to charge it with, and the policy's callback
        for the release of that charge (:class:`Forecasts`)."""
        candidates = self.candidates(role)
        if key.model is not None and self._models is not None:
            candidates = self._models.serving(candidates, key.model)
        if avoid_urls:
            candidates = [ep for ep in candidates if ep.url not in avoid_urls] or candidates
        if not candidates:
            raise NoHealthyEndpoint(role)
        weights = self.weights(role, candidates, key)
        loads: Mapping[Endpoint, int]
        if role in self._by_tokens:
            tokens = self._ledger.token_loads(candidates)
            if self._peers is not None:
                tokens = self._peers.add_tokens_to(tokens)
            loads = {ep: tokens[ep] + weights[ep] for ep in candidates}
        else:
            loads = self._ledger.loads(candidates)
            if self._peers is not None:
                loads = self._peers.add_to(loads)
        chosen = self._policies[role].choose(candidates, loads, key)
        forecaster = self._forecasters.get(role)
        return chosen, weights[chosen], None if forecaster is None else forecaster.on_release

    def weights(
        self, role: Role, candidates: Sequence[Endpoint], key: RoutingKey
    ) -> dict[Endpoint, int]:
        """The token weight this request would put on each candidate (see the module doc)."""
        if role is not Role.PREFILL:
            return dict.fromkeys(candidates, key.prompt_tokens + key.output_tokens)
        holder = self._prefixes.get(role)
        if holder is None:
            return dict.fromkeys(candidates, key.prompt_tokens)
        return dict(holder.uncached_tokens(candidates, key))

    def lease_pd(
        self, key: RoutingKey, avoid_urls: Collection[str] = ()
    ) -> tuple[Lease, Endpoint, Endpoint]:
        """Choose a prefill and a decode endpoint and charge both (decode is charged before
        prefill starts, so concurrent arrivals see it; docs/design.md, "The load ledger")."""
        with self._ledger.charging():
            prefill, prefill_tokens, prefill_release = self._choose(Role.PREFILL, key, avoid_urls)
            try:
                decode, decode_tokens, decode_release = self._choose(Role.DECODE, key, avoid_urls)
            except NoHealthyEndpoint:
                for lesson in self.lessons(Role.PREFILL).values():
                    lesson.unlearn()  # that prefill is never sent the request
                if prefill_release is not None:
                    prefill_release()
                raise
            # Decode is PENDING until its leg is sent: charged (policies see it) but not yet
            # visible to the engine (engine truth leaves it out).
            tokens = {prefill: prefill_tokens, decode: decode_tokens}
            releases = _releases((prefill, prefill_release), (decode, decode_release))
            lease = self._ledger.lease(
                prefill, decode, pending=(decode,), tokens=tokens, on_release=releases
            )
            return lease, prefill, decode

    def lease_one(
        self, role: Role, key: RoutingKey, avoid_urls: Collection[str] = ()
    ) -> tuple[Lease, Endpoint]:
        with self._ledger.charging():
            endpoint, weight, on_release = self._choose(role, key, avoid_urls)
            releases = _releases((endpoint, on_release))
            lease = self._ledger.lease(endpoint, tokens={endpoint: weight}, on_release=releases)
            return lease, endpoint

    def kv_note(self, role: Role) -> str | None:
        """What the ``kv_aware`` policy of ``role`` saw in its last decision (None for other
        policies); read right after a lease, in the same synchronous step."""
        last = getattr(self._policies.get(role), "last", None)
        return last.note() if isinstance(last, KvDecision) else None

    def forecasts(self) -> dict[str, dict[str, dict[str, object]]]:
        """Endpoint key -> stage -> the state of ``kv_aware``'s forecast of that engine."""
        out: dict[str, dict[str, dict[str, object]]] = {}
        for role, policy in self._forecasters.items():
            for key, state in policy.forecast_states().items():
                out.setdefault(key, {})[role.value] = state
        return out

    def lessons(self, *roles: Role) -> dict[Role, Lesson]:
        """What the policies of ``roles`` learnt in their last choice, to be taken back if the
        engine chosen refuses the request; read right after a lease, in the same synchronous
        step (as :meth:`kv_note`)."""
        out: dict[Role, Lesson] = {}
        for role in roles:
            teacher = self._teachers.get(role)
            if teacher is not None and teacher.lesson is not None:
                out[role] = teacher.lesson
        return out

    def finish_session(self, session: str) -> bool:
        """Forget ``session`` in every stage whose policy keeps sessions (this process's maps);
        True when any stage had it bound."""
        finished = [keeper.finish(session) for keeper in self._session_keepers]
        return any(finished)

    def maintain(self) -> bool:
        """One slice of every policy's housekeeping; True while any has more to do."""
        more = False
        for policy in self._policies.values():
            more = policy.maintain() or more
        return more


def _releases(
    *pairs: tuple[Endpoint, Callable[[], None] | None],
) -> dict[Endpoint, Callable[[], None]] | None:
    """The lease's ``on_release`` of the endpoints whose policies gave a callback."""
    out = {endpoint: callback for endpoint, callback in pairs if callback is not None}
    return out or None
