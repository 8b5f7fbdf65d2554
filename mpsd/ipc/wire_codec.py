"""The payload of a daemon <-> worker frame: a fixed binary layout for the per-request messages, pickle
for everything else.

Every request pays for its Infer and InferDone (or InferFailed) in both processes, and pickle cost about
20 us per request there; `struct` with precompiled layouts costs a fraction of that. A binary payload starts
with its kind, a byte below 0x80; a pickle (protocol 2 or later) always starts with 0x80.

The variable part of an Infer (its regions, input refs and output names) and the output refs of an
InferDone or StreamPart repeat from request to request of a model at one batch size, so both ends cache
it: the encoder by its field values, the decoder by its bytes (the objects it hands out are frozen, so one
may serve many messages). A value the layout cannot hold (an int past 64 bits, a name past 65535 bytes, a
string with a lone surrogate, a shape that is a list) sends that message as a pickle instead.
"""

from __future__ import annotations

import operator
import pickle
import struct
from collections.abc import Callable
from itertools import chain
from typing import Any, TypeVar

from mpsd.ipc import protocol as p

Buffer = bytes | bytearray | memoryview
M = TypeVar("M")

PICKLED = 0x80  # the first byte of a pickle of protocol 2 or later
INFER, INFER_DONE, INFER_FAILED, STREAM_PART, STREAM_ACK = 1, 2, 3, 4, 5

# Each message: a fixed head, then for some a variable tail. Integers are little-endian int64, lengths and
# counts uint16 (a string's length in UTF-8 bytes).
_INFER = struct.Struct("<BqqqqI")  # kind, req_id, seat, sent_ns, requests, pieces; then each piece's
# five fields (int64 each), then the tail: _INFER_TAIL
_DONE = struct.Struct("<Bqqqqq?q")  # kind, req_id, compute input/infer/output ns, waited, has device, device
_PART = struct.Struct("<Bqq")  # kind, req_id, index; tail: refs
_ACK = struct.Struct("<Bqq?")  # kind, req_id, index, stop
_FAILED = struct.Struct("<BqHI")  # kind, req_id, code's length, message's length (uint32); code, message
# Infer's tail: input and output region sizes, their names' lengths, counts of input refs and output names;
# then both region names, the input refs, each output name's length and the output names.
_INFER_TAIL = struct.Struct("<qqHHHH")
# A tensor ref: this, then its name, its datatype and its dims (int64 each). Refs on their own (InferDone,
# StreamPart) are preceded by their count.
_REF = struct.Struct("<HHHqq")  # name's length, datatype's length, dims, offset, nbytes
_COUNT = struct.Struct("<H")
_PIECE_FIELDS = len(p.Piece._fields)
_DIMS = tuple(struct.Struct(f"<{n}q") for n in range(9))

CACHE_ENTRIES = 1024  # per cache; when full it starts over (a model whose shapes vary misses each time)
_REF_FIELDS = operator.attrgetter("name", "datatype", "shape", "offset", "nbytes")
_new = object.__new__


class MalformedFrame(ValueError):
    """A payload that is not one this module writes (truncated, trailing bytes, unknown kind)."""


def dumps(message: object) -> bytes:
    """The payload for `message`: binary for the per-request kinds, a pickle otherwise."""
    pack = _PACKERS.get(type(message))
    if pack is not None:
        try:
            return pack(message)
        except (struct.error, UnicodeEncodeError, TypeError):
            pass  # outside the layout, or not of the declared types: pickle holds it
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def loads(payload: Buffer) -> object:
    """The message in `payload` (a whole frame's payload; a view into a reused buffer is copied from)."""
    if not payload:
        raise MalformedFrame("empty frame")
    kind = payload[0]
    if kind == PICKLED:
        return pickle.loads(payload)
    try:
        unpack = _UNPACKERS[kind]
    except KeyError:
        raise MalformedFrame(f"unknown frame kind {kind:#04x}") from None
    try:
        return unpack(payload)
    except (struct.error, UnicodeDecodeError) as exc:
        raise MalformedFrame(f"malformed frame of kind {kind}: {exc}") from exc


def clear_caches() -> None:
    """Forget every cached tail (tests and benchmarks: the next message is encoded and parsed in full)."""
    for cache in (_infer_tails, _refs_tails, _infer_parts, _refs_parts):
        cache.clear()


def _remember(cache: dict[Any, M], key: object, value: M) -> M:
    if len(cache) >= CACHE_ENTRIES:
        cache.clear()
    cache[key] = value
    return value


# Encoding


def _dims(n: int) -> struct.Struct:
    return _DIMS[n] if n < len(_DIMS) else struct.Struct(f"<{n}q")


def _put_refs(out: list[bytes], refs: tuple[p.TensorRef, ...]) -> None:
    for ref in refs:
        name, datatype, shape = ref.name.encode(), ref.datatype.encode(), ref.shape
        out.append(_REF.pack(len(name), len(datatype), len(shape), ref.offset, ref.nbytes))
        out.append(name)
        out.append(datatype)
        out.append(_dims(len(shape)).pack(*shape))


