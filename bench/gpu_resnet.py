"""Scenario 5: ResNet-50 (torchvision architecture, random weights, fp16, TorchScript trace) on a GPU, 64
clients each sending one 3x224x224 image per request, dynamic batching on.

mpsd's throughput and p50/p99 are set against the same TorchScript file called in this process at the batch
sizes mpsd's batcher formed (read from ModelStatistics.batch_stats), in two ways:
  - host to host: the batch starts in host memory and the logits end there (the transfers mpsd also does);
  - on device: the batch is already on the GPU and the logits stay there (the model alone).
Rounds alternate: load through mpsd, then in-process at that round's batch mix, while the daemon idles.

Usage (on a GPU machine with torchvision): python -m bench.gpu_resnet --out bench/results
`--tiny --device cpu` runs the same steps with a small stand-in model on the CPU (a check of the script).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from bench import common, profile, report
from bench.front_ports import handed
from bench.inprocess import InProcess, throughput_at
from bench.loadgen import ClientPool
from bench.run import baseline_info, measure
from mpsd.proto import grpc_service_pb2 as pb

IMAGE = (3, 224, 224)


class TinyStandIn(nn.Module):
    """A stand-in with ResNet-50's input and output shapes, cheap enough to check the script on a CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 7, stride=8, padding=3)
        self.head = nn.Linear(16, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.stem(x)).mean((2, 3)))
        return out


