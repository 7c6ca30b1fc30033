"""The other replicas' loads, as their latest snapshots say, read from memory while routing.

Rules of this module (pure: nothing here awaits or touches the network):

* A snapshot is a replica's whole ledger as absolute counts, ``{role: {endpoint key: n}}``, the
  shape of :meth:`~trio_pdrouter.load.LoadLedger.snapshot`. Absolute counts, never deltas: a
  lost or repeated snapshot cannot make a count drift, and a count is never negative (a peer's
  negative or non-integer count is read as 0).
* :meth:`PeerLoads.update` replaces every peer at once with what the store returned: a peer the
  store no longer has (its key expired: the replica died or lost the store) counts 0 from then
  on. :meth:`PeerLoads.forget` (the store is unreachable) makes every peer count 0 at once, and
  so does an update older than ``valid_for`` seconds (a sync loop that stopped answering): the
  router then routes on its local counts.
* :meth:`PeerLoads.add_to` is what routing calls inside its synchronous choose-and-charge: a
  dictionary lookup per candidate, no await.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import orjson

from .endpoints import Endpoint

#: ``{role: {endpoint key: count}}``: one replica's ledger.
Snapshot = dict[str, dict[str, int]]


def encode(snapshot: Snapshot) -> bytes:
    return orjson.dumps(snapshot)


def decode(raw: bytes | str) -> Snapshot:
    """A peer's published snapshot, with anything that is not a non-negative count dropped.

    Raises ``ValueError`` when ``raw`` is not a JSON object (orjson's error is one).
    """
    data: Any = orjson.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("a snapshot is a JSON object")
    out: Snapshot = {}
    for role, counts in data.items():
        if isinstance(role, str) and isinstance(counts, dict):
            out[role] = {
                key: n
                for key, n in counts.items()
                if isinstance(n, int) and not isinstance(n, bool) and n > 0
            }
    return out


def summed(snapshots: Iterable[Snapshot]) -> Snapshot:
    """The per-endpoint sum of ``snapshots`` (every key of any of them, zeros kept)."""
    out: Snapshot = {}
    for snapshot in snapshots:
        for role, counts in snapshot.items():
            total = out.setdefault(role, {})
            for key, n in counts.items():
                total[key] = total.get(key, 0) + n
    return out


class PeerLoads:
    """The latest snapshot of each peer replica and their per-endpoint sum.

    ``replica`` is this replica's own id (never counted as a peer); ``clock`` gives seconds
    (``trio.current_time`` in the router) and ``valid_for`` how long after an update the peers'
    counts still hold if no other update or :meth:`forget` comes.
    """

    def __init__(self, replica: str, valid_for: float, clock: Callable[[], float]) -> None:
        self.replica = replica
        self._valid_for = valid_for
        self._clock = clock
        self._snapshots: dict[str, Snapshot] = {}
        self._sum: dict[tuple[str, str], int] = {}
        self._valid_until = float("-inf")

    def update(self, snapshots: Mapping[str, Snapshot]) -> None:
        """Every live peer's snapshot, as just read from the store (this replica's own left out)."""
        self._snapshots = {r: s for r, s in snapshots.items() if r != self.replica}
        self._sum = {
            (role, key): n
            for role, counts in summed(self._snapshots.values()).items()
            for key, n in counts.items()
        }
        self._valid_until = self._clock() + self._valid_for

    def forget(self) -> None:
        """Every peer counts 0 until the next update (the store cannot be reached)."""
        self._snapshots = {}
        self._sum = {}

    def live(self) -> bool:
        """True while the last update is recent enough to count."""
        return self._clock() <= self._valid_until

    def snapshots(self) -> dict[str, Snapshot]:
        """Each live peer's snapshot (none once the last update is too old)."""
        return dict(self._snapshots) if self.live() else {}

    def load(self, endpoint: Endpoint) -> int:
        """What every live peer has charged to ``endpoint``."""
        if not self.live():
            return 0
        return self._sum.get((endpoint.role.value, endpoint.key), 0)

    def add_to(self, loads: dict[Endpoint, int]) -> dict[Endpoint, int]:
        """``loads`` (this replica's own counts) plus the peers' counts, per endpoint."""
        if not self._sum or not self.live():
            return loads
        peers = self._sum
        return {ep: n + peers.get((ep.role.value, ep.key), 0) for ep, n in loads.items()}


def cluster_view(own: Snapshot, peers: PeerLoads) -> dict[str, Any]:
    """``/get_loads``' ``"cluster"``: each replica's snapshot (this one's exact, the peers'
    latest) and their sum."""
    replicas = {peers.replica: own, **peers.snapshots()}
    return {"replica": peers.replica, "replicas": replicas, "total": summed(replicas.values())}
