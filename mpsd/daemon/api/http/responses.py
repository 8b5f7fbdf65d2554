"""HTTP response bodies: JSON as Triton's HTTP server writes it, and the infer response with its outputs
as JSON arrays or as binary data after the JSON (the binary tensor data extension).

Metadata, configs and statistics are the gRPC path's own messages (`respond`), written as JSON the way
Triton does: field names as in the proto, 64-bit integers as numbers, not strings.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
from aiohttp import web
from google.protobuf.descriptor import FieldDescriptor

from mpsd.daemon.api.describe import repeated
from mpsd.daemon.dataplane.request import InferResult
from mpsd.ipc import strings
from mpsd.ipc.dtypes import DATATYPES

JSON = "application/json"
BINARY = "application/octet-stream"
HEADER_LENGTH = "Inference-Header-Content-Length"


def dumps(value: Any) -> bytes:
    """Compact JSON; NaN and infinities as the bare tokens NaN, Infinity, -Infinity, as Triton writes them."""
    return json.dumps(value, separators=(",", ":")).encode()


def json_response(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=dumps(value), status=status, content_type=JSON)


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    """Triton's error body: `{"error": "..."}`."""
    return web.Response(body=dumps({"error": message}), status=status, content_type=JSON, headers=headers)


def empty(status: int = 200) -> web.Response:
    return web.Response(status=status)


# ---- protobuf messages as Triton's JSON ---------------------------------------------------------------


def proto_dict(message: Any) -> dict[str, Any]:
    """A message as JSON-ready values: every scalar, repeated and map field (defaults included), and the
    message fields that are set; enums by name, bytes in base64, 64-bit integers as numbers."""
    out: dict[str, Any] = {}
    for fd in message.DESCRIPTOR.fields:
        value = getattr(message, fd.name)
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            value_fd = fd.message_type.fields_by_name["value"]
            out[fd.name] = {key: _scalar(value_fd, item) for key, item in value.items()}
        elif repeated(fd):
            out[fd.name] = [_scalar(fd, item) for item in value]
        elif fd.type == FieldDescriptor.TYPE_MESSAGE:
            if message.HasField(fd.name):
                out[fd.name] = proto_dict(value)
        elif fd.containing_oneof is None or message.HasField(fd.name):
            out[fd.name] = _scalar(fd, value)
    return out


def _scalar(fd: Any, value: Any) -> Any:
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        return proto_dict(value)
    if fd.type == FieldDescriptor.TYPE_ENUM:
        known = fd.enum_type.values_by_number.get(value)
        return known.name if known is not None else value
    if fd.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64encode(value).decode()
    return value


# ---- infer ---------------------------------------------------------------------------------------------


def json_values(datatype: str, data: bytes | memoryview, shape: Sequence[int]) -> list[Any]:
    """An output's bytes as a flat JSON array (BF16 as the float32 values it stands for; strings as text,
    bytes that are not UTF-8 replaced by U+FFFD: binary data carries them exactly)."""
    if datatype == strings.DATATYPE:
        return [e.decode("utf-8", "replace") for e in strings.split(data, math.prod(shape))]
    if datatype == "BF16":
        wide = np.frombuffer(data, np.uint16).astype(np.uint32) << 16
        return wide.view(np.float32).tolist()  # type: ignore[no-any-return]
    spec = DATATYPES[datatype]
    return np.frombuffer(data, np.dtype(spec.numpy)).tolist()  # type: ignore[no-any-return]


def infer_response(
    result: InferResult,
    request_id: str,
    in_shm: Collection[str],
    binary: Mapping[str, bool],
    binary_default: bool,
) -> web.Response:
    """The response of one inference: JSON, followed by the binary outputs' bytes in output order."""
    head: dict[str, Any] = {"id": request_id} if request_id else {}
    head["model_name"] = result.model
    head["model_version"] = str(result.version)
    outputs = []
    pieces: list[bytes] = []
    for out in result.outputs:
        entry: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": list(out.shape)}
        if out.name in in_shm:
            pass  # written to the client's region; Triton returns no data for it
        elif binary.get(out.name, binary_default):
            entry["parameters"] = {"binary_data_size": len(out.data)}
            if out.data:
                pieces.append(out.data)
        else:
            entry["data"] = json_values(out.datatype, out.data, out.shape)
        outputs.append(entry)
    head["outputs"] = outputs
    header = dumps(head)
    if not pieces:
        return web.Response(body=header, content_type=JSON)
    return web.Response(
        body=b"".join([header, *pieces]),
        content_type=BINARY,
        headers={HEADER_LENGTH: str(len(header))},
    )
