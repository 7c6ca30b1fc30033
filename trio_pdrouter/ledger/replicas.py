"""The other replicas' loads, as their latest snapshots say, read from memory while routing.

Rules of this module (pure: nothing here awaits or touches the network):

* A :class:`Snapshot` is a replica's whole ledger as absolute numbers, three maps of the shape
  ``{role: {endpoint key: n}}`` (:meth:`~trio_pdrouter.ledger.load.LoadLedger.snapshot`'s):
  ``counts``, every slot it holds (what peers route on: a decode slot charged while its prefill runs
  is a real upcoming load); ``visible``, the slots whose request has been sent (what engine truth
  compares with the engines, which cannot see the others yet); ``tokens``, the token weights (what
  peers route on where a stage's load metric is tokens). Absolute numbers, never deltas: a lost or
  repeated snapshot cannot make a number drift, and a number is never negative (a peer's negative or
  non-integer one is read as 0).
* The wire shape is one JSON object: the counts' role maps at the top, as the first version
  wrote them, and beside them the sections ``"visible"`` and ``"tokens"`` (never a role's name),
  each a ``{role: {key: n}}``. So in a rolling upgrade either version reads the other: a reader
  of the first version sees the counts where it looks and takes the two sections for roles with
  no counts (no endpoint has their name, so they add nothing); this version reads a snapshot
  without ``"visible"`` as visible = counts (that peer's pending slots cannot be told apart) and
  one without ``"tokens"`` as no token weight.
* :meth:`PeerLoads.update` replaces every peer at once with what the store returned: a peer the
  store no longer has (its key expired: the replica died or lost the store) counts 0 from then
  on. :meth:`PeerLoads.forget` (the store is unreachable) makes every peer count 0 at once, and
  so does an update older than ``valid_for`` seconds (a sync loop that stopped answering): the
  router then routes on its local counts.
* Beside them, the section ``"tenants"``: ``{tenant: {"in_flight": n, "queued": n, "served": n}}``,
  the replica's tenants' numbers (:mod:`trio_pdrouter.tenants`); a reader of an older version takes
  it for a role with no counts, and this version reads a snapshot without it as no tenants.
  :meth:`PeerLoads.tenant` sums one of them over the live peers.
* :meth:`PeerLoads.add_to` and :meth:`PeerLoads.add_tokens_to` are what routing calls inside its
  synchronous choose-and-charge: a dictionary lookup per candidate, no await.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import orjson

from ..endpoints import Endpoint
from .load import LoadLedger

#: ``{role: {endpoint key: n}}``: one kind of number over one replica's ledger.
Loads = dict[str, dict[str, int]]

#: The wire names of the sections beside the counts' role maps (see the module doc).
VISIBLE = "visible"
TOKENS = "tokens"
TENANTS = "tenants"
SECTIONS = (VISIBLE, TOKENS, TENANTS)


@attrs.frozen
class Snapshot:
    """One replica's ledger: its counts, the visible part of them, and its token weights."""

    counts: Loads
    #: None: the same as ``counts`` (a peer of the first version did not say).
    visible: Loads | None = None
    tokens: Loads = attrs.field(factory=dict)
    #: ``{tenant: {"in_flight"|"queued"|"served": n}}`` (the same shape as the loads).
    tenants: Loads = attrs.field(factory=dict)

    @classmethod
    def of(cls, ledger: LoadLedger, tenants: Loads | None = None) -> Snapshot:
        """What this replica publishes: ``ledger``'s numbers now (machine-wide with workers),
        and its tenants' own numbers."""
        return cls(
            ledger.snapshot(), ledger.visible_snapshot(), ledger.token_snapshot(), tenants or {}
        )

    def visible_counts(self) -> Loads:
        return self.counts if self.visible is None else self.visible


def encode(snapshot: Snapshot) -> bytes:
    wire: dict[str, Any] = dict(snapshot.counts)
    wire[VISIBLE] = snapshot.visible_counts()
    wire[TOKENS] = snapshot.tokens
    if snapshot.tenants:
        wire[TENANTS] = snapshot.tenants
    return orjson.dumps(wire)


def decode(raw: bytes | str) -> Snapshot:
    """A peer's published snapshot, with anything that is not a non-negative number dropped.

    Raises ``ValueError`` when ``raw`` is not a JSON object (orjson's error is one).
    """
    data: Any = orjson.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("a snapshot is a JSON object")
    counts = _loads({role: v for role, v in data.items() if role not in SECTIONS})
    visible = data.get(VISIBLE)
    tokens = data.get(TOKENS)
    tenants = data.get(TENANTS)
    return Snapshot(
        counts,
        _loads(visible) if isinstance(visible, dict) else None,
        _loads(tokens) if isinstance(tokens, dict) else {},
        _loads(tenants) if isinstance(tenants, dict) else {},
    )


def _loads(data: dict[Any, Any]) -> Loads:
    out: Loads = {}
    for role, numbers in data.items():
        if isinstance(role, str) and isinstance(numbers, dict):
            out[role] = {
                key: n
                for key, n in numbers.items()
                if isinstance(n, int) and not isinstance(n, bool) and n > 0
            }
    return out


