"""Processes of a benchmark: simulators, routers and load generators, each its own OS process.

Every process is started in its own process group and registered with a :class:`ProcessSet`,
whose ``close()`` (run from ``finally``) terminates each group, then kills what is left. On
Linux the children also get SIGTERM from the kernel if the benchmark itself dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import httpx
import orjson
import psutil  # type: ignore[import-untyped]

ROOT = Path(__file__).resolve().parent.parent
VLLM_ROUTER_VENV = ROOT / ".venv-bench-vllm-router"
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def find_vllm_router() -> str | None:
    """The ``vllm-router`` program: ``$VLLM_ROUTER``, the bench venv's, or one on ``PATH``."""
    candidates = [os.environ.get("VLLM_ROUTER"), str(VLLM_ROUTER_VENV / "bin" / "vllm-router")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("vllm-router")


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the benchmark dies, so does the child.
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Service:
    """One started process: its ``url`` (if it serves HTTP), CPU and memory counters."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log: Path, url: str) -> None:
        self.name = name
        self.popen = popen
        self.log = log
        self.url = url
        self.ps = psutil.Process(popen.pid)

    def _tree(self) -> list[psutil.Process]:
        try:
            return [self.ps, *self.ps.children(recursive=True)]
        except psutil.Error:
            return []

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the process and its children so far."""
        total = 0.0
        for proc in self._tree():
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                total += times.user + times.system
        return total

    def rss(self) -> int:
        """Resident set size now, in bytes (process and children)."""
        total = 0
        for proc in self._tree():
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
        return total

    def peak_rss(self) -> int:
        """The kernel's high-water mark of the resident set (``VmHWM``), in bytes."""
        try:
            for line in Path(f"/proc/{self.ps.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return self.rss()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ProcessSet:
    """Starts processes and guarantees they are gone after :meth:`close`."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.services: list[Service] = []
        self._logs: list[IO[bytes]] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        url: str = "",
        stdout: int | None = None,
        cwd: Path = ROOT,
    ) -> Service:
        """Start ``argv``; its output goes to ``<log_dir>/<name>.log`` unless ``stdout`` says
        otherwise (``subprocess.PIPE`` for a load generator's protocol lines); it runs in ``cwd``,
        so ``python -m`` imports the packages of that checkout."""
        log_path = self.log_dir / f"{name}.log"
        log = log_path.open("wb")
        self._logs.append(log)
        popen = subprocess.Popen(
            list(argv),
            stdout=log if stdout is None else stdout,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            cwd=cwd,
        )
        service = Service(name, popen, log_path, url)
        self.services.append(service)
        return service

    def stop(self, service: Service, grace: float = 5.0) -> None:
        """Terminate ``service``'s process group; kill it if it outlives ``grace`` seconds."""
        try:
            children = service.ps.children(recursive=True)
        except psutil.Error:
            children = []
        if service.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(service.popen.pid, signal.SIGTERM)
            try:
                service.popen.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(service.popen.pid, signal.SIGKILL)
                service.popen.wait(grace)
        # Children that outlived their parent (psutil checks the pid was not reused).
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
        if service in self.services:
            self.services.remove(service)

    def close(self) -> None:
        """Stop every process still registered (newest first), then close the log files."""
        for service in reversed(list(self.services)):
            self.stop(service, grace=3.0)
        for log in self._logs:
            log.close()
        self._logs.clear()


def wait_ready(service: Service, path: str = "/health", timeout: float = 60.0) -> None:
    """Poll ``GET url+path`` until it answers 200, the process exits, or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if not service.alive():
                raise RuntimeError(f"{service.name} exited:\n{service.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(service.url + path).status_code == 200:
                    return
            time.sleep(0.1)
    raise RuntimeError(f"{service.name} not ready after {timeout:.0f} s:\n{service.log_tail()}")


def start_sim(procs: ProcessSet, name: str, *flags: str) -> Service:
    """A simulator (``python -m trio_pdrouter_sim``) on a free port, ready."""
    port = free_port()
    argv = [sys.executable, "-m", "trio_pdrouter_sim", "--port", str(port), *flags]
    service = procs.start(name, argv, url=f"http://127.0.0.1:{port}")
    wait_ready(service)
    return service


def start_router(
    procs: ProcessSet, name: str, kind: str, flags: Sequence[str], cwd: Path = ROOT
) -> Service:
    """A router on a free port, ready: ``kind`` ``ours`` (``python -m trio_pdrouter`` of the
    checkout in ``cwd``) or ``vllm`` (the ``vllm-router`` program; its Prometheus listener gets
    a free port too)."""
    port = free_port()
    common = ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    if kind == "ours":
        argv = [sys.executable, "-m", "trio_pdrouter", *common, *flags]
    else:
        program = find_vllm_router()
        if program is None:
            raise RuntimeError("vllm-router is not installed")
        argv = [program, *common, "--prometheus-port", str(free_port()), *flags]
    service = procs.start(name, argv, url=f"http://127.0.0.1:{port}", cwd=cwd)
    # Ours answers /health as soon as it listens, before its servers are healthy.
    wait_ready(service, "/readiness" if kind == "ours" else "/health", timeout=90.0)
    return service


class LoadRun:
    """One or more load generator processes, run to completion while the router is watched.

    The router's CPU seconds are read when the first generator prints ``window-start`` and
    ``window-end``, so they cover exactly the measured window.
    """

    def __init__(
        self,
        procs: ProcessSet,
        name: str,
        flags: Sequence[str],
        *,
        processes: int = 1,
        concurrency: int,
        watch: Service | None,
    ) -> None:
        self.procs = procs
        self.watch = watch
        self.outs: list[Path] = []
        self.gens: list[Service] = []
        self.cpu_marks: dict[str, float] = {}
        self.mark_times: dict[str, float] = {}
        self._marks_done = threading.Event()
        shares = [
            concurrency // processes + (i < concurrency % processes) for i in range(processes)
        ]
        for i, share in enumerate(shares):
            out = procs.log_dir / f"{name}-{i}.json"
            out.unlink(missing_ok=True)
            self.outs.append(out)
            argv = [
                sys.executable,
                "-m",
                "benchmarks.loadgen",
                *flags,
                "--concurrency",
                str(share),
                "--seed",
                str(i + 1),
                "--out",
                str(out),
            ]
            self.gens.append(procs.start(f"{name}-{i}", argv, stdout=subprocess.PIPE))
        self._reader = threading.Thread(target=self._read_marks, daemon=True)
        self._reader.start()

    def _read_marks(self) -> None:
        stream = self.gens[0].popen.stdout
        assert stream is not None
        for raw in stream:
            mark = raw.decode(errors="replace").strip()
            if mark in ("window-start", "window-end"):
                self.mark_times[mark] = time.monotonic()
                if self.watch is not None:
                    self.cpu_marks[mark] = self.watch.cpu_seconds()
        self._marks_done.set()

    @property
    def measuring(self) -> bool:
        return "window-start" in self.mark_times and "window-end" not in self.mark_times

    def wait(
        self, timeout: float, tick: Callable[[], None] | None = None, every: float = 0.25
    ) -> dict[str, Any]:
        """Wait for every generator (calling ``tick`` every ``every`` seconds meanwhile) and
        merge their results; ``router_cpu_s`` is the watched router's CPU over the window."""
        deadline = time.monotonic() + timeout
        try:
            while any(g.alive() for g in self.gens):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"load generator still running after {timeout:.0f} s")
                if tick is not None:
                    tick()
                time.sleep(every)
            self._marks_done.wait(5.0)
        finally:
            for gen in self.gens:
                self.procs.stop(gen)
        merged: dict[str, Any] = {
            "ttfb": [],
            "total": [],
            "first_bytes": [],
            "ok": 0,
            "failed": 0,
            "errors": {},
            "events": 0,
            "window_s": 0.0,
            "window_start_s": 0.0,
            "open_streams_peak": 0,
        }
        for gen, out in zip(self.gens, self.outs, strict=True):
            if not out.exists():
                raise RuntimeError(f"{gen.name} wrote no results:\n{gen.log_tail()}")
            part = orjson.loads(out.read_bytes())
            merged["ttfb"] += part["ttfb"]
            merged["total"] += part["total"]
            merged["first_bytes"] += part["first_bytes"]
            for key in ("ok", "failed", "events", "open_streams_peak"):
                merged[key] += part[key]
            gaps = merged.setdefault("gaps", [0] * len(part["gaps"]))
            for i, n in enumerate(part["gaps"]):
                gaps[i] += n
            for kind, n in part["errors"].items():
                merged["errors"][kind] = merged["errors"].get(kind, 0) + n
            merged["window_s"] = max(merged["window_s"], part["window_s"])
            merged["window_start_s"] = max(merged["window_start_s"], part["window_start_s"])
            if "requests" in part:
                merged.setdefault("requests", []).extend(part["requests"])
        merged["window"] = [self.mark_times.get("window-start"), self.mark_times.get("window-end")]
        if "window-start" in self.cpu_marks and "window-end" in self.cpu_marks:
            merged["router_cpu_s"] = self.cpu_marks["window-end"] - self.cpu_marks["window-start"]
        return merged


def wait_sims_idle(client: httpx.Client, sims: Sequence[Service], timeout: float = 30.0) -> None:
    """Poll the simulators' ``/sim/stats`` until nothing runs or waits (streams of a stopped
    load generator take a moment to be aborted)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = 0
        for sim in sims:
            totals = client.get(sim.url + "/sim/stats").json()["totals"]
            busy += int(totals["running"] + totals["waiting"])
        if busy == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"simulators still busy {timeout:.0f} s after the load stopped")
