"""TraceSetting over gRPC, a call's traceparent from its metadata, and the fronts' calls, traced or not."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from mpsd.daemon.api.grpc.known_headers import KnownHeaders
from mpsd.daemon.api.operations import Operations
from mpsd.daemon.api.trace_settings import FIELDS
from mpsd.daemon.api.tracing import TRACEPARENT, Incoming, incoming
from mpsd.daemon.dataplane.request import InferResult
from mpsd.errors import InvalidArgument
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


Data = bytes | bytearray | memoryview
Parts = list[bytes | memoryview]


Answer = Callable[[Parts | BaseException], None]  # a submitted call's response pieces, or its error


class BytesInfer(Protocol):
    """The servicer's ModelInfer on serialized bytes."""

    ops: Operations

    async def infer_serialized_parts(
        self, data: Data, deadline: float | None, came: Incoming | None = None
    ) -> Parts: ...

    def submit_serialized(
        self, data: Data, deadline: float | None, answer: Answer
    ) -> asyncio.Future[InferResult] | None: ...


class FrontCalls:
    """ModelInfer for the front processes' calls: `submit` takes an untraced call whose header is known
    into its model's queue and answers it from a callback; `infer` runs any other in a task of its own,
    with the traceparent its front read (if any)."""

    def __init__(self, servicer: BytesInfer) -> None:
        self._servicer = servicer
        self._ops = servicer.ops

    def submit(
        self, data: Data, deadline: float | None, answer: Answer
    ) -> asyncio.Future[InferResult] | None:
        """None: the call goes to `infer` (a traced one always does, to be sampled and spanned there)."""
        if self._ops.tracing.on:
            return None
        return self._servicer.submit_serialized(data, deadline, answer)

    async def infer(self, data: Data, deadline: float | None, traceparent: str | None) -> Parts:
        came = incoming(traceparent, "ModelInfer") if self._ops.tracing.on else None
        return await self._servicer.infer_serialized_parts(data, deadline, came)


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
