"""Every inference RPC through the stock tritonclient against a real daemon with real workers."""

from __future__ import annotations

import base64
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from mpsd.daemon.supervise.gpus import cuda_gpu_count
from tests import models
from tests.conftest import RunningDaemon, serving, wait_for

NP = models.NUMPY_OF


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    repo = tmp_path_factory.mktemp("repo")
    models.add_sub(repo)
    models.echo_all_types(repo)
    models.echo_all_types(repo, "echo_typed", typed_only=True)
    models.python_model(
        repo,
        "failing",
        """
        if float(inputs['x'].sum()) != 0:  # warm-up sends zeros
            raise ValueError('bad input value ' + str(float(inputs['x'].sum())))
        return {'y': inputs['x']}
        """,
    )
    models.python_model(
        repo,
        "oom",
        """
        if float(inputs['x'].sum()) != 0:  # the allocator's own exception type and message
            raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 20.00 GiB')
        return {'y': inputs['x']}
        """,
    )
    scores = models.identity(repo, "scores", "TYPE_FP32", [5], max_batch_size=4)
    config = yaml.safe_load((scores / "config.yaml").read_text())
    config["output"][0]["label_filename"] = "labels.txt"
    models.write_config(scores, config)
    (scores / "labels.txt").write_text("cat\ndog\n\nbird\n")
    f = {"data_type": "TYPE_FP32", "dims": [-1]}
    models.python_model(
        repo,
        "cached",
        "return {'y': inputs['x'] * 2}",
        config={
            "backend": "python",
            "max_batch_size": 0,
            "input": [{"name": "x", **f}],
            "output": [{"name": "y", **f}],
            "response_cache": {"enable": True},
        },
    )
    with serving(repo, tmp_path_factory.mktemp("log") / "daemon.log") as d:
        yield d


def add_sub_inputs(a: np.ndarray, b: np.ndarray) -> list[grpcclient.InferInput]:
    inputs = []
    for name, value in (("INPUT0", a), ("INPUT1", b)):
        inp = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        inp.set_data_from_numpy(value)
        inputs.append(inp)
    return inputs


def test_server_live_ready_and_metadata(daemon: RunningDaemon) -> None:
    c = daemon.client
    assert c.is_server_live()
    assert c.is_server_ready()
    assert c.is_model_ready("add_sub")
    assert c.is_model_ready("add_sub", "1")
    assert not c.is_model_ready("add_sub", "2")
    assert not c.is_model_ready("no_such_model")
    meta = c.get_server_metadata(as_json=True)
    assert meta["name"] == "mpsd"
    assert "model_repository" in meta["extensions"]
    assert "system_shared_memory" in meta["extensions"]
    cuda = {"cuda_shared_memory"} if cuda_gpu_count(os.environ) else set()  # only where the driver shows GPUs
    assert (
        set(meta["extensions"])
        == {  # docs/api.md lists exactly these
            "model_repository",
            "model_configuration",
            "statistics",
            "binary_tensor_data",
            "logging",
            "system_shared_memory",
            "trace",
        }
        | cuda
    )


def test_model_metadata_includes_batch_dimension(daemon: RunningDaemon) -> None:
    meta = daemon.client.get_model_metadata("add_sub", as_json=True)
    assert meta["platform"] == "pytorch_libtorch"
    assert meta["versions"] == ["1"]
    assert [(i["name"], i["datatype"], i["shape"]) for i in meta["inputs"]] == [
        ("INPUT0", "FP32", ["-1", "16"]),
        ("INPUT1", "FP32", ["-1", "16"]),
    ]
    echo = daemon.client.get_model_metadata("echo_all", as_json=True)
    assert echo["inputs"][0]["shape"] == ["-1"]


