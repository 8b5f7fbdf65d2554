"""Shape buckets (a model's `shape_buckets`): requests of different lengths padded to a few shapes.

A bucketed input's variable dim is padded, where the batch's inputs are laid out for the worker, to the
smallest of its sizes that holds the batch's longest request; the queue's batching key holds that size, not
the exact length, so requests of different lengths share an execution. The model then sees a few shapes
only (one CUDA graph each, one entry each in MPS's graph cache), the daemon makes the mask input (1 at real
positions, 0 at padding), and outputs that follow a bucketed input are cut back to each request's length.
"""

from __future__ import annotations

import asyncio
import bisect
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpsd.config.model_config import ModelConfig
from mpsd.config.shape_buckets import mask_follows
from mpsd.daemon.dataplane.marshal import ALIGN, BatchTensors, assemble
from mpsd.daemon.dataplane.request import InferRequest, OutputTensor
from mpsd.daemon.dataplane.tensors import Place
from mpsd.errors import InvalidArgument, MpsdError
from mpsd.ipc import protocol as p
from mpsd.ipc.dtypes import DATATYPES, config_to_wire


@dataclass(frozen=True)
class _Input:
    index: int  # in the request's inputs (config order)
    name: str
    dim: int  # in the tensor as the model gets it (0 is the batch dimension when batching)
    sizes: tuple[int, ...]
    pad: float


def _raw(datatype: str) -> str:
    """An unsigned numpy type of the datatype's size: bytes are moved as such, whatever they mean."""
    itemsize = DATATYPES[datatype].itemsize
    assert itemsize is not None, "strings are not bucketed (shape_buckets' rules)"
    return f"u{itemsize}"


