"""Per-process GPU memory caps, shown for real on a CUDA machine.

Starts the real daemon with two models pinned to GPU 0 at memory fractions 0.1 and 0.3 and shows, through
the stock tritonclient:
  - each worker sees only its GPU (CUDA_VISIBLE_DEVICES pinning: device_count is 1);
  - a request that needs more than its fraction gets RESOURCE_EXHAUSTED with the allocator's message;
  - the same worker (same pid) then answers a normal request;
  - the other model keeps answering throughout;
  - the reported memory figures (ModelStatistics.memory_usage) move.
With `--two-gpus`, also: `gpus: [0, 1]` with count 1 gives one instance on each GPU, each seeing only its own.

Usage: python bench/gpu_memory_check.py [--two-gpus] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20

MODEL_PY = textwrap.dedent(
    """
    import os
    import torch


    class Model:
        \"\"\"Allocates `mib` MiB on its device and keeps it until the next request.\"\"\"

        def __init__(self, config, device):
            self.device = device
            self.kept = None

        def infer(self, inputs):
            self.kept = None
            mib = int(inputs["mib"].reshape(-1)[0])
            if mib > 0:
                self.kept = torch.ones(mib << 20, dtype=torch.uint8, device=self.device)
            torch.cuda.synchronize()
            return {
                "device_count": torch.tensor([torch.cuda.device_count()], dtype=torch.int64),
                "visible": torch.tensor(
                    [int(v) for v in os.environ.get("CUDA_VISIBLE_DEVICES", "-1").split(",")],
                    dtype=torch.int64,
                ),
                "pid": torch.tensor([os.getpid()], dtype=torch.int64),
                "allocated": torch.tensor([torch.cuda.memory_allocated()], dtype=torch.int64),
            }
    """
)


def write_model(repo: Path, name: str, fraction: float | None, gpus: list[int]) -> None:
    group: dict[str, Any] = {"kind": "KIND_GPU", "count": 1, "gpus": gpus}
    if fraction is not None:
        group["memory_fraction"] = fraction
    config = {
        "backend": "python",
        "max_batch_size": 0,
        "input": [{"name": "mib", "data_type": "TYPE_INT64", "dims": [1]}],
        "output": [
            {"name": "device_count", "data_type": "TYPE_INT64", "dims": [1]},
            {"name": "visible", "data_type": "TYPE_INT64", "dims": [-1]},
            {"name": "pid", "data_type": "TYPE_INT64", "dims": [1]},
            {"name": "allocated", "data_type": "TYPE_INT64", "dims": [1]},
        ],
        "instance_group": [group],
    }
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.yaml").write_text(yaml.safe_dump(config))
    (repo / name / "1" / "model.py").write_text(MODEL_PY)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    def __init__(self, repo: Path, log: Path) -> None:
        import tritonclient.grpc as grpcclient

        self.address = f"127.0.0.1:{free_port()}"
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mpsd",
                "serve",
                "--model-repository",
                str(repo),
                "--grpc-address",
                self.address,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )
        self.client = grpcclient.InferenceServerClient(self.address)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited:\n{self.log_path.read_text()}")
            try:
                if self.client.is_server_ready():
                    return
            except Exception:
                pass
            time.sleep(0.2)
        raise TimeoutError(self.log_path.read_text())

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


def call(client: Any, model: str, mib: int) -> dict[str, Any]:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    inp = grpcclient.InferInput("mib", [1], "INT64")
    inp.set_data_from_numpy(np.array([mib], dtype=np.int64))
    try:
        r = client.infer(model, [inp])
    except InferenceServerException as exc:
        return {"ok": False, "status": exc.status(), "message": exc.message()}
    return {
        "ok": True,
        "device_count": int(r.as_numpy("device_count")[0]),
        "visible": r.as_numpy("visible").tolist(),
        "pid": int(r.as_numpy("pid")[0]),
        "allocated_bytes": int(r.as_numpy("allocated")[0]),
    }


def memory_usage(client: Any, model: str) -> list[dict[str, Any]]:
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    return list(stats.get("memory_usage", []))


def gpu_bytes(usage: list[dict[str, Any]]) -> int:
    return sum(int(u.get("byte_size", 0)) for u in usage if u.get("type") == "GPU")


def check(results: dict[str, Any], name: str, ok: bool, detail: str) -> None:
    results["checks"].append({"check": name, "passed": bool(ok), "detail": detail})
    print(("PASS " if ok else "FAIL ") + name + ": " + detail, flush=True)


def fraction_check(results: dict[str, Any], work: Path) -> None:
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    repo = work / "repo"
    write_model(repo, "small", 0.1, [0])
    write_model(repo, "big", 0.3, [0])
    daemon = Daemon(repo, work / "daemon.log")
    try:
        daemon.wait_ready()
        c = daemon.client
        over = int(total * 0.15 / MIB)  # more than small's 10 %, well inside big's 30 %
        first_small, first_big = call(c, "small", 16), call(c, "big", 16)
        check(
            results,
            "each worker sees only its GPU",
            first_small["device_count"] == 1
            and first_big["device_count"] == 1
            and first_small["visible"] == [0]
            and first_big["visible"] == [0],
            f"small: {first_small}, big: {first_big}",
        )
        before = gpu_bytes(memory_usage(c, "big"))
        big_hold = call(c, "big", over)
        check(results, "big (0.3) holds a buffer above small's cap", big_hold["ok"], json.dumps(big_hold))
        oom = call(c, "small", over)
        check(
            results,
            "small (0.1) request above its fraction -> RESOURCE_EXHAUSTED",
            (not oom["ok"])
            and oom["status"] == "StatusCode.RESOURCE_EXHAUSTED"
            and "out of memory" in oom["message"].lower(),
            json.dumps(oom)[:600],
        )
        after = call(c, "small", 16)
        check(
            results,
            "the same small worker answers a normal request after the OOM",
            after["ok"] and after["pid"] == first_small["pid"],
            f"{after}, first pid {first_small['pid']}",
        )
        big_again = call(c, "big", over)
        check(
            results,
            "the other model kept answering",
            big_again["ok"] and big_again["pid"] == first_big["pid"],
            json.dumps(big_again),
        )
        deadline = time.monotonic() + 20
        moved = before
        while time.monotonic() < deadline:
            moved = gpu_bytes(memory_usage(c, "big"))
            if moved >= before + over * MIB // 2:
                break
            time.sleep(0.5)
        check(
            results,
            "reported device memory moved (ModelStatistics.memory_usage)",
            moved >= before + over * MIB // 2,
            f"big GPU bytes before {before}, after {moved}",
        )
        results["memory_usage_after"] = {"small": memory_usage(c, "small"), "big": memory_usage(c, "big")}
        results["device_total_bytes"] = total
    finally:
        daemon.stop()
        results["daemon_log_tail"] = (work / "daemon.log").read_text()[-4000:]


def two_gpu_check(results: dict[str, Any], work: Path) -> None:
    repo = work / "repo2"
    write_model(repo, "pair", None, [0, 1])
    daemon = Daemon(repo, work / "daemon2.log")
    try:
        daemon.wait_ready()
        seen: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + 60
        while len(seen) < 2 and time.monotonic() < deadline:
            r = call(daemon.client, "pair", 1)
            seen[r["pid"]] = r
        views = sorted(tuple(r["visible"]) for r in seen.values())
        check(
            results,
            "gpus: [0, 1] gives one instance on each GPU, each seeing only its own",
            len(seen) == 2 and views == [(0,), (1,)] and all(r["device_count"] == 1 for r in seen.values()),
            json.dumps(list(seen.values())),
        )
    finally:
        daemon.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--two-gpus", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to check")
        return 0
    results: dict[str, Any] = {
        "machine": {
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "torch": torch.__version__,
            "python": platform.python_version(),
            "host": platform.platform(),
        },
        "checks": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        fraction_check(results, Path(tmp))
        if args.two_gpus:
            two_gpu_check(results, Path(tmp))
    passed = all(c["passed"] for c in results["checks"])
    results["all_passed"] = passed
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
