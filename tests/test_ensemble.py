"""Ensembles through the real daemon with the stock tritonclient: a Triton config.pbtxt ensemble of three
models (python, TorchScript, python) answers what the three models answer called one after the other;
independent branches run at the same time (the models log when they run); ensemble requests batch in a
step model with its other traffic; a step model that loads on demand is loaded by the ensemble's request;
a failing step is named; ModelStreamInfer through an ensemble whose last step is a decoupled model streams
that model's responses, each carrying the outputs the earlier steps made (docs/configuration.md,
ensembles); and a step that refuses its input fails the client's request with the step's own status,
INVALID_ARGUMENT, over gRPC and HTTP. In one process: the steps' order, wiring and cancellation are
test_ensemble_steps.py's; a failing step's status and the other steps' cancellation,
test_ensemble_failures.py's."""

from __future__ import annotations

import concurrent.futures
import json
import queue
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from mpsd.config.model_file import validate_model_config
from tests import models
from tests.conftest import RunningDaemon, wait_for

F4 = {"data_type": "TYPE_FP32", "dims": [4]}

PIPELINE = """
name: "pipeline"
platform: "ensemble"
max_batch_size: 8
input [ { name: "RAW", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "TOTAL", data_type: TYPE_FP32, dims: [ 1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "pre", model_version: -1,
      input_map { key: "x" value: "RAW" }, output_map { key: "y" value: "scaled" } },
    { model_name: "net", model_version: 1,
      input_map { key: "x" value: "scaled" }, output_map { key: "y" value: "shifted" } },
    { model_name: "post",
      input_map { key: "x" value: "shifted" }, output_map { key: "total" value: "TOTAL" } }
  ]
}
"""
# Two branches from one input, joined by a third step: each branch's model logs when it runs.
BRANCHES = {
    "backend": "ensemble",
    "max_batch_size": 0,
    "input": [{"name": "X", **F4}],
    "output": [{"name": "JOINED", **F4}],
    "ensemble_scheduling": {
        "step": [
            {"model_name": "slow_a", "input_map": {"x": "X"}, "output_map": {"y": "a"}},
            {"model_name": "slow_b", "input_map": {"x": "X"}, "output_map": {"y": "b"}},
            {"model_name": "join", "input_map": {"a": "a", "b": "b"}, "output_map": {"y": "JOINED"}},
        ]
    },
}
SLOW = """
start = time.time()
with open(self.config['parameters']['log'] + '.started', 'a') as started:
    started.write(self.config['name'] + '\\n')
time.sleep(0.4)
release = self.config['parameters']['log'] + '.release'
while inputs['x'].sum() >= 100 and not os.path.exists(release) and time.time() < start + 60:
    time.sleep(0.02)  # a call held until the test releases it
with open(self.config['parameters']['log'], 'a') as log:
    log.write(json.dumps([self.config['name'], start, time.time()]) + '\\n')
return {'y': inputs['x'] * float(self.config['parameters']['factor'])}
"""