def build_model(repo: Path, args: argparse.Namespace) -> Path:
    """repo/resnet50/{config.yaml,1/model.pt}; returns the model file."""
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    if args.tiny:
        module: nn.Module = TinyStandIn()
    else:
        import torchvision  # type: ignore[import-not-found]

        module = torchvision.models.resnet50(weights=None)
    module = module.eval().to(device=args.device, dtype=dtype)
    example = torch.randn((2, *IMAGE), device=args.device, dtype=dtype)
    with torch.inference_mode():
        traced = torch.jit.trace(module, example)  # type: ignore[no-untyped-call]
    path = repo / "resnet50" / "1" / "model.pt"
    path.parent.mkdir(parents=True)
    torch.jit.save(traced, str(path))
    wire = "TYPE_FP16" if dtype == torch.float16 else "TYPE_FP32"
    config = {
        "name": "resnet50",
        "backend": "torchscript",
        "max_batch_size": args.max_batch,
        "input": [{"name": "input", "data_type": wire, "dims": list(IMAGE)}],
        "output": [{"name": "logits", "data_type": wire, "dims": [1000]}],
        "instance_group": [
            {"kind": "KIND_GPU" if args.device == "cuda" else "KIND_CPU", "count": args.instances}
        ],
        "dynamic_batching": {
            "max_queue_delay_microseconds": args.delay_us,
            "preferred_batch_size": [args.max_batch],
        },
    }
    if args.cuda_graphs:
        config["optimization"] = {"cuda": {"graphs": True}}
    (repo / "resnet50" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class GpuSampler:
    """nvidia-smi's GPU utilization every 100 ms while a load runs (none where nvidia-smi is missing)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self.samples: list[float] = []

    def __enter__(self) -> GpuSampler:
        exe = shutil.which("nvidia-smi")
        if exe is not None:
            cmd = [exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100"]
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=10)
        self.samples = [float(x) for x in out.split() if x.replace(".", "", 1).isdigit()]

    @property
    def busy_percent(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a small stand-in instead of ResNet-50")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--client-processes", type=int, default=4)
    parser.add_argument(
        "--connections",
        type=int,
        default=1,
        help="gRPC connections per client process, its requests in flight spread over them in turn",
    )
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--delay-us", type=int, default=2000, help="max_queue_delay_microseconds")
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument(
        "--shm-inputs",
        action="store_true",
        help="clients pass the image through system shared memory instead of in the request",
    )
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--profile", action="store_true", help="py-spy even where the target is met")
    parser.add_argument(
        "--profile-rate",
        type=int,
        default=profile.RATE,
        help="py-spy's samples a second (default: %(default)s)",
    )
    parser.add_argument("--front-processes", help="mpsd's front_processes (default: the daemon's, auto)")
    parser.add_argument(
        "--event-loop", choices=["asyncio", "uvloop"], help="mpsd's event_loop (default: asyncio)"
    )
    parser.add_argument("--busy-poll-us", type=int, help="mpsd's busy_poll_us (default: the daemon's)")
    parser.add_argument("--gather-us", type=int, help="mpsd's gather_us (default: the daemon's)")
    parser.add_argument(
        "--beside-tree",
        type=Path,
        help="a second mpsd, from this checkout, measured next to the first in every round, first in every "
        "other one (a comparison that the host's drift between runs cannot tilt)",
    )
    parser.add_argument(
        "--beside-busy-poll-us",
        type=int,
        help="a second mpsd (this tree, unless --beside-tree) with this busy_poll_us, measured the same way",
    )
    parser.add_argument(
        "--beside-gather-us",
        type=int,
        help="a second mpsd (this tree, unless --beside-tree) with this gather_us, measured the same way",
    )
    parser.add_argument(
        "--beside-event-loop",
        choices=["asyncio", "uvloop"],
        help="a second mpsd (this tree, unless --beside-tree) on this event_loop, measured the same way",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="optimization.cuda.graphs on (recorded at the default sizes)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--name", default="resnet50-gpu")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="mpsd-bench-gpu-"))
    dtype_name = "float16" if args.device == "cuda" else "float32"
    wire = "FP16" if args.device == "cuda" else "FP32"
    results: dict[str, Any] = {
        "machine": common.machine_info(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "load_generator": f"{args.client_processes} client processes with raw grpc stubs, "
        f"{args.clients // args.client_processes} grpc.aio requests in flight each over {args.connections} "
        "connection(s), pre-serialized requests",
        "floor": "the bare grpc.aio server (bench/floor_server.py) answering each request with one FP16 "
        "[1,1000] tensor: what Python gRPC alone can take in at this request size",
    }
    try:
        model_path = build_model(work / "repo", args)
        print(f"model written ({time.time() - started:.0f} s)", flush=True)
        pool = ClientPool(args.client_processes)
        inproc = InProcess(openmp_variants=args.device == "cpu")
        settings = _settings(args.busy_poll_us, args.gather_us)
        server = common.start_mpsd(
            work / "repo",
            work,
            front_processes=args.front_processes,
            event_loop=args.event_loop,
            settings=settings,
        )
        floor = common.start_floor(work, [1, 1000])
        beside = start_beside(args, work)
        per_proc = args.clients // args.client_processes

        def load(target: common.Server, req: bytes, duration: float, warmup: float) -> dict[str, Any]:
            """One closed-loop run against `target`; through fronts, with each front's share of it."""
            fronts_before = handed(target) if target is not floor else []
            got = measure(
                pool,
                target,
                req,
                per_proc,
                args.client_processes,
                duration,
                warmup,
                connections=args.connections,
            )
            if fronts_before:
                now = [n - b for n, b in zip(handed(target), fronts_before, strict=True)]
                got["front_shares"] = [round(n / max(sum(now), 1), 3) for n in now]
            return got

        shared: common.SharedInput | None = None
        try:
            results["ready_s"] = server.wait_ready()
            floor.wait_ready()
            if beside is not None:
                beside.wait_ready()
                results["beside"] = beside_info(args)
            print(f"mpsd ready in {results['ready_s']:.1f} s", flush=True)
            request = common.infer_request("resnet50", [1, *IMAGE], wire, input_name="input")
            floor_request = request
            if args.shm_inputs:  # the image in shared memory; the floor still gets it in the message
                req = pb.ModelInferRequest()
                req.ParseFromString(request)
                shared = common.SharedInput(server, "image", req.raw_input_contents[0])
                request = shared.request("resnet50", "input", wire, [1, *IMAGE])
            # Warm-up at the batch sizes the load will form (the TorchScript executor specializes per shape).
            load(server, request, args.warmup * 2, 0.0)
            if beside is not None:
                load(beside, request, args.warmup * 2, 0.0)
            rounds = []
            for r in range(args.rounds):
                before = daemon_stats(server)
                beside_before = daemon_stats(beside) if beside is not None else None
                row: dict[str, Any] = {}
                # The second mpsd goes before the first in every other round: neither always goes second.
                order = [beside, server] if beside is not None and r % 2 else [server, beside]
                for target in order:
                    if target is beside and beside is not None:
                        row["beside"] = load(beside, request, args.duration, args.warmup)
                    elif target is server:
                        with GpuSampler() as gpu:
                            row["mpsd"] = load(server, request, args.duration, args.warmup)
                        row["mpsd"]["gpu_busy_percent"] = gpu.busy_percent
                row["floor"] = load(floor, floor_request, args.duration, args.warmup)
                # The batches formed, and where a request's time went inside the daemon (the rest of what
                # its client saw was gRPC, the fronts and the client); the same for the second daemon.
                row["mpsd"] |= daemon_delta(server, before)
                if beside is not None and beside_before is not None:
                    row["beside"] |= daemon_delta(beside, beside_before)
                executions = {size: s["count"] for size, s in row["mpsd"]["batches"].items()}
                variants = [("inprocess_host_to_host", True, False), ("inprocess_on_device", False, False)]
                if args.cuda_graphs:  # the same technique in-process: mpsd's edge from it is only the graphs
                    variants.append(("inprocess_graphs_host_to_host", True, True))
                    # The GPU's best: full batches already on the device, replayed as a CUDA graph.
                    full = {args.max_batch: 1}
                    secs = inproc.batch_seconds(
                        str(model_path), IMAGE, full, dtype_name, args.device, 0.1, False, True
                    )
                    row["inprocess_full_batch_graphs_on_device"] = {
                        "throughput_rps": throughput_at(full, secs["best"]),
                        "seconds_by_batch": secs,
                    }
                for label, h2h, graphs in variants:
                    secs = inproc.batch_seconds(
                        str(model_path), IMAGE, executions, dtype_name, args.device, 0.1, h2h, graphs
                    )
                    row[label] = {
                        "throughput_rps": throughput_at(executions, secs["best"]),
                        "seconds_by_batch": secs,
                    }
                rounds.append(row)
                print(f"  round {r + 1}: {round_line(row)}", flush=True)
            results["rounds"] = rounds
            results["summary"] = summarize(rounds)
            check = results["summary"]["ratio_throughput_mpsd_inprocess"] >= report.TARGETS["5"][0][2]
            if (args.profile or not check) and not args.no_profile:
                worker = profile.worker_pid(server.log_path, "resnet50")
                with profile.PySpy(
                    args.out / f"{args.name}-profile",
                    common.profile_targets(server.pid, worker),
                    6,
                    args.profile_rate,
                ) as spy:
                    load(server, request, 6.0, 0.5)
                results["profile"] = spy.summaries()
        finally:
            if shared is not None:
                shared.close()
            server.stop()
            floor.stop()
            if beside is not None:
                beside.stop()
            pool.close()
            inproc.close()
        results["wall_s"] = time.time() - started
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["verdicts"] = report.verdicts({"5": {"summary": results.get("summary", {})}})
    stem = args.out / args.name
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    stem.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


Stats = tuple[dict[int, dict[str, int]], dict[str, int]]


def daemon_stats(target: common.Server) -> Stats:
    """A daemon's batch and request statistics so far."""
    return common.batch_stats(target, "resnet50"), common.request_stats(target, "resnet50")


def daemon_delta(target: common.Server, before: Stats) -> dict[str, Any]:
    """The batches a daemon formed since `before`, and where its requests' time went meanwhile."""
    batches, requests = daemon_stats(target)
    was_batches, was_requests = before
    return {
        "batches": common.stats_delta(batches, was_batches),
        "in_daemon_ms": common.per_request_ms(requests, was_requests),
    }


def start_beside(args: argparse.Namespace, work: Path) -> common.Server | None:
    """The second mpsd of --beside-tree / --beside-busy-poll-us (same model repository), or None."""
    if all(
        v is None
        for v in (args.beside_tree, args.beside_busy_poll_us, args.beside_gather_us, args.beside_event_loop)
    ):
        return None
    settings = _settings(args.beside_busy_poll_us, args.beside_gather_us)
    return common.start_mpsd(
        work / "repo",
        work,
        name="mpsd-beside",
        front_processes=args.front_processes,
        event_loop=args.beside_event_loop or args.event_loop,
        settings=settings,
        source=args.beside_tree,
    )


def beside_info(args: argparse.Namespace) -> dict[str, Any]:
    info: dict[str, Any] = {}
    if args.beside_tree is not None:
        info |= baseline_info(args.beside_tree)
    if args.beside_busy_poll_us is not None:
        info["busy_poll_us"] = args.beside_busy_poll_us
    if args.beside_gather_us is not None:
        info["gather_us"] = args.beside_gather_us
    if args.beside_event_loop is not None:
        info["event_loop"] = args.beside_event_loop
    return info


def _settings(busy_poll_us: int | None, gather_us: int | None) -> dict[str, int] | None:
    """The daemon config's event-loop settings that were given (None: the daemon's defaults)."""
    given = {"busy_poll_us": busy_poll_us, "gather_us": gather_us}
    return {k: v for k, v in given.items() if v is not None} or None


def round_line(row: dict[str, Any]) -> str:
    m = row["mpsd"]
    return (
        f"mpsd {m['throughput_rps']:.0f}/s (p50 {m['p50_ms']:.1f} ms, p99 {m['p99_ms']:.1f} ms, mean batch "
        f"{report.mean_batch(m['batches']):.1f}, GPU busy {_pct(m['gpu_busy_percent'])}); in-process "
        f"host-to-host {row['inprocess_host_to_host']['throughput_rps']:.0f}/s, on-device "
        f"{row['inprocess_on_device']['throughput_rps']:.0f}/s"
        + (
            f", host-to-host with CUDA graphs {row['inprocess_graphs_host_to_host']['throughput_rps']:.0f}/s"
            if "inprocess_graphs_host_to_host" in row
            else ""
        )
        + f"; floor {row['floor']['throughput_rps']:.0f}/s"
        + (f"; beside {beside_round(row['beside'])}" if "beside" in row else "")
        + (f"; fronts' shares {m['front_shares']}" if m.get("front_shares") else "")
        + (
            f"; in the daemon {d['success']:.1f} ms a request, {d['queue']:.1f} of it queued"
            if (d := m.get("in_daemon_ms"))
            else ""
        )
    )


def beside_round(b: dict[str, Any]) -> str:
    """The second daemon's round: throughput, latency, batches and its requests' time inside it."""
    d = b.get("in_daemon_ms") or {}
    return (
        f"{b['throughput_rps']:.0f}/s (p50 {b['p50_ms']:.1f} ms"
        + (f", mean batch {report.mean_batch(b['batches']):.1f}" if b.get("batches") else "")
        + (f", in the daemon {d['success']:.1f} ms a request, {d['queue']:.1f} of it queued" if d else "")
        + ")"
    )


def beside_lines(results: dict[str, Any]) -> list[str]:
    """The second mpsd's line, when one ran (--beside-tree / --beside-busy-poll-us)."""
    b = results.get("summary", {}).get("beside")
    if b is None:
        return []
    what = ", ".join(f"{k} {v}" for k, v in results.get("beside", {}).items())
    best = b.get("ratio_throughput_full_batch_graphs_on_device")
    return [
        f"Beside it, measured next to it in each round (first in every other one), mpsd ({what}): "
        f"{b['throughput_rps']:.0f} images/s, p50 {b['p50_ms']:.1f} ms, daemon and fronts "
        f"{b['server_cpu_us_per_request']:.0f} us of CPU per request"
        + (f", mean batch {b['mean_batch']:.1f}" if b.get("mean_batch") else "")
        + (f", x{best:.2f} the GPU's best" if best is not None else "")
        + f"; mpsd / beside, median of the rounds' ratios: x{b['ratio_throughput_mpsd_beside']:.2f}."
    ]


def _pct(value: float | None) -> str:
    return "n/a" if value is None or value != value else f"{value:.0f}%"


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    med = report.med
    mp = [r["mpsd"] for r in rounds]
    sizes: dict[int, dict[str, int]] = {}
    for m in mp:
        for size, st in m["batches"].items():
            acc = sizes.setdefault(int(size), {"count": 0, "input_ns": 0, "infer_ns": 0, "output_ns": 0})
            for k in acc:
                acc[k] += st[k]
    execs = sum(s["count"] for s in sizes.values()) or 1
    h2h = [r["inprocess_host_to_host"]["throughput_rps"] for r in rounds]
    dev = [r["inprocess_on_device"]["throughput_rps"] for r in rounds]
    graphed = [
        r["inprocess_graphs_host_to_host"]["throughput_rps"]
        for r in rounds
        if "inprocess_graphs_host_to_host" in r
    ]
    extra: dict[str, Any] = {}
    best = [
        r["inprocess_full_batch_graphs_on_device"]["throughput_rps"]
        for r in rounds
        if "inprocess_full_batch_graphs_on_device" in r
    ]
    if best:
        extra["inprocess_full_batch_graphs_on_device_rps"] = med(best)
        extra["ratio_throughput_mpsd_full_batch_graphs_on_device"] = med(
            [m["throughput_rps"] / b for m, b in zip(mp, best, strict=True) if b]
        )
    beside = [r["beside"] for r in rounds if "beside" in r]
    if beside:
        extra["beside"] = {
            "throughput_rps": med([b["throughput_rps"] for b in beside]),
            "p50_ms": med([b["p50_ms"] for b in beside]),
            "server_cpu_us_per_request": med([b["cpu_us_per_request"]["server"] for b in beside]),
            "mean_batch": med([report.mean_batch(b["batches"]) for b in beside if b.get("batches")]),
            # Per round, measured next to mpsd: the host's drift between runs does not enter it.
            "ratio_throughput_mpsd_beside": med(
                [m["throughput_rps"] / b["throughput_rps"] for m, b in zip(mp, beside, strict=True)]
            ),
        }
        if best:
            extra["beside"]["ratio_throughput_full_batch_graphs_on_device"] = med(
                [b["throughput_rps"] / g for b, g in zip(beside, best, strict=True) if g]
            )
    if graphed:
        extra["inprocess_graphs_host_to_host_rps"] = med(graphed)
        extra["ratio_throughput_mpsd_inprocess_graphs"] = med(
            [m["throughput_rps"] / g for m, g in zip(mp, graphed, strict=True) if g]
        )
    return extra | {
        "mpsd": {
            "throughput_rps": med([m["throughput_rps"] for m in mp]),
            "p50_ms": med([m["p50_ms"] for m in mp]),
            "p99_ms": med([m["p99_ms"] for m in mp]),
            "gpu_busy_percent": med([m["gpu_busy_percent"] for m in mp if m["gpu_busy_percent"] is not None]),
            "cpu_us_per_request": {
                k: med([m["cpu_us_per_request"][k] for m in mp]) for k in ("server", "workers", "clients")
            },
            # The worker's own split of one execution (ModelStatistics compute_input/infer/output), in ms.
            "worker_ms_per_execution": {
                k.removesuffix("_ns"): sum(s[k] for s in sizes.values()) / execs / 1e6
                for k in ("input_ns", "infer_ns", "output_ns")
            },
        },
        "batch_sizes": {size: sizes[size]["count"] for size in sorted(sizes)},
        "mean_batch": report.mean_batch(sizes),
        "floor": {
            "throughput_rps": med([r["floor"]["throughput_rps"] for r in rounds]),
            "p50_ms": med([r["floor"]["p50_ms"] for r in rounds]),
            "p99_ms": med([r["floor"]["p99_ms"] for r in rounds]),
            "server_cpu_us_per_request": med([r["floor"]["cpu_us_per_request"]["server"] for r in rounds]),
        },
        "ratio_throughput_mpsd_floor": med(
            [r["mpsd"]["throughput_rps"] / r["floor"]["throughput_rps"] for r in rounds]
        ),
        "inprocess_host_to_host_rps": med(h2h),
        "inprocess_on_device_rps": med(dev),
        "ratio_throughput_mpsd_inprocess": med(
            [m["throughput_rps"] / h for m, h in zip(mp, h2h, strict=True) if h]
        ),
        "ratio_throughput_mpsd_on_device": med(
            [m["throughput_rps"] / d for m, d in zip(mp, dev, strict=True) if d]
        ),
    }


def markdown(results: dict[str, Any]) -> str:
    s = results.get("summary")
    st = results["settings"]
    model = "tiny stand-in" if st["tiny"] else "ResNet-50 (torchvision architecture, random weights)"
    lines = [f"# Scenario 5: {model}, {st['device']}, dynamic batching", ""]
    lines += report.machine_lines(results["machine"])
    lines += [
        f"- {st['clients']} clients, one image per request; max_batch_size {st['max_batch']}, "
        f"max_queue_delay_microseconds {st['delay_us']}, preferred_batch_size [{st['max_batch']}], "
        f"{st['instances']} instance(s); front_processes {st.get('front_processes') or 'auto'}; "
        f"event_loop {st.get('event_loop') or 'asyncio'}; "
        f"CUDA graphs {'on' if st.get('cuda_graphs') else 'off'}; "
        f"{st['rounds']} rounds of {st['duration']} s"
        + ("; inputs through system shared memory." if st.get("shm_inputs") else "."),
        f"- Load generator: {results['load_generator']}.",
        f"- Daemon ready {results.get('ready_s', 0):.1f} s after start; "
        f"run took {results.get('wall_s', 0):.0f} s.",
        "",
    ]
    if not s:
        return "\n".join([*lines, "No figures: the run did not finish.", ""])
    m = s["mpsd"]
    w = m["worker_ms_per_execution"]
    cpu = m["cpu_us_per_request"]
    for check in results["verdicts"].get("5", {}).get("checks", []):
        verdict = "met" if check["met"] else "**missed**"
        lines.append(f"Target: {check['what']} {check['target']}: {verdict} ({check['value']:.2f}).")
    lines += [
        "",
        "| | images/s | p50 ms | p99 ms |",
        "|---|---|---|---|",
        f"| mpsd | {m['throughput_rps']:.0f} | {m['p50_ms']:.1f} | {m['p99_ms']:.1f} |",
        f"| in-process, host to host, same batch sizes | {s['inprocess_host_to_host_rps']:.0f} | | |",
        f"| in-process, on device, same batch sizes | {s['inprocess_on_device_rps']:.0f} | | |",
        *(
            [f"| in-process, host to host, CUDA graphs, same batch sizes | {graphed:.0f} | | |"]
            if (graphed := s.get("inprocess_graphs_host_to_host_rps")) is not None
            else []
        ),
        f"| floor: bare grpc.aio server, small reply, no model | {s['floor']['throughput_rps']:.0f} | "
        f"{s['floor']['p50_ms']:.1f} | {s['floor']['p99_ms']:.1f} |",
        "",
        f"mpsd / in-process host to host: x{s['ratio_throughput_mpsd_inprocess']:.2f}; mpsd / on device: "
        f"x{s['ratio_throughput_mpsd_on_device']:.2f}; mpsd / floor: x{s['ratio_throughput_mpsd_floor']:.2f} "
        f"(the floor spends {s['floor']['server_cpu_us_per_request']:.0f} us of CPU per request, "
        f"mpsd's daemon and front processes {m['cpu_us_per_request']['server']:.0f} us).",
        *(
            [
                f"With CUDA graphs on: mpsd / in-process host to host with CUDA graphs: x{ratio:.2f} (the "
                "target's verdict above is against plain in-process torch)."
            ]
            if (ratio := s.get("ratio_throughput_mpsd_inprocess_graphs")) is not None
            else []
        ),
        *(
            [
                f"Against the GPU's best (in-process, full batches of {st['max_batch']} on the device, CUDA "
                f"graphs, {s['inprocess_full_batch_graphs_on_device_rps']:.0f} images/s): mpsd x{best:.2f}."
            ]
            if (best := s.get("ratio_throughput_mpsd_full_batch_graphs_on_device")) is not None
            else []
        ),
        *beside_lines(results),
        "",
        f"Batches formed (size: executions): {', '.join(f'{k}: {v}' for k, v in s['batch_sizes'].items())}; "
        f"mean batch {s['mean_batch']:.1f}.",
        f"Worker time per execution: {w['input']:.2f} ms input (host to device), {w['infer']:.2f} ms model, "
        f"{w['output']:.2f} ms output; GPU busy {_pct(m['gpu_busy_percent'])} (nvidia-smi) during the load.",
        f"CPU per request: daemon and fronts {cpu['server']:.0f} us, worker {cpu['workers']:.0f} us, "
        f"clients {cpu['clients']:.0f} us.",
        "",
    ]
    if "profile" in results:
        lines += ["Profile (py-spy, main thread; busy = not waiting in select/sleep):", ""]
        for proc, p in results["profile"].items():
            own = "; ".join(f"{f} {v}%" for f, v in p["own"][:8])
            lines.append(f"- {proc} ({p['file']}): busy {100 * p['busy_share']:.0f}%; own time: {own}")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
