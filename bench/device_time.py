"""The device's own compute time (timing events around the model call) beside the host's compute_infer
time, per execution, on a CUDA GPU: a chain of large FP16 matrix products, and ResNet-50 (torchvision
architecture, random weights, fp16) where torchvision is installed.

One client sends requests one at a time, so each execution is one request of the batch size named; the
figures are the means over `--requests` executions, from the HTTP statistics' `batch_stats` (host
`compute_infer`, and mpsd's `mpsd_device_compute`).

Usage (on a GPU machine): python -m bench.device_time --out bench/results --name device-time-h100
"""

from __future__ import annotations

import argparse
import json
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import torch
import yaml
from torch import nn

from bench.common import Server, infer_request, machine_info, start_mpsd

WIDTH = 4096
IMAGE = (3, 224, 224)
BATCHES = (1, 8, 32)


class MatMuls(nn.Module):
    """Eight [batch, 4096] x [4096, 4096] FP16 products: about 0.27 GFLOP per row."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.randn(8, WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(8):
            x = torch.relu(x @ self.weights[i])
        return x


def write(repo: Path, name: str, module: nn.Module, dims: list[int], out_dims: list[int]) -> None:
    module = module.eval().cuda().half()
    example = torch.randn((2, *dims), device="cuda", dtype=torch.float16)
    with torch.inference_mode():
        traced = torch.jit.trace(module, example)  # type: ignore[no-untyped-call]
    (repo / name / "1").mkdir(parents=True)
    torch.jit.save(traced, str(repo / name / "1" / "model.pt"))
    config = {
        "name": name,
        "backend": "torchscript",
        "max_batch_size": max(BATCHES),
        "input": [{"name": "x", "data_type": "TYPE_FP16", "dims": dims}],
        "output": [{"name": "y", "data_type": "TYPE_FP16", "dims": out_dims}],
        "instance_group": [{"kind": "KIND_GPU", "count": 1}],
    }
    (repo / name / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def batch_stats(server: Server, model: str) -> dict[int, dict[str, Any]]:
    with urllib.request.urlopen(f"http://{server.http_address}/v2/models/{model}/stats", timeout=10) as r:
        (entry,) = json.loads(r.read())["model_stats"]
    return {int(b["batch_size"]): b for b in entry["batch_stats"]}


def measure(server: Server, model: str, dims: list[int], requests: int) -> list[dict[str, Any]]:
    # Serialized requests on a plain channel: tritonclient's protobuf modules cannot share a process with
    # mpsd's (the same message names in one descriptor pool).
    limit = 256 * 1024 * 1024
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    channel = grpc.insecure_channel(server.address, options=options)
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    rows = []
    for batch in BATCHES:
        request = infer_request(model, [batch, *dims], "FP16", input_name="x")
        for _ in range(5):  # warm-up at this size (cuBLAS and cuDNN choose their kernels)
            infer(request)
        before = batch_stats(server, model).get(batch, {})
        for _ in range(requests):
            infer(request)
        after = batch_stats(server, model)[batch]

        def delta(
            key: str, field: str, after: dict[str, Any] = after, before: dict[str, Any] = before
        ) -> int:
            return int(after[key][field]) - int(before.get(key, {}).get(field, 0))

        executions = delta("compute_infer", "count")
        host_ms = delta("compute_infer", "ns") / executions / 1e6
        device_ms = delta("mpsd_device_compute", "ns") / delta("mpsd_device_compute", "count") / 1e6
        rows.append(
            {
                "model": model,
                "batch": batch,
                "executions": executions,
                "host_compute_infer_ms": round(host_ms, 4),
                "device_compute_ms": round(device_ms, 4),
                "device_over_host": round(device_ms / host_ms, 4),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"# Device time (timing events) vs host compute_infer, {m['gpu']}",
        "",
        f"{m['cpu']}, {m['logical_cores']} logical cores; torch {m['torch']}, CUDA {m.get('cuda')}.",
        f"One client, one request at a time, {results['requests']} executions per row after 5 warm-ups;",
        "means per execution.",
        "",
        "| model | batch | host compute_infer (ms) | device compute (ms) | device / host |",
        "|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        host, device = r["host_compute_infer_ms"], r["device_compute_ms"]
        lines.append(
            f"| {r['model']} | {r['batch']} | {host:.3f} | {device:.3f} | {r['device_over_host']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default="device-time")
    parser.add_argument("--requests", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = work / "repo"
        write(repo, "matmuls", MatMuls(), [WIDTH], [WIDTH])
        models = [("matmuls", [WIDTH])]
        try:
            import torchvision  # type: ignore[import-not-found]

            write(repo, "resnet50", torchvision.models.resnet50(weights=None), list(IMAGE), [1000])
            models.append(("resnet50", list(IMAGE)))
        except ImportError:
            print("torchvision not installed: ResNet-50 left out", flush=True)
        server = start_mpsd(repo, work)
        try:
            server.wait_ready()
            rows = [row for name, dims in models for row in measure(server, name, dims, args.requests)]
        finally:
            server.stop()
    results = {"machine": machine_info(), "requests": args.requests, "rows": rows}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=2) + "\n")
        (args.out / f"{args.name}.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
