"""The distributions, built once per session: the sdist and the wheel (``python -m build``, as
``make dist`` runs it), and a wheelhouse of every wheel the router needs (its dependencies from
the package index or pip's cache), from which a clean venv or an image installs offline."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tomllib
from typing import Any

import attrs
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@attrs.frozen
class Dist:
    wheel: pathlib.Path
    sdist: pathlib.Path
    #: What the build printed (setuptools' warnings among it).
    log: str


def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``command``, which must succeed; its output goes into the failure message."""
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{command}: {done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    out = tmp_path_factory.mktemp("dist")
    done = run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)])
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return Dist(wheel, sdist, done.stdout + done.stderr)


@pytest.fixture(scope="session")
def wheelhouse(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The router's wheel, its dependencies' wheels, and its build requirements' (for a builder
    that makes the wheel again from the source, offline): what ``make wheelhouse`` gathers."""
    house = tmp_path_factory.mktemp("wheelhouse")
    pip = [sys.executable, "-m", "pip", "--quiet"]
    run([*pip, "wheel", "--wheel-dir", str(house), str(dist.wheel)])
    build_requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]
    run([*pip, "download", "--no-deps", "--dest", str(house), *build_requires["requires"]])
    return house
