"""HTTP, both ways: what the router answers clients with, and how it calls the engines.

The client side of an exchange as ASGI gives it (:mod:`.asgi`); every error in the OpenAI shape,
one constructor per kind (:mod:`.errors`); server-sent events as vLLM writes them (:mod:`.sse`);
which upstream headers reach the client; CORS; the table of routes and what each means for the
PD split; the changes made to hypercorn's trio worker once at start-up, with the connection
handle the request path reads; binding the listening sockets first (:mod:`.listen`); and
:class:`LegClient`, the httpx client every leg uses over
:mod:`trio_pdrouter.transport`, with its time limits and capped reads.

Contract: shapes and I/O helpers, no routing or load. May import the config, the endpoints and
the transport.
"""

from __future__ import annotations

from .asgi import JSON, Downstream, Headers, Receive, Reply, Scope, Send, answer_lifespan
from .connection import Connection, current_connection
from .cors import Cors, origin_of
from .errors import RouterError
from .hypercorn_patches import (
    close_connections_when_clients_leave,
    expose_connections,
    reuse_keep_alive_timers,
    serve_http1_only,
)
from .listen import BindError, listening_sockets
from .response_headers import passed_on, with_default
from .routes import GENERATE, RESPONSES, ROUTES, Route
from .sse import DONE, EventFramer, EventTooLarge, error_event
from .upstream import (
    Answer,
    AnswerTooLarge,
    LegClient,
    client_timeout,
    make_client,
    post_capped,
    read_capped,
    stream_timeout,
)

__all__ = [
    "DONE",
    "GENERATE",
    "JSON",
    "RESPONSES",
    "ROUTES",
    "Answer",
    "AnswerTooLarge",
    "BindError",
    "Connection",
    "Cors",
    "Downstream",
    "EventFramer",
    "EventTooLarge",
    "Headers",
    "LegClient",
    "Receive",
    "Reply",
    "Route",
    "RouterError",
    "Scope",
    "Send",
    "answer_lifespan",
    "client_timeout",
    "close_connections_when_clients_leave",
    "current_connection",
    "error_event",
    "expose_connections",
    "listening_sockets",
    "make_client",
    "origin_of",
    "passed_on",
    "post_capped",
    "read_capped",
    "reuse_keep_alive_timers",
    "serve_http1_only",
    "stream_timeout",
    "with_default",
]