def test_model_config_is_effective_config(daemon: RunningDaemon) -> None:
    cfg = daemon.client.get_model_config("add_sub", as_json=True)["config"]
    assert cfg["name"] == "add_sub"
    assert cfg["max_batch_size"] == 8
    assert cfg["default_model_filename"] == "model.pt"
    assert [i["name"] for i in cfg["input"]] == ["INPUT0", "INPUT1"]
    assert cfg["input"][0]["data_type"] == "TYPE_FP32"
    assert cfg["version_policy"] == {"latest": {"num_versions": 1}}


def test_sync_infer_with_request_id_and_all_outputs(daemon: RunningDaemon) -> None:
    a = np.arange(32, dtype=np.float32).reshape(2, 16)
    b = np.full((2, 16), 3.0, dtype=np.float32)
    result = daemon.client.infer("add_sub", add_sub_inputs(a, b), request_id="req-42")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    response = result.get_response(as_json=True)
    assert response["id"] == "req-42"
    assert response["model_version"] == "1"


def test_requested_output_subset(daemon: RunningDaemon) -> None:
    a = np.ones((1, 16), np.float32)
    result = daemon.client.infer(
        "add_sub", add_sub_inputs(a, a), outputs=[grpcclient.InferRequestedOutput("OUTPUT1")]
    )
    assert result.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.zeros((1, 16), np.float32))


def test_async_infer(daemon: RunningDaemon) -> None:
    results: queue.Queue[object] = queue.Queue()
    a = np.random.rand(1, 16).astype(np.float32)
    b = np.random.rand(1, 16).astype(np.float32)
    for _ in range(4):
        daemon.client.async_infer(
            "add_sub", add_sub_inputs(a, b), callback=lambda result, error: results.put((result, error))
        )
    for _ in range(4):
        result, error = results.get(timeout=30)  # type: ignore[misc]
        assert error is None
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b)


def test_stream_infer_survives_a_failed_request(daemon: RunningDaemon) -> None:
    results: queue.Queue[object] = queue.Queue()
    client = grpcclient.InferenceServerClient(daemon.address)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        a = np.ones((1, 16), np.float32)
        client.async_stream_infer("add_sub", add_sub_inputs(a, a), request_id="s1")
        bad = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        bad.set_data_from_numpy(a)
        client.async_stream_infer("add_sub", [bad], request_id="s2")  # INPUT1 missing
        client.async_stream_infer("add_sub", add_sub_inputs(a * 2, a), request_id="s3")
        got = [results.get(timeout=30) for _ in range(3)]
    finally:
        client.stop_stream()
        client.close()
    (r1, e1), (r2, e2), (r3, e3) = got  # type: ignore[misc]
    assert e1 is None and r1.get_response().id == "s1"
    np.testing.assert_array_equal(r1.as_numpy("OUTPUT0"), a * 2)
    assert r2 is None and "missing input(s) INPUT1" in str(e2)
    assert e3 is None and r3.get_response().id == "s3"
    np.testing.assert_array_equal(r3.as_numpy("OUTPUT0"), a * 3)


def _echo_values(dtype: str, n: int = 7) -> np.ndarray:
    rng = np.random.default_rng(0)
    if dtype == "BOOL":
        return rng.integers(0, 2, n).astype(bool)
    if dtype == "BF16":
        return rng.integers(0, 2**16, n).astype(np.uint16)  # raw bf16 bit patterns
    np_type = NP[dtype]
    if np.issubdtype(np_type, np.integer):
        info = np.iinfo(np_type)
        return rng.integers(info.min, info.max, n, dtype=np_type, endpoint=True)
    return (rng.standard_normal(n) * 1e3).astype(np_type)


def _echo_inputs(values: dict[str, np.ndarray], raw: bool) -> list[grpcclient.InferInput]:
    inputs = []
    for dtype, v in values.items():
        inp = grpcclient.InferInput(f"IN_{dtype}", list(v.shape), dtype)
        if dtype == "BF16":
            inp._raw_content = v.tobytes()  # tritonclient has no numpy bf16; send the bit patterns raw
        elif raw:
            inp.set_data_from_numpy(v)
        else:
            _set_typed(inp, dtype, v)
        inputs.append(inp)
    return inputs


