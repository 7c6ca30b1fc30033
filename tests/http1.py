"""HTTP/1.1 answers as tests that speak raw sockets read them."""

from __future__ import annotations


def dechunk(raw: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response (``raw``: head and body as received)."""
    body = raw.split(b"\r\n\r\n", 1)[1]
    out = bytearray()
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2 :]
    return bytes(out)