def _python(
    repo: Path, name: str, body: str, batch: int, inputs: list[str], outputs: dict[str, Any], **extra: Any
) -> None:
    models.python_model(
        repo,
        name,
        "import json\n" + body,
        config={
            "backend": "python",
            "max_batch_size": batch,
            "input": [{"name": n, **F4} for n in inputs],
            "output": [{"name": n, **spec} for n, spec in outputs.items()],
            **extra,
        },
    )


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("ensemble")
    repo = tmp / "repo"
    log = tmp / "runs.log"
    _python(repo, "pre", "return {'y': inputs['x'] * 2}", 8, ["x"], {"y": F4})
    model_dir = repo / "net"
    models.write_config(
        model_dir,
        {
            "backend": "torchscript",
            "max_batch_size": 8,
            "dynamic_batching": {"max_queue_delay_microseconds": 100_000},
            "input": [{"name": "x", **F4}],
            "output": [{"name": "y", **F4}],
        },
    )
    models.save_torchscript(models.Constant(1.0), model_dir / "1" / "model.pt")
    _python(
        repo,
        "post",
        "return {'total': inputs['x'].sum(dim=1, keepdim=True)}",
        8,
        ["x"],
        {"total": {"data_type": "TYPE_FP32", "dims": [1]}},
        residency={"load": "on_demand"},
    )
    (repo / "pipeline" / "1").mkdir(parents=True)
    (repo / "pipeline" / "config.pbtxt").write_text(PIPELINE)
    for name, factor in (("slow_a", 2), ("slow_b", 3)):
        _python(repo, name, SLOW, 0, ["x"], {"y": F4}, parameters={"log": str(log), "factor": factor})
    _python(repo, "join", "return {'y': inputs['a'] + inputs['b']}", 0, ["a", "b"], {"y": F4})
    models.write_config(repo / "branches", BRANCHES)
    (repo / "branches" / "1").mkdir()
    failing = dict(
        BRANCHES,
        ensemble_scheduling={
            "step": [{"model_name": "boom", "input_map": {"x": "X"}, "output_map": {"y": "JOINED"}}]
        },
    )
    models.write_config(repo / "failing", failing)
    (repo / "failing" / "1").mkdir()
    boom = "if float(inputs['x'].sum()) > 0:\n    raise ValueError('the step model broke')\n"
    _python(repo, "boom", boom + "return {'y': inputs['x']}", 0, ["x"], {"y": F4})  # zeros pass warm-up
    _image_ensemble(repo)
    orphan = dict(  # its step's model is in no repository
        BRANCHES,
        ensemble_scheduling={
            "step": [{"model_name": "absent", "input_map": {"x": "X"}, "output_map": {"y": "JOINED"}}]
        },
    )
    models.write_config(repo / "orphan", orphan)
    (repo / "orphan" / "1").mkdir()
    _streamed_ensembles(repo)
    daemon = RunningDaemon(repo, tmp / "daemon.log")
    try:
        daemon.wait_models_settled(timeout=300)  # nine workers start
        index = daemon.client.get_model_repository_index(as_json=True)["models"]
        assert {m["name"]: m["state"] for m in index if m["name"] not in ("post", "orphan")} == dict.fromkeys(
            (
                *IMAGE_MODELS,
                "boom",
                "branches",
                "count",
                "double",
                "failing",
                "join",
                "net",
                "pipeline",
                "pre",
                "slow_a",
                "slow_b",
                "streamed",
                "strict",
            ),
            "READY",
        ), index
        yield daemon
    finally:
        daemon.stop()
        daemon.kill_group()


PARTS = 3  # the responses of `count`, the decoupled last step of `streamed`


def _streamed_ensembles(repo: Path) -> None:
    """`streamed`: a decoupled ensemble whose last step is a decoupled model; `strict`: an ensemble whose
    step's model refuses an input the ensemble takes."""
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


# Triton's ensemble_image_client: image files' bytes (BYTES [batch, 1]) in, an ensemble of a python
# preprocess (here: decoding binary PPM files with numpy) and a classifier, top classes with labels out.
IMAGE_MODELS = ("decode", "classify", "image_ensemble")
LABELS = ["red", "green", "blue"]
DECODE = """
images = []
for row in inputs['IMAGE'].reshape(-1):
    if not row:  # warm-up's empty strings
        images.append(np.zeros(3))
        continue
    header, pixels = row.split(b'\\n', 3)[:3], row.split(b'\\n', 3)[3]
    width, height = map(int, header[1].split())
    images.append(np.frombuffer(pixels, np.uint8).reshape(height, width, 3).mean(axis=(0, 1)) / 255)
return {'PIXELS': torch.tensor(np.stack(images), dtype=torch.float32)}
"""


def _ppm(rgb: tuple[int, int, int]) -> bytes:
    return b"P6\n2 2\n255\n" + bytes(rgb) * 4


