"""docs/configuration.md's repository rules against one real daemon: ignored names, a config's name, the
version policies, what a `python` model receives, optional inputs, and the worker start timeout."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import RunningDaemon, wait_for

# A python model that answers with its version and its `offset` parameter, after checking what it was given.
VERSIONED = """
import torch


class Model:
    def __init__(self, config, device):
        assert isinstance(device, torch.device), device
        for key in ("name", "version", "backend", "model_path", "max_batch_size", "inputs", "outputs"):
            assert key in config, key
        assert config["backend"] == "python" and config["model_path"].endswith("model.py")
        assert isinstance(config["parameters"]["offset"], str), config["parameters"]  # written as a number
        self.answer = 10 * int(config["version"]) + float(config["parameters"]["offset"])

    def infer(self, inputs):
        return {"y": torch.full_like(inputs["x"], self.answer)}
"""


def versioned(repo: Path, name: str, versions: list[int], policy: dict[str, object]) -> None:
    models.write_config(
        repo / name,
        {
            "backend": "python",
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [-1]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [-1]}],
            "version_policy": policy,
            "parameters": {"offset": 5},
        },
    )
    for v in versions:
        (repo / name / str(v)).mkdir(parents=True)
        (repo / name / str(v) / "model.py").write_text(VERSIONED)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    repo = tmp_path_factory.mktemp("repo")
    versioned(repo, "all_versions", [1, 2, 3], {"all": {}})
    versioned(repo, "specific", [1, 2, 3], {"specific": {"versions": [1, 3]}})
    versioned(repo, "latest_two", [1, 2, 3], {"latest": {"num_versions": 2}})
    versioned(repo, "no_match", [1], {"specific": {"versions": [5]}})
    models.python_model(repo, "named_wrong", "return {'y': inputs['x']}")
    models.write_config(
        repo / "named_wrong",
        {**yaml.safe_load((repo / "named_wrong" / "config.yaml").read_text()), "name": "other"},
    )
    models.python_model(
        repo,
        "optional_in",
        "return {'y': inputs['x']}",
        config={
            "backend": "python",
            "input": [
                {"name": "x", "data_type": "TYPE_FP32", "dims": [-1]},
                {"name": "z", "data_type": "TYPE_FP32", "dims": [-1], "optional": True},
            ],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [-1]}],
        },
    )
    for hidden in (".staging", "copy.tmp", "upload.part", "backup~"):  # valid models under ignored names
        models.python_model(repo, hidden, "return {'y': inputs['x']}")
    daemon = RunningDaemon(repo, tmp_path_factory.mktemp("log") / "daemon.log")
    try:
        daemon.wait_models_settled()
        yield daemon
    finally:
        daemon.stop()
        daemon.kill_group()


def index(daemon: RunningDaemon) -> dict[tuple[str, str], dict[str, str]]:
    rows = daemon.client.get_model_repository_index(as_json=True)["models"]
    return {(r["name"], r.get("version", "")): r for r in rows}


def answer(daemon: RunningDaemon, model: str, version: str = "") -> float:
    x = grpcclient.InferInput("x", [2], "FP32")
    x.set_data_from_numpy(np.zeros(2, np.float32))
    return float(daemon.client.infer(model, [x], model_version=version).as_numpy("y")[0])


def test_ignored_names_are_never_models(daemon: RunningDaemon) -> None:
    names = {name for name, _ in index(daemon)}
    assert names == {"all_versions", "specific", "latest_two", "no_match", "named_wrong", "optional_in"}


def test_a_config_name_must_equal_the_folder_name(daemon: RunningDaemon) -> None:
    row = index(daemon)[("named_wrong", "")]
    assert row["state"] == "UNAVAILABLE"
    assert "'other' does not match the model directory 'named_wrong'" in row["reason"]


def test_version_policies_pick_the_versions_and_a_request_without_one_gets_the_highest(
    daemon: RunningDaemon,
) -> None:
    rows = index(daemon)
    served = {
        model: sorted(v for (name, v), r in rows.items() if name == model and r["state"] == "READY")
        for model in ("all_versions", "specific", "latest_two")
    }
    assert served == {"all_versions": ["1", "2", "3"], "specific": ["1", "3"], "latest_two": ["2", "3"]}
    for model in served:
        assert answer(daemon, model) == 35.0  # version 3, and the parameter as the model received it
    assert answer(daemon, "all_versions", "1") == 15.0
    assert daemon.client.get_model_metadata("all_versions", as_json=True)["platform"] == "python"
    assert answer(daemon, "all_versions", "2") == 25.0
    with pytest.raises(InferenceServerException) as err:
        answer(daemon, "specific", "2")
    assert err.value.status() in ("StatusCode.NOT_FOUND", "StatusCode.UNAVAILABLE")


def test_a_policy_that_selects_no_version_present_is_unavailable(daemon: RunningDaemon) -> None:
    row = index(daemon)[("no_match", "")]
    assert row["state"] == "UNAVAILABLE"
    assert "no version directory matches the version policy" in row["reason"]


def test_omitting_an_optional_input_is_unimplemented(daemon: RunningDaemon) -> None:
    x = grpcclient.InferInput("x", [2], "FP32")
    x.set_data_from_numpy(np.ones(2, np.float32))
    with pytest.raises(InferenceServerException) as err:
        daemon.client.infer("optional_in", [x])
    assert err.value.status() == "StatusCode.UNIMPLEMENTED"
    z = grpcclient.InferInput("z", [2], "FP32")
    z.set_data_from_numpy(np.ones(2, np.float32))
    np.testing.assert_array_equal(daemon.client.infer("optional_in", [x, z]).as_numpy("y"), np.ones(2))


SLOW = """
import time


class Model:
    def __init__(self, config, device):
        time.sleep(600)

    def infer(self, inputs):
        return {"y": inputs["x"]}
"""


def test_a_worker_slower_than_worker_start_timeout_s_fails_the_load(start_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    repo = tmp_path / "repo"
    models.python_model(repo, "slow", "return {'y': inputs['x']}")
    (repo / "slow" / "1" / "model.py").write_text(SLOW)
    config = tmp_path / "mpsd.yaml"
    config.write_text("worker_start_timeout_s: 8\nmetrics_address: off\n")
    started = time.monotonic()
    daemon = start_daemon(repo, config=config)
    daemon.wait_models_settled(timeout=90)
    assert time.monotonic() - started < 45  # the 8 s limit, not the model's 600 s
    row = index(daemon)[("slow", "")]
    assert row["state"] == "UNAVAILABLE"
    assert "worker did not become ready within 8 s" in row["reason"]
    wait_for(lambda: not daemon.worker_pids(), 30, "the slow worker stopped")


DIES = """
import os


class Model:
    def __init__(self, config, device):
        os._exit(3)

    def infer(self, inputs):
        return {"y": inputs["x"]}
"""


def test_a_worker_that_dies_while_loading_fails_the_load_with_its_exit(start_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    repo = tmp_path / "repo"
    models.python_model(repo, "dies", "return {'y': inputs['x']}")
    (repo / "dies" / "1" / "model.py").write_text(DIES)
    config = tmp_path / "mpsd.yaml"
    config.write_text("metrics_address: off\n")
    daemon = start_daemon(repo, config=config)
    daemon.wait_models_settled(timeout=90)
    row = index(daemon)[("dies", "")]
    assert row["state"] == "UNAVAILABLE"
    assert "worker exit code 3 while loading" in row["reason"], row
