"""Input bytes read in place from the fronts' arenas: which bytes the daemon leaves to the worker (pieces),
how the worker builds its inputs from them on the CPU and on a CUDA GPU, the book of arenas, and the
message that carries them. The end to end case (a daemon with fronts, batched requests) is in
test_fronts.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from mpsd.daemon.dataplane.arenas import ArenaBook
from mpsd.daemon.dataplane.marshal import IN_PLACE_BYTES, BatchTensors
from mpsd.daemon.dataplane.request import InferRequest, InputTensor
from mpsd.ipc import protocol as p
from mpsd.ipc.shm import Region
from mpsd.ipc.wire_codec import PICKLED, dumps, loads
from mpsd.worker.inference import Runner
from mpsd.worker.regions import Arenas
from tests import models
from tests.conftest import free_port, serving

ROW = IN_PLACE_BYTES  # bytes per request: just large enough to be read in place
FLOATS = ROW // 4


def request(data: bytes | memoryview) -> InferRequest:
    return InferRequest("m", "1", "", (InputTensor("x", "FP32", (1, FLOATS), data),), ("y",), 1)


def rows(*values: float) -> bytes:
    return b"".join(np.full(FLOATS, v, dtype=np.float32).tobytes() for v in values)


def test_bytes_in_a_mapped_arena_are_left_to_the_worker_and_the_rest_copied() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        arena = bytearray(rows(1, 2, 3))
        view = memoryview(arena)
        live, gone = loop.create_future(), loop.create_future()
        gone.cancel()

        def place(data: memoryview) -> tuple[int, int] | None:
            base = np.frombuffer(view, np.uint8).ctypes.data
            at = np.frombuffer(data, np.uint8).ctypes.data
            return (7, at - base) if base <= at < base + len(arena) else None

        batch = [
            request(view[0:ROW]),  # in the arena: a piece
            request(rows(9)),  # the daemon's own bytes: copied
            request(view[2 * ROW : 3 * ROW]),  # in the arena, but its caller is gone: neither
            request(view[ROW : 2 * ROW]),  # in the arena: a piece
        ]
        tensors = BatchTensors(batch, [live, live, gone, live])
        buf = memoryview(bytearray(tensors.lay_out()))
        pieces = tensors.write(buf, place)
        (x,) = tensors.refs
        assert pieces == (
            p.Piece(0, 7, 0, x.offset, ROW),
            p.Piece(0, 7, ROW, x.offset + 3 * ROW, ROW),
        )
        written = bytes(buf[x.offset : x.offset + x.nbytes])
        assert written == bytes(ROW) + rows(9) + bytes(2 * ROW)  # only the daemon's bytes were copied
        # Without arenas (a worker started before them), everything is copied.
        plain = BatchTensors(batch, [])
        buf = memoryview(bytearray(plain.lay_out()))
        assert plain.write(buf, None) == ()
        assert bytes(buf[x.offset : x.offset + x.nbytes]) == rows(1, 9, 3, 2)

    asyncio.run(run())


def test_small_bytes_are_copied_even_in_an_arena() -> None:
    arena = memoryview(bytearray(64))
    small = InferRequest("m", "1", "", (InputTensor("x", "UINT8", (1, 16), arena[0:16]),), ("y",), 1)
    tensors = BatchTensors([small], [])
    buf = memoryview(bytearray(tensors.lay_out()))
    assert tensors.write(buf, lambda data: (1, 0)) == ()


NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=NO_GPU)]


@pytest.mark.parametrize("device", DEVICES)
def test_the_worker_builds_its_inputs_from_the_pieces_and_the_region(device: str) -> None:
    """Rows 0 and 2 come from the arena (in another order there), rows 1 and 3 from the region."""
    arena = Region.create(4 * ROW, keep_fd=True)
    try:
        arena.buf[: 2 * ROW] = rows(20, 10)
        assert arena.fd is not None
        arenas = Arenas([p.ArenaRef(5, os.dup(arena.fd), arena.size)])
        offset = p.CONTROL_BYTES
        region_bytes = bytearray(offset + 4 * ROW)
        region_bytes[offset + ROW : offset + 2 * ROW] = rows(11)
        region_bytes[offset + 3 * ROW :] = rows(13)
        region = SimpleNamespace(buf=memoryview(region_bytes), size=len(region_bytes))
        ref = p.TensorRef("x", "FP32", (4, FLOATS), offset, 4 * ROW)
        pieces = (p.Piece(0, 5, ROW, offset, ROW), p.Piece(0, 5, 0, offset + 2 * ROW, ROW))
        spec = p.ModelSpec("m", 1, "python", "", 8, (p.TensorSpec("x", "FP32", (FLOATS,)),), ())
        runner = Runner(spec, lambda inputs: {}, torch.device(device))
        (x,) = runner.inputs(region, [ref], {}, pieces, arenas)  # type: ignore[arg-type]
        assert x.device.type == device
        assert x[:, 0].tolist() == [10.0, 11.0, 20.0, 13.0]
        expected = np.frombuffer(rows(10, 11, 20, 13), np.float32).reshape(4, -1)
        np.testing.assert_array_equal(x.cpu().numpy(), expected)
        arenas.forget(5)
        assert arenas.regions == {}
    finally:
        arena.unlink()
        arena.close()


@settings(max_examples=40, deadline=None)
@given(
    batch=st.lists(st.tuples(st.integers(1, 3), st.booleans(), st.booleans()), min_size=1, max_size=5),
    small=st.booleans(),
    device=st.sampled_from(["cuda"] if torch.cuda.is_available() else ["cpu"]),
)
def test_inputs_read_in_place_are_the_inputs_copied(
    batch: list[tuple[int, bool, bool]], small: bool, device: str
) -> None:
    """The fast path (bytes in a mapped arena left to the worker) against the plain one (every byte
    copied into the region): the worker builds the same inputs from either, through the real marshalling
    and `Runner.inputs`. Each request has `rows` rows of input x (at least IN_PLACE_BYTES per row unless
    `small`) and of input z (always small); x in the arena or not, z in the arena or not."""
    width = 8 if small else FLOATS
    arena = Region.create(2 * len(batch) * 3 * (4 * FLOATS + 64) + 4096, keep_fd=True)
    try:
        assert arena.fd is not None
        requests, at = [], 64
        for k, (n, x_in_arena, z_in_arena) in enumerate(batch):
            tensors = []
            for name, floats, in_arena in (("x", width, x_in_arena), ("z", 2, z_in_arena)):
                data = np.arange(n * floats, dtype=np.float32) + 1000 * k + (0.5 if name == "z" else 0)
                raw = data.tobytes()
                if in_arena:
                    arena.buf[at : at + len(raw)] = raw
                    view: bytes | memoryview = arena.buf[at : at + len(raw)]
                    at += len(raw) + 64
                else:
                    view = raw
                tensors.append(InputTensor(name, "FP32", (n, floats), view))
            requests.append(InferRequest("m", "1", str(k), tuple(tensors), ("y",), n))

        def place(data: memoryview) -> tuple[int, int] | None:
            base = np.frombuffer(arena.buf, np.uint8).ctypes.data
            start = np.frombuffer(data, np.uint8).ctypes.data - base
            return (5, start) if 0 <= start < arena.size else None

        inputs = (p.TensorSpec("x", "FP32", (width,)), p.TensorSpec("z", "FP32", (2,)))
        spec = p.ModelSpec("m", 1, "python", "", 8, inputs, ())
        runner = Runner(spec, lambda inputs: {}, torch.device(device))
        arenas = Arenas([p.ArenaRef(5, os.dup(arena.fd), arena.size)])
        built = []
        for where in (place, None):
            tensors = BatchTensors(requests, [])
            region_bytes = bytearray(tensors.lay_out())
            region = SimpleNamespace(buf=memoryview(region_bytes), size=len(region_bytes))
            pieces = tensors.write(region.buf, where)
            in_place = where is not None and not small and any(x for _, x, _ in batch)
            assert bool(pieces) == in_place, pieces  # only x's rows are large enough to be left in place
            built.append(
                [t.cpu().clone() for t in runner.inputs(region, list(tensors.refs), {}, pieces, arenas)]  # type: ignore[arg-type]
            )
        for fast, plain in zip(*built, strict=True):
            torch.testing.assert_close(fast, plain, rtol=0, atol=0)
        arenas.forget(5)
    finally:
        arena.unlink()
        arena.close()


def test_the_book_finds_bytes_only_in_arenas_the_worker_mapped_and_tells_when_one_goes() -> None:
    book = ArenaBook()
    one, two = Region.create(1 << 16, keep_fd=True), Region.create(1 << 16, keep_fd=True)
    try:
        first, second = book.add(one), book.add(two)
        assert [(ref.arena_id, ref.fd) for ref in book.refs()] == [(first, one.fd), (second, two.fd)]
        assert book.locate(two.buf[100:200], {first, second}) == (second, 100)
        assert book.locate(two.buf[100:200], {first}) is None  # not mapped by this worker
        assert book.locate(memoryview(bytearray(100)), {first, second}) is None
        assert book.locate(two.buf[two.size - 10 :], {second}) == (second, two.size - 10)
        assert book.locate(one.buf[:10], {first, second}) == (first, 0)
        assert book.locate(one.buf[one.size - 1 :], {first, second}) == (first, one.size - 1)
        gone: list[int] = []
        stop = book.listen(gone.append)
        book.remove(first)
        assert book.locate(one.buf[:10], {first, second}) is None  # gone from the book
        assert book.locate(two.buf[:10], {first, second}) == (second, 0)
        stop()
        book.remove(second)
        assert gone == [first] and book.refs() == []
    finally:
        for region in (one, two):
            region.unlink()
            region.close()


def test_an_execution_with_pieces_crosses_the_channel_whole() -> None:
    msg = p.Infer(
        3,
        (p.TensorRef("x", "FP32", (2, 4), 64, 32),),
        ("y",),
        p.RegionRef("/in", 4096),
        p.RegionRef("/out", 4096),
        1,
        5,
        2,
        (p.Piece(0, 1, 4096, 64, 16), p.Piece(0, 2, 0, 80, 16)),
    )
    payload = dumps(msg)
    assert payload[0] != PICKLED  # the fixed layout carries the pieces too
    assert loads(payload) == msg


class RowMix(nn.Module):
    """Each row's answer depends on all of that row and nothing else: a row read from the wrong place, or
    another request's, shows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3 + x.sum(dim=1, keepdim=True)