def _image_ensemble(repo: Path) -> None:
    three = {"data_type": "TYPE_FP32", "dims": [3]}
    models.python_model(
        repo,
        "decode",
        "import numpy as np\n" + DECODE,
        config={
            "backend": "python",
            "max_batch_size": 4,
            "input": [{"name": "IMAGE", "data_type": "TYPE_STRING", "dims": [1]}],
            "output": [{"name": "PIXELS", **three}],
        },
    )
    classify = repo / "classify"
    models.write_config(
        classify,
        {
            "backend": "torchscript",
            "max_batch_size": 4,
            "input": [{"name": "x", **three}],
            "output": [{"name": "y", **three}],
        },
    )
    models.save_torchscript(models.Identity(), classify / "1" / "model.pt")
    ensemble = repo / "image_ensemble"
    models.write_config(
        ensemble,
        {
            "backend": "ensemble",
            "max_batch_size": 4,
            "input": [{"name": "INPUT", "data_type": "TYPE_STRING", "dims": [1]}],
            "output": [{"name": "SCORES", **three, "label_filename": "labels.txt"}],
            "ensemble_scheduling": {
                "step": [
                    {
                        "model_name": "decode",
                        "input_map": {"IMAGE": "INPUT"},
                        "output_map": {"PIXELS": "pixels"},
                    },
                    {"model_name": "classify", "input_map": {"x": "pixels"}, "output_map": {"y": "SCORES"}},
                ]
            },
        },
    )
    (ensemble / "1").mkdir()
    (ensemble / "labels.txt").write_text("\n".join(LABELS) + "\n")


def test_ensemble_image_client_flow(daemon: RunningDaemon) -> None:
    """The steps of Triton's ensemble_image_client: files' bytes as BYTES [batch, 1], the top classes of the
    ensemble's output with its labels."""
    files = np.array([[_ppm((250, 10, 0))], [_ppm((0, 20, 240))]], dtype=np.object_)
    for module, client in (
        (grpcclient, _client(daemon)),
        (httpclient, httpclient.InferenceServerClient(daemon.http_address)),
    ):
        image = module.InferInput("INPUT", list(files.shape), "BYTES")
        image.set_data_from_numpy(files)
        result = client.infer(
            "image_ensemble", [image], outputs=[module.InferRequestedOutput("SCORES", class_count=2)]
        )
        top = [[c.decode() if isinstance(c, bytes) else c for c in row] for row in result.as_numpy("SCORES")]
        assert top == [
            [f"{250 / 255:f}:0:red", f"{10 / 255:f}:1:green"],
            [f"{240 / 255:f}:2:blue", f"{20 / 255:f}:1:green"],
        ]


def _client(daemon: RunningDaemon) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(daemon.address)


def _infer(client: Any, module: Any, model: str, name: str, value: np.ndarray, output: str) -> np.ndarray:
    tensor = module.InferInput(name, list(value.shape), "FP32")
    tensor.set_data_from_numpy(value)
    return client.infer(model, [tensor]).as_numpy(output)  # type: ignore[no-any-return]


def test_triton_ensemble_answers_as_its_steps_called_one_after_the_other(daemon: RunningDaemon) -> None:
    raw = np.arange(12, dtype=np.float32).reshape(3, 4)
    for module, client in (
        (grpcclient, _client(daemon)),
        (httpclient, httpclient.InferenceServerClient(daemon.http_address)),
    ):
        chained = _infer(client, module, "pre", "x", raw, "y")
        chained = _infer(client, module, "net", "x", chained, "y")
        chained = _infer(client, module, "post", "x", chained, "total")
        got = _infer(client, module, "pipeline", "RAW", raw, "TOTAL")
        np.testing.assert_array_equal(got, chained)
        np.testing.assert_array_equal(got, (raw * 2 + 1).sum(axis=1, keepdims=True))


