import pytest
import trio
import trio.testing

from trio_pdrouter import outcomes
from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.relay import RelayBuffer, RelayOverflow


async def test_writer_gets_everything_pending_in_one_piece() -> None:
    buffer = RelayBuffer(limit=1000)
    buffer.put(b"a")
    buffer.put(b"b")
    assert await buffer.take() == b"ab"
    buffer.put(b"c")
    buffer.close()
    assert await buffer.take() == b"c"
    assert await buffer.take() is None
    assert buffer.failure is None


async def test_writer_waits_for_data_then_sees_the_error() -> None:
    buffer = RelayBuffer(limit=1000)
    got: list[bytes | None] = []

    async def writer() -> None:
        while (data := await buffer.take()) is not None:
            got.append(data)
        got.append(None)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer)
        await trio.testing.wait_all_tasks_blocked()
        buffer.put(b"x")
        await trio.testing.wait_all_tasks_blocked()
        err = outcomes.invalid("decode", Endpoint("http://e:1", Role.DECODE), "no [DONE]")
        buffer.close(err)
        buffer.close(None)  # the first close wins
    assert got == [b"x", None]
    assert buffer.failure is err


def test_overflow_past_the_limit() -> None:
    buffer = RelayBuffer(limit=3)
    buffer.put(b"abc")
    with pytest.raises(RelayOverflow):
        buffer.put(b"d")
