"""Custom ops (`op_libraries`): a model's config lists shared objects and Python modules that register ops,
and each worker loads them before the model.

Promises checked here:
- a TorchScript model that calls a C++ op (built for the test with torch.utils.cpp_extension) serves
  through the real daemon and the stock tritonclient when its library is listed;
- an exported program that calls an op a Python module registers with torch.library serves when that module
  is listed (found in the version folder first);
- the same TorchScript model without the library fails to load with a reason naming the op;
- a library outside the model's folder (`..`, a symlink) is refused as a config error, unless the daemon
  config lists its directory in `op_library_dirs`.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import yaml

from mpsd.config.daemon_config import load_daemon_config
from mpsd.config.repository import load_model_source
from tests import models
from tests.conftest import ROOT, RunningDaemon

OP_SOURCE = """
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/mul.h>
#include <torch/library.h>

at::Tensor affine(const at::Tensor& x, double scale, double shift) {
  return at::add(at::mul(x, scale), shift);
}

TORCH_LIBRARY(mpsd_test, m) {
  m.def("affine(Tensor x, float scale, float shift) -> Tensor", affine);
}
"""

PY_OPS = """
import torch


@torch.library.custom_op("mpsd_pyops::triple", mutates_args=())
def triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@triple.register_fake
def _(x):
    return torch.empty_like(x)
"""


@pytest.fixture(scope="session")
def op_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The C++ op, built once per test session (a few seconds: only the headers the op needs)."""
    if shutil.which("g++") is None or shutil.which("ninja") is None:
        pytest.skip("building a C++ op needs g++ and ninja")
    from torch.utils import cpp_extension

    build = tmp_path_factory.mktemp("op_build")
    source = build / "mpsd_test_ops.cpp"
    source.write_text(OP_SOURCE)
    # Loaded into this process too (is_python_module=False): the test scripts a model that calls it.
    built = cpp_extension.load(
        "mpsd_test_ops", [str(source)], build_directory=str(build), is_python_module=False
    )
    return Path(str(built))


class Affine(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mpsd_test.affine(x, 2.0, 1.0)


class Triple(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mpsd_pyops.triple(x) + 1


def _config(backend: str = "torchscript", **extra: object) -> dict[str, object]:
    return {
        "backend": backend,
        "max_batch_size": 0,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [4]}],
        **extra,
    }


def _affine_model(repo: Path, name: str, library: Path | None, op_libraries: list[str]) -> Path:
    model_dir = repo / name
    models.write_config(model_dir, _config(op_libraries=op_libraries) if op_libraries else _config())
    if library is not None:
        shutil.copy(library, model_dir / library.name)
    models.save_torchscript(Affine(), model_dir / "1" / "model.pt")
    return model_dir