def test_ensemble_metadata_and_config(daemon: RunningDaemon) -> None:
    client = _client(daemon)
    meta = client.get_model_metadata("pipeline", as_json=True)
    assert meta["platform"] == "ensemble"
    assert [(i["name"], i["shape"]) for i in meta["inputs"]] == [("RAW", ["-1", "4"])]
    config = client.get_model_config("pipeline", as_json=True)["config"]
    steps = config["ensemble_scheduling"]["step"]
    assert [s["model_name"] for s in steps] == ["pre", "net", "post"]
    assert steps[1]["input_map"] == {"x": "scaled"} and steps[1]["model_version"] == "1"
    assert "instance_group" not in config or not config["instance_group"]
    assert client.is_model_ready("pipeline")


def test_independent_branches_run_at_the_same_time(daemon: RunningDaemon) -> None:
    x = np.ones((4,), dtype=np.float32)
    got = _infer(_client(daemon), grpcclient, "branches", "X", x, "JOINED")
    np.testing.assert_array_equal(got, x * 2 + x * 3)
    runs = [json.loads(line) for line in (Path(daemon.repo).parent / "runs.log").read_text().splitlines()]
    (a_start, a_end), (b_start, b_end) = ([r[1], r[2]] for r in sorted(runs[-2:]))
    assert a_start < b_end and b_start < a_end, runs  # the two runs overlap in time


def test_a_reload_of_a_step_model_does_not_drop_an_ensemble_request_in_flight(daemon: RunningDaemon) -> None:
    """The request is in slow_a (held there until released) when slow_a is reloaded with a new file: the
    reload completes, the new version serves, and the old one still finishes the request."""
    client = _client(daemon)
    started = Path(daemon.repo).parent / "runs.log.started"
    before = started.read_text().count("slow_a")
    x = np.full((4,), 100.0, dtype=np.float32)  # slow_a holds it until released
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            _infer, grpcclient.InferenceServerClient(daemon.address), grpcclient, "branches", "X", x, "JOINED"
        )
        wait_for(lambda: started.read_text().count("slow_a") > before, 30, "slow_a running the request")
        model_file = Path(daemon.repo) / "slow_a" / "1" / "model.py"
        model_file.write_text(model_file.read_text() + "\n# a new version of the file\n")
        readies = daemon.log().count('"model": "slow_a", "versions": [1], "event": "model ready"')
        client.load_model("slow_a")  # returns once the new version serves
        assert not answer.done()
        (Path(daemon.repo).parent / "runs.log.release").touch()
        np.testing.assert_array_equal(answer.result(timeout=60), x * 2 + x * 3)
    assert daemon.log().count('"model": "slow_a", "versions": [1], "event": "model ready"') == readies + 1


def test_ensemble_requests_batch_in_a_step_model_with_its_other_traffic(daemon: RunningDaemon) -> None:
    client = _client(daemon)
    raw = np.ones((1, 4), dtype=np.float32)
    before = client.get_inference_statistics("net", as_json=True)["model_stats"][0]

    def one(i: int) -> np.ndarray:
        fresh = grpcclient.InferenceServerClient(daemon.address)
        if i % 2:
            return _infer(fresh, grpcclient, "net", "x", raw * 4, "y")  # the step model's own traffic
        return _infer(fresh, grpcclient, "pipeline", "RAW", raw * i, "TOTAL")

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    for i, got in enumerate(results):
        expected = raw * 4 + 1 if i % 2 else (raw * i * 2 + 1).sum(axis=1, keepdims=True)
        np.testing.assert_array_equal(got, expected)
    after = client.get_inference_statistics("net", as_json=True)["model_stats"][0]
    inferences = int(after["inference_count"]) - int(before.get("inference_count", 0))
    executions = int(after["execution_count"]) - int(before.get("execution_count", 0))
    assert inferences == 8 and executions < 8, (inferences, executions)


def test_a_failing_step_fails_the_request_with_the_step_named(daemon: RunningDaemon) -> None:
    with pytest.raises(InferenceServerException) as info:
        _infer(_client(daemon), grpcclient, "failing", "X", np.ones(4, dtype=np.float32), "JOINED")
    message = info.value.message()
    assert message.startswith("ensemble 'failing' step 0 (model 'boom'): "), message
    assert "the step model broke" in message


