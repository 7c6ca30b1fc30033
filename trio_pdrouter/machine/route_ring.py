"""Each worker's prompts in flight, in shared memory, so every worker's forecasts see them all.

With ``--workers N`` every worker keeps its own ``kv_aware`` forecasts
(:mod:`trio_pdrouter.kv.forecast`): what each engine's prefix cache will hold once the prompts sent
to it are computed. Fed only by its own prompts, a worker's forecast misses the others' and the
evictions they cause (measured with two workers: the forecasts found half of each engine's stores
foreign and fell back to the indexes). Here each worker also publishes every prompt it sends to an
engine and that prompt's release, and applies the others' before each choice and before a forecast
takes in an engine's batch (a store read before the route it comes from would look like traffic from
elsewhere), so each forecast is the one a single router would keep.

Rules of this module (the layout and the only code that reads or writes it):

* A region of the machine table (:mod:`.table`) holds one ring per (stage, worker row) of
  :data:`ENTRIES` entries (:mod:`.ring`: one writer, no lock, entries stamped and checked, the
  count of writers a row has had); an entry's payload is::

      prompt int64, block count int32 (-1: a release), key length uint16, pad, the endpoint
      key (at most KEY_BYTES), block count int64 block keys (at most MAX_KEYS)

* A route entry names the prompt (a number unique within its writer), the endpoint key and the
  prompt's block keys (the own hash chain of :func:`trio_pdrouter.kv.block_keys`, the same in
  every process); a release entry names the prompt only. :meth:`RouteRing.news` merges all
  rows in stamp order.
* Each reader keeps the prompts in flight it has read (at most :data:`IN_FLIGHT` per row, the
  oldest released past that) and turns a release entry into that prompt's keys.
* Loss never leaves credit behind: a prompt the forecasts await keeps its blocks in them until
  its release, so a reader that cannot be sure to see a release releases the prompt itself:
  when it falls more than ``ENTRIES`` behind a row or finds an entry overwritten while reading
  it, every prompt of that row it holds; when a row has a new writer (a replacement worker:
  its predecessor's releases never come), every prompt of the old writer. Released early, a
  prompt's blocks are kept only once the engine stores them (the forecast's rule), so a loss
  costs credit, never gives false credit. A release whose route the reader never saw is
  ignored.
* A prompt of more than :data:`MAX_KEYS` blocks is published with its first ``MAX_KEYS``: the
  other workers forecast its start.
* A new reader starts at every row's head: prompts in flight before it started are not its
  concern (their releases are ignored).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from .ring import RingLayout, StageRings

__all__ = ["ENTRIES", "IN_FLIGHT", "LAYOUT", "MAX_KEYS", "RouteRing"]

ENTRIES = 256
KEY_BYTES = 256
MAX_KEYS = 256
#: Prompts in flight a reader holds per row before it releases the oldest.
IN_FLIGHT = 16384
#: A prompt's number: its writer's generation (the ring's writer count when it started) in
#: the high bits, so a replacement's numbers never meet its predecessor's.
_GENERATION_SHIFT = 40
_PAYLOAD_HEAD = struct.Struct("<qiH2x")
LAYOUT = RingLayout(ENTRIES, _PAYLOAD_HEAD.size + KEY_BYTES + 8 * MAX_KEYS)
_RELEASE = -1

#: One change to apply to a forecast: (endpoint key, block keys, True: routed / False: released).
Change = tuple[str, list[int], bool]


class RouteRing:
    """One worker's view of one stage's rings: publish its prompts (:meth:`routed`,
    :meth:`released`), read the others' (:meth:`news`); see the module doc. ``region`` is the
    machine table's route region (this object keeps no view of its own)."""

    def __init__(self, region: memoryview, rows: int, row: int, stage: str) -> None:
        self._rings = StageRings(LAYOUT, region, rows, stage)
        self._row = row
        head, writers = self._rings.join(row)
        self._next: int = head
        self._prompt: int = writers << _GENERATION_SHIFT
        heads = [self._rings.head(r) for r in range(rows)]
        self._seen = [head for head, _writer in heads]
        self._writers = [writer for _head, writer in heads]
        #: Per row: prompt -> (endpoint key, block keys) of the routes read and not released.
        self._flying: list[dict[int, tuple[str, list[int]]]] = [{} for _ in range(rows)]

    def routed(self, key: str, keys: Sequence[int]) -> int:
        """Tell the other workers that a prompt with block ``keys`` went to endpoint ``key``;
        returns the prompt's number for :meth:`released`."""
        self._prompt += 1
        self._write(self._prompt, key, keys[:MAX_KEYS])
        return self._prompt

    def released(self, prompt: int) -> None:
        """Tell the other workers that the prompt :meth:`routed` numbered ``prompt`` is done."""
        self._write(prompt, "", None)

    def _write(self, prompt: int, key: str, keys: Sequence[int] | None) -> None:
        raw_key = key.encode()[:KEY_BYTES]
        count = _RELEASE if keys is None else len(keys)
        payload = _PAYLOAD_HEAD.pack(prompt, count, len(raw_key)) + raw_key
        if keys is not None:
            payload += struct.pack(f"<{count}q", *keys)
        self._rings.write(self._row, self._next, payload)
        self._next += 1

    def news(self) -> list[Change]:
        """The other workers' routes and releases since the last call, oldest first, with the
        releases this reader made for them where it may have missed theirs (module doc)."""
        out: list[tuple[int, Change]] = []
        for r in range(self._rings.rows):
            if r != self._row:
                self._news_of(r, out)
        if len(out) > 1:
            out.sort(key=lambda stamped: stamped[0])
        return [change for _stamp, change in out]

    def _news_of(self, r: int, out: list[tuple[int, Change]]) -> None:
        flying = self._flying[r]
        head, writer = self._rings.head(r)
        start = self._seen[r]
        stamp = 0  # of the last entry read: a release this reader makes comes after it
        if head - ENTRIES > start:  # fell behind: releases may be lost
            self._release(r, out, stamp)
            start = head - ENTRIES
        for i in range(start, head):
            entry = self._read(r, i)
            if entry is None:  # overwritten while read: a release may be lost
                self._release(r, out, stamp)
                continue
            stamp, prompt, key, keys = entry
            if keys is not None:
                flying[prompt] = (key, keys)
                out.append((stamp, (key, keys, True)))
                if len(flying) > IN_FLIGHT:
                    oldest = next(iter(flying))
                    old_key, old_keys = flying.pop(oldest)
                    out.append((stamp, (old_key, old_keys, False)))
            else:
                known = flying.pop(prompt, None)
                if known is not None:
                    out.append((stamp, (known[0], known[1], False)))
        self._seen[r] = max(start, head)
        if writer != self._writers[r]:  # a new worker at this row: the old ones' never end
            self._writers[r] = writer
            self._release(r, out, stamp, before=writer << _GENERATION_SHIFT)

    def _release(
        self, r: int, out: list[tuple[int, Change]], stamp: int, before: int | None = None
    ) -> None:
        """Release the prompts of row ``r`` in flight (numbered below ``before`` only), as of
        ``stamp`` (the sort that merges the rows is stable: after what was read by then)."""
        flying = self._flying[r]
        for prompt in [p for p in flying if before is None or p < before]:
            key, keys = flying.pop(prompt)
            out.append((stamp, (key, keys, False)))

    def _read(self, row: int, i: int) -> tuple[int, int, str, list[int] | None] | None:
        entry = self._rings.read(row, i)
        if entry is None:
            return None
        stamp, payload = entry
        prompt, count, key_len = _PAYLOAD_HEAD.unpack_from(payload)
        key = payload[_PAYLOAD_HEAD.size : _PAYLOAD_HEAD.size + key_len]
        keys = None
        if count != _RELEASE:
            keys = list(struct.unpack_from(f"<{count}q", payload, _PAYLOAD_HEAD.size + key_len))
        return stamp, prompt, key.decode(errors="replace"), keys
