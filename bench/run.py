"""`make bench`: what mpsd adds to a request, against a bare Python gRPC server and in-process torch.

Scenarios, each run side by side with its references in interleaved rounds:
  1. identity FP32[1,16], one client: p50/p99 latency; mpsd vs the floor vs in-process
  2. identity FP32[1,16], 16 requests in flight: throughput; mpsd vs the floor
  3. identity FP32[1,3,224,224] (600 KB), one client: latency; mpsd vs the floor vs in-process
  4. small CNN on CPU, 32 clients: dynamic batching on vs off vs in-process at the batch sizes formed
  5. ResNet-50 on a CUDA GPU, 64 clients (`bench/gpu_resnet.py`; only where a GPU and torchvision are)
  6. start-up to ServerReady with 1, 4 and 8 models; RSS/USS of the daemon and of each worker
  7. identity FP32[1,16] on mpsd over HTTP (binary tensor data) vs over gRPC: one client, 16 in flight

Scenarios 1-3 also run MLServer (`bench/mlserver_peer.py`, a pinned version installed into
bench/.mlserver-venv on first use) as a peer, unless --no-mlserver or it cannot be installed, and Triton
(`bench/triton_peer.py`, the tritonserver of a pinned nvidia-pytriton installed into bench/.triton-venv on
first use, its python backend), unless --no-triton or it cannot be installed or run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench import common, cpus, mlserver_peer, peer_venv, profile, report, triton_peer
from bench.inprocess import InProcess, throughput_at
from bench.loadgen import ClientPool, LoadSpec
from mpsd.proto import grpc_service_pb2 as pb

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Ctx:
    args: argparse.Namespace
    work: Path
    pool: ClientPool
    mpsd: common.Server
    floor: common.Server
    inproc: InProcess
    floor_hop: common.Server
    peers: dict[str, common.Server]  # MLServer's configurations and Triton, where they run


def measure(
    pool: ClientPool,
    server: common.Server,
    request: bytes,
    concurrency: int,
    processes: int,
    duration_s: float,
    warmup_s: float,
    protocol: str = "grpc",
    connections: int = 1,
) -> dict[str, Any]:
    """One closed-loop measurement (`concurrency` requests in flight in each of `processes` client
    processes, over `connections` gRPC connections each), with the CPU time the server, its workers and
    the clients spent per request."""
    server_side, workers = common.server_groups(server.pid)
    clients = [psutil.Process(pid) for pid in pool.pids[:processes]]
    groups = [server_side, workers, clients, server_side[1:]]
    before = [common.cpu_seconds(g) for g in groups]
    address = server.http_address if protocol == "http" else server.address
    assert address is not None
    spec = LoadSpec(
        address, request, concurrency, duration_s, warmup_s, protocol=protocol, connections=connections
    )
    result = pool.run(spec, processes)
    after = [common.cpu_seconds(g) for g in groups]
    if result.errors:
        raise RuntimeError(f"{result.errors} requests failed: {result.first_error}")
    per = [(a - b) / max(result.completed, 1) * 1e6 for a, b in zip(after, before, strict=True)]
    return {
        **common.summary_ms(result.latencies_ns),
        "throughput_rps": result.throughput,
        # server: the daemon and its front processes together; fronts: their part of it.
        "cpu_us_per_request": {"server": per[0], "workers": per[1], "clients": per[2], "fronts": per[3]},
        "concurrency": concurrency * processes,
        "client_processes": processes,
    }


def run_load(
    ctx: Ctx,
    server: common.Server,
    request: bytes,
    concurrency: int,
    processes: int = 1,
    duration_s: float = 0,
    protocol: str = "grpc",
) -> dict[str, Any]:
    duration = duration_s or ctx.args.duration
    return measure(ctx.pool, server, request, concurrency, processes, duration, ctx.args.warmup, protocol)


def check_echo(server: common.Server, request: bytes) -> None:
    """The server answers the prepared request with the input's bytes (identity model / echo)."""
    req = pb.ModelInferRequest()
    req.ParseFromString(request)
    reply = server.stub.ModelInfer(req, timeout=30)
    if list(reply.outputs[0].shape) != list(req.inputs[0].shape):
        raise RuntimeError(f"{server.address}: output shape {list(reply.outputs[0].shape)}")
    if reply.raw_output_contents[0] != req.raw_input_contents[0]:
        raise RuntimeError(f"{server.address}: output bytes differ from the input")


