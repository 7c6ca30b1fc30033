"""The command line's flags: the parser of every flag :class:`~.router.RouterConfig` declares.

Parsing builds a :class:`~.router.RouterConfig` (every check of a single setting, and those across
settings) and turns a bad setting into argparse's exit 2 with one message. Checks that need the
runtime (the ``--kv-tokenizer-path`` files load) are passed in by the caller
(:func:`trio_pdrouter.cli.parse_config`), so this package imports no runtime module.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from .. import __version__
from . import flags
from .flags import ConfigError
from .router import RouterConfig

__all__ = ["build_parser", "parse_config"]

DESCRIPTION = """\
A vLLM router for prefill/decode (PD) disaggregated serving and plain load balancing, built on
trio. Per-endpoint load is exact: a decode stream counts until its last byte, until the client
leaves, or until anything fails.

PD mode:      trio-pdrouter --vllm-pd-disaggregation --prefill URL --decode URL [...]
Regular mode: trio-pdrouter --worker-urls URL [URL ...]
"""

EPILOG = """\
routes: POST /v1/completions, /v1/chat/completions, /v1/responses, /inference/v1/generate
(generation, streaming or not; split in PD mode); POST /v1/rerank, /rerank, /tokenize,
/detokenize, /v1/embeddings, /pooling, /score, /v1/score, /classify (to one server); GET
/v1/models, /health, /healthcheck, /liveness, /readiness, /get_loads (the load ledger), /workers,
/metrics, /version, /admin/config (the effective flags, secrets redacted).
"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, except None ("not given"): it tells a user nothing,
    and where the default depends on other flags (the help says how) it would contradict it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every flag that :class:`RouterConfig` declares."""
    parser = argparse.ArgumentParser(
        prog="trio-pdrouter",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"trio-pdrouter {__version__}")
    flags.add_flags(parser, RouterConfig)
    return parser


def parse_config(
    argv: Sequence[str] | None = None,
    *,
    check: Callable[[RouterConfig], None] | None = None,
) -> RouterConfig:
    """The config ``argv`` describes; on a bad setting, exit 2 with the message on stderr.

    ``check`` is a further check of the whole config that raises :class:`ConfigError`.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = flags.build(RouterConfig, args)
        if check is not None:
            check(config)
        return config
    except ConfigError as exc:
        # Not parser.error(): the usage would bury the one message that matters.
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
