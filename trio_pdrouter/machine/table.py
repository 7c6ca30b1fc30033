"""The machine's load cells in shared memory, one row per worker process, and the machine lock.

Rules of this module (the layout and the only code that reads or writes it):

* One ``multiprocessing.shared_memory`` block holds a header, an endpoint table and the cells::

      header   HEADER_CELLS int64: magic, rows, slots, columns, server changes logged, worker
               restarts, spare...
      keys     slots x KEY_BYTES: the endpoint owning each slot ("role key", utf-8; empty = free)
      changes  LOG_ENTRIES x ENTRY_BYTES: the runtime server changes, in order (utf-8 text)
      cells    rows x slots x columns int64
      prefixes each worker's recent prefix-tree inserts (:mod:`.prefix_ring` owns the layout)
      routes   each worker's prompts in flight for the forecasts (:mod:`.route_ring` owns it)

  A slot is one endpoint; its columns are :data:`COUNT`, :data:`PENDING` and :data:`TOKENS`
  (what :class:`~trio_pdrouter.ledger.load.LoadLedger` keeps per endpoint). Every worker finds an
  endpoint's slot by its key, so workers agree on columns whatever order they learn of
  endpoints in.
* Each worker writes only its own row, so a cell has one writer and needs no atomic add; readers
  sum a column over the rows. The supervisor zeroes a dead worker's row (:meth:`zero_row`)
  before its replacement starts, so a crash never leaves a phantom charge.
* :meth:`MachineTable.locked` is the machine lock: ``fcntl.flock`` on a lock file, which the
  kernel releases if its holder dies. Routing holds it around the synchronous choose-and-charge,
  so no two workers choose from the same loads. Claiming a slot also takes it. It is reentrant
  within one process (a depth count), since flock on the same file description is not.
* The change log is append-only, under the machine lock; its length is the fleet generation.
  What an entry says is :class:`~trio_pdrouter.fleet.servers.Fleet`'s business (``POST``/``DELETE
  /workers`` in any worker append; every worker replays what it has not seen).
* Slots are never freed: a removed server that comes back gets its old slot (its cells are zero
  once its leases are released). :data:`DEFAULT_SLOTS` bounds the endpoints a machine can see.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from multiprocessing import resource_tracker, shared_memory

from . import prefix_ring, route_ring

MAGIC = 0x7472696F_6C656467  # "trioledg"
HEADER_CELLS = 8
_ROWS, _SLOTS, _COLUMNS, _GENERATION, _RESTARTS = 1, 2, 3, 4, 5
KEY_BYTES = 256
DEFAULT_SLOTS = 1024
ENTRY_BYTES = 512
LOG_ENTRIES = 1024
#: Columns of a slot: the in-flight count, the part of it charged but not yet sent (PENDING).
COUNT, PENDING = 0, 1
#: In a URL's own slot ("health URL"), in the prober's row: the health verdict it published.
VERDICT = 2
#: The token weight of the slots held (see :mod:`trio_pdrouter.ledger.load`).
TOKENS = 3
DEFAULT_COLUMNS = 4  # COUNT, PENDING, VERDICT (health slots only), TOKENS


#: Blocks this process created (and whose unlinking it owns).
_created: set[str] = set()


class TableFull(RuntimeError):
    """Every slot of the machine table is taken."""


def _buffer(shm: shared_memory.SharedMemory) -> memoryview:
    buf = shm.buf
    if buf is None:  # pragma: no cover - only after close()
        raise ValueError(f"shared memory {shm.name} is closed")
    return buf


def _size(rows: int, slots: int, columns: int) -> int:
    return (
        8 * HEADER_CELLS
        + slots * KEY_BYTES
        + LOG_ENTRIES * ENTRY_BYTES
        + 8 * rows * slots * columns
        + prefix_ring.LAYOUT.region_size(rows)
        + route_ring.LAYOUT.region_size(rows)
    )


class MachineTable:
    """A view of the shared block; :meth:`create` (the supervisor) or :meth:`attach` (workers).

    The creator calls :meth:`destroy` at the end; everyone else :meth:`close`.
    """

    def __init__(self, shm: shared_memory.SharedMemory, lock_path: str, *, owner: bool) -> None:
        self._shm = shm
        self.lock_path = lock_path
        self._owner = owner
        buf = _buffer(shm)
        header = buf[: 8 * HEADER_CELLS].cast("q")
        if header[0] != MAGIC:
            raise ValueError(f"shared memory {shm.name} is not a machine ledger")
        self._header = header
        self.rows, self.slots, self.columns = header[_ROWS], header[_SLOTS], header[_COLUMNS]
        keys_end = 8 * HEADER_CELLS + self.slots * KEY_BYTES
        log_end = keys_end + LOG_ENTRIES * ENTRY_BYTES
        self._keys = buf[8 * HEADER_CELLS : keys_end]
        self._log = buf[keys_end:log_end]
        cells_end = log_end + 8 * self.rows * self.slots * self.columns
        self._cells = buf[log_end:cells_end].cast("q")
        #: The prefix rings' bytes (:class:`~.prefix_ring.PrefixRing` reads and writes them).
        prefixes_end = cells_end + prefix_ring.LAYOUT.region_size(self.rows)
        self.prefixes = buf[cells_end:prefixes_end]
        #: The route rings' bytes (:class:`~.route_ring.RouteRing` reads and writes them).
        self.routes = buf[prefixes_end : prefixes_end + route_ring.LAYOUT.region_size(self.rows)]
        self._lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        self._depth = 0
        self._slot_of: dict[str, int] = {}

    @classmethod
    def create(
        cls,
        rows: int,
        lock_path: str,
        *,
        slots: int = DEFAULT_SLOTS,
        columns: int = DEFAULT_COLUMNS,
    ) -> MachineTable:
        shm = shared_memory.SharedMemory(create=True, size=_size(rows, slots, columns))
        _created.add(shm.name)
        header = _buffer(shm)[: 8 * HEADER_CELLS].cast("q")
        header[_ROWS], header[_SLOTS], header[_COLUMNS] = rows, slots, columns
        header[0] = MAGIC
        header.release()
        return cls(shm, lock_path, owner=True)

    @classmethod
    def attach(cls, name: str, lock_path: str) -> MachineTable:
        shm = shared_memory.SharedMemory(name=name)
        if shm.name not in _created:
            # Python 3.11 registers every attached block with this process's resource tracker,
            # which would unlink it when this worker exits: the creator owns the block.
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        return cls(shm, lock_path, owner=False)

    @property
    def name(self) -> str:
        return self._shm.name

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The machine lock (see the module doc); reentrant within a process."""
        if self._depth == 0:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def slot(self, key: str) -> int:
        """The slot of the endpoint named ``key``, claiming a free one the first time."""
        found = self._slot_of.get(key)
        if found is not None:
            return found
        raw = key.encode()
        if not raw or len(raw) > KEY_BYTES:
            raise ValueError(f"endpoint key must be 1..{KEY_BYTES} bytes: {key!r}")
        padded = raw.ljust(KEY_BYTES, b"\0")
        keys = self._keys
        with self.locked():
            for slot in range(self.slots):
                at = slot * KEY_BYTES
                current = keys[at : at + KEY_BYTES]
                if current == padded:
                    break
                if current[0] == 0:
                    keys[at : at + KEY_BYTES] = padded
                    break
            else:
                raise TableFull(f"the machine table has no free slot for {key!r}")
        self._slot_of[key] = slot
        return slot

    def add(self, row: int, slot: int, column: int, delta: int) -> int:
        """Add ``delta`` to one cell of ``row`` (the caller's own row); return the cell."""
        i = (row * self.slots + slot) * self.columns + column
        cells = self._cells
        cells[i] += delta
        return int(cells[i])

    def put(self, row: int, slot: int, column: int, value: int) -> None:
        """Set one cell of ``row`` (the caller's own row)."""
        self._cells[(row * self.slots + slot) * self.columns + column] = value

    def cell(self, row: int, slot: int, column: int) -> int:
        return int(self._cells[(row * self.slots + slot) * self.columns + column])

    def total(self, slot: int, column: int) -> int:
        """The machine's figure: ``column`` of ``slot`` summed over every row."""
        cells, stride = self._cells, self.slots * self.columns
        i = slot * self.columns + column
        return sum(cells[i + r * stride] for r in range(self.rows))

    def zero_row(self, row: int) -> None:
        """Forget everything ``row`` charged: its worker is dead (the supervisor's call)."""
        width = self.slots * self.columns
        start = row * width
        for i in range(start, start + width):
            self._cells[i] = 0

    @property
    def generation(self) -> int:
        """How many server changes the log holds."""
        return int(self._header[_GENERATION])

    @property
    def restarts(self) -> int:
        """Workers the supervisor restarted after they died (any worker reads it)."""
        return int(self._header[_RESTARTS])

    def count_restart(self) -> None:
        """One more worker restarted: the supervisor's call, its only writer."""
        self._header[_RESTARTS] += 1

    def append_change(self, change: str) -> int:
        """Log one server change; return the new generation. The caller holds the lock."""
        raw = change.encode()
        n = self.generation
        if n >= LOG_ENTRIES:
            raise TableFull(f"the machine's server change log is full ({LOG_ENTRIES} changes)")
        if not raw or len(raw) > ENTRY_BYTES:
            raise ValueError(f"a server change must be 1..{ENTRY_BYTES} bytes")
        self._log[n * ENTRY_BYTES : (n + 1) * ENTRY_BYTES] = raw.ljust(ENTRY_BYTES, b"\0")
        self._header[_GENERATION] = n + 1
        return n + 1

    def changes(self, since: int) -> list[str]:
        """The logged changes from index ``since`` on."""
        log = self._log
        return [
            bytes(log[i * ENTRY_BYTES : (i + 1) * ENTRY_BYTES]).rstrip(b"\0").decode()
            for i in range(since, self.generation)
        ]

    def close(self) -> None:
        for view in (self.routes, self.prefixes, self._cells, self._log, self._keys, self._header):
            view.release()
        self._shm.close()
        os.close(self._lock_fd)

    def destroy(self) -> None:
        """Close and free the block and the lock file (the creator's call)."""
        self.close()
        if self._owner:
            self._shm.unlink()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.lock_path)
