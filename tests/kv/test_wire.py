"""The KV-event decoder: both layouts, unknown fields, malformed frames (never a crash)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_pdrouter.kv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedFrame,
    decode_message,
    decode_payload,
    fold_hash,
)
from trio_pdrouter.kv import wire as kv_wire
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


@pytest.mark.parametrize("layout", ["map", "array"])
def test_the_shapes_vllm_sends_are_decoded_typed(layout: str) -> None:
    payload = _journal_payload(layout)
    taken = [shape for shape in kv_wire._TYPED if _takes(shape, payload)]
    assert len(taken) == 1
    assert decode_payload(payload, 3) == kv_wire._decode_untyped(payload, 3)


def _takes(shape: msgspec.msgpack.Decoder[object], payload: bytes) -> bool:
    try:
        shape.decode(payload)
    except msgspec.DecodeError:
        return False
    return True


_ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=3),
    st.binary(max_size=10),
    st.lists(st.integers(0, 9), max_size=2),
)


def _mostly(sent: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    """What vLLM sends, nine times in ten; anything else otherwise."""
    return st.integers(0, 9).flatmap(lambda n: _ANY_VALUE if n == 9 else sent)


_HASH = st.one_of(st.integers(0, 2**64 - 1), st.integers(-(2**63), -1), st.binary(max_size=12))
_TOKENS = st.lists(st.integers(0, 2**40), min_size=1, max_size=3).map(lambda t: t * 16)
#: Per field: what vLLM sends, mostly, and now and then anything (a token id too).
_FIELDS: dict[str, st.SearchStrategy[object]] = {
    "block_hashes": _mostly(st.lists(_HASH, min_size=1, max_size=3)),
    "parent_block_hash": _mostly(st.one_of(st.none(), _HASH)),
    "token_ids": st.one_of(
        *[_TOKENS] * 6,
        st.tuples(_TOKENS, _ANY_VALUE).map(lambda t: [*t[0][:-1], t[1]]),
        _ANY_VALUE,
    ),
    "block_size": _mostly(st.sampled_from([16] * 8 + [0, -1])),
    "lora_id": _mostly(st.one_of(st.none(), st.integers(0, 3))),
    "medium": _mostly(st.sampled_from([None, "GPU", "cpu_tier"])),
    "lora_name": _mostly(st.one_of(st.none(), st.text(max_size=3))),
    "extra_keys": _mostly(st.one_of(st.none(), st.lists(st.none(), max_size=2))),
    "group_idx": _mostly(st.sampled_from([0, 1, None])),
    "kv_cache_spec_kind": _mostly(
        st.sampled_from(["full_attention", "mla_attention", "sliding_window", None])
    ),
}
_ORDER = {
    "BlockStored": list(_FIELDS),
    "BlockRemoved": ["block_hashes", "medium", "group_idx"],
    "AllBlocksCleared": [],
    "SomethingNew": ["medium"],
}


@st.composite
def _events(draw: st.DrawFn, array: bool) -> object:
    tag = draw(st.sampled_from([*_ORDER, "BlockStored", "BlockRemoved"]))
    names = _ORDER[tag]
    if array:
        kept = names[: draw(st.sampled_from([0, len(names) // 2] + [len(names)] * 6))]
        extra = draw(st.lists(_ANY_VALUE, max_size=2))
        return [tag, *(draw(_FIELDS[name]) for name in kept), *extra]
    fields = {n: draw(_FIELDS[n]) for n in names if draw(st.integers(0, 19)) > 0}
    if draw(st.booleans()):
        fields["remaining_copy_counts"] = draw(_ANY_VALUE)
    return {"type": tag, **fields}


@st.composite
def _payloads(draw: st.DrawFn) -> bytes:
    array = draw(st.booleans())
    events = draw(st.lists(_events(array), max_size=3))
    ts = draw(_mostly(st.one_of(st.floats(0, 2e9), st.integers(0, 2**31))))
    rank = draw(_mostly(st.one_of(st.none(), st.integers(0, 7))))
    envelope: object = draw(
        st.sampled_from(["three", "three", "three", "two", "map"]).map(
            lambda shape: {
                "three": [ts, events, rank],
                "two": [ts, events],
                "map": {"ts": ts, "events": events, "data_parallel_rank": rank},
            }[shape]
        )
    )
    return msgspec.msgpack.encode(envelope)


@given(_payloads())
@settings(max_examples=400, deadline=None)
def test_typed_and_field_by_field_decoding_agree_on_every_payload(payload: bytes) -> None:
    try:
        expected: kv_wire.Batch | None = kv_wire._decode_untyped(payload, 9)
    except MalformedFrame:
        expected = None
    try:
        got: kv_wire.Batch | None = decode_payload(payload, 9)
    except MalformedFrame:
        got = None
    assert got == expected
