"""Shape buckets through the real daemon: padded to a bucket and cut back with exact answers, the mask input
made by the daemon, requests of different lengths batched together (configured in config.yaml or as
`mpsd.shape_buckets.*` parameters of a config.pbtxt), a too-long request refused; and the config's rules,
in-process, and the same rules' words for a config.pbtxt (through `mpsd`, as its protobuf code clashes with
tritonclient's in one process)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from pydantic import ValidationError
from tritonclient.utils import InferenceServerException

from mpsd.config.model_config import ModelConfig
from tests import models
from tests.conftest import ROOT, RunningDaemon, serving

# Doubles x and takes its mean over the real positions (the mask's ones; all of them without a mask), and
# logs the shapes it was given.
MASKED_MEAN = """
import json
x = inputs['x']
mask = inputs.get('MASK')
weights = mask.to(x.dtype) if mask is not None else torch.ones_like(x)
with open(self.config['parameters']['log'], 'a') as f:
    f.write(json.dumps({'x': list(x.shape), 'mask': list(mask.shape) if mask is not None else None}) + '\\n')
return {'y': x * 2, 'mean': ((x * weights).sum(1, keepdim=True) / weights.sum(1, keepdim=True))}
"""

SIZES = [4, 8, 16]

# The same without batching: x is one vector, bucketed along its only dim (0).
SINGLE = """
x, weights = inputs['x'], inputs['MASK'].to(inputs['x'].dtype)
return {'y': x * 2, 'mean': (x * weights).sum(0, keepdim=True) / weights.sum(0, keepdim=True)}
"""


def config(log: Path, buckets: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    return {
        "backend": "python",
        "max_batch_size": 8,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [
            {"name": "y", "data_type": "TYPE_FP32", "dims": [-1]},
            {"name": "mean", "data_type": "TYPE_FP32", "dims": [1]},
        ],
        "instance_group": [{"kind": "KIND_CPU"}],
        "parameters": {"log": str(log)},
        **({"shape_buckets": buckets} if buckets is not None else {}),
        **extra,
    }


BUCKETS = {
    "inputs": {"x": {"dim": 1, "sizes": SIZES, "pad_value": -7}},
    "mask_input": "MASK",
    "outputs": {"y": {"dim": 1, "follows": "x"}},
}


# "batched" as Triton's text format: its buckets as `mpsd.shape_buckets.*` parameters.
BATCHED_PBTXT = """
backend: "python"
max_batch_size: 8
input [ { name: "x", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [
  { name: "y", data_type: TYPE_FP32, dims: [ -1 ] },
  { name: "mean", data_type: TYPE_FP32, dims: [ 1 ] }
]
instance_group [ { kind: KIND_CPU } ]
dynamic_batching { max_queue_delay_microseconds: 500000, preferred_batch_size: [ 6 ] }
parameters [
  { key: "log", value: { string_value: "LOG" } },
  { key: "mpsd.shape_buckets.inputs.x.dim", value: { string_value: "1" } },
  { key: "mpsd.shape_buckets.inputs.x.sizes", value: { string_value: "4, 8, 16" } },
  { key: "mpsd.shape_buckets.inputs.x.pad_value", value: { string_value: "-7" } },
  { key: "mpsd.shape_buckets.mask_input", value: { string_value: "MASK" } },
  { key: "mpsd.shape_buckets.outputs.y.dim", value: { string_value: "1" } },
  { key: "mpsd.shape_buckets.outputs.y.follows", value: { string_value: "x" } }
]
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningDaemon, Path]]:
    tmp = tmp_path_factory.mktemp("buckets")
    repo = tmp / "repo"
    models.python_model(repo, "plain", MASKED_MEAN, config=config(tmp / "plain.log", None))
    models.python_model(repo, "bucketed", MASKED_MEAN, config=config(tmp / "bucketed.log", BUCKETS))
    batching = {"max_queue_delay_microseconds": 500_000, "preferred_batch_size": [6]}
    models.python_model(
        repo, "batched", MASKED_MEAN, config=config(tmp / "batched.log", BUCKETS, dynamic_batching=batching)
    )
    single = {**config(tmp / "single.log", None), "max_batch_size": 0}
    single["shape_buckets"] = {
        "inputs": {"x": {"dim": 0, "sizes": [4, 8], "pad_value": 5}},
        "mask_input": {"name": "MASK", "data_type": "TYPE_BOOL"},
        "outputs": {"y": {"dim": 0, "follows": "x"}},
    }
    models.python_model(repo, "single", SINGLE, config=single)
    pbtxt_model = models.python_model(
        repo, "batched_pbtxt", MASKED_MEAN, config=config(tmp / "pbtxt.log", None)
    )
    (pbtxt_model / "config.yaml").unlink()
    (pbtxt_model / "config.pbtxt").write_text(BATCHED_PBTXT.replace("LOG", str(tmp / "pbtxt.log")))
    with serving(repo, tmp / "daemon.log") as running:
        yield running, tmp


