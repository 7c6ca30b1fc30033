"""The router and the simulator are separate packages: neither imports the other.

Only the demo (``demo/``), the tests and the benchmarks compose them. Every module is parsed with
``ast``, so an import anywhere counts (inside a function or under ``TYPE_CHECKING`` too).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.architecture.imports import imported_modules, module_name, modules_of

REPO = Path(__file__).resolve().parents[2]
ROUTER = REPO / "trio_pdrouter"
SIM = REPO / "trio_pdrouter_sim"


def top_level(modules: set[str]) -> set[str]:
    return {module.split(".")[0] for module in modules}


def name_of(path: Path) -> str:
    return module_name(path, REPO)


@pytest.mark.parametrize("path", modules_of(SIM), ids=name_of)
def test_the_simulator_imports_nothing_from_the_router(path: Path) -> None:
    assert not top_level(imported_modules(path, REPO)) & {"trio_pdrouter", "demo"}


@pytest.mark.parametrize("path", modules_of(ROUTER), ids=name_of)
def test_the_router_imports_nothing_from_the_simulator(path: Path) -> None:
    assert not top_level(imported_modules(path, REPO)) & {"trio_pdrouter_sim", "demo"}


def test_the_check_sees_imports() -> None:
    # The demo composes both, and relative imports resolve to their package.
    assert {"trio_pdrouter", "trio_pdrouter_sim"} <= top_level(
        imported_modules(REPO / "demo" / "run.py", REPO)
    )
    assert "trio_pdrouter_sim.config" in imported_modules(SIM / "cli.py", REPO)
    assert "trio_pdrouter.config" in imported_modules(ROUTER / "cli.py", REPO)
    policies = imported_modules(ROUTER / "routing" / "policies" / "__init__.py", REPO)
    assert {"trio_pdrouter.endpoints", "trio_pdrouter.routing.policies.cache_aware"} <= policies
