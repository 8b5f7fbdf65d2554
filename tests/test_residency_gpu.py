"""Eviction measured on a real CUDA GPU (skipped without one): two models whose caps together exceed the
GPU's budget; loading the second evicts the first, and the driver shows the first one's memory gone.

Each model's worker holds 8 GiB on the GPU from its start; its footprint is its cap, `memory_fraction` x
the GPU's total memory (from nvidia-smi), so 0.55 + 0.55 of the GPU do not fit a budget of 0.9.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import yaml

from tests.conftest import RunningDaemon, serving, wait_for

HAS_CUDA = torch.cuda.is_available() and shutil.which("nvidia-smi") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and nvidia-smi")]

HOLDS_8_GIB = """
import os, torch

class Model:
    def __init__(self, config, device):
        self.device = device
        self.block = torch.empty(8 * 2**30, dtype=torch.uint8, device=device)
        self.block.fill_(1)

    def infer(self, inputs):
        return {'y': inputs['x'] + 1, 'pid': torch.tensor([os.getpid()], dtype=torch.int64)}
"""


def gpu_model(repo: Path, name: str) -> None:
    model_dir = repo / name
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.py").write_text(HOLDS_8_GIB)
    config = {
        "backend": "python",
        "max_batch_size": 0,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [
            {"name": "y", "data_type": "TYPE_FP32", "dims": [-1]},
            {"name": "pid", "data_type": "TYPE_INT64", "dims": [1]},
        ],
        "instance_group": [{"kind": "KIND_GPU", "gpus": [0], "memory_fraction": 0.55}],
        "residency": {"load": "on_demand"},
    }
    (model_dir / "config.yaml").write_text(yaml.safe_dump(config))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("residency-gpu")
    repo = tmp / "repo"
    gpu_model(repo, "first")
    gpu_model(repo, "second")
    config = tmp / "mpsd.yaml"
    config.write_text(yaml.safe_dump({"residency": {"min_residency_s": 0}, "metrics_address": "off"}))
    with serving(repo, tmp / "daemon.log", config=config) as running:
        yield running


def gpu_processes() -> dict[int, int]:
    """pid -> MiB the driver says each process holds on the GPUs."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    held = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            held[int(pid)] = int(mib)
    return held


def infer(daemon: RunningDaemon, name: str) -> int:
    inp = grpcclient.InferInput("x", [2], "FP32")
    inp.set_data_from_numpy(np.ones(2, np.float32))
    result = daemon.client.infer(name, [inp])
    return int(result.as_numpy("pid")[0])  # type: ignore[index]


def test_loading_the_second_model_evicts_the_first_and_frees_its_gpu_memory(daemon: RunningDaemon) -> None:
    first = infer(daemon, "first")
    assert gpu_processes().get(first, 0) >= 8 * 1024
    second = infer(daemon, "second")
    assert gpu_processes().get(second, 0) >= 8 * 1024
    wait_for(lambda: first not in gpu_processes(), 30, "the first worker's GPU memory freed")
    unloads = [
        json.loads(line)
        for line in daemon.log().splitlines()
        if line.startswith("{") and '"model unloaded"' in line
    ]
    assert [(u["model"], u["reason"]) for u in unloads] == [("first", "evicted for 'second'")]
    status = subprocess.run(
        ["python3", "-m", "mpsd", "status", "--json", "--address", daemon.address],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    budget = next(b for b in json.loads(status)["budgets"] if b["device"] == "cuda:0")
    total = torch.cuda.get_device_properties(0).total_memory
    assert abs(budget["budget_bytes"] - 0.9 * total) < 2**20  # nvidia-smi's MiB against torch's bytes
