"""`mpsd tune` against an exhaustive sweep of the same space, on the small CPU CNN (bench/models.py).

One daemon; the tuner's search runs first (mpsd.tools.tune's own measurer and search, in this process),
then every point of the space is measured the same way. The question: does the tuner's choice reach 0.95x
of the sweep's best throughput under the p99 bound, with how many trials? Both figures are given: the
tuner's best as it measured it, and the same settings as the sweep measured them (noise on a loaded
machine moves a point by several percent between two measurements).

    .venv/bin/python -m bench.tune_sweep --out bench/results/tune-sweep-cpu-2core
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.common import machine_info, start_mpsd
from bench.models import SmallCNN, cnn_config, write_model
from mpsd.tools.tune.budget import Budget
from mpsd.tools.tune.daemon import Daemon
from mpsd.tools.tune.load import build_request
from mpsd.tools.tune.measure import DaemonMeasurer, Load
from mpsd.tools.tune.overrides import start_settings
from mpsd.tools.tune.search import Search, Space
from mpsd.tools.tune.trials import Objective, Settings, Trial

MODEL = "cnn"


def row(trial: Trial) -> dict[str, Any]:
    return {
        **asdict(trial.settings),
        "throughput": round(trial.throughput, 1),
        "p50_ms": round(trial.p50_ms, 2),
        "p99_ms": round(trial.p99_ms, 2),
        "mean_batch": round(trial.mean_batch(), 2),
        "refused": trial.refused,
        "failed": trial.failed,
        "errors": trial.errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--p99-ms", type=float, default=50.0)
    parser.add_argument("--duration", type=float, default=1.5)
    parser.add_argument("--warmup", type=float, default=0.5)
    args = parser.parse_args()
    space = Space(instances=(1, 2), batches=(1, 2, 4, 8), delays_us=(0, 1000, 4000))
    objective = Objective(args.p99_ms, 0.02)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        config = cnn_config(batching=True, delay_us=0, threads=1)
        config["max_batch_size"] = 8
        config["dynamic_batching"] = {"max_queue_delay_microseconds": 0}
        write_model(work / "repo", MODEL, SmallCNN(), config)
        server = start_mpsd(work / "repo", work)
        try:
            server.wait_ready()
            conn = argparse.Namespace(address=server.address, tls_ca=None, token_file=None)
            from mpsd.connect import open_channel

            with open_channel(conn) as channel:
                daemon = Daemon(channel, server.address, MODEL, 30.0)
                served = daemon.served_config()
                start = start_settings(served)
                request = build_request(MODEL, daemon.inputs(), True, [], [])
                load = Load(args.concurrency, args.duration, args.warmup, 60.0, 600.0)
                measurer = DaemonMeasurer(daemon, served, request, load, start, False, Budget(MODEL))
                load_before = os.getloadavg()
                began = time.monotonic()
                search = Search(measurer, space, objective, lambda t: print("tune ", row(t), flush=True))
                search.run(start)
                tuner_s = time.monotonic() - began
                sweep: dict[Settings, Trial] = {}
                began = time.monotonic()
                for settings in space.points():
                    sweep[settings] = measurer(settings)
                    print("sweep", row(sweep[settings]), flush=True)
                sweep_s = time.monotonic() - began
                load_after = os.getloadavg()
        finally:
            server.stop()
    feasible = [t for t in sweep.values() if objective.feasible(t)]
    if not feasible:  # nothing met the bound (a loaded machine): compare throughput alone, and say so
        print(f"no point met p99 <= {args.p99_ms:g} ms: compared on throughput alone")
        feasible = [t for t in sweep.values() if t.measured]
    sweep_best = max(feasible, key=lambda t: t.throughput)
    chosen = search.best
    again = sweep.get(chosen.settings)
    result = {
        "machine": machine_info(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "concurrency": args.concurrency,
        "p99_ms": args.p99_ms,
        "trial_s": args.duration,
        "space_points": len(sweep),
        "tuner_trials": len(search.trials),
        "tuner_s": round(tuner_s, 1),
        "sweep_s": round(sweep_s, 1),
        "tuner_best": row(chosen),
        "tuner_best_in_sweep": row(again) if again else None,
        "sweep_best": row(sweep_best),
        "ratio_tuner_measure": round(chosen.throughput / sweep_best.throughput, 3),
        "ratio_same_measurement": round(again.throughput / sweep_best.throughput, 3) if again else None,
        "tuner": [row(t) for t in search.trials],
        "sweep": [row(t) for t in sweep.values()],
    }
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("tuner", "sweep")}, indent=1))


if __name__ == "__main__":
    main()
