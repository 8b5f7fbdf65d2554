"""Processes under test (the mpsd daemon, the floor server), machine description and statistics."""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
import yaml

from bench.cpus import cpu_name, pinned_to
from mpsd.daemon.supervise.fronts.pool import is_front_command
from mpsd.proto import grpc_service_pb2 as pb
from mpsd.proto import grpc_service_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exit_on_sigterm() -> None:
    """SIGTERM ends the benchmark as Ctrl-C does, through its `finally` blocks: the servers it started are
    stopped rather than left running in sessions of their own (`start_new_session`), which the signal
    to the benchmark does not reach. Only from the main thread, and only where nobody set a handler."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (
        signal.SIG_DFL,
        None,
    ):
        signal.signal(signal.SIGTERM, _exit_143)


def _exit_143(signum: int, frame: object) -> None:
    raise SystemExit(128 + signal.SIGTERM)


class Server:
    """A server process on loopback (mpsd or the floor), with a stub for control RPCs."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        address: str,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        cpus: Collection[int] | None = None,
    ):
        exit_on_sigterm()
        self.address = address
        self.http_address: str | None = None  # mpsd's HTTP/REST port
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.started_at = time.perf_counter()
        self.proc = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
            cwd=cwd or ROOT,
            preexec_fn=pinned_to(cpus),
        )
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)  # type: ignore[no-untyped-call]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Seconds from process start to the first ServerReady that says ready."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args!r} exited: {self.log_path.read_text(errors='replace')}")
            try:
                if self.stub.ServerReady(pb.ServerReadyRequest(), timeout=1.0).ready:
                    return time.perf_counter() - self.started_at
            except grpc.RpcError:
                pass
            time.sleep(0.01)
        raise TimeoutError(f"not ready after {timeout_s} s: {self.log_path.read_text(errors='replace')}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.channel.close()
        self._log.close()

    def memory(self) -> dict[str, Any]:
        """RSS and USS (memory only this process holds) of the server and of each child process."""

        def one(p: psutil.Process) -> dict[str, int]:
            info = p.memory_full_info()
            return {"pid": p.pid, "rss_bytes": info.rss, "uss_bytes": info.uss}

        parent = psutil.Process(self.pid)
        children = parent.children(recursive=True)
        return {
            "server": one(parent),
            "children": [one(c) for c in children if not is_front(c)],  # model workers
            "fronts": [one(c) for c in children if is_front(c)],
        }


def wait_models(server: Server, models: list[str], label: str, timeout_s: float = 120.0) -> None:
    """Until the server says each model is ready (a peer's ServerReady may come before its models are)."""
    deadline = time.monotonic() + timeout_s
    for model in models:
        while True:
            try:
                if server.stub.ModelReady(pb.ModelReadyRequest(name=model), timeout=2).ready:
                    break
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                log = server.log_path.read_text(errors="replace")
                raise TimeoutError(f"{label}: {model} not ready: {log}")
            time.sleep(0.05)


def start_mpsd(
    repo: Path,
    workdir: Path,
    name: str = "mpsd",
    env: dict[str, str] | None = None,
    front_processes: str | None = None,
    event_loop: str | None = None,
    settings: dict[str, Any] | None = None,
    cpus: Collection[int] | None = None,
    source: Path | None = None,
) -> Server:
    """`mpsd serve` with its defaults, except that the metrics endpoint is off (several may run) and,
    when given, the number of front processes, the event loop and other daemon settings; with `cpus`, the
    daemon runs on those CPUs only, and so do the fronts and workers it starts. With `source`, mpsd runs
    from that source tree (another checkout) instead of this one."""
    address = f"127.0.0.1:{free_port()}"
    config = workdir / f"{name}.yaml"
    http = f"127.0.0.1:{free_port()}"
    daemon: dict[str, Any] = {"model_repository": str(repo), "metrics_address": "", "http_address": http}
    if event_loop is not None:
        daemon["event_loop"] = event_loop
    config.write_text(yaml.safe_dump({**daemon, **(settings or {})}))
    args = [sys.executable, "-m", "mpsd", "serve", "--config", str(config), "--grpc-address", address]
    if front_processes is not None:
        args += ["--front-processes", front_processes]
    if source is not None:
        path = [str(source), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**(env or {}), "PYTHONPATH": os.pathsep.join(path)}
    server = Server(args, workdir / f"{name}.log", address, env, cwd=source, cpus=cpus)
    server.http_address = http
    return server


def start_floor(workdir: Path, reply_shape: list[int] | None = None, worker_hop: bool = False) -> Server:
    address = f"127.0.0.1:{free_port()}"
    args = [sys.executable, "-m", "bench.floor_server", "--address", address]
    if reply_shape:
        args += ["--reply-shape", *map(str, reply_shape)]
    if worker_hop:
        args.append("--worker-hop")
    return Server(args, workdir / ("floor-hop.log" if worker_hop else "floor.log"), address)


def batch_stats(server: Server, model: str) -> dict[int, dict[str, int]]:
    """Per batch size so far (ModelStatistics.batch_stats): executions and the worker's time in each
    phase (compute_input/infer/output, ns)."""
    reply = server.stub.ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=10)
    return {
        int(b.batch_size): {
            "count": int(b.compute_infer.count),
            "input_ns": int(b.compute_input.ns),
            "infer_ns": int(b.compute_infer.ns),
            "output_ns": int(b.compute_output.ns),
        }
        for s in reply.model_stats
        for b in s.batch_stats
    }


