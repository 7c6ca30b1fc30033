"""Stranded prefill KV: blocks a prefill engine holds for a decode that will never pull them.

After a successful prefill leg the prefill engine keeps the request's KV blocks until a decode
engine pulls them, or until vLLM's KV timeout (480 s by default) frees them. When an attempt ends
with the blocks still there (:attr:`KvOwner.PREFILL <.lifecycle.KvOwner.PREFILL>`), the proxy
decides their fate from the request's state (see :mod:`.lifecycle`); :class:`KvReclaimer`
carries out a reclaim: it sends the attempt's decode endpoint a one-token request with the same
``kv_transfer_params``, which pulls the blocks and so frees them on the prefill engine now.

The reclaim outlives its request (whose client left), so it runs in the background nursery
given at construction. It is charged to the decode endpoint at once, synchronously, since the
engine is about to run it, and released when its first byte (proof that the blocks were pulled)
or its failure arrives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import httpx
import orjson
import trio

from ..endpoints import Endpoint
from ..ledger import Lease, LoadLedger
from ..observe import LegTrace
from . import bodies
from .request import Attempt, Request

log = logging.getLogger("trio_pdrouter.stranded")


class KvReclaimer:
    """Sends the one-token decode that frees a stranded prefill's KV blocks (module doc)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        ledger: LoadLedger,
        background: trio.Nursery,
        *,
        limit: float,
        upstream_api_key: str | None,
        on_reclaim: Callable[[Endpoint], None],
        on_refused: Callable[[Endpoint], None],
    ) -> None:
        self._client = client
        self._ledger = ledger
        self._background = background
        self._limit = limit
        self._upstream_api_key = upstream_api_key
        self._on_reclaim = on_reclaim
        self._on_refused = on_refused

    def reclaim(self, req: Request, attempt: Attempt, ep: Endpoint) -> None:
        """Start the reclaim of ``attempt``'s KV blocks on decode endpoint ``ep``; never awaits."""
        inf = req.inf
        content = orjson.dumps(bodies.stranded_decode_body(inf.body, req.kv_params, inf.path))
        headers = bodies.upstream_headers(
            inf.headers, attempt.request_id, ep, self._upstream_api_key
        )
        leg = None
        if req.trace is not None:  # a span of its own, ended when the pull ends
            leg = req.trace.leg("reclaim", ep, attempt.number)
            headers[b"traceparent"] = leg.traceparent.encode()
        # Charged now, synchronously: the engine is about to run this request, pulling the
        # prompt's KV blocks to generate one token.
        lease = self._ledger.lease(ep, tokens={ep: inf.key.prompt_tokens + 1})
        try:
            self._background.start_soon(
                self._pull, ep, ep.url + inf.path, content, headers, lease, leg
            )
        except RuntimeError:  # shutting down: the background nursery is closed
            lease.release_all()

    async def _pull(
        self,
        ep: Endpoint,
        url: str,
        content: bytes,
        headers: dict[bytes, bytes],
        lease: Lease,
        leg: LegTrace | None,
    ) -> None:
        outcome = "timeout"
        with lease, trio.move_on_after(self._limit):
            try:
                async with self._client.stream(
                    "POST", url, content=content, headers=headers
                ) as resp:
                    outcome = "ok" if resp.status_code == 200 else f"status_{resp.status_code}"
                    if resp.status_code != 200:
                        log.info("stranded_kv endpoint=%s status=%d", ep.key, resp.status_code)
                        self._on_refused(ep)
                    async for _ in resp.aiter_raw():
                        break  # the first byte: the blocks were pulled, or the refusal read
            except Exception as exc:  # background work: log and end, never take the router down
                outcome = type(exc).__name__
                log.info("stranded_kv endpoint=%s error=%s", ep.key, outcome)
        self._on_reclaim(ep)
        if leg is not None:
            leg.end(outcome)
