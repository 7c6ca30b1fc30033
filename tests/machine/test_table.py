"""The machine table's slots (held, let go, reclaimed) and its change log (snapshot and tail)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from trio_pdrouter.machine import COUNT, VERDICT, MachineTable, TableFull


@pytest.fixture
def table(tmp_path: Path) -> Iterator[MachineTable]:
    t = MachineTable.create(2, str(tmp_path / "lock"), slots=3, log_entries=4)
    yield t
    t.destroy()


@pytest.fixture
def other(table: MachineTable) -> Iterator[MachineTable]:
    """Another worker's attachment."""
    view = MachineTable.attach(table.name, table.lock_path)
    yield view
    view.close()


def test_a_key_has_one_slot_whoever_holds_it(table: MachineTable, other: MachineTable) -> None:
    a = table.hold(0, "decode http://d:1")
    b = other.hold(1, "decode http://d:1")
    assert a == b and table.holders() == {"decode http://d:1": 2}


def test_a_slot_is_reused_only_once_every_holder_let_go_and_then_starts_from_zero(
    table: MachineTable, other: MachineTable
) -> None:
    for i in range(3):
        table.hold(0, f"decode http://d:{i}")
    slot = other.hold(1, "decode http://d:0")
    other.add(1, slot, COUNT, 1)
    table.put(0, slot, VERDICT, 1)
    table.let_go(0, "decode http://d:0")
    with pytest.raises(TableFull):
        table.hold(0, "decode http://d:9")  # row 1 still holds it
    other.add(1, slot, COUNT, -1)
    other.let_go(1, "decode http://d:0")
    assert table.hold(0, "decode http://d:9") == slot
    assert table.total(slot, COUNT) == 0 and table.cell(0, slot, VERDICT) == 0
    assert set(table.holders()) == {"decode http://d:9", "decode http://d:1", "decode http://d:2"}


def test_a_full_table_refuses_and_can_still_be_closed(tmp_path: Path) -> None:
    t = MachineTable.create(1, str(tmp_path / "lock"), slots=1)
    t.hold(0, "decode http://d:1")
    try:
        t.hold(0, "decode http://d:2")
    except TableFull as exc:
        kept = exc  # its traceback keeps the frames of the search alive
    assert t.holders() == {"decode http://d:1": 1}
    t.destroy()  # no view of the block is left exported
    assert kept.__traceback__ is not None


def test_check_room_counts_the_slots_its_keys_already_have(table: MachineTable) -> None:
    table.hold(0, "decode http://d:1")
    table.hold(0, "decode http://d:4")
    table.hold(0, "decode http://d:0")
    table.let_go(0, "decode http://d:0")  # its slot is free, still under its key
    table.check_room(["decode http://d:0"])
    table.check_room(["decode http://d:2"])
    # d:0 would take its own slot back, the only free one: none is left for d:2
    with pytest.raises(TableFull, match="0 free slots of 3, 1 needed"):
        table.check_room(["decode http://d:0", "decode http://d:2"])


def test_a_dead_workers_holds_stay_until_its_replacement_keeps_what_it_uses(
    table: MachineTable, other: MachineTable
) -> None:
    other.hold(1, "decode http://d:0")
    slot = other.hold(1, "decode http://d:1")
    other.add(1, slot, COUNT, 2)
    table.zero_row(1)  # the supervisor, after worker 1 died
    assert table.total(slot, COUNT) == 0
    assert set(table.holders()) == {"decode http://d:0", "decode http://d:1"}
    replacement = MachineTable.attach(table.name, table.lock_path)
    try:
        replacement.hold(1, "decode http://d:1")
        replacement.keep_only(1)
        assert table.holders() == {"decode http://d:1": 1}
    finally:
        replacement.close()


def test_the_log_is_a_snapshot_and_a_tail_and_a_reader_behind_the_base_starts_again(
    table: MachineTable,
) -> None:
    assert table.room == 4
    for change in ("add a", "remove a", "add b"):
        table.append_change(change)
    assert table.changes(1).entries == ["remove a", "add b"]
    assert not table.changes(1).reset and table.changes(1).generation == 3
    table.compact(["add b"])  # the state at generation 3
    assert table.room == 3
    assert table.append_change("add c") == 4
    assert table.changes(3).entries == ["add c"] and not table.changes(3).reset
    assert table.changes(4).entries == []
    behind = table.changes(2)
    assert behind.reset and behind.entries == ["add b", "add c"] and behind.generation == 4
    for change in ("add d", "add e"):
        table.append_change(change)
    with pytest.raises(TableFull):
        table.append_change("add f")
    with pytest.raises(TableFull):
        table.compact(["add b", "add c", "add d", "add e"])  # no room left after it
    assert table.changes(3).entries == ["add c", "add d", "add e"], "a refused compaction"