@NO_GPU
def test_batches_through_fronts_on_a_gpu_are_read_in_place_and_each_request_gets_its_rows(
    tmp_path: Path,
) -> None:
    """The whole path on a CUDA GPU: requests through 2 fronts, batched, read by the worker from the arenas
    by DMA, the next batch's inputs built while the GPU runs the current one, CUDA graphs on."""
    repo = tmp_path / "repo"
    models.save_torchscript(RowMix(), repo / "mix" / "1" / "model.pt")
    models.write_config(
        repo / "mix",
        {
            "backend": "torchscript",
            "max_batch_size": 8,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [FLOATS]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [FLOATS]}],
            "instance_group": [{"kind": "KIND_GPU", "count": 1, "gpus": [0]}],
            "dynamic_batching": {"max_queue_delay_microseconds": 20_000},
            "optimization": {"cuda": {"graphs": True, "graph_spec": [{"batch_size": 4}, {"batch_size": 8}]}},
        },
    )
    port = free_port()
    args = ["--front-processes", "2", "--metrics-address", f"127.0.0.1:{port}"]  # Linux only, as CUDA
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((1, FLOATS), dtype=np.float32) for _ in range(48)]
    with serving(repo, tmp_path / "daemon.log", extra_args=args) as daemon:
        client = grpcclient.InferenceServerClient(daemon.address)
        results: dict[int, object] = {}
        done = threading.Event()

        def record(k: int) -> Callable[[object, object], None]:
            def on_answer(result: object, error: object) -> None:
                results[k] = error if error is not None else result
                if len(results) == len(xs):
                    done.set()

            return on_answer

        try:
            for k, x in enumerate(xs):
                inp = grpcclient.InferInput("x", [1, FLOATS], "FP32")
                inp.set_data_from_numpy(x)
                client.async_infer("mix", [inp], record(k))
            assert done.wait(120)
        finally:
            client.close()
        for k, x in enumerate(xs):
            result = results[k]
            assert isinstance(result, grpcclient.InferResult), result
            np.testing.assert_allclose(
                result.as_numpy("y"), x * 3 + x.sum(axis=1, keepdims=True), rtol=1e-4, atol=1e-3
            )
        stats = daemon.client.get_inference_statistics("mix").model_stats[0]
        assert any(b.batch_size > 1 for b in stats.batch_stats)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        in_place = re.search(
            r'^mpsd_worker_input_bytes_in_place_total\{[^}]*model="mix"[^}]*\} (\S+)$', text, re.M
        )
        assert in_place is not None and float(in_place.group(1)) == len(xs) * ROW


def test_an_arena_the_worker_cannot_map_fails_its_load_with_the_reason() -> None:
    from mpsd.worker.main import _map_arenas

    read_end, write_end = os.pipe()  # a descriptor that cannot be mapped
    try:
        with pytest.raises(
            RuntimeError, match=r"mapping the front processes' arenas failed.*arenas_to_workers"
        ):
            _map_arenas((p.ArenaRef(1, read_end, 1 << 16),), torch.device("cpu"))
    finally:
        os.close(write_end)
        with contextlib.suppress(OSError):
            os.close(read_end)  # from_fd closes it once it tried
