"""Batch marshalling without a worker: where a batch's inputs go in the input region, what is written there,
and how the outputs are split back per request (`dataplane.marshal`)."""

from __future__ import annotations

import asyncio
import struct

import pytest

from mpsd.daemon.dataplane.marshal import ALIGN, BatchTensors, assemble, split
from mpsd.daemon.dataplane.request import InferRequest, InputTensor
from mpsd.errors import Internal, InvalidArgument
from mpsd.ipc.protocol import CONTROL_BYTES, TensorRef


def request(rows: int, x: bytes, mask: bytes, outputs: tuple[str, ...] = ("y",)) -> InferRequest:
    """`rows` rows of two inputs: x (FP32, 2 per row) and mask (BOOL, 3 per row)."""
    return InferRequest(
        "m",
        "1",
        "",
        (InputTensor("x", "FP32", (rows, 2), x), InputTensor("mask", "BOOL", (rows, 3), mask)),
        outputs,
        rows,
    )


def floats(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


class Unreadable:
    """Client shared memory that is gone by the time the batch is assembled."""

    def __len__(self) -> int:
        return 3

    def read_into(self, dest: memoryview) -> None:
        raise InvalidArgument("region gone")


def test_inputs_are_laid_out_after_the_control_block_aligned_with_all_rows_back_to_back() -> None:
    a = request(2, floats(1, 2, 3, 4), b"\x01\x00\x01\x00\x01\x00")
    b = request(1, floats(5, 6), b"\x01\x01\x01")
    tensors = BatchTensors([a, b], [])
    size = tensors.lay_out()
    x, mask = tensors.refs
    assert (x.name, x.datatype, x.shape, x.offset, x.nbytes) == ("x", "FP32", (3, 2), CONTROL_BYTES, 24)
    assert mask.offset % ALIGN == 0 and mask.offset >= x.offset + x.nbytes
    assert (mask.shape, mask.nbytes) == ((3, 3), 9)
    assert size == mask.offset + ALIGN  # the last input's end, aligned
    assert tensors.rows == 3
    # One request: its shapes go as they are.
    alone = BatchTensors([a], [])
    alone.lay_out()
    assert [r.shape for r in alone.refs] == [(2, 2), (2, 3)]


def test_written_inputs_are_each_requests_bytes_in_order_at_their_offsets() -> None:
    a = request(2, floats(1, 2, 3, 4), b"\x01\x00\x01\x00\x01\x00")
    b = request(1, floats(5, 6), memoryview(b"\x01\x01\x01"))
    tensors = BatchTensors([a, b], [])
    buf = memoryview(bytearray(tensors.lay_out()))
    tensors.write(buf)
    x, mask = tensors.refs
    assert bytes(buf[x.offset : x.offset + x.nbytes]) == floats(1, 2, 3, 4, 5, 6)
    assert bytes(buf[mask.offset : mask.offset + mask.nbytes]) == b"\x01\x00\x01\x00\x01\x00\x01\x01\x01"
    assert bytes(buf[:CONTROL_BYTES]) == bytes(CONTROL_BYTES)  # the control block is the handle's


def test_a_request_whose_bytes_cannot_be_read_fails_alone_and_without_callers_the_batch_fails() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        ok, broken = loop.create_future(), loop.create_future()
        a = request(1, floats(1, 2), b"\x01\x01\x01")
        b = InferRequest(
            "m",
            "1",
            "",
            (
                InputTensor("x", "FP32", (1, 2), floats(3, 4)),
                InputTensor("mask", "BOOL", (1, 3), Unreadable()),
            ),
            ("y",),
            1,
        )
        tensors = BatchTensors([a, b], [ok, broken])
        buf = memoryview(bytearray(tensors.lay_out()))
        tensors.write(buf)
        assert not ok.done()
        assert isinstance(broken.exception(), InvalidArgument)
        x = tensors.refs[0]
        assert bytes(buf[x.offset : x.offset + x.nbytes]) == floats(1, 2, 3, 4)  # the rest is written
        with pytest.raises(InvalidArgument):
            assemble(buf, tensors.refs, [a, b], [])

    asyncio.run(run())


def test_outputs_wanted_are_every_requests_each_once_in_the_order_first_asked() -> None:
    a = request(1, floats(1, 2), b"\x00\x00\x00", ("z", "y"))
    b = request(1, floats(1, 2), b"\x00\x00\x00", ("y", "w"))
    assert BatchTensors([a, b], []).outputs() == ("z", "y", "w")


def test_outputs_are_split_back_per_request_each_its_rows_of_what_it_asked_for() -> None:
    a = request(2, floats(1, 2, 3, 4), bytes(6), ("y", "z"))
    b = request(1, floats(5, 6), bytes(3), ("z",))
    tensors = BatchTensors([a, b], [])
    tensors.lay_out()
    out = bytearray(256)
    out[0:12] = floats(10, 20, 30)  # y: 3 rows of 1
    out[64:88] = floats(1, 1, 2, 2, 3, 3)  # z: 3 rows of 2
    refs = [TensorRef("y", "FP32", (3,), 0, 12), TensorRef("z", "FP32", (3, 2), 64, 24)]
    first, second = tensors.read(refs, memoryview(out))
    assert [(t.name, t.shape, t.data) for t in first] == [
        ("y", (2,), floats(10, 20)),
        ("z", (2, 2), floats(1, 1, 2, 2)),
    ]
    assert [(t.name, t.shape, t.data) for t in second] == [("z", (1, 2), floats(3, 3))]
    assert all(type(t.data) is bytes for t in (*first, *second))  # copied out: the region is reused


def test_a_single_request_takes_its_outputs_as_the_worker_shaped_them() -> None:
    a = request(2, floats(1, 2, 3, 4), bytes(6), ("s",))
    out = memoryview(bytearray(floats(7)))
    ((scalar,),) = split([a], [TensorRef("s", "FP32", (), 0, 4)], out, 2)
    assert (scalar.shape, scalar.data) == ((), floats(7))


def test_a_batched_output_without_the_batch_as_first_dimension_is_an_internal_error() -> None:
    a = request(2, floats(1, 2, 3, 4), bytes(6))
    b = request(1, floats(5, 6), bytes(3))
    with pytest.raises(Internal, match="first dimension must be the batch"):
        split([a, b], [TensorRef("y", "FP32", (2,), 0, 8)], memoryview(bytearray(8)), 3)


def test_string_outputs_are_split_where_each_requests_first_row_starts() -> None:
    """BYTES rows differ in size: each request's rows are found by walking the elements, and a fixed-size
    output beside them is still cut by its row size."""
    a = request(2, floats(1, 2, 3, 4), bytes(6), ("s", "y"))
    b = request(1, floats(5, 6), bytes(3), ("s",))
    items = [b"a", b"bb", b"", b"dddd", b"e", b"ff"]  # 3 rows of 2 elements
    data = b"".join(struct.pack("<I", len(item)) + item for item in items)
    out = bytearray(256)
    out[: len(data)] = data
    out[128:140] = floats(10, 20, 30)
    refs = [TensorRef("s", "BYTES", (3, 2), 0, len(data)), TensorRef("y", "FP32", (3,), 128, 12)]
    first, second = split([a, b], refs, memoryview(out), 3)
    strings_of = [struct.pack("<I", len(i)) + i for i in items]
    assert [(t.name, t.shape, t.data) for t in first] == [
        ("s", (2, 2), b"".join(strings_of[:4])),
        ("y", (2,), floats(10, 20)),
    ]
    assert [(t.name, t.shape, t.data) for t in second] == [("s", (1, 2), b"".join(strings_of[4:]))]
