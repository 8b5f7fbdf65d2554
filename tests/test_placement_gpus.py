"""An unpinned KIND_GPU model on a machine of several CUDA GPUs: one instance on each (skips elsewhere).

Where each worker runs is read from what the worker reports (ListWorkers: its device and index, by the
daemon's numbering of its GPUs) and, where nvidia-smi lists the workers' processes, from the driver
(compute apps by pid). A worker's environment cannot tell: the worker's process title rewrites the memory
/proc/PID/environ reads. The readings run here on a CPU worker; the placement itself needs two GPUs.
CPU workers' own placement on real workers too: a model's thread count, and a pinned daemon's cores.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from mpsd.proto import admin_pb2, admin_pb2_grpc
from tests import models
from tests.conftest import RunningDaemon, serving

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
CONTEXT_BYTES = 100 << 20  # a worker's CUDA context and model hold at least this much of its GPU


def reported_devices(daemon: RunningDaemon, model: str = "") -> dict[int, tuple[str, int | None]]:
    """Each running worker's pid -> (device kind, index) as the worker reported it once ready."""
    with grpc.insecure_channel(daemon.address) as channel:
        listed = admin_pb2_grpc.MpsdAdminStub(channel).ListWorkers(
            admin_pb2.ListWorkersRequest(model=model), timeout=10
        )
    return {
        w.pid: (w.device.kind, w.device.index if w.device.HasField("index") else None)
        for w in listed.workers
        if w.pid
    }


def gpus_by_pid(compute_apps: str, gpus: str) -> dict[int, int]:
    """pid -> the GPU's index, from `nvidia-smi --query-compute-apps=pid,gpu_uuid --format=csv,noheader`
    and `nvidia-smi --query-gpu=index,uuid --format=csv,noheader`."""
    index_of = {}
    for line in gpus.splitlines():
        if line.strip():
            index, uuid = (part.strip() for part in line.split(","))
            index_of[uuid] = int(index)
    placed = {}
    for line in compute_apps.splitlines():
        if line.strip():
            pid, uuid = (part.strip() for part in line.split(","))
            if uuid in index_of:
                placed[int(pid)] = index_of[uuid]
    return placed


def driver_placement() -> dict[int, int]:
    """What the driver says of the processes on each GPU (empty without nvidia-smi, or where it cannot see
    the processes, as in a container of its own PID namespace)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}

    def query(what: str) -> str:
        return subprocess.run(
            [smi, f"--query-{what}", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        ).stdout

    return gpus_by_pid(query("compute-apps=pid,gpu_uuid"), query("gpu=index,uuid"))


def test_the_driver_listing_is_read_by_pid() -> None:
    apps = "4242, GPU-aaaa\n4343, GPU-bbbb\n99, GPU-gone\n"
    gpus = "0, GPU-aaaa\n1, GPU-bbbb\n"
    assert gpus_by_pid(apps, gpus) == {4242: 0, 4343: 1}
    assert gpus_by_pid("", gpus) == {}


def test_a_workers_device_is_read_from_what_it_reports(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    models.add_sub(repo, instance_group=[{"kind": "KIND_CPU", "count": 2}])
    with serving(repo, tmp_path / "daemon.log") as daemon:
        reported = reported_devices(daemon, "add_sub")
        assert sorted(reported) == sorted(daemon.worker_pids())
        assert set(reported.values()) == {("cpu", None)}


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs")
def test_an_unpinned_gpu_model_gets_an_instance_on_every_gpu(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    models.add_sub(repo, instance_group=[{"kind": "KIND_GPU", "count": 1}])
    free_before = [torch.cuda.mem_get_info(i)[0] for i in range(GPUS)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    every_gpu = {"CUDA_VISIBLE_DEVICES": visible or ",".join(str(i) for i in range(GPUS))}
    daemon = RunningDaemon(repo, tmp_path / "daemon.log", env=every_gpu)  # not just the first (conftest)
    try:
        daemon.wait_ready()
        pids = daemon.worker_pids()
        assert len(pids) == GPUS, daemon.log()
        # Each reports its GPU by the daemon's numbering (inside, every worker sees its one GPU as cuda:0).
        reported = reported_devices(daemon)
        assert sorted(reported) == sorted(pids)
        assert sorted(reported.values()) == [("cuda", i) for i in range(GPUS)], reported
        on_gpus = driver_placement()
        if all(pid in on_gpus for pid in pids):  # the driver agrees, where it shows the processes
            assert len({on_gpus[pid] for pid in pids}) == GPUS, (on_gpus, reported)
        # Each GPU's own free memory fell: the workers really are on different GPUs.
        free_after = [torch.cuda.mem_get_info(i)[0] for i in range(GPUS)]
        assert all(b - a >= CONTEXT_BYTES for b, a in zip(free_before, free_after, strict=True)), (
            free_before,
            free_after,
        )
        a = np.arange(16, dtype=np.float32).reshape(1, 16)
        inputs = [grpcclient.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(a)
        for _ in range(8):
            result = daemon.client.infer("add_sub", inputs)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
    finally:
        daemon.stop()
        daemon.kill_group()


def test_a_real_worker_runs_with_the_models_thread_count(start_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """End to end: the parameter reaches torch in the worker process (the model reports its thread count)."""
    repo = tmp_path / "repo"
    for name, threads in (("one", "1"), ("two", "2")):
        models.python_model(
            repo,
            name,
            "return {'y': torch.full_like(inputs['x'], float(torch.get_num_threads()))}",
            instance_group=[{"kind": "KIND_CPU", "count": 1}],
            parameters={"intra_op_thread_count": threads},
        )
    daemon = start_daemon(repo)
    daemon.wait_ready()
    for name, threads in (("one", 1.0), ("two", 2.0)):
        inp = grpcclient.InferInput("x", [2], "FP32")
        inp.set_data_from_numpy(np.zeros(2, np.float32))
        assert daemon.client.infer(name, [inp]).as_numpy("y").tolist() == [threads, threads]


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity")
    or len(os.sched_getaffinity(0)) < 2
    or "OMP_NUM_THREADS" in os.environ,
    reason="needs sched_setaffinity (Linux), 2 CPUs to pin to 1, and torch's default thread count",
)
def test_a_pinned_daemons_cpu_worker_runs_torch_on_the_daemons_cores(start_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A daemon started on one CPU of several (as under `taskset -c`): a CPU model with no thread count of
    its own runs torch on one thread, the CPUs the worker may use, not one per CPU of the machine."""
    repo = tmp_path / "repo"
    models.python_model(
        repo,
        "threads",
        "return {'y': torch.full_like(inputs['x'], float(torch.get_num_threads()))}",
        instance_group=[{"kind": "KIND_CPU", "count": 1}],
    )
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mine)})  # this thread only; the daemon started from it inherits it
    try:
        daemon = start_daemon(repo)
    finally:
        os.sched_setaffinity(0, mine)
    daemon.wait_ready()
    inp = grpcclient.InferInput("x", [2], "FP32")
    inp.set_data_from_numpy(np.zeros(2, np.float32))
    assert daemon.client.infer("threads", [inp]).as_numpy("y").tolist() == [1.0, 1.0]
