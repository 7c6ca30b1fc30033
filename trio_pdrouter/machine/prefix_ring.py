"""Each worker's recent prefix-tree inserts, in shared memory, so every worker's tree learns all.

With ``--workers N`` every worker keeps its own ``cache_aware`` radix tree; fed only by its own
requests, each tree would know a quarter of where prompts went (measured: prefix hits fell from
83 % to 67 % with 4 workers). Here each worker also publishes what it inserted, and before each
choice applies what the others published, so the trees agree with one tree fed by all.

Rules of this module (the layout and the only code that reads or writes it):

* A region of the machine table (:mod:`.table`) holds one ring per (stage, worker row) of
  :data:`ENTRIES` entries (:mod:`.ring`: one writer, no lock, entries stamped and checked); an
  entry's payload is::

      key length uint16, model length uint16, text length uint32, the key (at most KEY_BYTES),
      the model (at most MODEL_BYTES; empty for a request that named none), the text (at most
      TEXT_BYTES)

  (the model says which of the per-model trees the insert belongs to: docs/models.md).

* :meth:`PrefixRing.news` returns all rows' entries merged in stamp order, so a tree learns the
  inserts in the order they happened and its most-recent owner of a prefix is the machine's.
  An entry overwritten while being read is skipped, never half-applied.
* Bounded: a reader more than ``ENTRIES`` inserts behind skips the oldest (a hint lost, never a
  wrong count: the tree only guides placement). Texts keep their first ``TEXT_BYTES`` bytes of
  UTF-8 (a character cut at the end is dropped), enough for the tree to find the prefix.
* A replacement worker continues its row's ring from the head and, on its first read, applies
  the last ``ENTRIES`` inserts of every row, its predecessor's included.
"""

from __future__ import annotations

import struct

from .ring import RingLayout, StageRings

__all__ = ["ENTRIES", "KEY_BYTES", "LAYOUT", "MODEL_BYTES", "TEXT_BYTES", "PrefixRing"]

ENTRIES = 256
KEY_BYTES = 256
MODEL_BYTES = 256
TEXT_BYTES = 4096
_LENGTHS = struct.Struct("<HHI")
LAYOUT = RingLayout(ENTRIES, _LENGTHS.size + KEY_BYTES + MODEL_BYTES + TEXT_BYTES)


class PrefixRing:
    """One worker's view of one stage's rings: :meth:`publish` its inserts, :meth:`news` the
    others' (see the module doc). ``region`` is the machine table's prefix region."""

    def __init__(self, region: memoryview, rows: int, row: int, stage: str) -> None:
        self._rings = StageRings(LAYOUT, region, rows, stage)
        self._row = row
        self._next = self._start = self._rings.head(row)[0]
        # Everything published before is news once: the predecessor's inserts and the others'.
        self._seen = [0] * rows

    def publish(self, key: str, text: str, model: str = "") -> None:
        """Tell the other workers that ``text`` was inserted under endpoint ``key`` in the tree
        of ``model``. A model name longer than ``MODEL_BYTES`` is not published (cut, it could
        name another model's tree)."""
        raw_model = model.encode("utf-8", "surrogatepass")
        if len(raw_model) > MODEL_BYTES:
            return
        raw_key = key.encode()[:KEY_BYTES]
        raw_text = text[:TEXT_BYTES].encode("utf-8", "surrogatepass")[:TEXT_BYTES]
        lengths = _LENGTHS.pack(len(raw_key), len(raw_model), len(raw_text))
        payload = lengths + raw_key + raw_model + raw_text
        self._rings.write(self._row, self._next, payload)
        self._next += 1

    def news(self) -> list[tuple[str, str, str]]:
        """(endpoint key, text, model) of every insert published since the last call, oldest
        first, leaving out this worker's own since it started."""
        out: list[tuple[int, str, str, str]] = []
        rings = self._rings
        for r in range(rings.rows):
            head = self._start if r == self._row else rings.head(r)[0]
            for i in range(max(self._seen[r], head - ENTRIES), head):
                entry = rings.read(r, i)
                if entry is not None:
                    stamp, payload = entry
                    key_len, model_len, text_len = _LENGTHS.unpack_from(payload)
                    at = _LENGTHS.size
                    key = payload[at : at + key_len].decode(errors="replace")
                    at += key_len
                    model = payload[at : at + model_len].decode("utf-8", "replace")
                    at += model_len
                    text = payload[at : at + text_len].decode("utf-8", "ignore")
                    out.append((stamp, key, text, model))
            self._seen[r] = max(self._seen[r], head)
        if len(out) > 1:
            out.sort(key=lambda entry: entry[0])
        return [(key, text, model) for _, key, text, model in out]