def x(values: np.ndarray) -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("x", list(values.shape), "FP32")
    inp.set_data_from_numpy(values)
    return [inp]


def shapes(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_a_padded_request_answers_as_the_unpadded_one(daemon: tuple[RunningDaemon, Path]) -> None:
    running, tmp = daemon
    rng = np.random.default_rng(0)
    for length in (1, 3, 4, 5, 11, 16):
        values = rng.integers(-50, 50, (2, length)).astype(np.float32)  # sums exact in any order
        plain = running.client.infer("plain", x(values))
        padded = running.client.infer("bucketed", x(values))
        for name in ("y", "mean"):
            assert padded.as_numpy(name).shape == plain.as_numpy(name).shape, (name, length)
            np.testing.assert_array_equal(padded.as_numpy(name), plain.as_numpy(name))
    seen = shapes(tmp / "bucketed.log")
    assert {s["x"][1] for s in seen} == set(SIZES), seen  # warm-up and requests: the buckets only
    assert all(s["mask"] == s["x"] for s in seen), seen


def test_without_batching_the_first_dim_is_bucketed(daemon: tuple[RunningDaemon, Path]) -> None:
    running, _ = daemon
    for length in (1, 3, 6, 8):
        values = np.arange(length, dtype=np.float32) - 2
        result = running.client.infer("single", x(values))
        np.testing.assert_array_equal(result.as_numpy("y"), values * 2)
        np.testing.assert_allclose(result.as_numpy("mean"), [values.mean()], rtol=1e-6)


@pytest.mark.parametrize(("model", "log"), [("batched", "batched.log"), ("batched_pbtxt", "pbtxt.log")])
def test_requests_of_different_lengths_share_an_execution(
    daemon: tuple[RunningDaemon, Path], model: str, log: str
) -> None:
    running, tmp = daemon
    lengths = [5, 6, 7, 8, 2, 3]  # buckets 8, 8, 8, 8, 4, 4: one execution pads all to 8
    arrays = [np.arange(n, dtype=np.float32).reshape(1, n) + i for i, n in enumerate(lengths)]
    done: queue.Queue[tuple[int, Any, Any]] = queue.Queue()
    for i, a in enumerate(arrays):
        running.client.async_infer(
            model, x(a), callback=lambda result, error, i=i: done.put((i, result, error))
        )
    got = sorted((done.get(timeout=60) for _ in arrays), key=lambda t: t[0])
    for a, (_, result, error) in zip(arrays, got, strict=True):
        assert error is None, error
        np.testing.assert_array_equal(result.as_numpy("y"), a * 2)
        np.testing.assert_allclose(result.as_numpy("mean"), a.mean(1, keepdims=True), rtol=1e-6)
    stats = running.client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    assert int(stats["execution_count"]) < int(stats["inference_count"]), stats
    assert any(s["x"][0] > 1 and s["x"][1] == 8 for s in shapes(tmp / log))


def test_a_request_longer_than_the_largest_bucket_is_refused(daemon: tuple[RunningDaemon, Path]) -> None:
    running, _ = daemon
    with pytest.raises(InferenceServerException) as refused:
        running.client.infer("bucketed", x(np.zeros((1, 17), np.float32)))
    assert "INVALID_ARGUMENT" in str(refused.value.status())
    message = refused.value.message()
    assert "input 'x'" in message and "length 17" in message and "largest shape bucket 16" in message


def _config(buckets: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "max_batch_size": 4,
        "input": [
            {"name": "IDS", "data_type": "TYPE_INT64", "dims": [-1]},
            {"name": "FIXED", "data_type": "TYPE_FP32", "dims": [3]},
        ],
        "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [-1, 2]}],
        "shape_buckets": buckets,
        **extra,
    }


@pytest.mark.parametrize(
    ("buckets", "message"),
    [
        ({"inputs": {"IDS": {"dim": 1, "sizes": [8, 4]}}}, "sizes must be strictly ascending"),
        ({"inputs": {"IDS": {"dim": 1, "sizes": [0, 4]}}}, "greater than or equal to 1"),
        ({"inputs": {"IDS": {"dim": 1, "sizes": []}}}, "at least 1 item"),
        ({"inputs": {"NOPE": {"dim": 1, "sizes": [4]}}}, "the model has no input 'NOPE'"),
        (
            {"inputs": {"FIXED": {"dim": 1, "sizes": [4]}}},
            "dim 1 (counting the batch dimension as 0) is not a",
        ),
        ({"inputs": {"IDS": {"dim": 0, "sizes": [4]}}}, "dim 0 is the batch dimension"),
        ({"inputs": {"IDS": {"dim": 1, "sizes": [4]}}, "mask_input": "FIXED"}, "is also an input"),
        (
            {"inputs": {"IDS": {"dim": 1, "sizes": [4]}}, "outputs": {"OUT": {"dim": 2, "follows": "IDS"}}},
            "dim 2 (counting the batch dimension as 0) is not a variable (-1) dim of 'OUT'",
        ),
        (
            {"inputs": {"IDS": {"dim": 1, "sizes": [4]}}, "outputs": {"OUT": {"dim": 1, "follows": "FIXED"}}},
            "follows 'FIXED', which is not a bucketed input",
        ),
    ],
)
def test_config_rules(buckets: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as refused:
        ModelConfig.model_validate(_config(buckets))
    assert message in str(refused.value)


def test_a_valid_config_and_cuda_graphs_over_bucketed_dims() -> None:
    buckets = {
        "inputs": {"IDS": {"dim": 1, "sizes": [4, 8]}},
        "mask_input": "MASK",
        "outputs": {"OUT": {"dim": 1, "follows": "IDS"}},
    }
    config = ModelConfig.model_validate(_config(buckets, optimization={"cuda": {"graphs": True}}))
    assert config.shape_buckets is not None and config.shape_buckets.mask_input is not None
    assert config.shape_buckets.mask_input.name == "MASK"
    with pytest.raises(ValidationError, match="variable"):  # unbucketed variable dims are still refused
        ModelConfig.model_validate(_config(None, optimization={"cuda": {"graphs": True}}))  # type: ignore[arg-type]


def _mpsd(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mpsd", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


TENSORS_PBTXT = """
backend: "python"
max_batch_size: 4
input [
  { name: "IDS", data_type: TYPE_INT64, dims: [ -1 ] },
  { name: "FIXED", data_type: TYPE_FP32, dims: [ 3 ] }
]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1, 2 ] } ]
"""

# The same broken spec in config.yaml's fields and as config.pbtxt parameters (without `mpsd.shape_buckets.`).
BROKEN = [
    ({"inputs": {"IDS": {"dim": 1, "sizes": [8, 4]}}}, {"inputs.IDS.dim": "1", "inputs.IDS.sizes": "8,4"}),
    ({"inputs": {"IDS": {"dim": 1, "sizes": [0, 4]}}}, {"inputs.IDS.dim": "1", "inputs.IDS.sizes": "0,4"}),
    ({"inputs": {"IDS": {"dim": 1, "sizes": []}}}, {"inputs.IDS.dim": "1", "inputs.IDS.sizes": ""}),
    ({"inputs": {"NOPE": {"dim": 1, "sizes": [4]}}}, {"inputs.NOPE.dim": "1", "inputs.NOPE.sizes": "4"}),
    ({"inputs": {"IDS": {"dim": 0, "sizes": [4]}}}, {"inputs.IDS.dim": "0", "inputs.IDS.sizes": "4"}),
    ({"inputs": {"IDS": {"dim": "one", "sizes": [4]}}}, {"inputs.IDS.dim": "one", "inputs.IDS.sizes": "4"}),
    ({"inputs": {"IDS": {"sizes": [4]}}}, {"inputs.IDS.sizes": "4"}),
    (
        {"inputs": {"IDS": {"dim": 1, "sizes": [4], "pad": 1}}},
        {"inputs.IDS.dim": "1", "inputs.IDS.sizes": "4", "inputs.IDS.pad": "1"},
    ),
    (
        {"inputs": {"IDS": {"dim": 1, "sizes": [4]}}, "mask_input": "FIXED"},
        {"inputs.IDS.dim": "1", "inputs.IDS.sizes": "4", "mask_input": "FIXED"},
    ),
    (
        {"inputs": {"IDS": {"dim": 1, "sizes": [4]}}, "outputs": {"OUT": {"dim": 1, "follows": "FIXED"}}},
        {
            "inputs.IDS.dim": "1",
            "inputs.IDS.sizes": "4",
            "outputs.OUT.dim": "1",
            "outputs.OUT.follows": "FIXED",
        },
    ),
]


def _bucket_parameters(parameters: dict[str, str]) -> str:
    entries = ",\n".join(
        f'  {{ key: "mpsd.shape_buckets.{k}", value: {{ string_value: "{v}" }} }}'
        for k, v in parameters.items()
    )
    return f"parameters [\n{entries}\n]\n"


def test_a_broken_spec_in_config_pbtxt_is_refused_in_the_words_of_config_yaml(tmp_path: Path) -> None:
    """Every broken spec gives `mpsd validate` the same field and problem in either format; a parameter of no
    known form is refused naming the forms."""
    for i, (fields, parameters) in enumerate(BROKEN):
        models.write_config(tmp_path / f"yaml{i}", {**_config(fields), "backend": "python"})
        pbtxt = tmp_path / f"pbtxt{i}"
        pbtxt.mkdir()
        (pbtxt / "config.pbtxt").write_text(TENSORS_PBTXT + _bucket_parameters(parameters))
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.pbtxt").write_text(
        TENSORS_PBTXT + _bucket_parameters({"inputs.IDS": "4"})
    )
    done = _mpsd("validate", tmp_path, "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    found: dict[str, list[tuple[str, str]]] = {}
    for p in json.loads(done.stdout)["problems"]:
        found.setdefault(p["model"], []).append((p["field"], p["problem"]))
    for i in range(len(BROKEN)):
        assert found[f"yaml{i}"], BROKEN[i]
        assert found[f"pbtxt{i}"] == found[f"yaml{i}"], BROKEN[i]
    [(field, problem)] = found["unknown"]
    assert field == "parameters.mpsd.shape_buckets.inputs.IDS", field
    assert "shape_buckets.inputs.NAME.(dim|sizes|pad_value)" in problem, problem


def test_config_yaml_to_pbtxt_and_back_keeps_the_buckets(tmp_path: Path) -> None:
    """`mpsd convert-config` writes shape_buckets as `mpsd.shape_buckets.*` parameters and reads them back
    as the same buckets, a tensor name with dots included."""
    buckets = {
        "inputs": {
            "IDS": {"dim": 1, "sizes": [4, 8], "pad_value": -1},
            "feat.x": {"dim": 1, "sizes": [2, 16], "pad_value": 0.5},
        },
        "mask_input": {"name": "MASK", "follows": "feat.x", "data_type": "TYPE_BOOL"},
        "outputs": {"OUT": {"dim": 1, "follows": "IDS"}},
    }
    original = _config(buckets)
    original["input"].append({"name": "feat.x", "data_type": "TYPE_FP32", "dims": [-1, 4]})
    models.write_config(tmp_path / "m", original)
    to_pbtxt = _mpsd("convert-config", tmp_path / "m" / "config.yaml")
    assert to_pbtxt.returncode == 0, to_pbtxt.stderr
    assert '"mpsd.shape_buckets.inputs.feat.x.sizes"' in to_pbtxt.stdout, to_pbtxt.stdout
    (tmp_path / "n").mkdir()
    (tmp_path / "n" / "config.pbtxt").write_text(to_pbtxt.stdout)
    back = _mpsd("convert-config", tmp_path / "n" / "config.pbtxt", "--to", "yaml")
    assert back.returncode == 0, back.stderr
    assert not back.stderr.strip(), back.stderr  # nothing ignored
    expected = ModelConfig.model_validate(original).shape_buckets
    assert ModelConfig.model_validate(yaml.safe_load(back.stdout)).shape_buckets == expected