def _set_typed(inp: grpcclient.InferInput, dtype: str, v: np.ndarray) -> None:
    """Fill the typed `contents` field the way a KServe client without raw support would."""
    tensor = inp._get_tensor()
    inp._raw_content = None
    field = {
        "BOOL": "bool_contents",
        "UINT8": "uint_contents",
        "INT8": "int_contents",
        "INT16": "int_contents",
        "INT32": "int_contents",
        "INT64": "int64_contents",
        "FP32": "fp32_contents",
        "FP64": "fp64_contents",
    }[dtype]
    getattr(tensor.contents, field).extend(v.tolist())


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
def test_every_datatype_round_trips_exactly(daemon: RunningDaemon, raw: bool) -> None:
    """Raw: all ten datatypes in one request. Typed `contents`: the eight that have a typed field."""
    values = {t: _echo_values(t) for t in (models.DTYPES if raw else models.TYPED_DTYPES)}
    result = daemon.client.infer("echo_all" if raw else "echo_typed", _echo_inputs(values, raw))
    response = result.get_response()
    raw_out = {o.name: response.raw_output_contents[i] for i, o in enumerate(response.outputs)}
    for dtype, v in values.items():
        out = response.outputs[[o.name for o in response.outputs].index(f"OUT_{dtype}")]
        assert out.datatype == dtype
        assert list(out.shape) == [len(v)]
        assert raw_out[f"OUT_{dtype}"] == v.tobytes(), dtype


def test_model_exception_is_internal_and_worker_keeps_serving(daemon: RunningDaemon) -> None:
    x = grpcclient.InferInput("x", [3], "FP32")
    x.set_data_from_numpy(np.ones(3, np.float32))
    pids = daemon.worker_pids()
    for _ in range(2):
        with pytest.raises(InferenceServerException) as err:
            daemon.client.infer("failing", [x])
        assert err.value.status() == "StatusCode.INTERNAL"
        assert "ValueError: bad input value 3.0" in err.value.message()
    assert daemon.worker_pids() == pids
    assert daemon.client.is_model_ready("failing")


def test_out_of_memory_is_resource_exhausted_and_worker_keeps_serving(daemon: RunningDaemon) -> None:
    """A CPU machine cannot run a GPU out of memory on demand: the model raises the allocator's own error."""
    pids = daemon.worker_pids()
    x = grpcclient.InferInput("x", [2], "FP32")
    x.set_data_from_numpy(np.ones(2, np.float32))
    with pytest.raises(InferenceServerException) as err:
        daemon.client.infer("oom", [x])
    assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert "CUDA out of memory. Tried to allocate 20.00 GiB" in err.value.message()
    x.set_data_from_numpy(np.zeros(2, np.float32))
    np.testing.assert_array_equal(daemon.client.infer("oom", [x]).as_numpy("y"), np.zeros(2, np.float32))
    assert daemon.worker_pids() == pids


def test_statistics_move(daemon: RunningDaemon) -> None:
    def stats() -> dict[str, object]:
        return daemon.client.get_inference_statistics("add_sub", as_json=True)["model_stats"][0]  # type: ignore[no-any-return]

    before = stats()
    a = np.ones((3, 16), np.float32)
    daemon.client.infer("add_sub", add_sub_inputs(a, a))
    after = stats()
    assert int(after["inference_count"]) == int(before.get("inference_count", 0)) + 3
    assert int(after["execution_count"]) == int(before.get("execution_count", 0)) + 1
    s = after["inference_stats"]
    for key in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert int(s[key]["count"]) >= 1, key
        assert int(s[key]["ns"]) > 0, key
    assert int(after["last_inference"]) > 0
    # memory usage per worker: process RSS as CPU (device memory as GPU on a GPU), from its ~5 s report
    usage = wait_for(lambda: stats().get("memory_usage"), 30, "memory usage in the statistics")
    assert [u["type"] for u in usage] == ["CPU"]
    assert int(usage[0]["byte_size"]) > 10_000_000
    all_stats = daemon.client.get_inference_statistics(as_json=True)["model_stats"]
    assert {m["name"] for m in all_stats} >= {"add_sub", "echo_all"}
    with pytest.raises(InferenceServerException) as err:
        daemon.client.get_inference_statistics("nope")
    assert (err.value.status(), err.value.message()) == (  # Triton's answer
        "StatusCode.INVALID_ARGUMENT",
        "requested model 'nope' is not available",
    )


