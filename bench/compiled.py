"""Compiled models and mixed precision through mpsd: ResNet-50 (torchvision architecture, random weights)
served several ways by one daemon, each measured at the same fixed number of clients with dynamic batching on:

  - torchscript: a torch.jit.trace of the module in fp16 on a GPU (backend torchscript);
  - eager: the fp16 torch.export program run as it is (backend torch_export, no compile);
  - compile: the same program with optimization.compile (torch.compile at load, warm-up compiles);
  - aoti: the program compiled ahead of time by AOTInductor for the device (backend aoti);
  - fp32: the model in float32, eager (backend torch_export), FP32 on the wire;
  - autocast: the same float32 program under optimization.autocast float16 (inputs and outputs FP32).

Rounds alternate between the variants so that drift hits each alike; the summary is each one's median
throughput and its ratio to its baseline (torchscript for the fp16 variants, fp32 for autocast), with the
load and compile times from the daemon's ready events. `--variants` picks a subset.

Usage (on a CUDA machine with torchvision): python -m bench.compiled --out bench/results
`--tiny --device cpu --out /tmp/x` runs the same steps with a small stand-in model on the CPU (a check of
the script: AOTInductor and Inductor then compile C++ with the system compiler).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from bench import common
from bench.gpu_resnet import IMAGE, TinyStandIn
from bench.loadgen import ClientPool
from bench.report import machine_lines
from bench.run import measure

VARIANTS = ("torchscript", "eager", "compile", "aoti", "fp32", "autocast")
FILES = {
    "torchscript": "model.pt",
    "eager": "model.pt2",
    "compile": "model.pt2",
    "aoti": "model.aoti.pt2",
    "fp32": "model.pt2",
    "autocast": "model.pt2",
}
BACKENDS = {
    "torchscript": "torchscript",
    "eager": "torch_export",
    "compile": "torch_export",
    "aoti": "aoti",
    "fp32": "torch_export",
    "autocast": "torch_export",
}
FULL_PRECISION = ("fp32", "autocast")  # float32 weights and FP32 on the wire
BASELINE = {"autocast": "fp32"}  # what each variant's ratio is against; torchscript otherwise


def build_module(args: argparse.Namespace, full_precision: bool = False) -> tuple[nn.Module, torch.dtype]:
    dtype = torch.float16 if args.device == "cuda" and not full_precision else torch.float32
    torch.manual_seed(0)
    if args.tiny:
        module: nn.Module = TinyStandIn()
    else:
        import torchvision  # type: ignore[import-not-found]

        module = torchvision.models.resnet50(weights=None)
    return module.eval().to(device=args.device, dtype=dtype), dtype


def build_repo(repo: Path, args: argparse.Namespace) -> dict[str, float]:
    """One model per chosen variant under `repo`; returns the seconds each file took to write (AOTInductor's
    compile included)."""
    chosen = args.variants
    batch = torch.export.Dim("batch", min=1, max=args.max_batch)
    seconds: dict[str, float] = {}
    files = {v: repo / v / "1" / FILES[v] for v in chosen}
    for path in files.values():
        path.parent.mkdir(parents=True)
    dtypes: dict[str, torch.dtype] = {}
    for full in (False, True):
        group = [v for v in chosen if (v in FULL_PRECISION) == full]
        if not group:
            continue
        module, dtype = build_module(args, full)
        dtypes.update(dict.fromkeys(group, dtype))
        example = torch.randn((2, *IMAGE), device=args.device, dtype=dtype)
        if "torchscript" in group:
            t0 = time.perf_counter()
            with torch.inference_mode():
                traced = torch.jit.trace(module, example)  # type: ignore[no-untyped-call]
            torch.jit.save(traced, str(files["torchscript"]))
            seconds["torchscript"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        program = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
        for variant in group:
            if BACKENDS[variant] == "torch_export":
                torch.export.save(program, str(files[variant]))
        seconds["export_fp32" if full else "export"] = time.perf_counter() - t0
        if "aoti" in group:
            t0 = time.perf_counter()
            torch._inductor.aoti_compile_and_package(program, package_path=str(files["aoti"]))
            seconds["aoti_compile"] = time.perf_counter() - t0
    kind = "KIND_GPU" if args.device == "cuda" else "KIND_CPU"
    for variant in chosen:
        wire = "TYPE_FP16" if dtypes[variant] == torch.float16 else "TYPE_FP32"
        config: dict[str, Any] = {
            "backend": BACKENDS[variant],
            "max_batch_size": args.max_batch,
            "input": [{"name": "input", "data_type": wire, "dims": list(IMAGE)}],
            "output": [{"name": "logits", "data_type": wire, "dims": [1000]}],
            "instance_group": [{"kind": kind, "count": 1}],
            "dynamic_batching": {
                "max_queue_delay_microseconds": args.delay_us,
                "preferred_batch_size": [args.max_batch],
            },
        }
        if variant == "compile":
            config["optimization"] = {"compile": {"mode": args.compile_mode}}
        if variant == "autocast":
            config["optimization"] = {"autocast": "float16" if args.device == "cuda" else "bfloat16"}
        (repo / variant / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return seconds


def ready_events(log_path: Path) -> dict[str, dict[str, Any]]:
    """Each model's "model version ready" event (load_s, compile_ms where compiled)."""
    found: dict[str, dict[str, Any]] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "model version ready":
            found[str(event.get("model"))] = {k: event.get(k) for k in ("load_s", "compile_ms")}
    return found


