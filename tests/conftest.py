"""Hypothesis profiles for the whole suite.

* ``ci`` (the default, used by ``make test``): Hypothesis' usual 100 examples per test and up to 50
  steps per state machine run, with no per-example deadline (the lifecycle machines drive a trio
  loop in a helper thread; a slow CI machine must not turn into a flaky ``DeadlineExceeded``).
  The state machines of ``tests/serve/test_lifecycle_machine.py`` take about 20 s in all on 2 cores.
* ``long``: a soak of the same properties, 20x the examples and 4x the steps per run::

      .venv/bin/pytest --hypothesis-profile=long tests/serve/test_lifecycle_machine.py tests/ledger/test_load.py

  ``--hypothesis-profile`` is the option of Hypothesis' own pytest plugin; it overrides the
  profile loaded here.

Tests that set ``max_examples`` themselves keep their own count under both profiles.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio
from hypothesis import HealthCheck, settings

from tests.redis_server import RedisServer

settings.register_profile(
    "ci",
    deadline=None,
    max_examples=100,
    stateful_step_count=50,
    print_blob=True,
)
settings.register_profile(
    "long",
    parent=settings.get_profile("ci"),
    max_examples=2000,
    stateful_step_count=200,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")


@pytest.fixture
async def background() -> AsyncIterator[trio.Nursery]:
    """A nursery for work that outlives one request (the app's stranded-KV reclaim); cancelled
    when the test ends."""
    async with trio.open_nursery() as nursery:
        yield nursery
        nursery.cancel_scope.cancel()


@pytest.fixture
async def redis_server() -> AsyncIterator[RedisServer]:
    """A real Redis on 127.0.0.1 (see :mod:`tests.redis_server`), killed when the test ends."""
    server = RedisServer()
    await server.start()
    try:
        yield server
    finally:
        with trio.CancelScope(shield=True):
            await server.aclose()