def test_an_ensemble_whose_step_model_is_missing_says_so_everywhere(daemon: RunningDaemon) -> None:
    """The index (gRPC and HTTP), `mpsd models` and a refused request give one reason; the log never calls
    the ensemble ready."""
    reason = "step model(s) 'absent' not available"
    with pytest.raises(InferenceServerException) as info:
        _infer(_client(daemon), grpcclient, "orphan", "X", np.ones(4, dtype=np.float32), "JOINED")
    assert info.value.message().endswith(reason), info.value.message()
    over_grpc = _client(daemon).get_model_repository_index(as_json=True)["models"]
    over_http = httpclient.InferenceServerClient(daemon.http_address).get_model_repository_index()
    for rows in (over_grpc, over_http):
        (row,) = [m for m in rows if m["name"] == "orphan"]
        assert (row["state"], row["reason"]) == ("UNAVAILABLE", reason), row
    listing = subprocess.run(
        [sys.executable, "-m", "mpsd", "models", "--address", daemon.address, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    (row,) = [m for m in json.loads(listing.stdout) if m["name"] == "orphan"]
    assert (row["state"], row["reason"]) == ("UNAVAILABLE", reason), row
    said = [json.loads(line) for line in daemon.log().splitlines() if '"model": "orphan"' in line]
    assert {e["event"] for e in said} >= {"model version loaded, not ready", "model loaded, not ready"}, said
    assert not [e for e in said if e["event"] in ("model version ready", "model ready")], said
    assert all(e["reason"] == reason for e in said if "not ready" in e["event"]), said


def test_a_step_model_that_loads_on_demand_is_loaded_by_the_ensemble(daemon: RunningDaemon) -> None:
    """`post` loads on demand: the pipeline's first request (above or here) loaded it."""
    client = _client(daemon)
    _infer(client, grpcclient, "pipeline", "RAW", np.ones((1, 4), dtype=np.float32), "TOTAL")
    index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    assert index["post"]["state"] == "READY"


def test_ensemble_graphs_that_cannot_run_are_refused_naming_the_problem(tmp_path: Path) -> None:
    def refused(steps: list[dict[str, Any]], outputs: tuple[str, ...] = ("Y",)) -> str:
        config = {
            "backend": "ensemble",
            "input": [{"name": "X", **F4}],
            "output": [{"name": o, **F4} for o in outputs],
            "ensemble_scheduling": {"step": steps},
        }
        with pytest.raises(ValueError) as info:
            validate_model_config(tmp_path / "config.yaml", config)
        return str(info.value)

    step = {"model_name": "m", "input_map": {"x": "X"}, "output_map": {"y": "Y"}}
    assert "ensemble tensor 'Y' is made twice" in refused([step, step])
    assert "reads ensemble tensor 'nope', which no input or step makes" in refused(
        [{**step, "input_map": {"x": "nope"}}]
    )
    assert "ensemble output 'Z' is not made by any step" in refused([step], ("Y", "Z"))
    cycle = [
        {"model_name": "a", "input_map": {"x": "q"}, "output_map": {"y": "p"}},
        {"model_name": "b", "input_map": {"x": "p"}, "output_map": {"y": "q"}},
        {"model_name": "c", "input_map": {"x": "q"}, "output_map": {"y": "Y"}},
    ]
    assert "the steps form a cycle" in refused(cycle)
    batching = {
        "backend": "ensemble",
        "max_batch_size": 4,
        "dynamic_batching": {},
        "input": [{"name": "X", **F4}],
        "output": [{"name": "Y", **F4}],
        "ensemble_scheduling": {"step": [step]},
    }
    with pytest.raises(ValueError) as info:
        validate_model_config(tmp_path / "c.yaml", batching)
    assert "dynamic_batching is for models that run in workers" in str(info.value)


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
