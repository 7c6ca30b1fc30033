"""Sizes in bytes as people write them: ``512MiB``, ``4MiB``, ``1GiB``, ``64KiB`` or plain bytes.

:func:`byte_size` is the argparse ``type`` of every size flag; :func:`show_size` is how
``--help`` and the configuration reference show a size, in the largest binary unit that divides it
exactly (``536870912`` shows as ``512MiB``), so what is shown parses back to the same number.

Units: ``KiB``, ``MiB``, ``GiB``, ``TiB`` are powers of 1024 (``Ki``, ``Mi``, ``Gi``, ``Ti`` too,
as Kubernetes writes them); ``kB``, ``MB``, ``GB``, ``TB`` are powers of 1000; ``B`` or no unit is
bytes. A unit's case must be as written here: ``mb`` is refused rather than guessed.
"""

from __future__ import annotations

import argparse
import re

__all__ = ["byte_size", "show_size"]

_BINARY = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_UNITS: dict[str, int] = {
    "": 1,
    "B": 1,
    **_BINARY,
    **{unit.removesuffix("B"): factor for unit, factor in _BINARY.items()},
    "kB": 1000,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def byte_size(text: str) -> int:
    """The number of bytes ``text`` names; a fraction must come to whole bytes (``1.5KiB``)."""
    match = _SIZE.fullmatch(text)
    if match is None or str(match[2]) not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes, or a number with a unit such as 512MiB, 4MiB,"
            " 1GiB, 64KiB (binary) or 500MB (decimal)"
        )
    number, unit = str(match[1]), str(match[2])
    factor = _UNITS[unit]
    if "." not in number:
        return int(number) * factor
    whole, fraction = number.split(".")
    scale: int = 10 ** len(fraction)
    numerator = (int(whole) * scale + int(fraction)) * factor
    if numerator % scale:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes")
    return numerator // scale


def show_size(size: int) -> str:
    """``size`` in the largest binary unit that divides it (``512MiB``), else in bytes."""
    for unit, factor in reversed(_BINARY.items()):
        if size and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)