def summarize(rounds: list[dict[str, Any]], chosen: list[str]) -> dict[str, Any]:
    medians = {v: statistics.median(r[v]["throughput_rps"] for r in rounds) for v in chosen}
    p50 = {v: statistics.median(r[v]["p50_ms"] for r in rounds) for v in chosen}
    ratios = {}
    for v in chosen:
        base = BASELINE.get(v, "torchscript")
        if medians.get(base):
            ratios[v] = {"baseline": base, "ratio": medians[v] / medians[base]}
    return {"throughput_rps": medians, "p50_ms": p50, "ratio": ratios}


def model_time(delta: dict[int, dict[str, int]], full: int) -> dict[str, float | None]:
    """The worker's model time (compute_infer) over the measured rounds: per image on average, the mean
    batch, and per execution at the full batch size (None if no full batch ran)."""
    rows = sum(size * d["count"] for size, d in delta.items())
    executions = sum(d["count"] for d in delta.values())
    infer_ns = sum(d["infer_ns"] for d in delta.values())
    at_full = delta.get(full)
    return {
        "ms_per_image": infer_ns / rows / 1e6 if rows else None,
        "mean_batch": rows / executions if executions else None,
        "ms_at_full_batch": at_full["infer_ns"] / at_full["count"] / 1e6 if at_full else None,
    }


