"""Choosing endpoints and charging them, in one synchronous step.

:class:`Routing` knows every endpoint per role, which ones may take traffic, and the policy of
each stage. :meth:`Routing.lease_pd` and :meth:`Routing.lease_one` read the ledger, ask the
policies, and charge the chosen endpoints without an await in between, so concurrent arrivals
always see each other's load and a cancellation can never fall between choice and charge.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection

from .config import RouterConfig
from .endpoints import Endpoint, Role, expand
from .load import Lease, LoadLedger
from .policies import Policy, RoutingKey, make_policy


class NoHealthyEndpoint(Exception):
    def __init__(self, role: Role) -> None:
        super().__init__(f"no healthy {role.value} endpoint")
        self.role = role


#: Extra admission test per endpoint (health, circuit breaker); True = may take traffic.
Admits = Callable[[Endpoint], bool]


class Routing:
    def __init__(
        self, config: RouterConfig, ledger: LoadLedger, rng: random.Random | None = None
    ) -> None:
        self.ledger = ledger
        self._rng = rng or random.Random()
        self._config = config
        self.endpoints: dict[Role, list[Endpoint]] = {
            role: list(eps) for role, eps in config.endpoints().items()
        }
        self.policies: dict[Role, Policy] = {
            role: make_policy(
                config.stage_policy(role),
                stage=role.value,
                settings=config.policy_settings,
                endpoints=eps,
                rng=self._rng,
            )
            for role, eps in self.endpoints.items()
        }
        self._admits: list[Admits] = []
        for eps in self.endpoints.values():
            for ep in eps:
                ledger.add_endpoint(ep)

    def add_admission_check(self, admits: Admits) -> None:
        self._admits.append(admits)

    def all_endpoints(self) -> list[Endpoint]:
        return [ep for eps in self.endpoints.values() for ep in eps]

    def candidates(self, role: Role) -> list[Endpoint]:
        """Endpoints of ``role`` that may take traffic now (healthy, circuit not open)."""
        admits = self._admits
        return [ep for ep in self.endpoints.get(role, []) if all(a(ep) for a in admits)]

    def choose(self, role: Role, key: RoutingKey, avoid_urls: Collection[str] = ()) -> Endpoint:
        """Ask the stage's policy; servers in ``avoid_urls`` (failed in an earlier attempt) are
        skipped while any other candidate remains."""
        candidates = self.candidates(role)
        if avoid_urls:
            candidates = [ep for ep in candidates if ep.url not in avoid_urls] or candidates
        if not candidates:
            raise NoHealthyEndpoint(role)
        return self.policies[role].choose(candidates, self.ledger.loads(candidates), key)

    def lease_pd(
        self, key: RoutingKey, avoid_urls: Collection[str] = ()
    ) -> tuple[Lease, Endpoint, Endpoint]:
        """Choose a prefill and a decode endpoint and charge both (SPEC §5: decode is charged
        before prefill starts, so concurrent arrivals see it)."""
        prefill = self.choose(Role.PREFILL, key, avoid_urls)
        decode = self.choose(Role.DECODE, key, avoid_urls)
        # Decode is PENDING until its leg is sent: charged (policies see it) but not yet
        # visible to the engine (engine truth leaves it out).
        return self.ledger.lease(prefill, decode, pending=(decode,)), prefill, decode

    def lease_one(
        self, role: Role, key: RoutingKey, avoid_urls: Collection[str] = ()
    ) -> tuple[Lease, Endpoint]:
        endpoint = self.choose(role, key, avoid_urls)
        return self.ledger.lease(endpoint), endpoint

    def add_url(self, url: str, role: Role) -> list[Endpoint]:
        """Add a server (all its DP ranks) to ``role``; raises ``ValueError`` for a bad URL, a
        role this mode does not have, or a server already present."""
        if role not in self.endpoints:
            modes = ", ".join(r.value for r in self.endpoints)
            raise ValueError(f"role {role.value!r} does not exist in this mode (use {modes})")
        added = list(expand([url], role, self._config.dp_size))
        if any(ep.url == added[0].url for eps in self.endpoints.values() for ep in eps):
            raise KeyError(added[0].url)
        self.endpoints[role].extend(added)
        for ep in added:
            self.ledger.add_endpoint(ep)
        self.policies[role].set_endpoints(self.endpoints[role])
        return added

    def remove_url(self, url: str) -> list[Endpoint]:
        """Stop routing to a server; its in-flight requests keep their leases until they end."""
        url = url.rstrip("/")
        removed: list[Endpoint] = []
        for role, eps in self.endpoints.items():
            gone = [ep for ep in eps if ep.url == url]
            if gone:
                self.endpoints[role] = [ep for ep in eps if ep.url != url]
                self.policies[role].set_endpoints(self.endpoints[role])
                removed.extend(gone)
        return removed

    def maintain(self) -> bool:
        """One slice of every policy's housekeeping; True while any has more to do."""
        more = False
        for policy in self.policies.values():
            more = policy.maintain() or more
        return more
