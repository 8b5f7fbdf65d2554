"""MLServer as a peer in scenarios 1-3: a pinned version, installed by the bench into its own virtual
environment the first time it is needed, serving the identity models under mpsd's names.

MLServer implements the same KServe v2 gRPC service (`inference.GRPCInferenceService`), so the load
generator sends it the very bytes it sends mpsd. The model is `bench/mlserver_identity.py`, a custom
`mlserver.MLModel` that answers with a copy of its input. Two configurations:

- `mlserver`: `parallel_workers: 0`, the model runs in the server's own process (no process hop);
- `mlserver_w1`: MLServer's default, `parallel_workers: 1`: the server hands each request to one inference
  worker process and back (the same shape as mpsd: a gRPC process and a model process).

Otherwise MLServer's defaults, except that its per-request access log (`debug`, on by default) is off, as
mpsd writes none, and the ports are free ones on loopback. Adaptive batching is off (MLServer's default).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from bench import common, peer_venv

MLSERVER_VERSION = "1.7.1"
# uvloop 0.22 made asyncio.get_event_loop() raise where no loop runs, which MLServer 1.7.1's inference workers
# call at start: with it, parallel_workers >= 1 never gets a worker up.
PACKAGES = [f"mlserver=={MLSERVER_VERSION}", "uvloop==0.21.0"]
DEFAULT_VENV = Path(__file__).resolve().parent / ".mlserver-venv"

# Models of scenarios 1-3: name -> shape of one request (as in bench/models.py).
MODELS = {"identity_16": [1, 16], "identity_600k": [1, 3, 224, 224]}


def venv_python(venv: Path) -> Path:
    return peer_venv.venv_python(venv)


def ensure_installed(venv: Path = DEFAULT_VENV) -> Path | None:
    """The Python of a virtual environment with mlserver==MLSERVER_VERSION, installing it there the first
    time; None (with a message saying why) where it cannot be installed, e.g. with no network."""
    check = "import mlserver; print(mlserver.__version__)"
    return peer_venv.ensure(venv, PACKAGES, check, MLSERVER_VERSION, "MLServer", "--no-mlserver")


def versions(python: Path) -> dict[str, str]:
    """Versions of MLServer and of what it runs on, in its environment."""
    code = (
        "import json, sys, grpc, google.protobuf, mlserver, numpy, uvloop; print(json.dumps({"
        "'python': sys.version.split()[0], 'mlserver': mlserver.__version__, 'grpcio': grpc.__version__, "
        "'protobuf': google.protobuf.__version__, 'numpy': numpy.__version__, 'uvloop': uvloop.__version__}))"
    )
    out = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True)
    return dict(json.loads(out.stdout))


def write_repo(root: Path, parallel_workers: int, grpc_port: int, http_port: int, metrics_port: int) -> None:
    """settings.json and one folder per identity model, with its model-settings.json."""
    root.mkdir(parents=True, exist_ok=True)
    settings = {
        "debug": False,
        "parallel_workers": parallel_workers,
        "host": "127.0.0.1",
        "grpc_port": grpc_port,
        "http_port": http_port,
        "metrics_port": metrics_port,
        "grpc_max_message_length": 256 * 1024 * 1024,
        "load_models_at_startup": True,
    }
    (root / "settings.json").write_text(json.dumps(settings, indent=1))
    for name, shape in MODELS.items():
        tensor = {"datatype": "FP32", "shape": shape}
        model = {
            "name": name,
            "implementation": "mlserver_identity.IdentityRuntime",
            "inputs": [{"name": "INPUT", **tensor}],
            "outputs": [{"name": "OUTPUT", **tensor}],
        }
        (root / name).mkdir(exist_ok=True)
        (root / name / "model-settings.json").write_text(json.dumps(model, indent=1))


def start(python: Path, workdir: Path, parallel_workers: int, name: str) -> common.Server:
    """`mlserver start` on a fresh repository under `workdir`, with the bench's runtime importable."""
    root = workdir / name
    grpc_port = common.free_port()
    write_repo(root, parallel_workers, grpc_port, common.free_port(), common.free_port())
    # The runtime alone on the path of every MLServer process (bench/ itself would shadow `profile`).
    runtime = root / "runtime"
    runtime.mkdir()
    shutil.copy(Path(__file__).resolve().parent / "mlserver_identity.py", runtime)
    env = {
        "PYTHONPATH": str(runtime),
        "MLSERVER_METRICS_DIR": str(root / ".metrics"),
        "MLSERVER_ENVIRONMENTS_DIR": str(root / ".envs"),
        "VIRTUAL_ENV": str(python.parent.parent),
        "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    args = [str(python.parent / "mlserver"), "start", str(root)]
    return common.Server(args, workdir / f"{name}.log", f"127.0.0.1:{grpc_port}", env, cwd=root)


def wait_models(server: common.Server, timeout_s: float = 120.0) -> None:
    """Until MLServer says each identity model is ready (ServerReady may come first)."""
    common.wait_models(server, list(MODELS), "MLServer", timeout_s)
