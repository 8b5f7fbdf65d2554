"""RepositoryModelLoad with Triton's `config` and `file:<path>` parameters (docs/api.md, "Loading with a
config or files"), through the stock clients' `load_model(name, config=..., files=...)` against one real
daemon: the override serves until a plain load or a repository change, sent files load from the daemon's
own folder and go with their model, the repository is never written, and what cannot be loaded as given is
refused with Triton's answers before anything changes."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import RunningDaemon, http_request, serving

ADMIN_TOKEN = "admin-token-for-loads"
USER_TOKEN = "user-token-inference-only"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
HTTP_ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MAX_UPLOAD = 1 << 20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    base = tmp_path_factory.mktemp("override")
    repo = base / "repo"
    model_dir = repo / "const"
    models.write_config(
        model_dir,
        {
            "backend": "torchscript",
            "max_batch_size": 0,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [2]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [2]}],
            "instance_group": [{"kind": "KIND_CPU", "count": 1}],
        },
    )
    models.save_torchscript(models.Constant(1.0), model_dir / "1" / "model.pt")
    models.save_torchscript(models.Constant(10.0), model_dir / "1" / "alt.pt")  # only an override names it
    (base / "uploads").mkdir()
    for name, token in (("admin.token", ADMIN_TOKEN), ("user.token", USER_TOKEN)):
        (base / name).write_text(token)
        (base / name).chmod(0o600)
    config = base / "mpsd.yaml"
    settings = {
        "metrics_address": "",
        "model_control": "explicit",
        "reload_quiet_period_s": 0,  # a reload acts on files just written
        "model_upload_dir": str(base / "uploads"),
        "max_model_upload_bytes": MAX_UPLOAD,
        "auth": {
            "tokens": [
                {"token_file": "admin.token", "categories": ["model-repository"]},
                {"token_file": "user.token", "categories": ["inference"]},
            ],
            "open_categories": ["inference", "health", "logs-statistics"],
        },
    }
    config.write_text(yaml.safe_dump(settings))
    with serving(repo, base / "daemon.log", config=config) as d:
        yield d


def uploads(daemon: RunningDaemon) -> Path:
    return daemon.repo.parent / "uploads"


def upload_folders(daemon: RunningDaemon) -> list[Path]:
    """The folders of the loads' files in the daemon's own upload folder (one per model loaded with files)."""
    return sorted(p for root in uploads(daemon).glob("mpsd-models-*") for p in root.iterdir())


def tree_hash(root: Path) -> str:
    """Every file under `root`, by path and contents."""
    digest = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            digest.update(f"{p.relative_to(root)}\0".encode() + p.read_bytes())
    return digest.hexdigest()


def torchscript_bytes(value: float) -> bytes:
    out = io.BytesIO()
    torch.jit.save(torch.jit.script(models.Constant(value)), out)
    return out.getvalue()


def triton_config(max_batch_size: int, filename: str | None = None, **extra: Any) -> str:
    """A ModelConfig in Triton's JSON form (model_config.proto's field names, enum names as strings)."""
    config: dict[str, Any] = {
        "platform": "pytorch_libtorch",
        "max_batch_size": max_batch_size,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [2]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [2]}],
        "instance_group": [{"kind": "KIND_CPU", "count": 1}],
        **extra,
    }
    if filename is not None:
        config["default_model_filename"] = filename
    return json.dumps(config)


def served(daemon: RunningDaemon, model: str = "const") -> float:
    """What the model adds to its input, asked the way its current config wants (a batch of one or not)."""
    batched = daemon.client.get_model_config(model).config.max_batch_size > 0
    shape = [1, 2] if batched else [2]
    inp = grpcclient.InferInput("x", shape, "FP32")
    inp.set_data_from_numpy(np.zeros(shape, np.float32))
    return float(daemon.client.infer(model, [inp]).as_numpy("y").reshape(-1)[0])


def refusal(call: Any) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as err:
        call()
    return str(err.value.status()), str(err.value.message())


def test_a_config_override_serves_until_a_load_without_one(daemon: RunningDaemon) -> None:
    client = daemon.client
    before = tree_hash(daemon.repo)
    client.load_model("const", config=triton_config(4, "alt.pt"), headers=ADMIN)
    config = client.get_model_config("const").config
    assert (config.max_batch_size, config.default_model_filename) == (4, "alt.pt")
    assert served(daemon) == 10.0  # alt.pt, in a batch
    assert tree_hash(daemon.repo) == before  # the repository's files are read, never written

    client.load_model("const", headers=ADMIN)  # as Triton: a load without the override undoes it
    assert client.get_model_config("const").config.max_batch_size == 0
    assert served(daemon) == 1.0
    assert tree_hash(daemon.repo) == before


def test_a_partial_override_is_completed_from_the_repository_config(daemon: RunningDaemon) -> None:
    """Triton's model-control example sends `{"max_batch_size": "16"}` alone; the fields it leaves out keep
    the repository config's values (Triton completes them from the model)."""
    client = daemon.client
    repository = client.get_model_config("const").config
    adds = served(daemon)
    try:
        client.load_model("const", config='{"max_batch_size": "16"}', headers=ADMIN)
        config = client.get_model_config("const").config
        assert config.max_batch_size == 16
        assert [(i.name, list(i.dims)) for i in config.input] == [
            (i.name, list(i.dims)) for i in repository.input
        ]
        assert served(daemon) == adds  # the same model, asked with a batch dimension now
    finally:
        client.load_model("const", headers=ADMIN)
    assert client.get_model_config("const").config.max_batch_size == repository.max_batch_size


