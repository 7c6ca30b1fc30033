"""``trio-pdrouter``: the command line, flag for flag compatible with vllm-router.

A vllm-router launch command works with only the program name changed. Flags of vllm-router that
trio-pdrouter does not implement (service discovery, WASM middleware, KV events, ...) parse, and
the router then exits 2 with one message naming each of them with the alternative, rather than
ignoring them silently.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import trio

from .config import ConfigError, RouterConfig, build_parser
from .config import parse_config as parse_settings
from .observe import TracingUnavailable, check_tracing_available, configure_logging
from .routing import LocalTokenizer, TokenizerFilesError
from .tenants import TenantsFileError
from .tenants import load as load_tenants

__all__ = ["build_parser", "main", "parse_config"]


def _tokenizer_loads(config: RouterConfig) -> None:
    """``--kv-tokenizer-path`` names files the router can load."""
    path = config.kv_events.tokenizer_path
    if path is not None:
        try:
            LocalTokenizer.load(path)
        except TokenizerFilesError as exc:
            raise ConfigError(f"--kv-tokenizer-path {exc}") from None


def _tracing_loads(config: RouterConfig) -> None:
    """``--otlp-traces-endpoint`` has the OpenTelemetry SDK it needs."""
    if config.otlp_traces_endpoint is not None:
        try:
            check_tracing_available()
        except TracingUnavailable as exc:
            raise ConfigError(str(exc)) from None


def _tenants_load(config: RouterConfig) -> None:
    """``--tenants-file`` parses; ``--tenant-header`` names tenants of one."""
    admission = config.admission
    if admission.tenants_file is not None:
        try:
            load_tenants(admission.tenants_file)
        except TenantsFileError as exc:
            raise ConfigError(str(exc)) from None
    elif admission.tenant_header is not None:
        raise ConfigError("--tenant-header names tenants of a --tenants-file: give one")


def _files_load(config: RouterConfig) -> None:
    _tokenizer_loads(config)
    _tracing_loads(config)
    _tenants_load(config)


def parse_config(argv: Sequence[str] | None = None) -> RouterConfig:
    """The config ``argv`` describes, its files checked; on a bad setting, exit 2 with the
    message on stderr."""
    return parse_settings(argv, check=_files_load)


def main(argv: Sequence[str] | None = None) -> None:
    from .discovery import NoCredentials
    from .fleet import StartupTimeout
    from .http import BindError
    from .server import run_router, wait_for_signal
    from .workers import WorkersKeepDying, supervise

    argv = sys.argv[1:] if argv is None else list(argv)
    config = parse_config(argv)
    configure_logging(config.log_level, config.log_dir, config.log_format)
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
        except BindError as exc:
            _exit_bad_setting(exc)
        return
    failure = ""
    try:
        trio.run(lambda: supervise(config, argv, wait_for_signal))
    except* BindError as group:
        _exit_bad_setting(_leaves(group)[0])
    except* WorkersKeepDying as group:
        failure = "; ".join(str(exc) for exc in _leaves(group))
    if failure:
        logging.getLogger("trio_pdrouter.supervisor").error("%s", failure)
        sys.exit(1)


def _exit_bad_setting(exc: BaseException) -> None:
    """Exit 2 (a setting the router cannot use, as for a bad flag) with one line naming it."""
    print(f"trio-pdrouter: {exc}", file=sys.stderr)
    sys.exit(2)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    return [
        leaf
        for exc in group.exceptions
        for leaf in (_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    ]
