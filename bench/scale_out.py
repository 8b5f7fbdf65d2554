"""Throughput with 1, 2 and 4 daemons behind gRPC client-side balancing (round_robin with health checks,
`mpsd.client`): does serving scale with the number of daemons?

Each daemon serves the same repository: the small CNN of scenario 4 (3x64x64 images, dynamic batching up
to 32) on the CPU, or on a CUDA GPU with `--device cuda`, where daemon i sees GPU i modulo the GPUs there
are (`CUDA_VISIBLE_DEVICES`). The load is closed-loop: `--clients` client processes, each with one channel
to every daemon (target `ipv4:a,b,...`) and `--concurrency` requests in flight. Figures: throughput,
p50/p99, errors, and each daemon's share of the requests (from its statistics).

On a machine with fewer cores than daemons times what one daemon uses, more daemons only share the same
cores: the figures then show the balancing's cost and spread, not scaling. The question this answers
needs a GPU host with many cores (one daemon per GPU).

Usage: python -m bench.scale_out --out bench/results --name scale-out-cpu [--daemons 1,2,4] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import Server, infer_request, machine_info, start_mpsd, summary_ms
from bench.loadgen import ClientPool, LoadSpec
from bench.models import CNN_IMAGE, SmallCNN, cnn_config, write_model
from mpsd.client import balanced_target, service_config
from mpsd.proto import grpc_service_pb2 as pb

MODEL = "cnn"


def build_repo(repo: Path, device: str, delay_us: int) -> None:
    config = cnn_config(True, delay_us)
    if device == "cuda":
        config["instance_group"] = [{"kind": "KIND_GPU", "count": 1}]
    torch.manual_seed(0)
    write_model(repo, MODEL, SmallCNN(), config)


def served(server: Server) -> int:
    reply = server.stub.ModelStatistics(pb.ModelStatisticsRequest(name=MODEL), timeout=10)
    return sum(int(s.inference_stats.success.count) for s in reply.model_stats)


def run_fleet(args: argparse.Namespace, n: int, repo: Path, work: Path, pool: ClientPool) -> dict[str, Any]:
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    daemons = []
    try:
        for i in range(n):
            env = {"CUDA_VISIBLE_DEVICES": str(i % gpus)} if gpus else None
            daemons.append(
                start_mpsd(repo, work, f"mpsd{n}-{i}", env=env, front_processes=args.front_processes)
            )
        for daemon in daemons:
            daemon.wait_ready()
        options = (
            ("grpc.service_config", json.dumps(service_config(""))),
            ("grpc.service_config_disable_resolution", 1),
            ("grpc.enable_retries", 1),
        )
        spec = LoadSpec(
            address=balanced_target([d.address for d in daemons]),
            request=infer_request(MODEL, [1, *CNN_IMAGE]),
            concurrency=args.concurrency,
            duration_s=args.seconds,
            warmup_s=args.warmup,
            options=options,
        )
        before = [served(d) for d in daemons]
        result = pool.run(spec)
        shares = [served(d) - b for d, b in zip(daemons, before, strict=True)]
    finally:
        for daemon in daemons:
            daemon.stop()
    total = sum(shares) or 1
    return {
        "daemons": n,
        "throughput_rps": result.throughput,
        **summary_ms(result.latencies_ns),
        "errors": result.errors,
        "first_error": result.first_error,
        "requests_per_daemon": shares,
        "share_per_daemon": [round(s / total, 3) for s in shares],
    }


def report(data: dict[str, Any]) -> str:
    m = data["machine"]
    lines = [
        f"# Scale-out: {data['name']}",
        "",
        f"Machine: {m['cpu']}, {m['logical_cores']} logical cores, {m['memory_gib']} GiB, GPU: {m['gpu']}; "
        f"{m['os']}, torch {m['torch']}, grpcio {m['grpcio']}.",
        f"Small CNN on {data['device']}, {data['clients']} client processes x {data['concurrency']} "
        f"in flight, {data['seconds']} s per run after {data['warmup']} s of warm-up; client-side "
        "round_robin with health checks (`mpsd.client`).",
        "",
        "| daemons | throughput (req/s) | vs 1 daemon | p50 ms | p99 ms | errors | share per daemon |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = data["runs"][0]["throughput_rps"] or 1.0
    for r in data["runs"]:
        shares = ", ".join(f"{s:.2f}" for s in r["share_per_daemon"])
        lines.append(
            f"| {r['daemons']} | {r['throughput_rps']:.0f} | {r['throughput_rps'] / base:.2f}x | "
            f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['errors']} | {shares} |"
        )
    if data.get("note"):
        lines += ["", data["note"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--daemons", default="1,2,4", help="daemon counts to run, comma-separated")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight per client process")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--delay-us", type=int, default=2000, help="dynamic batching's max queue delay")
    parser.add_argument("--front-processes", help="each daemon's front_processes (default: auto)")
    parser.add_argument("--note", default="", help="a line for the report")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="scale-out")
    args = parser.parse_args()
    counts = [int(c) for c in args.daemons.split(",")]
    data: dict[str, Any] = {
        "name": args.name,
        "machine": machine_info(),
        "device": args.device,
        "clients": args.clients,
        "concurrency": args.concurrency,
        "seconds": args.seconds,
        "warmup": args.warmup,
        "note": args.note,
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="mpsd-scale-") as tmp:
        work = Path(tmp)
        build_repo(work / "repo", args.device, args.delay_us)
        pool = ClientPool(args.clients)
        try:
            for n in counts:
                started = time.perf_counter()
                run = run_fleet(args, n, work / "repo", work, pool)
                data["runs"].append(run)
                print(
                    f"{n} daemon(s): {run['throughput_rps']:.0f} req/s, p50 {run['p50_ms']:.1f} ms, "
                    f"errors {run['errors']}, shares {run['share_per_daemon']} "
                    f"({time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
        finally:
            pool.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (args.out / f"{args.name}.md").write_text(report(data))
    print(report(data))


if __name__ == "__main__":
    main()
