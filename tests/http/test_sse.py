import orjson
from hypothesis import given
from hypothesis import strategies as st

from trio_pdrouter.http import DONE, EventFramer, EventTooLarge, error_event, errors

LIMIT = 1024
EVENTS = [b'data: {"n": %d}\n\n' % i for i in range(5)] + [DONE]


def test_whole_events_pass_through_unchanged() -> None:
    framer = EventFramer(LIMIT)
    chunk = b"".join(EVENTS)
    assert framer.feed(chunk) is chunk
    assert framer.saw_done
    assert framer.pending == b""


def test_partial_event_is_held_until_its_end_arrives() -> None:
    framer = EventFramer(LIMIT)
    assert framer.feed(b'data: {"a"') == b""
    assert framer.pending == b'data: {"a"'
    assert framer.feed(b": 1}\n\ndata: 2") == b'data: {"a": 1}\n\n'
    assert framer.pending == b"data: 2"
    assert not framer.saw_done


@given(st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_any_split_of_a_stream_relays_exactly_the_whole_events(cuts: list[int]) -> None:
    stream = b"".join(EVENTS)
    points = sorted({min(c, len(stream)) for c in cuts})
    pieces = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    framer = EventFramer(LIMIT)
    out = b"".join(framer.feed(p) for p in pieces)
    assert out == stream
    assert framer.saw_done
    assert framer.pending == b""
    # Nothing relayed ever ends mid-event.
    framer = EventFramer(LIMIT)
    for piece in pieces:
        relayed = framer.feed(piece)
        assert relayed == b"" or relayed.endswith(b"\n\n")


def test_error_event_is_an_openai_error_then_done() -> None:
    payload = error_event(errors.upstream_failed("decode", "dropped the connection"))
    first, rest = payload.split(b"\n\n", 1)
    assert first.startswith(b"data: ")
    body = orjson.loads(first[len(b"data: ") :])
    assert body["error"]["code"] == 502
    assert body["error"]["type"] == "upstream_error"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert rest == DONE


def test_a_separator_split_across_two_reads_ends_the_event() -> None:
    framer = EventFramer(LIMIT)
    assert framer.feed(b"data: 1\n") == b""
    assert framer.feed(b"\ndata: 2") == b"data: 1\n\n"
    assert framer.pending == b"data: 2"


def test_an_event_that_never_ends_is_refused_past_the_limit() -> None:
    framer = EventFramer(LIMIT)
    assert framer.feed(b"data: ok\n\n") == b"data: ok\n\n"
    fed = 0
    try:
        while fed <= 10 * LIMIT:  # bounded: an endless upstream line
            framer.feed(b"x" * 100)
            fed += 100
    except EventTooLarge:
        pass
    else:
        raise AssertionError("an endless line was held without limit")
    assert fed <= LIMIT < fed + 100  # refused by the read that crossed the limit


@given(st.lists(st.integers(min_value=0, max_value=200), max_size=12), st.integers(1, 300))
def test_events_up_to_the_limit_pass_whatever_the_split(cuts: list[int], size: int) -> None:
    event = b"data: " + b"y" * size + b"\n\n"
    stream = event * 3
    points = sorted({min(c, len(stream)) for c in cuts})
    pieces = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    framer = EventFramer(len(event))
    assert b"".join(framer.feed(p) for p in pieces) == stream
