"""A Triton repository with Triton python-backend models (`TritonPythonModel`, `triton_python_backend_utils`)
served unchanged: an ensemble of a python preprocess, a TorchScript network and a python postprocess
answers what the three answer called one after the other; a decoupled python model streams from a thread
of its own through its response sender; an error response reaches the client."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import RunningDaemon, wait_for

PREPROCESS = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        out = pb_utils.get_output_config_by_name(self.model_config, "SCALED")
        self.dtype = pb_utils.triton_string_to_numpy(out["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            raw = pb_utils.get_input_tensor_by_name(request, "RAW").as_numpy()
            scaled = pb_utils.Tensor("SCALED", (raw * 2).astype(self.dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[scaled]))
        return responses

    def finalize(self):
        pass
"""
POSTPROCESS = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.prefix = config["parameters"]["prefix"]["string_value"]

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "SHIFTED").as_numpy()
            if (x < 0).any():
                error = pb_utils.TritonError("negative values cannot be summed here")
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            total = x.sum(axis=1, keepdims=True).astype(np.float32)
            text = np.array([[f"{self.prefix}{t:.1f}".encode()] for t in total[:, 0]], dtype=np.object_)
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("TOTAL", total), pb_utils.Tensor("TEXT", text)]
                )
            )
        return responses
"""
REPEAT = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            sender = request.get_response_sender()

            def send(n=n, sender=sender):
                for i in range(n):
                    out = pb_utils.Tensor("I", np.array([i], dtype=np.int32))
                    sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

            threading.Thread(target=send).start()
        return None
"""


# Triton's BLS: calls the network with `exec` (or `await async_exec` from an `async def execute`), and a
# model that is not there, whose error comes back in its response.
BLS = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    ASYNC

    def answer(self, x, found, missing):
        if found.has_error():
            raise pb_utils.TritonError(found.error().message())
        y = pb_utils.get_output_tensor_by_name(found, "OUTPUT__0").as_numpy()
        error = np.array([[missing.error().message().encode()]] * len(x), dtype=np.object_)
        tensors = [pb_utils.Tensor("Y", y), pb_utils.Tensor("ERROR", error)]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def calls(self, request):
        x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
        found = pb_utils.InferenceRequest(
            model_name="network",
            requested_output_names=["OUTPUT__0"],
            inputs=[pb_utils.Tensor("INPUT__0", x)],
        )
        missing = pb_utils.InferenceRequest(
            model_name="nope", requested_output_names=["y"], inputs=[pb_utils.Tensor("x", x)]
        )
        return x, found, missing
"""
SYNC_EXECUTE = """def execute(self, requests):
        out = []
        for request in requests:
            x, found, missing = self.calls(request)
            out.append(self.answer(x, found.exec(), missing.exec()))
        return out"""
ASYNC_EXECUTE = """async def execute(self, requests):
        out = []
        for request in requests:
            x, found, missing = self.calls(request)
            out.append(self.answer(x, await found.async_exec(), await missing.async_exec()))
        return out"""
# The python_backend README's BLS error pattern: a failed call's error raised as the model's own.
BLS_RAISES = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X")
            response = pb_utils.InferenceRequest(
                model_name="postprocess",
                requested_output_names=["TOTAL"],
                inputs=[pb_utils.Tensor("SHIFTED", x.as_numpy())],
            ).exec()
            if response.has_error():
                raise pb_utils.TritonModelException(response.error().message())
            total = pb_utils.get_output_tensor_by_name(response, "TOTAL")
            out = pb_utils.Tensor("TOTAL", total.as_numpy())
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
"""
# A model with metrics of its own: refused at load, with the line and the reason.
METRICS = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.family = pb_utils.MetricFamily(
            name="calls", description="calls", kind=pb_utils.MetricFamily.COUNTER
        )
"""
BLS_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [
  { name: "Y", data_type: TYPE_FP32, dims: [ 4 ] },
  { name: "ERROR", data_type: TYPE_STRING, dims: [ 1 ] }
]
"""