def test_cuda_shared_memory_with_none_registered(daemon: RunningDaemon) -> None:
    """Status and unregister answer as Triton's do with nothing registered (Triton's shared memory examples
    unregister everything first); a named region is not found."""
    client = daemon.client
    assert client.get_cuda_shared_memory_status(as_json=True) == {}
    client.unregister_cuda_shared_memory()
    client.unregister_cuda_shared_memory("never")
    with pytest.raises(InferenceServerException) as err:
        client.get_cuda_shared_memory_status("never")
    assert err.value.status() == "StatusCode.NOT_FOUND"
    assert "unable to find cuda shared memory region: 'never'" in err.value.message()


def test_cuda_shared_memory_register_refusals(daemon: RunningDaemon) -> None:
    """A register request is checked as Triton checks it before CUDA is touched, and a handle this host
    cannot open is refused with the reason: without a GPU in Triton's words for a server without GPU
    support, on a GPU host (tests/test_cuda_shm_gpu.py) in Triton's words for a handle no process made."""

    def refused(name: str, handle: bytes, byte_size: int = 16) -> tuple[str, str]:
        with pytest.raises(InferenceServerException) as err:
            daemon.client.register_cuda_shared_memory(name, base64.b64encode(handle), 0, byte_size)
        return str(err.value.status()), str(err.value.message())

    invalid = "StatusCode.INVALID_ARGUMENT"
    status, message = refused("", bytes(64))
    assert (status, message) == (invalid, "'region name' is necessary to register cuda shared memory region")
    for short in (b"", b"handle", bytes(65)):
        assert refused("r", short) == (
            invalid,
            "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t",
        )
    status, message = refused("r", bytes(64))
    assert status == invalid
    if cuda_gpu_count(os.environ):
        assert message.startswith("failed to register shared memory region: invalid args: "), message
    else:
        assert message.startswith("failed to register CUDA shared memory region: 'r', GPUs not supported: ")
    assert daemon.client.get_cuda_shared_memory_status(as_json=True) == {}


def test_trace_settings_of_a_daemon_that_does_not_trace(daemon: RunningDaemon) -> None:
    """Tracing is off by default (level OFF); tests/test_tracing.py traces."""
    settings = daemon.client.get_trace_settings(as_json=True)["settings"]
    assert settings["trace_level"]["value"] == ["OFF"]
    assert settings["trace_rate"]["value"] == ["1000"]


def test_concurrent_clients(daemon: RunningDaemon) -> None:
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        client = grpcclient.InferenceServerClient(daemon.address)
        try:
            for k in range(10):
                a = np.full((1, 16), seed * 100 + k, np.float32)
                r = client.infer("add_sub", add_sub_inputs(a, a))
                np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a * 2)
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# A config override that its completion from the repository's config cannot mend.
BAD_DIMS = '{"max_batch_size": 4, "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [0]}]}'
BAD_DIMS_REASON = "field 'input.0.dims': dimension 0 is not allowed: use a positive size or -1 for variable"


