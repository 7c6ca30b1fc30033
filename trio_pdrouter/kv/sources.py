"""Where vLLM's KV events come from: the sources :class:`~trio_pdrouter.config.KvEventSettings`
gives, and the subscriber over them.

One endpoint for a server of ``--dp-size N`` stands for all its ranks at vLLM's
offsets: rank ``r`` on port + ``r``. An endpoint with ``*`` is bound here (vLLM connects to
it), as is one prefixed ``bind:`` (that address only); any other is connected to (vLLM bound
it), as vLLM decides for its own side.

:func:`event_sources` turns the settings into :class:`~.sockets.EventSource` values,
refusing (``ConfigError``) a server the router does not route to, a rank count that does not
match, or a malformed value. With ``--workers N`` the supervisor follows those sources once
for the machine (:mod:`.fanout`) and each worker's :func:`kv_events_for` subscribes to the
supervisor's local copies instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from ..config import ConfigError, KvEventSettings, PolicySettings
from ..endpoints import Endpoint, normalize_url
from .fanout import relayed
from .sockets import BIND, EventSource
from .subscriber import KvEvents

__all__ = [
    "event_sources",
    "kv_events_for",
    "medium_weights",
    "sources_for",
]


_PORT = re.compile(r"^(.*):(\d+)$")


def _parse(values: Sequence[str], spelling: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for value in values:
        url, sep, endpoints = value.partition("=")
        if not sep or not endpoints:
            raise ConfigError(f"{spelling} {value!r}: expected URL=ENDPOINT[,ENDPOINT...]")
        try:
            key = normalize_url(url)
        except ValueError as exc:
            raise ConfigError(f"{spelling}: {exc}") from None
        listed = [e.strip() for e in endpoints.split(",") if e.strip()]
        for endpoint in listed:
            if not endpoint.removeprefix(BIND).startswith(("tcp://", "ipc://")):
                raise ConfigError(
                    f"{spelling} {endpoint!r}: a ZMQ endpoint is [bind:]tcp:// or [bind:]ipc://"
                )
        out.setdefault(key, []).extend(listed)
    return out


def _per_rank(endpoints: list[str], ranks: int, spelling: str, url: str) -> list[str]:
    if len(endpoints) == ranks:
        return endpoints
    if len(endpoints) == 1:
        match = _PORT.match(endpoints[0])
        if match is None:
            if ranks == 1:
                return endpoints
            raise ConfigError(f"{spelling} {url}: one endpoint for {ranks} ranks needs a port")
        return [f"{match[1]}:{int(match[2]) + r}" for r in range(ranks)]
    raise ConfigError(f"{spelling} {url}: {len(endpoints)} endpoints for {ranks} DP ranks")


def event_sources(
    settings: KvEventSettings, endpoints: Mapping[str, Sequence[Endpoint]]
) -> list[EventSource]:
    """The event sources of ``settings`` for the servers in ``endpoints`` (URL -> its DP
    ranks' endpoints, as the router routes to them)."""
    live = _parse(settings.sources, "--kv-event-source")
    for url, listed in _parse(settings.pd_sources, "--pd-kv-events").items():
        live.setdefault(url, []).extend(listed)
    replay = _parse(settings.replay_sources, "--kv-event-replay-source")
    out: list[EventSource] = []
    for url, listed in live.items():
        ranks = endpoints.get(url)
        if not ranks:
            raise ConfigError(f"--kv-event-source {url}: not a server this router routes to")
        per_rank = _per_rank(listed, len(ranks), "--kv-event-source", url)
        replays: list[str | None] = [None] * len(ranks)
        if url in replay:
            replays = list(_per_rank(replay[url], len(ranks), "--kv-event-replay-source", url))
        for endpoint, live_endpoint, replay_endpoint in zip(ranks, per_rank, replays, strict=True):
            out.append(EventSource(url, endpoint.rank, live_endpoint, replay_endpoint))
    for url in replay:
        if url not in live:
            raise ConfigError(f"--kv-event-replay-source {url}: no --kv-event-source for it")
    return out


def medium_weights(settings: PolicySettings) -> dict[str, float]:
    """Credit per block by vLLM's ``medium``: GPU 1, CPU the host penalty, disk media the disk
    penalty, any other (a connector's external store) the external penalty."""
    return {
        "GPU": 1.0,
        "CPU": settings.kv_penalty_host,
        "DISK": settings.kv_penalty_disk,
        "STORAGE": settings.kv_penalty_disk,
        "*": settings.kv_penalty_external,
    }


def sources_for(settings: KvEventSettings, endpoints: Iterable[Endpoint]) -> list[EventSource]:
    """The event sources of ``settings`` over the router's ``endpoints`` (every role's)."""
    by_url: dict[str, list[Endpoint]] = {}
    for ep in endpoints:  # a server in two roles (prefill and decode) is one set of engines
        ranks = by_url.setdefault(ep.url, [])
        if ep.rank not in (r.rank for r in ranks):
            ranks.append(ep)
    return event_sources(settings, by_url)


def kv_events_for(
    settings: KvEventSettings,
    policy: PolicySettings,
    endpoints: Iterable[Endpoint],
    *,
    relay_dir: str | None = None,
) -> KvEvents | None:
    """The subscriber for these settings over the router's ``endpoints`` (None without any
    event source). ``relay_dir``: a worker of ``--workers N``, whose live events come from the
    supervisor's fan-out in that directory (:mod:`.fanout`)."""
    if not settings.any:
        return None
    sources = sources_for(settings, endpoints)
    return KvEvents(
        sources if relay_dir is None else relayed(sources, relay_dir),
        block_size=settings.block_size,
        weights=medium_weights(policy),
        budget=settings.index_blocks,
    )
