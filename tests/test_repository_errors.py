"""A repository with one good model and several broken ones: the good one serves, each broken one is
UNAVAILABLE with a reason that names the file, the field and the problem."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from mpsd.config.model_file import parse_model_config
from mpsd.config.repository import load_model_source, scan_repository
from mpsd.errors import ModelConfigError
from tests import models
from tests.conftest import RunningDaemon, http_request

GOOD_BODY = "return {'y': inputs['x'] * 2}"


def _tensor(name: str, dims: list[int]) -> dict[str, object]:
    return {"name": name, "data_type": "TYPE_FP32", "dims": dims}


def _valid_config(**extra: object) -> dict[str, object]:
    return {
        "backend": "torchscript",
        "max_batch_size": 0,
        "input": [_tensor("IN", [4])],
        "output": [_tensor("OUT", [4])],
        **extra,
    }


# Broken model -> words its reason must contain (besides its own path).
BROKEN: dict[str, tuple[str, ...]] = {
    "bad_yaml": ("config.yaml", "invalid YAML at line 4, column 9"),
    "missing_file": ("1/model.pt", "model file is missing"),
    "wrong_dims": ("warm-up", "output 'OUT'", "[4]", "config dims [5]"),
    "unknown_key": ("config.yaml", "max_batchsize", "unknown field"),
    "name_mismatch": ("config.yaml", "'name'", "'other_name'", "does not match", "'name_mismatch'"),
    "binary_config": ("config.yaml", "not UTF-8"),
    "bad_filename": ("config.yaml", "'../model.pt' must be a plain file name inside the version directory"),
}


def build_repository(repo: Path) -> None:
    """One good model (`good`) and one broken model per entry of BROKEN."""
    models.python_model(repo, "good", GOOD_BODY)

    bad_yaml = repo / "bad_yaml"
    models.save_torchscript(models.Identity(), bad_yaml / "1" / "model.pt")
    (bad_yaml / "config.yaml").write_text("backend: torchscript\ninput:\n  - name: [IN\n    dims: [4]\n")

    models.write_config(repo / "missing_file", _valid_config())
    (repo / "missing_file" / "1").mkdir()

    # The config's output dims do not match what the model returns; only the warm-up can tell.
    wrong_dims = repo / "wrong_dims"
    models.write_config(wrong_dims, _valid_config(output=[_tensor("OUT", [5])]))
    models.save_torchscript(models.Identity(), wrong_dims / "1" / "model.pt")

    unknown_key = repo / "unknown_key"
    models.write_config(unknown_key, _valid_config(max_batchsize=4))
    models.save_torchscript(models.Identity(), unknown_key / "1" / "model.pt")

    name_mismatch = repo / "name_mismatch"
    models.write_config(name_mismatch, _valid_config(name="other_name"))
    models.save_torchscript(models.Identity(), name_mismatch / "1" / "model.pt")

    binary = repo / "binary_config"
    binary.mkdir()
    (binary / "config.yaml").write_bytes(b"\xff\xfe\x00\x01backend")
    models.save_torchscript(models.Identity(), binary / "1" / "model.pt")

    bad_filename = repo / "bad_filename"  # default_model_filename is a plain file name
    models.write_config(bad_filename, _valid_config(default_model_filename="../model.pt"))
    models.save_torchscript(models.Identity(), bad_filename / "1" / "model.pt")


# ---- without a daemon ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("repo")
    build_repository(path)
    return path


def test_load_model_source_good_model(repo: Path) -> None:
    source = load_model_source(repo / "good")
    assert source.ok, source.error
    assert source.versions == (1,)
    assert source.config is not None and source.config.backend == "python"


@pytest.mark.parametrize("name", sorted(set(BROKEN) - {"wrong_dims"}))
def test_load_model_source_reports_broken_model(repo: Path, name: str) -> None:
    source = load_model_source(repo / name)
    assert not source.ok
    assert source.config is None
    assert source.error is not None and str(repo / name) in source.error
    for word in BROKEN[name]:
        assert word in source.error, f"{word!r} not in {source.error!r}"


def test_wrong_dims_are_only_found_by_the_warm_up(repo: Path) -> None:
    source = load_model_source(repo / "wrong_dims")
    assert source.ok, source.error
    assert source.config is not None and source.config.output[0].dims == [5]


def test_scan_repository_returns_every_model(repo: Path) -> None:
    sources = scan_repository(repo)
    assert set(sources) == {"good", *BROKEN}
    assert {n for n, s in sources.items() if s.ok} == {"good", "wrong_dims"}


def test_parse_invalid_yaml_names_line_and_column() -> None:
    with pytest.raises(ValueError) as exc:
        parse_model_config(Path("m/config.yaml"), "input:\n  - name: [x\n", "m")
    message = str(exc.value)
    assert message.startswith("m/config.yaml: invalid YAML at line ")
    assert "column" in message


def _doc(in_type: str = "TYPE_FP32", in_dims: str = "[4]", extra: str = "") -> str:
    return (
        f"input: [{{name: IN, data_type: {in_type}, dims: {in_dims}}}]\n"
        "output: [{name: OUT, data_type: TYPE_FP32, dims: [4]}]\n" + extra
    )


@pytest.mark.parametrize(
    ("document", "words"),
    [
        (_doc(extra="max_batchsize: 4\n"), ("field 'max_batchsize'", "unknown field")),
        (
            "input: [{name: IN, data_type: TYPE_FP32, dims: [4]}]\n",
            ("field 'output'", "required field is missing"),
        ),
        (_doc(extra="name: other\n"), ("field 'name'", "'other'", "does not match", "'m'")),
        (_doc(in_dims="[0]"), ("field 'input.0.dims'", "dimension 0")),
        (_doc(in_type="TYPE_FP33"), ("field 'input.0.data_type'", "TYPE_FP32")),
        (_doc(in_type="TYPE_STRING"), ("field 'input.0.data_type'", "torch has no string tensors")),
        (_doc(extra="max_batch_size: -1\n"), ("field 'max_batch_size'", "greater than or equal to 0")),
        ("- 1\n- 2\n", ("expected a mapping", "list")),
        ("", ("file is empty",)),
        # docs/configuration.md's field rules
        (
            _doc(extra="version_policy: {latest: {num_versions: 1}, all: {}}\n"),
            ("field 'version_policy'", "choose one of latest, all, specific"),
        ),
        (
            "input: [{name: IN, data_type: TYPE_FP32, dims: [4]},\n"
            "        {name: IN, data_type: TYPE_FP32, dims: [4]}]\n"
            "output: [{name: OUT, data_type: TYPE_FP32, dims: [4]}]\n",
            ("input names must be unique", "IN"),
        ),
        (_doc().replace("name: OUT", "name: " + "x" * 257), ("field 'output.0.name'", "at most 256")),
        (_doc(extra="instance_group: [{kind: KIND_CPU, count: 65}]\n"), ("instance_group.0.count", "64")),
        (_doc(in_dims="[-2]"), ("field 'input.0.dims'", "dimension -2", "-1 for variable")),
    ],
    ids=[
        "unknown_key",
        "missing_field",
        "name_mismatch",
        "zero_dim",
        "bad_type",
        "string_type",
        "negative_batch",
        "list",
        "empty",
        "two_policies",
        "duplicate_names",
        "long_name",
        "count_over_64",
        "negative_dim",
    ],
)
def test_parse_model_config_messages(document: str, words: tuple[str, ...]) -> None:
    with pytest.raises(ValueError) as exc:
        parse_model_config(Path("m/config.yaml"), document, "m")
    message = str(exc.value)
    assert message.startswith("m/config.yaml: ")
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


@pytest.mark.parametrize(
    ("document", "loc", "problem"),
    [
        (_doc(extra="max_batchsize: 4\n"), ("max_batchsize",), "unknown field"),
        (_doc(in_dims="[0]"), ("input", 0, "dims"), "dimension 0 is not allowed"),
        (_doc(extra="name: other\n"), ("name",), "'other' does not match the model directory 'm'"),
        # rules across fields: pydantic places them at the top, the issue at the field the rule is about
        (_doc(extra="dynamic_batching: {}\n"), ("dynamic_batching",), "needs max_batch_size > 0"),
        ("input: []\noutput: [{name: OUT, data_type: TYPE_FP32, dims: [4]}]\n", ("input",), "at least one"),
        ("input:\n  - name: [x\n", (), "invalid YAML at line "),
        ("", (), "file is empty"),
    ],
    ids=["unknown_key", "zero_dim", "name_mismatch", "rule", "empty_list", "yaml", "empty"],
)
def test_parse_errors_carry_file_field_and_problem_as_data(
    document: str, loc: tuple[str | int, ...], problem: str
) -> None:
    """What `mpsd validate` reads instead of taking the message apart again."""
    with pytest.raises(ModelConfigError) as exc:
        parse_model_config(Path("m/config.yaml"), document, "m")
    [issue] = exc.value.issues
    assert (issue.file, issue.loc) == ("m/config.yaml", loc)
    assert problem in issue.problem and issue.problem in exc.value.message


def test_a_broken_model_source_carries_its_reason_as_data(repo: Path) -> None:
    for name in sorted(set(BROKEN) - {"wrong_dims"}):
        source = load_model_source(repo / name)
        assert source.issues, name
        for issue in source.issues:
            assert issue.file.startswith(str(repo / name)) and issue.problem in (source.error or "")


def test_a_symlink_out_of_the_repository_is_one_issue(tmp_path: Path) -> None:
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    models.write_config(repo / "m", _valid_config())
    models.save_torchscript(models.Identity(), outside / "model.pt")
    (repo / "m" / "1").mkdir()
    (repo / "m" / "1" / "model.pt").symlink_to(outside / "model.pt")
    source = load_model_source(repo / "m")
    [issue] = source.issues
    assert issue.file == str(repo / "m" / "1" / "model.pt") and issue.loc == ()
    assert issue.problem.endswith("; set allow_symlinks: true in the daemon config to allow it")
    assert source.error == str(issue)


def test_version_directories_must_be_plain_numbers(tmp_path: Path) -> None:
    model = tmp_path / "m"
    models.write_config(model, _valid_config())
    for odd in ("01", "\u00b2", "1a"):  # leading zero, superscript two, not a number
        (model / odd).mkdir()
        models.save_torchscript(models.Identity(), model / odd / "model.pt")
    source = load_model_source(model)
    assert not source.ok
    assert source.error is not None and "no version directory" in source.error
    models.save_torchscript(models.Identity(), model / "3" / "model.pt")
    source = load_model_source(model)
    assert source.ok, source.error
    assert source.versions == (3,)


# ---- with a daemon ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    d = RunningDaemon(repo, tmp_path_factory.mktemp("log") / "daemon.log")
    try:
        d.wait_models_settled()
        yield d
    finally:
        d.stop()
        d.kill_group()


def _x(value: np.ndarray) -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("x", list(value.shape), "FP32")
    inp.set_data_from_numpy(value)
    return [inp]


def test_good_model_serves_beside_broken_ones(daemon: RunningDaemon) -> None:
    assert daemon.client.is_model_ready("good")
    x = np.arange(5, dtype=np.float32)
    result = daemon.client.infer("good", _x(x))
    np.testing.assert_array_equal(result.as_numpy("y"), x * 2)


def test_server_is_not_ready_while_a_model_is_broken(daemon: RunningDaemon) -> None:
    assert daemon.client.is_server_live()
    assert not daemon.client.is_server_ready()
    for name in BROKEN:
        assert not daemon.client.is_model_ready(name), name


def test_repository_index_gives_state_and_reason(daemon: RunningDaemon) -> None:
    index = {m["name"]: m for m in daemon.client.get_model_repository_index(as_json=True)["models"]}
    assert set(index) == {"good", *BROKEN}
    assert index["good"]["state"] == "READY"
    for name, words in BROKEN.items():
        row = index[name]
        assert row["state"] == "UNAVAILABLE", row
        reason = row.get("reason", "")
        assert str(daemon.repo / name) in reason or name == "wrong_dims", reason
        for word in words:
            assert word in reason, f"{name}: {word!r} not in {reason!r}"
    # docs/api.md: `ready` lists the ready versions only, over gRPC, HTTP and `mpsd models --ready`
    with grpc.insecure_channel(daemon.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        ready = stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True), timeout=30).models
    assert [(m.name, m.state) for m in ready] == [("good", "READY")]
    status, body, _ = http_request(daemon.http_address, "POST", "/v2/repository/index", b'{"ready": true}')
    assert status == 200 and [m["name"] for m in body] == ["good"], body
    listed = subprocess.run(
        [sys.executable, "-m", "mpsd", "models", "--ready", "--address", daemon.address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0 and "good" in listed.stdout, listed.stderr
    assert not any(name in listed.stdout for name in BROKEN), listed.stdout


def test_broken_models_leave_no_worker_running(daemon: RunningDaemon) -> None:
    # Only the good model's worker; the one that failed its warm-up has exited.
    assert len(daemon.worker_pids()) == 1


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_inference_on_broken_model_is_unavailable_with_reason(daemon: RunningDaemon, name: str) -> None:
    with pytest.raises(InferenceServerException) as exc:
        daemon.client.infer(name, _x(np.zeros(4, np.float32)))
    assert exc.value.status() == "StatusCode.UNAVAILABLE", exc.value.message()
    message = exc.value.message()
    assert f"model '{name}' is not available" in message
    assert BROKEN[name][-1] in message


def test_inference_on_broken_model_is_refused(daemon: RunningDaemon) -> None:
    """Whatever the code, the request is refused and the message names the model."""
    for name in BROKEN:
        with pytest.raises(InferenceServerException) as exc:
            daemon.client.infer(name, _x(np.zeros(4, np.float32)))
        assert exc.value.status() in ("StatusCode.UNAVAILABLE", "StatusCode.NOT_FOUND")
        assert f"'{name}'" in exc.value.message()
