"""Shape buckets and a worker's resident memory: many requests of random lengths against a small model served
with `shape_buckets` and the same model without, sampling each worker's RSS as they go.

The model (TorchScript, on the CPU): a linear layer over 16 features, then the mean over the real positions
of a variable-length sequence. With buckets the worker sees at most five lengths; without, every length
from 1 to 256. On a Mac the difference is MPS's graph cache, which keeps a graph per shape (not measured
here: this runs where the daemon runs, on the CPU); on the CPU it is what torch's allocator and the worker's
caches keep per shape.

Usage: python -m bench.buckets_rss [--requests 10000] [--out bench/results/buckets-rss-<host>.json]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
import yaml

from bench.common import Server, is_front, machine_info, start_mpsd
from mpsd.proto import grpc_service_pb2 as pb

FEATURES = 16
SIZES = [16, 32, 64, 128, 256]


class MaskedMean(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(FEATURES, FEATURES)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = mask.to(x.dtype).unsqueeze(-1)
        return (self.linear(x) * weights).sum(1) / weights.sum(1)


class Mean(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(FEATURES, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).mean(1)


def write_model(repo: Path, name: str, module: torch.nn.Module, buckets: dict[str, Any] | None) -> None:
    folder = repo / name
    (folder / "1").mkdir(parents=True)
    torch.jit.save(torch.jit.script(module), str(folder / "1" / "model.pt"))
    config: dict[str, Any] = {
        "backend": "torchscript",
        "max_batch_size": 8,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [-1, FEATURES]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [FEATURES]}],
        "instance_group": [{"kind": "KIND_CPU"}],
        "parameters": {"intra_op_thread_count": "1"},
        "dynamic_batching": {},
    }
    if buckets is not None:
        config["shape_buckets"] = buckets
    (folder / "config.yaml").write_text(yaml.safe_dump(config))


def worker_rss(server_pid: int, model: str) -> int:
    """The RSS of the model's worker (its command line names the model)."""
    for child in psutil.Process(server_pid).children(recursive=True):
        if not is_front(child) and any(model in part for part in child.cmdline()):
            return int(child.memory_info().rss)
    raise RuntimeError(f"no worker for {model}")


def run(server: Server, model: str, lengths: list[int]) -> dict[str, Any]:
    pid = server.pid
    samples = [(0, worker_rss(pid, model))]
    every = max(1, len(lengths) // 20)
    t0 = time.perf_counter()
    for i, length in enumerate(lengths, 1):
        x = np.random.default_rng(i).standard_normal((1, length, FEATURES)).astype(np.float32)
        request = pb.ModelInferRequest(model_name=model)
        request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
        request.raw_input_contents.append(x.tobytes())
        server.stub.ModelInfer(request, timeout=30)
        if i % every == 0:
            samples.append((i, worker_rss(pid, model)))
    seconds = time.perf_counter() - t0
    rss = [s[1] for s in samples]
    half = rss[len(rss) // 2]
    return {
        "requests": len(lengths),
        "distinct_lengths": len(set(lengths)),
        "seconds": round(seconds, 1),
        "rss_start_mib": round(rss[0] / 2**20, 1),
        "rss_half_mib": round(half / 2**20, 1),
        "rss_end_mib": round(rss[-1] / 2**20, 1),
        "rss_max_mib": round(max(rss) / 2**20, 1),
        "growth_second_half_mib": round((rss[-1] - half) / 2**20, 1),
        "samples": [(n, round(r / 2**20, 1)) for n, r in samples],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    random.seed(0)
    lengths = [random.randint(1, SIZES[-1]) for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = work / "repo"
        buckets = {
            "inputs": {"x": {"dim": 1, "sizes": SIZES}},
            "mask_input": {"name": "mask", "data_type": "TYPE_FP32"},
        }
        write_model(repo, "bucketed", MaskedMean(), buckets)
        write_model(repo, "plain", Mean(), None)
        server = start_mpsd(repo, work, front_processes="0")
        try:
            server.wait_ready()
            result = {
                "machine": {**machine_info(), "host": socket.gethostname()},
                "sizes": SIZES,
                "bucketed": run(server, "bucketed", lengths),
                "plain": run(server, "plain", lengths),
            }
        finally:
            server.stop()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
