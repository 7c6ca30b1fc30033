"""The router's subpackages stand in a declared order, and no import reaches up it.

:data:`LAYERS` lists the units of ``trio_pdrouter`` from the bottom up: a subpackage, or a module
at the top of the package. A module may import its own unit and the units below it, nothing
above; the package root (``trio_pdrouter/__init__.py``, the version) is below everything. No two
modules import each other, directly or round a longer cycle. Every import counts, inside a
function or under ``TYPE_CHECKING`` too (see :func:`imported_modules`), and each failure names
the importing module and what it imports.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.architecture.imports import imported_modules, module_name, modules_of

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "trio_pdrouter"

#: Bottom to top. What each unit is, and why it sits where it does, its face's docstring says.
LAYERS = (
    "transport",  # HTTP/1.1 pools under httpx; knows nothing of the router
    "endpoints",  # Endpoint and Role: the words every layer above uses
    "config",  # every setting, valid by construction; imports no runtime module
    "machine",  # --workers: the shared-memory table, lock and rings
    "http",  # both HTTP sides: ASGI shapes, errors, SSE, headers, the upstream client
    "ledger",  # load held by leases, request cost, the machine's and the replicas' loads
    "tenants",  # the tenants file, each tenant's in-flight, queued and served numbers
    "observe",  # metrics, the access record, log files
    "kv",  # vLLM's KV events: wire, feed, index, forecast, subscriber
    "routing",  # choose and charge; the policies; prompt tokens
    "fleet",  # the servers, their health, breakers, engine truth, served models
    "discovery",  # Kubernetes pods -> servers, through the fleet
    "serve",  # one request's life: proxy, legs, relay, KV ownership, admission
    "app",  # the ASGI app: inference routes, admin routes
    "collector",  # the garbage collector of a serving process
    "assemble",  # the composition root: settings -> a wired RouterApp
    "server",  # running it under hypercorn, with its background work
    "workers",  # --workers N: supervisor and worker processes
    "cli",  # the command line
    "__main__",
)


def unit_of(module: str) -> str | None:
    """``trio_pdrouter.serve.proxy`` -> ``serve``; the package root -> None."""
    parts = module.split(".")
    assert parts[0] == PACKAGE, module
    return parts[1] if len(parts) > 1 else None


def upward_imports(root: Path) -> list[str]:
    """Every import of a module under ``root`` (a copy of the package) that reaches above the
    importer's unit, or into a unit :data:`LAYERS` does not name."""
    found = []
    for path in modules_of(root / PACKAGE):
        name = module_name(path, root)
        own = unit_of(name)
        level = -1 if own is None else LAYERS.index(own) if own in LAYERS else None
        if level is None:
            found.append(f"{name}: its unit {own!r} is not in LAYERS")
            continue
        for target in sorted(imported_modules(path, root)):
            if target.split(".")[0] != PACKAGE:
                continue
            unit = unit_of(target)
            if unit is None or unit == own:
                continue
            if unit not in LAYERS:
                found.append(f"{name} imports {target}: {unit!r} is not in LAYERS")
            elif LAYERS.index(unit) > level:
                found.append(f"{name} ({own}) imports {target} ({unit}), a layer above it")
    return found


def cycles(root: Path) -> list[list[str]]:
    """The import cycles among the modules under ``root`` (each strongly connected set of two or
    more modules, or a module importing itself), by Tarjan's algorithm."""
    paths = modules_of(root / PACKAGE)
    names = {module_name(p, root) for p in paths}
    graph = {
        module_name(p, root): sorted(
            t for t in _modules_only(imported_modules(p, root), names) if t != module_name(p, root)
        )
        for p in paths
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def _modules_only(targets: Iterable[str], names: set[str]) -> set[str]:
    """Imports as modules of the package: ``from .x import Name`` counts as ``x``; a name that
    is a module (``from . import errors``) was resolved to it by :func:`imported_modules`."""
    return {t for t in targets if t in names}


def test_no_module_imports_a_layer_above_its_own() -> None:
    assert upward_imports(REPO) == []


def test_no_import_cycles() -> None:
    assert cycles(REPO) == []


def test_every_unit_in_layers_exists() -> None:
    package = REPO / PACKAGE
    for unit in LAYERS:
        assert (package / unit).is_dir() or (package / f"{unit}.py").is_file(), unit


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(REPO / PACKAGE, tmp_path / PACKAGE)
    return tmp_path


def test_an_upward_import_is_named(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    ledger = root / PACKAGE / "ledger" / "load.py"
    ledger.write_text(ledger.read_text() + "\nfrom ..serve.proxy import Proxy  # noqa\n")
    assert upward_imports(root) == [
        "trio_pdrouter.ledger.load (ledger) imports trio_pdrouter.serve.proxy (serve),"
        " a layer above it"
    ]


def test_an_import_cycle_is_named(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    load = root / PACKAGE / "ledger" / "load.py"
    load.write_text(load.read_text() + "\ndef later() -> None:\n    from . import machine\n")
    assert cycles(root) == [["trio_pdrouter.ledger.load", "trio_pdrouter.ledger.machine"]]


@pytest.mark.parametrize("unit", [u for u in LAYERS if (REPO / PACKAGE / u).is_dir()])
def test_each_subpackage_has_a_face(unit: str) -> None:
    """A subpackage's ``__init__`` says what it does and names its public face."""
    import importlib

    face = importlib.import_module(f"{PACKAGE}.{unit}")
    assert (face.__doc__ or "").strip(), f"{unit}/__init__.py has no docstring"
    assert getattr(face, "__all__", None), f"{unit}/__init__.py has no __all__"
    for name in face.__all__:
        assert hasattr(face, name), f"{unit}.__all__ names {name!r}, which it lacks"
