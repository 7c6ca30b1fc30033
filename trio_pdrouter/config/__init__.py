"""Every setting of the router, as frozen values valid by construction.

Each field a command-line flag sets declares that flag once, with its default, help and check
(:mod:`.flags` has the rules); :class:`RouterConfig` holds a section per subsystem, in the order
of ``--help``. Building any settings class, ``attrs.evolve`` included, validates it and raises
:class:`ConfigError` with a message fit for users; :func:`parse_config` turns that into
argparse's exit 2. vllm-router's flags for what the router does not do parse too, and are
refused by name (:mod:`.refused`).

Contract: settings are values, never runtime objects. This package imports only
:mod:`trio_pdrouter.endpoints` (the words ``Endpoint`` and ``Role``): whatever is built from
settings is built by the composition root (:mod:`trio_pdrouter.assemble`) or by the subsystem
that owns it, and a check that needs the runtime (loading ``--kv-tokenizer-path``) is handed in
by the command line.
"""

from __future__ import annotations

from .cluster import ClusterSettings
from .command_line import build_parser, parse_config, shown_default
from .discovery import DiscoverySettings, Selector
from .effective import REDACTED, effective
from .flags import ConfigError
from .kv_events import KvEventSettings
from .listening import ServerSettings, Timeouts
from .policies import LOAD_METRICS, POLICY_NAMES, PolicySettings
from .resilience import AdmissionSettings, BreakerSettings, HealthSettings, RetrySettings
from .router import RouterConfig
from .sizes import byte_size, show_size

__all__ = [
    "LOAD_METRICS",
    "POLICY_NAMES",
    "REDACTED",
    "AdmissionSettings",
    "BreakerSettings",
    "ClusterSettings",
    "ConfigError",
    "DiscoverySettings",
    "HealthSettings",
    "KvEventSettings",
    "PolicySettings",
    "RetrySettings",
    "RouterConfig",
    "Selector",
    "ServerSettings",
    "Timeouts",
    "build_parser",
    "byte_size",
    "effective",
    "parse_config",
    "show_size",
    "shown_default",
]
