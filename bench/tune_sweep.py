"""`mpsd tune` against an exhaustive sweep of the same space, on one of three models (bench/models.py):

- `cnn`: the small CPU CNN (3x64x64, one intra-op thread), 8 clients, p99 <= 50 ms;
- `resnet50`: ResNet-50 (torchvision's layout, random weights, no torchvision needed), fp16 on CUDA, one
  3x224x224 image a request, 64 clients, p99 <= 50 ms;
- `encoder`: a 6-layer transformer encoder (d_model 512, 8 heads, torch.nn.TransformerEncoder, random
  weights), fp16 on CUDA, 128 token ids a request, 64 clients, p99 <= 25 ms.

One daemon; the tuner's search runs first (mpsd.tools.tune's own measurer and search, in this process),
then every point of the space is measured the same way. The question: does the tuner's choice reach 0.95x
of the sweep's best throughput under the p99 bound, with how many trials, and what does it gain over the
config it started from? On CUDA the space has CUDA graphs on and off (the tuner's only CUDA axis; it does
not search autocast, and these models are fp16 already). For resnet50 and encoder the load comes from
bench/loadgen.py's client processes rather than the tuner's threads (`--client`): on an H100, ResNet-50
through mpsd took about 3,400 images/s from 4 such processes, more than one Python process of 64 threads
sends, which would make every setting measure the same.

Device time is scarce, so for resnet50 and encoder the sweep reuses the tuner's measurements of the points it
already has (`--remeasure` measures them again; the cnn's sweep always does), visits the points in an order
where every other step changes only the instance count (workers added or removed in place, no reload), and
with `--limit-s` stops once the whole run has taken that long, naming the points it left out. It prints its
estimate first: points x (load + warm-up + window).

    .venv/bin/python -m bench.tune_sweep --out bench/results/tune-sweep-cpu-2core
    python -m bench.tune_sweep --model resnet50 --out bench/results/tune-sweep-resnet50-h200
    python -m bench.tune_sweep --model encoder --out bench/results/tune-sweep-encoder-h200
    python -m bench.tune_sweep --model encoder --tiny --device cpu --duration 0.5 --out /tmp/ts  # a check

Writes OUT.json (every trial) and OUT.md (the summary).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from bench.common import machine_info, start_mpsd
from bench.loadgen import ClientPool, LoadSpec
from bench.models import CNN_IMAGE, Encoder, ResNet50, SmallCNN, cnn_config, write_model
from mpsd.tools.tune.budget import Budget
from mpsd.tools.tune.daemon import Daemon, worker_memory
from mpsd.tools.tune.load import build_request
from mpsd.tools.tune.measure import DaemonMeasurer, Load
from mpsd.tools.tune.overrides import start_settings
from mpsd.tools.tune.search import Search, Space
from mpsd.tools.tune.trials import Objective, Settings, Trial

SEQ_LEN = 128  # the encoder's tokens per request: fixed, so CUDA graphs apply
# Seconds a reload of each model takes, for the estimate printed before the run: a guess for an H100/H200
# host (ResNet-50 fp16 took 6.6 s to load on an H100, bench/results/compiled-h100.md, before CUDA graphs are
# recorded); the run records each trial's real time (`trial_s`).
LOAD_GUESS_S = {"cnn": 1.5, "resnet50": 8.0, "encoder": 6.0}


@dataclass(frozen=True)
class Plan:
    """What one model's run uses by default."""

    concurrency: int
    p99_ms: float
    duration_s: float
    warmup_s: float
    space: Space
    start: dict[str, Any]  # the served config's searched fields at trial 0
    limit_s: float | None = None  # the whole run's time, after which the sweep stops


def plan(model: str, cuda: bool) -> Plan:
    if model == "cnn":
        space = Space(instances=(1, 2), batches=(1, 2, 4, 8), delays_us=(0, 1000, 4000))
        return Plan(8, 50.0, 1.5, 0.5, space, {"max_batch_size": 8, "delay_us": 0})
    # 64 clients: batches below 8 only queue; the delay grid and no preferred sizes keep the space at 32
    # points (on CUDA), which an H200 measures in about 6 minutes (see the estimate printed).
    space = Space(
        instances=(1, 2), batches=(8, 16, 32, 64), delays_us=(0, 2000), preferred=False, cuda_graphs=cuda
    )
    p99 = 50.0 if model == "resnet50" else 25.0
    return Plan(64, p99, 2.0, 1.0, space, {"max_batch_size": 64, "delay_us": 0}, limit_s=360.0)


