"""The KV-event decoder: both layouts, unknown fields, malformed frames (never a crash)."""

from __future__ import annotations

import msgspec
import pytest

from trio_pdrouter.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedFrame,
    decode_message,
    decode_payload,
    fold_hash,
)
from trio_pdrouter_sim.kv_events import KvJournal

TOKENS = list(range(100, 132))


def _journal_payload(layout: str) -> bytes:
    journal = KvJournal(0, 16, pub=None, layout=layout)  # type: ignore[arg-type]
    journal.stored([11, 12], None, TOKENS)
    journal.removed([11])
    journal.cleared()
    journal.step()
    return journal.buffer[0][1]


@pytest.mark.parametrize("layout", ["map", "array"])
def test_both_layouts_decode_to_the_same_events(layout: str) -> None:
    batch = decode_payload(_journal_payload(layout), seq=7)
    assert batch.seq == 7 and batch.rank == 0
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.token_ids == tuple(TOKENS)
    assert stored.parent_block_hash is None and stored.indexable and stored.medium == "GPU"
    assert len(stored.block_hashes) == 2
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == stored.block_hashes[:1]
    assert isinstance(cleared, AllBlocksCleared)


def test_unknown_fields_and_event_types_are_ignored() -> None:
    event = {
        "type": "BlockStored",
        "block_hashes": [5],
        "parent_block_hash": 4,
        "token_ids": list(range(16)),
        "block_size": 16,
        "medium": "cpu",
        "locality": "x",
        "remaining_copy_counts": [1],
    }
    payload = msgspec.msgpack.encode([1.5, [event, {"type": "SomethingNew", "a": 1}], 3])
    batch = decode_payload(payload)
    assert batch.rank == 3 and len(batch.events) == 1
    stored = batch.events[0]
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash == 4 and stored.medium == "CPU" and stored.indexable


def test_a_two_element_envelope_and_bytes_hashes() -> None:
    digest = bytes(range(32))
    event = ["BlockRemoved", [digest], "GPU"]
    batch = decode_payload(msgspec.msgpack.encode([0.0, [event]]))
    assert batch.rank is None
    removed = batch.events[0]
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == (int.from_bytes(digest[-8:], "big"),)
    assert fold_hash(-1) == (1 << 64) - 1


@pytest.mark.parametrize(
    "extra",
    [
        {"lora_name": "adapter"},
        {"extra_keys": [["salt"]]},
        {"group_idx": 1},
        {"kv_cache_spec_kind": "sliding_window"},
        {"token_ids": [[1, 2]] * 16},
    ],
)
def test_stores_the_index_cannot_key_are_marked_not_indexable(extra: dict[str, object]) -> None:
    event: dict[str, object] = {
        "type": "BlockStored",
        "block_hashes": [1],
        "token_ids": list(range(16)),
        "block_size": 16,
    }
    event.update(extra)
    stored = decode_payload(msgspec.msgpack.encode([0.0, [event], 0])).events[0]
    assert isinstance(stored, BlockStored) and not stored.indexable


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode({"nope": 1}),
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode(["ts", [], 0]),
        msgspec.msgpack.encode([1.0, "events", 0]),
        msgspec.msgpack.encode([1.0, [7], 0]),
        msgspec.msgpack.encode([1.0, [{"type": 3}], 0]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": "x"}], 0]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1.5]}], 0]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": []}], 0]),
        msgspec.msgpack.encode([1.0, [], "rank"]),
    ],
)
def test_malformed_payloads_raise_only_malformed_frame(payload: bytes) -> None:
    with pytest.raises(MalformedFrame):
        decode_payload(payload)


def test_messages_need_three_frames_and_an_eight_byte_seq() -> None:
    payload = msgspec.msgpack.encode([0.0, [], 0])
    assert decode_message([b"", (5).to_bytes(8, "big"), payload]).seq == 5
    with pytest.raises(MalformedFrame):
        decode_message([b"", payload])
    with pytest.raises(MalformedFrame):
        decode_message([b"", b"\x01", payload])
