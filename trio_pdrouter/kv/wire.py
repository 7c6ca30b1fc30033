"""vLLM's KV-event frames, decoded by field name into :class:`Batch` (no I/O).

One ZMQ message is three frames: a topic, an 8-byte big-endian sequence number, and a msgpack
payload ``[ts, events, data_parallel_rank]`` (a map ``{"ts", "events", "data_parallel_rank"}``
is accepted too, and a two-element array without the rank). Each event is either a map tagged
``"type"`` (current vLLM) or a positional array ``[tag, field, ...]`` (vLLM up to about 0.23),
in the field order vLLM declared:

* ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...
* ``BlockRemoved``: block_hashes, medium, group_idx, ...
* ``AllBlocksCleared``: no fields.

The rules:

* Fields are read by name; unknown fields and unknown event types are ignored (the schema has
  grown six times in a year); a missing field takes vLLM's default.
* A block hash is an integer (uint64) or bytes (the full digest when vLLM's int hashes are off);
  bytes fold to their last 8 bytes, as vLLM's int mode does, so both modes give one id.
* A store that is not plain full-attention group 0 without extra keys or LoRA is decoded with
  ``indexable=False``: the index skips it and counts it. Its hashes are kept, so a later remove
  of them is recognised.
* Anything that is not the format above raises :class:`MalformedFrame`, never anything else: the
  caller counts it and carries on.

The payload is decoded with :mod:`msgspec.msgpack` (measured faster than ``msgpack`` on
realistic batches: ``python -m benchmarks.kv_decode``), first typed, in one of the two shapes
vLLM sends (``[ts, events, rank]`` with events all maps, or all arrays, of the three known
types): msgspec then checks every token id in C, where the router would in Python. A
payload that neither shape takes (an unknown event type, another envelope, a token id that is
not an integer, anything malformed) is read untyped, field by field, by the rules above, which
decide; whenever both ways take a payload they give the same batch (tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import msgspec

__all__ = [
    "GPU",
    "AllBlocksCleared",
    "Batch",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "MalformedFrame",
    "decode_message",
    "decode_payload",
    "fold_hash",
]

_MASK = (1 << 64) - 1
#: The medium of a block on the engine's GPU (an event without a medium is one).
GPU = "GPU"
_FULL_ATTENTION = ("full_attention", "mla_attention")

_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class _StoredFields(msgspec.Struct):
    """A ``BlockStored`` in the typed shapes (the fields the rules read, in vLLM's order)."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: Any = None
    medium: Any = None
    lora_name: Any = None
    extra_keys: Any = None
    group_idx: Any = 0
    kv_cache_spec_kind: Any = "full_attention"


class _RemovedFields(msgspec.Struct):
    block_hashes: list[int | bytes]
    medium: Any = None
    group_idx: Any = 0


class _ClearedFields(msgspec.Struct):
    pass


class _StoredMap(_StoredFields, tag_field="type", tag="BlockStored"):
    pass


class _RemovedMap(_RemovedFields, tag_field="type", tag="BlockRemoved"):
    pass


class _ClearedMap(_ClearedFields, tag_field="type", tag="AllBlocksCleared"):
    pass


class _StoredArray(_StoredFields, tag_field="type", tag="BlockStored", array_like=True):
    pass


class _RemovedArray(_RemovedFields, tag_field="type", tag="BlockRemoved", array_like=True):
    pass


class _ClearedArray(_ClearedFields, tag_field="type", tag="AllBlocksCleared", array_like=True):
    pass


#: The two typed shapes (module doc), current vLLM's first.
_TYPED = (
    msgspec.msgpack.Decoder(tuple[float, list[_StoredMap | _RemovedMap | _ClearedMap], int | None]),
    msgspec.msgpack.Decoder(
        tuple[float, list[_StoredArray | _RemovedArray | _ClearedArray], int | None]
    ),
)


class MalformedFrame(ValueError):
    """A message that is not a KV-event batch; the message says what was wrong."""


@attrs.frozen
class BlockStored:
    """Full blocks an engine cached: ``token_ids`` are exactly those blocks' tokens."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str
    indexable: bool


@attrs.frozen
class BlockRemoved:
    """Blocks an engine evicted, one hash per physical copy."""

    block_hashes: tuple[int, ...]
    medium: str


@attrs.frozen
class AllBlocksCleared:
    """The engine emptied its prefix cache."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@attrs.frozen
class Batch:
    """One published batch: its sequence number, timestamp, events and DP rank (if sent)."""

    seq: int
    ts: float
    events: tuple[Event, ...]
    rank: int | None

    @property
    def clears(self) -> bool:
        """Whether the engine emptied its prefix cache in this batch."""
        return any(isinstance(e, AllBlocksCleared) for e in self.events)


def fold_hash(value: object) -> int:
    """A block hash as vLLM's int mode sends it: uint64, or bytes folded to the last 8."""
    if type(value) is int:
        return value & _MASK
    if isinstance(value, bytes) and value:
        return int.from_bytes(value[-8:], "big")
    raise MalformedFrame(f"a block hash must be an integer or bytes, not {value!r:.40}")


def _fields(raw: object, names: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """The tag and named fields of one event in either layout."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise MalformedFrame(f"an event must be a map or an array, not {raw!r:.40}")
    if not isinstance(tag, str):
        raise MalformedFrame(f"an event needs a string type tag, not {tag!r:.40}")
    return tag, fields


def _hashes(value: object) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise MalformedFrame("block_hashes must be an array")
    return tuple([h & _MASK if type(h) is int else fold_hash(h) for h in value])


def _medium(value: object) -> str:
    if value is None:
        return GPU
    if not isinstance(value, str):
        raise MalformedFrame("medium must be a string")
    return value.upper()


def _stored(fields: dict[str, Any], *, typed: bool = False) -> BlockStored:
    """The event of a ``BlockStored``'s fields; ``typed``: decoded typed, every token id an
    integer already."""
    hashes = _hashes(fields.get("block_hashes"))
    parent = fields.get("parent_block_hash")
    block_size = fields.get("block_size")
    tokens = fields.get("token_ids")
    if type(block_size) is not int or block_size < 1:
        raise MalformedFrame("block_size must be a positive integer")
    if not isinstance(tokens, list):
        raise MalformedFrame("token_ids must be an array")
    plain = typed or all(type(t) is int for t in tokens)
    extra = fields.get("extra_keys")
    no_extra = extra is None or (isinstance(extra, list) and all(k is None for k in extra))
    indexable = (
        plain
        and no_extra
        and len(tokens) == block_size * len(hashes)
        and fields.get("lora_id") is None
        and fields.get("lora_name") is None
        and fields.get("group_idx", 0) in (0, None)
        and fields.get("kv_cache_spec_kind", "full_attention") in (*_FULL_ATTENTION, None)
    )
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else fold_hash(parent),
        token_ids=tuple(tokens) if plain else (),
        block_size=block_size,
        medium=_medium(fields.get("medium")),
        indexable=indexable,
    )


def _event(raw: object) -> Event | None:
    tag, _ = _fields(raw, ())
    if tag == "BlockStored":
        return _stored(_fields(raw, _STORED_FIELDS)[1])
    if tag == "BlockRemoved":
        return _removed(_fields(raw, _REMOVED_FIELDS)[1])
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # an event type this router does not know: ignored


def _removed(fields: dict[str, Any]) -> BlockRemoved | None:
    if fields.get("group_idx", 0) not in (0, None):
        return None
    return BlockRemoved(_hashes(fields.get("block_hashes")), _medium(fields.get("medium")))


def _typed_event(raw: msgspec.Struct) -> Event | None:
    fields = msgspec.structs.asdict(raw)
    if isinstance(raw, _StoredFields):
        return _stored(fields, typed=True)
    if isinstance(raw, _RemovedFields):
        return _removed(fields)
    return AllBlocksCleared()


def decode_payload(payload: bytes, seq: int = 0) -> Batch:
    """The batch in one msgpack payload (see the module doc for the layouts)."""
    for shape in _TYPED:
        try:
            ts, typed, rank = shape.decode(payload)
        except (msgspec.DecodeError, ValueError, TypeError):  # not this shape
            continue
        found = (_typed_event(raw_event) for raw_event in typed)
        return Batch(seq=seq, ts=ts, events=tuple(e for e in found if e is not None), rank=rank)
    return _decode_untyped(payload, seq)


def _decode_untyped(payload: bytes, seq: int) -> Batch:
    """:func:`decode_payload` field by field: every shape the module doc accepts."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise MalformedFrame(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) in (2, 3):
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) == 3 else None
    else:
        raise MalformedFrame("the payload must be [ts, events, data_parallel_rank]")
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise MalformedFrame("ts must be a number")
    if not isinstance(events, list):
        raise MalformedFrame("events must be an array")
    if rank is not None and type(rank) is not int:
        raise MalformedFrame("data_parallel_rank must be an integer")
    decoded = tuple(e for e in (_event(raw_event) for raw_event in events) if e is not None)
    return Batch(seq=seq, ts=float(ts), events=decoded, rank=rank)


def decode_message(frames: Sequence[bytes]) -> Batch:
    """The batch in one live message ``[topic, seq, payload]``."""
    if len(frames) != 3:
        raise MalformedFrame(f"a message has 3 frames (topic, seq, payload), not {len(frames)}")
    seq_frame = frames[1]
    if len(seq_frame) != 8:
        raise MalformedFrame("the sequence number must be 8 bytes")
    return decode_payload(frames[2], int.from_bytes(seq_frame, "big", signed=True))