def _python_ops_model(repo: Path) -> None:
    """An exported program calling an op that `pyops.py` (in the version folder) registers."""
    model_dir = repo / "triple"
    models.write_config(model_dir, _config("torch_export", op_libraries=["pyops.py"]))
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "pyops.py").write_text(textwrap.dedent(PY_OPS))
    spec = importlib.util.spec_from_file_location("mpsd_test_pyops", model_dir / "1" / "pyops.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # registered here, to export the model
    program = torch.export.export(Triple(), (torch.zeros(4),))
    torch.export.save(program, str(model_dir / "1" / "model.pt2"))


@pytest.fixture(scope="module")
def daemon(op_library: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    repo = tmp_path_factory.mktemp("op_repo")
    _affine_model(repo, "affine", op_library, [op_library.name])
    _python_ops_model(repo)
    _affine_model(repo, "affine_unlisted", None, [])
    _affine_model(repo, "affine_escape", None, [f"../affine/{op_library.name}"])
    linked = _affine_model(repo, "affine_symlink", None, ["libs/ops.so"])
    (linked / "libs").mkdir()
    (linked / "libs" / "ops.so").symlink_to(op_library)  # the build folder: outside the model's folder
    running = RunningDaemon(repo, tmp_path_factory.mktemp("op_logs") / "daemon.log")
    try:
        running.wait_models_settled()
        yield running
    finally:
        running.stop()
        running.kill_group()


def _infer(daemon: RunningDaemon, model: str, x: np.ndarray) -> np.ndarray:
    inp = grpcclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = daemon.client.infer(model, [inp])
    out = result.as_numpy("y")
    assert out is not None
    return out


def _reasons(daemon: RunningDaemon) -> dict[str, tuple[str, str]]:
    index = daemon.client.get_model_repository_index(as_json=True)["models"]
    return {m["name"]: (m["state"], m.get("reason", "")) for m in index}


def test_a_torchscript_model_calling_a_cpp_op_serves_when_its_library_is_listed(
    daemon: RunningDaemon,
) -> None:
    x = np.array([0.0, 1.0, -2.0, 3.5], dtype=np.float32)
    np.testing.assert_array_equal(_infer(daemon, "affine", x), x * 2 + 1)
    reported = daemon.client.get_model_config("affine", as_json=True)["config"]["model_operations"]
    assert reported == {"op_library_filename": [op_library_name(daemon)]}


def op_library_name(daemon: RunningDaemon) -> str:
    return next(p.name for p in (daemon.repo / "affine").iterdir() if p.suffix == ".so")


def test_an_exported_program_calling_a_python_registered_op_serves(daemon: RunningDaemon) -> None:
    x = np.array([0.0, 1.0, -2.0, 3.5], dtype=np.float32)
    np.testing.assert_array_equal(_infer(daemon, "triple", x), x * 3 + 1)


def test_a_model_whose_op_library_is_not_listed_fails_naming_the_op(daemon: RunningDaemon) -> None:
    state, reason = _reasons(daemon)["affine_unlisted"]
    assert state == "UNAVAILABLE"
    assert "custom op mpsd_test::affine" in reason, reason
    assert "op_libraries" in reason, reason


@pytest.mark.parametrize("name", ["affine_escape", "affine_symlink"])
def test_a_library_outside_the_model_folder_is_a_config_error(daemon: RunningDaemon, name: str) -> None:
    state, reason = _reasons(daemon)[name]
    assert state == "UNAVAILABLE"
    assert "field 'op_libraries.0'" in reason, reason
    assert "outside the model's folder" in reason and "op_library_dirs" in reason, reason
    assert not any(name in " ".join(map(str, p.cmdline())) for p in _workers(daemon)), "a worker was started"


def _workers(daemon: RunningDaemon) -> list[object]:
    import psutil

    return [psutil.Process(pid) for pid in daemon.worker_pids()]


def test_library_paths_resolve_in_the_model_folder_or_an_allowed_directory(tmp_path: Path) -> None:
    """Version folder first, then the model folder; `..` and symlinks out are refused unless the directory
    they reach is allowed; an absolute path is held to the same rule."""
    repo, shared = tmp_path / "repo", tmp_path / "shared"
    shared.mkdir()
    (shared / "ops.so").write_bytes(b"")
    model_dir = models.add_sub(repo, "m", op_libraries=["ops.so", "../../shared/ops.so"])
    (model_dir / "ops.so").write_bytes(b"")
    (model_dir / "1" / "ops.so").write_bytes(b"")

    refused = load_model_source(model_dir)
    assert refused.config is None and refused.issues[0].loc == ("op_libraries", 1), refused.error
    allowed = load_model_source(model_dir, op_library_dirs=[shared])
    assert allowed.error is None, allowed.error
    assert allowed.op_libraries[1] == (str((model_dir / "1" / "ops.so").resolve()), str(shared / "ops.so"))

    models.write_config(
        model_dir,
        {**yaml.safe_load((model_dir / "config.yaml").read_text()), "op_libraries": [str(shared / "ops.so")]},
    )
    assert "outside the model's folder" in str(load_model_source(model_dir).error)
    assert load_model_source(model_dir, op_library_dirs=[shared]).error is None

    (model_dir / "1" / "ops.so").unlink()
    models.write_config(
        model_dir,
        {**yaml.safe_load((model_dir / "config.yaml").read_text()), "op_libraries": ["ops.so", "gone.so"]},
    )
    missing = load_model_source(model_dir)
    assert missing.issues[0].loc == ("op_libraries", 1)
    assert "'gone.so' not found in version folder 1 or the model folder" in str(missing.error)


def test_op_library_dirs_resolve_relative_to_the_daemon_config(tmp_path: Path) -> None:
    config = tmp_path / "mpsd.yaml"
    config.write_text("op_library_dirs: [ops, /opt/ops]\n")
    assert load_daemon_config(config).op_library_dirs == [tmp_path / "ops", Path("/opt/ops")]


def test_validate_accepts_libraries_from_the_directories_the_daemon_config_allows(tmp_path: Path) -> None:
    """`mpsd validate --config` judges op libraries as the daemon with that config would."""
    repo, shared = tmp_path / "models", tmp_path / "shared"
    shared.mkdir()
    (shared / "ops.so").write_bytes(b"")
    models.add_sub(repo, "m", op_libraries=[str(shared / "ops.so")])
    config = tmp_path / "mpsd.yaml"

    def validate(settings: str) -> subprocess.CompletedProcess[str]:
        config.write_text(f"model_repository: models\n{settings}")
        command = [sys.executable, "-m", "mpsd", "validate", "--config", str(config)]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)

    refused = validate("")
    assert refused.returncode == 1 and "outside the model's folder" in refused.stdout, refused.stdout
    allowed = validate("op_library_dirs: [shared]\n")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