def _pad_bits(datatype: str, value: float) -> Any:
    """The pad value as the datatype's bytes, read as its `_raw` type."""
    numpy = DATATYPES[datatype].numpy
    if numpy is None:  # BF16: the upper half of the float32
        return (np.array(value, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return np.array(value).astype(numpy).view(_raw(datatype))


class Buckets:
    """A model's shape buckets: `admit` checks a request and gives its batching key, `tensors` lays a batch
    out padded and cuts its outputs back."""

    def __init__(self, config: ModelConfig) -> None:
        sb = config.shape_buckets
        assert sb is not None
        self.model = config.name or ""
        order = [t.name for t in config.input]
        self.inputs = tuple(
            _Input(order.index(name), name, b.dim, tuple(b.sizes), b.pad_value)
            for name, b in sb.inputs.items()
        )
        by_name = {b.name: b for b in self.inputs}
        follows = mask_follows(config)
        self.mask: tuple[str, str, _Input] | None = None
        if sb.mask_input is not None and follows is not None:
            self.mask = (sb.mask_input.name, config_to_wire(sb.mask_input.data_type), by_name[follows])
        self.outputs = {name: (cut.dim, by_name[cut.follows]) for name, cut in sb.outputs.items()}

    def admit(self, request: InferRequest) -> Hashable:
        """The request's batching key (its inputs' types and shapes past the batch dimension, each bucketed
        dim as its bucket); InvalidArgument when a length exceeds its largest bucket."""
        shapes = [list(t.shape) for t in request.inputs]
        for b in self.inputs:
            length = shapes[b.index][b.dim]
            shapes[b.index][b.dim] = self.bucket(b, length)
        key = tuple((t.datatype, tuple(s[1:])) for t, s in zip(request.inputs, shapes, strict=True))
        return (key, request.parameters) if request.parameters else key

    def bucket(self, b: _Input, length: int) -> int:
        """The smallest of the input's sizes that holds `length`."""
        i = bisect.bisect_left(b.sizes, length)
        if i == len(b.sizes):
            raise InvalidArgument(
                f"input '{b.name}': length {length} along dim {b.dim} exceeds the largest shape bucket "
                f"{b.sizes[-1]} of model '{self.model}'"
            )
        return b.sizes[i]

    def tensors(
        self, requests: Sequence[InferRequest], waiting: Sequence[asyncio.Future[Any]]
    ) -> BucketedTensors:
        return BucketedTensors(self, requests, waiting)


class BucketedTensors(BatchTensors):
    """A batch's tensors with its bucketed inputs padded, the mask input after the config's inputs, and the
    outputs that follow a bucketed input cut back to each request's length."""

    __slots__ = ("buckets",)

    def __init__(
        self, buckets: Buckets, requests: Sequence[InferRequest], waiting: Sequence[asyncio.Future[Any]]
    ) -> None:
        super().__init__(requests, waiting)
        self.buckets = buckets

    def lay_out(self) -> int:
        """As a plain batch, but each bucketed input at its padded shape, then the mask."""
        end = super().lay_out()
        requests, refs = self.requests, list(self.refs)
        for b in self.buckets.inputs:
            ref = refs[b.index]
            size = self.buckets.bucket(b, max(r.inputs[b.index].shape[b.dim] for r in requests))
            shape = (*ref.shape[: b.dim], size, *ref.shape[b.dim + 1 :])
            refs[b.index] = p.TensorRef(ref.name, ref.datatype, shape, 0, _nbytes(ref.datatype, shape))
        mask = self.buckets.mask
        if mask is not None:
            name, datatype, follows = mask
            shape = refs[follows.index].shape[: follows.dim + 1]
            refs.append(p.TensorRef(name, datatype, shape, 0, _nbytes(datatype, shape)))
        offset = p.CONTROL_BYTES
        for i, ref in enumerate(refs):  # placed again: the padded inputs take more room
            refs[i] = p.TensorRef(ref.name, ref.datatype, ref.shape, offset, ref.nbytes)
            offset = _align(offset + ref.nbytes)
        self.refs = tuple(refs)
        return max(end, offset)

    def write(self, buf: memoryview, place: Place | None = None) -> tuple[p.Piece, ...]:
        buckets = self.buckets
        padded = {b.index for b in buckets.inputs}
        plain = [
            ref if i not in padded else None
            for i, ref in enumerate(self.refs[: len(self.requests[0].inputs)])
        ]
        pieces = assemble(buf, plain, self.requests, self.waiting, place)
        for b in buckets.inputs:
            self._pad(buf, b)
        if buckets.mask is not None:
            self._mask(buf, *buckets.mask)
        return pieces

    def _array(self, buf: memoryview, ref: p.TensorRef) -> Any:
        dtype = np.dtype(_raw(ref.datatype))
        return np.frombuffer(buf, dtype, math.prod(ref.shape), ref.offset).reshape(ref.shape)

    def _pad(self, buf: memoryview, b: _Input) -> None:
        """The input's padded tensor: the pad value, with each request's rows copied into its corner."""
        ref = self.refs[b.index]
        out = self._array(buf, ref)
        out.fill(_pad_bits(ref.datatype, b.pad))
        row = 0
        for k, r in enumerate(self.requests):
            t = r.inputs[b.index]
            where = (slice(row, row + t.shape[0]), *(slice(0, s) for s in t.shape[1:]))
            row += t.shape[0]
            if self.waiting and self.waiting[k].done():
                continue  # its caller is gone: its bytes may be reused already
            data = t.data
            given: bytes | bytearray | memoryview
            if isinstance(data, (bytes, bytearray, memoryview)):
                given = data
            else:  # a client's shared memory
                given = bytearray(len(data))
                try:
                    data.read_into(memoryview(given))
                except MpsdError as exc:
                    if not self.waiting:
                        raise
                    self.waiting[k].set_exception(exc)
                    continue
            out[where] = np.frombuffer(given, out.dtype).reshape(t.shape)

    def _mask(self, buf: memoryview, name: str, datatype: str, follows: _Input) -> None:
        """1 at each request's real positions along the followed dim, 0 past them."""
        ref = self.refs[-1]
        out = self._array(buf, ref)
        out.fill(0)
        one = _pad_bits(datatype, 1)
        row = 0
        for r in self.requests:
            shape = r.inputs[follows.index].shape
            length = shape[follows.dim]
            if follows.dim == 0:  # without batching: the tensor's own first dim
                out[:length] = one
                continue
            between = (slice(None),) * (follows.dim - 1)
            where = (slice(row, row + shape[0]), *between, slice(0, length))
            out[where] = one
            row += shape[0]

    def read(self, refs: Sequence[p.TensorRef], buf: memoryview) -> list[tuple[OutputTensor, ...]]:
        results = super().read(refs, buf)
        cuts = self.buckets.outputs
        if not cuts:
            return results
        return [
            tuple(_cut(t, r, *cuts[t.name]) if t.name in cuts else t for t in tensors)
            for r, tensors in zip(self.requests, results, strict=True)
        ]


def _cut(t: OutputTensor, request: InferRequest, dim: int, follows: _Input) -> OutputTensor:
    """The output's rows of one request, cut back along `dim` to the request's length of `follows`."""
    length = request.inputs[follows.index].shape[follows.dim]
    if dim >= len(t.shape) or t.shape[dim] <= length:
        return t
    rows = np.frombuffer(t.data, _raw(t.datatype)).reshape(t.shape)
    kept = rows[(slice(None),) * dim + (slice(0, length),)]
    return OutputTensor(t.name, t.datatype, tuple(kept.shape), np.ascontiguousarray(kept).tobytes())


def _nbytes(datatype: str, shape: Sequence[int]) -> int:
    itemsize = DATATYPES[datatype].itemsize
    assert itemsize is not None
    return math.prod(shape) * itemsize


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
