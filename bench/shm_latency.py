"""Latency of a 600 KB input sent through system shared memory versus inside the gRPC request.

Starts the real daemon on an identity model FP32[1, 3, 224, 224] (602,112 bytes) and, through the stock
tritonclient, sends N requests each way, interleaved so that both ways see the same machine state:
  - request:    input in raw_input_contents, output in the response;
  - shm_input:  input in a registered shared-memory region, output in the response;
  - shm_both:   input and output in shared-memory regions.
The client's own copy of the input into its region is inside the timed span, as it would be in a real
client. Prints p50 per way and the ratio shm/request; writes JSON with the machine description.

Usage: python bench/shm_latency.py [--requests N] [--out FILE]
"""

from __future__ import annotations

import _posixshmem
import argparse
import importlib.metadata
import json
import mmap
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
SHAPE = [1, 3, 224, 224]
MODES = ("request", "shm_input", "shm_both")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_identity(repo: Path) -> None:
    import torch

    class Identity(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

    model_dir = repo / "identity"
    (model_dir / "1").mkdir(parents=True)
    torch.jit.save(torch.jit.script(Identity()), str(model_dir / "1" / "model.pt"))
    tensor = {"data_type": "TYPE_FP32", "dims": SHAPE}
    config = {
        "backend": "torchscript",
        "max_batch_size": 0,
        "input": [{"name": "IN", **tensor}],
        "output": [{"name": "OUT", **tensor}],
        "instance_group": [{"kind": "KIND_AUTO", "count": 1}],
    }
    (model_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


class ClientRegion:
    """A POSIX shared-memory object owned by the benchmark (the client side); unlinked on close."""

    def __init__(self, key: str, size: int) -> None:
        self.key = key
        fd = _posixshmem.shm_open(key, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self.map, dtype=np.float32).reshape(SHAPE)

    def close(self) -> None:
        del self.array
        self.map.close()
        _posixshmem.shm_unlink(self.key)


def machine() -> dict[str, Any]:
    import grpc
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        if sys.platform == "darwin":
            cpu = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, check=False
            ).stdout.strip()
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "tritonclient": importlib.metadata.version("tritonclient"),
    }


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def run(requests: int, warmup: int, workdir: Path) -> dict[str, Any]:
    import tritonclient.grpc as grpcclient

    repo = workdir / "repo"
    write_identity(repo)
    address = f"127.0.0.1:{free_port()}"
    log = (workdir / "daemon.log").open("wb")
    serve = ["serve", "--model-repository", str(repo), "--grpc-address", address]
    daemon = subprocess.Popen(
        [sys.executable, "-m", "mpsd", *serve, "--metrics-address", "off", "--log-level", "warning"],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        cwd=ROOT,
    )
    client = grpcclient.InferenceServerClient(address)
    data = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    nbytes = data.nbytes
    tag = f"/mpsdbench_{os.getpid()}"
    regions: list[ClientRegion] = []
    try:
        deadline = time.monotonic() + 300
        while True:
            if daemon.poll() is not None:
                raise RuntimeError(f"daemon exited: {(workdir / 'daemon.log').read_text()}")
            try:
                if client.is_model_ready("identity"):
                    break
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("daemon not ready after 300 s")
            time.sleep(0.2)

        in_region, out_region = ClientRegion(tag + "_in", nbytes), ClientRegion(tag + "_out", nbytes)
        regions += [in_region, out_region]
        client.register_system_shared_memory("bench_in", in_region.key, nbytes)
        client.register_system_shared_memory("bench_out", out_region.key, nbytes)

        def via_request() -> np.ndarray:
            inp = grpcclient.InferInput("IN", SHAPE, "FP32")
            inp.set_data_from_numpy(data)
            return client.infer("identity", [inp]).as_numpy("OUT")  # type: ignore[no-any-return]

        def via_shm_input() -> np.ndarray:
            in_region.array[...] = data
            inp = grpcclient.InferInput("IN", SHAPE, "FP32")
            inp.set_shared_memory("bench_in", nbytes)
            return client.infer("identity", [inp]).as_numpy("OUT")  # type: ignore[no-any-return]

        def via_shm_both() -> np.ndarray:
            in_region.array[...] = data
            inp = grpcclient.InferInput("IN", SHAPE, "FP32")
            inp.set_shared_memory("bench_in", nbytes)
            out = grpcclient.InferRequestedOutput("OUT")
            out.set_shared_memory("bench_out", nbytes)
            client.infer("identity", [inp], outputs=[out])
            return out_region.array

        calls: dict[str, Callable[[], np.ndarray]] = {
            "request": via_request,
            "shm_input": via_shm_input,
            "shm_both": via_shm_both,
        }
        for mode, call in calls.items():  # correctness first, then warm-up
            np.testing.assert_array_equal(call(), data, err_msg=mode)
            for _ in range(warmup):
                call()
        samples: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(requests):
            order = MODES[i % len(MODES) :] + MODES[: i % len(MODES)]  # rotate who goes first
            for mode in order:
                t0 = time.perf_counter_ns()
                calls[mode]()
                samples[mode].append((time.perf_counter_ns() - t0) / 1e3)
        client.unregister_system_shared_memory()
    finally:
        client.close()
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()
        log.close()
        for region in regions:
            region.close()

    stats = {
        mode: {
            "p50_us": round(percentile(values, 50), 1),
            "p90_us": round(percentile(values, 90), 1),
            "p99_us": round(percentile(values, 99), 1),
            "mean_us": round(statistics.fmean(values), 1),
            "n": len(values),
        }
        for mode, values in samples.items()
    }
    request_p50 = stats["request"]["p50_us"]
    return {
        "scenario": "identity FP32[1,3,224,224]: input through system shared memory vs inside the request",
        "input_bytes": nbytes,
        "requests_per_mode": requests,
        "warmup_per_mode": warmup,
        "interleaved": True,
        "client_copy_into_region_timed": True,
        "machine": machine(),
        "latency": stats,
        "ratio_p50": {
            "shm_input_over_request": round(stats["shm_input"]["p50_us"] / request_p50, 3),
            "shm_both_over_request": round(stats["shm_both"]["p50_us"] / request_p50, 3),
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=500, help="timed requests per way (default 500)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed requests per way first (default 20)")
    parser.add_argument("--out", type=Path, help="JSON file (default bench/results/shm_latency_<host>.json)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mpsd-shm-bench-") as tmp:
        result = run(args.requests, args.warmup, Path(tmp))
    for mode, s in result["latency"].items():
        print(f"{mode:10s} p50 {s['p50_us']:9.1f} us   p90 {s['p90_us']:9.1f} us   p99 {s['p99_us']:9.1f} us")
    ratios = result["ratio_p50"]
    print(f"p50 ratio shm_input/request: {ratios['shm_input_over_request']:.3f}")
    print(f"p50 ratio shm_both/request:  {ratios['shm_both_over_request']:.3f}")
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname())
    out = args.out or ROOT / "bench" / "results" / f"shm_latency_{host}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
