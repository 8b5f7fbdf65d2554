"""Talking to a running daemon from the command line with mpsd's own generated stubs.

The stubs, not tritonclient, so that the tools work wherever mpsd is installed. They are imported inside
functions: importing them next to tritonclient in one process registers the same protobuf symbols twice.
"""

from __future__ import annotations

import argparse
from typing import Any

import grpc

from mpsd.connect import DEFAULT_ADDRESS, open_channel
from mpsd.tools.common import EX_UNAVAILABLE, ToolError

__all__ = ["DEFAULT_ADDRESS", "EX_UNAVAILABLE", "connect", "inference_stub", "rpc_failure"]


# Status code -> what to try next, for errors the daemon reports about a request.
_HINTS: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.NOT_FOUND: "`mpsd models` lists the models and versions the daemon serves",
    grpc.StatusCode.UNAVAILABLE: "`mpsd status` shows why; `mpsd logs --model NAME` shows its events",
    grpc.StatusCode.INVALID_ARGUMENT: "check the values against the model's inputs; `mpsd infer --help` "
    "shows the value forms",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "the device ran out of memory: send a smaller batch, or see "
    "docs/troubleshooting.md",
    grpc.StatusCode.DEADLINE_EXCEEDED: "raise --timeout, or check `mpsd status` for a stuck worker",
    grpc.StatusCode.UNAUTHENTICATED: "pass --token-file (or set MPSD_TOKEN) with a token the daemon knows",
    grpc.StatusCode.PERMISSION_DENIED: "use a token whose categories include this call (docs/security.md)",
}


def connect(conn: argparse.Namespace) -> grpc.Channel:
    """A channel to the daemon from the command's connection arguments (address, TLS, token)."""
    return open_channel(conn)


def inference_stub(channel: grpc.Channel, address: str, timeout: float) -> Any:
    """The KServe stub, after checking that a daemon answers at `address` (ToolError, status 69, if not)."""
    from mpsd.proto import grpc_service_pb2 as pb
    from mpsd.proto import grpc_service_pb2_grpc as pb_grpc

    stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
    try:
        stub.ServerLive(pb.ServerLiveRequest(), timeout=timeout)
    except grpc.RpcError as exc:
        details = exc.details()  # type: ignore[attr-defined]
        if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):  # type: ignore[attr-defined]
            raise rpc_failure(exc) from None
        raise ToolError(
            f"cannot reach the daemon at {address}: {details}",
            "is it running (`mpsd serve`, `make run`)? pass --address if it listens elsewhere",
            EX_UNAVAILABLE,
        ) from None
    return stub


def rpc_failure(exc: grpc.RpcError) -> ToolError:
    """A failed call as one line (status code and the daemon's message) plus a hint."""
    code: grpc.StatusCode = exc.code()  # type: ignore[attr-defined]
    details: str = exc.details()  # type: ignore[attr-defined]
    return ToolError(f"{code.name}: {details}", _HINTS.get(code, "`mpsd logs` shows the daemon's events"))