def servers(ctx: Ctx) -> dict[str, common.Server]:
    return {"mpsd": ctx.mpsd, "floor": ctx.floor, "floor_hop": ctx.floor_hop, **ctx.peers}


def rotate(items: list[str], r: int) -> list[str]:
    k = r % len(items)
    return items[k:] + items[:k]


def scenario_latency(ctx: Ctx, model: str, shape: list[int]) -> dict[str, Any]:
    """mpsd vs the floor vs the model in-process, one request in flight."""
    request = common.infer_request(model, shape)
    for server in servers(ctx).values():
        check_echo(server, request)
    path = str(ctx.work / "repo" / model / "1" / "model.pt")
    rounds = []
    for r in range(ctx.args.rounds):
        row: dict[str, Any] = {"load_average_1m": os.getloadavg()[0]}
        for who in rotate(["mpsd", "floor", "inprocess", "floor_hop", *ctx.peers], r):
            if who == "inprocess":
                row[who] = common.summary_ms(ctx.inproc.latency(path, shape, ctx.args.duration))
            else:
                row[who] = run_load(ctx, servers(ctx)[who], request, 1)
        rounds.append(row)
        print(f"  round {r + 1}: {report.latency_line(row)}", flush=True)
    return {"model": model, "shape": shape, "request_bytes": len(request), "rounds": rounds}


def scenario_throughput(ctx: Ctx, model: str, shape: list[int], concurrency: int) -> dict[str, Any]:
    """mpsd vs the floor with `concurrency` requests in flight from one client process."""
    request = common.infer_request(model, shape)
    for server in ctx.peers.values():
        check_echo(server, request)
    rounds = []
    for r in range(ctx.args.rounds):
        row: dict[str, Any] = {"load_average_1m": os.getloadavg()[0]}
        for who in rotate(["mpsd", "floor", "floor_hop", *ctx.peers], r):
            before = common.batch_stats(ctx.mpsd, model) if who == "mpsd" else {}
            row[who] = run_load(ctx, servers(ctx)[who], request, concurrency)
            if who == "mpsd":
                row[who]["batches"] = common.stats_delta(common.batch_stats(ctx.mpsd, model), before)
        rounds.append(row)
        print(f"  round {r + 1}: {report.throughput_line(row)}", flush=True)
    return {"model": model, "shape": shape, "concurrency": concurrency, "rounds": rounds}


def check_http_echo(server: common.Server, request: bytes, data: bytes) -> None:
    """mpsd answers the prepared HTTP request with the input's bytes as binary data."""
    from bench.loadgen import _http_call

    assert server.http_address is not None
    host, _, port = server.http_address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        body = _http_call(sock, request, bytearray())
    if not body.endswith(data):
        raise RuntimeError(f"{server.http_address}: the HTTP answer does not end with the input's bytes")


def scenario_http(ctx: Ctx) -> dict[str, Any]:
    """The same small identity request to mpsd over HTTP (binary data) and over gRPC, in turn: one request
    in flight, then 16."""
    model, shape = "identity_16", [1, 16]
    grpc_request = common.infer_request(model, shape)
    assert ctx.mpsd.http_address is not None
    http_request, data = common.http_infer_request(model, shape, ctx.mpsd.http_address)
    check_echo(ctx.mpsd, grpc_request)
    check_http_echo(ctx.mpsd, http_request, data)
    rounds = []
    for r in range(ctx.args.rounds):
        row: dict[str, Any] = {"load_average_1m": os.getloadavg()[0]}
        for concurrency in (1, 16):
            for who in rotate(["grpc", "http"], r):
                request = http_request if who == "http" else grpc_request
                key = who if concurrency == 1 else f"{who}_16"
                row[key] = run_load(ctx, ctx.mpsd, request, concurrency, protocol=who)
        rounds.append(row)
        print(f"  round {r + 1}: {report.http_line(row)}", flush=True)
    return {"model": model, "shape": shape, "http_request_bytes": len(http_request), "rounds": rounds}


