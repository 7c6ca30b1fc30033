"""The router's upstream HTTP transport: httpx as the client API, our own HTTP/1.1 pools below.

    import httpx
    from trio_pdrouter.transport import H11Transport

    client = httpx.AsyncClient(transport=H11Transport(max_connections_per_host=2048))

See `_transport` for the contract (read a response to its end, or close it: closing before
the end closes the upstream socket at once, which is how vLLM learns to abort), `_pool` for
the per-origin pool, `_connection` for one h11 connection, and `_send_side` for what a caller
sees and does of its request's sending side (written yet; a half-close).
"""

from ._connection import RECEIVE_SIZE
from ._send_side import SEND_SIDE, SendSide
from ._transport import H11ResponseStream, H11Transport, body_chunks

__all__ = [
    "RECEIVE_SIZE",
    "SEND_SIDE",
    "H11ResponseStream",
    "H11Transport",
    "SendSide",
    "body_chunks",
]
