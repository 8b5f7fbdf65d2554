"""Triton's system shared-memory extension through the stock tritonclient and its own shm helpers."""

from __future__ import annotations

import base64
import contextlib
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from tests import models, posix_shm
from tests.conftest import RunningDaemon, free_port, pending_requests, wait_for
from tests.triton_shm import shm

DIMS = 16
NBYTES = DIMS * 4  # one FP32 row of add_sub


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    repo = tmp_path_factory.mktemp("repo")
    models.add_sub(repo, dims=DIMS)
    gate = tmp_path_factory.mktemp("gate")
    models.gated_model(repo, gate)
    metrics = f"127.0.0.1:{free_port()}"
    d = RunningDaemon(
        repo, tmp_path_factory.mktemp("log") / "daemon.log", extra_args=["--metrics-address", metrics]
    )
    d.gate = gate  # type: ignore[attr-defined]
    d.metrics = metrics  # type: ignore[attr-defined]
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop()
        d.kill_group()


Key = Callable[[str], str]


@pytest.fixture
def key() -> Iterator[Key]:
    """A shm key unique to this test; any region left by a failing test is removed."""
    made: list[str] = []

    def new(tag: str) -> str:
        made.append(posix_shm.checked(f"/mpsdtest_{os.getpid()}_{tag}"))
        return made[-1]

    yield new
    for k in made:
        posix_shm.unlink(k)


def _regions(client: grpcclient.InferenceServerClient, name: str = "") -> dict[str, tuple[str, int, int]]:
    """Registered regions as name -> (key, offset, byte_size)."""
    regions = client.get_system_shared_memory_status(name, as_json=True).get("regions", {})
    return {n: (r["key"], int(r.get("offset", 0)), int(r["byte_size"])) for n, r in regions.items()}


def _error(call: object, *args: object, **kwargs: object) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as err:
        call(*args, **kwargs)  # type: ignore[operator]
    return err.value


def test_extension_is_listed(daemon: RunningDaemon) -> None:
    assert "system_shared_memory" in daemon.client.get_server_metadata(as_json=True)["extensions"]


def test_tritonclient_example_flow(daemon: RunningDaemon, key: Key) -> None:
    """The flow of Triton's simple_grpc_shm_client: inputs and outputs in shared memory."""
    client = daemon.client
    client.unregister_system_shared_memory()
    a = np.arange(DIMS, dtype=np.float32).reshape(1, DIMS)
    b = np.full((1, DIMS), 0.5, dtype=np.float32)
    out_key, in_key = key("output"), key("input")
    out_handle = shm.create_shared_memory_region("output_data", out_key, NBYTES * 2)
    in_handle = shm.create_shared_memory_region("input_data", in_key, NBYTES * 2)
    try:
        client.register_system_shared_memory("output_data", out_key, NBYTES * 2)
        shm.set_shared_memory_region(in_handle, [a])
        shm.set_shared_memory_region(in_handle, [b], offset=NBYTES)
        client.register_system_shared_memory("input_data", in_key, NBYTES * 2)

        inputs = [
            grpcclient.InferInput("INPUT0", [1, DIMS], "FP32"),
            grpcclient.InferInput("INPUT1", [1, DIMS], "FP32"),
        ]
        inputs[0].set_shared_memory("input_data", NBYTES)
        inputs[1].set_shared_memory("input_data", NBYTES, offset=NBYTES)
        outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory("output_data", NBYTES)
        outputs[1].set_shared_memory("output_data", NBYTES, offset=NBYTES)
        result = client.infer("add_sub", inputs, outputs=outputs)

        out0, out1 = result.get_output("OUTPUT0"), result.get_output("OUTPUT1")
        sum_ = shm.get_contents_as_numpy(out_handle, triton_to_np_dtype(out0.datatype), out0.shape)
        diff = shm.get_contents_as_numpy(
            out_handle, triton_to_np_dtype(out1.datatype), out1.shape, offset=NBYTES
        )
        np.testing.assert_array_equal(sum_, a + b)
        np.testing.assert_array_equal(diff, a - b)

        assert _regions(client) == {
            "input_data": (in_key, 0, NBYTES * 2),
            "output_data": (out_key, 0, NBYTES * 2),
        }
    finally:
        client.unregister_system_shared_memory()
        assert _regions(client) == {}
        # mpsd never unlinks a client's object: it is still there for the client to destroy.
        assert posix_shm.exists(in_key)
        shm.destroy_shared_memory_region(out_handle)
        shm.destroy_shared_memory_region(in_handle)


