"""The httpx client every leg uses, over the transport chosen by ``--upstream-transport``, and
the time limits it applies.

A leg's POST goes straight to the client's transport (:meth:`LegClient.open_post`): httpx's
``build_request`` and ``send`` do per request what a leg never needs (parse the URL, merge the
client's default headers and cookies, run the auth and redirect flows, take cookies out of
every answer, which the next request would then send to every engine, and wrap the body stream
to time it). The request and the answer are still httpx's types; health probes, ``/v1/models``
and the rest use httpx's API as it is.

``h11`` (the default) is :class:`trio_pdrouter.transport.H11Transport`: one HTTP/1.1 pool per
upstream, and a synchronous socket close on any response not read to a clean end — which is what
makes vLLM abort the request. ``httpx`` is httpx's stock pool, kept for side-by-side benchmarks.

Time limits (see :class:`~trio_pdrouter.config.router.Timeouts`): the client's defaults bound every
socket operation by ``--request-timeout-secs``; a decode stream's request carries
:func:`stream_timeout` instead, so each read waits at most the idle limit. The legs add their own
deadlines around whole phases (prefill, first byte).
"""

from __future__ import annotations

import attrs
import httpx

from ..config import RouterConfig, Timeouts
from ..transport import SEND_SIDE, H11Transport, SendSide, body_chunks


def client_timeout(t: Timeouts) -> httpx.Timeout:
    """The client's default limits on each connect, read, write and pool wait."""
    return httpx.Timeout(connect=t.connect, read=t.request, write=t.request, pool=t.request)


def stream_timeout(t: Timeouts) -> httpx.Timeout:
    """A decode stream's limits: every read and write within the idle limit."""
    return httpx.Timeout(
        connect=t.connect, read=t.idle_limit, write=t.idle_limit, pool=t.first_byte_limit
    )


#: Distinct upstream URLs whose parsed form :class:`LegClient` keeps (endpoints x paths).
URLS_KEPT = 4096
#: httpx's own default limits, for a client built without any.
DEFAULT_TIMEOUT = httpx.Timeout(5.0)


class LegClient(httpx.AsyncClient):
    """httpx's client, plus :meth:`open_post` for the legs (the module doc)."""

    def __init__(
        self,
        *,
        transport: httpx.AsyncBaseTransport,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(transport=transport, timeout=timeout, follow_redirects=False)
        self._leg_transport = transport
        self._leg_timeout = timeout.as_dict()
        self._leg_urls: dict[str, tuple[httpx.URL, bytes]] = {}

    async def open_post(
        self,
        url: str,
        content: bytes,
        headers: dict[bytes, bytes],
        limits: dict[str, float | None] | None = None,
        side: SendSide | None = None,
    ) -> httpx.Response:
        """POST ``content`` to ``url`` with ``headers`` (and ``Host``, ``Content-Length``);
        returns once the answer's head has arrived. The caller reads its body to the end or
        closes it. ``limits``: an ``httpx.Timeout.as_dict()`` made once by the caller; the
        client's if not given. ``side``: the request's sending side (written yet; a
        half-close), see :class:`~trio_pdrouter.transport.SendSide`."""
        target = self._leg_urls.get(url)
        if target is None:
            if len(self._leg_urls) >= URLS_KEPT:
                self._leg_urls.clear()
            parsed = httpx.URL(url)
            target = self._leg_urls[url] = (parsed, parsed.netloc)
        parsed, host = target
        request = httpx.Request(
            "POST",
            parsed,
            headers=[
                (b"host", host),
                *headers.items(),
                (b"content-length", b"%d" % len(content)),
            ],
            stream=httpx.ByteStream(content),
            extensions={"timeout": self._leg_timeout if limits is None else limits},
        )
        if side is not None:
            request.extensions[SEND_SIDE] = side
        request.read()  # the body is in memory: ``request.content`` works as httpx's does
        response = await self._leg_transport.handle_async_request(request)
        if side is not None:
            side.written = True  # a head answers a request the server has read
        response.request = request
        return response


class AnswerTooLarge(Exception):
    """An upstream's answer is larger than the router will hold in memory."""


@attrs.frozen
class Answer:
    """A whole upstream answer: its status, headers and body as sent."""

    status_code: int
    headers: httpx.Headers
    content: bytes


async def post_capped(
    client: LegClient,
    url: str,
    *,
    content: bytes,
    headers: dict[bytes, bytes],
    cap: int,
    side: SendSide | None = None,
) -> Answer:
    """POST and read the whole answer, but never more than ``cap`` bytes of it (``side``: as
    :meth:`LegClient.open_post`'s).

    Raises :class:`AnswerTooLarge` past the cap (the connection is closed, not drained), or
    what httpx raises.
    """
    resp = await client.open_post(url, content, headers, side=side)
    try:
        body = await read_capped(resp, cap)
    finally:
        await resp.aclose()
    return Answer(resp.status_code, resp.headers, body)


async def read_capped(resp: httpx.Response, cap: int) -> bytes:
    """The rest of ``resp``'s body as sent (not decoded), at most ``cap`` bytes."""
    if resp.is_stream_consumed:  # built with its body in memory (a test's transport)
        if len(resp.content) > cap:
            raise AnswerTooLarge(f"answer larger than {cap} bytes")
        return resp.content
    chunks: list[bytes] = []
    size = 0
    async for chunk in body_chunks(resp):
        size += len(chunk)
        if size > cap:
            raise AnswerTooLarge(f"answer larger than {cap} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def make_client(config: RouterConfig) -> LegClient:
    transport: httpx.AsyncBaseTransport
    if config.transport == "h11":
        transport = H11Transport()
    else:
        transport = httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=512)
        )
    return LegClient(transport=transport, timeout=client_timeout(config.timeouts))
