"""The response cache: a cache hit against a model call, on the same model, side by side.

One TorchScript model (x + 1) served twice by one daemon: `cached` with `response_cache: {enable: true}`
and `plain` without. The client sends the same request again and again, so every request to `cached` after
the first is a hit. Small (FP32[1,16]) and 600 KB (FP32[1,3,224,224]) inputs; one client (latency) and 16
in flight (requests per second); interleaved rounds, medians.

    python -m bench.cache --out bench/results --name cache-cpu-2core
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
import yaml

from bench.common import machine_info, median, start_mpsd, summary_ms
from mpsd.proto import grpc_service_pb2 as pb
from mpsd.proto import grpc_service_pb2_grpc as pb_grpc

SHAPES = {"small": [1, 16], "600KB": [1, 3, 224, 224]}
MODELS = {"cache hit": "cached", "model call": "plain"}


class AddOne(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def build_repo(repo: Path, dims: list[int]) -> None:
    tensor = {"data_type": "TYPE_FP32", "dims": dims}
    for name in MODELS.values():
        (repo / name / "1").mkdir(parents=True)
        torch.jit.save(torch.jit.script(AddOne()), str(repo / name / "1" / "model.pt"))
        config = {
            "max_batch_size": 8,
            "input": [{"name": "x", **tensor}],
            "output": [{"name": "y", **tensor}],
            "response_cache": {"enable": name == "cached"},
        }
        (repo / name / "config.yaml").write_text(yaml.safe_dump(config))


async def measure(
    address: str, model: str, shape: list[int], seconds: float, in_flight: int
) -> dict[str, Any]:
    data = np.random.default_rng(0).random(shape, dtype=np.float32).tobytes()
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="x", datatype="FP32", shape=shape)
    request.raw_input_contents.append(data)
    async with grpc.aio.insecure_channel(
        address, options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    ) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        expected = (np.frombuffer(data, np.float32) + 1).tobytes()
        assert (await stub.ModelInfer(request)).raw_output_contents[0] == expected, f"{model} answered wrong"
        latencies: list[int] = []
        end = time.perf_counter() + seconds

        async def loop() -> None:
            while time.perf_counter() < end:
                t0 = time.perf_counter_ns()
                await stub.ModelInfer(request)
                latencies.append(time.perf_counter_ns() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(in_flight)))
        elapsed = time.perf_counter() - t0
    return {**summary_ms(latencies), "per_s": len(latencies) / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default="cache-cpu")
    args = parser.parse_args()
    results: dict[str, Any] = {"machine": machine_info(), "settings": vars(args) | {"out": str(args.out)}}
    rows: dict[str, dict[str, Any]] = {}
    t_start = time.perf_counter()
    for size, dims in SHAPES.items():
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            build_repo(work / "repo", dims[1:])
            server = start_mpsd(work / "repo", work, front_processes="0")
            try:
                server.wait_ready()
                for clients in (1, 16):
                    per_round: dict[str, list[dict[str, Any]]] = {kind: [] for kind in MODELS}
                    for _ in range(args.rounds):
                        for kind, model in MODELS.items():  # interleaved: both see the same machine
                            per_round[kind].append(
                                asyncio.run(measure(server.address, model, dims, args.seconds, clients))
                            )
                    key = f"{size}, {clients} in flight"
                    rows[key] = {
                        kind: {
                            "p50_ms": median([r["p50_ms"] for r in runs]),
                            "p99_ms": median([r["p99_ms"] for r in runs]),
                            "per_s": median([r["per_s"] for r in runs]),
                        }
                        for kind, runs in per_round.items()
                    }
                    rows[key]["hit / call, throughput"] = median(
                        [
                            h["per_s"] / c["per_s"]
                            for h, c in zip(per_round["cache hit"], per_round["model call"], strict=True)
                        ]
                    )
                    print(key, json.dumps(rows[key]), flush=True)
            finally:
                server.stop()
    results["rows"] = rows
    results["seconds"] = round(time.perf_counter() - t_start, 1)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=2) + "\n")
        (args.out / f"{args.name}.md").write_text(report(results))


def report(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        "# Response cache: a hit against a model call",
        "",
        f"- CPU: {m['cpu']}, {m['logical_cores']} logical cores; GPU: {m['gpu']}; torch {m['torch']}",
        f"- {results['settings']['rounds']} interleaved rounds of {results['settings']['seconds']} s per "
        "side; medians over rounds; the ratio is the median of per-round ratios.",
        "- The same TorchScript model (x + 1) with and without response_cache; the same request each time.",
        "",
        "| case | hit p50 ms | call p50 ms | hits/s | calls/s | hit / call |",
        "|---|---|---|---|---|---|",
    ]
    for key, row in results["rows"].items():
        h, c = row["cache hit"], row["model call"]
        lines.append(
            f"| {key} | {h['p50_ms']:.3f} | {c['p50_ms']:.3f} | {h['per_s']:.0f} | {c['per_s']:.0f} | "
            f"{row['hit / call, throughput']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
