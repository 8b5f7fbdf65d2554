"""Triton's HTTP/REST protocol through the stock `tritonclient.http` against a real daemon with real workers:
every endpoint, JSON and binary tensors of every datatype, and the errors, with Triton's statuses; and the
HTTP server in the daemon's lifecycle (on by default, off on request, a busy port, the drain at SIGTERM)."""

from __future__ import annotations

import base64
import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from mpsd.config.daemon_config import DaemonConfig
from tests import models
from tests.conftest import RunningDaemon, free_port, http_request, pending_requests, serving, wait_for
from tests.test_infer import BAD_DIMS, BAD_DIMS_REASON

NP = models.NUMPY_OF


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    repo = tmp_path_factory.mktemp("repo")
    models.add_sub(repo)
    models.echo_all_types(repo)
    models.python_model(
        repo,
        "failing",
        """
        if float(inputs['x'].sum()) != 0:  # warm-up sends zeros
            raise ValueError('bad input value ' + str(float(inputs['x'].sum())))
        return {'y': inputs['x']}
        """,
    )
    with serving(repo, tmp_path_factory.mktemp("log") / "daemon.log") as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon: RunningDaemon) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(daemon.http_address, network_timeout=60)
    try:
        yield c
    finally:
        c.close()


def inputs_of(values: dict[str, np.ndarray], binary: bool = True) -> list[httpclient.InferInput]:
    inputs = []
    for name, value in values.items():
        datatype = "BF16" if name.endswith("BF16") else _datatype(value)
        inp = httpclient.InferInput(name, list(value.shape), datatype)
        inp.set_data_from_numpy(value, binary_data=binary)
        inputs.append(inp)
    return inputs


def _datatype(value: np.ndarray) -> str:
    from tritonclient.utils import np_to_triton_dtype

    return str(np_to_triton_dtype(value.dtype))


def add_sub(a: np.ndarray, b: np.ndarray, binary: bool = True) -> list[httpclient.InferInput]:
    return inputs_of({"INPUT0": a, "INPUT1": b}, binary)


def refused(call: Any) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as err:
        call()
    return str(err.value.status()), str(err.value.message())


# ---- health and metadata ------------------------------------------------------------------------------


def test_health_and_metadata(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("add_sub")
    assert client.is_model_ready("add_sub", "1")
    assert not client.is_model_ready("add_sub", "2")
    assert not client.is_model_ready("no_such_model")
    meta = client.get_server_metadata()
    assert meta["name"] == "mpsd"
    assert "system_shared_memory" in meta["extensions"] and "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata("add_sub")
    assert model["versions"] == ["1"] and model["platform"] == "pytorch_libtorch"
    assert [(i["name"], i["datatype"], i["shape"]) for i in model["inputs"]] == [
        ("INPUT0", "FP32", [-1, 16]),
        ("INPUT1", "FP32", [-1, 16]),
    ]
    assert client.get_model_metadata("add_sub", "1") == model
    assert refused(lambda: client.get_model_metadata("no_such_model"))[0] == "404"


def test_model_config_is_the_effective_config(client: httpclient.InferenceServerClient) -> None:
    cfg = client.get_model_config("add_sub")
    assert cfg["name"] == "add_sub" and cfg["max_batch_size"] == 8
    first = cfg["input"][0]
    assert (first["name"], first["data_type"], first["dims"]) == ("INPUT0", "TYPE_FP32", [16])
    assert cfg["version_policy"] == {"latest": {"num_versions": 1}}
    assert client.get_model_config("add_sub", "1") == cfg
    status, message = refused(lambda: client.get_model_config("add_sub", "7"))
    assert (status, message) == ("404", "Request for unknown model: 'add_sub' version 7 is not found")


def test_health_agrees_with_grpc(daemon: RunningDaemon, client: httpclient.InferenceServerClient) -> None:
    for model in ("add_sub", "no_such_model"):
        assert client.is_model_ready(model) == daemon.client.is_model_ready(model)
    assert client.is_server_ready() == daemon.client.is_server_ready()


# ---- infer ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_with_request_id_and_every_output(
    client: httpclient.InferenceServerClient, binary: bool
) -> None:
    a = np.arange(32, dtype=np.float32).reshape(2, 16)
    b = np.full((2, 16), 3.0, np.float32)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("OUTPUT0", "OUTPUT1")]
    result = client.infer("add_sub", add_sub(a, b, binary), request_id="req-42", outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    response = result.get_response()
    assert (response["id"], response["model_name"], response["model_version"]) == ("req-42", "add_sub", "1")
    assert ("data" in response["outputs"][0]) is not binary


def test_requested_output_subset_and_version(client: httpclient.InferenceServerClient) -> None:
    a = np.ones((1, 16), np.float32)
    result = client.infer(
        "add_sub", add_sub(a, a), model_version="1", outputs=[httpclient.InferRequestedOutput("OUTPUT1")]
    )
    assert result.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.zeros((1, 16), np.float32))


