"""Soak: mixed load against a real daemon while models are reloaded and workers are killed.

Clients send valid and invalid requests to three models while a new version of one is published every
5 s and a random worker is killed with SIGKILL every 7 s. Reports requests sent, answered, failed by
status, lost (sent but never answered: must be 0), and the
daemon's RSS and mpsd shared-memory segments at start and end. Bounded in time (`--duration`).

Usage: python bench/soak.py [--duration 60] [--out bench/results/soak_<host>.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent


class Constant(torch.nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a + b + self.value, a - b


def write_model(repo: Path, name: str, count: int, batching: bool) -> None:
    config: dict[str, Any] = {
        "backend": "torchscript",
        "max_batch_size": 8,
        "input": [{"name": f"INPUT{i}", "data_type": "TYPE_FP32", "dims": [16]} for i in range(2)],
        "output": [{"name": f"OUTPUT{i}", "data_type": "TYPE_FP32", "dims": [16]} for i in range(2)],
        "instance_group": [{"kind": "KIND_CPU", "count": count}],
    }
    if batching:
        config["dynamic_batching"] = {"max_queue_delay_microseconds": 2000}
    (repo / name).mkdir(parents=True)
    (repo / name / "config.yaml").write_text(yaml.safe_dump(config))
    publish(repo / name, 1, 0.0)


def publish(model_dir: Path, version: int, value: float) -> None:
    """Write aside, then rename into place (the documented safe way)."""
    staging = model_dir.parent / f".staging-{model_dir.name}-{version}"
    staging.mkdir()
    torch.jit.save(torch.jit.script(Constant(value)), str(staging / "model.pt"))
    os.rename(staging, model_dir / str(version))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _is_worker(argv: list[str]) -> bool:
    """A model worker: as started (`python -m mpsd.worker`) or as it names itself in ps."""
    return "mpsd.worker" in argv or any(arg.startswith("mpsd: worker ") for arg in argv)


def segments(pid: int) -> list[str]:
    """Named shared-memory segments of the daemon `pid` (mpsd names them mpsd-<pid>-<n>)."""
    shm = Path("/dev/shm")
    return sorted(p.name for p in shm.iterdir() if p.name.startswith(f"mpsd-{pid}-")) if shm.is_dir() else []


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent = 0
        self.ok = 0
        self.failed: collections.Counter[str] = collections.Counter()
        self.outstanding = 0

    def start(self) -> None:
        with self.lock:
            self.sent += 1
            self.outstanding += 1

    def end(self, status: str | None) -> None:
        with self.lock:
            self.outstanding -= 1
            if status is None:
                self.ok += 1
            else:
                self.failed[status] += 1


def client_loop(address: str, tally: Tally, stop: threading.Event, seed: int) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    rng = random.Random(seed)
    client = grpcclient.InferenceServerClient(address)
    a = np.ones((1, 16), np.float32)
    while not stop.is_set():
        model = rng.choice(["steady", "reloaded", "killed"])
        bad = rng.random() < 0.1
        inputs = []
        for i in range(2):
            shape = [1, 15] if bad and i == 1 else [1, 16]
            inp = grpcclient.InferInput(f"INPUT{i}", shape, "FP32")
            inp.set_data_from_numpy(np.ones(shape, np.float32) if bad and i == 1 else a)
            inputs.append(inp)
        tally.start()
        try:
            client.infer(model, inputs, client_timeout=30)
            tally.end(None)
        except InferenceServerException as exc:
            tally.end(str(exc.status()))
    client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        write_model(repo, "steady", 1, batching=True)
        write_model(repo, "reloaded", 1, batching=False)
        write_model(repo, "killed", 2, batching=True)
        config = Path(tmp) / "mpsd.yaml"
        config.write_text(yaml.safe_dump({"reload_quiet_period_s": 0.3, "metrics_address": ""}))
        address = f"127.0.0.1:{free_port()}"
        log = open(Path(tmp) / "daemon.log", "wb")  # noqa: SIM115
        daemon = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mpsd",
                "serve",
                "--config",
                str(config),
                "--model-repository",
                str(repo),
                "--grpc-address",
                address,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )
        import tritonclient.grpc as grpcclient

        probe = grpcclient.InferenceServerClient(address)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if probe.is_server_ready():
                    break
            except Exception:
                pass
            time.sleep(0.2)
        proc = psutil.Process(daemon.pid)
        start = {"daemon_rss_bytes": proc.memory_info().rss, "shm_segments": segments(daemon.pid)}
        tally = Tally()
        stop = threading.Event()
        clients = [
            threading.Thread(target=client_loop, args=(address, tally, stop, i)) for i in range(args.clients)
        ]
        for t in clients:
            t.start()
        reloads = kills = 0
        version = 1
        t_end = time.monotonic() + args.duration
        next_reload, next_kill = time.monotonic() + 5, time.monotonic() + 7
        while time.monotonic() < t_end:
            now = time.monotonic()
            if now >= next_reload:
                version += 1
                publish(repo / "reloaded", version, float(version))
                reloads += 1
                next_reload = now + 5
            if now >= next_kill:
                workers = [c for c in proc.children() if _is_worker(c.cmdline())]
                if workers:  # any worker: models with one instance fail requests while it restarts
                    os.kill(random.choice(workers).pid, signal.SIGKILL)
                    kills += 1
                next_kill = now + 7
            time.sleep(0.1)
        stop.set()
        for t in clients:
            t.join(60)
        end = {"daemon_rss_bytes": proc.memory_info().rss, "shm_segments": segments(daemon.pid)}
        daemon.send_signal(signal.SIGTERM)
        exit_code = daemon.wait(120)
        log.close()
        result = {
            "machine": {
                "cpu": platform.processor() or platform.machine(),
                "cores": os.cpu_count(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "host": platform.platform(),
            },
            "duration_s": args.duration,
            "clients": args.clients,
            "reloads": reloads,
            "worker_kills": kills,
            "requests_sent": tally.sent,
            "answered_ok": tally.ok,
            "failed_by_status": dict(tally.failed),
            "lost": tally.sent - tally.ok - sum(tally.failed.values()),
            "start": start,
            "end": end,
            "shm_segments_after_exit": segments(daemon.pid),
            "daemon_exit_code": exit_code,
        }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    ok = result["lost"] == 0 and not result["shm_segments_after_exit"] and exit_code == 0
    print("PASS" if ok else "FAIL", "lost requests:", result["lost"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