def test_mixed_shared_memory_and_request_tensors(daemon: RunningDaemon, key: Key) -> None:
    """One input and one output in shared memory, the others in the request: each is found in its place."""
    client = daemon.client
    a = np.full((2, DIMS), 3.0, dtype=np.float32)
    b = np.arange(2 * DIMS, dtype=np.float32).reshape(2, DIMS)
    k = key("mixed")
    handle = shm.create_shared_memory_region("mixed", k, 4 * NBYTES)
    try:
        shm.set_shared_memory_region(handle, [b])
        client.register_system_shared_memory("mixed", k, 4 * NBYTES)
        in0 = grpcclient.InferInput("INPUT0", [2, DIMS], "FP32")
        in0.set_data_from_numpy(a)
        in1 = grpcclient.InferInput("INPUT1", [2, DIMS], "FP32")
        in1.set_shared_memory("mixed", 2 * NBYTES)
        out0 = grpcclient.InferRequestedOutput("OUTPUT0")
        out0.set_shared_memory("mixed", 2 * NBYTES, offset=2 * NBYTES)
        out1 = grpcclient.InferRequestedOutput("OUTPUT1")
        result = client.infer("add_sub", [in0, in1], outputs=[out0, out1])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(handle, np.float32, [2, DIMS], offset=2 * NBYTES), a + b
        )
    finally:
        client.unregister_system_shared_memory("mixed")
        shm.destroy_shared_memory_region(handle)


def test_alike_requests_each_write_their_own_output(daemon: RunningDaemon, key: Key) -> None:
    """Three requests with the same names, shapes and parameters, the output in one region: each leaves its
    own result there. A header with parameters is never learned (mpsd/daemon/api/grpc/known_headers.py), so
    the second and third are not taken for the first's known header and answered without their write."""
    client = daemon.client
    k = key("repeat")
    handle = shm.create_shared_memory_region("repeat", k, NBYTES)
    try:
        client.register_system_shared_memory("repeat", k, NBYTES)
        for value in (1.0, 2.0, 3.0):
            row = np.full((1, DIMS), value, np.float32)
            inputs = [grpcclient.InferInput(n, [1, DIMS], "FP32") for n in ("INPUT0", "INPUT1")]
            for inp in inputs:
                inp.set_data_from_numpy(row)
            out = grpcclient.InferRequestedOutput("OUTPUT0")
            out.set_shared_memory("repeat", NBYTES)
            client.infer("add_sub", inputs, outputs=[out])
            np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [1, DIMS]), row + row)
    finally:
        client.unregister_system_shared_memory("repeat")
        shm.destroy_shared_memory_region(handle)


def _shm_inputs(region: str, nbytes: int, offset: int = 0) -> list[grpcclient.InferInput]:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        inp = grpcclient.InferInput(name, [1, DIMS], "FP32")
        inp.set_shared_memory(region, nbytes, offset=offset)
        inputs.append(inp)
    return inputs


def test_bounds_are_checked(daemon: RunningDaemon, key: Key) -> None:
    client = daemon.client
    k = key("bounds")
    handle = shm.create_shared_memory_region("bounds", k, 2 * NBYTES)
    try:
        # Registering more than the object holds.
        err = _error(client.register_system_shared_memory, "bounds", k, 2 * NBYTES, offset=NBYTES)
        assert err.status() == "StatusCode.INVALID_ARGUMENT"
        assert "exceeds the" in err.message()
        client.register_system_shared_memory("bounds", k, 2 * NBYTES)
        # A tensor that would end past the region.
        err = _error(client.infer, "add_sub", _shm_inputs("bounds", NBYTES, offset=NBYTES + 4))
        assert err.status() == "StatusCode.INVALID_ARGUMENT"
        assert "outside shared memory region 'bounds'" in err.message()
        # A byte size that does not match shape x datatype.
        err = _error(client.infer, "add_sub", _shm_inputs("bounds", NBYTES - 4))
        assert err.status() == "StatusCode.INVALID_ARGUMENT"
        assert f"need {NBYTES} bytes" in err.message()
        # An output region too small for the result: refused, and the client's bytes after it untouched.
        mine = np.arange(2 * DIMS, dtype=np.float32)
        shm.set_shared_memory_region(handle, [mine])
        out = grpcclient.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory("bounds", 8)
        err = _error(client.infer, "add_sub", _shm_inputs("bounds", NBYTES), outputs=[out])
        assert err.status() == "StatusCode.INVALID_ARGUMENT"
        assert "holds 8 bytes" in err.message()
        after = shm.get_contents_as_numpy(handle, np.float32, [2 * DIMS])
        np.testing.assert_array_equal(after[2:], mine[2:])  # past the 8 bytes of the output's place
    finally:
        client.unregister_system_shared_memory("bounds")
        shm.destroy_shared_memory_region(handle)


