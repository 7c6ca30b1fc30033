"""``--workers N``: the supervisor that owns the port, the machine table and N worker processes.

Rules of this module:

* The supervisor binds the listening socket(s) before any worker starts and keeps them open
  for its whole life: one socket every worker accepts from (``--worker-sockets shared``), or one
  ``SO_REUSEPORT`` socket per worker (``reuseport``). A restarted worker inherits the same socket,
  so the port never closes and connections queued while a worker restarts wait for it.
* It creates the :class:`~trio_pdrouter.machine.table.MachineTable` (one row per worker) and
  destroys it at exit. A worker's row is zeroed when the worker exits, before its replacement
  starts: a crash leaves no phantom charge.
* A worker that exits while the supervisor is not stopping is restarted at once. A worker that
  dies before it is ready :data:`START_FAILURES` times in a row means the configuration cannot
  run: the supervisor stops the others and exits 1 with a message naming the worker.
* With KV event sources (``--kv-event-source``, ``--pd-kv-events``) it owns the machine's one
  subscription per source and fans the frames out to the workers over ``ipc://`` endpoints in
  its temporary directory, the one holding the machine table's lock file
  (:mod:`~trio_pdrouter.kv.fanout`); it is bound before any worker starts.
* SIGTERM/SIGINT: every worker gets SIGTERM and follows the single-process graceful rules
  (``--graceful-timeout-secs``); a worker still running a few seconds past that is killed.
  The supervisor exits 0 once all have exited.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import trio

from ..config import RouterConfig
from ..http import listening_sockets
from ..kv import KvFanout, sources_for
from ..machine import DEFAULT_LOG_ENTRIES, DEFAULT_SLOTS, MachineTable
from ..server import metrics_socket, starting_line
from ..tenants import MAX_TENANTS
from .worker import READY, WorkerCommand, worker_command

log = logging.getLogger("trio_pdrouter.supervisor")

#: Deaths before ready, in a row, after which a worker is given up on.
START_FAILURES = 3
#: Seconds past the graceful timeout after which a worker that has not exited is killed.
KILL_AFTER = 5.0


class WorkersKeepDying(Exception):
    """A worker died at start :data:`START_FAILURES` times in a row."""


class Supervisor:
    """Runs N workers over one machine table (see the module doc)."""

    def __init__(
        self,
        config: RouterConfig,
        argv: Sequence[str],
        table: MachineTable,
        command: WorkerCommand = worker_command,
    ) -> None:
        self._config = config
        self._argv = list(argv)
        self._table = table
        self._command = command
        s = config.server
        self._sockets = listening_sockets(
            s.host, s.port, s.backlog, s.workers, reuseport=s.worker_sockets == "reuseport"
        )
        # One socket, any worker answers (each with its own counters: see docs/monitoring.md).
        self._metrics_socket = metrics_socket(config, s.backlog)
        self._stopping = False
        self._procs: dict[int, trio.Process] = {}
        self.url = _url(self._sockets[0])

    async def run(
        self,
        shutdown_trigger: Callable[[], Awaitable[None]],
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until ``shutdown_trigger`` returns; report the URL once every worker is ready.

        Raises :class:`WorkersKeepDying` when a worker cannot start.
        """
        n = self._config.server.workers
        try:
            async with trio.open_nursery() as nursery:
                ready: set[int] = set()
                all_ready = trio.Event()

                def on_ready(row: int) -> None:
                    ready.add(row)
                    if len(ready) == n:
                        all_ready.set()

                for row in range(n):  # all at once
                    nursery.start_soon(self._keep_running, row, on_ready)
                await all_ready.wait()
                metrics_url = None if self._metrics_socket is None else _url(self._metrics_socket)
                log.info("%s", starting_line(self._config, self.url, metrics_url))
                task_status.started(self.url)
                await shutdown_trigger()
                self._stop(nursery)
        finally:
            for sock in {*self._sockets, self._metrics_socket}:
                if sock is not None:
                    sock.close()

    def pid(self, row: int) -> int:
        """The process id of worker ``row`` now (tests kill workers by it)."""
        return self._procs[row].pid

    def _stop(self, nursery: trio.Nursery) -> None:
        self._stopping = True
        for proc in self._procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        # The workers stop accepting as they drain; with the supervisor's copies closed too, the
        # port is closed and a new connection is refused, as by a single process, not queued.
        for sock in self._sockets:  # /metrics stays open while the workers drain
            sock.close()
        nursery.cancel_scope.deadline = (
            trio.current_time() + self._config.server.graceful_timeout + KILL_AFTER
        )

    async def _keep_running(self, row: int, on_ready: Callable[[int], None]) -> None:
        failures = 0
        while not self._stopping:
            ready = await self._run_once(row, lambda: on_ready(row))
            if self._stopping:
                return
            failures = 0 if ready else failures + 1
            if failures >= START_FAILURES:
                self._stopping = True  # one give-up: a row failing in the same step returns
                raise WorkersKeepDying(
                    f"worker {row} exited before it was ready {failures} times in a row;"
                    " its log is above"
                )
            log.warning("worker=%d exited restarting=true", row)
            self._table.count_restart()

    async def _run_once(self, row: int, on_ready: Callable[[], None]) -> bool:
        """Run worker ``row`` until it exits; True if it became ready."""
        self._table.zero_row(row)
        fd = self._sockets[row].fileno()
        metrics_fd = None if self._metrics_socket is None else self._metrics_socket.fileno()
        proc = await trio.lowlevel.open_process(
            self._command(row, self._table, fd, metrics_fd, self._argv),
            # Its stdin: a pipe only this process holds, whose end tells the worker it is gone.
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(fd,) if metrics_fd is None else (fd, metrics_fd),
        )
        self._procs[row] = proc
        ready = False
        try:
            assert proc.stdout is not None
            line = b""
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some()
                if not chunk:
                    break
                line += chunk
            if line == READY:
                ready = True
                log.info("worker=%d pid=%d ready", row, proc.pid)
                on_ready()
            code = await proc.wait()
        finally:
            if proc.returncode is None:  # cancelled: past the grace period, or an error
                proc.kill()
                with trio.CancelScope(shield=True):
                    await proc.wait()
            self._table.zero_row(row)
        log.log(
            logging.INFO if self._stopping else logging.WARNING,
            "worker=%d pid=%d exit=%s",
            row,
            proc.pid,
            code,
        )
        return ready


