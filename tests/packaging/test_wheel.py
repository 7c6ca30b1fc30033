"""The wheel: its metadata and contents, and, installed into a clean venv, the router and the
simulator it carries serving a PD request from a directory outside the source tree."""

from __future__ import annotations

import email.parser
import os
import pathlib
import sys
import tarfile
import zipfile

import pytest
import trio

from tests.packaging.conftest import ROOT, Dist, run
from tests.packaging.launch import ROUTER_LISTENING, SIM_LISTENING, check_pd_request, start
from trio_pdrouter import __version__


def test_the_build_gives_no_warning_of_deprecated_metadata(dist: Dist) -> None:
    assert "Deprecat" not in dist.log and "deprecat" not in dist.log, dist.log


def test_the_wheel_carries_both_packages_the_license_and_the_commands(dist: Dist) -> None:
    assert dist.wheel.name == f"trio_pdrouter-{__version__}-py3-none-any.whl"
    with zipfile.ZipFile(dist.wheel) as wheel:
        names = wheel.namelist()
        info = f"trio_pdrouter-{__version__}.dist-info"
        metadata = email.parser.Parser().parsestr(wheel.read(f"{info}/METADATA").decode())
        license_text = wheel.read(f"{info}/licenses/LICENSE").decode()
        entry_points = wheel.read(f"{info}/entry_points.txt").decode()
    assert {name.split("/")[0] for name in names} == {"trio_pdrouter", "trio_pdrouter_sim", info}
    assert {"trio_pdrouter/py.typed", "trio_pdrouter_sim/py.typed"} <= set(names)
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["License-File"] == "LICENSE"
    assert metadata["Version"] == __version__
    assert license_text == (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "trio-pdrouter = trio_pdrouter.cli:main" in entry_points
    assert "trio-pdrouter-sim = trio_pdrouter_sim.cli:main" in entry_points


def test_the_sdist_carries_the_source_and_the_license(dist: Dist) -> None:
    with tarfile.open(dist.sdist) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert {"LICENSE", "README.md", "pyproject.toml", "trio_pdrouter/cli.py"} <= names
    assert "trio_pdrouter_sim/cli.py" in names


@pytest.fixture(scope="module")
def venv(wheelhouse: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A fresh venv with the wheel installed from the wheelhouse alone."""
    where = tmp_path_factory.mktemp("venv") / "venv"
    run([sys.executable, "-m", "venv", str(where)])
    pip = [str(where / "bin" / "python"), "-m", "pip", "--quiet", "--disable-pip-version-check"]
    run([*pip, "install", "--no-index", "--find-links", str(wheelhouse), "trio-pdrouter"])
    return where


def outside_env() -> dict[str, str]:
    """The environment without anything that would point Python at the source tree."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}


def test_the_installed_packages_are_the_venvs_and_report_the_version(
    venv: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    code = "import trio_pdrouter, trio_pdrouter_sim; print(trio_pdrouter.__file__, trio_pdrouter_sim.__file__)"
    done = run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, env=outside_env())
    for path in done.stdout.split():
        assert pathlib.Path(path).is_relative_to(venv / "lib"), path
    done = run([str(venv / "bin" / "trio-pdrouter"), "--version"], cwd=tmp_path, env=outside_env())
    assert done.stdout.strip() == f"trio-pdrouter {__version__}"


async def test_the_installed_router_serves_a_pd_request_through_the_installed_simulator(
    venv: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    bin_ = venv / "bin"
    where = {"cwd": str(tmp_path), "env": outside_env()}
    async with trio.open_nursery() as nursery:
        sims = {}
        for role in ("prefill", "decode"):
            command = [str(bin_ / "trio-pdrouter-sim"), "--host", "127.0.0.1", "--port", "0"]
            command += ["--role", role]
            sims[role] = await start(nursery, command, SIM_LISTENING, stream="stdout", **where)
        command = [
            str(bin_ / "trio-pdrouter"),
            "--host", "127.0.0.1", "--port", "0", "--log-level", "info",
            "--vllm-pd-disaggregation",
            "--prefill", sims["prefill"].url, "--decode", sims["decode"].url,
        ]  # fmt: skip
        router = await start(nursery, command, ROUTER_LISTENING, stream="stderr", **where)
        await check_pd_request(router.url, sims["prefill"].url, sims["decode"].url)
        nursery.cancel_scope.cancel()
