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

__all__ = ["build_parser", "parse_config", "shown_default"]

USAGE = """\
%(prog)s --vllm-pd-disaggregation --prefill URL --decode URL [options]   (PD mode)
       %(prog)s --worker-urls URL [URL ...] [options]                        (regular mode)"""

DESCRIPTION = """\
A vLLM router for prefill/decode (PD) disaggregated serving and plain load balancing, built on
trio. Per-endpoint load is exact: a decode stream counts until its last byte, until the client
leaves, or until anything fails.
"""

EPILOG = """\
Sizes take a unit: 512MiB, 4MiB, 1GiB, 64KiB (or plain bytes). vllm-router's flags for what
is not implemented here (--mini-lb, --enable-igw, --vllm-discovery-address, WASM middleware,
program scheduling) parse and then stop the router with the reason and what to use instead.
Every flag, with the reasoning behind its default: docs/reference/configuration.md.
"""


def shown_default(action: argparse.Action) -> str | None:
    """A flag's default as ``--help`` and the reference show it, or None when it tells a user
    nothing: "not given" (None, an empty list, an unset switch), or a default that depends on
    other flags (the help says how). A list shows as the words to type."""
    text = action.help or ""
    default = action.default
    unset = default is None or default is False or default is argparse.SUPPRESS
    if unset or default in ([], ()) or "Default:" in text or "(default:" in text:
        return None
    if isinstance(default, list | tuple):
        return " ".join(str(value) for value in default)
    return str(default)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag's help, then its :func:`shown_default` when there is one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        shown = shown_default(action)
        if shown is None or action.help is argparse.SUPPRESS:
            return action.help
        return f"{action.help} (default: {shown.replace('%', '%%')})"


def build_parser() -> argparse.ArgumentParser:
    """The parser of every flag that :class:`RouterConfig` declares."""
    parser = argparse.ArgumentParser(
        prog="trio-pdrouter",
        usage=USAGE,
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
