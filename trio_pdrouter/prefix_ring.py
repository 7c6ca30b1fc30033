"""Each worker's recent prefix-tree inserts, in shared memory, so every worker's tree learns all.

With ``--workers N`` every worker keeps its own ``cache_aware`` radix tree; fed only by its own
requests, each tree would know a quarter of where prompts went (measured: prefix hits fell from
83 % to 67 % with 4 workers). Here each worker also publishes what it inserted, and before each
choice applies what the others published, so the trees agree with one tree fed by all.

Rules of this module (the layout and the only code that reads or writes it):

* A region of the machine table (:mod:`.machine_table`) holds one ring per (stage, worker row)
  of :data:`ENTRIES` entries; a ring has one writer, its worker, and no lock::

      ring    head int64 (inserts ever published), then ENTRIES entries of
      entry   seq int64, stamp int64, key length uint16, text length uint32, pad, KEY_BYTES key,
              TEXT_BYTES text

* The writer marks the entry invalid (seq -1), fills it, stamps its seq, then advances the head.
  The stamp is the publishing time (``CLOCK_MONOTONIC``, one clock for the whole machine):
  :meth:`PrefixFeed.news` returns all rows' entries merged in that order, so a tree learns the
  inserts in the order they happened and its most-recent owner of a prefix is the machine's.
  A reader copies an entry and keeps it only if its seq is the expected one before and after
  the copy, so an entry overwritten while being read is skipped, never half-applied.
* Bounded: a reader more than ``ENTRIES`` inserts behind skips the oldest (a hint lost, never a
  wrong count: the tree only guides placement). Texts keep their first ``TEXT_BYTES`` bytes of
  UTF-8 (a character cut at the end is dropped), enough for the tree to find the prefix.
* A replacement worker continues its row's ring from the head and, on its first read, applies
  the last ``ENTRIES`` inserts of every row, its predecessor's included.
"""

from __future__ import annotations

import struct
import time

__all__ = ["ENTRIES", "KEY_BYTES", "STAGES", "TEXT_BYTES", "PrefixFeed", "region_size"]

STAGES = ("prefill", "decode", "regular")
ENTRIES = 256
KEY_BYTES = 256
TEXT_BYTES = 4096
_HEAD = struct.Struct("<q")
_ENTRY_HEAD = struct.Struct("<qqHI")
_HEAD_BYTES = 24
_ENTRY_BYTES = _HEAD_BYTES + KEY_BYTES + TEXT_BYTES
_RING_BYTES = 8 + ENTRIES * _ENTRY_BYTES
_INVALID = -1


def region_size(rows: int) -> int:
    """Bytes of the rings of ``rows`` workers."""
    return len(STAGES) * rows * _RING_BYTES


class PrefixFeed:
    """One worker's view of one stage's rings: :meth:`publish` its inserts, :meth:`news` the
    others' (see the module doc). ``region`` is the machine table's prefix region (this object
    keeps no view of its own, so the table closes whenever its owner says)."""

    def __init__(self, region: memoryview, rows: int, row: int, stage: str) -> None:
        base = STAGES.index(stage) * rows * _RING_BYTES
        self._region = region
        self._rings = [base + r * _RING_BYTES for r in range(rows)]
        self._row = row
        self._next = self._start = self._head(row)
        # Everything published before is news once: the predecessor's inserts and the others'.
        self._seen = [0] * rows

    def _head(self, row: int) -> int:
        return int(_HEAD.unpack_from(self._region, self._rings[row])[0])

    def publish(self, key: str, text: str) -> None:
        """Tell the other workers that ``text`` was inserted under endpoint ``key``."""
        raw_key = key.encode()[:KEY_BYTES]
        raw_text = text[:TEXT_BYTES].encode("utf-8", "surrogatepass")[:TEXT_BYTES]
        region, ring, i = self._region, self._rings[self._row], self._next
        at = ring + 8 + (i % ENTRIES) * _ENTRY_BYTES
        _ENTRY_HEAD.pack_into(region, at, _INVALID, 0, 0, 0)
        region[at + _HEAD_BYTES : at + _HEAD_BYTES + len(raw_key)] = raw_key
        text_at = at + _HEAD_BYTES + KEY_BYTES
        region[text_at : text_at + len(raw_text)] = raw_text
        _ENTRY_HEAD.pack_into(region, at, i, time.monotonic_ns(), len(raw_key), len(raw_text))
        self._next = i + 1
        _HEAD.pack_into(region, ring, i + 1)

    def news(self) -> list[tuple[str, str]]:
        """(endpoint key, text) of every insert published since the last call, oldest first,
        leaving out this worker's own since it started."""
        out: list[tuple[int, str, str]] = []
        for r in range(len(self._rings)):
            head = self._start if r == self._row else self._head(r)
            for i in range(max(self._seen[r], head - ENTRIES), head):
                entry = self._read(r, i)
                if entry is not None:
                    out.append(entry)
            self._seen[r] = max(self._seen[r], head)
        if len(out) > 1:
            out.sort(key=lambda entry: entry[0])
        return [(key, text) for _, key, text in out]

    def _read(self, row: int, i: int) -> tuple[int, str, str] | None:
        region = self._region
        at = self._rings[row] + 8 + (i % ENTRIES) * _ENTRY_BYTES
        seq, stamp, key_len, text_len = _ENTRY_HEAD.unpack_from(region, at)
        if seq != i:
            return None
        key = bytes(region[at + _HEAD_BYTES : at + _HEAD_BYTES + key_len])
        text_at = at + _HEAD_BYTES + KEY_BYTES
        text = bytes(region[text_at : text_at + text_len])
        if _ENTRY_HEAD.unpack_from(region, at)[0] != i:
            return None
        return stamp, key.decode(errors="replace"), text.decode("utf-8", "ignore")
