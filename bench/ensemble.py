"""A three-step ensemble against the same three models called by the client one after the other.

Three TorchScript models (each adds 1 to its input) and an ensemble of them, served by one daemon. The
client either sends the input to the ensemble once, or sends it to the first model, the first answer to
the second and the second's to the third, as a client without ensembles does. Both build each request
the same way (a ModelInferRequest with the tensor in raw contents). Small (FP32[1,16]) and 600 KB
(FP32[1,3,224,224]) inputs; one client (latency of a whole chain) and 16 chains in flight (chains per
second); interleaved rounds, medians.

    python -m bench.ensemble --out bench/results --name ensemble-cpu-2core
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

STEPS = ("step0", "step1", "step2")
SHAPES = {"small": [1, 16], "600KB": [1, 3, 224, 224]}


class AddOne(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def build_repo(repo: Path, dims: list[int]) -> None:
    tensor = {"data_type": "TYPE_FP32", "dims": dims}
    for name in STEPS:
        (repo / name / "1").mkdir(parents=True)
        torch.jit.save(torch.jit.script(AddOne()), str(repo / name / "1" / "model.pt"))
        config = {
            "max_batch_size": 8,
            "input": [{"name": "x", **tensor}],
            "output": [{"name": "y", **tensor}],
        }
        (repo / name / "config.yaml").write_text(yaml.safe_dump(config))
    names = ["IN", "a", "b", "OUT"]
    steps = [
        {"model_name": name, "input_map": {"x": names[i]}, "output_map": {"y": names[i + 1]}}
        for i, name in enumerate(STEPS)
    ]
    ensemble = {
        "backend": "ensemble",
        "max_batch_size": 8,
        "input": [{"name": "IN", **tensor}],
        "output": [{"name": "OUT", **tensor}],
        "ensemble_scheduling": {"step": steps},
    }
    (repo / "chain3" / "1").mkdir(parents=True)
    (repo / "chain3" / "config.yaml").write_text(yaml.safe_dump(ensemble))


def request(model: str, name: str, shape: list[int], data: bytes) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name=model)
    msg.inputs.add(name=name, datatype="FP32", shape=shape)
    msg.raw_input_contents.append(data)
    return msg


async def ensemble_call(stub: Any, shape: list[int], data: bytes) -> bytes:
    response = await stub.ModelInfer(request("chain3", "IN", shape, data))
    return bytes(response.raw_output_contents[0])


async def client_chain(stub: Any, shape: list[int], data: bytes) -> bytes:
    for model in STEPS:
        response = await stub.ModelInfer(request(model, "x", shape, data))
        data = response.raw_output_contents[0]
    return bytes(data)


CALLS = {"ensemble": ensemble_call, "client chain": client_chain}


async def measure(
    address: str, kind: str, shape: list[int], seconds: float, in_flight: int
) -> dict[str, Any]:
    data = np.random.default_rng(0).random(shape, dtype=np.float32).tobytes()
    call = CALLS[kind]
    async with grpc.aio.insecure_channel(
        address, options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    ) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        expected = (np.frombuffer(data, np.float32) + 3).tobytes()
        assert await call(stub, shape, data) == expected, f"{kind} answered wrong"
        latencies: list[int] = []
        end = time.perf_counter() + seconds

        async def loop() -> None:
            while time.perf_counter() < end:
                t0 = time.perf_counter_ns()
                await call(stub, shape, data)
                latencies.append(time.perf_counter_ns() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(in_flight)))
        elapsed = time.perf_counter() - t0
    return {**summary_ms(latencies), "chains_per_s": len(latencies) / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default="ensemble-cpu")
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
                    per_round: dict[str, list[dict[str, Any]]] = {kind: [] for kind in CALLS}
                    for _ in range(args.rounds):
                        for kind in CALLS:  # interleaved: both sides see the same machine
                            per_round[kind].append(
                                asyncio.run(measure(server.address, kind, dims, args.seconds, clients))
                            )
                    key = f"{size}, {clients} in flight"
                    rows[key] = {
                        kind: {
                            "p50_ms": median([r["p50_ms"] for r in runs]),
                            "p99_ms": median([r["p99_ms"] for r in runs]),
                            "chains_per_s": median([r["chains_per_s"] for r in runs]),
                        }
                        for kind, runs in per_round.items()
                    }
                    ratio = median(
                        [
                            e["chains_per_s"] / c["chains_per_s"]
                            for e, c in zip(per_round["ensemble"], per_round["client chain"], strict=True)
                        ]
                    )
                    rows[key]["ensemble / client chain, throughput"] = ratio
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
        "# Ensemble against the client-side chain",
        "",
        f"- CPU: {m['cpu']}, {m['logical_cores']} logical cores; GPU: {m['gpu']}; torch {m['torch']}",
        f"- {results['settings']['rounds']} interleaved rounds of {results['settings']['seconds']} s per "
        "side; medians over rounds; the ratio is the median of per-round ratios.",
        "- Three TorchScript models (x + 1) on the CPU; the client builds each request the same way for "
        "both.",
        "",
        "| case | ensemble p50 ms | chain p50 ms | ensemble chains/s | chain chains/s | ensemble / chain |",
        "|---|---|---|---|---|---|",
    ]
    for key, row in results["rows"].items():
        e, c = row["ensemble"], row["client chain"]
        lines.append(
            f"| {key} | {e['p50_ms']:.3f} | {c['p50_ms']:.3f} | {e['chains_per_s']:.0f} | "
            f"{c['chains_per_s']:.0f} | {row['ensemble / client chain, throughput']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
