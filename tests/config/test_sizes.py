import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_pdrouter.config import byte_size, show_size


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("536870912", 536870912),
        ("512MiB", 512 * 1024 * 1024),
        ("4MiB", 4 * 1024 * 1024),
        ("1GiB", 1 << 30),
        ("64KiB", 65536),
        ("64Ki", 65536),
        ("2Ti", 2 << 40),
        ("100B", 100),
        ("500MB", 500_000_000),
        ("1kB", 1000),
        ("1.5KiB", 1536),
        (" 8 MiB ", 8 << 20),
    ],
)
def test_a_size_is_read_in_its_unit(text: str, size: int) -> None:
    assert byte_size(text) == size


@pytest.mark.parametrize(
    "text", ["", "MiB", "5mb", "5 mib", "-1", "1.5", "0.1KB0", "1e6", "1.0001KiB"]
)
def test_what_is_not_a_size_is_refused_with_a_reason(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"size|whole"):
        byte_size(text)


@pytest.mark.parametrize(
    ("size", "shown"),
    [(536870912, "512MiB"), (4194304, "4MiB"), (1 << 30, "1GiB"), (1536, "1536"), (0, "0")],
)
def test_a_size_is_shown_in_its_largest_exact_unit(size: int, shown: str) -> None:
    assert show_size(size) == shown


@given(st.integers(min_value=0, max_value=1 << 50))
def test_what_is_shown_reads_back_as_the_same_size(size: int) -> None:
    assert byte_size(show_size(size)) == size
