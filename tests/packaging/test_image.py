"""The container image, built offline as these machines must (docs/install.md): a base made from
Debian's packages by mmdebstrap, the router's wheels built on the host, ``podman build
--isolation=chroot``. ``podman run`` is not available here, so the tests run the image's own
filesystem (``podman image mount`` + ``chroot``), as the image's user: ``--help``, the health
check, and the router serving a PD request against simulators on the host."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import re
import shutil
import tarfile
import uuid
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import trio

from tests.packaging.conftest import ROOT, Dist, run
from tests.packaging.launch import ROUTER_LISTENING, check_pd_request, start
from trio_pdrouter_sim import SimConfig
from trio_pdrouter_sim.server import SimServer

#: Where the builder stage finds the host's wheels, inside the build context.
OFFLINE_PIP_OPTIONS = "--no-index --find-links=/src/wheelhouse"


def makefile_setting(name: str) -> str:
    """A variable of the Makefile, so that the test builds the base ``make base-image`` builds."""
    (value,) = re.findall(rf"^{name} [?:]?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    return value


@contextlib.contextmanager
def machine_lock(name: str) -> Iterator[None]:
    """One holder at a time on this machine (several checkouts may test at once)."""
    with open(f"/var/tmp/{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def debian_base(workdir: pathlib.Path) -> str:
    """The base image, made from Debian's packages the first time on this machine and then kept
    in podman's store (``podman rmi`` it to make it again)."""
    tag = makefile_setting("DEBIAN_BASE")
    with machine_lock("trio-pdrouter-base"):
        exists = run(["podman", "image", "ls", "--quiet", tag]).stdout.strip()
        if not exists:
            tarball = workdir / "base.tar"
            packages = makefile_setting("DEBIAN_PACKAGES")
            debian = ["--variant=minbase", f"--include={packages}", "bookworm", str(tarball)]
            # In a session of its own: on a failure mmdebstrap hangs up its whole process group.
            run(["mmdebstrap", *debian], start_new_session=True)
            run(["podman", "import", str(tarball), tag])
            tarball.unlink()
    return tag


@attrs.frozen
class Image:
    tag: str
    config: dict[str, Any]
    #: The HEALTHCHECK's command (``podman image inspect`` keeps it beside the config).
    healthcheck: list[str]
    rootfs: pathlib.Path


@pytest.fixture(scope="module")
def image(
    dist: Dist, wheelhouse: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Image]:
    """The image built from the sdist's source with the host's wheels, its filesystem mounted."""
    workdir = tmp_path_factory.mktemp("image")
    base = debian_base(workdir)
    context = workdir / "context"
    with tarfile.open(dist.sdist) as sdist:
        sdist.extractall(workdir, filter="data")
    (workdir / dist.sdist.name.removesuffix(".tar.gz")).rename(context)
    shutil.copytree(wheelhouse, context / "wheelhouse")
    tag = f"localhost/trio-pdrouter-test:{uuid.uuid4().hex[:12]}"
    build = [
        "podman", "build", "--isolation=chroot", "--format", "docker", "--layers=false",
        "--build-arg", f"BASE={base}", "--build-arg", f"PIP_OPTIONS={OFFLINE_PIP_OPTIONS}",
        "--tag", tag, "--file", str(ROOT / "Containerfile"), str(context),
    ]  # fmt: skip
    run(build)
    try:
        (inspected,) = json.loads(run(["podman", "image", "inspect", tag]).stdout)
        rootfs = pathlib.Path(run(["podman", "image", "mount", tag]).stdout.strip())
        try:
            yield Image(tag, inspected["Config"], inspected["Healthcheck"]["Test"], rootfs)
        finally:
            run(["podman", "image", "unmount", tag])
    finally:
        run(["podman", "rmi", "--force", tag])


def in_image(image: Image, *command: str, **env: str) -> list[str]:
    """``command`` run in the image's filesystem as the image's user, with the image's
    environment (plus ``env``)."""
    variables = [*image.config["Env"], *(f"{k}={v}" for k, v in env.items())]
    return [
        "chroot", f"--userspec={image.config['User']}", str(image.rootfs),
        "/usr/bin/env", "-i", *variables, *command,
    ]  # fmt: skip


def test_the_image_runs_the_router_as_a_user_with_a_health_check(image: Image) -> None:
    config = image.config
    uid, gid = config["User"].split(":")
    assert int(uid) != 0 and int(gid) != 0
    assert config["Entrypoint"][0] == "trio-pdrouter"
    assert "30000/tcp" in config["ExposedPorts"]
    assert config["Labels"]["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert image.healthcheck[0] == "CMD" and "TRIO_PDROUTER_HEALTH_URL" in image.healthcheck[-1]
    assert "TRIO_PDROUTER_HEALTH_URL=http://127.0.0.1:30000/health" in config["Env"]


def test_the_image_answers_help_and_version(image: Image) -> None:
    done = run(in_image(image, *image.config["Entrypoint"], "--help"))
    assert done.stdout.startswith("usage: trio-pdrouter")
    done = run(in_image(image, "trio-pdrouter", "--version"))
    assert done.stdout.startswith("trio-pdrouter ")
    # the wheels were installed, not the source: nothing of the builder stage is left
    assert not (image.rootfs / "src").exists() and not (image.rootfs / "tmp" / "wheels").exists()


async def test_the_router_in_the_image_serves_a_pd_request_and_passes_its_health_check(
    image: Image,
) -> None:
    async with trio.open_nursery() as nursery:
        prefill = SimServer(SimConfig.fast(port=0, role="prefill"))
        decode = SimServer(SimConfig.fast(port=0, role="decode"))
        for sim in (prefill, decode):
            await nursery.start(sim.run)
        command = [
            *image.config["Entrypoint"],
            "--host", "127.0.0.1", "--port", "0", "--log-level", "info",
            "--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url,
        ]  # fmt: skip
        router = await start(
            nursery,
            in_image(image, *command),
            ROUTER_LISTENING,
            stream="stderr",
            cwd="/",
            env=dict(os.environ),
        )
        await check_pd_request(router.url, prefill.url, decode.url)
        health = image.healthcheck[1:]
        checked = await trio.run_process(
            in_image(image, *health, TRIO_PDROUTER_HEALTH_URL=router.url + "/health"),
            check=False,
            capture_stderr=True,
        )
        assert checked.returncode == 0, checked.stderr
        # and the check fails where nothing answers
        wrong = router.url.rsplit(":", 1)[0] + ":1/health"
        checked = await trio.run_process(
            in_image(image, *health, TRIO_PDROUTER_HEALTH_URL=wrong),
            check=False,
            capture_stderr=True,
        )
        assert checked.returncode != 0
        nursery.cancel_scope.cancel()