def request_stats(server: Server, model: str) -> dict[str, int]:
    """The model's request statistics so far (ModelStatistics.inference_stats): requests answered and the
    time they spent in the daemon, in its queue, and in each phase of their executions (ns, summed)."""
    reply = server.stub.ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=10)
    out = {"count": 0, "success_ns": 0, "queue_ns": 0, "input_ns": 0, "infer_ns": 0, "output_ns": 0}
    for s in reply.model_stats:
        stats = s.inference_stats
        out["count"] += int(stats.success.count)
        out["success_ns"] += int(stats.success.ns)
        out["queue_ns"] += int(stats.queue.ns)
        out["input_ns"] += int(stats.compute_input.ns)
        out["infer_ns"] += int(stats.compute_infer.ns)
        out["output_ns"] += int(stats.compute_output.ns)
    return out


def per_request_ms(after: dict[str, int], before: dict[str, int]) -> dict[str, float]:
    """Milliseconds per request answered between two `request_stats` readings, by part."""
    count = after["count"] - before["count"]
    if count <= 0:
        return {}
    return {k.removesuffix("_ns"): (after[k] - before[k]) / count / 1e6 for k in after if k != "count"}


def stats_delta(
    after: dict[int, dict[str, int]], before: dict[int, dict[str, int]]
) -> dict[int, dict[str, int]]:
    """What happened between two batch_stats readings (batch sizes with no new execution are left out)."""
    out = {}
    for size, now in after.items():
        was = before.get(size, {})
        diff = {k: v - was.get(k, 0) for k, v in now.items()}
        if diff["count"] > 0:
            out[size] = diff
    return out


def http_infer_request(model: str, shape: list[int], address: str, seed: int = 0) -> tuple[bytes, bytes]:
    """A whole HTTP/1.1 infer request with the same tensor as `infer_request` (FP32, random, never zeros) as
    binary data, the output asked for as binary data too; and the tensor's bytes."""
    import json

    data = np.random.default_rng(seed).standard_normal(shape).astype(np.float32).tobytes()
    binary = {"binary_data_size": len(data)}
    tensor = {"name": "INPUT", "shape": shape, "datatype": "FP32", "parameters": binary}
    header = json.dumps({"inputs": [tensor], "parameters": {"binary_data_output": True}}).encode()
    head = (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {address}\r\n"
        f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: {len(header)}\r\n"
        f"Content-Length: {len(header) + len(data)}\r\n\r\n"
    )
    return head.encode() + header + data, data


def infer_request(
    model: str, shape: list[int], datatype: str = "FP32", seed: int = 0, input_name: str | None = None
) -> bytes:
    """A serialized ModelInferRequest with random raw contents (never zeros)."""
    rng = np.random.default_rng(seed)
    dtype = {"FP32": np.float32, "FP16": np.float16}[datatype]
    data = rng.standard_normal(shape).astype(dtype).tobytes()
    name = input_name or ("INPUT" if model.startswith("identity") else "image")
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name=name, datatype=datatype, shape=shape)
    req.raw_input_contents.append(data)
    return bytes(req.SerializeToString())


