"""The worker's request channel: both ends get the front links' wide socket buffers (macOS's default is
8 KiB, so a Python model's inline tensors took hundreds of sends), checked on the pair the daemon spawns a
real worker with."""

from __future__ import annotations

import asyncio
import socket

from mpsd.daemon.supervise.worker.process import Process, WorkerLaunch, request_pair
from mpsd.ipc.protocol import ModelSpec

LAUNCH = WorkerLaunch(ModelSpec("m", 1, "torchscript", "/nowhere", 8, (), ()), 0, "KIND_CPU", None, {})
OPTIONS = (socket.SO_SNDBUF, socket.SO_RCVBUF)


def buffers(sock: socket.socket) -> tuple[int, int]:
    send, receive = (sock.getsockopt(socket.SOL_SOCKET, option) for option in OPTIONS)
    return send, receive


def defaults() -> tuple[int, int]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        return buffers(ours)


def wider(sock: socket.socket) -> bool:
    return all(got > default for got, default in zip(buffers(sock), defaults(), strict=True))


def test_both_ends_of_the_request_pair_are_widened() -> None:
    parent, child = request_pair()
    with parent, child:
        assert wider(parent) and wider(child)


def test_the_daemon_spawns_a_worker_on_a_widened_pair() -> None:
    async def spawn() -> bool:
        process = Process(LAUNCH)
        sock, beats = await process.spawn()
        try:
            return wider(sock)
        finally:
            await process.kill()
            sock.close()
            beats.close()

    assert asyncio.run(spawn())
