"""``trio-pdrouter``: the command line, flag for flag compatible with vllm-router.

A vllm-router launch command works with only the program name changed. Flags of vllm-router that
trio-pdrouter does not implement (service discovery, WASM middleware, KV events, ...) parse, and
the router then exits 2 with one message naming each of them with the alternative, rather than
ignoring them silently.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import trio

from . import __version__, flags
from .config import RouterConfig
from .flags import ConfigError
from .log_files import configure_logging

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
/metrics.
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


def parse_config(argv: Sequence[str] | None = None) -> RouterConfig:
    """The config ``argv`` describes; on a bad setting, exit 2 with the message on stderr."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return flags.build(RouterConfig, args)
    except ConfigError as exc:
        # Not parser.error(): the usage would bury the one message that matters.
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


def main(argv: Sequence[str] | None = None) -> None:
    from .kube_credentials import NoCredentials
    from .server import run_router, wait_for_signal
    from .startup import StartupTimeout
    from .supervisor import WorkersKeepDying, supervise

    argv = sys.argv[1:] if argv is None else list(argv)
    config = parse_config(argv)
    configure_logging(config.log_level, config.log_dir)
    if config.server.workers == 1:
        try:
            trio.run(
                lambda: run_router(
                    config,
                    shutdown_trigger=wait_for_signal,
                    exit_by_deadline=True,
                    settle_heap=True,
                )
            )
        except (StartupTimeout, NoCredentials) as exc:
            sys.exit(f"trio-pdrouter: {exc}")
        return
    failure = ""
    try:
        trio.run(lambda: supervise(config, argv, wait_for_signal))
    except* WorkersKeepDying as group:
        failure = "; ".join(str(exc) for exc in _leaves(group))
    if failure:
        logging.getLogger("trio_pdrouter.supervisor").error("%s", failure)
        sys.exit(1)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    return [
        leaf
        for exc in group.exceptions
        for leaf in (_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    ]
