"""The tenants file as the router reads it: loaded at start, reloaded when it changes.

Rules of this module:

* :func:`load` reads and parses the file once; any failure is one :class:`TenantsFileError`
  line (at start the router exits 2 with it).
* :class:`TenantsFile` holds the current :class:`~.book.TenantBook`. :meth:`TenantsFile.check`
  looks at the file's identity (inode, size, modification time in nanoseconds) and reloads it
  when that changed; :meth:`TenantsFile.watch` checks every :data:`CHECK_INTERVAL` seconds. A
  file that fails to load on a reload leaves the current book in force and logs one warning (once
  per bad version of the file); the next good version is taken.
* Every worker of ``--workers N`` watches the file itself, so all take a change within a check.
  Requests already admitted or queued keep the tenant (weight, limits) they arrived with.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import trio

from .book import TenantBook, TenantsFileError, parse_book

log = logging.getLogger("trio_pdrouter.tenants")

#: Seconds between two looks at the tenants file.
CHECK_INTERVAL = 1.0

_Identity = tuple[int, int, int]


def _identity(path: str) -> _Identity:
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def load(path: str) -> TenantBook:
    """The book in ``path``; raises :class:`TenantsFileError`."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise TenantsFileError(f"--tenants-file {path}: cannot be read: {exc}") from None
    return parse_book(text, f"--tenants-file {path}")


class TenantsFile:
    """The tenants file at ``path`` and its current book (see the module doc)."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            # Before reading: a change made while it is read is seen at the next check.
            self._seen = _identity(path)
        except OSError:
            self._seen = (-1, -1, -1)
        self.book = load(path)
        #: Reloads that took a new book, and those refused.
        self.reloads = 0
        self.failures = 0

    def check(self) -> bool:
        """Reload the file if it changed; True if a new book is in force."""
        try:
            seen = _identity(self.path)
        except OSError as exc:
            seen = (-1, -1, -1)
            if seen != self._seen:
                self._seen = seen
                self.failures += 1
                log.warning("tenants file %s unreadable, keeping the tenants: %s", self.path, exc)
            return False
        if seen == self._seen:
            return False
        self._seen = seen
        try:
            book = load(self.path)
        except TenantsFileError as exc:
            self.failures += 1
            log.warning("tenants file not reloaded, keeping the tenants in force: %s", exc)
            return False
        self.book = book
        self.reloads += 1
        log.info("tenants file %s reloaded: tenants=%d", self.path, len(book.tenants))
        return True

    async def watch(self, on_reload: Callable[[TenantBook], None] | None = None) -> None:
        """Check every :data:`CHECK_INTERVAL` seconds until cancelled; ``on_reload`` gets each
        new book."""
        while True:
            await trio.sleep(CHECK_INTERVAL)
            if self.check() and on_reload is not None:
                on_reload(self.book)
