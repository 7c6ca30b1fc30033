"""Decoding vLLM's KV-event payloads: ``msgspec`` against ``msgpack``, on realistic batches.

``python -m benchmarks.kv_decode`` prints microseconds per batch for three batch shapes (a
prefill's stores: 32 blocks of 16 tokens; a scheduler step under cache pressure: 4 stores and 4
removes of 8 blocks; the legacy array layout of the latter), each decoded untyped by
``msgspec.msgpack.decode`` and by ``msgpack.unpackb``, and the whole of
:func:`trio_pdrouter.kv.wire.decode_payload` (typed, as the router decodes these shapes) and of
its field-by-field reading (untyped msgspec plus reading the events by name: what it does for
a shape it does not decode typed).
Needs ``msgpack`` (``pip install msgpack``; the router itself does not).
"""

from __future__ import annotations

import random
import sys
import timeit
from functools import partial
from typing import Any

import msgspec

from trio_pdrouter.kv import decode_payload
from trio_pdrouter.kv import wire as kv_wire
from trio_pdrouter_sim.kv_events import KvJournal


def _batch(layout: str, stores: int, removes: int, blocks: int) -> bytes:
    rng = random.Random(0)
    journal = KvJournal(0, 16, pub=None, layout=layout)  # type: ignore[arg-type]
    for _ in range(stores):
        hashes = [rng.getrandbits(63) for _ in range(blocks)]
        journal.stored(
            hashes, rng.getrandbits(63), [rng.randrange(150_000) for _ in range(16 * blocks)]
        )
    for _ in range(removes):
        journal.removed([rng.getrandbits(63) for _ in range(blocks)])
    journal.step()
    return journal.buffer[-1][1]


SHAPES = {
    "prefill: 1 store x 32 blocks (map)": ("map", 1, 0, 32),
    "pressure: 4 stores + 4 removes x 8 blocks (map)": ("map", 4, 4, 8),
    "pressure, legacy arrays": ("array", 4, 4, 8),
}


def run(number: int = 2000) -> dict[str, Any]:
    import msgpack  # type: ignore[import-untyped]  # a benchmark-only dependency

    out: dict[str, Any] = {}

    def per_batch_us(fn: Any) -> float:
        return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6

    for name, shape in SHAPES.items():
        payload = _batch(*shape)
        out[name] = {
            "bytes": len(payload),
            "msgspec_us": round(per_batch_us(partial(msgspec.msgpack.decode, payload)), 2),
            "msgpack_us": round(
                per_batch_us(partial(msgpack.unpackb, payload, strict_map_key=False)), 2
            ),
            "decode_payload_us": round(per_batch_us(partial(decode_payload, payload)), 2),
            # The same read field by field: what decode_payload does for a shape not typed.
            "field_by_field_us": round(
                per_batch_us(partial(kv_wire._decode_untyped, payload, 0)), 2
            ),
        }
    return out


if __name__ == "__main__":
    for name, row in run(int(sys.argv[1]) if len(sys.argv) > 1 else 2000).items():
        print(f"{name}: {row}")
