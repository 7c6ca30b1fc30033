"""Where the router's log goes: stderr always, and with ``--log-dir`` a file a day as well.

As vllm-router does with ``--log-dir``: the directory is created if missing, and each UTC day's
lines go to ``<dir>/trio-pdrouter.<YYYY-MM-DD>`` (vllm-router's files are ``vllm-router.<date>``),
the same lines as on stderr, without colours. Files of past days are kept.

Library loggers are quiet unless ``--log-level debug``: httpx would write a line per upstream
request (two a second from the engine-metrics scrape alone) and the router writes its own access
line per request.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable

from .json_log import JsonLines

FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
PREFIX = "trio-pdrouter"
#: Loggers of libraries, at WARNING unless the router logs at debug.
LIBRARY_LOGGERS = ("httpx", "httpcore", "hypercorn.access", "hpack")


class DailyLogFile(logging.FileHandler):
    """Appends to ``<directory>/trio-pdrouter.<UTC date>``, opening a new file when the day
    changes. ``clock`` gives the time (seconds since the epoch)."""

    def __init__(self, directory: str, clock: Callable[[], float] = time.time) -> None:
        os.makedirs(directory, exist_ok=True)
        self._directory = directory
        self._clock = clock
        self._day = self._today()
        super().__init__(self._path(self._day), encoding="utf-8", delay=True)

    def _today(self) -> str:
        return time.strftime("%Y-%m-%d", time.gmtime(self._clock()))

    def _path(self, day: str) -> str:
        return os.path.join(self._directory, f"{PREFIX}.{day}")

    def emit(self, record: logging.LogRecord) -> None:
        day = self._today()
        if day != self._day:
            self.acquire()
            try:
                self.close()
                self._day = day
                self.baseFilename = os.path.abspath(self._path(day))
            finally:
                self.release()
        super().emit(record)


def configure_logging(level: str, log_dir: str | None = None, log_format: str = "text") -> None:
    """Log at ``level`` to stderr, and to a file a day in ``log_dir`` when given; as text lines
    or (``log_format="json"``) one JSON object a line (:mod:`.json_log`)."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_dir is not None:
        handlers.append(DailyLogFile(log_dir))
    logging.basicConfig(level=level.upper(), format=FORMAT, handlers=handlers, force=True)
    if log_format == "json":
        for handler in handlers:
            handler.setFormatter(JsonLines())
    quiet = logging.DEBUG if level == "debug" else logging.WARNING
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(quiet)