def _infer_tail(msg: p.Infer) -> bytes:
    i, o = msg.input_region, msg.output_region
    i_name, o_name = i.name.encode(), o.name.encode()
    outputs = [name.encode() for name in msg.outputs]
    head = _INFER_TAIL.pack(i.size, o.size, len(i_name), len(o_name), len(msg.inputs), len(outputs))
    out = [head, i_name, o_name]
    _put_refs(out, msg.inputs)
    out.append(struct.pack(f"<{len(outputs)}H", *map(len, outputs)))
    out.extend(outputs)
    return b"".join(out)


def _refs_tail(refs: tuple[p.TensorRef, ...]) -> bytes:
    out = [_COUNT.pack(len(refs))]
    _put_refs(out, refs)
    return b"".join(out)


_infer_tails: dict[tuple[object, ...], bytes] = {}
_refs_tails: dict[tuple[object, ...], bytes] = {}


def _pack_infer(msg: p.Infer) -> bytes:
    if msg.parameters or msg.trace:
        raise TypeError("parameters or trace: pickled (rare)")
    if msg.sequence:
        raise TypeError("sequence: pickled (only sequence models' executions have it)")
    i, o = msg.input_region, msg.output_region
    key = (msg.outputs, i.name, i.size, o.name, o.size, *map(_REF_FIELDS, msg.inputs))
    tail = _infer_tails.get(key)
    if tail is None:
        tail = _remember(_infer_tails, key, _infer_tail(msg))
    pieces = msg.pieces
    head = _INFER.pack(INFER, msg.req_id, msg.seat, msg.sent_ns, msg.requests, len(pieces))
    if not pieces:
        return head + tail
    # A batch of images from fronts' arenas has a piece per image: plain integers, not a pickle of each.
    return b"".join(
        (head, struct.pack(f"<{_PIECE_FIELDS * len(pieces)}q", *chain.from_iterable(pieces)), tail)
    )


def _pack_refs(refs: tuple[p.TensorRef, ...]) -> bytes:
    key = tuple(map(_REF_FIELDS, refs))
    tail = _refs_tails.get(key)
    if tail is None:
        tail = _remember(_refs_tails, key, _refs_tail(refs))
    return tail


def _pack_done(msg: p.InferDone) -> bytes:
    if msg.span is not None:
        raise TypeError("a traced execution's answer is pickled")
    device = msg.device_compute_ns
    head = _DONE.pack(
        INFER_DONE,
        msg.req_id,
        msg.compute_input_ns,
        msg.compute_infer_ns,
        msg.compute_output_ns,
        msg.waited_ns,
        device is not None,
        0 if device is None else device,
    )
    return head + _pack_refs(msg.outputs)


def _pack_part(msg: p.StreamPart) -> bytes:
    return _PART.pack(STREAM_PART, msg.req_id, msg.index) + _pack_refs(msg.outputs)


def _pack_ack(msg: p.StreamAck) -> bytes:
    return _ACK.pack(STREAM_ACK, msg.req_id, msg.index, msg.stop)


def _pack_failed(msg: p.InferFailed) -> bytes:
    code, text = msg.code.encode(), msg.message.encode()
    return _FAILED.pack(INFER_FAILED, msg.req_id, len(code), len(text)) + code + text


_PACKERS: dict[type, Callable[[Any], bytes]] = {
    p.Infer: _pack_infer,
    p.InferDone: _pack_done,
    p.InferFailed: _pack_failed,
    p.StreamPart: _pack_part,
    p.StreamAck: _pack_ack,
}


# Decoding. A tail is parsed once per distinct bytes (the cache holds the rest). Slicing never fails, so
# a length that runs past the end shows only in the final position: it must be the tail's end exactly.


def _parse_refs(data: bytes, pos: int, count: int) -> tuple[tuple[p.TensorRef, ...], int]:
    refs = []
    for _ in range(count):
        name_len, datatype_len, ndim, offset, nbytes = _REF.unpack_from(data, pos)
        pos += _REF.size
        name = data[pos : pos + name_len].decode()
        pos += name_len
        datatype = data[pos : pos + datatype_len].decode()
        pos += datatype_len
        dims = _dims(ndim)
        shape = dims.unpack_from(data, pos)
        pos += dims.size
        ref = _new(p.TensorRef)
        ref.__dict__.update(name=name, datatype=datatype, shape=shape, offset=offset, nbytes=nbytes)
        refs.append(ref)
    return tuple(refs), pos


def _check_end(data: bytes, pos: int) -> None:
    if pos != len(data):
        raise MalformedFrame(f"the message's lengths add up to {pos} bytes of a {len(data)}-byte tail")


_InferParts = tuple[tuple[p.TensorRef, ...], tuple[str, ...], p.RegionRef, p.RegionRef]
_infer_parts: dict[bytes, _InferParts] = {}
_refs_parts: dict[bytes, tuple[p.TensorRef, ...]] = {}


