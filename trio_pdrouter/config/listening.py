"""How the router listens, and its time limits: the ``--host``/``--port`` and timeout sections.

Each field that a flag sets declares it (see :mod:`.flags`); :class:`~.router.RouterConfig`
holds one of each section.
"""

from __future__ import annotations

import attrs

from .flags import Flag, Group, must, positive, setting

WORKER_SOCKETS = ("shared", "reuseport")


@attrs.frozen
class ServerSettings:
    """How hypercorn listens."""

    host: str = setting("127.0.0.1", Flag("--host", Group.LISTENING, "address to listen on"))
    port: int = setting(
        30000,
        Flag("--port", Group.LISTENING, "port to listen on (0: any free port)", type=int),
        check=must(lambda p: 0 <= p <= 65535, "must be a port number, 0 to 65535"),
    )
    backlog: int = setting(2048, Flag("--backlog", Group.LISTENING, "listen backlog", type=int))
    keep_alive_timeout: float = setting(
        75.0,
        Flag(
            "--keep-alive-timeout-secs",
            Group.LISTENING,
            "close idle client connections after this many seconds",
            type=float,
        ),
    )
    graceful_timeout: float = setting(
        30.0,
        Flag(
            "--graceful-timeout-secs",
            Group.LISTENING,
            "on SIGTERM/SIGINT, stop accepting and let in-flight requests finish for this long;"
            " then each stream ends with an error event (503) and [DONE], every other request"
            " gets a 503, and the process exits within a second more whatever clients do",
            type=float,
        ),
    )
    workers: int = setting(
        1,
        Flag(
            "--workers",
            Group.LISTENING,
            "router processes serving the port, with one machine-wide load ledger in shared"
            " memory; a supervisor restarts any that dies. 1: a single process, no supervisor",
            type=int,
        ),
        check=must(lambda n: n >= 1, "must be at least 1"),
    )
    worker_sockets: str = setting(
        "shared",
        Flag(
            "--worker-sockets",
            Group.LISTENING,
            "with --workers N: one listening socket all workers accept from (shared), or one"
            " SO_REUSEPORT socket per worker (reuseport)",
            choices=WORKER_SOCKETS,
        ),
    )
    body_timeout: float = setting(
        60.0,
        Flag(
            "--request-body-timeout-secs",
            Group.LISTENING,
            "a request body must arrive whole within this time, else 408 and the connection"
            " closes (a body trickled byte by byte holds no slot forever)",
            type=float,
        ),
        check=positive,
    )
    write_timeout: float = setting(
        30.0,
        Flag(
            "--client-write-timeout-secs",
            Group.LISTENING,
            "a client that accepts no byte of its answer for this long is cut off: its request"
            " ends (outcome client_stalled) and its connection closes; 0: never",
            type=float,
        ),
        check=must(lambda v: v >= 0, "must be 0 (never) or more"),
    )
    #: The request line plus headers, counted as they arrived (a larger head gets 431).
    max_header_bytes: int = 64 * 1024


@attrs.frozen
class Timeouts:
    """Upstream time limits in seconds.

    ``--request-timeout-secs`` is the default of the three limits below; none of them bounds a
    stream that keeps producing, however long it runs:

    * ``prefill``: the whole prefill leg (request sent, JSON answer read);
    * ``first_byte``: from sending the decode leg to its response head (for a non-streaming
      request, which vLLM answers in one piece, that is the whole answer);
    * ``idle``: the longest gap between two reads of a decode stream.

    A limit hit before the client got a byte is a 504 (and may be retried); after, the stream
    ends with an SSE error event and ``[DONE]``.
    """

    request: float = setting(
        1800.0,
        Flag(
            "--request-timeout-secs",
            Group.TIMEOUTS,
            "bounds the prefill leg, the wait for decode's first byte, and every gap between"
            " decode chunks; never a stream that keeps producing",
            type=float,
        ),
        check=positive,
    )
    prefill: float | None = setting(
        None,
        Flag(
            "--prefill-timeout-secs",
            Group.TIMEOUTS,
            "limit on the whole prefill leg (default: --request-timeout-secs)",
            type=float,
        ),
        check=positive,
    )
    first_byte: float | None = setting(
        None,
        Flag(
            "--decode-first-byte-timeout-secs",
            Group.TIMEOUTS,
            "limit from sending the decode leg to its first byte; for a non-streaming request"
            " that is the whole answer (default: --request-timeout-secs)",
            type=float,
        ),
        check=positive,
    )
    idle: float | None = setting(
        None,
        Flag(
            "--decode-idle-timeout-secs",
            Group.TIMEOUTS,
            "longest gap between two chunks of a decode stream (default: --request-timeout-secs)",
            type=float,
        ),
        check=positive,
    )
    prefill_grace: float = setting(
        1.0,
        Flag(
            "--prefill-answer-grace-secs",
            Group.TIMEOUTS,
            "a client that leaves while the prefill leg is out: stop sending to the prefill"
            " engine (it aborts a prefill still running), but read this long an answer already"
            " on its way, so its KV blocks are reclaimed instead of stranded; 0: close at once",
            type=float,
        ),
        check=must(lambda v: v >= 0, "must be 0 (close at once) or more"),
    )
    prefill_kv_hold: float = setting(
        20.0,
        Flag(
            "--prefill-kv-hold-secs",
            Group.TIMEOUTS,
            "how long a prefill engine can be counted on to hold a request's KV blocks for its"
            " decode (vLLM's NIXL lease is 30 s, its older abort timeout 120-480 s): a decode"
            " retry reuses them, and a departed client's are reclaimed, only within this time"
            " of the prefill's answer; later, a retry runs a fresh prefill and the blocks are"
            " left to the engine",
            type=float,
        ),
        check=positive,
    )
    connect: float = setting(
        10.0,
        Flag(
            "--connect-timeout-secs",
            Group.TIMEOUTS,
            "time to open a connection to an upstream",
            type=float,
        ),
        check=positive,
    )

    @property
    def prefill_limit(self) -> float:
        return self.request if self.prefill is None else self.prefill

    @property
    def first_byte_limit(self) -> float:
        return self.request if self.first_byte is None else self.first_byte

    @property
    def idle_limit(self) -> float:
        return self.request if self.idle is None else self.idle
