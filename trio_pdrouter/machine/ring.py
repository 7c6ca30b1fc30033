"""Single-writer rings in shared memory: the one primitive under the prefix and route rings.

Rules of this module (the layout and the only code that reads or writes a ring):

* A region holds one ring per (stage, worker row), stage-major; each ring has one writer, its
  worker, and no lock::

      ring    head int64 (entries ever published), writers int64 (how many workers have
              joined it as its writer), then ``entries`` entries of
      entry   seq int64, stamp int64, payload length uint32, pad, ``payload_bytes`` payload

* The writer marks the entry invalid (seq -1), copies the payload in, stamps the seq and the
  publishing time (``CLOCK_MONOTONIC``: one clock for the whole machine, so readers can merge
  the rows in the order things happened), then advances the head.
* A reader copies an entry and keeps it only if its seq is the expected one before and after the
  copy: an entry overwritten while being read is reported as lost (None), never half-read.
* What a payload means is its feed's (:mod:`.prefix_ring`, :mod:`.route_ring`); what to do about
  a reader that fell more than ``entries`` behind is the feed's too.
"""

from __future__ import annotations

import struct
import time

import attrs

__all__ = ["STAGES", "RingLayout", "StageRings"]

#: The stages a machine's rings serve, in region order.
STAGES = ("prefill", "decode", "regular")

_RING_HEAD = struct.Struct("<qq")
_HEAD = struct.Struct("<q")
_ENTRY_HEAD = struct.Struct("<qqI4x")
_INVALID = -1


@attrs.frozen
class RingLayout:
    """The shape of one kind of ring: ``entries`` slots of at most ``payload_bytes`` each."""

    entries: int
    payload_bytes: int

    @property
    def entry_bytes(self) -> int:
        return _ENTRY_HEAD.size + self.payload_bytes

    @property
    def ring_bytes(self) -> int:
        return _RING_HEAD.size + self.entries * self.entry_bytes

    def region_size(self, rows: int) -> int:
        """Bytes of the rings of ``rows`` workers, every stage."""
        return len(STAGES) * rows * self.ring_bytes

    def entry_at(self, i: int) -> int:
        """Where entry ``i`` (a count of entries ever published) starts in its ring."""
        return _RING_HEAD.size + (i % self.entries) * self.entry_bytes


class StageRings:
    """The rings of one stage in ``region`` (a machine table's view; this object keeps no view
    of its own, so the table closes whenever its owner says): one per worker row."""

    def __init__(self, layout: RingLayout, region: memoryview, rows: int, stage: str) -> None:
        base = STAGES.index(stage) * rows * layout.ring_bytes
        self.layout = layout
        self._region = region
        self._rings = [base + r * layout.ring_bytes for r in range(rows)]

    @property
    def rows(self) -> int:
        return len(self._rings)

    def head(self, row: int) -> tuple[int, int]:
        """Row ``row``'s (head, writers)."""
        head, writers = _RING_HEAD.unpack_from(self._region, self._rings[row])
        return int(head), int(writers)

    def join(self, row: int) -> tuple[int, int]:
        """Become row ``row``'s writer: its (head, writers) with this writer counted."""
        head, writers = self.head(row)
        _RING_HEAD.pack_into(self._region, self._rings[row], head, writers + 1)
        return head, writers + 1

    def write(self, row: int, i: int, payload: bytes) -> None:
        """Publish entry ``i`` of row ``row`` (the writer's next) and advance the head past it."""
        assert len(payload) <= self.layout.payload_bytes, len(payload)
        region, ring = self._region, self._rings[row]
        at = ring + self.layout.entry_at(i)
        _ENTRY_HEAD.pack_into(region, at, _INVALID, 0, 0)
        start = at + _ENTRY_HEAD.size
        region[start : start + len(payload)] = payload
        _ENTRY_HEAD.pack_into(region, at, i, time.monotonic_ns(), len(payload))
        _HEAD.pack_into(region, ring, i + 1)

    def read(self, row: int, i: int) -> tuple[int, bytes] | None:
        """Entry ``i`` of row ``row`` as (stamp, payload); None if it is not entry ``i`` any more
        (overwritten, or being written)."""
        region = self._region
        at = self._rings[row] + self.layout.entry_at(i)
        seq, stamp, length = _ENTRY_HEAD.unpack_from(region, at)
        if seq != i:
            return None
        start = at + _ENTRY_HEAD.size
        payload = bytes(region[start : start + length])
        if _ENTRY_HEAD.unpack_from(region, at)[0] != i:
            return None
        return int(stamp), payload
