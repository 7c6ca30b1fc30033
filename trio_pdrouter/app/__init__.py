"""The ASGI application: the routes table, request parsing, and the admin routes.

:class:`RouterApp` is what hypercorn serves: its first checks, then :class:`InferenceRoutes`
(through the proxy) or :class:`AdminRoutes` (loads, servers, health, metrics), both built by
the composition root from the subsystems they read.

Contract: parses and dispatches; the request's life is :mod:`trio_pdrouter.serve`'s. May import
every subsystem below it.
"""

from __future__ import annotations

from .admin import AdminRoutes
from .inference import InferenceRoutes
from .router_app import RouterApp

__all__ = [
    "AdminRoutes",
    "InferenceRoutes",
    "RouterApp",
]