POST_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "TOTAL", data_type: TYPE_FP32, dims: [ 1 ] } ]
"""


def _pbtxt(name: str, body: str) -> str:
    return f'name: "{name}"\n' + textwrap.dedent(body)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("triton_python")
    repo = tmp / "repo"
    for name, source, body in (
        (
            "preprocess",
            PREPROCESS,
            """
            backend: "python"
            max_batch_size: 8
            input [ { name: "RAW", data_type: TYPE_FP32, dims: [ 4 ] } ]
            output [ { name: "SCALED", data_type: TYPE_FP32, dims: [ 4 ] } ]
            """,
        ),
        (
            "postprocess",
            POSTPROCESS,
            """
            backend: "python"
            max_batch_size: 8
            input [ { name: "SHIFTED", data_type: TYPE_FP32, dims: [ 4 ] } ]
            output [
              { name: "TOTAL", data_type: TYPE_FP32, dims: [ 1 ] },
              { name: "TEXT", data_type: TYPE_STRING, dims: [ 1 ] }
            ]
            parameters { key: "prefix" value: { string_value: "sum=" } }
            """,
        ),
        (
            "repeat",
            REPEAT,
            """
            backend: "python"
            max_batch_size: 0
            model_transaction_policy { decoupled: true }
            input [ { name: "N", data_type: TYPE_INT32, dims: [ 1 ] } ]
            output [ { name: "I", data_type: TYPE_INT32, dims: [ 1 ] } ]
            """,
        ),
    ):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(source)
        (repo / name / "config.pbtxt").write_text(_pbtxt(name, body))
    for name, execute in (("bls", SYNC_EXECUTE), ("bls_async", ASYNC_EXECUTE)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(BLS.replace("ASYNC", execute))
        (repo / name / "config.pbtxt").write_text(_pbtxt(name, BLS_CONFIG))
    for name, source, body in (
        ("bls_raises", BLS_RAISES, POST_CONFIG),
        ("metrics", METRICS, POST_CONFIG),
    ):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(source)
        (repo / name / "config.pbtxt").write_text(_pbtxt(name, body))
    (repo / "network" / "1").mkdir(parents=True)
    models.save_torchscript(models.Constant(1.0), repo / "network" / "1" / "model.pt")
    (repo / "network" / "config.pbtxt").write_text(
        _pbtxt(
            "network",
            """
            platform: "pytorch_libtorch"
            max_batch_size: 8
            input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
            output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
            """,
        )
    )
    (repo / "pipeline" / "1").mkdir(parents=True)
    (repo / "pipeline" / "config.pbtxt").write_text(
        _pbtxt(
            "pipeline",
            """
            platform: "ensemble"
            max_batch_size: 8
            input [ { name: "IMAGE", data_type: TYPE_FP32, dims: [ 4 ] } ]
            output [
              { name: "SUM", data_type: TYPE_FP32, dims: [ 1 ] },
              { name: "CAPTION", data_type: TYPE_STRING, dims: [ 1 ] }
            ]
            ensemble_scheduling {
              step [
                { model_name: "preprocess" model_version: -1
                  input_map { key: "RAW" value: "IMAGE" } output_map { key: "SCALED" value: "scaled" } },
                { model_name: "network" model_version: -1
                  input_map { key: "INPUT__0" value: "scaled" }
                  output_map { key: "OUTPUT__0" value: "shifted" } },
                { model_name: "postprocess" model_version: -1
                  input_map { key: "SHIFTED" value: "shifted" }
                  output_map [ { key: "TOTAL" value: "SUM" }, { key: "TEXT" value: "CAPTION" } ] }
              ]
            }
            """,
        )
    )
    daemon = RunningDaemon(repo, tmp / "daemon.log")
    try:
        daemon.wait_models_settled(timeout=300)
        index = daemon.client.get_model_repository_index(as_json=True)["models"]
        assert {m["name"]: m["state"] for m in index if m["name"] != "metrics"} == dict.fromkeys(
            ("bls", "bls_async", "bls_raises", "network", "pipeline", "postprocess", "preprocess", "repeat"),
            "READY",
        ), index
        yield daemon
    finally:
        daemon.stop()
        daemon.kill_group()


def _infer(
    client: Any, module: Any, model: str, name: str, value: np.ndarray, outputs: list[str]
) -> list[Any]:
    tensor = module.InferInput(name, list(value.shape), "FP32")
    tensor.set_data_from_numpy(value)
    result = client.infer(model, [tensor])
    return [result.as_numpy(o) for o in outputs]


def test_triton_python_ensemble_answers_as_its_steps_one_after_the_other(daemon: RunningDaemon) -> None:
    image = np.arange(8, dtype=np.float32).reshape(2, 4)
    for module, client in (
        (grpcclient, grpcclient.InferenceServerClient(daemon.address)),
        (httpclient, httpclient.InferenceServerClient(daemon.http_address)),
    ):
        (scaled,) = _infer(client, module, "preprocess", "RAW", image, ["SCALED"])
        (shifted,) = _infer(client, module, "network", "INPUT__0", scaled, ["OUTPUT__0"])
        total, text = _infer(client, module, "postprocess", "SHIFTED", shifted, ["TOTAL", "TEXT"])
        got_total, got_text = _infer(client, module, "pipeline", "IMAGE", image, ["SUM", "CAPTION"])
        np.testing.assert_array_equal(got_total, total)
        assert got_text.tolist() == text.tolist() == [[b"sum=16.0"], [b"sum=48.0"]]


@pytest.mark.parametrize("model", ["bls", "bls_async"])
def test_a_triton_python_model_calls_another_model_with_exec(daemon: RunningDaemon, model: str) -> None:
    """Triton's BLS: `InferenceRequest(model_name=...).exec()` (and `async_exec`) answer what the called
    model answers; a call to a model that is not there answers a response carrying Triton's error."""
    client = grpcclient.InferenceServerClient(daemon.address)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    y, error = _infer(client, grpcclient, model, "X", x, ["Y", "ERROR"])
    np.testing.assert_array_equal(y, x + 1)
    assert error.tolist() == [[b"Request for unknown model: 'nope' is not found"]] * 2