def parse_response(data: bytes) -> Any:
    response = pb.ModelInferResponse()
    response.ParseFromString(data)
    return response


def summary_ms(latencies_ns: list[int]) -> dict[str, float]:
    if not latencies_ns:
        nan = float("nan")
        return {"count": 0, "p50_ms": nan, "p90_ms": nan, "p99_ms": nan, "mean_ms": nan}
    arr = np.asarray(latencies_ns, dtype=np.float64) / 1e6
    return {
        "count": len(latencies_ns),
        "p50_ms": float(np.percentile(arr, 50)),
        "p90_ms": float(np.percentile(arr, 90)),
        "p99_ms": float(np.percentile(arr, 99)),
        "mean_ms": float(arr.mean()),
    }


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def machine_info() -> dict[str, Any]:
    import google.protobuf  # type: ignore[import-untyped]
    import torch

    info: dict[str, Any] = {
        "cpu": cpu_name(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "grpcio": grpc.__version__,
        "protobuf": google.protobuf.__version__,
        "gpu": None,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def process_tree(pid: int) -> list[psutil.Process]:
    parent = psutil.Process(pid)
    return [parent, *parent.children(recursive=True)]


def is_front(p: psutil.Process) -> bool:
    """A daemon's gRPC front process (`python -m mpsd.front`), as opposed to a model worker."""
    try:
        return is_front_command(p.cmdline())
    except psutil.NoSuchProcess:
        return False


def profile_targets(server_pid: int, worker_pid: int) -> dict[str, int]:
    """Processes to profile: the daemon, the model's worker and, when there are fronts, the first one."""
    fronts = [p.pid for p in process_tree(server_pid)[1:] if is_front(p)]
    return {"daemon": server_pid, "worker": worker_pid, **({"front": fronts[0]} if fronts else {})}


def server_groups(pid: int) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """The server side (the daemon and its front processes) and the model workers, for CPU accounting."""
    tree = process_tree(pid)
    fronts = [p for p in tree[1:] if is_front(p)]
    return [tree[0], *fronts], [p for p in tree[1:] if p not in fronts]


def cpu_seconds(procs: list[psutil.Process]) -> float:
    """User plus system CPU time of the processes so far (ones that have exited count as zero)."""
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


class SharedInput:
    """One input tensor in a POSIX shared-memory object registered with the server (Triton's system
    shared-memory extension), and a request that names it instead of carrying the bytes. Every request in
    flight may name the same region: the server only reads inputs."""

    def __init__(self, server: Server, region: str, data: bytes) -> None:
        import _posixshmem
        import mmap

        self.server = server
        self.region = region
        self.key = f"/bench-{os.getpid()}-{region}"
        fd = _posixshmem.shm_open(self.key, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, len(data))
            with mmap.mmap(fd, len(data)) as mm:
                mm[:] = data
        finally:
            os.close(fd)
        self.nbytes = len(data)
        server.stub.SystemSharedMemoryRegister(
            pb.SystemSharedMemoryRegisterRequest(name=region, key=self.key, offset=0, byte_size=len(data)),
            timeout=10,
        )

    def request(self, model: str, input_name: str, datatype: str, shape: list[int]) -> bytes:
        req = pb.ModelInferRequest(model_name=model)
        tensor = req.inputs.add(name=input_name, datatype=datatype, shape=shape)
        tensor.parameters["shared_memory_region"].string_param = self.region
        tensor.parameters["shared_memory_byte_size"].int64_param = self.nbytes
        return bytes(req.SerializeToString())

    def close(self) -> None:
        import _posixshmem

        with contextlib.suppress(grpc.RpcError):
            self.server.stub.SystemSharedMemoryUnregister(
                pb.SystemSharedMemoryUnregisterRequest(name=self.region), timeout=10
            )
        with contextlib.suppress(FileNotFoundError):
            _posixshmem.shm_unlink(self.key)
