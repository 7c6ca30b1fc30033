"""Measuring the labels of :mod:`.radix_tree`: common prefixes in characters, sizes in bytes.

Pure functions over ``str``; each does its work in C-level string operations (no loop per
character), because the tree calls them on every node of every walk.
"""

from __future__ import annotations

#: Characters encoded at a time when measuring a long non-ASCII text.
_SLICE = 1 << 20


def utf8(text: str) -> int:
    """The UTF-8 size of ``text`` (a lone surrogate counts 3 bytes), without encoding a huge
    text in one piece; O(1) for ASCII (a flag of the string in CPython)."""
    if text.isascii():
        return len(text)
    return sum(
        len(text[i : i + _SLICE].encode("utf-8", "surrogatepass"))
        for i in range(0, len(text), _SLICE)
    )


def common_len(label: str, text: str, pos: int) -> int:
    """Length of the common prefix of ``label`` and ``text[pos:]`` without a per-char loop.

    The common case (the whole label matches) is one ``startswith``. Otherwise a binary search
    that only re-compares the not-yet-confirmed half keeps the total work O(len(label)).
    """
    if text.startswith(label, pos):
        return len(label)
    lo = 0  # label[:lo] is known to match
    hi = min(len(label), len(text) - pos)  # the answer is at most hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(label[lo:mid], pos + lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


def head_chars(label: str, keep: int) -> int:
    """How many leading characters of ``label`` fit in ``keep`` bytes (0 < keep < its size);
    0 when not even the first does."""
    if label.isascii():
        return keep
    raw = label.encode("utf-8", "surrogatepass")
    while raw[keep] & 0xC0 == 0x80:  # inside a character: keep less, so the cut drops it whole
        keep -= 1
    return len(raw[:keep].decode("utf-8", "surrogatepass"))