def _ms(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    summary = results["summary"]
    lines = [
        f"# Compiled models through mpsd ({'stand-in' if s['tiny'] else 'ResNet-50'}, {s['device']})",
        "",
        *machine_lines(results["machine"]),
        f"{s['clients']} clients, one {list(IMAGE)} image per request, dynamic batching up to "
        f"{s['max_batch']}, {s['rounds']} rounds of {s['duration']:g} s; medians.",
        "",
        "Throughput and p50 are end to end (the clients' view, bound by whichever of the GPU, the worker's",
        "input handling and gRPC is slowest); the model time is the worker's compute_infer from the",
        "statistics (the model call, synchronized), per image and per full batch, over the measured rounds;",
        "the model speed compares full batches where both ran some (batch mixes differ between variants).",
        "",
        f"| variant | throughput (req/s) | vs baseline | p50 (ms) | model ms per image | mean batch | "
        f"model ms at batch {s['max_batch']} | model speed vs baseline | load (s) | compile (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    times = results.get("model_time", {})
    for v in s["variants"]:
        ready = results["ready"].get(v, {})
        compiled = ready.get("compile_ms")
        ratio = summary["ratio"].get(v)
        versus = f"{ratio['ratio']:.2f}x {ratio['baseline']}" if ratio else "-"
        mine = times.get(v, {})
        base = times.get(BASELINE.get(v, "torchscript"), {})
        speed = "-"  # at the full batch where both ran one, else per image at their own batch mixes
        if mine.get("ms_at_full_batch") and base.get("ms_at_full_batch"):
            speed = f"{base['ms_at_full_batch'] / mine['ms_at_full_batch']:.2f}x"
        elif mine.get("ms_per_image") and base.get("ms_per_image"):
            speed = f"{base['ms_per_image'] / mine['ms_per_image']:.2f}x per image"
        lines.append(
            f"| {v} | {summary['throughput_rps'][v]:.0f} | {versus} | "
            f"{summary['p50_ms'][v]:.2f} | {_ms(mine.get('ms_per_image'))} | "
            f"{_ms(mine.get('mean_batch'), 1)} | "
            f"{_ms(mine.get('ms_at_full_batch'), 2)} | {speed} | {ready.get('load_s', 0):.1f} | "
            f"{'-' if compiled is None else f'{compiled:.0f}'} |"
        )
    built = results["build_s"]
    if "aoti_compile" in built:
        lines += ["", f"AOTInductor compile of the package: {built['aoti_compile']:.1f} s (before serving)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a small stand-in instead of ResNet-50")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--client-processes", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--delay-us", type=int, default=2000, help="max_queue_delay_microseconds")
    parser.add_argument(
        "--compile-mode", default="max-autotune-no-cudagraphs", help="optimization.compile.mode"
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)}"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--name", default="compiled")
    args = parser.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants: {', '.join(sorted(unknown))}")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="mpsd-bench-compiled-"))
    results: dict[str, Any] = {
        "machine": common.machine_info(),
        "torch": torch.__version__,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    per_proc = max(1, args.clients // args.client_processes)
    try:
        results["build_s"] = build_repo(work / "repo", args)
        print(f"models written ({time.time() - started:.0f} s)", flush=True)
        env = {"TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-cache")}
        server = common.start_mpsd(work / "repo", work, env=env)
        pool = ClientPool(args.client_processes)
        try:
            results["ready_s"] = server.wait_ready(timeout_s=1800.0)
            results["ready"] = ready_events(server.log_path)
            print(f"mpsd ready in {results['ready_s']:.1f} s: {results['ready']}", flush=True)
            half = args.device == "cuda"
            requests = {
                v: common.infer_request(
                    v, [1, *IMAGE], "FP16" if half and v not in FULL_PRECISION else "FP32", input_name="input"
                )
                for v in args.variants
            }
            for v in args.variants:  # warm-up at the batch sizes the load forms
                measure(pool, server, requests[v], per_proc, args.client_processes, args.warmup * 2, 0.0)
            before = {v: common.batch_stats(server, v) for v in args.variants}
            rounds = []
            for r in range(args.rounds):
                chosen = args.variants
                order = chosen[r % len(chosen) :] + chosen[: r % len(chosen)]
                row = {
                    v: measure(
                        pool, server, requests[v], per_proc, args.client_processes, args.duration, args.warmup
                    )
                    for v in order
                }
                rounds.append(row)
                line = ", ".join(f"{v} {row[v]['throughput_rps']:.0f}/s" for v in chosen)
                print(f"  round {r + 1}: {line}", flush=True)
            results["rounds"] = rounds
            results["summary"] = summarize(rounds, args.variants)
            results["model_time"] = {
                v: model_time(common.stats_delta(common.batch_stats(server, v), before[v]), args.max_batch)
                for v in args.variants
            }
        finally:
            server.stop()
            pool.close()
        results["wall_s"] = time.time() - started
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stem = args.out / args.name
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    stem.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