def test_repository_index_and_load_unload(daemon: RunningDaemon, tmp_path: Path) -> None:
    c = daemon.client
    index = {m["name"]: m for m in c.get_model_repository_index(as_json=True)["models"]}
    assert index["add_sub"]["state"] == "READY"
    assert index["add_sub"]["version"] == "1"
    c.unload_model("failing")
    assert not c.is_model_ready("failing")
    # the unload sticks: a reconcile with the repository (its files unchanged) leaves the model alone
    reload = subprocess.run(
        [sys.executable, "-m", "mpsd", "reload", "--address", daemon.address], capture_output=True, text=True
    )
    assert reload.returncode == 0, reload.stderr
    assert not c.is_model_ready("failing")
    assert "failing" not in {m["name"] for m in c.get_model_repository_index(as_json=True)["models"]}
    with pytest.raises(InferenceServerException) as err:
        x = grpcclient.InferInput("x", [1], "FP32")
        x.set_data_from_numpy(np.ones(1, np.float32))
        c.infer("failing", [x])
    assert err.value.status() == "StatusCode.NOT_FOUND"
    assert err.value.message() == "Request for unknown model: 'failing' has no available versions"  # Triton's
    c.load_model("failing")
    assert c.is_model_ready("failing")
    # Triton's answers, which its model control example matches: a load that finds nothing to load
    not_polled = "failed to load '{}', failed to poll from model repository"
    with pytest.raises(InferenceServerException) as err:
        c.load_model("not_in_repo")
    assert err.value.status() == "StatusCode.INTERNAL"
    assert err.value.message() == not_polled.format("not_in_repo")
    with pytest.raises(InferenceServerException) as err:
        c.load_model("add_sub", files={"file:1/model.pt": b"\x00"})
    assert (err.value.status(), err.value.message()) == (  # files need a config, as in Triton
        "StatusCode.INTERNAL",
        not_polled.format("add_sub") + ": Load parameter 'config' must be specified for model file override",
    )
    with pytest.raises(InferenceServerException) as err:  # a config is validated as in the repository
        c.load_model("add_sub", config=BAD_DIMS)
    assert (err.value.status(), err.value.message()) == (
        "StatusCode.INTERNAL",
        not_polled.format("add_sub") + ": Invalid config override: " + BAD_DIMS_REASON,
    )
    c.unload_model("not_in_repo")  # nothing to unload: done, as Triton answers
    assert c.is_model_ready("add_sub")
    with pytest.raises(grpc.RpcError) as rpc_err:  # mpsd serves one repository, the unnamed one
        c._client_stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(repository_name="other"))
    assert rpc_err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "other" in (rpc_err.value.details() or "")


def test_tensors_larger_than_the_shared_memory_regions_grow_them(daemon: RunningDaemon) -> None:
    """3 MB in and out: past the first regions' size, so the input region and the output region grow."""
    values = {t: _echo_values(t, n=400_000) for t in models.DTYPES}
    result = daemon.client.infer("echo_all", _echo_inputs(values, raw=True))
    response = result.get_response()
    raw_out = {o.name: response.raw_output_contents[i] for i, o in enumerate(response.outputs)}
    for dtype, v in values.items():
        assert raw_out[f"OUT_{dtype}"] == v.tobytes(), dtype
    small = {t: _echo_values(t) for t in models.DTYPES}
    again = daemon.client.infer("echo_all", _echo_inputs(small, raw=True)).get_response()
    assert again.raw_output_contents[0] == small["BOOL"].tobytes()


def test_a_stream_longer_than_its_window_is_answered_in_order(daemon: RunningDaemon) -> None:
    """More requests than a stream may have in progress (256): the stream waits, nothing is dropped."""
    results: queue.Queue[tuple[object, object]] = queue.Queue()
    client = grpcclient.InferenceServerClient(daemon.address)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for i in range(400):
            a = np.full((1, 16), float(i), np.float32)
            client.async_stream_infer("add_sub", add_sub_inputs(a, a), request_id=str(i))
        got = [results.get(timeout=60) for _ in range(400)]
    finally:
        client.stop_stream()
        client.close()
    assert [e for _, e in got] == [None] * 400
    assert [r.get_response().id for r, _ in got] == [str(i) for i in range(400)]  # type: ignore[union-attr]


