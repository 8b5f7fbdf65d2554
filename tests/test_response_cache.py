"""The response cache through the real daemon with the stock tritonclient: a repeated request is answered
without running the model (its execution count does not move, Triton's cache_hit counts it), a changed
byte or other requested outputs are not, a model without `response_cache` never is, and a reloaded version
does not answer from its predecessor's entries."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from mpsd.config.model_file import validate_model_config
from mpsd.daemon.core.response_cache import request_key
from mpsd.daemon.dataplane.request import InferRequest, InputTensor
from tests import models
from tests.conftest import RunningDaemon, serving

BODY = "return {'y': inputs['x'] * 2, 'z': inputs['x'] + 1}"


def _config(cache: bool) -> dict[str, Any]:
    f = {"data_type": "TYPE_FP32", "dims": [-1]}
    return {
        "backend": "python",
        "max_batch_size": 0,
        "input": [{"name": "x", **f}],
        "output": [{"name": "y", **f}, {"name": "z", **f}],
        "response_cache": {"enable": cache},
    }


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("cache")
    repo = tmp / "repo"
    models.python_model(repo, "cached", BODY, config=_config(True))
    models.python_model(repo, "plain", BODY, config=_config(False))
    with serving(repo, tmp / "daemon.log") as d:
        yield d


def _counts(client: grpcclient.InferenceServerClient, model: str) -> tuple[int, int, int]:
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    inference = stats["inference_stats"]
    return (
        int(stats.get("execution_count", 0)),
        int(inference.get("cache_hit", {}).get("count", 0)),
        int(inference.get("cache_miss", {}).get("count", 0)),
    )


def _infer(
    client: Any, module: Any, model: str, x: np.ndarray, outputs: tuple[str, ...] = ("y", "z")
) -> list[Any]:
    tensor = module.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer(model, [tensor], outputs=[module.InferRequestedOutput(o) for o in outputs])
    return [result.as_numpy(o) for o in outputs]


def test_a_repeated_request_is_answered_from_the_cache(daemon: RunningDaemon) -> None:
    client = grpcclient.InferenceServerClient(daemon.address)
    x = np.arange(6, dtype=np.float32)
    first = _infer(client, grpcclient, "cached", x)
    executions, hits, misses = _counts(client, "cached")
    for module, other in (
        (grpcclient, client),
        (httpclient, httpclient.InferenceServerClient(daemon.http_address)),
    ):
        again = _infer(other, module, "cached", x)
        for a, b in zip(first, again, strict=True):
            np.testing.assert_array_equal(a, b)
    assert _counts(client, "cached") == (executions, hits + 2, misses)


def test_a_changed_byte_or_other_outputs_run_the_model(daemon: RunningDaemon) -> None:
    client = grpcclient.InferenceServerClient(daemon.address)
    x = np.full(4, 7.0, dtype=np.float32)
    _infer(client, grpcclient, "cached", x)
    executions, hits, _ = _counts(client, "cached")
    changed = x.copy()
    changed.view(np.uint8)[0] ^= 1
    (y,) = _infer(client, grpcclient, "cached", changed, ("y",))
    np.testing.assert_array_equal(y, changed * 2)
    _infer(client, grpcclient, "cached", x, ("z",))
    assert _counts(client, "cached")[:2] == (executions + 2, hits)


def test_a_model_without_the_cache_runs_every_time(daemon: RunningDaemon) -> None:
    client = grpcclient.InferenceServerClient(daemon.address)
    x = np.ones(3, dtype=np.float32)
    before = _counts(client, "plain")[0]
    for _ in range(3):
        _infer(client, grpcclient, "plain", x)
    assert _counts(client, "plain") == (before + 3, 0, 0)


def test_a_reloaded_version_does_not_answer_from_its_predecessors_entries(daemon: RunningDaemon) -> None:
    client = grpcclient.InferenceServerClient(daemon.address)
    x = np.full(2, 3.0, dtype=np.float32)
    _infer(client, grpcclient, "cached", x, ("y",))
    model_file = Path(daemon.repo) / "cached" / "1" / "model.py"
    model_file.write_text(model_file.read_text().replace("inputs['x'] * 2", "inputs['x'] * 3"))
    client.load_model("cached")
    (y,) = _infer(client, grpcclient, "cached", x, ("y",))
    np.testing.assert_array_equal(y, x * 3)


def test_a_decoupled_model_cannot_enable_the_cache(tmp_path: Path) -> None:
    config = {**_config(True), "model_transaction_policy": {"decoupled": True}}
    with pytest.raises(ValueError) as info:
        validate_model_config(tmp_path / "config.yaml", config)
    assert "a decoupled model's responses are a stream, which the response cache does not keep" in str(
        info.value
    )


def test_a_request_with_other_parameters_has_another_key() -> None:
    """A python model reads its request's parameters: they are part of what identifies the answer."""
    plain = InferRequest("m", "", "", (InputTensor("x", "FP32", (1,), bytes(4)),), ("y",))
    assert request_key(1, plain) == request_key(1, replace(plain, id="other"))
    assert request_key(1, plain) != request_key(1, replace(plain, parameters=(("k", 1),)))
    assert request_key(1, replace(plain, parameters=(("k", 1),))) != request_key(
        1, replace(plain, parameters=(("k", "1"),))
    )
