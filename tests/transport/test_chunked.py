"""ChunkedBody (the transport's chunked-body decoder): exact payload at any read boundaries,
``done`` exactly at the body's last byte, extensions and trailers skipped, bad framing refused."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_pdrouter.transport._chunked import ChunkedBody, ChunkedError


def encode(pieces: list[bytes], extensions: bool, trailers: list[bytes]) -> bytes:
    ext = b";name=value" if extensions else b""
    body = b"".join(b"%X%s\r\n%s\r\n" % (len(p), ext, p) for p in pieces if p)
    return body + b"0" + ext + b"\r\n" + b"".join(t + b"\r\n" for t in trailers) + b"\r\n"


@given(
    pieces=st.lists(st.binary(min_size=1, max_size=300), max_size=6),
    extensions=st.booleans(),
    trailers=st.lists(st.sampled_from([b"x-a: 1", b"x-usage: done"]), max_size=2),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=15),
)
def test_any_read_boundaries_give_the_payload_and_end_exactly_at_the_last_byte(
    pieces: list[bytes], extensions: bool, trailers: list[bytes], cuts: list[int]
) -> None:
    wire = encode(pieces, extensions, trailers)
    bounds = sorted({0, len(wire), *(c for c in cuts if c < len(wire))})
    body = ChunkedBody()
    out = b""
    for start, end in itertools.pairwise(bounds):
        assert not body.done
        out += body.feed(wire[start:end])
    assert body.done
    assert out == b"".join(pieces)
    assert body.extra == b""


def test_byte_by_byte() -> None:
    wire = encode([b"data: 1\n\n", b"data: [DONE]\n\n"], extensions=False, trailers=[])
    body = ChunkedBody()
    out = b""
    for i in range(len(wire)):
        assert not body.done
        out += body.feed(wire[i : i + 1])
    assert body.done
    assert out == b"data: 1\n\ndata: [DONE]\n\n"


def test_a_read_that_is_one_whole_chunk_returns_just_its_payload() -> None:
    body = ChunkedBody()
    assert body.feed(b"9\r\ndata: 1\n\n\r\n") == b"data: 1\n\n"
    assert body.feed(b"0\r\n\r\n") == b""
    assert body.done


def test_bytes_after_the_end_are_kept_as_extra() -> None:
    body = ChunkedBody()
    assert body.feed(b"3\r\nabc\r\n0\r\n\r\nHTTP/1.1") == b"abc"
    assert body.done
    assert body.extra == b"HTTP/1.1"


@pytest.mark.parametrize(
    "wire",
    [b"zz\r\n", b"\r\n", b"-1\r\n", b"3\r\nabcXY", b"11111111111111111\r\n", b"3 4\r\n"],
    ids=["not-hex", "empty-size", "negative", "no-crlf-after-data", "too-big", "space-inside"],
)
def test_bad_framing_is_refused(wire: bytes) -> None:
    with pytest.raises(ChunkedError):
        ChunkedBody().feed(wire)


def test_an_endless_size_line_is_refused() -> None:
    body = ChunkedBody()
    with pytest.raises(ChunkedError):
        for _ in range(10):
            body.feed(b"0" * 4000)


def _fed_bytewise(wire: bytes) -> tuple[bytes, bool] | str:
    body, out = ChunkedBody(), b""
    try:
        for i in range(len(wire)):
            out += body.feed(wire[i : i + 1])
    except ChunkedError:
        return "refused"
    return out, body.done


def _fed_whole(wire: bytes) -> tuple[bytes, bool] | str:
    body = ChunkedBody()
    try:
        out = body.feed(wire)
    except ChunkedError:
        return "refused"
    return out, body.done


@given(
    size=st.none() | st.integers(min_value=0, max_value=300),
    spelling=st.sampled_from(["%x", "%X", "%04x", "+%x", "0x%x", " %x", "%x ", "%x;e=1", "-%x"]),
    payload=st.binary(max_size=300),
    tail=st.sampled_from([b"\r\n", b"", b"\r", b"XY", b"\r\n3\r\nabc\r\n", b"\r\n0\r\n\r\n"]),
)
def test_a_read_of_one_whole_chunk_decodes_as_byte_by_byte_reads_do(
    size: int | None, spelling: str, payload: bytes, tail: bytes
) -> None:
    """A read that is exactly one chunk takes a shorter path: the same payload, the same
    refusals, whatever the size line says and whatever follows."""
    size = len(payload) if size is None else size  # mostly the size the payload has
    wire = (spelling % size).encode() + b"\r\n" + payload + tail
    assert _fed_whole(wire) == _fed_bytewise(wire)
