"""What a module imports, read with ``ast`` (nothing is imported): for the layering tests."""

from __future__ import annotations

import ast
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """``<root>/trio_pdrouter/serve/proxy.py`` -> ``trio_pdrouter.serve.proxy``; a package is
    its ``__init__``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_of(package: Path) -> list[Path]:
    paths = sorted(package.rglob("*.py"))
    assert paths, package
    return paths


def imported_modules(path: Path, root: Path) -> set[str]:
    """The absolute name of every module ``path`` imports, relative imports resolved. An
    imported name that is a module of the tree (``from . import errors``) counts as that
    module alone; any other imported name counts as the module it comes from. Every import counts,
    inside a function or under ``TYPE_CHECKING`` too."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # ``from .x`` is in ``package``, ``from ..x`` one level up
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                assert node.module is not None
                module = node.module
            for alias in node.names:
                candidate = f"{module}.{alias.name}"
                found.add(candidate if _is_module(candidate, root) else module)
    return found


def _is_module(name: str, root: Path) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()
