"""The httpx client every leg uses, over the transport chosen by ``--upstream-transport``, and
the time limits it applies.

``h11`` (the default) is :class:`trio_pdrouter.transport.H11Transport`: one HTTP/1.1 pool per
upstream, and a synchronous socket close on any response not read to a clean end — which is what
makes vLLM abort the request. ``httpx`` is httpx's stock pool, kept for side-by-side benchmarks.

Time limits (see :class:`~trio_pdrouter.config.Timeouts`): the client's defaults bound every
socket operation by ``--request-timeout-secs``; a decode stream's request carries
:func:`stream_timeout` instead, so each read waits at most the idle limit. The legs add their own
deadlines around whole phases (prefill, first byte).
"""

from __future__ import annotations

import httpx

from .config import RouterConfig, Timeouts
from .transport import H11Transport


def client_timeout(t: Timeouts) -> httpx.Timeout:
    """The client's default limits on each connect, read, write and pool wait."""
    return httpx.Timeout(connect=t.connect, read=t.request, write=t.request, pool=t.request)


def stream_timeout(t: Timeouts) -> httpx.Timeout:
    """A decode stream's limits: every read and write within the idle limit."""
    return httpx.Timeout(
        connect=t.connect, read=t.idle_limit, write=t.idle_limit, pool=t.first_byte_limit
    )


class AnswerTooLarge(Exception):
    """An upstream's answer is larger than the router will hold in memory."""


async def post_capped(
    client: httpx.AsyncClient,
    url: str,
    *,
    content: bytes,
    headers: dict[bytes, bytes],
    cap: int,
) -> httpx.Response:
    """POST and read the whole answer, but never more than ``cap`` bytes of it.

    Raises :class:`AnswerTooLarge` past the cap (the connection is closed, not drained), or
    what httpx raises. The response returned holds its body.
    """
    request = client.build_request("POST", url, content=content, headers=headers)
    resp = await client.send(request, stream=True)
    try:
        body = await read_capped(resp, cap)
    finally:
        await resp.aclose()
    return httpx.Response(resp.status_code, headers=resp.headers, content=body, request=request)


async def read_capped(resp: httpx.Response, cap: int) -> bytes:
    """The rest of ``resp``'s body as sent (not decoded), at most ``cap`` bytes."""
    if resp.is_stream_consumed:  # built with its body in memory (a test's transport)
        if len(resp.content) > cap:
            raise AnswerTooLarge(f"answer larger than {cap} bytes")
        return resp.content
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.aiter_raw():
        size += len(chunk)
        if size > cap:
            raise AnswerTooLarge(f"answer larger than {cap} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def make_client(config: RouterConfig) -> httpx.AsyncClient:
    transport: httpx.AsyncBaseTransport
    if config.transport == "h11":
        transport = H11Transport()
    else:
        transport = httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=512)
        )
    return httpx.AsyncClient(
        transport=transport, timeout=client_timeout(config.timeouts), follow_redirects=False
    )
