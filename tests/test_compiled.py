"""Compiled models: AOTInductor packages (backend aoti) and torch.compile at load (optimization.compile),
through the real daemon and the stock tritonclient, on the CPU.

Promises checked here:
- `mpsd init-model NAME --from program.pt2 --aoti` compiles the exported program into model.aoti.pt2 with
  backend aoti, and the daemon serves it: outputs close to eager at several batch sizes;
- a torch_export model with `optimization.compile` answers close to eager at every batch size, and its
  compile time (the compiling warm-up's) is in the "model version ready" and "worker ready" events;
- a python model with `optimization.compile` runs its `infer` compiled (torch.compiler.is_compiling() is
  true inside it);
- a package compiled for another device than the instance's is refused with the reason (a copy of the CPU
  package whose metadata says cuda stands in for a CUDA package: there is no GPU here);
- on a CUDA GPU (skipped elsewhere): both kinds answer close to eager, an AOTInductor package also under
  CUDA graphs, and a CPU package is refused there.

AOTInductor and Inductor compile C++ with the system compiler: artifacts are cached per test session
(TORCHINDUCTOR_CACHE_DIR in a session directory), and one daemon serves every model of the module; it
compiles the torch.compile models while init-model compiles the package, which it then loads from its
watched repository.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from tests import models
from tests.conftest import ROOT, RunningDaemon, wait_for

FEATURES = 8
MAX_BATCH = 4
INIT = (sys.executable, "-m", "mpsd", "init-model")
# torch.compiler.is_compiling() is True while torch.compile traces, so a compiled infer answers 1 for it.
PYTHON_BODY = """
x = inputs["x"]
flag = torch.full((x.shape[0], 1), float(torch.compiler.is_compiling()), device=x.device)
return {"y": torch.relu(x) * 2 + 1, "compiled": flag}
"""
FLAG = {"name": "compiled", "data_type": "TYPE_FP32", "dims": [1]}


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.linear = torch.nn.Linear(FEATURES, FEATURES)
        with torch.no_grad():
            self.linear.weight.copy_(torch.rand(FEATURES, FEATURES, generator=generator) - 0.5)
            self.linear.bias.copy_(torch.rand(FEATURES, generator=generator) - 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) * 2 + 1


def export_tiny(path: Path) -> None:
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    program = torch.export.export(Tiny().eval(), (torch.zeros(2, FEATURES),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))


def tiny_config(backend: str, **extra: Any) -> dict[str, Any]:
    return {
        "backend": backend,
        "max_batch_size": MAX_BATCH,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [FEATURES]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [FEATURES]}],
        **extra,
    }


def with_device_key(package: Path, target: Path, device: str) -> None:
    """A copy of the package whose AOTInductor metadata names another device."""
    with zipfile.ZipFile(package) as src, zipfile.ZipFile(target, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("_metadata.json"):
                metadata = json.loads(data)
                metadata["AOTI_DEVICE_KEY"] = device
                data = json.dumps(metadata).encode()
            dst.writestr(item, data)


@pytest.fixture(scope="session")
def inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor-cache"))}


@dataclass
class Served:
    daemon: RunningDaemon
    repo: Path
    init_output: str


MODELS = ("tiny_aoti", "tiny_compiled", "python_compiled", "cuda_package")


def all_settled(daemon: RunningDaemon) -> bool:
    """Every model of the module taken on, none LOADING, and each that is not READY saying why."""
    index = daemon.client.get_model_repository_index(as_json=True).get("models", [])
    rows = {m["name"]: m for m in index}
    return set(MODELS) <= set(rows) and all(
        m.get("state") == "READY" or (m.get("state") != "LOADING" and m.get("reason")) for m in rows.values()
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, inductor_cache: dict[str, str]) -> Iterator[Served]:
    """The daemon starts on the two torch.compile models while `mpsd init-model --aoti` compiles the package
    beside it (the two compilations are the module's time); the daemon watches its repository, and
    init-model renames its model in whole once checked, as does the fixture the cuda package's copy."""
    base = tmp_path_factory.mktemp("compiled")
    repo = base / "repo"
    program = base / "tiny.pt2"
    export_tiny(program)
    models.write_config(
        repo / "tiny_compiled", tiny_config("torch_export", optimization={"compile": {"mode": "default"}})
    )
    (repo / "tiny_compiled" / "1").mkdir()
    shutil.copyfile(program, repo / "tiny_compiled" / "1" / "model.pt2")
    models.python_model(
        repo,
        "python_compiled",
        PYTHON_BODY,
        tiny_config("python", optimization={"compile": {"mode": "default"}})
        | {"output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [FEATURES]}, FLAG]},
    )
    init = subprocess.Popen(
        [*INIT, "tiny_aoti", "--from", str(program), "--aoti", "--repository", str(repo)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **inductor_cache},
    )
    daemon = RunningDaemon(repo, base / "daemon.log", env=inductor_cache)
    try:
        stdout, stderr = init.communicate(timeout=600)
        assert init.returncode == 0, stderr
        cuda_package = base / "cuda_package"  # written aside, renamed in whole
        models.write_config(cuda_package, tiny_config("aoti", instance_group=[{"kind": "KIND_CPU"}]))
        (cuda_package / "1").mkdir()
        with_device_key(
            repo / "tiny_aoti" / "1" / "model.aoti.pt2", cuda_package / "1" / "model.aoti.pt2", "cuda"
        )
        os.rename(cuda_package, repo / "cuda_package")
        daemon.wait_live(600)
        wait_for(lambda: all_settled(daemon), 600, f"every model settled\n{daemon.log()}")
        yield Served(daemon, repo, stdout + stderr)
    finally:
        if init.poll() is None:
            init.kill()
            init.wait()
        daemon.stop()
        daemon.kill_group()


def infer(daemon: RunningDaemon, model: str, x: np.ndarray) -> np.ndarray:
    """One request; tensor names from the model's metadata (init-model names them after the program)."""
    metadata = daemon.client.get_model_metadata(model, as_json=True)
    inputs = [grpcclient.InferInput(metadata["inputs"][0]["name"], list(x.shape), "FP32")]
    inputs[0].set_data_from_numpy(x)
    out = daemon.client.infer(model, inputs).as_numpy(metadata["outputs"][0]["name"])
    assert out is not None
    return out


def eager(x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return Tiny().eval()(torch.from_numpy(x)).numpy()


def events(daemon: RunningDaemon, name: str) -> list[dict[str, Any]]:
    found = []
    for line in daemon.log().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == name:
            found.append(event)
    return found


def test_init_model_writes_an_aoti_package_that_serves_like_eager(served: Served) -> None:
    config = (served.repo / "tiny_aoti" / "config.yaml").read_text()
    assert "backend: aoti" in config
    assert (served.repo / "tiny_aoti" / "1" / "model.aoti.pt2").is_file()
    assert "compiling tiny.pt2 with AOTInductor for cpu" in served.init_output
    rng = np.random.default_rng(0)
    for batch in (1, 3, MAX_BATCH):
        x = rng.standard_normal((batch, FEATURES)).astype(np.float32)
        np.testing.assert_allclose(infer(served.daemon, "tiny_aoti", x), eager(x), rtol=1e-5, atol=1e-5)
    metadata = served.daemon.client.get_model_metadata("tiny_aoti", as_json=True)
    assert metadata["platform"] == "torch_aoti"


def test_a_compiled_model_answers_like_eager_and_reports_its_compile_time(served: Served) -> None:
    rng = np.random.default_rng(1)
    for batch in (1, 2, MAX_BATCH):
        x = rng.standard_normal((batch, FEATURES)).astype(np.float32)
        np.testing.assert_allclose(infer(served.daemon, "tiny_compiled", x), eager(x), rtol=1e-5, atol=1e-5)
    ready = [e for e in events(served.daemon, "model version ready") if e.get("model") == "tiny_compiled"]
    assert len(ready) == 1 and ready[0]["compile_ms"] > 0
    workers = [e for e in events(served.daemon, "worker ready") if e.get("worker") == "tiny_compiled/1#0"]
    assert workers and workers[0]["compile_ms"] > 0
    uncompiled = [e for e in events(served.daemon, "model version ready") if e.get("model") == "tiny_aoti"]
    assert uncompiled and "compile_ms" not in uncompiled[0]


def test_a_python_model_runs_compiled(served: Served) -> None:
    x = np.random.default_rng(3).standard_normal((2, FEATURES)).astype(np.float32)
    inputs = [grpcclient.InferInput("x", list(x.shape), "FP32")]
    inputs[0].set_data_from_numpy(x)
    result = served.daemon.client.infer("python_compiled", inputs)
    np.testing.assert_allclose(result.as_numpy("y"), np.maximum(x, 0) * 2 + 1, rtol=1e-6)
    np.testing.assert_array_equal(result.as_numpy("compiled"), np.ones((2, 1), dtype=np.float32))


def test_a_package_for_another_device_is_refused_with_the_reason(served: Served) -> None:
    index = served.daemon.client.get_model_repository_index(as_json=True)["models"]
    entry = next(m for m in index if m["name"] == "cuda_package")
    assert entry["state"] == "UNAVAILABLE"
    assert "compiled for cuda, but this instance runs on cpu" in entry["reason"]


# ---- GPU -----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_models_on_a_cuda_gpu(tmp_path: Path, inductor_cache: dict[str, str]) -> None:
    repo = tmp_path / "repo"
    program = tmp_path / "tiny.pt2"
    export_tiny(program)
    init = subprocess.run(
        [*INIT, "tiny_aoti", "--from", str(program), "--aoti", "cuda", "--repository", str(repo)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **inductor_cache},
        timeout=600,
    )
    assert init.returncode == 0, init.stderr
    models.write_config(repo / "tiny_aoti", {**tiny_config("aoti"), "instance_group": [{"kind": "KIND_GPU"}]})
    gpu = {"instance_group": [{"kind": "KIND_GPU"}]}
    models.write_config(
        repo / "tiny_compiled",
        tiny_config("torch_export", optimization={"compile": {"mode": "max-autotune-no-cudagraphs"}}, **gpu),
    )
    (repo / "tiny_compiled" / "1").mkdir()
    shutil.copyfile(program, repo / "tiny_compiled" / "1" / "model.pt2")
    graphed = {**tiny_config("aoti"), **gpu, "optimization": {"cuda": {"graphs": True}}}
    models.write_config(repo / "tiny_aoti_graphs", graphed)
    (repo / "tiny_aoti_graphs" / "1").mkdir()
    shutil.copyfile(
        repo / "tiny_aoti" / "1" / "model.aoti.pt2", repo / "tiny_aoti_graphs" / "1" / "model.aoti.pt2"
    )
    models.write_config(repo / "cpu_package", {**tiny_config("aoti"), **gpu})
    (repo / "cpu_package" / "1").mkdir()
    with_device_key(
        repo / "tiny_aoti" / "1" / "model.aoti.pt2", repo / "cpu_package" / "1" / "model.aoti.pt2", "cpu"
    )
    daemon = RunningDaemon(repo, tmp_path / "daemon.log", env=inductor_cache)
    try:
        daemon.wait_models_settled(timeout=600)
        x = np.random.default_rng(2).standard_normal((3, FEATURES)).astype(np.float32)
        for model in ("tiny_aoti", "tiny_compiled", "tiny_aoti_graphs"):
            np.testing.assert_allclose(infer(daemon, model, x), eager(x), rtol=1e-3, atol=1e-3)
        index = daemon.client.get_model_repository_index(as_json=True)["models"]
        entry = next(m for m in index if m["name"] == "cpu_package")
        assert "compiled for cpu, but this instance runs on cuda" in entry["reason"]
    finally:
        daemon.stop()
        daemon.kill_group()
