"""``--kv-event-source`` values: the ``bind:`` prefix binds one address, DP ranks at port + r."""

from __future__ import annotations

import pytest

from trio_pdrouter.config import ConfigError, KvEventSettings
from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.kv import sources_for

URL = "http://10.0.0.1:8000"
RANKS = [Endpoint(URL, Role.REGULAR, r) for r in range(2)]


def test_a_bind_endpoint_keeps_its_prefix_at_each_rank_offset() -> None:
    settings = KvEventSettings(sources=(f"{URL}=bind:tcp://10.0.0.9:5557",))
    sources = sources_for(settings, RANKS)
    assert [(s.rank, s.endpoint) for s in sources] == [
        (0, "bind:tcp://10.0.0.9:5557"),
        (1, "bind:tcp://10.0.0.9:5558"),
    ]


def test_anything_but_tcp_or_ipc_is_refused_with_or_without_the_prefix() -> None:
    for endpoint in ("bind:udp://x:1", "ws://x:1"):
        with pytest.raises(ConfigError, match=r"\[bind:\]tcp://"):
            sources_for(KvEventSettings(sources=(f"{URL}={endpoint}",)), RANKS)
