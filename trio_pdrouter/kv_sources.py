"""Where vLLM's KV events come from: vllm-router 0.1.17's flags, and the sources they give.

``--kv-event-source URL=ENDPOINT[,ENDPOINT...]`` (repeat per server) names the ZMQ endpoints a
server's engines publish on, one per DP rank in rank order; ``--pd-kv-events`` is the same for a
prefill server in PD mode; ``--kv-event-replay-source`` gives the matching replay (ROUTER)
endpoints. One endpoint for a server of ``--dp-size N`` stands for all its ranks at vLLM's
offsets: rank ``r`` on port + ``r``. An endpoint with ``*`` is bound here (vLLM connects to
it), as is one prefixed ``bind:`` (that address only); any other is connected to (vLLM bound
it), as vLLM decides for its own side.

:func:`event_sources` turns the settings into :class:`~.kv_subscriber.EventSource` values,
refusing (``ConfigError``) a server the router does not route to, a rank count that does not
match, or a malformed value. With ``--workers N`` the supervisor follows those sources once
for the machine (:mod:`.kv_fanout`) and each worker's :func:`kv_events_for` subscribes to the
supervisor's local copies instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import attrs

from .endpoints import Endpoint, normalize_url
from .flags import ConfigError, Flag, Group, non_negative, positive, setting
from .kv_fanout import relayed
from .kv_subscriber import BIND, EventSource, KvEvents
from .local_tokenizer import LocalTokenizer, TokenizerFilesError
from .policies import PolicySettings

__all__ = [
    "KvEventSettings",
    "event_sources",
    "kv_events_for",
    "medium_weights",
    "sources_for",
]


#: ``--kv-tokenize-cut-chars`` with ``--kv-tokenizer-path`` unless given: shared starts are
#: cached at a multiple of this many characters.
STITCH_CUT_CHARS = 32


def _tuple(values: list[str] | None) -> tuple[str, ...]:
    return tuple(values or ())


def _sources(spelling: str, help: str) -> tuple[str, ...]:
    return setting(
        (),
        Flag(
            spelling,
            Group.ROUTING_POLICY,
            help,
            action="append",
            metavar="URL=ENDPOINT[,ENDPOINT...]",
            parse=_tuple,
        ),
    )


def _loadable(instance: object, field: attrs.Attribute[str | None], value: str | None) -> None:
    if value is not None:
        try:
            LocalTokenizer.load(value)
        except TokenizerFilesError as exc:
            raise ConfigError(f"--kv-tokenizer-path {exc}") from None


@attrs.frozen
class KvEventSettings:
    """vLLM's KV-event sources for the ``kv_aware`` policy (see the module doc)."""

    sources: tuple[str, ...] = _sources(
        "--kv-event-source",
        "kv_aware: ZMQ endpoints where a server's engines publish KV events (vLLM's"
        " --kv-events-config endpoint), one per DP rank in rank order, or one for all ranks"
        " at port+rank; '*' in an endpoint makes the router bind it; repeat per server",
    )
    replay_sources: tuple[str, ...] = _sources(
        "--kv-event-replay-source",
        "kv_aware: the matching replay endpoints (vLLM's replay_endpoint); with them a lost"
        " batch is replayed, and a restarted router rebuilds its index from the engines'"
        " buffers",
    )
    block_size: int = setting(
        16,
        Flag(
            "--kv-event-block-size",
            Group.ROUTING_POLICY,
            "kv_aware: the engines' KV block size in tokens (vLLM's --block-size)",
            type=int,
        ),
        check=positive,
    )
    model: str | None = setting(
        None,
        Flag(
            "--kv-event-model",
            Group.ROUTING_POLICY,
            "kv_aware: the model every event source serves (informational: one router serves"
            " one model)",
        ),
    )
    pd_sources: tuple[str, ...] = _sources(
        "--pd-kv-events",
        "kv_aware in PD mode: KV event endpoints of a prefill server, one per DP rank",
    )
    index_blocks: int = setting(
        100_000,
        Flag(
            "--kv-index-max-blocks",
            Group.ROUTING_POLICY,
            "kv_aware: blocks the router indexes per engine and DP rank; past it the oldest"
            " are dropped (less credit, never false credit)",
            type=int,
        ),
        check=positive,
    )

    tokenizer_path: str | None = setting(
        None,
        Flag(
            "--kv-tokenizer-path",
            Group.ROUTING_POLICY,
            "kv_aware: tokenize prompts in the router with the engines' tokenizer (a"
            " tokenizer.json, or a model directory with tokenizer.json and tokenizer_config.json"
            " for the chat template) instead of asking an engine's /tokenize per request"
            " (no round trip before routing; the encode costs router CPU instead); it must be"
            " the tokenizer the engines use",
            metavar="TOKENIZER_PATH",
        ),
        check=_loadable,
    )

    tokenize_cut_chars: int | None = setting(
        None,
        Flag(
            "--kv-tokenize-cut-chars",
            Group.ROUTING_POLICY,
            "kv_aware: N > 0 tokenizes a text prompt whose start (512 characters or more) the"
            " router has sent before up to that start, cut at a multiple of N characters, and"
            " caches the start's ids. With --kv-tokenizer-path the rest is encoded from a word"
            " boundary and every id kept (exact, measured cheaper than a whole encode); with"
            " /tokenize the rest is counted by estimate and gets no credit (measured: less"
            " router CPU, 1-1.5 points fewer hits; README). 0: every prompt whole. Default: 32"
            " with --kv-tokenizer-path, else 0",
            type=int,
        ),
        check=non_negative,
    )

    def cut_chars(self) -> int:
        """``--kv-tokenize-cut-chars`` as given, else its default: starts stitched where the
        router tokenizes (no credit lost), whole prompts where an engine does."""
        if self.tokenize_cut_chars is not None:
            return self.tokenize_cut_chars
        return STITCH_CUT_CHARS if self.tokenizer_path is not None else 0

    @property
    def any(self) -> bool:
        return bool(self.sources or self.pd_sources)


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
    supervisor's fan-out in that directory (:mod:`.kv_fanout`)."""
    if not settings.any:
        return None
    sources = sources_for(settings, endpoints)
    return KvEvents(
        sources if relay_dir is None else relayed(sources, relay_dir),
        block_size=settings.block_size,
        weights=medium_weights(policy),
        budget=settings.index_blocks,
    )
