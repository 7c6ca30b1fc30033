"""The httpx client every leg uses, over the transport chosen by ``--upstream-transport``.

``h11`` (the default) is :class:`trio_pdrouter.transport.H11Transport`: one HTTP/1.1 pool per
upstream, and a synchronous socket close on any response not read to a clean end — which is what
makes vLLM abort the request. ``httpx`` is httpx's stock pool, kept for side-by-side benchmarks.
"""

from __future__ import annotations

import httpx

from .config import RouterConfig
from .transport import H11Transport


def make_client(config: RouterConfig) -> httpx.AsyncClient:
    timeout = httpx.Timeout(
        connect=config.timeouts.connect,
        read=config.timeouts.request,
        write=config.timeouts.request,
        pool=config.timeouts.request,
    )
    transport: httpx.AsyncBaseTransport
    if config.transport == "h11":
        transport = H11Transport()
    else:
        transport = httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=512)
        )
    return httpx.AsyncClient(transport=transport, timeout=timeout, follow_redirects=False)