def _values(datatype: str, n: int = 7) -> np.ndarray:
    rng = np.random.default_rng(1)
    if datatype == "BOOL":
        return rng.integers(0, 2, n).astype(bool)
    if datatype == "BF16":  # float32 values that BF16 holds exactly: the low 16 bits are zero
        bits = rng.integers(0, 2**16, n).astype(np.uint32) << 16
        values = bits.view(np.float32)
        return np.where(np.isfinite(values), values, 1.0).astype(np.float32)
    np_type = NP[datatype]
    if np.issubdtype(np_type, np.integer):
        info = np.iinfo(np_type)
        return rng.integers(info.min, info.max, n, dtype=np_type, endpoint=True)
    return (rng.standard_normal(n) * 1e3).astype(np_type)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_every_datatype_round_trips_exactly(client: httpclient.InferenceServerClient, binary: bool) -> None:
    """Binary data: all ten datatypes. JSON: all but BF16, which JSON cannot carry (as in Triton) and which
    goes as binary data in the same request: the two ways mix."""
    values = {f"IN_{t}": _values(t) for t in models.DTYPES}
    inputs = []
    for name, value in values.items():
        inputs += inputs_of({name: value}, binary or name.endswith("BF16"))
    outputs = [
        httpclient.InferRequestedOutput(f"OUT_{t}", binary_data=binary or t == "BF16") for t in models.DTYPES
    ]
    result = client.infer("echo_all", inputs, outputs=outputs)
    for t in models.DTYPES:
        got = result.as_numpy(f"OUT_{t}")
        assert got is not None, t
        expected = values[f"IN_{t}"]
        np.testing.assert_array_equal(got.astype(expected.dtype), expected, err_msg=t)
        assert result.get_output(f"OUT_{t}")["datatype"] == t
        assert ("data" in result.get_output(f"OUT_{t}")) is not (binary or t == "BF16")


