import pytest
import trio
import trio.testing

from trio_pdrouter import outcomes
from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.relay import IdleDeadline, RelayBuffer, RelayOverflow


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


@pytest.mark.parametrize("limit", [0.5, 3.0, 600.0])
async def test_idle_deadline_fires_between_limit_and_limit_plus_slack_after_the_last_touch(
    limit: float, autojump_clock: trio.testing.MockClock
) -> None:
    """Touched at irregular gaps below the limit, it never fires; after the last touch it
    fires no earlier than ``limit`` and no later than ``limit + slack``."""
    slack = min(1.0, limit / 16)
    idle = IdleDeadline(limit)
    last = trio.current_time()
    with idle.scope:
        for gap in [0.0, 0.3, 0.9, 0.5, 0.7, 0.2, 0.01] * 3:
            await trio.sleep(gap * limit)
            idle.touch()
            last = trio.current_time()
        await trio.sleep_forever()
    assert idle.scope.cancelled_caught
    assert limit <= trio.current_time() - last <= limit + slack + 1e-9


async def test_idle_deadline_without_a_limit_never_fires(
    autojump_clock: trio.testing.MockClock,
) -> None:
    idle = IdleDeadline(None)
    with idle.scope:
        idle.touch()
        await trio.sleep(10**6)
    assert not idle.scope.cancelled_caught
