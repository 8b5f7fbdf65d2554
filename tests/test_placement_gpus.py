"""An unpinned KIND_GPU model on a machine of several CUDA GPUs: one instance on each (skips elsewhere)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from tests import models
from tests.conftest import RunningDaemon

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
CONTEXT_BYTES = 100 << 20  # a worker's CUDA context and model hold at least this much of its GPU


def _visible(pid: int) -> str | None:
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        key, _, value = entry.partition(b"=")
        if key == b"CUDA_VISIBLE_DEVICES":
            return value.decode()
    return None


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs")
def test_an_unpinned_gpu_model_gets_an_instance_on_every_gpu(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    models.add_sub(repo, instance_group=[{"kind": "KIND_GPU", "count": 1}])
    free_before = [torch.cuda.mem_get_info(i)[0] for i in range(GPUS)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    expected = [e.strip() for e in visible.split(",")][:GPUS] if visible else [str(i) for i in range(GPUS)]
    every_gpu = {"CUDA_VISIBLE_DEVICES": visible or ",".join(str(i) for i in range(GPUS))}
    daemon = RunningDaemon(repo, tmp_path / "daemon.log", env=every_gpu)  # not just the first (conftest)
    try:
        daemon.wait_ready()
        pids = daemon.worker_pids()
        assert len(pids) == GPUS, daemon.log()
        assert sorted(_visible(pid) or "" for pid in pids) == sorted(expected)
        # Each reports its GPU by the daemon's numbering (inside, every worker sees its one GPU as cuda:0).
        ready = [json.loads(line) for line in daemon.log().splitlines() if '"worker ready"' in line]
        assert sorted(e["device_index"] for e in ready) == list(range(GPUS)), ready
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