def test_a_change_in_the_repository_ends_the_override(daemon: RunningDaemon, tmp_path: Path) -> None:
    token = tmp_path / "admin.token"
    token.write_text(ADMIN_TOKEN)
    reload = [sys.executable, "-m", "mpsd", "reload", "--address", daemon.address, "--token-file", str(token)]
    daemon.client.load_model("const", config=triton_config(4, "alt.pt"), headers=ADMIN)
    assert subprocess.run(reload, capture_output=True, text=True, check=True).returncode == 0
    assert served(daemon) == 10.0  # the repository did not change: the override stays

    staging = daemon.repo / ".staging"
    models.save_torchscript(models.Constant(2.0), staging / "model.pt")
    (staging / "model.pt").replace(daemon.repo / "const" / "1" / "model.pt")
    staging.rmdir()
    assert subprocess.run(reload, capture_output=True, text=True, check=True).returncode == 0
    assert daemon.client.get_model_config("const").config.max_batch_size == 0
    assert served(daemon) == 2.0  # the repository's config and files, as changed


def test_files_sent_by_the_client_load_and_go_with_their_model(daemon: RunningDaemon) -> None:
    client = daemon.client
    before = tree_hash(daemon.repo)
    files = {"file:1/model.pt": torchscript_bytes(5.0)}
    client.load_model("sent", config=triton_config(0), files=files, headers=ADMIN)
    assert served(daemon, "sent") == 5.0
    assert not (daemon.repo / "sent").exists() and tree_hash(daemon.repo) == before
    (first,) = upload_folders(daemon)
    assert (first / "sent" / "1" / "model.pt").read_bytes() == files["file:1/model.pt"]

    client.load_model(
        "sent", config=triton_config(0), files={"file:1/model.pt": torchscript_bytes(7.0)}, headers=ADMIN
    )
    assert served(daemon, "sent") == 7.0
    assert first not in upload_folders(daemon) and len(upload_folders(daemon)) == 1  # replaced: the old go

    http = httpclient.InferenceServerClient(daemon.http_address, network_timeout=60)
    try:  # the stock HTTP client sends the files in base64
        files = {"file:1/model.pt": torchscript_bytes(3.0)}
        http.load_model("sent", config=triton_config(0), files=files, headers=HTTP_ADMIN)
        inp = httpclient.InferInput("x", [2], "FP32")
        inp.set_data_from_numpy(np.zeros(2, np.float32))
        assert http.infer("sent", [inp]).as_numpy("y").tolist() == [3.0, 3.0]
    finally:
        http.close()

    client.unload_model("sent", headers=ADMIN)
    assert upload_folders(daemon) == []
    assert tree_hash(daemon.repo) == before


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("file:../escape.pt", "must stay within model directory"),
        ("file:1/../../escape.pt", "must stay within model directory"),
        ("file:/tmp/escape.pt", "must stay within model directory"),
        ("file:1//model.pt", "empty component"),
        ("file:" + "A" * 256, "longer than 255 bytes"),
        ("file:config.pbtxt", "the model's config is the 'config' parameter"),
        ("file:" + "/".join(["d"] * 17), "more than 16 levels deep"),
    ],
)
def test_paths_that_leave_the_model_directory_are_refused(daemon: RunningDaemon, key: str, why: str) -> None:
    files = {"file:1/model.pt": torchscript_bytes(1.0), key: b"x"}
    status, message = refusal(
        lambda: daemon.client.load_model("stray", config=triton_config(0), files=files, headers=ADMIN)
    )
    assert status == "StatusCode.INTERNAL", message  # Triton's answer to a load it could not read
    assert message.startswith("failed to load 'stray', failed to poll from model repository: ")
    assert f"Invalid file parameter '{key[:60]}" in message and why in message
    assert not daemon.client.is_model_ready("stray")
    assert upload_folders(daemon) == []  # nothing was written
    assert not list(uploads(daemon).rglob("escape.pt")) and not Path("/tmp/escape.pt").exists()


def test_files_over_the_limit_are_refused(daemon: RunningDaemon) -> None:
    files = {"file:1/model.pt": torchscript_bytes(1.0), "file:1/padding.bin": bytes(MAX_UPLOAD)}
    status, message = refusal(
        lambda: daemon.client.load_model("big", config=triton_config(0), files=files, headers=ADMIN)
    )
    assert status == "StatusCode.INTERNAL", message
    assert message == (
        "failed to load 'big', failed to poll from model repository: "
        f"the files add up to {MAX_UPLOAD + len(files['file:1/model.pt'])} bytes, "
        f"more than max_model_upload_bytes ({MAX_UPLOAD})"
    )
    assert upload_folders(daemon) == [] and not daemon.client.is_model_ready("big")


