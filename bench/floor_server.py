"""The Python gRPC floor: a bare `grpc.aio` server whose ModelInfer echoes the inputs back as outputs.

It implements the same RPC of Triton's protocol with mpsd's generated servicer base and does nothing else
(no validation, no queue, no worker), so its latency is what any Python `grpc.aio` server pays for one
ModelInfer round trip. Run: `python -m bench.floor_server --address 127.0.0.1:PORT [--reply-shape 1 1000]`.

With `--worker-hop` every request also makes the trip a process-per-model server cannot avoid: a 64-byte
message to a child process over a socketpair and back (the child answers each at once; tensor bytes stay
in the server). That floor shows how much of mpsd's overhead is the process hop itself.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import signal
import socket
import struct
import subprocess
import sys
from typing import Any

import grpc

from mpsd.proto import grpc_service_pb2 as pb
from mpsd.proto import grpc_service_pb2_grpc as pb_grpc

MAX_MESSAGE = 256 * 1024 * 1024
HOP = struct.Struct("!Q56x")  # a call id, padded to 64 bytes


class WorkerHop(asyncio.Protocol):
    """The server's side of the hop: send a call id, wait until the child sends it back."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: dict[int, asyncio.Future[None]] = {}
        self._ids = itertools.count()
        self._buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buf += data
        while len(self._buf) >= HOP.size:
            (call,) = HOP.unpack_from(self._buf)
            self._buf = self._buf[HOP.size :]
            waiter = self.waiting.pop(call, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def round_trip(self) -> None:
        assert self.transport is not None
        call = next(self._ids)
        waiter = asyncio.get_running_loop().create_future()
        self.waiting[call] = waiter
        self.transport.write(HOP.pack(call))
        await waiter


def hop_child(fd: int) -> None:
    """The child: echo every 64-byte message at once, blocking, like a worker's receive loop."""
    sock = socket.socket(fileno=fd)
    while True:
        data = sock.recv(HOP.size, socket.MSG_WAITALL)
        if len(data) < HOP.size:
            return
        sock.sendall(data)


class EchoServicer(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """Echoes the inputs; with `reply_shape`, answers every request with one fixed FP16 output of that
    shape instead (a classifier's logits, say), so only the request is large."""

    def __init__(self, reply_shape: list[int] | None = None, hop: WorkerHop | None = None) -> None:
        self.reply_shape = reply_shape
        self.hop = hop
        self.reply_bytes = b"\x00\x3c" * math.prod(reply_shape) if reply_shape else b""

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=True)

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        if self.hop is not None:
            await self.hop.round_trip()
        response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
        if self.reply_shape is not None:
            response.outputs.add(name="OUTPUT", datatype="FP16", shape=self.reply_shape)
            response.raw_output_contents.append(self.reply_bytes)
            return response
        for tensor in request.inputs:
            response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        response.raw_output_contents.extend(request.raw_input_contents)
        return response


async def start_hop() -> tuple[WorkerHop, subprocess.Popen[bytes]]:
    parent, child = socket.socketpair()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.floor_server", "--hop-child", str(child.fileno())],
        pass_fds=(child.fileno(),),
    )
    child.close()
    _, hop = await asyncio.get_running_loop().create_unix_connection(WorkerHop, sock=parent)
    return hop, proc


async def serve(address: str, reply_shape: list[int] | None, worker_hop: bool = False) -> None:
    hop, child = await start_hop() if worker_hop else (None, None)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.so_reuseport", 0),
        ]
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(EchoServicer(reply_shape, hop), server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(address)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)
    if child is not None:
        child.terminate()
        child.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", help="host:port to listen on")
    parser.add_argument("--worker-hop", action="store_true", help="send each request through a child process")
    parser.add_argument("--hop-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--reply-shape", type=int, nargs="+", help="answer with one FP16 tensor of this shape"
    )
    args = parser.parse_args()
    if args.hop_child is not None:
        hop_child(args.hop_child)
        return
    if not args.address:
        parser.error("--address is required")
    asyncio.run(serve(args.address, args.reply_shape, args.worker_hop))


if __name__ == "__main__":
    main()