def scenario_batching(ctx: Ctx) -> dict[str, Any]:
    """The CNN with 32 clients: batching on vs off, and in-process torch at the batch sizes formed."""
    from bench.models import CNN_IMAGE

    shape = [1, *CNN_IMAGE]
    procs = ctx.args.cnn_client_processes
    per_proc = 32 // procs
    path = str(ctx.work / "repo" / "cnn_batched" / "1" / "model.pt")
    everything = cpus.usable_cpus()
    model_cpus = everything[-ctx.args.model_cpus :] if ctx.args.model_cpus else everything
    other_cpus = everything[: -ctx.args.model_cpus] if ctx.args.model_cpus else everything
    if ctx.args.model_cpus:
        # The model gets the same CPUs in mpsd's worker and in the in-process reference; the daemon, its
        # fronts and the load generator run on the others.
        server, workers = common.server_groups(ctx.mpsd.pid)
        cpus.pin_threads([w.pid for w in workers] + ctx.inproc.pids, model_cpus)
        cpus.pin_threads([p.pid for p in server] + ctx.pool.pids, other_cpus)
    try:
        rounds = batching_rounds(ctx, shape, procs, per_proc, path)
    finally:
        if ctx.args.model_cpus:
            cpus.pin_threads(
                [p.pid for p in common.process_tree(ctx.mpsd.pid)] + ctx.inproc.pids + ctx.pool.pids,
                everything,
            )
    return {
        "model": "cnn",
        "image": list(CNN_IMAGE),
        "clients": 32,
        "cpus": {"model": model_cpus, "server_and_clients": other_cpus},
        "model_threads": ctx.args.model_cpus or None,
        "rounds": rounds,
    }


def batching_rounds(ctx: Ctx, shape: list[int], procs: int, per_proc: int, path: str) -> list[dict[str, Any]]:
    from bench.models import CNN_IMAGE

    rounds = []
    for r in range(ctx.args.rounds):
        row: dict[str, Any] = {"load_average_1m": os.getloadavg()[0]}
        for who in rotate(["batched", "unbatched"], r):
            model = f"cnn_{who}"
            request = common.infer_request(model, shape, seed=r)
            before = common.batch_stats(ctx.mpsd, model)
            row[who] = run_load(ctx, ctx.mpsd, request, per_proc, procs, ctx.args.cnn_duration)
            row[who]["batches"] = common.stats_delta(common.batch_stats(ctx.mpsd, model), before)
        executions = {size: s["count"] for size, s in row["batched"]["batches"].items()}
        seconds = ctx.inproc.batch_seconds(path, CNN_IMAGE, executions)
        single = ctx.inproc.batch_seconds(path, CNN_IMAGE, {1: 1})
        row["inprocess"] = {
            "throughput_rps": throughput_at(executions, seconds["best"]),
            "throughput_rps_by_openmp": {
                label: throughput_at(executions, secs) for label, secs in seconds.items() if label != "best"
            },
            "seconds_by_batch": seconds,
            "batch1_throughput_rps": 1.0 / single["best"][1],
        }
        rounds.append(row)
        print(f"  round {r + 1}: {report.batching_line(row)}", flush=True)
    return rounds


