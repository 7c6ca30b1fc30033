"""One worker process of ``--workers N``: the router over its row of the machine ledger.

The supervisor starts it as ``python -m trio_pdrouter.workers.worker ROW SHM LOCK FD METRICS_FD
ARGV...``: its row in the machine table, the table's shared-memory name and lock file, the
listening sockets it inherited (``METRICS_FD`` -1 without ``--prometheus-port``), and the
router's own command line. Once it listens it writes ``ready`` on stdout
(the supervisor's only channel from it; logs go to the inherited stderr) and serves until
SIGTERM/SIGINT, with the single-process router's graceful rules. Its stdin is a pipe only the
supervisor writes to: end of file there means the supervisor is gone (even SIGKILLed), and the
worker stops as on SIGTERM, so no worker outlives its supervisor. (Not ``PR_SET_PDEATHSIG``: it
fires when the parent *thread* exits, and trio starts processes from a cached thread that ends
after 10 s idle, which stopped every worker about 10 s after its start.)
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence

import trio

from ..config import parse_config
from ..ledger import MachineLedger
from ..machine import MachineTable
from ..observe import configure_logging

READY = b"ready\n"
log = logging.getLogger("trio_pdrouter")


#: The command of worker ``row`` given the table, the two fds and the router's argv.
WorkerCommand = Callable[[int, MachineTable, int, int | None, Sequence[str]], list[str]]


def worker_command(
    row: int, table: MachineTable, fd: int, metrics_fd: int | None, argv: Sequence[str]
) -> list[str]:
    """The command line the supervisor runs for worker ``row``."""
    return [
        sys.executable,
        "-m",
        "trio_pdrouter.workers.worker",
        str(row),
        table.name,
        table.lock_path,
        str(fd),
        str(-1 if metrics_fd is None else metrics_fd),
        *argv,
    ]


async def _supervisor_gone() -> None:
    """Return once this worker's stdin (the supervisor's pipe) reads end of file."""
    async with trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())) as pipe:
        while await pipe.receive_some():
            pass
    log.warning("supervisor gone: shutting down")


async def _until_stopped(wait_for_signal: Callable[[], Awaitable[None]]) -> None:
    """Return on SIGTERM/SIGINT or when the supervisor is gone, whichever comes first."""
    async with trio.open_nursery() as nursery:

        async def then_stop(trigger: Callable[[], Awaitable[None]]) -> None:
            await trigger()
            nursery.cancel_scope.cancel()

        nursery.start_soon(then_stop, wait_for_signal)
        nursery.start_soon(then_stop, _supervisor_gone)


def main(args: Sequence[str]) -> None:
    from ..server import run_router, wait_for_signal

    row, name, lock_path, fd, metrics_fd = int(args[0]), args[1], args[2], *map(int, args[3:5])
    config = parse_config(args[5:])
    configure_logging(config.log_level, config.log_dir, config.log_format)
    log.info("worker=%d pid=%d starting", row, os.getpid())
    table = MachineTable.attach(name, lock_path)

    async def serve() -> None:
        ledger = MachineLedger(table, row)
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: run_router(
                    config,
                    shutdown_trigger=lambda: _until_stopped(wait_for_signal),
                    ledger=ledger,
                    listener=socket.socket(fileno=fd),
                    metrics_fd=None if metrics_fd < 0 else metrics_fd,
                    settle_heap=True,
                    task_status=task_status,
                )
            )
            os.write(sys.stdout.fileno(), READY)

    try:
        trio.run(serve)
    finally:
        table.close()


if __name__ == "__main__":
    main(sys.argv[1:])
