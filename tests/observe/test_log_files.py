"""``--log-dir``: a log file a day, as vllm-router writes them; library loggers kept quiet."""

from __future__ import annotations

import logging
import pathlib
import socket
import subprocess
import sys

from trio_pdrouter.observe import DailyLogFile

DAY = 86_400.0


def test_each_utc_day_gets_its_own_file(tmp_path: pathlib.Path) -> None:
    now = [1_764_547_200.0 + DAY - 2]  # 2025-12-01 23:59:58 UTC
    directory = tmp_path / "logs" / "router"  # created when missing
    handler = DailyLogFile(str(directory), clock=lambda: now[0])
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("test_log_files.daily")
    log.propagate = False
    log.addHandler(handler)
    try:
        log.warning("first")
        log.warning("second")
        now[0] += 4  # past midnight
        log.warning("third")
    finally:
        log.removeHandler(handler)
        handler.close()
    files = {path.name: path.read_text() for path in directory.iterdir()}
    assert files == {
        "trio-pdrouter.2025-12-01": "first\nsecond\n",
        "trio-pdrouter.2025-12-02": "third\n",
    }


def test_the_router_writes_its_log_to_the_log_dir(tmp_path: pathlib.Path) -> None:
    with socket.socket() as sock:  # nothing listens: the router logs its wait, then gives up
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        done = subprocess.run(
            [
                *(sys.executable, "-m", "trio_pdrouter", "--worker-urls", url),
                *("--log-dir", str(tmp_path), "--worker-startup-timeout-secs", "0.5"),
                *("--worker-startup-check-interval", "0.1"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1
    (log_file,) = tmp_path.iterdir()
    assert log_file.name.startswith("trio-pdrouter.20")
    text = log_file.read_text()
    assert f"INFO trio_pdrouter.startup startup waiting_for={url}" in text
    assert text in done.stderr, "the file has the lines stderr has"


QUIET = """
import logging
from trio_pdrouter.observe import configure_logging
configure_logging({level!r})
print(logging.getLogger("httpx").getEffectiveLevel(), logging.getLogger("trio_pdrouter.access")
      .getEffectiveLevel(), logging.getLogger("hypercorn.access").getEffectiveLevel())
"""


def test_library_loggers_are_quiet_unless_debugging() -> None:
    def levels(level: str) -> list[int]:
        out = subprocess.run(
            [sys.executable, "-c", QUIET.format(level=level)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return [int(n) for n in out.split()]

    assert levels("info") == [logging.WARNING, logging.INFO, logging.WARNING]
    assert levels("debug") == [logging.DEBUG, logging.DEBUG, logging.DEBUG]