def table_size(config: RouterConfig) -> tuple[int, int]:
    """(slots, log entries) of the machine table ``config``'s workers need.

    A server takes a slot per endpoint and one for its URL's health verdict; servers removed but
    still draining keep theirs, so there is room for every server twice. The log's snapshot
    holds at most every runtime server and every command-line server removed: twice that leaves
    as much room for changes again. With a tenants file, each tenant takes a slot, kept for the
    machine's life: room for twice the most a file may name, for the names reloads bring.
    """
    static = sum(len(urls) for urls in config.servers().values())
    servers = static + config.max_runtime_servers
    slots = 2 * servers * (config.dp_size + 1) + 16
    if config.admission.tenants_file is not None:
        slots += 2 * (MAX_TENANTS + 1)  # every tenant's slot, twice over for reloads
    entries = 2 * (2 * static + config.max_runtime_servers) + 16
    return max(DEFAULT_SLOTS, slots), max(DEFAULT_LOG_ENTRIES, entries)


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def supervise(
    config: RouterConfig,
    argv: Sequence[str],
    shutdown_trigger: Callable[[], Awaitable[None]],
    *,
    command: WorkerCommand = worker_command,
    task_status: trio.TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Create the machine table (and the KV-event fan-out), run the workers until
    ``shutdown_trigger`` returns, clean up."""
    with tempfile.TemporaryDirectory(prefix="trio-pdrouter-") as tmp:
        slots, entries = table_size(config)
        table = MachineTable.create(
            config.server.workers,
            str(Path(tmp) / "ledger.lock"),
            slots=slots,
            log_entries=entries,
        )
        try:
            supervisor = Supervisor(config, argv, table, command)
            async with trio.open_nursery() as nursery:
                if config.kv_events.any:
                    every = [ep for eps in config.endpoints().values() for ep in eps]
                    fanout = KvFanout(sources_for(config.kv_events, every), tmp)
                    await nursery.start(fanout.run)

                async def serve(*, task_status: trio.TaskStatus[str]) -> None:
                    await supervisor.run(shutdown_trigger, task_status=task_status)
                    nursery.cancel_scope.cancel()  # the workers are gone: so is the fan-out

                await nursery.start(serve)
                task_status.started(supervisor)
        finally:
            table.destroy()
