"""The flags of vLLM's KV events for ``kv_aware``: vllm-router 0.1.17's, with its spellings.

``--kv-event-source URL=ENDPOINT[,ENDPOINT...]`` (repeat per server) names the ZMQ endpoints a
server's engines publish on, one per DP rank in rank order; ``--pd-kv-events`` is the same for a
prefill server in PD mode; ``--kv-event-replay-source`` gives the matching replay (ROUTER)
endpoints. What they mean, and the checks against the servers the router routes to, are
:mod:`trio_pdrouter.kv.sources`'s. That ``--kv-tokenizer-path`` names loadable files is checked by
the command line (:func:`trio_pdrouter.cli.parse_config`), which may load a tokenizer.
"""

from __future__ import annotations

import attrs

from .flags import Flag, Group, as_tuple, non_negative, positive, setting

__all__ = ["STITCH_CUT_CHARS", "KvEventSettings"]


#: ``--kv-tokenize-cut-chars`` with ``--kv-tokenizer-path`` unless given: shared starts are
#: cached at a multiple of this many characters.
STITCH_CUT_CHARS = 32


def _sources(spelling: str, help: str) -> tuple[str, ...]:
    return setting(
        (),
        Flag(
            spelling,
            Group.KV_AWARE,
            help,
            action="append",
            metavar="URL=ENDPOINT[,ENDPOINT...]",
            parse=as_tuple,
        ),
    )


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
            Group.KV_AWARE,
            "kv_aware: the engines' KV block size in tokens (vLLM's --block-size)",
            type=int,
        ),
        check=positive,
    )
    model: str | None = setting(
        None,
        Flag(
            "--kv-event-model",
            Group.KV_AWARE,
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
            Group.KV_AWARE,
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
            Group.KV_AWARE,
            "kv_aware: tokenize prompts in the router with the engines' tokenizer (a"
            " tokenizer.json, or a model directory with tokenizer.json and tokenizer_config.json"
            " for the chat template) instead of asking an engine's /tokenize per request"
            " (no round trip before routing; the encode costs router CPU instead); it must be"
            " the tokenizer the engines use",
            metavar="TOKENIZER_PATH",
        ),
    )

    tokenize_cut_chars: int | None = setting(
        None,
        Flag(
            "--kv-tokenize-cut-chars",
            Group.KV_AWARE,
            "kv_aware: N > 0 tokenizes a text prompt whose start (512 characters or more) the"
            " router has sent before up to that start, cut at a multiple of N characters, and"
            " caches the start's ids. With --kv-tokenizer-path the rest is encoded from a word"
            " boundary and every id kept (exact, measured cheaper than a whole encode); with"
            " /tokenize the rest is counted by estimate and gets no credit (measured: less"
            " router CPU, 1-1.5 points fewer hits; docs/routing.md). 0: every prompt whole."
            " Default: 32 with --kv-tokenizer-path, else 0",
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