def test_non_finite_floats_travel_in_json_as_triton_writes_them(
    daemon: RunningDaemon, client: httpclient.InferenceServerClient
) -> None:
    """JSON has no NaN or infinity; Triton (rapidjson) reads and writes them as the bare tokens NaN, Infinity
    and -Infinity, and tritonclient.http does too: the same here, in both directions."""
    a = np.array([[np.nan, np.inf, -np.inf, 1.5] * 4], np.float32)
    result = client.infer(
        "add_sub",
        add_sub(a, a, binary=False),
        outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)],
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
    body = {
        "inputs": [
            {"name": n, "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 15 + [float("-inf")]}
            for n in ("INPUT0", "INPUT1")
        ],
        "outputs": [{"name": "OUTPUT0"}],
    }
    status, _, raw = http_request(
        daemon.http_address, "POST", "/v2/models/add_sub/infer", json.dumps(body).encode()
    )
    assert status == 200, raw
    assert b"-Infinity]" in raw, raw


def test_bf16_outputs_as_json_are_their_float_values(client: httpclient.InferenceServerClient) -> None:
    values = {f"IN_{t}": _values(t, 3) for t in models.DTYPES}
    result = client.infer(
        "echo_all",
        inputs_of(values),
        outputs=[httpclient.InferRequestedOutput("OUT_BF16", binary_data=False)],
    )
    np.testing.assert_array_equal(result.as_numpy("OUT_BF16"), values["IN_BF16"])


def test_errors_have_triton_statuses_and_name_the_problem(client: httpclient.InferenceServerClient) -> None:
    a = np.ones((1, 16), np.float32)
    cases = {
        "unknown model": (
            lambda: client.infer("no_such_model", add_sub(a, a)),
            "404",
            "Request for unknown model: 'no_such_model' is not found",
        ),
        "unknown version": (
            lambda: client.infer("add_sub", add_sub(a, a), model_version="7"),
            "404",
            "Request for unknown model: 'add_sub' version 7 is not found",
        ),
        "missing input": (
            lambda: client.infer("add_sub", inputs_of({"INPUT0": a})),
            "400",
            "missing input(s) INPUT1",
        ),
        "bad shape": (
            lambda: client.infer("add_sub", add_sub(np.ones((1, 15), np.float32), a)),
            "400",
            "does not match the model's dims [16]",
        ),
        "batch too large": (
            lambda: client.infer(
                "add_sub", add_sub(np.ones((9, 16), np.float32), np.ones((9, 16), np.float32))
            ),
            "400",
            "exceeds max_batch_size 8",
        ),
        "wrong datatype": (
            lambda: client.infer("add_sub", add_sub(a.astype(np.float64), a)),
            "400",
            "expected datatype FP32",
        ),
        "model raised": (
            lambda: client.infer("failing", inputs_of({"x": np.ones(3, np.float32)})),
            "500",
            "ValueError: bad input value 3.0",
        ),
    }
    for what, (call, status, words) in cases.items():
        got_status, message = refused(call)
        assert (got_status, words in message) == (status, True), f"{what}: {got_status} {message}"


def test_bytes_tensors_are_refused_as_on_grpc(daemon: RunningDaemon) -> None:
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "BYTES", "data": ["a"]}]}
    status, reply, _ = http_request(
        daemon.http_address, "POST", "/v2/models/add_sub/infer", json.dumps(body).encode()
    )
    assert status == 400 and "BYTES" in reply["error"]


def test_statistics_move_and_are_numbers(client: httpclient.InferenceServerClient) -> None:
    def stats() -> dict[str, Any]:
        return client.get_inference_statistics("add_sub")["model_stats"][0]  # type: ignore[no-any-return]

    before = stats()
    a = np.ones((3, 16), np.float32)
    client.infer("add_sub", add_sub(a, a))
    after = stats()
    assert after["inference_count"] == before["inference_count"] + 3
    assert after["execution_count"] == before["execution_count"] + 1
    assert after["inference_stats"]["success"]["count"] >= 1
    assert isinstance(after["inference_stats"]["success"]["ns"], int)
    assert client.get_inference_statistics("add_sub", "1")["model_stats"] == [
        client.get_inference_statistics("add_sub", "1")["model_stats"][0]
    ]
    everything = client.get_inference_statistics()["model_stats"]
    assert {m["name"] for m in everything} >= {"add_sub", "echo_all"}
    assert refused(lambda: client.get_inference_statistics("nope")) == (
        "400",
        "requested model 'nope' is not available",  # Triton's answer
    )


