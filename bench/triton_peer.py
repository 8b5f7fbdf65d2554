"""NVIDIA Triton Inference Server as a peer in scenarios 1-3: the tritonserver binary that the
`nvidia-pytriton` wheel bundles (a pinned version, installed by the bench into its own virtual environment
the first time it is needed), serving the identity models through its python backend, on the CPU.

Triton's gRPC service is the one mpsd implements (`inference.GRPCInferenceService`), so the load generator
sends it the very bytes it sends mpsd. The models are mpsd's identity models (`bench/models.py`,
`OVERHEAD_IDENTITIES`: the same tensors, max_batch_size, dynamic batching with no queue delay, one CPU
instance) with `backend: python` and `bench/triton_identity.py` as model.py. Triton runs a python-backend
model in a stub process of its own, so it has mpsd's shape: a server process and a model process.

tritonserver is started the way pytriton starts it (pytriton/triton.py, server/triton_server.py): the python
backend's directory holds the stub built for the environment's Python version, the wheel's bundled libraries
are on LD_LIBRARY_PATH, and the environment's bin/ comes first on PATH, which is how the stub's embedded
interpreter finds the environment's site-packages (numpy). Ahead of the bundled libraries on
LD_LIBRARY_PATH goes the directory of the environment's own libpython where it was built shared: without it
the stub loads whichever libpython3.X the system has (Debian's 3.11.2 beside pyenv's 3.11.7 here).
Otherwise Triton's defaults, on loopback ports.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import common, peer_venv

PYTRITON_VERSION = "0.7.0"
TRITONSERVER_VERSION = "2.51.0"  # the tritonserver that nvidia-pytriton 0.7.0 bundles
PACKAGES = [f"nvidia-pytriton=={PYTRITON_VERSION}"]
DEFAULT_VENV = Path(__file__).resolve().parent / ".triton-venv"
MODEL_FILE = Path(__file__).resolve().parent / "triton_identity.py"

# What the environment's Python says about itself and where the wheel put tritonserver.
_LAYOUT = (
    "import json, sys, sysconfig, pathlib, pytriton; root = pathlib.Path(pytriton.__file__).parent; "
    "print(json.dumps({'server': str(root / 'tritonserver'), "
    "'libs': str(root.parent / 'nvidia_pytriton.libs'), "
    "'python': '%d.%d' % sys.version_info[:2], "
    "'libpython_dir': sysconfig.get_config_var('LIBDIR') if sysconfig.get_config_var('Py_ENABLE_SHARED') "
    "else None}))"
)


@dataclass(frozen=True)
class Layout:
    """Where the wheel's tritonserver, its libraries and the python backend's stub are."""

    server: Path  # pytriton/tritonserver: bin/, backends/python/, python_backend_stubs/
    libs: Path  # nvidia_pytriton.libs: libtritonserver and the libraries it was built with
    python: str  # the environment's Python version, major.minor: the stub must be built for it
    libpython_dir: str | None  # the directory of the environment's libpython, where it was built shared

    @property
    def binary(self) -> Path:
        return self.server / "bin" / "tritonserver"

    @property
    def stub(self) -> Path:
        return self.server / "python_backend_stubs" / self.python / "triton_python_backend_stub"

    def env(self, python: Path) -> dict[str, str]:
        """tritonserver's environment (see the module's docstring)."""
        libs = [self.libpython_dir, str(self.libs), os.environ.get("LD_LIBRARY_PATH")]
        return {
            "LD_LIBRARY_PATH": os.pathsep.join(p for p in libs if p),
            "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }


def layout(python: Path) -> Layout:
    out = subprocess.run([str(python), "-c", _LAYOUT], check=True, capture_output=True, text=True)
    raw = json.loads(out.stdout)
    return Layout(Path(raw["server"]), Path(raw["libs"]), raw["python"], raw["libpython_dir"])


def missing_libraries(where: Layout, python: Path) -> list[str]:
    """Shared libraries the binary or the stub cannot find in tritonserver's environment (ldd's `not found`);
    empty where ldd is not there to say."""
    if shutil.which("ldd") is None:
        return []
    missing: list[str] = []
    for exe in (where.binary, where.stub):
        out = subprocess.run(
            ["ldd", str(exe)], capture_output=True, text=True, env={**os.environ, **where.env(python)}
        )
        missing += [line.split()[0] for line in out.stdout.splitlines() if "not found" in line]
    return sorted(set(missing))


def ensure_installed(venv: Path = DEFAULT_VENV) -> Path | None:
    """The Python of a virtual environment with nvidia-pytriton==PYTRITON_VERSION, installing it there the
    first time; None (with a message saying why) where it cannot be installed or tritonserver cannot run."""
    check = "import importlib.metadata as m; print(m.version('nvidia-pytriton'))"
    python = peer_venv.ensure(venv, PACKAGES, check, PYTRITON_VERSION, "Triton", "--no-triton")
    if python is None:
        return None
    where = layout(python)
    problem = None
    if not where.stub.exists():
        problem = f"nvidia-pytriton {PYTRITON_VERSION} has no python backend stub for Python {where.python}"
    elif missing := missing_libraries(where, python):
        problem = f"tritonserver's libraries not found: {', '.join(missing)}"
        if any(name.startswith("libpython") for name in missing):
            problem += f" (the python backend's stub needs a shared libpython{where.python}: on Debian, "
            f"apt-get install libpython{where.python})"
    if problem:
        print(f"Triton skipped: {problem}; --no-triton skips the attempt.", flush=True)
        return None
    return python


def model_config(shape: list[int], batching: bool) -> dict[str, Any]:
    """mpsd's identity model config (bench/models.py) for Triton's python backend: the same tensors, batch
    size, batching and instances; without the TorchScript-only parameter (intra_op_thread_count)."""
    from bench.models import identity_config

    config = identity_config(shape, batching)
    config.pop("parameters", None)
    return {**config, "backend": "python"}


def write_repo(root: Path) -> None:
    """A Triton model repository with the identity models of scenarios 1-3: per model config.pbtxt and
    1/model.py (bench/triton_identity.py)."""
    from google.protobuf import json_format, text_format  # type: ignore[import-untyped]

    from bench.models import OVERHEAD_IDENTITIES
    from mpsd.proto import model_config_pb2 as mc

    for name, (shape, batching) in OVERHEAD_IDENTITIES.items():
        (root / name / "1").mkdir(parents=True, exist_ok=True)
        msg = json_format.ParseDict({"name": name, **model_config(shape, batching)}, mc.ModelConfig())
        (root / name / "config.pbtxt").write_text(text_format.MessageToString(msg))
        shutil.copy(MODEL_FILE, root / name / "1" / "model.py")


def start(python: Path, workdir: Path, name: str = "triton") -> common.Server:
    """tritonserver on a fresh model repository under `workdir`, its python backend with the stub for the
    environment's Python (copied beside the backend, as pytriton does), ports free ones on loopback."""
    where = layout(python)
    root = workdir / name
    write_repo(root / "models")
    backend = root / "backends" / "python"
    backend.mkdir(parents=True)
    for part in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy(where.server / "backends" / "python" / part, backend)
    shutil.copy(where.stub, backend)
    grpc_port = common.free_port()
    args = [str(where.binary), "--model-repository", str(root / "models")]
    args += ["--backend-directory", str(root / "backends")]
    for api in ("grpc", "http", "metrics"):
        port = grpc_port if api == "grpc" else common.free_port()
        args += [f"--{api}-address", "127.0.0.1", f"--{api}-port", str(port)]
    env = where.env(python)
    return common.Server(args, workdir / f"{name}.log", f"127.0.0.1:{grpc_port}", env, cwd=root)


def wait_models(server: common.Server, timeout_s: float = 120.0) -> None:
    from bench.models import OVERHEAD_IDENTITIES

    common.wait_models(server, list(OVERHEAD_IDENTITIES), "Triton", timeout_s)


def versions(python: Path, server: common.Server) -> dict[str, str]:
    """Versions of tritonserver (as it says over gRPC) and of its python backend's environment."""
    from mpsd.proto import grpc_service_pb2 as pb

    code = (
        "import json, sys, importlib.metadata as m, numpy; print(json.dumps({"
        "'python': sys.version.split()[0], 'nvidia-pytriton': m.version('nvidia-pytriton'), "
        "'numpy': numpy.__version__}))"
    )
    out = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True)
    meta = server.stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=10)
    return {"tritonserver": str(meta.version), **json.loads(out.stdout)}
