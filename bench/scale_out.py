"""Throughput with 1, 2 and 4 daemons behind gRPC client-side balancing (round_robin with health checks,
`mpsd.client`) and behind HAProxy (deploy/haproxy/mpsd.cfg): does serving scale with the number of daemons?

Each daemon serves the same repository: the small CNN of scenario 4 (3x64x64 images, dynamic batching up
to 32) on the CPU, or on a CUDA GPU with `--device cuda`, where daemon i sees GPU i modulo the GPUs there
are (`CUDA_VISIBLE_DEVICES`). The load is closed-loop: client processes with `--concurrency` requests in
flight each, on one channel to every daemon (`--via client`: target `ipv4:a,b,...`) or to HAProxy
(`--via haproxy`: one address; HAProxy balances each call over the daemons). With `--via both` each fleet
of daemons is measured both ways. Figures: throughput, p50/p99, errors, each daemon's share of the requests
(from its statistics), and the CPU each part kept busy.

`--pin` splits the CPUs this process may use: a client share (`--client-cores`, default a quarter, at least
2), of which HAProxy gets `--proxy-cores` (default 1) of its own when it runs, and equal disjoint sets for
the daemons of the largest count run, one set each (cores left over stay idle). A daemon starts on its set,
and the fronts and workers it starts inherit it; the runs with fewer daemons use the first sets, so each
daemon has the same cores in every run. A pinned daemon's model runs `--instances` instances (default: its
cores minus one, at least one) of `--threads` torch threads each (default 1), the daemon left over being for
the daemon itself; front processes follow the daemon's `auto` (0 up to 4 cores) unless
`--front-processes` says otherwise. Without `--pin` nothing is pinned and every worker's torch sizes itself
to the machine: more daemons then only share the same cores.

Usage: python -m bench.scale_out --out bench/results --name scale-out-cpu [--daemons 1,2,4] [--pin]
       [--via client|haproxy|both] [--haproxy PATH] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    Server,
    cpu_seconds,
    infer_request,
    is_front,
    machine_info,
    process_tree,
    start_mpsd,
    summary_ms,
)
from bench.cpus import affinity, can_pin, pin_threads, usable_cpus
from bench.haproxy import HAProxy
from bench.loadgen import ClientPool, LoadResult, LoadSpec
from bench.models import CNN_IMAGE, SmallCNN, cnn_config, write_model
from mpsd.client import balanced_target, service_config
from mpsd.proto import grpc_service_pb2 as pb

MODEL = "cnn"
PATHS = {"client": ("client",), "haproxy": ("haproxy",), "both": ("client", "haproxy")}
PATH_NAMES = {"client": "client-side round_robin", "haproxy": "HAProxy"}
# HAProxy's backends for this bench's traffic (mpsd_http_big routes a model this repository does not have)
PROXY_BACKENDS = ("mpsd_grpc", "mpsd_http")


@dataclass
class CorePlan:
    """Which CPUs each part runs on (empty: not pinned)."""

    usable: list[int]
    clients: list[int] = field(default_factory=list)
    proxy: list[int] = field(default_factory=list)
    daemons: list[list[int]] = field(default_factory=list)  # one set per daemon of the largest count
    idle: list[int] = field(default_factory=list)
    shared: list[str] = field(default_factory=list)  # what had to share cores, on a machine too small


def plan_cores(
    usable: list[int], daemons: int, client_cores: int | None, proxy_cores: int, proxy: bool
) -> CorePlan:
    """Split `usable` CPUs into the client share (HAProxy's cores out of it when `proxy`) and `daemons`
    equal disjoint sets. Where there are too few CPUs for that, parts share cores, and the plan says so."""
    cpus = sorted(usable)
    plan = CorePlan(usable=cpus)
    share = client_cores if client_cores is not None else max(2, len(cpus) // 4)
    share = max(1, min(share, len(cpus) - 1)) if len(cpus) > 1 else 1
    client_share, pool = cpus[:share], cpus[share:] or cpus[:1]
    if len(cpus) == 1:
        plan.shared.append("clients and daemons share the only CPU")
    if proxy:
        if 0 < proxy_cores < len(client_share):
            plan.clients, plan.proxy = client_share[:-proxy_cores], client_share[-proxy_cores:]
        else:
            plan.clients, plan.proxy = client_share, client_share
            plan.shared.append("HAProxy shares the client cores")
    else:
        plan.clients = client_share
    per = len(pool) // daemons
    if per >= 1:
        plan.daemons = [pool[i * per : (i + 1) * per] for i in range(daemons)]
        plan.idle = pool[daemons * per :]
    else:
        plan.daemons = [[pool[i % len(pool)]] for i in range(daemons)]
        plan.shared.append(f"{daemons} daemons share {len(pool)} core(s)")
    return plan


def cpu_list(cpus: list[int]) -> str:
    """`0-3,8` for [0, 1, 2, 3, 8], as taskset writes it."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def model_layout(args: argparse.Namespace, daemon_cores: int | None) -> tuple[int, int | None]:
    """(instances, torch threads per instance; None: torch's default) of the model in each daemon."""
    instances = args.instances or (max(1, daemon_cores - 1) if daemon_cores else 1)
    threads = args.threads or (1 if daemon_cores else None)
    return instances, threads


def build_repo(repo: Path, device: str, delay_us: int, instances: int, threads: int | None) -> None:
    config = cnn_config(True, delay_us, threads)
    kind = "KIND_GPU" if device == "cuda" else "KIND_CPU"
    config["instance_group"] = [{"kind": kind, "count": instances}]
    torch.manual_seed(0)
    write_model(repo, MODEL, SmallCNN(), config)


def served(server: Server) -> int:
    reply = server.stub.ModelStatistics(pb.ModelStatisticsRequest(name=MODEL), timeout=10)
    return sum(int(s.inference_stats.success.count) for s in reply.model_stats)


def describe_daemon(server: Server, cpus: list[int]) -> dict[str, Any]:
    """What runs in the daemon's tree, and whether every process of it is on the daemon's cores."""
    tree = process_tree(server.pid)
    fronts = [p for p in tree[1:] if is_front(p)]
    on_cores = all(affinity(p.pid) == set(cpus) for p in tree) if cpus else None
    return {"cpus": cpus, "fronts": len(fronts), "workers": len(tree) - 1 - len(fronts), "pinned": on_cores}


def measure(
    pool: ClientPool, spec: LoadSpec, daemons: list[Server], proxy: HAProxy | None
) -> tuple[LoadResult, list[int], dict[str, Any]]:
    """Run the load; the requests each daemon served, and the cores each part kept busy meanwhile."""
    groups = {f"daemon{i + 1}": process_tree(d.pid) for i, d in enumerate(daemons)}
    clients = [p for pid in pool.pids for p in process_tree(pid)]
    proxies = process_tree(proxy.pid) if proxy else []
    before = [served(d) for d in daemons]
    cpu_before = {k: cpu_seconds(v) for k, v in groups.items()}
    client_before, proxy_before = cpu_seconds(clients), cpu_seconds(proxies)
    started = time.perf_counter()
    result = pool.run(spec)
    wall = time.perf_counter() - started
    shares = [served(d) - b for d, b in zip(daemons, before, strict=True)]
    busy = {
        "clients": round((cpu_seconds(clients) - client_before) / wall, 2),
        "proxy": round((cpu_seconds(proxies) - proxy_before) / wall, 2) if proxy else None,
        "daemons": [round((cpu_seconds(v) - cpu_before[k]) / wall, 2) for k, v in groups.items()],
    }
    return result, shares, busy


def run_fleet(
    args: argparse.Namespace, n: int, plan: CorePlan | None, repo: Path, work: Path, pool: ClientPool
) -> list[dict[str, Any]]:
    """Start `n` daemons (pinned to the plan's first `n` sets), measure them through each path, stop them."""
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    daemons: list[Server] = []
    runs = []
    request = infer_request(MODEL, [1, *CNN_IMAGE])
    try:
        for i in range(n):
            env = {"CUDA_VISIBLE_DEVICES": str(i % gpus)} if gpus else None
            cpus = plan.daemons[i] if plan else None
            settings = {"shutdown_grace_s": 0}  # no balancer to warn: stop at once
            daemons.append(
                start_mpsd(
                    repo,
                    work,
                    f"mpsd{n}-{i}",
                    env=env,
                    front_processes=args.front_processes,
                    settings=settings,
                    cpus=cpus,
                )
            )
        for daemon in daemons:
            daemon.wait_ready()
        layout = [describe_daemon(d, plan.daemons[i] if plan else []) for i, d in enumerate(daemons)]
        for path in PATHS[args.via]:
            proxy = None
            if path == "client":
                options: tuple[tuple[str, Any], ...] = (
                    ("grpc.service_config", json.dumps(service_config(""))),
                    ("grpc.service_config_disable_resolution", 1),
                    ("grpc.enable_retries", 1),
                )
                address = balanced_target([d.address for d in daemons])
            else:
                backends = [(d.address, d.http_address or "") for d in daemons]
                proxy = HAProxy(args.haproxy, backends, work, cpus=plan.proxy if plan else None)
                proxy.wait_all_up(PROXY_BACKENDS)
                options, address = (), proxy.grpc
            spec = LoadSpec(
                address=address,
                request=request,
                concurrency=args.concurrency,
                duration_s=args.seconds,
                warmup_s=args.warmup,
                options=options,
            )
            try:
                result, shares, busy = measure(pool, spec, daemons, proxy)
            finally:
                if proxy is not None:
                    proxy.stop()
            total = sum(shares) or 1
            runs.append(
                {
                    "path": path,
                    "daemons": n,
                    "throughput_rps": result.throughput,
                    **summary_ms(result.latencies_ns),
                    "errors": result.errors,
                    "first_error": result.first_error,
                    "requests_per_daemon": shares,
                    "share_per_daemon": [round(s / total, 3) for s in shares],
                    "cores_busy": busy,
                    "daemon_processes": layout,
                }
            )
    finally:
        for daemon in daemons:  # all signalled first: they stop together
            if daemon.proc.poll() is None:
                daemon.proc.terminate()
        for daemon in daemons:
            daemon.stop()
    return runs


def scaling(data: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per path: throughput with each daemon count over throughput with the fewest daemons."""
    out: dict[str, dict[str, float]] = {}
    for path in PATHS[data["via"]]:
        runs = [r for r in data["runs"] if r["path"] == path]
        if runs:
            base = runs[0]["throughput_rps"] or 1.0
            out[path] = {str(r["daemons"]): round(r["throughput_rps"] / base, 2) for r in runs}
    return out


def report(data: dict[str, Any]) -> str:
    m = data["machine"]
    model = data["model"]
    threads = model["torch_threads"] or "torch's default number of"
    lines = [
        f"# Scale-out: {data['name']}",
        "",
        f"Machine: {m['cpu']}, {m['logical_cores']} logical cores, {m['memory_gib']} GiB, GPU: {m['gpu']}; "
        f"{m['os']}, torch {m['torch']}, grpcio {m['grpcio']}.",
        f"Small CNN on {data['device']} (dynamic batching up to 32, {model['max_queue_delay_us']} us queue "
        f"delay), {model['instances']} instance(s) per daemon of {threads} torch thread(s) each; "
        f"{data['clients']} client processes x {data['concurrency']} in flight, {data['seconds']} s per run "
        f"after {data['warmup']} s of warm-up. Paths: "
        + "; ".join(
            {
                "client": "client-side round_robin with health checks (`mpsd.client`), one channel to every "
                "daemon",
                "haproxy": f"HAProxy {data['haproxy']} with deploy/haproxy/mpsd.cfg (gRPC over HTTP/2 end "
                "to end), one address",
            }[p]
            for p in PATHS[data["via"]]
        )
        + ".",
        "",
    ]
    pin = data["pinning"]
    if pin is None:
        lines.append("Nothing pinned: every process may run on every core.")
    else:
        sets = " | ".join(cpu_list(s) for s in pin["daemons"])
        lines.append(
            f"Pinned ({len(pin['usable'])} usable cores): clients on {cpu_list(pin['clients'])}"
            + (f", HAProxy on {cpu_list(pin['proxy'])}" if pin["proxy"] else "")
            + f"; daemon i on set i of {sets} ({len(pin['daemons'][0])} core(s) each)"
            + (f"; idle: {cpu_list(pin['idle'])}" if pin["idle"] else "")
            + ". Fronts and workers run on their daemon's cores."
        )
        if pin["shared"]:
            lines.append(f"Too few cores for disjoint sets: {'; '.join(pin['shared'])}.")
    first = data["runs"][0]["daemon_processes"][0] if data["runs"] else None
    if first is not None:
        lines.append(
            f"Each daemon: {first['fronts']} front process(es), {first['workers']} worker(s)"
            + ("; every process of it on its cores: checked." if first["pinned"] else ".")
        )
    fewest = min((r["daemons"] for r in data["runs"]), default=1)
    lines += [
        "",
        f"| path | daemons | throughput (req/s) | vs {fewest} daemon{'s' if fewest > 1 else ''} | p50 ms "
        "| p99 ms | errors | share per daemon "
        "| cores busy: clients / HAProxy / each daemon |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ratios = scaling(data)
    order = list(PATHS[data["via"]])
    for r in sorted(data["runs"], key=lambda r: (order.index(r["path"]), r["daemons"])):
        shares = ", ".join(f"{s:.2f}" for s in r["share_per_daemon"])
        busy = r["cores_busy"]
        proxy = "-" if busy["proxy"] is None else f"{busy['proxy']:.2f}"
        each = ", ".join(f"{b:.2f}" for b in busy["daemons"])
        lines.append(
            f"| {PATH_NAMES[r['path']]} | {r['daemons']} | {r['throughput_rps']:.0f} | "
            f"{ratios[r['path']][str(r['daemons'])]:.2f}x | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
            f"{r['errors']} | {shares} | {busy['clients']:.2f} / {proxy} / {each} |"
        )
    lines += ["", "Scaling (throughput over that with the fewest daemons, per path):"]
    for path, by_count in ratios.items():
        lines.append(f"- {PATH_NAMES[path]}: " + ", ".join(f"{n}: {x:.2f}x" for n, x in by_count.items()))
    if data.get("note"):
        lines += ["", data["note"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--daemons", default="1,2,4", help="daemon counts to run, comma-separated")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--via", choices=tuple(PATHS), default="client", help="balancing path(s)")
    parser.add_argument("--haproxy", default="haproxy", help="HAProxy binary (default: haproxy on PATH)")
    parser.add_argument("--pin", action="store_true", help="pin clients, HAProxy and each daemon to cores")
    parser.add_argument("--client-cores", type=int, help="with --pin: the client share (default: 1/4, >= 2)")
    parser.add_argument("--proxy-cores", type=int, default=1, help="with --pin: HAProxy's, out of the share")
    parser.add_argument("--clients", type=int, help="client processes (default: 2; pinned: one per core)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight per client process")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--delay-us", type=int, default=2000, help="dynamic batching's max queue delay")
    parser.add_argument("--instances", type=int, help="model instances per daemon (pinned default: cores-1)")
    parser.add_argument("--threads", type=int, help="torch threads per instance (pinned default: 1)")
    parser.add_argument("--front-processes", help="each daemon's front_processes (default: auto)")
    parser.add_argument("--note", default="", help="a line for the report")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="scale-out")
    args = parser.parse_args()
    counts = [int(c) for c in args.daemons.split(",")]
    proxy = "haproxy" in PATHS[args.via]
    haproxy_version = None
    if proxy:
        found = shutil.which(args.haproxy)
        if found is None:
            parser.error(f"no HAProxy binary at {args.haproxy!r} (--haproxy PATH)")
        args.haproxy = found
        version = subprocess.run([found, "-v"], capture_output=True, text=True, check=True).stdout.split()
        haproxy_version = version[2] if len(version) > 2 else "?"
    if args.pin and not can_pin():
        parser.error("--pin needs CPU affinity, which this system does not have (macOS)")
    machine = machine_info()
    plan = None
    if args.pin:
        usable = usable_cpus()
        plan = plan_cores(usable, max(counts), args.client_cores, args.proxy_cores, proxy)
        for line in plan.shared:
            print(f"warning: {line}", flush=True)
    instances, threads = model_layout(args, len(plan.daemons[0]) if plan else None)
    clients = args.clients or (len(plan.clients) if plan else 2)
    data: dict[str, Any] = {
        "name": args.name,
        "machine": machine,
        "device": args.device,
        "via": args.via,
        "haproxy": haproxy_version,
        "clients": clients,
        "concurrency": args.concurrency,
        "seconds": args.seconds,
        "warmup": args.warmup,
        "model": {
            "instances": instances,
            "torch_threads": threads,
            "max_queue_delay_us": args.delay_us,
            "front_processes": args.front_processes or "auto",
        },
        "pinning": asdict(plan) if plan else None,
        "note": args.note,
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="mpsd-scale-") as tmp:
        work = Path(tmp)
        build_repo(work / "repo", args.device, args.delay_us, instances, threads)
        if plan is not None:  # this process too (it only waits on the clients), all of its threads
            pin_threads([os.getpid()], plan.clients)
        pool = ClientPool(clients, cpus=plan.clients if plan else None)
        try:
            for n in counts:
                started = time.perf_counter()
                for run in run_fleet(args, n, plan, work / "repo", work, pool):
                    data["runs"].append(run)
                    print(
                        f"{n} daemon(s) via {run['path']}: {run['throughput_rps']:.0f} req/s, "
                        f"p50 {run['p50_ms']:.1f} ms, errors {run['errors']}, "
                        f"shares {run['share_per_daemon']}, cores busy {run['cores_busy']}",
                        flush=True,
                    )
                print(f"{n} daemon(s) done in {time.perf_counter() - started:.0f} s", flush=True)
                save(args.out, args.name, data)  # what is measured so far, should a later count fail
        finally:
            pool.close()
    print(report(data))


def save(out: Path, name: str, data: dict[str, Any]) -> None:
    data["scaling"] = scaling(data)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / f"{name}.md").write_text(report(data))


if __name__ == "__main__":
    main()