def write_repo(repo: Path, model: str, cuda: bool, tiny: bool, start: dict[str, Any]) -> None:
    """repo/<model>: the model as trial 0 serves it (one instance, no CUDA graphs)."""
    torch.manual_seed(0)
    kind = "KIND_GPU" if cuda else "KIND_CPU"
    wire = "TYPE_FP16" if cuda else "TYPE_FP32"
    batching = {"max_queue_delay_microseconds": start["delay_us"]}
    if model == "cnn":
        config = cnn_config(batching=True, delay_us=0, threads=1)
        config.update(max_batch_size=start["max_batch_size"], dynamic_batching=batching)
        write_model(repo, model, SmallCNN(), config)
        return
    if model == "resnet50":
        module: torch.nn.Module = ResNet50(width=8 if tiny else 64)
        image = list(CNN_IMAGE) if tiny else [3, 224, 224]
        tensors = {
            "input": [{"name": "image", "data_type": wire, "dims": image}],
            "output": [{"name": "logits", "data_type": wire, "dims": [1000]}],
        }
    else:
        module = Encoder(1, 64, 2) if tiny else Encoder()
        width = 64 if tiny else 512
        tensors = {
            "input": [{"name": "ids", "data_type": "TYPE_INT64", "dims": [SEQ_LEN]}],
            "output": [{"name": "pooled", "data_type": wire, "dims": [width]}],
        }
    config = {
        "backend": "torchscript",
        "max_batch_size": start["max_batch_size"],
        **tensors,
        "instance_group": [{"kind": kind, "count": 1}],
        "dynamic_batching": batching,
    }
    if not cuda:
        config["parameters"] = {"intra_op_thread_count": "1"}
    write_model(repo, model, module.eval().half() if cuda else module.eval(), config)


def row(trial: Trial, seconds: float | None = None) -> dict[str, Any]:
    return {
        **asdict(trial.settings),
        "throughput": round(trial.throughput, 1),
        "p50_ms": round(trial.p50_ms, 2),
        "p99_ms": round(trial.p99_ms, 2),
        "mean_batch": round(trial.mean_batch(), 2),
        "refused": trial.refused,
        "failed": trial.failed,
        "errors": trial.errors,
        **({"trial_s": round(seconds, 1)} if seconds is not None else {}),
    }


def sweep_order(points: list[Settings]) -> Iterator[Settings]:
    """Every point, grouped by all but the instance count, the count ascending and descending in turn: every
    other step changes the count alone (workers added or removed, no reload)."""
    groups: dict[Settings, list[Settings]] = {}
    for p in points:
        groups.setdefault(replace(p, instances=0), []).append(p)
    for i, key in enumerate(sorted(groups, key=lambda s: (s.cuda_graphs, s.max_batch_size, s.delay_us))):
        yield from sorted(groups[key], key=lambda s: s.instances, reverse=i % 2 == 1)


