"""Two ways of getting one answer from one daemon, measured side by side (bench/ensemble.py,
bench/cache.py): each side's call in a loop for some seconds, one client or several in flight, the sides
interleaved round by round so both see the same machine; small and 600 KB inputs, each size on a daemon
of its own."""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.common import machine_info, median, start_mpsd, summary_ms
from mpsd.proto import grpc_service_pb2 as pb
from mpsd.proto import grpc_service_pb2_grpc as pb_grpc

SHAPES = {"small": [1, 16], "600KB": [1, 3, 224, 224]}
# A side: (stub, shape, input bytes) -> the answer's bytes.
Side = Callable[[Any, list[int], bytes], Awaitable[bytes]]


def request(model: str, name: str, shape: list[int], data: bytes) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name=model)
    msg.inputs.add(name=name, datatype="FP32", shape=shape)
    msg.raw_input_contents.append(data)
    return msg


async def measure(
    address: str, side: Side, shape: list[int], expected: float, seconds: float, in_flight: int
) -> dict[str, Any]:
    """`in_flight` loops of `side` for `seconds`; the first answer must be the input plus `expected`."""
    data = np.random.default_rng(0).random(shape, dtype=np.float32).tobytes()
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        assert await side(stub, shape, data) == (np.frombuffer(data, np.float32) + expected).tobytes()
        latencies: list[int] = []
        end = time.perf_counter() + seconds

        async def loop() -> None:
            while time.perf_counter() < end:
                t0 = time.perf_counter_ns()
                await side(stub, shape, data)
                latencies.append(time.perf_counter_ns() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(in_flight)))
        elapsed = time.perf_counter() - t0
    return {**summary_ms(latencies), "per_s": len(latencies) / elapsed}


def run(
    description: str,
    default_name: str,
    build_repo: Callable[[Path, list[int]], None],
    sides: Mapping[str, Side],
    expected: float,
) -> None:
    """The command line of a side-by-side bench: rows per size and clients, written as JSON and markdown."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default=default_name)
    args = parser.parse_args()
    first, second = sides
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
                    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in sides}
                    for _ in range(args.rounds):
                        for kind, side in sides.items():
                            runs[kind].append(
                                asyncio.run(
                                    measure(server.address, side, dims, expected, args.seconds, clients)
                                )
                            )
                    key = f"{size}, {clients} in flight"
                    rows[key] = {
                        kind: {m: median([r[m] for r in per]) for m in ("p50_ms", "p99_ms", "per_s")}
                        for kind, per in runs.items()
                    }
                    rows[key]["ratio"] = median(
                        [a["per_s"] / b["per_s"] for a, b in zip(runs[first], runs[second], strict=True)]
                    )
                    print(key, json.dumps(rows[key]), flush=True)
            finally:
                server.stop()
    results["rows"] = rows
    results["seconds"] = round(time.perf_counter() - t_start, 1)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=2) + "\n")
        (args.out / f"{args.name}.md").write_text(report(results, description, first, second))


def report(results: dict[str, Any], description: str, first: str, second: str) -> str:
    m = results["machine"]
    lines = [
        f"# {description.strip().splitlines()[0]}",
        "",
        f"- CPU: {m['cpu']}, {m['logical_cores']} logical cores; GPU: {m['gpu']}; torch {m['torch']}",
        f"- {results['settings']['rounds']} interleaved rounds of {results['settings']['seconds']} s per "
        "side; medians over rounds; the ratio is the median of per-round ratios of requests per second.",
        "",
        f"| case | {first} p50 ms | {second} p50 ms | {first} /s | {second} /s | {first} / {second} |",
        "|---|---|---|---|---|---|",
    ]
    for key, row in results["rows"].items():
        a, b = row[first], row[second]
        lines.append(
            f"| {key} | {a['p50_ms']:.3f} | {b['p50_ms']:.3f} | {a['per_s']:.0f} | {b['per_s']:.0f} | "
            f"{row['ratio']:.2f}x |"
        )
    return "\n".join(lines) + "\n"
