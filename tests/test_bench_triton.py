"""The Triton peer of the benchmark (bench/triton_peer.py): its model repository holds the very identity
models mpsd serves in scenarios 1-3, read back with mpsd's own config.pbtxt reader, and tritonserver's
environment puts the peer environment's libpython ahead of the wheel's libraries. tritonserver itself runs
only in the bench.

Each check runs in a process of its own: bench/ imports mpsd's generated protobuf modules, which cannot share
a descriptor pool with tritonclient's (imported by conftest)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

REPO = """
import json, sys
from pathlib import Path
from bench import triton_peer
from bench.models import OVERHEAD_IDENTITIES, identity_config
from mpsd.config.model_file import validate_model_config
from mpsd.config.pbtxt import parse_pbtxt_config

root = Path(sys.argv[1])
triton_peer.write_repo(root)
out = {"models": sorted(p.name for p in root.iterdir())}
for name, (shape, batching) in OVERHEAD_IDENTITIES.items():
    path = root / name / "config.pbtxt"
    triton, _ = parse_pbtxt_config(path, path.read_text(), name)
    mpsd = validate_model_config(path, {"name": name, **identity_config(shape, batching)})
    fields = ("max_batch_size", "input", "output", "dynamic_batching", "instance_group")
    out[name] = {
        "backend": triton.backend,
        "differ": [f for f in fields if getattr(triton, f) != getattr(mpsd, f)],
        "model_py": (root / name / "1" / "model.py").read_text() == triton_peer.MODEL_FILE.read_text(),
    }
print(json.dumps(out))
"""

ENV = """
import json
from pathlib import Path
from bench.triton_peer import Layout

shared = Layout(Path("/w/tritonserver"), Path("/w/libs"), "3.11", "/py/lib").env(Path("/venv/bin/python"))
static = Layout(Path("/w/tritonserver"), Path("/w/libs"), "3.11", None).env(Path("/venv/bin/python"))
print(json.dumps({"shared": shared, "static": static}))
"""


def run(code: str, *args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_triton_repo_has_mpsds_identity_models_on_the_python_backend(tmp_path: Path) -> None:
    out = run(REPO, str(tmp_path))
    assert out["models"] == ["identity_16", "identity_600k"]
    for name in ("identity_16", "identity_600k"):
        assert out[name] == {"backend": "python", "differ": [], "model_py": True}, name


def test_stub_runs_the_environments_libpython_ahead_of_the_wheels_libraries() -> None:
    """The environment's own libpython first (not whichever the system has), then the wheel's libraries;
    the environment's bin/ first on PATH, where the stub's interpreter finds its site-packages."""
    out = run(ENV)
    shared, static = out["shared"], out["static"]
    assert isinstance(shared, dict) and isinstance(static, dict)
    assert shared["LD_LIBRARY_PATH"].split(":")[:2] == ["/py/lib", "/w/libs"]
    assert shared["PATH"].split(":")[0] == "/venv/bin"
    assert static["LD_LIBRARY_PATH"].split(":")[0] == "/w/libs"
