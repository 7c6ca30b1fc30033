"""The ASGI application: the routes table, request parsing, and the admin routes.

:class:`RouterApp` is what hypercorn serves: it answers the inference routes through the proxy
and the small admin routes (loads, servers, health, metrics) from the subsystems it is given.

Contract: parses and dispatches; the request's life is :mod:`trio_pdrouter.serve`'s. May import
every subsystem below it.
"""

from __future__ import annotations

from .router_app import RouterApp

__all__ = [
    "RouterApp",
]