def test_what_cannot_be_loaded_as_given_is_refused_with_tritons_answers(daemon: RunningDaemon) -> None:
    client = daemon.client
    client.load_model("const", headers=ADMIN)
    serving_before = served(daemon)
    prefix = "failed to load 'const', failed to poll from model repository: "

    # the malformed config of Triton's own model-control example
    bad_json = '"parameters": {"config": {{"max_batch_size": "16"}}}'
    status, message = refusal(lambda: client.load_model("const", config=bad_json, headers=ADMIN))
    assert status == "StatusCode.INTERNAL"  # Triton's code, its message, and the reason it only logs
    assert message.startswith(prefix + "Invalid config override: invalid JSON: ")
    # validated as a repository config is, naming the field (with files, nothing completes it)
    status, message = refusal(
        lambda: client.load_model(
            "const", config='{"max_batch_size": 4}', files={"file:1/model.pt": b"x"}, headers=ADMIN
        )
    )
    assert message == prefix + (
        "Invalid config override: field 'input': required field is missing; "
        "field 'output': required field is missing"
    )
    status, message = refusal(
        lambda: client.load_model("const", config=triton_config(0, name="other"), headers=ADMIN)
    )
    assert (
        message == prefix + "Invalid config override: field 'name': 'other' is not the model loaded, 'const'"
    )
    status, message = refusal(
        lambda: client.load_model(
            "const", config=triton_config(0, sequence_batching={"iterative_sequence": True}), headers=ADMIN
        )
    )
    assert message.endswith(
        "field 'sequence_batching.iterative_sequence': iterative sequences (a request rescheduled by its "
        "model) are not supported by mpsd"
    )
    # files need a config, as in Triton
    status, message = refusal(
        lambda: client.load_model("const", files={"file:1/model.pt": b"x"}, headers=ADMIN)
    )
    assert (status, message) == (
        "StatusCode.INTERNAL",
        prefix + "Load parameter 'config' must be specified for model file override",
    )
    # files that do not make the model the config describes, said with the parameters' paths
    files = {"file:1/other.pt": torchscript_bytes(1.0)}
    status, message = refusal(
        lambda: client.load_model("const", config=triton_config(0), files=files, headers=ADMIN)
    )
    assert (status, message) == ("StatusCode.INTERNAL", prefix + "file:1/model.pt: model file is missing")
    assert upload_folders(daemon) == []  # the refused load's files are gone at once
    # a parameter that is neither, and a config of the wrong type: Triton's gRPC server's messages
    status, message = refusal(lambda: client.load_model("const", files={"model.pt": b"x"}, headers=ADMIN))
    assert (status, message) == ("StatusCode.INVALID_ARGUMENT", "unrecognized load parameter 'model.pt'.")
    request = service_pb2.RepositoryModelLoadRequest(model_name="const")
    request.parameters["config"].bytes_param = b"{}"
    with pytest.raises(grpc.RpcError) as rpc_error:
        client._client_stub.RepositoryModelLoad(request, metadata=tuple(ADMIN.items()))
    assert rpc_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        rpc_error.value.details() == "invalid value type for load parameter 'config', expected string_param."
    )

    # HTTP: the same answers, and base64 that does not decode
    body = json.dumps({"parameters": {"config": bad_json}}).encode()
    status_code, reply, _ = http_request(
        daemon.http_address, "POST", "/v2/repository/models/const/load", body, HTTP_ADMIN
    )
    assert status_code == 500 and reply["error"].startswith(prefix + "Invalid config override: invalid JSON")
    body = json.dumps({"parameters": {"config": triton_config(0), "file:1/model.pt": "QUJD!"}}).encode()
    status_code, reply, _ = http_request(
        daemon.http_address, "POST", "/v2/repository/models/const/load", body, HTTP_ADMIN
    )
    assert status_code == 400 and reply["error"].startswith(
        "load parameter 'file:1/model.pt' is not valid base64"
    )

    assert served(daemon) == serving_before  # nothing changed
    assert client.get_model_config("const").config.max_batch_size == 0


def test_a_load_with_a_config_needs_the_model_repository_category(daemon: RunningDaemon) -> None:
    config = triton_config(4, "alt.pt")
    user = {"authorization": f"Bearer {USER_TOKEN}"}
    status, message = refusal(lambda: daemon.client.load_model("const", config=config, headers=user))
    assert status == "StatusCode.PERMISSION_DENIED" and "model-repository" in message
    status, _ = refusal(lambda: daemon.client.load_model("const", config=config))
    assert status == "StatusCode.UNAUTHENTICATED"
    assert daemon.client.get_model_config("const").config.max_batch_size == 0


def test_shutdown_removes_the_uploaded_files(daemon: RunningDaemon) -> None:
    """Last: it stops the module's daemon."""
    daemon.client.load_model(
        "sent", config=triton_config(0), files={"file:1/model.pt": torchscript_bytes(4.0)}, headers=ADMIN
    )
    assert served(daemon, "sent") == 4.0
    assert upload_folders(daemon)
    assert daemon.stop() == 0
    assert list(uploads(daemon).iterdir()) == []