def test_unregistered_region_is_refused(daemon: RunningDaemon) -> None:
    err = _error(daemon.client.infer, "add_sub", _shm_inputs("never_registered", NBYTES))
    assert err.status() == "StatusCode.INVALID_ARGUMENT"
    assert "shared memory region 'never_registered' is not registered" in err.message()


def test_register_refusals(daemon: RunningDaemon, key: Key) -> None:
    client = daemon.client
    err = _error(client.register_system_shared_memory, "missing", key("missing"), 64)
    assert err.status() == "StatusCode.INVALID_ARGUMENT"
    assert "cannot open key" in err.message()
    # mpsd's own tensor buffers are not a client's to map.
    err = _error(client.register_system_shared_memory, "stolen", "/mpsd-1-0", 64)
    assert err.status() == "StatusCode.INVALID_ARGUMENT"
    assert "reserved" in err.message()
    k = key("twice")
    handle = shm.create_shared_memory_region("twice", k, 64)
    try:
        client.register_system_shared_memory("twice", k, 64)
        err = _error(client.register_system_shared_memory, "twice", k, 64)
        assert err.status() == "StatusCode.ALREADY_EXISTS"
    finally:
        client.unregister_system_shared_memory("twice")
        shm.destroy_shared_memory_region(handle)


def test_system_and_cuda_regions_share_one_name_space(daemon: RunningDaemon, key: Key) -> None:
    """As in Triton: a CUDA region cannot take a system region's name, CUDA status says which kind the name
    is, and CUDA unregister (named or all) leaves system regions registered."""
    client = daemon.client
    k = key("taken")
    handle = shm.create_shared_memory_region("taken", k, NBYTES)
    try:
        client.register_system_shared_memory("taken", k, NBYTES)
        err = _error(client.register_cuda_shared_memory, "taken", base64.b64encode(bytes(64)), 0, NBYTES)
        assert err.status() == "StatusCode.ALREADY_EXISTS"
        assert err.message() == "shared memory region 'taken' already in manager"
        err = _error(client.get_cuda_shared_memory_status, "taken")
        assert err.status() == "StatusCode.NOT_FOUND"
        assert err.message() == (
            "The region named 'taken' is registered as system shared memory, not CUDA shared memory"
        )
        assert client.get_cuda_shared_memory_status(as_json=True) == {}
        client.unregister_cuda_shared_memory("taken")
        client.unregister_cuda_shared_memory()
        assert _regions(client) == {"taken": (k, 0, NBYTES)}
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(handle)


def test_status_lists_registered_regions_and_unregister_while_idle(daemon: RunningDaemon, key: Key) -> None:
    client = daemon.client
    handles = []
    keys = {name: key(name) for name in ("first", "second")}
    try:
        for name, offset in (("first", 0), ("second", 64)):
            handles.append(shm.create_shared_memory_region(name, keys[name], 128))
            client.register_system_shared_memory(name, keys[name], 64, offset=offset)
        assert _regions(client) == {"first": (keys["first"], 0, 64), "second": (keys["second"], 64, 64)}
        assert _regions(client, "second") == {"second": (keys["second"], 64, 64)}
        err = _error(client.get_system_shared_memory_status, "nope")
        assert err.status() == "StatusCode.NOT_FOUND"

        client.unregister_system_shared_memory("first")
        assert _regions(client) == {"second": (keys["second"], 64, 64)}
        client.unregister_system_shared_memory("not_registered")  # Triton: not an error
        # The name is free again and the region works after being registered anew.
        client.register_system_shared_memory("first", keys["first"], 2 * NBYTES)
        shm.set_shared_memory_region(handles[0], [np.ones((1, DIMS), np.float32)])
        out = client.infer("add_sub", _shm_inputs("first", NBYTES))
        np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), np.full((1, DIMS), 2.0, np.float32))
    finally:
        client.unregister_system_shared_memory()
        for handle in handles:
            shm.destroy_shared_memory_region(handle)