class PoolMeasurer(DaemonMeasurer):
    """The tuner's measurer (its loads, budget and memory readings) with bench/loadgen.py's client processes
    (asyncio, prepared bytes) in place of its threads: on a fast GPU one Python process of 64 threads is
    the bottleneck, and every setting would measure the same. Batch sizes are counted over the warm-up too."""

    def __init__(self, pool: ClientPool, address: str, *args: Any) -> None:
        super().__init__(*args)
        self.pool = pool
        self.address = address

    def _measure(self, settings: Settings) -> Trial:
        load, processes = self.load, self.pool.size
        spec = LoadSpec(
            self.address,
            self.request.SerializeToString(),
            max(1, load.concurrency // processes),
            load.duration_s,
            load.warmup_s,
        )
        before = self.daemon.batch_stats()
        result = self.pool.run(spec)
        after = self.daemon.batch_stats()
        batches = {b: n - before.get(b, 0) for b, n in after.items() if n - before.get(b, 0) > 0}
        per_worker = worker_memory(self.daemon.workers(), self.daemon.model)
        self.budget.observe(per_worker)
        latencies = sorted(result.latencies_ns)

        def pct(q: float) -> float:
            return (
                latencies[min(len(latencies) - 1, int(q / 100 * len(latencies)))] / 1e6 if latencies else 0.0
            )

        return Trial(
            settings,
            throughput=result.throughput,
            p50_ms=pct(50),
            p99_ms=pct(99),
            requests=len(latencies),
            errors=result.errors,
            memory_bytes=sum(per_worker) if per_worker else None,
            batches=batches,
            failed=result.first_error if result.errors and not latencies else "",
        )


class Timed:
    """The measurer, recording each trial's wall time (its load and its load of requests)."""

    def __init__(self, measure: DaemonMeasurer) -> None:
        self.measure = measure
        self.seconds: dict[Settings, float] = {}

    def __call__(self, settings: Settings) -> Trial:
        began = time.monotonic()
        trial = self.measure(settings)
        self.seconds[settings] = time.monotonic() - began
        return trial


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="OUT.json and OUT.md are written")
    parser.add_argument("--model", choices=("cnn", "resnet50", "encoder"), default="cnn")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--tiny", action="store_true", help="small stand-ins of the models (a CPU check)")
    parser.add_argument("--concurrency", type=int, help="clients (default: the model's, 8 or 64)")
    parser.add_argument("--p99-ms", type=float, help="p99 bound (default: the model's, 50 or 25)")
    parser.add_argument("--duration", type=float, help="seconds measured per trial (default 1.5 cnn, 2 GPU)")
    parser.add_argument("--warmup", type=float, help="seconds of load before each (default 0.5 cnn, 1 GPU)")
    parser.add_argument(
        "--remeasure", action="store_true", help="the sweep measures the tuner's points again"
    )
    parser.add_argument(
        "--client",
        choices=("tuner", "pool"),
        help="the load: mpsd tune's own (threads in this process) or bench/loadgen.py's client processes "
        "(default: tuner for cnn, pool for resnet50 and encoder)",
    )
    parser.add_argument(
        "--final-rounds",
        type=int,
        default=3,
        help="measure the tuner's choice and the sweep's best again, in turn, this many times each (0: no)",
    )
    parser.add_argument("--client-processes", type=int, default=4, help="with --client pool (default 4)")
    parser.add_argument(
        "--limit-s",
        type=float,
        help="stop the sweep once the run (tuner and sweep) has taken this long (default 360 s for resnet50 "
        "and encoder, none for cnn; 0: none)",
    )
    args = parser.parse_args()
    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    cuda = device == "cuda" and args.model != "cnn"
    p = plan(args.model, cuda)
    concurrency = args.concurrency or p.concurrency
    p99_ms = args.p99_ms or p.p99_ms
    duration = args.duration or p.duration_s
    warmup = args.warmup or p.warmup_s
    limit_s = (args.limit_s if args.limit_s is not None else p.limit_s) or None
    remeasure = args.remeasure or args.model == "cnn"
    client = args.client or (
        "tuner" if args.model == "cnn" else "pool"
    )  # the CPU runs so far measured every point again
    space, objective = p.space, Objective(p99_ms, 0.02)
    points = list(sweep_order(list(space.points())))
    per_trial = LOAD_GUESS_S[args.model] + warmup + duration
    print(
        f"{args.model} on {'cuda' if cuda else 'cpu'}: {len(points)} points, about "
        f"{len(points) * per_trial / 60:.1f} min for the sweep plus the tuner's trials"
        f"{'' if remeasure else ' outside it'} at ~{per_trial:.0f} s a trial "
        f"({LOAD_GUESS_S[args.model]:g} s load + {warmup:g} s warm-up + {duration:g} s)"
        + (f"; the sweep stops at {limit_s:g} s of the run" if limit_s else ""),
        flush=True,
    )
    model = args.model
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_repo(work / "repo", model, cuda, args.tiny, p.start)
        server = start_mpsd(work / "repo", work)
        pool = ClientPool(args.client_processes) if client == "pool" else None
        try:
            server.wait_ready()
            conn = argparse.Namespace(address=server.address, tls_ca=None, token_file=None)
            from mpsd.connect import open_channel

            with open_channel(conn) as channel:
                daemon = Daemon(channel, server.address, model, 30.0)
                served = daemon.served_config()
                start = start_settings(served)
                request = build_request(model, daemon.inputs(), True, [], [])
                load = Load(concurrency, duration, warmup, 60.0, 600.0)
                parts = (daemon, served, request, load, start, cuda, Budget(model))
                measure = PoolMeasurer(pool, server.address, *parts) if pool else DaemonMeasurer(*parts)
                measurer = Timed(measure)
                load_before = os.getloadavg()
                began = run_began = time.monotonic()
                search = Search(
                    measurer,
                    space,
                    objective,
                    lambda t: print("tune ", row(t, measurer.seconds[t.settings]), flush=True),
                )
                search.run(start)
                tuner_s = time.monotonic() - began
                tuned = {t.settings: t for t in search.trials}
                sweep: dict[Settings, Trial] = {}
                left_out: list[Settings] = []
                began = time.monotonic()
                for settings in points:
                    reused = not remeasure and settings in tuned  # costs nothing: never left out
                    if not reused and limit_s is not None and time.monotonic() - run_began > limit_s:
                        left_out.append(settings)
                        continue
                    sweep[settings] = tuned[settings] if reused else measurer(settings)
                    label = "sweep (tuner's)" if reused else "sweep"
                    print(label, row(sweep[settings], measurer.seconds[settings]), flush=True)
                sweep_s = time.monotonic() - began
                side_by_side = final_rounds(measurer, search, sweep, objective, args.final_rounds)
                load_after = os.getloadavg()
        finally:
            if pool is not None:
                pool.close()
            server.stop()
    result = summarize(search, sweep, objective, start)
    result.update(
        {
            "side_by_side": side_by_side,
            "model": model + (" (tiny stand-in)" if args.tiny else ""),
            "device": "cuda" if cuda else "cpu",
            "machine": machine_info(),
            "load_average_before": load_before,
            "load_average_after": load_after,
            "concurrency": concurrency,
            "client": client
            + (f" ({args.client_processes} processes)" if client == "pool" else " (threads)"),
            "p99_ms": p99_ms,
            "trial_s": duration,
            "warmup_s": warmup,
            "space": {**asdict(space), "points": len(points)},
            "sweep_reuses_tuner_trials": not remeasure,
            "limit_s": limit_s,
            "tuner_s": round(tuner_s, 1),
            "sweep_s": round(sweep_s, 1),
            "sweep_left_out": [asdict(s) for s in left_out],
            "tuner": [row(t, measurer.seconds.get(t.settings)) for t in search.trials],
            "sweep": [row(t) for t in sweep.values()],
        }
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(markdown(result, args))
    print(args.out.with_suffix(".md").read_text())


def final_rounds(
    measure: Any, search: Search, sweep: dict[Settings, Trial], objective: Objective, rounds: int
) -> dict[str, Any] | None:
    """The tuner's choice and the sweep's best measured again, in turn, `rounds` times each: the sweep's best
    is the highest of many noisy measurements (biased upwards), so the two are compared side by side, by
    the medians of their rounds."""
    feasible = [t for t in sweep.values() if objective.feasible(t)] or [
        t for t in sweep.values() if t.measured
    ]
    if not rounds or not feasible:
        return None
    chosen, best = search.best.settings, max(feasible, key=lambda t: t.throughput).settings
    if chosen == best:
        return {"same_settings": True, "ratio": 1.0, "rounds": 0}
    tuner: list[float] = []
    swept: list[float] = []
    for i in range(rounds):
        for settings, into in (
            ((chosen, tuner), (best, swept)) if i % 2 == 0 else ((best, swept), (chosen, tuner))
        ):
            into.append(measure(settings).throughput)
            print(f"side by side {'tuner' if into is tuner else 'sweep'} {into[-1]:.1f}", flush=True)
    ratio = statistics.median(tuner) / statistics.median(swept) if statistics.median(swept) > 0 else None
    return {"same_settings": False, "rounds": rounds, "tuner": tuner, "sweep": swept, "ratio": ratio}


def summarize(
    search: Search, sweep: dict[Settings, Trial], objective: Objective, start: Settings
) -> dict[str, Any]:
    """The tuner's choice against the sweep's best (under the bound, else on throughput alone)."""
    feasible = [t for t in sweep.values() if objective.feasible(t)]
    bound_met = bool(feasible)
    if not feasible:  # nothing met the bound (a loaded machine): compare throughput alone, and say so
        feasible = [t for t in sweep.values() if t.measured]
    sweep_best = max(feasible, key=lambda t: t.throughput) if feasible else None
    chosen, baseline = search.best, search.trials[0]
    again = sweep.get(chosen.settings)

    def ratio(a: Trial | None, b: Trial | None) -> float | None:
        return round(a.throughput / b.throughput, 3) if a and b and b.throughput > 0 else None

    return {
        "start": asdict(start),
        "bound_met_in_sweep": bound_met,
        "tuner_trials": len(search.trials),
        "tuner_best": row(chosen),
        "tuner_best_in_sweep": row(again) if again else None,
        "sweep_best": row(sweep_best) if sweep_best else None,
        "ratio_tuner_measure": ratio(chosen, sweep_best),
        "ratio_same_measurement": ratio(again, sweep_best),
        "baseline": row(baseline),
        "gain_over_start": ratio(chosen, baseline),
    }


def markdown(r: dict[str, Any], args: argparse.Namespace) -> str:
    m = r["machine"]

    def settings(x: dict[str, Any] | None) -> str:
        if not x:
            return "-"
        text = f"instances {x['instances']}, batch {x['max_batch_size']}, delay {x['delay_us']} us"
        text += f", preferred {','.join(map(str, x['preferred']))}" if x["preferred"] else ""
        return text + (", CUDA graphs" if x["cuda_graphs"] else "")

    def line(name: str, trials: str, x: dict[str, Any] | None) -> str:
        if not x:
            return f"| {name} | {trials} | - | - | - | - |"
        return f"| {name} | {trials} | {settings(x)} | {x['throughput']} | {x['p50_ms']} | {x['p99_ms']} |"

    sp = r["space"]
    lines = [
        f"# mpsd tune against an exhaustive sweep: {r['model']} on {r['device']}",
        "",
        f"`python -m bench.tune_sweep --model {args.model}"
        + (" --tiny" if args.tiny else "")
        + f" --out {args.out}` (plus the options given: see the JSON)",
        "",
        f"- Machine: {m['cpu']}, {m['logical_cores']} logical cores, {m['memory_gib']} GiB; GPU:"
        f" {m.get('gpu')} (CUDA {m.get('cuda')}); torch {m['torch']}; load average"
        f" {r['load_average_before'][0]:.1f} before, {r['load_average_after'][0]:.1f} after",
        f"- Space: instances {sp['instances']} x batch {sp['batches']} x delay {sp['delays_us']} us"
        + (" x preferred sizes" if sp["preferred"] else "")
        + (" x CUDA graphs on/off" if sp["cuda_graphs"] else "")
        + f": {sp['points']} points",
        f"- Load: {r['concurrency']} clients ({r['client']}), {r['warmup_s']:g} s warm-up and"
        f" {r['trial_s']:g} s measured per trial; bound p99 <= {r['p99_ms']:g} ms"
        + (
            "" if r["bound_met_in_sweep"] else " (no point of the sweep met it: compared on throughput alone)"
        ),
        f"- Time: tuner {r['tuner_s']} s, sweep {r['sweep_s']} s"
        + (" (reusing the tuner's measurements of its points)" if r["sweep_reuses_tuner_trials"] else "")
        + (f"; {len(r['sweep_left_out'])} points left out at the time limit" if r["sweep_left_out"] else ""),
        "",
        "| | trials | settings | req/s | p50 ms | p99 ms |",
        "|---|---|---|---|---|---|",
        line("start (trial 0)", "", r["baseline"]),
        line("tuner's choice", str(r["tuner_trials"]), r["tuner_best"]),
        line("sweep's best", str(len(r["sweep"])), r["sweep_best"]),
    ]
    if r["sweep_reuses_tuner_trials"] is False and r["tuner_best_in_sweep"]:
        lines.append(line("tuner's choice, measured again in the sweep", "", r["tuner_best_in_sweep"]))
    lines += [
        "",
        f"Tuner's choice / sweep's best: {r['ratio_tuner_measure']} (the tuner's own measurement)"
        + (
            f", {r['ratio_same_measurement']} (as the sweep measured it)"
            if r["sweep_reuses_tuner_trials"] is False
            else ""
        )
        + f". Gain over the starting config: {r['gain_over_start']}x, in {r['tuner_trials']} trials"
        f" against the sweep's {len(r['sweep'])}.",
        "",
    ]
    side = r.get("side_by_side")
    if side and side["same_settings"]:
        lines += ["The tuner's choice is the sweep's best: side by side, 1.0.", ""]
    elif side:
        lines += [
            f"Side by side, measured again in turn {side['rounds']} times each: the tuner's choice "
            f"{', '.join(f'{x:.1f}' for x in side['tuner'])} req/s, the sweep's best "
            f"{', '.join(f'{x:.1f}' for x in side['sweep'])}; ratio of the medians "
            f"**{side['ratio']:.3f}**. (The sweep's best is the highest of many noisy measurements, so one"
            " measurement of it is biased upwards.)",
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
