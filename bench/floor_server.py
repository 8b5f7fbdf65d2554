"""The Python gRPC floor: a bare `grpc.aio` server whose ModelInfer echoes the inputs back as outputs.

It implements the same RPC of Triton's protocol with mpsd's generated servicer base and does nothing else
(no validation, no queue, no worker), so its latency is what any Python `grpc.aio` server pays for one
ModelInfer round trip. Run: `python -m bench.floor_server --address 127.0.0.1:PORT [--reply-shape 1 1000]`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
from typing import Any

import grpc

from mpsd.proto import grpc_service_pb2 as pb
from mpsd.proto import grpc_service_pb2_grpc as pb_grpc

MAX_MESSAGE = 256 * 1024 * 1024


class EchoServicer(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """Echoes the inputs; with `reply_shape`, answers every request with one fixed FP16 output of that
    shape instead (a classifier's logits, say), so only the request is large."""

    def __init__(self, reply_shape: list[int] | None = None) -> None:
        self.reply_shape = reply_shape
        self.reply_bytes = b"\x00\x3c" * math.prod(reply_shape) if reply_shape else b""

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=True)

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
        if self.reply_shape is not None:
            response.outputs.add(name="OUTPUT", datatype="FP16", shape=self.reply_shape)
            response.raw_output_contents.append(self.reply_bytes)
            return response
        for tensor in request.inputs:
            response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        response.raw_output_contents.extend(request.raw_input_contents)
        return response


async def serve(address: str, reply_shape: list[int] | None) -> None:
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.so_reuseport", 0),
        ]
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(EchoServicer(reply_shape), server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(address)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", required=True, help="host:port to listen on")
    parser.add_argument(
        "--reply-shape", type=int, nargs="+", help="answer with one FP16 tensor of this shape"
    )
    args = parser.parse_args()
    asyncio.run(serve(args.address, args.reply_shape))


if __name__ == "__main__":
    main()
