"""Triton's CUDA shared-memory extension on a real CUDA GPU (skipped without one): regions made by the stock
`tritonclient.utils.cuda_shared_memory` are registered by their IPC handles, a model reads its inputs from
them and writes its outputs into them over gRPC and HTTP, and the errors are Triton's.
"""

from __future__ import annotations

import base64
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import RunningDaemon, serving, wait_for
from tests.triton_shm import cuda_shm

cudashm = cuda_shm() if torch.cuda.is_available() else None
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        cudashm is None, reason="needs a CUDA GPU and cuda-python (tritonclient's CUDA helpers)"
    ),
]

DIMS = 16
ROW = DIMS * 4  # one FP32 row of add_sub
Make = Callable[[str, int], Any]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    repo = tmp_path_factory.mktemp("repo")
    models.add_sub(repo, dims=DIMS)
    with serving(repo, tmp_path_factory.mktemp("log") / "daemon.log") as d:
        yield d


@pytest.fixture
def region(daemon: RunningDaemon) -> Iterator[Make]:
    """Makes CUDA regions on GPU 0 with the stock helper; at the end every CUDA region is unregistered and
    then freed."""
    assert cudashm is not None
    made: list[Any] = []

    def make(name: str, byte_size: int) -> Any:
        made.append(cudashm.create_shared_memory_region(name, byte_size, 0))
        return made[-1]

    yield make
    daemon.client.unregister_cuda_shared_memory()
    for handle in made:
        cudashm.destroy_shared_memory_region(handle)


def rows(handle: Any, count: int) -> np.ndarray:
    assert cudashm is not None
    return np.asarray(cudashm.get_contents_as_numpy(handle, np.float32, [count, DIMS]))


def cuda_regions(client: grpcclient.InferenceServerClient) -> dict[str, tuple[int, int]]:
    """Registered CUDA regions as name -> (device_id, byte_size)."""
    regions = client.get_cuda_shared_memory_status(as_json=True).get("regions", {})
    return {n: (int(r.get("device_id", 0)), int(r["byte_size"])) for n, r in regions.items()}


