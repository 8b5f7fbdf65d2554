"""TraceSetting over gRPC, and a call's traceparent from its metadata."""

from __future__ import annotations

import dataclasses
from typing import Any

from mpsd.daemon.api.grpc.known_headers import KnownHeaders
from mpsd.daemon.api.operations import Operations
from mpsd.daemon.api.trace_settings import FIELDS
from mpsd.daemon.api.tracing import TRACEPARENT, Incoming, incoming
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