def test_the_same_queue_and_statistics_as_grpc(
    daemon: RunningDaemon, client: httpclient.InferenceServerClient
) -> None:
    """HTTP is an adapter over the same operations: a request on either protocol counts in one statistics."""
    a = np.ones((1, 16), np.float32)
    before = client.get_inference_statistics("add_sub")["model_stats"][0]["inference_count"]
    client.infer("add_sub", add_sub(a, a))
    inputs = [grpcclient.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
    for inp in inputs:
        inp.set_data_from_numpy(a)
    daemon.client.infer("add_sub", inputs)
    assert client.get_inference_statistics("add_sub")["model_stats"][0]["inference_count"] == before + 2


def test_concurrent_clients(daemon: RunningDaemon) -> None:
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        c = httpclient.InferenceServerClient(daemon.http_address)
        try:
            for k in range(10):
                a = np.full((1, 16), seed * 100 + k, np.float32)
                np.testing.assert_array_equal(c.infer("add_sub", add_sub(a, a)).as_numpy("OUTPUT0"), a * 2)
        except BaseException as exc:
            errors.append(exc)
        finally:
            c.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_system_shared_memory_with_the_stock_client(
    daemon: RunningDaemon, client: httpclient.InferenceServerClient
) -> None:
    """Inputs read from and outputs written to a registered region; the region is the gRPC port's too."""
    import os

    from tests.triton_shm import shm

    key = f"/mpsdtest_http_client_{os.getpid()}"
    handle = shm.create_shared_memory_region("http_region", key, 256)
    try:
        a, b = np.full((1, 16), 5.0, np.float32), np.full((1, 16), 2.0, np.float32)
        shm.set_shared_memory_region(handle, [a, b])
        client.register_system_shared_memory("http_region", key, 256)
        assert client.get_system_shared_memory_status() == [
            {"name": "http_region", "key": key, "offset": 0, "byte_size": 256}
        ]
        grpc_view = daemon.client.get_system_shared_memory_status(as_json=True)["regions"]
        assert grpc_view["http_region"]["key"] == key
        inputs = [httpclient.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_shared_memory("http_region", 64)
        inputs[1].set_shared_memory("http_region", 64, offset=64)
        out = httpclient.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory("http_region", 64, offset=128)
        result = client.infer("add_sub", inputs, outputs=[out, httpclient.InferRequestedOutput("OUTPUT1")])
        assert "data" not in result.get_output("OUTPUT0") and "parameters" not in result.get_output("OUTPUT0")
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(handle, np.float32, [1, 16], offset=128), a + b
        )
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
        assert refused(lambda: client.get_system_shared_memory_status("nope"))[0] == "404"
        status, message = refused(lambda: client.register_system_shared_memory("http_region", key, 256))
        assert status == "400" and "already registered" in message
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(handle)
    assert client.get_system_shared_memory_status() == []


# ---- repository, settings, what is not implemented ---------------------------------------------------------


def test_repository_index_load_and_unload(client: httpclient.InferenceServerClient) -> None:
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["add_sub"]["state"] == "READY" and index["add_sub"]["version"] == "1"
    client.unload_model("failing")
    assert not client.is_model_ready("failing")
    status, message = refused(lambda: client.infer("failing", inputs_of({"x": np.zeros(1, np.float32)})))
    assert (status, message) == ("404", "Request for unknown model: 'failing' has no available versions")
    client.load_model("failing")
    assert client.is_model_ready("failing")
    # Triton's answers, which its model control example matches: a load that finds nothing to load
    not_polled = "failed to load '{}', failed to poll from model repository"
    assert refused(lambda: client.load_model("not_in_repo")) == ("500", not_polled.format("not_in_repo"))
    status, message = refused(lambda: client.load_model("add_sub", files={"file:1/model.pt": b"\x00"}))
    assert (status, message) == (
        "500",
        not_polled.format("add_sub") + ": Load parameter 'config' must be specified for model file override",
    )
    status, message = refused(lambda: client.load_model("add_sub", config=BAD_DIMS))
    assert (status, message) == (
        "500",
        not_polled.format("add_sub") + ": Invalid config override: " + BAD_DIMS_REASON,
    )
    client.unload_model("not_in_repo")  # nothing to unload: done, as Triton answers
    assert client.is_model_ready("add_sub")


def test_log_settings_read_and_change(client: httpclient.InferenceServerClient) -> None:
    settings = client.get_log_settings()
    assert settings["log_info"] is True
    changed = client.update_log_settings({"log_verbose_level": 1})
    assert changed["log_verbose_level"] == 1
    client.update_log_settings({"log_verbose_level": 0})
    status, message = refused(lambda: client.update_log_settings({"log_file": "/tmp/x"}))
    assert status == "400" and "log_file" in message


def test_trace_settings_of_a_daemon_that_does_not_trace(client: httpclient.InferenceServerClient) -> None:
    """Tracing is off by default: level OFF, Triton's default rate and count (test_tracing.py traces)."""
    settings = client.get_trace_settings()
    assert (settings["trace_level"], settings["trace_rate"], settings["trace_count"]) == (
        ["OFF"],
        "1000",
        "-1",
    )
    assert settings["trace_mode"] == "opentelemetry"


def test_cuda_shared_memory_with_none_registered(client: httpclient.InferenceServerClient) -> None:
    """Status and unregister answer as Triton's do with nothing registered (clients unregister everything
    before they register system shared memory); a named region is not found."""
    assert client.get_cuda_shared_memory_status() == []
    client.unregister_cuda_shared_memory()
    client.unregister_cuda_shared_memory("never")
    status, message = refused(lambda: client.get_cuda_shared_memory_status("never"))
    assert status == "404" and "unable to find cuda shared memory region: 'never'" in message


def test_cuda_shared_memory_register_body(
    daemon: RunningDaemon, client: httpclient.InferenceServerClient
) -> None:
    """The register body is read as Triton's HTTP server reads it ({"raw_handle": {"b64"}, "device_id",
    "byte_size"}); a handle this host cannot open is refused with the reason (tests/test_infer.py)."""
    handle = base64.b64encode(bytes(64)).decode()

    def post(body: object) -> tuple[int, str]:
        path = "/v2/cudasharedmemory/region/r/register"
        status, reply, _ = http_request(daemon.http_address, "POST", path, json.dumps(body).encode())
        return status, reply["error"]

    bad_handle = "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"
    full = {"raw_handle": {"b64": handle}, "device_id": 0, "byte_size": 16}
    assert post({"device_id": 0, "byte_size": 16}) == (
        400,
        "Shared memory register request has no 'raw_handle' field",
    )
    for b64 in ("not base64!", f"!{handle}", base64.b64encode(bytes(63)).decode(), 7):
        assert post({**full, "raw_handle": {"b64": b64}}) == (400, bad_handle)
    for key in ("device_id", "byte_size"):
        assert post({k: v for k, v in full.items() if k != key}) == (
            400,
            f"the cuda shared memory register request has no '{key}' field",
        )
    status, message = refused(lambda: client.register_cuda_shared_memory("r", handle, 0, 16))
    assert status == "400" and message.startswith("failed to register")
    assert client.get_cuda_shared_memory_status() == []


# ---- HTTP itself -------------------------------------------------------------------------------------------


def test_unknown_paths_and_methods_get_triton_json_errors(daemon: RunningDaemon) -> None:
    status, reply, _ = http_request(daemon.http_address, "GET", "/v2/nothing/here")
    assert (status, reply) == (404, {"error": "Not Found"})
    status, reply, _ = http_request(daemon.http_address, "GET", "/v2/models/add_sub/infer")
    assert (status, reply) == (405, {"error": "Method Not Allowed"})
    status, reply, _ = http_request(daemon.http_address, "GET", "/v2/models/add_sub/versions/x")
    assert status == 404


def test_server_readiness_codes(daemon: RunningDaemon) -> None:
    assert http_request(daemon.http_address, "GET", "/v2/health/ready")[0] == 200
    status, reply, _ = http_request(daemon.http_address, "GET", "/v2/models/nope/ready")
    assert (status, reply) == (400, {"error": "Model version not ready"})


# ---- the HTTP server in the daemon's lifecycle -----------------------------------------------------------
# On by default beside gRPC, off on request, a busy port that does not stop the daemon, and the drain: at
# SIGTERM readiness turns 503 at once while the request in progress finishes, and the port closes only
# after it. Each on a daemon of its own.


def test_defaults() -> None:
    assert DaemonConfig().http_address == "127.0.0.1:8000"
    assert DaemonConfig().grpc_address == "127.0.0.1:8001"


def test_sigterm_turns_readiness_503_while_the_request_in_progress_finishes(
    tmp_path: Path, start_daemon: Any
) -> None:
    repo, gate = tmp_path / "repo", tmp_path / "gate"
    gate.mkdir()
    models.gated_model(repo, gate)
    metrics = f"127.0.0.1:{free_port()}"
    daemon: RunningDaemon = start_daemon(repo, extra_args=["--metrics-address", metrics])
    daemon.wait_ready()
    body = json.dumps({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0, 1.0]}]})
    answers: list[tuple[int, Any, bytes]] = []
    call = threading.Thread(
        target=lambda: answers.append(
            http_request(daemon.http_address, "POST", "/v2/models/gated/infer", body.encode(), timeout=120)
        )
    )
    call.start()
    wait_for(lambda: pending_requests(metrics) == 1, 30, "the request in the daemon")
    daemon.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "stopping: draining in-flight requests" in daemon.log(), 30, "the drain begun")

    for path in ("/v2/health/ready", "/v2/models/gated/ready"):
        status, reply, _ = http_request(daemon.http_address, "GET", path)
        assert (status, reply) == (503, {"error": "the daemon is shutting down"}), path
    # Still live, as Triton: a liveness probe must not restart a daemon that is finishing its requests.
    assert http_request(daemon.http_address, "GET", "/v2/health/live")[0] == 200
    status, _, _ = http_request(daemon.http_address, "POST", "/v2/models/gated/infer", body.encode())
    assert status == 503, "a request during the drain was accepted"
    try:
        grpc_ready = daemon.client.is_server_ready()
    except Exception:
        grpc_ready = False  # the gRPC server refuses new calls once its drain began
    assert not grpc_ready

    (gate / "1").touch()
    call.join(60)
    assert [a[:2] for a in answers] == [
        (200, {"model_name": "gated", "model_version": "1", "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [2], "data": [2.0, 2.0]}
        ]})
    ]  # fmt: skip
    assert daemon.proc.wait(60) == 0
    with pytest.raises(OSError):
        http_request(daemon.http_address, "GET", "/v2/health/live", timeout=5)


