"""The floor relay's de-chunker (benchmarks/floor.py): whatever the read boundaries, it gives
back exactly the payload, and says ``done`` exactly when the last byte arrived."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from benchmarks.floor import Dechunker


def _chunked(pieces: list[bytes]) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p)
    return body + b"0\r\n\r\n"


@given(
    pieces=st.lists(st.binary(min_size=1, max_size=40), max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_dechunker_undoes_chunking_at_any_read_boundaries(
    pieces: list[bytes], cuts: list[int]
) -> None:
    wire = _chunked(pieces)
    bounds = sorted({0, len(wire), *(c for c in cuts if c < len(wire))})
    dechunk = Dechunker()
    out = b""
    for start, end in itertools.pairwise(bounds):
        assert not dechunk.done
        out += dechunk.feed(wire[start:end])
    assert dechunk.done
    assert out == b"".join(pieces)


def test_dechunker_byte_by_byte_is_done_only_at_the_last_byte() -> None:
    wire = _chunked([b"data: 1\n\n", b"x" * 17, b"data: [DONE]\n\n"])
    dechunk = Dechunker()
    out = b""
    for i in range(len(wire)):
        assert not dechunk.done, i
        out += dechunk.feed(wire[i : i + 1])
    assert dechunk.done
    assert out == b"data: 1\n\n" + b"x" * 17 + b"data: [DONE]\n\n"
