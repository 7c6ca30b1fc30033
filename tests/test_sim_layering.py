"""The router and the simulator are separate packages: neither imports the other.

Only the demo (``demo/``), the tests and the benchmarks compose them. Every module is parsed with
``ast``, so an import anywhere counts (inside a function or under ``TYPE_CHECKING`` too).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROUTER = REPO / "trio_pdrouter"
SIM = REPO / "trio_pdrouter_sim"


def module_name(path: Path) -> str:
    """``trio_pdrouter_sim/app.py`` -> ``trio_pdrouter_sim.app``; a package is its ``__init__``."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    """The absolute name of every module ``path`` imports (relative imports resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # ``from .x`` is in ``package``, ``from ..x`` one level up
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                found.add(".".join([*base, *([node.module] if node.module else [])]))
            else:
                assert node.module is not None
                found.add(node.module)
    return found


def top_level(modules: set[str]) -> set[str]:
    return {module.split(".")[0] for module in modules}


def modules_of(package: Path) -> list[Path]:
    paths = sorted(package.rglob("*.py"))
    assert paths, package
    return paths


@pytest.mark.parametrize("path", modules_of(SIM), ids=module_name)
def test_the_simulator_imports_nothing_from_the_router(path: Path) -> None:
    assert not top_level(imported_modules(path)) & {"trio_pdrouter", "demo"}


@pytest.mark.parametrize("path", modules_of(ROUTER), ids=module_name)
def test_the_router_imports_nothing_from_the_simulator(path: Path) -> None:
    assert not top_level(imported_modules(path)) & {"trio_pdrouter_sim", "demo"}


def test_the_check_sees_imports() -> None:
    # The demo composes both, and relative imports resolve to their package.
    assert {"trio_pdrouter", "trio_pdrouter_sim"} <= top_level(
        imported_modules(REPO / "demo" / "run.py")
    )
    assert "trio_pdrouter_sim.config" in imported_modules(SIM / "cli.py")
    assert "trio_pdrouter.config" in imported_modules(ROUTER / "cli.py")
    policies = imported_modules(ROUTER / "policies" / "__init__.py")
    assert {"trio_pdrouter.endpoints", "trio_pdrouter.policies.cache_aware"} <= policies
