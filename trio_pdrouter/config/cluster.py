"""The cluster-wide load view across router replicas, through one Redis/Valkey (``--cluster-*``)."""

from __future__ import annotations

import socket

import attrs

from .flags import Flag, Group, must, positive, setting

#: What ``--cluster-url`` may start with (coredis' URL schemes; ``rediss`` is TLS).
CLUSTER_SCHEMES = ("redis://", "rediss://", "unix://")


@attrs.frozen
class ClusterSettings:
    """The cluster-wide load view across replicas through one Redis/Valkey (off without a URL).

    Every ``sync_ms`` each replica writes its ledger's counts to its own key, which expires after
    :attr:`ttl`, and reads its peers' keys in the same round trip.
    """

    url: str | None = setting(
        None,
        Flag(
            "--cluster-url",
            Group.CLUSTER,
            "share loads with the other replicas through this Redis or Valkey"
            " (redis://[user:password@]host:port/db; rediss:// for TLS); unset: this replica"
            " routes on its own counts only",
            metavar="REDIS_URL",
        ),
        check=must(
            lambda u: u.startswith(CLUSTER_SCHEMES),
            "must start with redis://, rediss:// or unix://",
        ),
    )
    sync_ms: int = setting(
        50,
        Flag(
            "--cluster-sync-ms",
            Group.CLUSTER,
            "publish this replica's loads and read the peers' this often (milliseconds); a"
            " replica that stops publishing counts 0 after 4 intervals (at least 0.5 s)",
            type=int,
            metavar="MS",
        ),
        check=positive,
    )
    replica_id: str | None = setting(
        None,
        Flag(
            "--replica-id",
            Group.CLUSTER,
            "this replica's name in the store and in /get_loads (default: hostname:port); every"
            " replica needs its own",
            metavar="ID",
        ),
        check=must(bool, "must not be empty"),
    )

    @property
    def interval(self) -> float:
        return self.sync_ms / 1000

    @property
    def ttl(self) -> float:
        """How long a published snapshot counts: four sync intervals, and at least 0.5 s, so a
        replica whose event loop is busy for a moment does not vanish from its peers' view."""
        return max(4 * self.interval, 0.5)

    def replica(self, port: int) -> str:
        return self.replica_id or f"{socket.gethostname()}:{port}"