def scenario_startup(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Time to ServerReady and memory, with 1, 4 and 8 identity models (one worker each)."""
    from bench.models import build_startup_repo

    out: dict[str, Any] = {"runs": []}
    for models in args.startup_models:
        repo = work / f"startup{models}"
        build_startup_repo(repo, models)
        for rep in range(args.startup_repeats):
            server = common.start_mpsd(repo, work, f"startup{models}_{rep}")
            try:
                ready_s = server.wait_ready()
                time.sleep(1.0)  # let the workers finish their first memory snapshot and settle
                memory = server.memory()
            finally:
                server.stop()
            run = {"models": models, "repeat": rep, "ready_s": ready_s, **memory}
            out["runs"].append(run)
            print(f"  {models} model(s), run {rep + 1}: {report.startup_line(run)}", flush=True)
    return out


def run_overhead(ctx: Ctx, only: set[str]) -> dict[str, Any]:
    scenarios: dict[str, Any] = {}
    if "1" in only:
        print("scenario 1: identity FP32[1,16], one client", flush=True)
        scenarios["1"] = scenario_latency(ctx, "identity_16", [1, 16])
    if "2" in only:
        print("scenario 2: identity FP32[1,16], 16 in flight", flush=True)
        scenarios["2"] = scenario_throughput(ctx, "identity_16", [1, 16], 16)
    if "3" in only:
        print("scenario 3: identity FP32[1,3,224,224], one client", flush=True)
        scenarios["3"] = scenario_latency(ctx, "identity_600k", [1, 3, 224, 224])
    if "4" in only:
        print("scenario 4: small CNN, 32 clients, batching on/off", flush=True)
        scenarios["4"] = scenario_batching(ctx)
    if "7" in only:
        print("scenario 7: identity FP32[1,16] over HTTP vs gRPC, 1 and 16 in flight", flush=True)
        scenarios["7"] = scenario_http(ctx)
    return scenarios


def profile_misses(ctx: Ctx, results: dict[str, Any], out_dir: Path) -> None:
    """py-spy on the daemon and the model's worker during one more mpsd run of each missed scenario."""
    from bench.models import CNN_IMAGE

    plans = {
        "1": ("identity_16", [1, 16], 1, 1),
        "2": ("identity_16", [1, 16], 16, 1),
        "3": ("identity_600k", [1, 3, 224, 224], 1, 1),
        "4": (
            "cnn_batched",
            [1, *CNN_IMAGE],
            32 // ctx.args.cnn_client_processes,
            ctx.args.cnn_client_processes,
        ),
    }
    for key, verdict in results["verdicts"].items():
        if verdict.get("met", True) or key not in plans or key not in results["scenarios"]:
            continue
        model, shape, concurrency, processes = plans[key]
        request = common.infer_request(model, shape)
        worker = profile.worker_pid(ctx.mpsd.log_path, model)
        print(f"profiling scenario {key} (daemon pid {ctx.mpsd.pid}, worker pid {worker})", flush=True)
        with profile.PySpy(
            out_dir / f"{ctx.args.name}-profile-s{key}",
            common.profile_targets(ctx.mpsd.pid, worker),
            ctx.args.duration + 1.0,
        ) as spy:
            run_load(ctx, ctx.mpsd, request, concurrency, processes)
        results["scenarios"][key]["profile"] = spy.summaries()


def run_gpu_scenario(args: argparse.Namespace) -> None:
    """Scenario 5 where a CUDA GPU and torchvision are present (its own results file); skipped otherwise."""
    import importlib.util

    import torch

    if not torch.cuda.is_available() or importlib.util.find_spec("torchvision") is None:
        print("scenario 5: skipped (needs a CUDA GPU and torchvision; see bench/README.md)", flush=True)
        return
    print("scenario 5: ResNet-50 on the GPU", flush=True)
    cmd = [sys.executable, "-m", "bench.gpu_resnet", "--out", str(args.out)]
    if args.quick:
        cmd += ["--rounds", "1", "--duration", "3", "--no-profile", "--name", "resnet50-gpu-quick"]
    subprocess.run(cmd, check=True, cwd=common.ROOT)
    print("compiled models and mixed precision: ResNet-50 on the GPU (bench/compiled.py)", flush=True)
    cmd = [sys.executable, "-m", "bench.compiled", "--out", str(args.out), "--clients", "128"]
    if args.quick:
        cmd += ["--rounds", "1", "--duration", "3", "--name", "compiled-gpu-quick"]
    if subprocess.run(cmd, check=False, cwd=common.ROOT).returncode != 0:
        print("bench/compiled.py failed (see its output above); the other results stand", flush=True)


# MLServer's configurations: side name -> parallel_workers (0: the model in the server's own process;
# 1, MLServer's default: one inference worker process).
PEERS = {"mlserver": 0, "mlserver_w1": 1}
TRITON = "triton"


def start_peers(args: argparse.Namespace, work: Path, only: set[str]) -> dict[str, common.Server]:
    """MLServer in its two configurations (bench/mlserver_peer.py) and Triton (bench/triton_peer.py) for
    scenarios 1-3, each where it installs and runs."""
    if not only & {"1", "2", "3"}:
        return {}
    peers: dict[str, common.Server] = {}
    python = None if args.no_mlserver else mlserver_peer.ensure_installed(args.mlserver_venv)
    if python is not None:
        peers.update(
            {name: mlserver_peer.start(python, work, workers, name) for name, workers in PEERS.items()}
        )
    python = None if args.no_triton else triton_peer.ensure_installed(args.triton_venv)
    if python is not None:
        peers[TRITON] = triton_peer.start(python, work, TRITON)
    return peers


def wait_peer_models(name: str, peer: common.Server) -> None:
    if name in PEERS:
        mlserver_peer.wait_models(peer)
    elif name == TRITON:
        triton_peer.wait_models(peer)


def triton_info(args: argparse.Namespace, peers: dict[str, common.Server]) -> dict[str, Any]:
    if TRITON not in peers:
        return {"skipped": "--no-triton" if args.no_triton else "could not be installed or run"}
    python = peer_venv.venv_python(args.triton_venv)
    return {
        "packages": triton_peer.PACKAGES,
        "versions": triton_peer.versions(python, peers[TRITON]),
        "model": "bench/triton_identity.py on the python backend, mpsd's identity configs (bench/models.py) "
        "with backend: python, one CPU instance",
        "settings": "tritonserver's defaults except loopback addresses and ports; CPU only",
    }


def baseline_info(tree: Path) -> dict[str, str]:
    """Which commit the baseline mpsd ran (a checkout given with --baseline-tree; an exported tree names
    its commit in a file COMMIT, as `git -C` would find the repository around it instead)."""
    named = tree / "COMMIT"
    if named.is_file():
        return {"commit": named.read_text().strip()}
    commit = subprocess.run(
        ["git", "-C", str(tree), "log", "-1", "--format=%h %s"], capture_output=True, text=True, check=False
    )
    return {"commit": commit.stdout.strip() or "unknown"}


def peer_info(args: argparse.Namespace, peers: dict[str, common.Server]) -> dict[str, Any]:
    if not any(name in PEERS for name in peers):  # a baseline checkout alone is no MLServer
        return {"skipped": "--no-mlserver" if args.no_mlserver else "could not be installed"}
    return {
        "packages": mlserver_peer.PACKAGES,
        "versions": mlserver_peer.versions(mlserver_peer.venv_python(args.mlserver_venv)),
        "configurations": {name: {"parallel_workers": workers} for name, workers in PEERS.items()},
        "runtime": "bench/mlserver_identity.py (NumpyCodec in, a copy of the array out)",
        "settings": "MLServer's defaults except debug (per-request access log) off and loopback ports",
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds measured per side and round")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds run before measuring")
    parser.add_argument("--cnn-duration", type=float, default=5.0)
    parser.add_argument("--cnn-client-processes", type=int, default=2)
    parser.add_argument("--cnn-delay-us", type=int, default=2000, help="max_queue_delay_microseconds")
    parser.add_argument("--startup-models", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--startup-repeats", type=int, default=3)
    parser.add_argument("--only", default="1,2,3,4,5,6,7", help="comma-separated scenarios")
    parser.add_argument("--no-profile", action="store_true", help="skip py-spy on missed targets")
    parser.add_argument(
        "--mpsd-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the daemon and its workers only (e.g. OMP_NUM_THREADS=8); repeatable",
    )
    parser.add_argument(
        "--front-processes", help="mpsd's front_processes for scenarios 1-4 (default: the daemon's, auto)"
    )
    parser.add_argument(
        "--event-loop",
        choices=["asyncio", "uvloop"],
        help="mpsd's event_loop for scenarios 1-4 (default: the daemon's, asyncio)",
    )
    parser.add_argument(
        "--model-cpus",
        type=int,
        default=None,
        help="scenario 4: CPUs (and threads) for the CNN, in mpsd's worker (intra_op_thread_count) and "
        "in-process alike; the daemon and the clients get the others (default: half of them; 0: no pinning, "
        "torch's defaults; on macOS, which cannot pin, only the thread counts apply)",
    )
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="another checkout of mpsd, run beside this one in scenarios 1-3 (a before/after in one run)",
    )
    parser.add_argument(
        "--baseline-event-loop",
        choices=["asyncio", "uvloop"],
        help="the baseline checkout's event_loop (default: --event-loop); the same tree with another loop "
        "compares the loops",
    )
    parser.add_argument(
        "--no-mlserver",
        action="store_true",
        help="scenarios 1-3 without MLServer (by default it runs beside mpsd, installed on first use)",
    )
    parser.add_argument(
        "--mlserver-venv",
        type=Path,
        default=mlserver_peer.DEFAULT_VENV,
        help="virtual environment for MLServer, made and filled on first use (default: %(default)s)",
    )
    parser.add_argument(
        "--no-triton",
        action="store_true",
        help="scenarios 1-3 without Triton (by default it runs beside mpsd, installed on first use)",
    )
    parser.add_argument(
        "--triton-venv",
        type=Path,
        default=triton_peer.DEFAULT_VENV,
        help="virtual environment for nvidia-pytriton's tritonserver, made and filled on first use "
        "(default: %(default)s)",
    )
    parser.add_argument("--quick", action="store_true", help="2 short rounds: a smoke test, not figures")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="overhead-cpu", help="results file stem")
    args = parser.parse_args()
    usable = len(cpus.usable_cpus())
    if args.model_cpus is None:
        args.model_cpus = usable // 2 if usable >= 2 else 0
    elif not 0 <= args.model_cpus < usable:
        parser.error(f"--model-cpus must leave CPUs for the servers and clients: 0 to {usable - 1} here")
    if args.quick:
        args.rounds, args.duration, args.cnn_duration, args.startup_repeats = 2, 1.0, 1.5, 1
    only = set(args.only.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="mpsd-bench-"))
    results: dict[str, Any] = {
        "machine": common.machine_info(),
        "load_average_at_start": os.getloadavg(),
        "settings": {k: (v if not isinstance(v, Path) else str(v)) for k, v in vars(args).items()},
        "load_generator": "client processes with raw grpc stubs sending pre-serialized requests "
        "(bench/loadgen.py); one blocking call at a time for latency, grpc.aio tasks for concurrency; "
        "for HTTP, whole pre-built HTTP/1.1 requests on raw keep-alive sockets, one per request in flight",
        "scenarios": {},
    }
    try:
        if only & {"1", "2", "3", "4", "7"}:
            from bench.models import build_overhead_repo

            build_overhead_repo(work / "repo", args.cnn_delay_us, args.model_cpus or None)
            pool = ClientPool(max(1, args.cnn_client_processes))
            mpsd_env = dict(item.split("=", 1) for item in args.mpsd_env)
            # The CNN's threads: as many in mpsd's workers (its intra_op_thread_count) as in the reference.
            inproc_env = {**os.environ, "OMP_NUM_THREADS": str(args.model_cpus)} if args.model_cpus else None
            inproc = InProcess(env=inproc_env)
            mpsd = common.start_mpsd(
                work / "repo",
                work,
                env=mpsd_env,
                front_processes=args.front_processes,
                event_loop=args.event_loop,
            )
            floor = common.start_floor(work)
            floor_hop = common.start_floor(work, worker_hop=True)
            peers = start_peers(args, work, only)
            if args.baseline_tree is not None and only & {"1", "2", "3"}:
                peers["mpsd_before"] = common.start_mpsd(
                    work / "repo",
                    work,
                    "mpsd-before",
                    env=mpsd_env,
                    front_processes=args.front_processes,
                    event_loop=args.baseline_event_loop or args.event_loop,
                    source=args.baseline_tree,
                )
                results["baseline"] = baseline_info(args.baseline_tree)
            try:
                print(f"mpsd ready in {mpsd.wait_ready():.1f} s; floor ready in {floor.wait_ready():.1f} s")
                floor_hop.wait_ready()
                for name, peer in peers.items():
                    print(f"{name} ready in {peer.wait_ready():.1f} s", flush=True)
                    wait_peer_models(name, peer)
                if only & {"1", "2", "3"}:
                    results["mlserver"] = peer_info(args, peers)
                    results["triton"] = triton_info(args, peers)
                ctx = Ctx(args, work, pool, mpsd, floor, inproc, floor_hop, peers)
                results["scenarios"].update(run_overhead(ctx, only))
                results["verdicts"] = report.verdicts(results["scenarios"])
                if not args.no_profile and not args.quick:
                    profile_misses(ctx, results, args.out)
            finally:
                mpsd.stop()
                floor.stop()
                floor_hop.stop()
                for peer in peers.values():
                    peer.stop()
                pool.close()
                inproc.close()
        if "5" in only:
            run_gpu_scenario(args)
        if "6" in only:
            print("scenario 6: start-up and memory", flush=True)
            results["scenarios"]["6"] = scenario_startup(args, work)
        results["verdicts"] = report.verdicts(results["scenarios"])
        results["load_average_at_end"] = os.getloadavg()
        results["wall_s"] = time.time() - started
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stem = args.out / (args.name + ("-quick" if args.quick else ""))
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    stem.with_suffix(".md").write_text(report.markdown(results))
    print(report.markdown(results))
    print(f"written: {stem}.json, {stem}.md ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