def test_unregister_while_in_use_is_safe(daemon: RunningDaemon, key: Key) -> None:
    """A region unregistered while a request uses it stays open until that request is answered."""
    client = daemon.client
    gate: Path = daemon.gate  # type: ignore[attr-defined]
    x = np.array([7, 1, 2, 3], dtype=np.float32)
    k = key("inuse")
    handle = shm.create_shared_memory_region("inuse", k, 2 * x.nbytes)
    try:
        shm.set_shared_memory_region(handle, [x])
        client.register_system_shared_memory("inuse", k, 2 * x.nbytes)
        inp = grpcclient.InferInput("x", [4], "FP32")
        inp.set_shared_memory("inuse", x.nbytes)
        out = grpcclient.InferRequestedOutput("y")
        out.set_shared_memory("inuse", x.nbytes, offset=x.nbytes)
        results: list[object] = []
        done = threading.Event()

        def callback(result: object, error: object) -> None:
            results.append(error or result)
            done.set()

        client.async_infer("gated", [inp], callback, outputs=[out])
        wait_for(lambda: (gate / "7.started").exists(), 60, "the request to reach the model")
        client.unregister_system_shared_memory("inuse")
        assert _regions(client) == {}
        (gate / "7").touch()
        assert done.wait(60)
        assert not isinstance(results[0], InferenceServerException), results[0]
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(handle, np.float32, [4], offset=x.nbytes), x * 2
        )
        # Once unregistered, new requests may not use it.
        err = _error(client.infer, "gated", [inp])
        assert "is not registered" in err.message()
        assert daemon.proc.poll() is None
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(handle)


