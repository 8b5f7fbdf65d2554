"""Models that load on demand under a memory budget: the time to the first response of a cold model against
a warm one, and the throughput and hit rate of request streams over more models than the budget holds.

N identity models (FP32[1,16]) load on demand with a declared footprint of 100 MiB each; the CPU budget holds
K of them (`memory_budget_bytes`), `min_residency_s: 0`. One client sends one request at a time:

- cold / warm: the first request to each model (it loads: a worker starts, imports torch, loads and warms
  up the model) against 20 requests once it is loaded (p50);
- round robin over all N models, where every request finds its model evicted when N > K (least recently
  used is exactly the wrong guess for a cycle), beside the same stream with a budget that holds all N;
- skewed: 90% of the requests to two hot models, 10% to the others in turn.

A hit is a request whose model was loaded when it came: hits = requests - loads on demand in the window.

Usage: python -m bench.residency --out bench/results --name residency-cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import yaml

from bench.common import Server, infer_request, machine_info, start_mpsd
from bench.models import build_startup_repo

MIB = 2**20
MODELLED = "/inference.GRPCInferenceService/ModelInfer"


def loads(server: Server) -> int:
    """Loads on demand so far, from the daemon's events."""
    count = 0
    for line in server.log_path.read_text(errors="replace").splitlines():
        if '"model loaded"' in line and '"why": "request"' in line:
            count += 1
    return count


def stream(server: Server, names: Callable[[int], str], seconds: float) -> dict[str, Any]:
    """One request at a time to `names(i)` for `seconds`: requests, errors, loads, throughput, hit rate."""
    infer = server.channel.unary_unary(MODELLED)
    requests: dict[str, bytes] = {}
    before = loads(server)
    sent = errors = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        name = names(sent)
        body = requests.setdefault(name, infer_request(name, [1, 16]))
        try:
            infer(body, timeout=120)
        except grpc.RpcError:
            errors += 1
        sent += 1
    elapsed = time.perf_counter() - start
    missed = loads(server) - before
    return {
        "requests": sent,
        "errors": errors,
        "loads": missed,
        "seconds": round(elapsed, 2),
        "throughput_rps": round(sent / elapsed, 2),
        "hit_rate": round(1 - missed / sent, 3) if sent else None,
    }


def cold_and_warm(server: Server, models: int) -> list[dict[str, Any]]:
    infer = server.channel.unary_unary(MODELLED)
    rows = []
    for i in range(models):
        body = infer_request(f"identity_{i}", [1, 16])
        t0 = time.perf_counter()
        infer(body, timeout=300)
        cold_s = time.perf_counter() - t0
        warm = []
        for _ in range(20):
            t0 = time.perf_counter()
            infer(body, timeout=60)
            warm.append(time.perf_counter() - t0)
        rows.append(
            {"model": i, "cold_s": round(cold_s, 3), "warm_p50_ms": round(statistics.median(warm) * 1e3, 3)}
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def skewed(i: int, models: int) -> str:
    """Nine requests in ten to the two hot models, the tenth to the others in turn."""
    if i % 10:
        return f"identity_{i % 2}"
    return f"identity_{2 + (i // 10) % (models - 2)}"


def daemon(work: Path, name: str, models: int, fit: int) -> Server:
    repo = work / f"repo-{name}"
    build_startup_repo(repo, models)
    for config in repo.glob("*/config.yaml"):
        data = yaml.safe_load(config.read_text())
        data["residency"] = {"load": "on_demand", "footprint_bytes": 100 * MIB}
        config.write_text(yaml.safe_dump(data))
    budget = {"memory_budget_bytes": {"cpu": fit * 100 * MIB + MIB}, "residency": {"min_residency_s": 0}}
    server = start_mpsd(repo, work, name, settings=budget)
    server.wait_ready()
    return server


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    n, k = results["settings"]["models"], results["settings"]["fit"]
    cold = results["cold_and_warm"]
    lines = [
        f"# Load on demand and eviction, {m.get('cpu', '')} ({m.get('logical_cores', '?')} logical cores)",
        "",
        f"{n} identity models of 100 MiB (declared); the budget holds {k}. One client, one request at a",
        "time.",
        "",
        f"torch {m.get('torch')}, Python {m.get('python')}, {m.get('os')}. Concurrent load on the machine "
        "during the run is not controlled.",
        "",
        "| model | cold: time to first response (s) | warm p50 (ms) | cold / warm |",
        "|---|---|---|---|",
    ]
    for row in cold:
        ratio = row["cold_s"] * 1e3 / row["warm_p50_ms"]
        lines.append(
            f"| identity_{row['model']} | {row['cold_s']:.2f} | {row['warm_p50_ms']:.2f} | {ratio:.0f}x |"
        )
    lines += [
        "",
        "| workload | budget holds | requests | errors | loads | req/s | hit rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, held, row in results["streams"]:
        lines.append(
            f"| {label} | {held} of {n} | {row['requests']} | {row['errors']} | {row['loads']} | "
            f"{row['throughput_rps']} | {row['hit_rate']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--fit", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default="residency-cpu")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mpsd-bench-residency-"))
    n, k = args.models, args.fit
    results: dict[str, Any] = {"machine": machine_info(), "settings": vars(args) | {"out": str(args.out)}}
    streams: list[tuple[str, int, dict[str, Any]]] = []
    tight = daemon(work, "tight", n, k)
    try:
        results["cold_and_warm"] = cold_and_warm(tight, n)
        for label, names in (
            ("round robin", lambda i: f"identity_{i % n}"),
            (
                "skewed: 90% to 2 hot models",
                lambda i: f"identity_{i % 2}" if i % 10 else f"identity_{2 + (i // 10) % (n - 2)}",
            ),
        ):
            row = stream(tight, names, args.seconds)
            streams.append((label, k, row))
            print(label, json.dumps(row), flush=True)
    finally:
        tight.stop()
    roomy = daemon(work, "roomy", n, n)
    try:
        stream(roomy, lambda i: f"identity_{i % n}", 5.0)  # every model loaded once
        row = stream(roomy, lambda i: f"identity_{i % n}", args.seconds)
        streams.append(("round robin", n, row))
        print("round robin, all fit", json.dumps(row), flush=True)
    finally:
        roomy.stop()
    results["streams"] = streams
    text = markdown(results)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=2))
        (args.out / f"{args.name}.md").write_text(text)


if __name__ == "__main__":
    main()
