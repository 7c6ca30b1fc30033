"""The supervisor's KV-event fan-out over real ZMQ sockets: frames reach every worker untouched,
a bound source is bound once, replay endpoints stay the engines'."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import zmq

from trio_pdrouter.kv import EventSource, KvFanout, relay_endpoint, relayed
from trio_pdrouter.kv.sockets import close, socket_fd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def message(seq: int) -> list[bytes]:
    return [b"kv@rank0", seq.to_bytes(8, "big"), b"\x93payload" + bytes([seq % 256])]


async def receive(sub: zmq.Socket[bytes]) -> list[bytes]:
    while True:
        try:
            return sub.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            with trio.move_on_after(0.05):  # bounded: re-check the socket, never a sync point
                await trio.lowlevel.wait_readable(socket_fd(sub))


@pytest.mark.parametrize("mode", ["connect", "bind"])
async def test_every_worker_gets_each_frame_as_the_engine_sent_it(
    ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path, mode: str
) -> None:
    port = free_port()
    engine = ctx.socket(zmq.PUB)
    if mode == "connect":  # the engine bound it (vLLM's tcp://*:P); the router connects
        engine.bind(f"tcp://127.0.0.1:{port}")
        endpoint = f"tcp://127.0.0.1:{port}"
    else:  # the engine connects (vLLM's tcp://router:P); the router binds
        engine.connect(f"tcp://127.0.0.1:{port}")
        endpoint = f"bind:tcp://127.0.0.1:{port}"
    source = EventSource("http://e:8000", 0, endpoint, "tcp://127.0.0.1:9")
    fanout = KvFanout([source], str(tmp_path), ctx)
    workers = []
    for _ in range(2):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(relay_endpoint(str(tmp_path), 0))
        workers.append(sub)
    async with trio.open_nursery() as nursery:
        await nursery.start(fanout.run)
        # Slow joiners: probe until both workers hear the engine (bounded), then the real run.
        for _ in range(200):
            engine.send_multipart([b"probe", b"\xff" * 8, b""])
            await trio.sleep(0.01)
            if all(sub.poll(0) for sub in workers):
                break
        else:
            raise AssertionError("the fan-out never connected")
        for seq in range(50):
            engine.send_multipart(message(seq))
        for sub in workers:
            got = []
            while len(got) < 50:
                frames = await receive(sub)
                if frames[0] != b"probe":
                    got.append(frames)
            assert got == [message(seq) for seq in range(50)]
        assert fanout.forwarded[source.key] >= 50
        nursery.cancel_scope.cancel()
    for sub in workers:
        close(sub)
    engine.close(linger=0)


def test_a_worker_subscribes_locally_and_replays_from_the_engine() -> None:
    sources = [
        EventSource("http://a:8000", 0, "bind:tcp://10.0.0.1:5557", "tcp://a:5560"),
        EventSource("http://b:8000", None, "tcp://b:5557", None),
    ]
    local = relayed(sources, "/run/x")
    assert [s.endpoint for s in local] == ["ipc:///run/x/kv-0.sock", "ipc:///run/x/kv-1.sock"]
    assert [(s.url, s.rank, s.replay) for s in local] == [
        (s.url, s.rank, s.replay) for s in sources
    ]
