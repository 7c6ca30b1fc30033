"""The garbage collector of a router process: settled once it serves, and only then."""

from __future__ import annotations

import subprocess
import sys
from functools import partial
from typing import Any

import pytest
import trio

from trio_pdrouter import cli, collector, server
from trio_pdrouter.config import RouterConfig, ServerSettings
from trio_pdrouter_sim import SimConfig
from trio_pdrouter_sim.server import SimServer

# Run in a process of its own: settling changes the collector of the whole process.
_SETTLE = """
import gc, weakref
from trio_pdrouter import collector

class Node:
    pass

early = [Node() for _ in range(100)]
collector.settle()
frozen = gc.get_freeze_count()
cycle = Node()
cycle.self = cycle
dead = weakref.ref(cycle)
del cycle
churn = [[] for _ in range(2 * collector.YOUNG_THRESHOLD)]  # allocations only, no gc.collect()
print(frozen, gc.get_threshold(), dead() is None)
"""


def test_settle_freezes_what_lives_and_still_frees_cycles_made_later() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SETTLE], capture_output=True, text=True, check=True
    ).stdout.split(maxsplit=1)
    frozen, rest = int(out[0]), out[1]
    assert frozen > 100, "what was alive went to the permanent generation"
    threshold = (collector.YOUNG_THRESHOLD, collector.OLDER_THRESHOLD, collector.OLDER_THRESHOLD)
    assert rest.strip() == f"{threshold} True", "a later cycle is freed by a young collection"


@pytest.mark.parametrize("settle_heap", [True, False])
async def test_a_router_settles_its_heap_once_serving_only_when_asked(
    monkeypatch: pytest.MonkeyPatch, settle_heap: bool
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(server.collector, "settle", lambda: calls.append(1))
    sim = SimServer(SimConfig.fast(port=0, role="both"))
    async with trio.open_nursery() as nursery:
        await nursery.start(sim.run)
        config = RouterConfig(
            pd=False,
            worker_urls=(sim.url,),
            server=ServerSettings(host="127.0.0.1", port=0),
            prometheus_listener=False,
        )
        assert calls == []
        await nursery.start(partial(server.run_router, config, settle_heap=settle_heap))
        assert calls == ([1] if settle_heap else [])
        nursery.cancel_scope.cancel()


def test_the_command_line_router_asks_to_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    async def fake_run_router(config: RouterConfig, **kwargs: Any) -> None:
        seen.update(kwargs)

    monkeypatch.setattr(server, "run_router", fake_run_router)
    cli.main(["--worker-urls", "http://127.0.0.1:9"])
    assert seen["settle_heap"] is True