def test_the_log_is_json_lines_when_stderr_is_not_a_terminal(daemon: RunningDaemon) -> None:
    """log_format auto: stderr is a file here, as under a service manager, so every line is one JSON event."""
    lines = daemon.log().splitlines()
    events = [json.loads(line) for line in lines]
    assert all(isinstance(e, dict) and "event" in e and "level" in e for e in events)
    listening = [e for e in events if e["event"] == "listening"]  # docs/troubleshooting.md: names the address
    assert len(listening) == 1 and daemon.address in json.dumps(listening[0])


SCORES = np.array([[0.1, 0.7, 0.2, 0.7, 0.05], [3.0, -1.0, 2.5, 0.0, 9.25]], dtype=np.float32)
# The classification extension (test_classification.py has its cases): tritonclient's class_count, as
# each protocol carries it; labels from the output's label file (index 2's is empty, index 4 has none).
TOP3 = [
    ["0.700000:1:dog", "0.700000:3:bird", "0.200000:2"],
    ["9.250000:4", "3.000000:0:cat", "2.500000:2"],
]


def test_grpc_top_classes_of_each_row_with_labels(daemon: RunningDaemon) -> None:
    client = grpcclient.InferenceServerClient(daemon.address)
    x = grpcclient.InferInput("IN", list(SCORES.shape), "FP32")
    x.set_data_from_numpy(SCORES)
    result = client.infer("scores", [x], outputs=[grpcclient.InferRequestedOutput("OUT", class_count=3)])
    out = result.as_numpy("OUT")
    assert result.get_output("OUT").datatype == "BYTES" and out.shape == (2, 3)
    assert [[e.decode() for e in row] for row in out] == TOP3


def test_http_top_classes_as_json_and_binary(daemon: RunningDaemon) -> None:
    client = httpclient.InferenceServerClient(daemon.http_address)
    x = httpclient.InferInput("IN", list(SCORES.shape), "FP32")
    x.set_data_from_numpy(SCORES)
    for binary in (False, True):
        wanted = httpclient.InferRequestedOutput("OUT", binary_data=binary, class_count=3)
        out = client.infer("scores", [x], outputs=[wanted]).as_numpy("OUT")
        got = [[e.decode() if isinstance(e, bytes) else e for e in row] for row in out]
        assert got == TOP3, binary


def _cache_counts(client: grpcclient.InferenceServerClient) -> tuple[int, int, int]:
    stats = client.get_inference_statistics("cached", as_json=True)["model_stats"][0]
    inference = stats["inference_stats"]
    return (
        int(stats.get("execution_count", 0)),
        int(inference.get("cache_hit", {}).get("count", 0)),
        int(inference.get("cache_miss", {}).get("count", 0)),
    )


def test_a_repeated_request_is_answered_from_the_response_cache_over_both_protocols(
    daemon: RunningDaemon,
) -> None:
    """The cache's cases are test_response_cache.py's; here: a hit over either protocol, in the statistics."""
    client = grpcclient.InferenceServerClient(daemon.address)
    x = np.arange(6, dtype=np.float32)
    results = []
    for module, c in (
        (grpcclient, client),
        (httpclient, httpclient.InferenceServerClient(daemon.http_address)),
    ):
        tensor = module.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        for _ in range(2 if module is grpcclient else 1):
            results.append(c.infer("cached", [tensor]).as_numpy("y"))
            if len(results) == 1:
                executions, hits, misses = _cache_counts(client)
    for y in results:
        np.testing.assert_array_equal(y, x * 2)
    assert _cache_counts(client) == (executions, hits + 2, misses)