def test_an_error_response_reaches_the_client(daemon: RunningDaemon) -> None:
    client = grpcclient.InferenceServerClient(daemon.address)
    with pytest.raises(InferenceServerException) as info:
        _infer(client, grpcclient, "postprocess", "SHIFTED", -np.ones((1, 4), dtype=np.float32), ["TOTAL"])
    assert "negative values cannot be summed here" in info.value.message()


def test_the_readme_bls_error_pattern_hands_the_called_models_error_to_the_client(
    daemon: RunningDaemon,
) -> None:
    """`raise pb_utils.TritonModelException(response.error().message())`: the client gets the called
    model's message as the caller's error."""
    client = grpcclient.InferenceServerClient(daemon.address)
    (total,) = _infer(client, grpcclient, "bls_raises", "X", np.ones((1, 4), dtype=np.float32), ["TOTAL"])
    assert total.tolist() == [[4.0]]
    with pytest.raises(InferenceServerException) as info:
        _infer(client, grpcclient, "bls_raises", "X", -np.ones((1, 4), dtype=np.float32), ["TOTAL"])
    assert info.value.message() == "negative values cannot be summed here", info.value.message()


def test_a_model_using_what_mpsd_refuses_fails_to_load_naming_it(daemon: RunningDaemon) -> None:
    index = daemon.client.get_model_repository_index(as_json=True)["models"]
    (row,) = [m for m in index if m["name"] == "metrics"]
    assert row["state"] == "UNAVAILABLE"
    assert (
        "metrics/1/model.py line 7: pb_utils.MetricFamily is not supported by mpsd: a model's own "
        in row["reason"]
    )


def test_a_decoupled_model_streams_from_its_own_thread(daemon: RunningDaemon) -> None:
    client = grpcclient.InferenceServerClient(daemon.address)
    responses: list[Any] = []
    client.start_stream(callback=lambda result, error: responses.append(error or result))
    try:
        n = grpcclient.InferInput("N", [1], "INT32")
        n.set_data_from_numpy(np.array([4], dtype=np.int32))
        client.async_stream_infer("repeat", [n])
        wait_for(lambda: len(responses) >= 4, 30, "four responses")
    finally:
        client.stop_stream()
    assert [int(r.as_numpy("I")[0]) for r in responses] == [0, 1, 2, 3]


def test_model_config_names_the_python_backend(daemon: RunningDaemon) -> None:
    config = grpcclient.InferenceServerClient(daemon.address).get_model_config("postprocess", as_json=True)[
        "config"
    ]
    assert (config["backend"], config["parameters"]["prefix"]["string_value"]) == ("python", "sum=")


def test_pipeline_folder_is_a_triton_repository(daemon: RunningDaemon) -> None:
    files = sorted(str(p.relative_to(daemon.repo)) for p in Path(daemon.repo).rglob("*") if p.is_file())
    assert all(f.endswith(("config.pbtxt", "model.py", "model.pt")) for f in files), files