def error(call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as err:
        call(*args, **kwargs)
    return str(err.value.status()), str(err.value.message())


def shm_inputs(module: Any, region: str, offset: int = 0) -> list[Any]:
    """add_sub's two inputs, one row each, side by side in `region` from `offset`."""
    inputs = [module.InferInput(name, [1, DIMS], "FP32") for name in ("INPUT0", "INPUT1")]
    inputs[0].set_shared_memory(region, ROW, offset=offset)
    inputs[1].set_shared_memory(region, ROW, offset=offset + ROW)
    return inputs


def test_extension_is_listed(daemon: RunningDaemon) -> None:
    assert "cuda_shared_memory" in daemon.client.get_server_metadata(as_json=True)["extensions"]


def test_grpc_inputs_and_outputs_in_cuda_memory(daemon: RunningDaemon, region: Make) -> None:
    """The flow of Triton's simple_grpc_cudashm_client, then status and unregister by name and all."""
    assert cudashm is not None
    client = daemon.client
    rng = np.random.default_rng()
    a, b = (rng.standard_normal((1, DIMS), dtype=np.float32) for _ in range(2))
    inp, out = region("input_data", 2 * ROW), region("output_data", 2 * ROW)
    cudashm.set_shared_memory_region(inp, [a, b])
    cudashm.set_shared_memory_region(out, [np.full((2, DIMS), np.nan, np.float32)])
    client.register_cuda_shared_memory("input_data", cudashm.get_raw_handle(inp), 0, 2 * ROW)
    client.register_cuda_shared_memory("output_data", cudashm.get_raw_handle(out), 0, 2 * ROW)

    outputs = [grpcclient.InferRequestedOutput(name) for name in ("OUTPUT0", "OUTPUT1")]
    outputs[0].set_shared_memory("output_data", ROW)
    outputs[1].set_shared_memory("output_data", ROW, offset=ROW)
    result = client.infer("add_sub", shm_inputs(grpcclient, "input_data"), outputs=outputs)

    assert list(result.get_response().raw_output_contents) == [b"", b""]  # the bytes went to the region
    np.testing.assert_array_equal(rows(out, 2), np.concatenate([a + b, a - b]))
    assert cuda_regions(client) == {"input_data": (0, 2 * ROW), "output_data": (0, 2 * ROW)}
    status = client.get_cuda_shared_memory_status("output_data", as_json=True)["regions"]
    assert list(status) == ["output_data"]
    client.unregister_cuda_shared_memory("input_data")
    assert cuda_regions(client) == {"output_data": (0, 2 * ROW)}
    client.unregister_cuda_shared_memory()
    assert cuda_regions(client) == {}


def test_http_inputs_and_outputs_in_cuda_memory(daemon: RunningDaemon, region: Make) -> None:
    """Over HTTP: inputs from a region, one output into it and one in the response; a region registered
    over HTTP is the gRPC port's too, and HTTP's status has Triton's fields."""
    assert cudashm is not None
    client = httpclient.InferenceServerClient(daemon.http_address, network_timeout=60)
    try:
        rng = np.random.default_rng()
        a, b = (rng.standard_normal((1, DIMS), dtype=np.float32) for _ in range(2))
        handle = region("http_region", 3 * ROW)
        cudashm.set_shared_memory_region(handle, [a, b, np.full((1, DIMS), np.nan, np.float32)])
        client.register_cuda_shared_memory("http_region", cudashm.get_raw_handle(handle), 0, 3 * ROW)
        assert client.get_cuda_shared_memory_status() == [
            {"name": "http_region", "device_id": 0, "byte_size": 3 * ROW}
        ]
        assert cuda_regions(daemon.client) == {"http_region": (0, 3 * ROW)}
        out = httpclient.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory("http_region", ROW, offset=2 * ROW)
        result = client.infer(
            "add_sub",
            shm_inputs(httpclient, "http_region"),
            outputs=[out, httpclient.InferRequestedOutput("OUTPUT1")],
        )
        np.testing.assert_array_equal(rows(handle, 3)[2:], a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
        client.unregister_cuda_shared_memory("http_region")
        assert client.get_cuda_shared_memory_status() == []
    finally:
        client.close()


def test_requests_batched_together_each_read_and_write_their_own_rows(
    daemon: RunningDaemon, region: Make
) -> None:
    """Concurrent requests (formed into batches by the daemon) each take their inputs from their own place
    in one region and put their outputs into their own place in another."""
    assert cudashm is not None
    count = 16
    rng = np.random.default_rng()
    values = rng.standard_normal((count, 2, DIMS), dtype=np.float32)
    inp, out = region("many_in", count * 2 * ROW), region("many_out", count * ROW)
    cudashm.set_shared_memory_region(inp, [values])
    cudashm.set_shared_memory_region(out, [np.full((count, DIMS), np.nan, np.float32)])
    daemon.client.register_cuda_shared_memory("many_in", cudashm.get_raw_handle(inp), 0, count * 2 * ROW)
    daemon.client.register_cuda_shared_memory("many_out", cudashm.get_raw_handle(out), 0, count * ROW)
    failures: list[BaseException] = []

    def one(i: int) -> None:
        client = grpcclient.InferenceServerClient(daemon.address)
        try:
            output = grpcclient.InferRequestedOutput("OUTPUT0")
            output.set_shared_memory("many_out", ROW, offset=i * ROW)
            client.infer("add_sub", shm_inputs(grpcclient, "many_in", i * 2 * ROW), outputs=[output])
        except BaseException as exc:
            failures.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    np.testing.assert_array_equal(rows(out, count), values[:, 0] + values[:, 1])


def test_one_allocation_registered_under_two_names(daemon: RunningDaemon, region: Make) -> None:
    """Both names work; unregistering one leaves the other's mapping open."""
    assert cudashm is not None
    client = daemon.client
    handle = region("shared", 4 * ROW)
    a, b = np.full((1, DIMS), 3.0, np.float32), np.full((1, DIMS), 1.0, np.float32)
    cudashm.set_shared_memory_region(handle, [a, b])
    for name in ("first_name", "second_name"):
        client.register_cuda_shared_memory(name, cudashm.get_raw_handle(handle), 0, 4 * ROW)
    client.unregister_cuda_shared_memory("first_name")
    output = grpcclient.InferRequestedOutput("OUTPUT0")
    output.set_shared_memory("second_name", ROW, offset=2 * ROW)
    client.infer("add_sub", shm_inputs(grpcclient, "second_name"), outputs=[output])
    np.testing.assert_array_equal(rows(handle, 3)[2:], a + b)


def test_refusals_are_tritons(daemon: RunningDaemon, region: Make) -> None:
    assert cudashm is not None
    client = daemon.client
    handle = region("small", 2 * ROW)
    raw = cudashm.get_raw_handle(handle)
    invalid = "StatusCode.INVALID_ARGUMENT"

    status, message = error(client.register_cuda_shared_memory, "big", raw, 0, 2 * ROW + 1)
    assert status == invalid
    assert message.startswith("failed to register shared memory region 'big': invalid args: byte_size 129")
    status, message = error(client.register_cuda_shared_memory, "elsewhere", raw, 7, 2 * ROW)
    assert status == invalid
    assert message.startswith("failed to register shared memory region: invalid args: ")
    assert "device 7" in message
    status, message = error(
        client.register_cuda_shared_memory, "made_by_noone", base64.b64encode(bytes(64)), 0, 8
    )
    assert status == invalid and message.startswith("failed to register shared memory region: invalid args: ")
    assert cuda_regions(client) == {}

    client.register_cuda_shared_memory("small", raw, 0, 2 * ROW)
    assert error(client.register_cuda_shared_memory, "small", raw, 0, 2 * ROW) == (
        "StatusCode.ALREADY_EXISTS",
        "shared memory region 'small' already in manager",
    )
    assert error(client.get_system_shared_memory_status, "small") == (
        "StatusCode.NOT_FOUND",
        "The region named 'small' is registered as CUDA shared memory, not system shared memory",
    )
    client.unregister_system_shared_memory()
    client.unregister_system_shared_memory("small")
    assert cuda_regions(client) == {"small": (0, 2 * ROW)}

    # INPUT0 starts past the region's end; INPUT1 starts inside it and ends past it
    assert error(client.infer, "add_sub", shm_inputs(grpcclient, "small", 2 * ROW)) == (
        invalid,
        "input 'INPUT0': Invalid offset for shared memory region: 'small'",
    )
    assert error(client.infer, "add_sub", shm_inputs(grpcclient, "small", ROW // 2)) == (
        invalid,
        "input 'INPUT1': Invalid offset + byte size for shared memory region: 'small'",
    )
    output = grpcclient.InferRequestedOutput("OUTPUT0")
    output.set_shared_memory("small", ROW, offset=2 * ROW - 4)
    inputs = [grpcclient.InferInput(n, [1, DIMS], "FP32") for n in ("INPUT0", "INPUT1")]
    for inp in inputs:
        inp.set_data_from_numpy(np.ones((1, DIMS), np.float32))
    status, message = error(client.infer, "add_sub", inputs, outputs=[output])
    assert (status, message) == (
        invalid,
        "output 'OUTPUT0': Invalid offset + byte size for shared memory region: 'small'",
    )


def gpu_pids() -> set[int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {int(line) for line in out.split() if line.strip().isdigit()}


def test_the_daemon_holds_a_gpu_context_only_while_a_region_is_registered(
    daemon: RunningDaemon, region: Make
) -> None:
    """The daemon makes a CUDA context for the first region on a GPU and lets it go with the last one, so a
    daemon that holds no client memory takes none of the GPU's."""
    assert cudashm is not None
    handle = region("held", ROW)
    daemon.client.unregister_cuda_shared_memory()
    wait_for(lambda: daemon.pid not in gpu_pids(), 30, "no context of the daemon's before any region")
    daemon.client.register_cuda_shared_memory("held", cudashm.get_raw_handle(handle), 0, ROW)
    wait_for(lambda: daemon.pid in gpu_pids(), 30, "the daemon's context while a region is registered")
    daemon.client.unregister_cuda_shared_memory("held")
    wait_for(lambda: daemon.pid not in gpu_pids(), 30, "the daemon's context gone with the last region")