def _parse_infer_tail(data: bytes) -> _InferParts:
    i_size, o_size, i_len, o_len, n_inputs, n_outputs = _INFER_TAIL.unpack_from(data)
    pos = _INFER_TAIL.size
    i_name = data[pos : pos + i_len].decode()
    pos += i_len
    o_name = data[pos : pos + o_len].decode()
    pos += o_len
    inputs, pos = _parse_refs(data, pos, n_inputs)
    lengths = struct.unpack_from(f"<{n_outputs}H", data, pos)
    pos += 2 * n_outputs
    outputs = []
    for n in lengths:
        outputs.append(data[pos : pos + n].decode())
        pos += n
    _check_end(data, pos)
    return inputs, tuple(outputs), p.RegionRef(i_name, i_size), p.RegionRef(o_name, o_size)


def _parse_refs_tail(data: bytes) -> tuple[p.TensorRef, ...]:
    (count,) = _COUNT.unpack_from(data)
    refs, pos = _parse_refs(data, _COUNT.size, count)
    _check_end(data, pos)
    return refs


def _refs_at(payload: Buffer, start: int) -> tuple[p.TensorRef, ...]:
    tail = bytes(payload[start:])
    refs = _refs_parts.get(tail)
    if refs is None:
        refs = _remember(_refs_parts, tail, _parse_refs_tail(tail))
    return refs


# Messages are built as pickle builds them (a new object, then its fields), which skips the frozen
# dataclass's __init__ and its per-field object.__setattr__: half the cost of building one.


def _unpack_infer(payload: Buffer) -> p.Infer:
    _, req_id, seat, sent_ns, requests, n_pieces = _INFER.unpack_from(payload)
    start = _INFER.size + 8 * _PIECE_FIELDS * n_pieces
    if len(payload) < start:
        raise MalformedFrame(f"an Infer of {len(payload)} bytes cannot hold its {n_pieces} pieces")
    pieces: tuple[p.Piece, ...] = ()
    if n_pieces:
        values = struct.unpack_from(f"<{_PIECE_FIELDS * n_pieces}q", payload, _INFER.size)
        pieces = tuple(map(p.Piece._make, zip(*[iter(values)] * _PIECE_FIELDS, strict=True)))
    tail = bytes(payload[start:])
    parts = _infer_parts.get(tail)
    if parts is None:
        parts = _remember(_infer_parts, tail, _parse_infer_tail(tail))
    inputs, outputs, input_region, output_region = parts
    msg = _new(p.Infer)
    msg.__dict__.update(
        req_id=req_id,
        inputs=inputs,
        outputs=outputs,
        input_region=input_region,
        output_region=output_region,
        seat=seat,
        sent_ns=sent_ns,
        requests=requests,
        pieces=pieces,
        parameters=(),
        sequence=(),
        trace="",
    )
    return msg


def _unpack_done(payload: Buffer) -> p.InferDone:
    _, req_id, input_ns, infer_ns, output_ns, waited_ns, has_device, device_ns = _DONE.unpack_from(payload)
    msg = _new(p.InferDone)
    msg.__dict__.update(
        req_id=req_id,
        outputs=_refs_at(payload, _DONE.size),
        compute_input_ns=input_ns,
        compute_infer_ns=infer_ns,
        compute_output_ns=output_ns,
        waited_ns=waited_ns,
        device_compute_ns=device_ns if has_device else None,
        span=None,
    )
    return msg


def _unpack_part(payload: Buffer) -> p.StreamPart:
    _, req_id, index = _PART.unpack_from(payload)
    return p.StreamPart(req_id, index, _refs_at(payload, _PART.size))


def _unpack_ack(payload: Buffer) -> p.StreamAck:
    if len(payload) != _ACK.size:
        raise MalformedFrame(f"a StreamAck of {len(payload)} bytes, not {_ACK.size}")
    _, req_id, index, stop = _ACK.unpack_from(payload)
    return p.StreamAck(req_id, index, stop)


def _unpack_failed(payload: Buffer) -> p.InferFailed:
    _, req_id, code_len, text_len = _FAILED.unpack_from(payload)
    start = _FAILED.size
    if len(payload) != start + code_len + text_len:
        raise MalformedFrame(f"an InferFailed of {len(payload)} bytes, not {start + code_len + text_len}")
    msg = _new(p.InferFailed)
    msg.__dict__.update(
        req_id=req_id,
        code=bytes(payload[start : start + code_len]).decode(),
        message=bytes(payload[start + code_len :]).decode(),
    )
    return msg


_UNPACKERS: dict[int, Callable[[Buffer], object]] = {
    INFER: _unpack_infer,
    INFER_DONE: _unpack_done,
    INFER_FAILED: _unpack_failed,
    STREAM_PART: _unpack_part,
    STREAM_ACK: _unpack_ack,
}
