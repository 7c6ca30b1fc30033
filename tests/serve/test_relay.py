import pytest
import trio
import trio.testing

from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.serve import (
    PIECE_BYTES,
    BufferBudget,
    IdleDeadline,
    RelayBuffer,
    RelayOverflow,
    outcomes,
)


async def test_writer_gets_everything_pending_in_one_piece() -> None:
    buffer = RelayBuffer(1000, BufferBudget(10_000))
    buffer.put(b"a")
    buffer.put(b"b")
    assert await buffer.take() == b"ab"
    buffer.put(b"c")
    buffer.close()
    assert await buffer.take() == b"c"
    assert await buffer.take() is None
    assert buffer.failure is None


async def test_writer_waits_for_data_then_sees_the_error() -> None:
    buffer = RelayBuffer(1000, BufferBudget(10_000))
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


def test_overflow_past_the_limit_and_never_over_it() -> None:
    budget = BufferBudget(10_000)
    buffer = RelayBuffer(3, budget)
    buffer.put(b"ab")
    with pytest.raises(RelayOverflow):
        buffer.put(b"cd")  # would be 4 bytes: refused whole
    assert buffer.queued == 2 and budget.total == 2


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


async def test_the_budget_counts_bytes_until_their_send_is_over_then_exactly_zero() -> None:
    budget = BufferBudget(100)
    a = RelayBuffer(1000, budget)
    a.put(b"x" * 10)
    assert budget.total == 10
    assert await a.take() == b"x" * 10
    assert budget.total == 10, "taken, but its send has not finished"
    a.put(b"y" * 5)
    assert await a.take() == b"y" * 5  # the first send finished
    assert budget.total == 5
    a.discard()
    a.discard()  # once only
    assert budget.total == 0


def test_past_the_budget_the_furthest_behind_open_stream_is_ended() -> None:
    budget = BufferBudget(100)
    behind, near, done = (RelayBuffer(1000, budget) for _ in range(3))
    behind.put(b"b" * 60)
    done.put(b"d" * 30)
    done.close()  # finished: its last bytes are not dropped
    near.put(b"n" * 10)  # 100: fits
    near.put(b"n")  # 101: the one furthest behind (and still open) is emptied
    assert budget.total == 41 and behind.queued == 0
    with pytest.raises(RelayOverflow, match="furthest behind"):
        behind.put(b"b")
    near.put(b"n" * 9)  # fits again
    with pytest.raises(RelayOverflow, match="furthest behind"):
        near.put(b"n" * 60)  # this stream itself is now the furthest behind
    for buffer in (behind, near, done):
        buffer.discard()
    assert budget.total == 0


async def test_a_long_backlog_goes_out_in_bounded_pieces_oldest_first() -> None:
    """A slow reader finishes each send, however far behind it is (issue: the write timeout
    cut readers that kept reading, because one send carried the whole backlog)."""
    budget = BufferBudget(10 * PIECE_BYTES)
    buffer = RelayBuffer(4 * PIECE_BYTES, budget)
    events = [bytes([65 + i % 26]) * 1000 for i in range(150)]  # 150 kB of events
    big = b"z" * (PIECE_BYTES + 10)  # one read larger than a piece
    for event in [*events, big]:
        buffer.put(event)
    buffer.close()
    sent = []
    while (piece := await buffer.take()) is not None:
        assert len(piece) <= PIECE_BYTES
        sent.append(piece)
        assert budget.total == buffer.queued + len(piece)  # in flight until the next take
    assert b"".join(sent) == b"".join([*events, big])
    assert len(sent) == 4 and budget.total == 0
    buffer.discard()
    assert budget.total == 0
