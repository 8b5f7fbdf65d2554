"""TraceSetting over gRPC, and a call's traceparent from its metadata."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from mpsd.daemon.api.grpc.known_headers import KnownHeaders
from mpsd.daemon.api.operations import Operations
from mpsd.daemon.api.trace_settings import FIELDS
from mpsd.daemon.api.tracing import TRACEPARENT, Incoming, incoming
from mpsd.errors import InvalidArgument
from mpsd.ipc.infer_wire import SplitRequest
from mpsd.proto import grpc_service_pb2 as pb


def came_with(context: Any, name: str) -> Incoming:
    """What a traced call brings: the traceparent of its metadata, if any."""
    traceparent = None
    for key, value in context.invocation_metadata() or ():
        if key == TRACEPARENT:
            traceparent = value
    return incoming(traceparent, name)


def sampled(ops: Operations, known: KnownHeaders, key: bytes, came: Incoming) -> Incoming | None:
    """A call whose header is known is sampled here, so that one not traced keeps the known-header path:
    None when it is not traced; a traced one takes the full path with its decision made."""
    header = known.get(key)
    if header is None:
        return came  # the full path decides
    return dataclasses.replace(came, sampled=True) if ops.tracing.sample(header.model, came) else None


Data = bytes | bytearray | memoryview | SplitRequest  # a request's bytes, or as its front split them
Parts = list[bytes | memoryview]


class BytesInfer(Protocol):
    """The servicer's ModelInfer on serialized bytes."""

    ops: Operations

    async def infer_serialized_parts(
        self, data: Data, deadline: float | None, came: Incoming | None = None
    ) -> Parts: ...


def front_calls(servicer: BytesInfer) -> Callable[[Data, float | None, str | None], Awaitable[Parts]]:
    """ModelInfer for the front processes' calls, each with the traceparent its front read (if any)."""
    ops = servicer.ops

    async def infer(data: Data, deadline: float | None, traceparent: str | None) -> Parts:
        came = incoming(traceparent, "ModelInfer") if ops.tracing.on else None
        return await servicer.infer_serialized_parts(data, deadline, came)

    return infer


def trace_setting(ops: Operations, request: Any) -> Any:
    """Triton's TraceSetting: each setting's values as a list, an empty list clearing it; more than one value
    only for trace_level."""
    update: dict[str, list[str] | str | None] = {}
    for key, setting in request.settings.items():
        values = list(setting.value)
        if key == "trace_level":
            update[key] = values or None
        elif not values:
            update[key] = None
        elif len(values) == 1 or key not in FIELDS:
            update[key] = values[0]
        else:
            raise InvalidArgument(f"expect only 1 value for '{key}'")
    reply = pb.TraceSettingResponse()
    for key, values in ops.trace_setting(request.model_name, update).items():
        reply.settings[key].value.extend(values)
    return reply
