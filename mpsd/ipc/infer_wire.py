"""ModelInfer's messages in their wire form, shared by the two processes that read them: a request taken
apart, and a response written, without protobuf copying the tensor bytes either way.

protobuf copies every `raw_input_contents` entry into a new `bytes` when it parses, and again when it is
read. The entries are instead cut out of the received buffer as memoryviews (`split_request`), and only
the rest of the message, a few hundred bytes of names and shapes, is parsed, by the daemon's gRPC adapter:
the tensor bytes are then copied once, into the worker's shared memory, or not at all when they are in a
front's arena. A front takes its requests apart itself (`split_spans`) and hands the daemon where the
pieces are (`Spans`), which the daemon turns back into the same split without walking the message again
(`split_from_spans`). On the way back, protobuf would copy each output into the message and again when
serializing it; the response is instead its header followed by the entries as separate pieces (joined
once, or sent as they are by a scatter-gather write). Nothing here imports the generated protobuf classes.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from typing import NamedTuple

RAW_INPUT_CONTENTS = 7  # field number of ModelInferRequest.raw_input_contents
RAW_OUTPUT_CONTENTS = 6  # field number of ModelInferResponse.raw_output_contents
_ID = 3  # field number of ModelInferRequest.id
_LENGTH_DELIMITED = 2
_OUTPUT_TAG = bytes([RAW_OUTPUT_CONTENTS << 3 | _LENGTH_DELIMITED])
_ID_TAG = bytes([_ID << 3 | _LENGTH_DELIMITED])
MAX_RAW_ENTRIES = 0xFFFF  # a request with more goes whole (a model has far fewer inputs)
MAX_KEY_BYTES = 4096  # a longer key is never kept (by the daemon's known headers, nor by a front)


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


class SplitRequest(NamedTuple):
    """A ModelInferRequest's wire bytes taken apart: `key`, the message without its raw_input_contents and
    its id (what requests of one kind share); the raw entries; the id's bytes, if it has one; and `rest`,
    the message without its raw_input_contents (to parse). A named tuple: one is made for every request
    on the daemon's thread, and a frozen dataclass costs twice as much to make."""

    key: bytes
    raw: list[memoryview]
    request_id: bytes | None
    pieces: tuple[bytes | bytearray | memoryview, ...]  # `rest`, not yet joined

    @property
    def rest(self) -> bytes | bytearray | memoryview:
        """Joined on demand: a request whose key is known is never parsed, so it never needs it."""
        pieces = self.pieces
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _skip(data: bytes | bytearray | memoryview, pos: int, wire_type: int) -> int:
    """Where a field that is not length-delimited ends; ValueError for a wire type protobuf no longer has."""
    if wire_type == 0:
        return _varint(data, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 5:
        return pos + 4
    raise ValueError(f"wire type {wire_type}")


def _split(data: bytes | bytearray | memoryview) -> tuple[SplitRequest, list[int], int, int] | None:
    """`split_request`'s split, with where its raw entries are (start and end of each, in order) and its
    id's start and end (-1 and -1: none); None when the bytes are not a well-formed message. One pass,
    views made as it goes: this runs for every request on the daemon's thread where no front splits it."""
    view = memoryview(data)
    size = len(data)
    rest: list[memoryview] = []  # the pieces between raw entries
    keyed: list[memoryview] = []  # the pieces between raw entries and ids
    raw: list[memoryview] = []
    spans: list[int] = []
    id_start = id_end = -1
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
                    spans += (pos, end)
                    start = key_start = end
                elif field == _ID:
                    keyed.append(view[key_start:field_start])
                    id_start, id_end = pos, end  # the last one counts, as protobuf reads it
                    key_start = end
                pos = end
            else:  # no field of ModelInferRequest itself: all are length-delimited
                pos = _skip(data, pos, wire_type)
    except (IndexError, ValueError):
        return None
    if pos != size:
        return None
    pieces: tuple[bytes | bytearray | memoryview, ...] = (data,)
    if raw:
        rest.append(view[start:size])
        pieces = tuple(rest)
    keyed.append(view[key_start:size])
    request_id = None if id_start < 0 else bytes(view[id_start:id_end])
    return SplitRequest(b"".join(keyed), raw, request_id, pieces), spans, id_start, id_end


def split_request(data: bytes | bytearray | memoryview) -> SplitRequest | None:
    """`SplitRequest` of the bytes, or None when they are not a well-formed message (the caller then lets
    protobuf report the error)."""
    found = _split(data)
    return None if found is None else found[0]


class Spans(NamedTuple):
    """Where a request's id and raw entries are in its bytes: what a front sends the daemon with them, so
    that the daemon need not walk the message. `id_start` is -1 when it has no id. A named tuple, as
    `SplitRequest` is: the daemon reads one for every call a front splits."""

    id_start: int
    id_end: int
    raw: tuple[int, ...]  # start and end of each raw entry, in order

    def pack(self, header_id: int) -> bytes:
        """The spans behind the id of the request's key (see the front link's frames)."""
        n = len(self.raw) // 2
        return _spans_struct(n).pack(header_id, n, self.id_start, self.id_end, *self.raw)


@functools.lru_cache(maxsize=64)
def _spans_struct(n: int) -> struct.Struct:
    return struct.Struct(f"!IHqq{2 * n}Q")


_SPANS_HEAD = _spans_struct(0)
ONE_RAW = _spans_struct(1)  # the spans of a request of one raw entry, most requests


def split_spans(data: bytes | bytearray | memoryview) -> tuple[bytes, Spans] | None:
    """A front's split: the request's key and where its pieces are; None when it is not well formed, has
    no raw entries (nothing to learn: see the daemon's known headers), too many, or a key too long to keep."""
    found = _split(data)
    if found is None:
        return None
    split, raw, id_start, id_end = found
    if not raw or len(raw) // 2 > MAX_RAW_ENTRIES or len(split.key) > MAX_KEY_BYTES:
        return None
    return split.key, Spans(id_start, id_end, tuple(raw))


def unpack_spans(payload: bytes | bytearray | memoryview) -> tuple[int, Spans, int] | None:
    """The header id, the spans and where what follows them starts in a payload that begins with `pack`'s
    bytes; None when it is too short for them."""
    if len(payload) < _SPANS_HEAD.size:
        return None
    header_id, n, id_start, id_end = _SPANS_HEAD.unpack_from(payload)
    layout = _spans_struct(n)
    if len(payload) < layout.size:
        return None
    raw = layout.unpack_from(payload)[4:]
    return header_id, Spans(id_start, id_end, raw), layout.size


def split_from_spans(data: bytes | bytearray | memoryview, key: bytes, spans: Spans) -> SplitRequest | None:
    """The `split_request` of `data` rebuilt from a front's spans and the key it declared, without walking
    the message; None when a span reaches outside the bytes."""
    return split_at(memoryview(data), key, spans.id_start, spans.id_end, spans.raw)


def split_at(
    view: memoryview, key: bytes, id_start: int, id_end: int, raw_spans: Sequence[int]
) -> SplitRequest | None:
    """`split_from_spans` on the spans' fields, as a front's frame carries them (`Spans.pack`)."""
    size = len(view)
    raw: list[memoryview] = []
    for i in range(0, len(raw_spans), 2):
        start, end = raw_spans[i], raw_spans[i + 1]
        if not 0 <= start <= end <= size:
            return None
        raw.append(view[start:end])
    if id_start < 0:
        return SplitRequest(key, raw, None, (key,))
    if not 0 <= id_start <= id_end <= size:
        return None
    request_id = bytes(view[id_start:id_end])
    return SplitRequest(key, raw, request_id, (key, _ID_TAG, varint_bytes(len(request_id)), request_id))


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
