"""Scenario 2 (identity FP32[1,16], 16 requests in flight over several client connections) through three
ways of serving gRPC, side by side in interleaved rounds:

- `none`: no fronts, the daemon serves gRPC on its own event loop (what a Mac gets by default);
- `shared`: `front_processes: N`, N fronts on the daemon's port, connections spread by the kernel
  (SO_REUSEPORT; Linux only, skipped elsewhere);
- `own`: `front_ports`, N fronts each on a port of its own, every client channel spreading its calls over
  them with gRPC's round_robin (`mpsd.client.front_target`, `balanced_channel_args`): what macOS can use.

Each client process holds one channel (`--clients` of them, `--concurrency` calls in flight on each). For
each way: throughput, p50/p99, the CPU the daemon and its fronts spent per request, and each front's share
of the calls (ListWorkers).

Usage: python -m bench.front_ports --name front-ports-cpu-2core [--fronts 2] [--rounds 3] [--duration 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import psutil

from bench import common
from bench.loadgen import ClientPool, LoadSpec
from bench.models import Identity, identity_config, write_model
from mpsd.client import balanced_channel_args, front_target
from mpsd.proto import admin_pb2, admin_pb2_grpc

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "identity_16"


def handed(server: common.Server) -> list[int]:
    """ModelInfer calls each front has handed to the daemon so far, in front order."""
    with grpc.insecure_channel(server.address) as channel:
        stub = admin_pb2_grpc.MpsdAdminStub(channel)  # type: ignore[no-untyped-call]
        reply = stub.ListWorkers(admin_pb2.ListWorkersRequest(), timeout=10)
    return [int(f.requests) for f in sorted(reply.fronts, key=lambda f: f.index)]


def start(way: str, fronts: int, repo: Path, work: Path) -> common.Server:
    if way == "none":
        return common.start_mpsd(repo, work, way, front_processes="0")
    if way == "shared":
        return common.start_mpsd(repo, work, way, front_processes=str(fronts))
    ports = [common.free_port() for _ in range(fronts)]
    return common.start_mpsd(repo, work, way, front_processes="0", settings={"front_ports": ports})


def measure(
    way: str, server: common.Server, pool: ClientPool, args: argparse.Namespace, request: bytes
) -> dict[str, Any]:
    """One closed-loop run through `way`, with the server side's CPU per request and the fronts' shares."""
    options: tuple[tuple[str, Any], ...]
    target, options = server.address, ()
    if way == "own":
        target, options = front_target(server.address), tuple(balanced_channel_args())
    spec = LoadSpec(target, request, args.concurrency, args.duration, args.warmup, options=options)
    server_side, _ = common.server_groups(server.pid)
    clients = [psutil.Process(pid) for pid in pool.pids]
    cpu_before = [common.cpu_seconds(server_side), common.cpu_seconds(clients)]
    handed_before = handed(server)
    result = pool.run(spec)
    if result.errors:
        raise RuntimeError(f"{way}: {result.errors} requests failed: {result.first_error}")
    spent = [common.cpu_seconds(server_side) - cpu_before[0], common.cpu_seconds(clients) - cpu_before[1]]
    shares = [after - then for after, then in zip(handed(server), handed_before, strict=True)]
    total = sum(shares) or 1
    done = max(result.completed, 1)
    return {
        **common.summary_ms(result.latencies_ns),
        "throughput_rps": result.throughput,
        "cpu_us_per_request": {"server": spent[0] / done * 1e6, "clients": spent[1] / done * 1e6},
        "front_shares": [round(s / total, 3) for s in shares],
    }


def markdown(results: dict[str, Any]) -> str:
    ways = results["ways"]
    rounds = results["rounds"]
    machine, settings = results["machine"], results["settings"]
    lines = [
        f"# Scenario 2 through no fronts, shared-port fronts and own-port fronts ({results['name']})",
        "",
        f"{machine['cpu']}, {machine['logical_cores']} logical cores, {machine['os']}, Python "
        f"{machine['python']}, grpcio {machine['grpcio']}; {settings['fronts']} fronts; "
        f"{settings['clients']} client processes x {settings['concurrency']} in flight; "
        f"{len(rounds)} rounds of {settings['duration']:g} s; load average at start "
        f"{results['load_average_at_start'][0]:.1f}.",
        "",
        "| way | req/s (median) | per round | p50 ms | p99 ms | server CPU us/req | client CPU us/req "
        "| front shares |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for way in ways:
        runs = [r[way] for r in rounds]
        med = common.median([x["throughput_rps"] for x in runs])
        per = ", ".join(f"{x['throughput_rps']:.0f}" for x in runs)
        shares = " / ".join(
            "-".join(f"{s:.2f}" for s in x["front_shares"]) for x in runs if x["front_shares"]
        )
        lines.append(
            f"| {way} | {med:.0f} | {per} | {common.median([x['p50_ms'] for x in runs]):.2f} "
            f"| {common.median([x['p99_ms'] for x in runs]):.2f} "
            f"| {common.median([x['cpu_us_per_request']['server'] for x in runs]):.0f} "
            f"| {common.median([x['cpu_us_per_request']['clients'] for x in runs]):.0f} | {shares or '-'} |"
        )
    base = common.median([r["none"]["throughput_rps"] for r in rounds])
    lines += [
        "",
        "Throughput against no fronts (median of the rounds): "
        + ", ".join(
            f"{way} {common.median([r[way]['throughput_rps'] for r in rounds]) / base:.2f}x" for way in ways
        )
        + ".",
    ]
    return "\n".join(lines) + "\n"


def shown(path: Path) -> str:
    """A path as results name it: relative to the repository when inside it."""
    root = RESULTS.parent.parent
    resolved = path.resolve()
    return str(resolved.relative_to(root)) if resolved.is_relative_to(root) else str(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fronts", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4, help="client processes, one channel each")
    parser.add_argument("--concurrency", type=int, default=4, help="calls in flight per client process")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds measured per way and round")
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="front-ports-cpu")
    args = parser.parse_args()
    ways = ["none", *(["shared"] if sys.platform.startswith("linux") else []), "own"]
    work = Path(tempfile.mkdtemp(prefix="mpsd-front-ports-"))
    write_model(work / "repo", MODEL, Identity(), identity_config([1, 16], batching=True))
    request = common.infer_request(MODEL, [1, 16])
    started = time.time()
    results: dict[str, Any] = {
        "name": args.name,
        "machine": common.machine_info(),
        "load_average_at_start": os.getloadavg(),
        "settings": {k: shown(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "ways": ways,
        "rounds": [],
    }
    servers = {way: start(way, args.fronts, work / "repo", work) for way in ways}
    pool = ClientPool(args.clients)
    try:
        for server in servers.values():
            server.wait_ready()
        for r in range(args.rounds):
            row: dict[str, Any] = {"load_average_1m": os.getloadavg()[0]}
            k = r % len(ways)
            for way in ways[k:] + ways[:k]:
                row[way] = measure(way, servers[way], pool, args, request)
            results["rounds"].append(row)
            print(
                f"round {r + 1}: "
                + ", ".join(f"{w} {row[w]['throughput_rps']:.0f}/s {row[w]['front_shares']}" for w in ways)
                + f" [load {row['load_average_1m']:.1f}]",
                flush=True,
            )
    finally:
        pool.close()
        for server in servers.values():
            server.stop()
    results["load_average_at_end"] = os.getloadavg()
    results["wall_s"] = time.time() - started
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / args.name
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    print(f"written: {stem}.json, {stem}.md")


if __name__ == "__main__":
    main()
