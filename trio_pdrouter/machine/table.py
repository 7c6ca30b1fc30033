"""The machine's load cells in shared memory, one row per worker process, and the machine lock.

Rules of this module (the layout and the only code that reads or writes it):

* One ``multiprocessing.shared_memory`` block holds a header, an endpoint table and the cells::

      header   HEADER_CELLS int64: magic, rows, slots, columns, generation, base, snapshot
               length, log entries, worker restarts, spare...
      keys     slots x KEY_BYTES: the endpoint owning each slot ("role key", utf-8; empty = free)
      changes  log entries x ENTRY_BYTES: the runtime server changes (utf-8 text)
      cells    rows x slots x columns int64
      prefixes each worker's recent prefix-tree inserts (:mod:`.prefix_ring` owns the layout)
      routes   each worker's prompts in flight for the forecasts (:mod:`.route_ring` owns it)

  A slot is one endpoint (or one URL's health verdict); its columns are :data:`COUNT`,
  :data:`PENDING`, :data:`VERDICT`, :data:`TOKENS` and :data:`HELD` (what
  :class:`~trio_pdrouter.ledger.load.LoadLedger` keeps per endpoint, and who uses the slot).
  Every worker finds an endpoint's slot by its key, so workers agree on columns whatever order
  they learn of endpoints in.
  A tenant's slot (key ``tenant NAME``) uses the same columns for its own numbers (see
  :mod:`trio_pdrouter.tenants.ledger`).
* Each worker writes only its own row, so a cell has one writer and needs no atomic add; readers
  sum a column over the rows. The supervisor zeroes a dead worker's row (:meth:`zero_row`)
  before its replacement starts, so a crash never leaves a phantom charge.
* A slot is **held** by the rows whose :data:`HELD` cell is 1: :meth:`MachineTable.hold` sets it
  (finding the key's slot, or claiming a free one), :meth:`MachineTable.let_go` clears it once the
  worker is done with the endpoint (the ledger: at its last release after the server was removed).
  A slot no row holds is free: the next claim takes it and zeroes its cells first, so a server
  that comes back (under its old key or another) starts from zero. A dead worker's holds outlive
  it (:meth:`zero_row` leaves them) until its replacement, having replayed the servers, gives up
  those it does not use (:meth:`MachineTable.keep_only`): no slot is reused while any process may
  still write it, and none stays taken by a process that is gone.
* :meth:`MachineTable.locked` is the machine lock: ``fcntl.flock`` on a lock file, which the
  kernel releases if its holder dies. Routing holds it around the synchronous choose-and-charge,
  so no two workers choose from the same loads. Claiming a slot also takes it. It is reentrant
  within one process (a depth count), since flock on the same file description is not.
* The change log, under the machine lock, is a **snapshot** (the entries that rebuild the state
  at generation ``base``) followed by the **tail** (the changes from ``base`` on); the generation
  counts every change ever logged. When it is full the writer replaces it by a new snapshot of
  the state now (:meth:`MachineTable.compact`); a reader that had not read up to the new base
  gets the snapshot and the tail and starts again from them (:class:`Changes` ``reset``). What an
  entry says is :class:`~trio_pdrouter.fleet.servers.Fleet`'s business (``POST``/``DELETE
  /workers`` in any worker append; every worker replays what it has not seen).
* Slots and log entries are sized at :meth:`MachineTable.create` from what the machine must
  hold; when they truly run out, :class:`TableFull` says so before anything changed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterable, Iterator, Sequence
from multiprocessing import resource_tracker, shared_memory

import attrs

from . import prefix_ring, route_ring

MAGIC = 0x7472696F_6C656467  # "trioledg"
HEADER_CELLS = 16
_ROWS, _SLOTS, _COLUMNS, _GENERATION, _BASE, _SNAPSHOT, _ENTRIES, _RESTARTS = range(1, 9)
KEY_BYTES = 256
DEFAULT_SLOTS = 1024
ENTRY_BYTES = 512
DEFAULT_LOG_ENTRIES = 1024
#: Columns of a slot: the in-flight count, the part of it charged but not yet sent (PENDING).
COUNT, PENDING = 0, 1
#: In a URL's own slot ("health URL"), in the prober's row: the health verdict it published.
VERDICT = 2
#: The token weight of the slots held (see :mod:`trio_pdrouter.ledger.load`).
TOKENS = 3
#: 1 in a row that uses the slot (module doc); a slot no row holds is free.
HELD = 4
COLUMNS = 5


#: Blocks this process created (and whose unlinking it owns).
_created: set[str] = set()


class TableFull(RuntimeError):
    """The machine table has no room left for what was asked: nothing was changed."""


@attrs.frozen
class Changes:
    """What :meth:`MachineTable.changes` read: the entries, and the generation they reach.

    ``reset``: the reader had not read up to the log's base, so ``entries`` are the snapshot and
    the whole tail, to be applied to the state the log started from.
    """

    entries: list[str]
    generation: int
    reset: bool


def _buffer(shm: shared_memory.SharedMemory) -> memoryview:
    buf = shm.buf
    if buf is None:  # pragma: no cover - only after close()
        raise ValueError(f"shared memory {shm.name} is closed")
    return buf


def _size(rows: int, slots: int, columns: int, entries: int) -> int:
    return (
        8 * HEADER_CELLS
        + slots * KEY_BYTES
        + entries * ENTRY_BYTES
        + 8 * rows * slots * columns
        + prefix_ring.LAYOUT.region_size(rows)
        + route_ring.LAYOUT.region_size(rows)
    )


def _padded(text: str, size: int, what: str) -> bytes:
    raw = text.encode()
    if not raw or len(raw) > size:
        raise ValueError(f"{what} must be 1..{size} bytes: {text[:80]!r}")
    return raw.ljust(size, b"\0")


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
            header.release()
            raise ValueError(f"shared memory {shm.name} is not a machine ledger")
        self._header = header
        self.rows, self.slots, self.columns = header[_ROWS], header[_SLOTS], header[_COLUMNS]
        self.log_entries = header[_ENTRIES]
        keys_end = 8 * HEADER_CELLS + self.slots * KEY_BYTES
        log_end = keys_end + self.log_entries * ENTRY_BYTES
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
        #: The slots this process holds, by key.
        self._slot_of: dict[str, int] = {}

    @classmethod
    def create(
        cls,
        rows: int,
        lock_path: str,
        *,
        slots: int = DEFAULT_SLOTS,
        log_entries: int = DEFAULT_LOG_ENTRIES,
    ) -> MachineTable:
        if rows < 1 or slots < 1 or log_entries < 2:
            raise ValueError(f"a machine table needs rows, slots and log entries: {rows}, {slots}")
        shm = shared_memory.SharedMemory(create=True, size=_size(rows, slots, COLUMNS, log_entries))
        _created.add(shm.name)
        header = _buffer(shm)[: 8 * HEADER_CELLS].cast("q")
        header[_ROWS], header[_SLOTS], header[_COLUMNS] = rows, slots, COLUMNS
        header[_ENTRIES] = log_entries
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

    # -- slots -----------------------------------------------------------------------------------

    def hold(self, row: int, key: str) -> int:
        """The slot of ``key``, held by ``row`` from now on: the key's own slot if it has one,
        else a free slot claimed for it. Raises :class:`TableFull` if there is none."""
        found = self._slot_of.get(key)
        if found is not None:
            return found
        padded = _padded(key, KEY_BYTES, "an endpoint key")
        with self.locked():
            slot = self._find(padded)
            if slot is None:
                raise TableFull(
                    f"the machine table's {self.slots} slots are all in use: no room for {key!r}"
                )
            if not self._held(slot):  # unused since its last holder let go: start from zero
                self._zero_slot(slot)
                self._keys[slot * KEY_BYTES : (slot + 1) * KEY_BYTES] = padded
            self.put(row, slot, HELD, 1)
        self._slot_of[key] = slot
        return slot

    def check_room(self, keys: Iterable[str]) -> None:
        """Raise :class:`TableFull` unless :meth:`hold` can take every one of ``keys`` now (the
        caller holds the lock, so nothing changes between this check and its holds)."""
        missing, own = 0, set()
        for key in set(keys):
            slot = self._slot_of.get(key)
            if slot is None:
                slot = self._exact(_padded(key, KEY_BYTES, "an endpoint key"))
            if slot is None:
                missing += 1
            else:
                own.add(slot)
        free = sum(1 for slot in range(self.slots) if slot not in own and not self._held(slot))
        if missing > free:
            raise TableFull(
                f"the machine table has {free} free slots of {self.slots}, {missing} needed"
                " (servers still draining hold theirs until their last request ends)"
            )

    def let_go(self, row: int, key: str) -> None:
        """``row`` no longer uses ``key``'s slot (its cells in ``row`` are zero by now)."""
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self.put(row, slot, HELD, 0)

    def keep_only(self, row: int) -> None:
        """Let go of every slot ``row`` holds but this process does not: a dead worker's, whose
        replacement has replayed the servers and holds what it uses."""
        mine = set(self._slot_of.values())
        with self.locked():
            for slot in range(self.slots):
                if slot not in mine and self.cell(row, slot, HELD):
                    self.put(row, slot, HELD, 0)

    def holders(self) -> dict[str, int]:
        """Every held slot's key with the number of rows holding it."""
        out: dict[str, int] = {}
        for slot in range(self.slots):
            n = sum(self.cell(r, slot, HELD) for r in range(self.rows))
            if n:
                with self._keys[slot * KEY_BYTES : (slot + 1) * KEY_BYTES] as raw:
                    out[bytes(raw).rstrip(b"\0").decode()] = n
        return out

    def _find(self, padded: bytes) -> int | None:
        """The slot whose key is ``padded``, else the first that no row holds."""
        exact = self._exact(padded)
        if exact is not None:
            return exact
        return next((slot for slot in range(self.slots) if not self._held(slot)), None)

    def _exact(self, padded: bytes) -> int | None:
        keys = self._keys
        for slot in range(self.slots):
            with keys[slot * KEY_BYTES : (slot + 1) * KEY_BYTES] as current:
                if current == padded:
                    return slot
        return None

    def _held(self, slot: int) -> bool:
        return any(self.cell(r, slot, HELD) for r in range(self.rows))

    def _zero_slot(self, slot: int) -> None:
        for r in range(self.rows):
            for column in range(self.columns):
                self.put(r, slot, column, 0)

    # -- cells -----------------------------------------------------------------------------------

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
        """Forget everything ``row`` charged: its worker is dead (the supervisor's call). Its
        holds stay until its replacement says which it uses (:meth:`keep_only`)."""
        for slot in range(self.slots):
            for column in range(self.columns):
                if column != HELD:
                    self.put(row, slot, column, 0)

    # -- the change log --------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """How many server changes were ever logged."""
        return int(self._header[_GENERATION])

    @property
    def room(self) -> int:
        """How many more changes fit before the log must be compacted."""
        header = self._header
        used = header[_SNAPSHOT] + header[_GENERATION] - header[_BASE]
        return int(self.log_entries - used)

    @property
    def restarts(self) -> int:
        """Workers the supervisor restarted after they died (any worker reads it)."""
        return int(self._header[_RESTARTS])

    def count_restart(self) -> None:
        """One more worker restarted: the supervisor's call, its only writer."""
        self._header[_RESTARTS] += 1

    def append_change(self, change: str) -> int:
        """Log one server change; return the new generation. The caller holds the lock."""
        raw = _padded(change, ENTRY_BYTES, "a server change")
        if self.room < 1:
            raise TableFull(f"the machine's server change log is full ({self.log_entries})")
        header = self._header
        at = int(header[_SNAPSHOT] + header[_GENERATION] - header[_BASE])
        self._log[at * ENTRY_BYTES : (at + 1) * ENTRY_BYTES] = raw
        header[_GENERATION] += 1
        return int(header[_GENERATION])

    def compact(self, snapshot: Sequence[str]) -> None:
        """Replace the log by ``snapshot``, the entries that rebuild the state at the current
        generation. The caller holds the lock; raises :class:`TableFull` (nothing changed) if
        the snapshot would leave no room for a change."""
        if len(snapshot) >= self.log_entries:
            raise TableFull(
                f"the machine's server change log holds {self.log_entries} entries: the"
                f" {len(snapshot)} servers changed at run time leave no room"
            )
        raws = [_padded(entry, ENTRY_BYTES, "a server change") for entry in snapshot]
        header = self._header
        for i, raw in enumerate(raws):
            self._log[i * ENTRY_BYTES : (i + 1) * ENTRY_BYTES] = raw
        header[_SNAPSHOT] = len(raws)
        header[_BASE] = header[_GENERATION]

    def changes(self, since: int) -> Changes:
        """The changes from generation ``since`` on (see :class:`Changes`)."""
        header = self._header
        base, snapshot, generation = int(header[_BASE]), int(header[_SNAPSHOT]), self.generation
        reset = since < base
        first = 0 if reset else snapshot + since - base
        last = snapshot + generation - base
        log = self._log
        entries = []
        for i in range(first, last):
            with log[i * ENTRY_BYTES : (i + 1) * ENTRY_BYTES] as raw:
                entries.append(bytes(raw).rstrip(b"\0").decode())
        return Changes(entries, generation, reset)

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