def test_http_off_and_a_busy_port(tmp_path: Path, start_daemon: Any) -> None:
    """`--http-address off` serves gRPC only; a port held by someone else is logged, and gRPC serves."""
    import socket

    repo = tmp_path / "repo"
    models.add_sub(repo, dims=4)
    off: RunningDaemon = start_daemon(repo, extra_args=["--http-address", "off"])
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy_address = f"127.0.0.1:{holder.getsockname()[1]}"
        busy: RunningDaemon = start_daemon(repo, extra_args=["--http-address", busy_address])
        for d in (off, busy):
            d.wait_ready()
        assert "http endpoint" not in off.log()
        assert "http endpoint not started" in busy.log()
    assert busy.client.is_server_ready()


def test_a_malformed_or_colliding_address_is_a_configuration_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    (tmp_path / "models").mkdir()
    for address, words in (
        ("nonsense", "http_address 'nonsense'"),
        ("unix:relative.sock", "absolute path"),
        ("127.0.0.1:8001", "collide"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "mpsd", "serve", "--model-repository", str(tmp_path / "models"),
             "--grpc-address", "127.0.0.1:8001", "--http-address", address],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        assert done.returncode == 78, done.stderr
        assert words in done.stderr, done.stderr


def test_the_stock_client_on_the_default_path(tmp_path: Path, start_daemon: Any) -> None:
    """The stock client's async infer (its greenlet pool) against the daemon's HTTP port."""
    repo = tmp_path / "repo"
    models.add_sub(repo, dims=4)
    daemon: RunningDaemon = start_daemon(repo)
    daemon.wait_ready()
    client = httpclient.InferenceServerClient(daemon.http_address, concurrency=4)
    try:
        a = np.ones((1, 4), np.float32)
        inputs = [httpclient.InferInput(n, [1, 4], "FP32") for n in ("INPUT0", "INPUT1")]
        for inp in inputs:
            inp.set_data_from_numpy(a)
        pending = [client.async_infer("add_sub", inputs) for _ in range(8)]
        for p in pending:
            np.testing.assert_array_equal(p.get_result().as_numpy("OUTPUT0"), a * 2)
    finally:
        client.close()
