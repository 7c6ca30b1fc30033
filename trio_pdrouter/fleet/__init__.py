"""The servers the router sends to: one owner that adds, checks, drains and forgets them.

:class:`Fleet` is the only place a server is added or removed (command line, admin routes,
discovery; with ``--workers N`` through the machine's change log). Around it: health probes
(:class:`HealthBoard`, shared across workers by :class:`MachineVerdicts`), circuit breakers fed
by real outcomes, each server's models, adapters and context length (:class:`ServedModels`),
the engines' own counts beside the ledger (:class:`EngineTruth`), and waiting at start for the
servers to be healthy.

Contract: a server is routable only through the fleet. May import routing and below.
"""

from __future__ import annotations

from .breakers import Breakers
from .engine_truth import EngineLoad, EngineTruth, ScrapeError, endpoint_loads, parse_engine_loads
from .health import HealthBoard, Verdicts
from .served_models import ServedModels, ServerModels
from .servers import API, DuplicateServer, Fleet, FleetFull, MachineServers, Origin, PodRef
from .startup import StartupStatus, StartupTimeout, wait_until_healthy
from .verdicts import PROBER_ROW, MachineVerdicts

__all__ = [
    "API",
    "PROBER_ROW",
    "Breakers",
    "DuplicateServer",
    "EngineLoad",
    "EngineTruth",
    "Fleet",
    "FleetFull",
    "HealthBoard",
    "MachineServers",
    "MachineVerdicts",
    "Origin",
    "PodRef",
    "ScrapeError",
    "ServedModels",
    "ServerModels",
    "StartupStatus",
    "StartupTimeout",
    "Verdicts",
    "endpoint_loads",
    "parse_engine_loads",
    "wait_until_healthy",
]
