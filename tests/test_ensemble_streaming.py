"""A decoupled ensemble through the real daemon with the stock tritonclient: ModelStreamInfer through an
ensemble whose last step is a decoupled model streams that model's responses, each carrying the outputs
the earlier steps made (docs/configuration.md, ensembles); and a step that refuses its input fails the
client's request with the step's own status, INVALID_ARGUMENT, over gRPC and HTTP."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import RunningDaemon, serving

F4 = {"data_type": "TYPE_FP32", "dims": [4]}
PARTS = 3


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("ensemble_stream")
    repo = tmp / "repo"
    python = {"backend": "python", "max_batch_size": 0}
    models.python_model(
        repo,
        "double",
        "return {'y': inputs['x'] * 2}",
        config={**python, "input": [{"name": "x", **F4}], "output": [{"name": "y", **F4}]},
    )
    counting = f"for i in range({PARTS}):\n    yield {{'part': inputs['x'] + i}}\n"
    models.python_model(
        repo,
        "count",
        counting,
        config={
            **python,
            "input": [{"name": "x", **F4}],
            "output": [{"name": "part", **F4}],
            "model_transaction_policy": {"decoupled": True},
        },
    )
    models.write_config(
        repo / "streamed",
        {
            "backend": "ensemble",
            "max_batch_size": 0,
            "model_transaction_policy": {"decoupled": True},
            "input": [{"name": "RAW", **F4}],
            "output": [{"name": "DOUBLED", **F4}, {"name": "PART", **F4}],
            "ensemble_scheduling": {
                "step": [
                    {"model_name": "double", "input_map": {"x": "RAW"}, "output_map": {"y": "DOUBLED"}},
                    {"model_name": "count", "input_map": {"x": "DOUBLED"}, "output_map": {"part": "PART"}},
                ]
            },
        },
    )
    (repo / "streamed" / "1").mkdir()
    # Its input takes any length; its step's model takes 4 values: another length is the step's refusal.
    models.write_config(
        repo / "strict",
        {
            "backend": "ensemble",
            "max_batch_size": 0,
            "input": [{"name": "RAW", "data_type": "TYPE_FP32", "dims": [-1]}],
            "output": [{"name": "DOUBLED", "data_type": "TYPE_FP32", "dims": [-1]}],
            "ensemble_scheduling": {
                "step": [{"model_name": "double", "input_map": {"x": "RAW"}, "output_map": {"y": "DOUBLED"}}]
            },
        },
    )
    (repo / "strict" / "1").mkdir()
    with serving(repo, tmp / "daemon.log") as running:
        running.wait_models_settled()
        yield running


def _raw(values: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("RAW", list(values.shape), "FP32")
    tensor.set_data_from_numpy(values)
    return tensor


def test_a_decoupled_ensemble_streams_each_response_with_the_earlier_steps_outputs(
    daemon: RunningDaemon,
) -> None:
    raw = np.arange(4, dtype=np.float32)
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(daemon.address)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer(
            "streamed",
            [_raw(raw)],
            outputs=[grpcclient.InferRequestedOutput(n) for n in ("DOUBLED", "PART")],
            enable_empty_final_response=True,
        )
        responses = []
        while True:
            result, error = got.get(timeout=60)
            assert error is None, error
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
            responses.append(result)
    finally:
        client.stop_stream()
        client.close()
    assert len(responses) == PARTS
    for i, result in enumerate(responses):
        np.testing.assert_array_equal(result.as_numpy("PART"), raw * 2 + i)
        doubled = result.as_numpy("DOUBLED")  # made by the first step, before the stream began
        assert doubled is not None, f"response {i} lacks the first step's output"
        np.testing.assert_array_equal(doubled, raw * 2)


def test_a_step_s_invalid_argument_reaches_the_client_as_invalid_argument(daemon: RunningDaemon) -> None:
    three = np.ones(3, dtype=np.float32)
    with pytest.raises(InferenceServerException) as raised:
        daemon.client.infer("strict", [_raw(three)])
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT", raised.value
    assert raised.value.message().startswith("ensemble 'strict' step 0 (model 'double'): ")
    http = httpclient.InferenceServerClient(daemon.http_address)
    try:
        tensor = httpclient.InferInput("RAW", [3], "FP32")
        tensor.set_data_from_numpy(three)
        with pytest.raises(InferenceServerException) as raised:
            http.infer("strict", [tensor])
        assert raised.value.status() == "400", raised.value
    finally:
        http.close()
