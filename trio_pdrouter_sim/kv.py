"""NIXL KV-transfer bookkeeping: blocks a prefill engine holds for a decode server.

vLLM's NIXL connector, on a request with ``kv_transfer_params.do_remote_decode = true``,
prefills, answers with one token and ``kv_transfer_params`` naming its engine and blocks, and
keeps those blocks until the decode server has read them, or until a timeout frees them
(``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``). Here the "read" is a small HTTP call: the decode
simulator sends ``POST /sim/kv/pull`` to ``remote_host:remote_port`` with
``{"remote_request_id", "remote_engine_id", "remote_block_ids"}``; the prefill simulator
answers 200 ``{"blocks": n}`` and frees the blocks, or 404 when it holds nothing under that id
(never sent, already pulled, or expired). Expired holds count as ``kv_blocks_leaked``.

The ends of a decode request, as vLLM's NIXL connector has them
(``NixlConnectorScheduler.request_finished`` on the decode side; the pull scheduler in newer
versions): a decode request that received its ``kv_transfer_params`` and is aborted before it
read the blocks (still waiting to be scheduled) tells the prefill to free them, here
``POST /sim/kv/free`` (``kv_blocks_freed``); one aborted while reading lets the read finish,
which frees them as a pull does. A pull of blocks this server held once and let go of (pulled,
freed or expired) is a second read of block ids that may hold another request's KV now: it fails
(404) and counts as ``kv_second_pulls`` on the engine that held them.

The pull is one HTTP/1.1 request on a fresh connection (h11 over ``trio.open_tcp_stream``),
bounded by a timeout: no pool whose behaviour under load could distort a benchmark.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import Any

import attrs
import h11
import orjson
import trio

from .engine import Engine

PULL_PATH = "/sim/kv/pull"
FREE_PATH = "/sim/kv/free"
#: Ids of holds let go of, remembered to tell a second pull from a pull of nothing.
ENDED_REMEMBERED = 100_000


@attrs.define
class Hold:
    """Blocks one prefill request keeps for its decode side."""

    request_id: str
    engine: Engine
    block_ids: list[int]
    expiry: trio.CancelScope = attrs.field(factory=trio.CancelScope)


class KvStore:
    """The holds of one server, by ``remote_request_id``."""

    def __init__(self, engine_id_prefix: str, timeout_s: float) -> None:
        self.engine_id_prefix = engine_id_prefix
        self.timeout_s = timeout_s
        self._holds: dict[str, Hold] = {}
        self._next_block: dict[int, int] = {}
        #: Holds let go of (pulled, freed or expired): request id -> the engine that held them.
        self._ended: OrderedDict[str, Engine] = OrderedDict()

    def engine_id(self, engine: Engine) -> str:
        """The ``remote_engine_id`` this server advertises for ``engine``."""
        return f"{self.engine_id_prefix}-dp{engine.rank}"

    def hold(self, engine: Engine, blocks: int, nursery: trio.Nursery) -> Hold:
        """Keep ``blocks`` blocks on ``engine`` until pulled or until the timeout (then leaked).

        A timeout of 0 keeps them until pulled.
        """
        first = self._next_block.get(engine.rank, 0)
        self._next_block[engine.rank] = first + blocks
        hold = Hold(uuid.uuid4().hex, engine, list(range(first, first + blocks)))
        self._holds[hold.request_id] = hold
        engine.kv_blocks_held += blocks
        if self.timeout_s > 0:
            nursery.start_soon(self._expire, hold)
        return hold

    async def _expire(self, hold: Hold) -> None:
        with hold.expiry:
            await trio.sleep(self.timeout_s)
            if self._end(hold.request_id) is not None:
                hold.engine.counters.kv_blocks_leaked += len(hold.block_ids)

    def pull(self, request_id: str, engine_id: str | None) -> Hold | None:
        """Release the hold ``request_id`` (the decode side read it); None if there is none, a
        second pull counted when it was held once."""
        hold = self._holds.get(request_id)
        if hold is None:
            ended = self._ended.get(request_id)
            if ended is not None:
                ended.counters.kv_second_pulls += 1
            return None
        if engine_id is not None and engine_id != self.engine_id(hold.engine):
            return None
        return self._end(request_id)

    def free(self, request_id: str) -> Hold | None:
        """The decode side was aborted before it read hold ``request_id``: free its blocks."""
        hold = self._end(request_id)
        if hold is not None:
            hold.engine.counters.kv_blocks_freed += len(hold.block_ids)
        return hold

    def _end(self, request_id: str) -> Hold | None:
        hold = self._holds.pop(request_id, None)
        if hold is None:
            return None
        hold.engine.kv_blocks_held -= len(hold.block_ids)
        hold.expiry.cancel()
        self._ended[request_id] = hold.engine
        if len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)
        return hold

    def __len__(self) -> int:
        return len(self._holds)


async def pull_remote(
    host: str, port: int, payload: dict[str, Any], timeout_s: float, path: str = PULL_PATH
) -> bool:
    """Ask the prefill server at ``host:port`` for the blocks in ``payload`` (``path``
    :data:`FREE_PATH`: tell it to free them instead).

    True when it answered 200. Any failure (refused, reset, timeout, 404) is False: the caller
    then prefills locally, as vLLM's decode side recomputes when a KV transfer fails.
    """
    body = orjson.dumps(payload)
    conn = h11.Connection(h11.CLIENT)
    request = h11.Request(
        method="POST",
        target=path,
        headers=[
            ("Host", f"{host}:{port}"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            ("Connection", "close"),
        ],
    )
    wire = conn.send(request) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
    status = 0
    with trio.move_on_after(timeout_s):
        try:
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                await stream.send_all(wire)
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        conn.receive_data(await stream.receive_some(65536))
                    elif isinstance(event, h11.Response):
                        status = event.status_code
                    elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                        break
        except (OSError, trio.BrokenResourceError, h11.ProtocolError):
            return False
        return status == 200
    return False
