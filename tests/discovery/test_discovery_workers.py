"""Discovery with ``--workers N``: one watcher per machine (worker 0), every worker routes to
what it found, and a replacement worker 0 lists again and diffs against the fleet it inherits."""

from __future__ import annotations

import os
import pathlib
import signal

import httpx
import trio

from tests.cluster import eventually
from tests.discovery.test_discovery_e2e import free_port, kubeconfig
from tests.kube_fake import FakeKube, serve_fake
from tests.pods import pod
from tests.workers_harness import start_supervisor, stop_supervisor
from trio_pdrouter_sim import SimConfig
from trio_pdrouter_sim.server import SimServer


async def test_one_watcher_per_machine_and_a_replacement_reconciles_what_it_inherits(
    tmp_path: pathlib.Path,
) -> None:
    async with trio.open_nursery() as nursery:
        fake = FakeKube()
        await nursery.start(serve_fake, fake)
        port = free_port("127.0.0.11")
        sims = {}
        for ip in ("127.0.0.11", "127.0.0.12"):
            sims[ip] = SimServer(SimConfig.fast(host=ip, port=port, role="both"))
            await nursery.start(sims[ip].run)
        fake.put(pod("w-1", "127.0.0.11"))
        args = [
            "--service-discovery", "--selector", "app=vllm", "--service-discovery-port",
            str(port), "--kubeconfig", str(kubeconfig(tmp_path / "config", fake.url)),
            "--health-check-interval-secs", "0.2", "--policy", "round_robin",
        ]  # fmt: skip
        sup = await start_supervisor(nursery, 3, args)
        await sup.wait_for(lambda: len(sup.pids) == 3, 30)

        async def every_worker_has(names: set[str]) -> bool:
            for _ in range(9):  # fresh connections: the kernel spreads them over the workers
                async with httpx.AsyncClient(timeout=10) as client:
                    workers = (await client.get(sup.url + "/workers")).json()["workers"]
                if {w["pod"]["name"] for w in workers if w["routable"]} != names:
                    return False
            return True

        await eventually(lambda: every_worker_has({"w-1"}), timeout=30)
        watches = [q for _, q, _ in fake.requests if q.get("watch")]
        assert fake.watches_open == 1 and len(watches) == 1  # worker 0 watches, alone

        victim = sup.pids[0]
        os.kill(victim, signal.SIGKILL)
        fake.delete("default", "w-1", force=True)  # while nobody watches
        fake.put(pod("w-2", "127.0.0.12"))
        fake.compact()  # and the history is gone: only a list can tell
        await sup.wait_for(lambda: sup.pids[0] != victim, 30)
        await eventually(lambda: every_worker_has({"w-2"}), timeout=30)  # a process start
        async with httpx.AsyncClient(timeout=10) as client:
            for _ in range(3):
                resp = await client.post(sup.url + "/v1/completions", json={"prompt": "x"})
                assert resp.status_code == 200
        assert sims["127.0.0.12"].state.engines[0].counters.requests == 3
        watches = [q for _, q, _ in fake.requests if q.get("watch")]
        assert len(watches) == 2  # the first worker 0's, then its replacement's
        assert await stop_supervisor(sup) == 0
        nursery.cancel_scope.cancel()
