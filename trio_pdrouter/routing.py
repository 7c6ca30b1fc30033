"""Choosing endpoints and charging them, in one synchronous step.

:class:`Routing` knows every endpoint per role, which ones may take traffic, and the policy of
each stage. :meth:`Routing.lease_pd` and :meth:`Routing.lease_one` read the ledger, ask the
policies, and charge the chosen endpoints without an await in between, so concurrent arrivals
always see each other's load and a cancellation can never fall between choice and charge.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from .config import RouterConfig
from .endpoints import Endpoint, Role
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

    def candidates(self, role: Role, exclude: Sequence[Endpoint] = ()) -> list[Endpoint]:
        eps = self.endpoints.get(role, [])
        admits = self._admits
        return [ep for ep in eps if ep not in exclude and all(a(ep) for a in admits)]

    def choose(self, role: Role, key: RoutingKey, exclude: Sequence[Endpoint] = ()) -> Endpoint:
        candidates = self.candidates(role, exclude)
        if not candidates:
            raise NoHealthyEndpoint(role)
        return self.policies[role].choose(candidates, self.ledger.loads(candidates), key)

    def lease_pd(
        self, key: RoutingKey, exclude: Sequence[Endpoint] = ()
    ) -> tuple[Lease, Endpoint, Endpoint]:
        """Choose a prefill and a decode endpoint and charge both (SPEC §5: decode is charged
        before prefill starts, so concurrent arrivals see it)."""
        prefill = self.choose(Role.PREFILL, key, exclude)
        decode = self.choose(Role.DECODE, key, exclude)
        return self.ledger.lease(prefill, decode), prefill, decode

    def lease_one(
        self, role: Role, key: RoutingKey, exclude: Sequence[Endpoint] = ()
    ) -> tuple[Lease, Endpoint]:
        endpoint = self.choose(role, key, exclude)
        return self.ledger.lease(endpoint), endpoint

    def maintain(self) -> None:
        for policy in self.policies.values():
            policy.maintain()
