"""ModelInfer's messages in their wire form: a request read into the inference call both adapters hand on
(`api.call`), and a response written, without protobuf copying the tensor bytes either way.

protobuf copies every `raw_input_contents` entry into a new `bytes` when it parses, and again when it is
read. The entries are instead cut out of the received buffer as memoryviews, and only the rest of the
message, a few hundred bytes of names and shapes, is parsed (`split_request`, then `infer_call`): the
tensor bytes are then copied once, into the worker's shared memory. On the way back, protobuf would copy
each output into the message and again when serializing it; the response is instead its header (kept
serialized by `responses.py`) followed by the entries as separate pieces (joined once, or sent as they are
by a scatter-gather write). Nothing here imports the generated protobuf classes: `infer_call` reads any
message with ModelInferRequest's fields.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mpsd.daemon.api.call import (
    NO_PARAMS,
    TYPED_CONTENTS,
    InferCall,
    InputCall,
    OutputCall,
    Param,
    Params,
    RawEntry,
)

RAW_INPUT_CONTENTS = 7  # field number of ModelInferRequest.raw_input_contents
RAW_OUTPUT_CONTENTS = 6  # field number of ModelInferResponse.raw_output_contents
_ID = 3  # field number of ModelInferRequest.id
_LENGTH_DELIMITED = 2
_OUTPUT_TAG = bytes([RAW_OUTPUT_CONTENTS << 3 | _LENGTH_DELIMITED])


def _varint(data: bytes | bytearray | memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]  # IndexError on a truncated message
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


@dataclass(frozen=True)
class SplitRequest:
    """A ModelInferRequest's wire bytes taken apart: `key`, the message without its raw_input_contents and
    its id (what requests of one kind share); the raw entries; the id's bytes, if it has one; and `rest`,
    the message without its raw_input_contents (to parse)."""

    key: bytes
    raw: list[memoryview]
    request_id: bytes | None
    pieces: tuple[bytes | bytearray | memoryview, ...]  # `rest`, not yet joined

    @property
    def rest(self) -> bytes | bytearray | memoryview:
        """Joined on demand: a request whose key is known is never parsed, so it never needs it."""
        pieces = self.pieces
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def split_request(data: bytes | bytearray | memoryview) -> SplitRequest | None:
    """`SplitRequest` of the bytes, or None when they are not a well-formed message (the caller then lets
    protobuf report the error)."""
    view = memoryview(data)
    size = len(data)
    rest: list[memoryview] = []  # the pieces between raw entries
    keyed: list[memoryview] = []  # the pieces between raw entries and ids
    raw: list[memoryview] = []
    request_id: memoryview | None = None
    pos = start = key_start = 0
    try:
        while pos < size:
            field_start = pos
            # One-byte varints (every tag of this message, most lengths) are read inline: the walk runs
            # for every request, and a call per varint was a fifth of its cost.
            tag = data[pos]
            if tag < 0x80:
                pos += 1
            else:
                tag, pos = _varint(data, pos)
            wire_type = tag & 7
            if wire_type == _LENGTH_DELIMITED:
                length = data[pos]
                if length < 0x80:
                    pos += 1
                else:
                    length, pos = _varint(data, pos)
                end = pos + length
                if end > size:
                    return None
                field = tag >> 3
                if field == RAW_INPUT_CONTENTS:
                    rest.append(view[start:field_start])
                    keyed.append(view[key_start:field_start])
                    raw.append(view[pos:end])
                    start = key_start = end
                elif field == _ID:
                    keyed.append(view[key_start:field_start])
                    request_id = view[pos:end]  # the last one counts, as protobuf reads it
                    key_start = end
                pos = end
            elif wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            else:
                return None
    except (IndexError, ValueError):
        return None
    if pos != size:
        return None
    pieces: tuple[bytes | bytearray | memoryview, ...] = (data,)
    if raw:
        rest.append(view[start:size])
        pieces = tuple(rest)
    keyed.append(view[key_start:size])
    key = b"".join(keyed)
    return SplitRequest(key, raw, None if request_id is None else bytes(request_id), pieces)


_SMALL_VARINTS = tuple(bytes([n]) for n in range(0x80))


def varint_bytes(n: int) -> bytes:
    """`n` as a protobuf varint."""
    return _SMALL_VARINTS[n] if n < 0x80 else _large_varint(n)


@functools.lru_cache(maxsize=1024)  # a model's outputs come in a few sizes
def _large_varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def raw_output_parts(header: bytes, contents: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """A serialized ModelInferResponse as consecutive pieces: `header` (the message without
    raw_output_contents, serialized) followed by one raw_output_contents entry per item, in order. Fields may
    come in any order on the wire, so the pieces parse exactly like the message with the entries set. The
    entries are not copied: a scatter-gather send can write them as they are."""
    parts: list[bytes | memoryview] = [header]
    for data in contents:
        size = data.nbytes if type(data) is memoryview else len(data)  # bytes, not a view's items
        parts += (_OUTPUT_TAG, varint_bytes(size), data) if size else (_OUTPUT_TAG, varint_bytes(0))
    return parts


def params(parameters: Mapping[str, Any]) -> Params:
    """InferParameters by key, each as its kind and value ("" and "" for one with no value set)."""
    if not parameters:
        return NO_PARAMS
    found = {}
    for key, value in parameters.items():
        choice = value.WhichOneof("parameter_choice")
        found[key] = Param(choice.removesuffix("_param"), getattr(value, choice)) if choice else Param("", "")
    return found


def _contents(tensor: Any) -> dict[str, Sequence[Any]]:
    if not tensor.HasField("contents"):
        return {}
    contents = tensor.contents
    return {f: values for f in TYPED_CONTENTS if len(values := getattr(contents, f))}


def infer_call(request: Any, raw: Sequence[RawEntry] | None = None) -> InferCall:
    """The call a ModelInferRequest makes; `raw`, when given, stands for its raw_input_contents."""
    return InferCall(
        request.model_name,
        request.model_version,
        request.id,
        params(request.parameters),
        tuple(
            InputCall(t.name, t.datatype, tuple(t.shape), params(t.parameters), _contents(t))
            for t in request.inputs
        ),
        tuple(OutputCall(o.name, params(o.parameters)) for o in request.outputs),
        tuple(request.raw_input_contents) if raw is None else raw,
    )