def summed(loads: Iterable[Loads]) -> Loads:
    """The per-endpoint sum of ``loads`` (every key of any of them, zeros kept)."""
    out: Loads = {}
    for one in loads:
        for role, numbers in one.items():
            total = out.setdefault(role, {})
            for key, n in numbers.items():
                total[key] = total.get(key, 0) + n
    return out


def _by_endpoint(loads: Iterable[Loads]) -> dict[tuple[str, str], int]:
    return {(role, key): n for role, ns in summed(loads).items() for key, n in ns.items()}


class PeerLoads:
    """The latest snapshot of each peer replica and their per-endpoint sums.

    ``replica`` is this replica's own id (never counted as a peer); ``clock`` gives seconds
    (``trio.current_time`` in the router) and ``valid_for`` how long after an update the peers'
    numbers still hold if no other update or :meth:`forget` comes.
    """

    def __init__(self, replica: str, valid_for: float, clock: Callable[[], float]) -> None:
        self.replica = replica
        self._valid_for = valid_for
        self._clock = clock
        self._snapshots: dict[str, Snapshot] = {}
        self._counts: dict[tuple[str, str], int] = {}
        self._visible: dict[tuple[str, str], int] = {}
        self._tokens: dict[tuple[str, str], int] = {}
        self._tenants: dict[tuple[str, str], int] = {}
        self._valid_until = float("-inf")

    def update(self, snapshots: Mapping[str, Snapshot]) -> None:
        """Every live peer's snapshot, as just read from the store (this replica's own left out)."""
        self._snapshots = {r: s for r, s in snapshots.items() if r != self.replica}
        peers = self._snapshots.values()
        self._counts = _by_endpoint(s.counts for s in peers)
        self._visible = _by_endpoint(s.visible_counts() for s in peers)
        self._tokens = _by_endpoint(s.tokens for s in peers)
        self._tenants = _by_endpoint(s.tenants for s in peers)
        self._valid_until = self._clock() + self._valid_for

    def forget(self) -> None:
        """Every peer counts 0 until the next update (the store cannot be reached)."""
        self._snapshots = {}
        self._counts, self._visible, self._tokens, self._tenants = {}, {}, {}, {}

    def live(self) -> bool:
        """True while the last update is recent enough to count."""
        return self._clock() <= self._valid_until

    def snapshots(self) -> dict[str, Snapshot]:
        """Each live peer's snapshot (none once the last update is too old)."""
        return dict(self._snapshots) if self.live() else {}

    def load(self, endpoint: Endpoint) -> int:
        """What every live peer has charged to ``endpoint``."""
        return self._of(self._counts, endpoint)

    def visible(self, endpoint: Endpoint) -> int:
        """The part of :meth:`load` whose requests the peers have sent to the engine."""
        return self._of(self._visible, endpoint)

    def token_load(self, endpoint: Endpoint) -> int:
        """The token weight every live peer has charged to ``endpoint``."""
        return self._of(self._tokens, endpoint)

    def tenant(self, name: str, field: str) -> int:
        """``field`` (``in_flight``, ``queued``, ``served``) of tenant ``name``, summed over the
        live peers."""
        return self._tenants.get((name, field), 0) if self.live() else 0

    def tenant_names(self) -> set[str]:
        """The tenants the live peers have numbers for."""
        return {name for name, _ in self._tenants} if self.live() else set()

    def _of(self, sums: dict[tuple[str, str], int], endpoint: Endpoint) -> int:
        if not self.live():
            return 0
        return sums.get((endpoint.role.value, endpoint.key), 0)

    def add_to(self, loads: dict[Endpoint, int]) -> dict[Endpoint, int]:
        """``loads`` (this replica's own counts) plus the peers' counts, per endpoint."""
        return self._added(self._counts, loads)

    def add_tokens_to(self, loads: dict[Endpoint, int]) -> dict[Endpoint, int]:
        """``loads`` (this replica's own token weights) plus the peers', per endpoint."""
        return self._added(self._tokens, loads)

    def _added(
        self, sums: dict[tuple[str, str], int], loads: dict[Endpoint, int]
    ) -> dict[Endpoint, int]:
        if not sums or not self.live():
            return loads
        return {ep: n + sums.get((ep.role.value, ep.key), 0) for ep, n in loads.items()}


def cluster_view(own: Snapshot, peers: PeerLoads) -> dict[str, Any]:
    """``/get_loads``' ``"cluster"``: each replica's counts (this one's exact, the peers' latest)
    and their sum, beside the sums of the visible counts and of the token weights."""
    replicas = {peers.replica: own, **peers.snapshots()}
    return {
        "replica": peers.replica,
        "replicas": {r: s.counts for r, s in replicas.items()},
        "total": summed(s.counts for s in replicas.values()),
        VISIBLE: summed(s.visible_counts() for s in replicas.values()),
        TOKENS: summed(s.tokens for s in replicas.values()),
    }