class OwnObject:
    """A POSIX shared-memory object this test owns through its descriptor, sized once, read and written
    through a mapping that lasts one copy (macOS has no read or write on the descriptor, and a mapping kept
    in this process would take the SIGBUS, once the object is shrunk, that the daemon must not)."""

    def __init__(self, key: str, data: bytes) -> None:
        import _posixshmem

        self.key = key
        self.fd = _posixshmem.shm_open(key, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(self.fd, len(data))
        with mmap.mmap(self.fd, len(data)) as mapping:
            mapping[:] = data

    def read(self, offset: int, size: int) -> bytes:
        with mmap.mmap(self.fd, offset + size, prot=mmap.PROT_READ) as mapping:
            return mapping[offset : offset + size]

    def shrink(self) -> None:
        os.ftruncate(self.fd, 0)

    def close(self) -> None:
        os.close(self.fd)


def _remove_gates(gate: Path, *names: str) -> None:
    for name in names:
        for suffix in ("", ".started"):
            with contextlib.suppress(FileNotFoundError):
                (gate / f"{name}{suffix}").unlink()


def _gated_call(
    client: grpcclient.InferenceServerClient,
    x: np.ndarray,
    region: tuple[str, str] | None = None,
) -> tuple[threading.Event, list[object]]:
    """Send `x` to the gated model, its input (`region` "in") or output ("out") in shared memory."""
    results: list[object] = []
    done = threading.Event()

    def callback(result: object, error: object) -> None:
        results.append(error or result)
        done.set()

    inp = grpcclient.InferInput("x", [len(x)], "FP32")
    out = grpcclient.InferRequestedOutput("y")
    if region is not None and region[1] == "in":
        inp.set_shared_memory(region[0], x.nbytes)
    else:
        inp.set_data_from_numpy(x)
    if region is not None and region[1] == "out":
        out.set_shared_memory(region[0], x.nbytes)
    client.async_infer("gated", [inp], callback, outputs=[out])
    return done, results


def test_a_region_shrunk_by_its_owner_fails_the_request_not_the_daemon(
    daemon: RunningDaemon, key: Key
) -> None:
    """Its owner may shrink a registered object at any time, after the request was checked: the input is
    read when the batch is assembled, the output written when the response is built, and both fail with
    INVALID_ARGUMENT where touching a mapping of the missing pages would have ended the daemon (SIGBUS)."""
    refusal = posix_shm.resize_refusal()
    if refusal is not None:
        pytest.skip(refusal)
    client = daemon.client
    gate: Path = daemon.gate  # type: ignore[attr-defined]
    x_in = np.array([13, 1, 2, 3], dtype=np.float32)
    (gate / "13").touch()  # should the shrunk input ever reach the model, it does not block
    source = OwnObject(key("shrink_in"), x_in.tobytes())
    sink = OwnObject(key("shrink_out"), bytes(16))
    try:
        client.register_system_shared_memory("shrink_in", source.key, x_in.nbytes)
        client.register_system_shared_memory("shrink_out", sink.key, 16)
        # The worker's two seats are taken (11 runs, 12 waits behind it): the next request waits in the queue.
        first = _gated_call(client, np.array([11, 0, 0, 0], np.float32))
        wait_for(lambda: (gate / "11.started").exists(), 60, "the first request to reach the model")
        second = _gated_call(client, np.array([12, 0, 0, 0], np.float32), ("shrink_out", "out"))
        queued = _gated_call(client, x_in, ("shrink_in", "in"))
        # Checked and held by the daemon (one running, one waiting in the worker, one in the queue).
        wait_for(lambda: pending_requests(daemon.metrics) == 3, 60, "three requests in the daemon")  # type: ignore[attr-defined]
        source.shrink()
        (gate / "11").touch()
        wait_for(lambda: (gate / "12.started").exists(), 60, "the second request to reach the model")
        sink.shrink()  # while it runs: its output has nowhere to go
        (gate / "12").touch()
        for done, _ in (first, second, queued):
            assert done.wait(60)
        assert not isinstance(first[1][0], InferenceServerException), first[1][0]
        # Each failed where its bytes were to move, not when it was checked.
        for (_, results), when in ((second, "while the request ran"), (queued, "before the request ran")):
            error = results[0]
            assert isinstance(error, InferenceServerException), error
            assert error.status() == "StatusCode.INVALID_ARGUMENT", error
            assert f"was truncated by its owner {when}" in error.message(), error.message()
        assert daemon.proc.poll() is None
        assert client.is_server_live()
    finally:
        client.unregister_system_shared_memory()
        source.close()
        sink.close()
        _remove_gates(gate, "11", "12", "13")


def test_a_region_unregistered_while_its_request_waits_is_still_read(daemon: RunningDaemon, key: Key) -> None:
    """Inputs are read when the batch is assembled: the region stays open for a request already accepted."""
    client = daemon.client
    gate: Path = daemon.gate  # type: ignore[attr-defined]
    x = np.array([23, 4, 5, 6], dtype=np.float32)
    (gate / "23").touch()
    source = OwnObject(key("late_in"), x.tobytes())
    try:
        client.register_system_shared_memory("late_in", source.key, x.nbytes)
        first = _gated_call(client, np.array([21, 0, 0, 0], np.float32))
        wait_for(lambda: (gate / "21.started").exists(), 60, "the first request to reach the model")
        second = _gated_call(client, np.array([22, 0, 0, 0], np.float32))
        queued = _gated_call(client, x, ("late_in", "in"))
        # Checked and held by the daemon (one running, one waiting in the worker, one in the queue).
        wait_for(lambda: pending_requests(daemon.metrics) == 3, 60, "three requests in the daemon")  # type: ignore[attr-defined]
        client.unregister_system_shared_memory("late_in")
        (gate / "21").touch()
        (gate / "22").touch()
        for done, _ in (first, second, queued):
            assert done.wait(60)
        result = queued[1][0]
        assert not isinstance(result, InferenceServerException), result
        np.testing.assert_array_equal(result.as_numpy("y"), x * 2)  # type: ignore[attr-defined]
    finally:
        client.unregister_system_shared_memory()
        source.close()
        _remove_gates(gate, "21", "22", "23")


def test_where_descriptors_cannot_be_read_regions_are_mapped_and_copied(
    monkeypatch: pytest.MonkeyPatch, key: Key
) -> None:
    """macOS has no read or write on shared-memory descriptors, and sizes an object once: regions are mapped
    there. The same reads and writes, through a mapping (switched on here, on Linux)."""
    from mpsd.daemon.api import client_shm

    monkeypatch.setattr(client_shm, "MAP_REGIONS", True)
    source = OwnObject(key("mapped"), bytes(range(64)))
    try:
        region = client_shm.ClientRegion("mapped", source.key, 16, 32)
        place = region.place("input 'x'", 4, 8)
        dest = bytearray(8)
        place.read_into(memoryview(dest))
        assert bytes(dest) == bytes(range(20, 28))
        place.write(b"ABCDEFGH")
        assert source.read(20, 8) == b"ABCDEFGH"
        region.close()
    finally:
        source.close()
