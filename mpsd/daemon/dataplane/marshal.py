"""A batch's tensors in a worker's shared memory: its requests' inputs concatenated along the batch
dimension into the input region, and each request's rows of every output it asked for copied back out.

The worker's handle provides the regions and moves no tensor bytes itself; it calls `BatchTensors` while it
holds the execution's seat, so the regions cannot change under the copies.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

from mpsd.daemon.dataplane.request import InferRequest, OutputTensor
from mpsd.daemon.dataplane.tensors import Place
from mpsd.errors import Internal, MpsdError
from mpsd.ipc import protocol as p
from mpsd.ipc import strings

ALIGN = 64
# Arena bytes at least this large are read by the worker in place; smaller ones cost less to copy than
# the worker's per-piece work.
IN_PLACE_BYTES = 64 * 1024


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def assemble(
    buf: memoryview,
    refs: Sequence[p.TensorRef | None],
    requests: Sequence[InferRequest],
    waiting: Sequence[asyncio.Future[Any]],
    place: Place | None = None,
) -> tuple[p.Piece, ...]:
    """Write the batch's inputs in place: each input's requests back to back from its ref's offset, one copy
    per request's bytes, except bytes that `place` finds in an arena the worker has mapped (at least
    IN_PLACE_BYTES): those are returned as pieces for the worker to read, and not copied.

    A request whose caller is gone (cancelled after the batch was formed) keeps its rows but lends no bytes:
    they may be in a front's arena chunk that is already in use for another call. Bytes in a client's shared
    memory are read here; a request whose bytes cannot be read any more fails alone (its rows stay as they
    were), when it has a caller to tell. A ref that is None is another's to write (a padded input's).
    """
    pieces: list[p.Piece] = []
    for i, ref in enumerate(refs):
        if ref is None:
            continue
        pos = ref.offset
        # Strings are read by the worker in one piece, out of its region.
        in_place = place if ref.datatype != strings.DATATYPE else None
        for k, r in enumerate(requests):
            data = r.inputs[i].data
            n = len(data)
            if not (waiting and waiting[k].done()):
                if isinstance(data, memoryview) and in_place is not None and n >= IN_PLACE_BYTES:
                    found = in_place(data)
                    if found is not None:
                        pieces.append(p.Piece(i, found[0], found[1], pos, n))
                        pos += n
                        continue
                if isinstance(data, (bytes, bytearray, memoryview)):
                    buf[pos : pos + n] = data
                else:
                    try:
                        data.read_into(buf[pos : pos + n])
                    except MpsdError as exc:
                        if not waiting:
                            raise
                        waiting[k].set_exception(exc)
            pos += n
    return tuple(pieces)


def split(
    requests: Sequence[InferRequest], refs: Sequence[p.TensorRef], buf: memoryview, total_rows: int
) -> list[tuple[OutputTensor, ...]]:
    """Each request's rows of each output it asked for, copied once out of the output region."""
    by_name = {ref.name: ref for ref in refs}
    if len(requests) == 1:
        only = requests[0]
        return [
            tuple(
                OutputTensor(
                    ref.name,
                    ref.datatype,
                    ref.shape,
                    bytes(buf[ref.offset : ref.offset + ref.nbytes]),
                )
                for ref in (by_name[name] for name in only.outputs)
            )
        ]
    for ref in refs:
        if not ref.shape or ref.shape[0] != total_rows:
            raise Internal(
                f"output '{ref.name}': a batch of {total_rows} rows gave shape {list(ref.shape)}; "
                "the first dimension must be the batch"
            )
    # Each output's place once per batch (not per request): its ref's fields, and its rows' size (fixed-size
    # data) or where each row starts (strings).
    places = {
        ref.name: (ref.datatype, ref.offset, ref.shape[1:], _rows(ref, buf, total_rows)) for ref in refs
    }
    results = []
    row = 0
    for r in requests:
        n = r.batch_size
        tensors = []
        for name in r.outputs:
            datatype, offset, tail, rows = places[name]
            if isinstance(rows, int):
                start = offset + row * rows
                end = start + n * rows
            else:
                start, end = offset + rows[row], offset + rows[row + n]
            tensors.append(OutputTensor(name, datatype, (n, *tail), bytes(buf[start:end])))
        results.append(tuple(tensors))
        row += n
    return results


def _rows(ref: p.TensorRef, buf: memoryview, total_rows: int) -> int | list[int]:
    """An output's rows: the size of each (fixed-size data), or where each starts, found by walking the
    elements (strings)."""
    if ref.datatype != strings.DATATYPE:
        return ref.nbytes // total_rows
    per_row = math.prod(ref.shape[1:])
    try:
        return strings.row_bounds(buf[ref.offset : ref.offset + ref.nbytes], total_rows, per_row)
    except strings.MalformedStrings as exc:
        raise Internal(f"output '{ref.name}': the worker's BYTES data {exc}") from None


class BatchTensors:
    """One execution's tensors, as the worker's handle asks for them (`Tensors`): where the inputs go, their
    bytes, the outputs wanted, and each request's share of the outputs.

    `waiting` are the requests' futures (empty: nobody to tell); a request whose future is done lends no
    bytes, and one whose bytes cannot be read fails through its future.
    """

    __slots__ = ("refs", "requests", "rows", "waiting")
    sequence: tuple[tuple[int, bool], ...] = ()  # a sequence model's rows (dataplane/sequence_plane.py)

    def __init__(self, requests: Sequence[InferRequest], waiting: Sequence[asyncio.Future[Any]]) -> None:
        self.requests = requests
        self.waiting = waiting
        self.refs: tuple[p.TensorRef, ...] = ()
        self.rows = 0

    def lay_out(self) -> int:
        """Place each input in the input region (after the control block, 64-byte aligned), all requests'
        rows back to back (`refs`); returns the region size that needs."""
        requests = self.requests
        self.rows = total_rows = sum(r.batch_size for r in requests)
        refs = []
        offset = p.CONTROL_BYTES
        for i, t in enumerate(requests[0].inputs):
            n = sum(len(r.inputs[i].data) for r in requests)
            shape = (total_rows, *t.shape[1:]) if len(requests) > 1 else t.shape
            refs.append(p.TensorRef(t.name, t.datatype, shape, offset, n))
            offset = _align(offset + n)
        self.refs = tuple(refs)
        return offset

    def write(self, buf: memoryview, place: Place | None = None) -> tuple[p.Piece, ...]:
        return assemble(buf, self.refs, self.requests, self.waiting, place)

    def outputs(self) -> tuple[str, ...]:
        """Every output any request asked for, each once, in the order first asked."""
        return tuple(dict.fromkeys(name for r in self.requests for name in r.outputs))

    def parameters(self) -> p.RequestParameters:
        """The requests' parameters: equal for every request of a batch (`Pending.key`)."""
        return self.requests[0].parameters

    def read(self, refs: Sequence[p.TensorRef], buf: memoryview) -> list[tuple[OutputTensor, ...]]:
        return split(self.requests, refs, buf, self.rows)
