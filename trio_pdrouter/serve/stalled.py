"""Clients that accept nothing: their requests end and their connections are cut.

hypercorn shields each send to a client, so a client that stays connected but stops reading
holds its request's task in one send forever: the decode load is released (the relay's reader
owns it), but the buffered answer and the connection stay. :class:`StallWatch` ends them.

Rules:

* A request is stalled when one send to its client has been under way, with no send finished
  since, for ``timeout`` seconds (``--client-write-timeout-secs``). A client that reads slowly
  finishes sends and is never cut; only one that accepts nothing is.
* The watch looks at every request in flight every ``timeout / 4`` seconds, so a stalled client
  is cut between ``timeout`` and ``1.25 * timeout`` after its last send finished. It costs the
  relay nothing per event: :class:`~trio_pdrouter.http.asgi.Downstream` only counts its sends.
* Cutting is :meth:`~.request.Request.stalled`: the request steps ``CLIENT_STALLED`` (the access
  line and metrics say ``client_stalled``), its scope is cancelled, and its connection closed.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

import trio

from .request import Request

log = logging.getLogger("trio_pdrouter.stalls")


class StallWatch:
    """Cuts off the clients of ``requests`` that accept nothing for ``timeout`` seconds."""

    def __init__(self, timeout: float, requests: Collection[Request]) -> None:
        self._timeout = timeout
        self._requests = requests
        #: Per request seen sending: its finished-send count then, and when it was first seen.
        self._seen: dict[Request, tuple[int, float]] = {}

    async def run(self) -> None:
        while True:
            await trio.sleep(self._timeout / 4)
            self.sweep()

    def sweep(self) -> None:
        """One look at every request (see the module doc)."""
        now = trio.current_time()
        seen: dict[Request, tuple[int, float]] = {}
        for req in list(self._requests):
            down = req.down
            if not down.sending:
                continue
            done, since = self._seen.get(req, (-1, now))
            if done != down.sends_done:
                since = now
            elif now - since >= self._timeout:
                log.warning(
                    "request_id=%s client accepted nothing for %.0fs: connection cut",
                    req.inf.request_id,
                    now - since,
                )
                req.stalled()
                continue
            seen[req] = (down.sends_done, since)
        self._seen = seen
