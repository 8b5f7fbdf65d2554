"""Registers `tune` on the `mpsd` command line; the search is mpsd.tools.tune."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mpsd.cli.tools import _address, _config, _debug, _guarded, _wrap
from mpsd.tools.common import default_repository

DESCRIPTION = (
    "Find the serving settings that give MODEL the best throughput on this machine's device, measured on "
    "a running daemon: the instance count, max_batch_size (up to what the config allows), "
    "max_queue_delay_microseconds, preferred_batch_size and, where the model runs on CUDA, CUDA graphs. "
    "Each trial loads its settings with a load request's `config` parameter (the repository is not "
    "written; the running config serves until the new one is ready, so no request fails), then "
    "--concurrency clients send requests for --duration seconds and the trial records throughput, p50/p99 "
    "latency, the model's memory and the batch sizes the daemon formed. The search goes one setting at a "
    "time: trial 0 is the config as it serves; then instances 1, 2, 3, ... at a mid batch size until a "
    "count stops helping; the batch size doubling from 1 until throughput stops improving or p99 breaks "
    "--p99-ms; the delay on a grid, hill-climbing from the batch fill time (batch size / throughput); "
    "preferred sizes halving from the batch size (only with a delay); CUDA graphs flipped once, at the "
    "best so far; then the neighbours of the best on every axis but CUDA graphs again, up to 3 rounds, "
    "while one wins. A model that does not batch searches the instance count (and CUDA graphs) only. Each "
    "point is measured once, in up to 3 windows of --duration: until two in a row agree within 10% (the "
    "first after a load can still be paying for it). A trial wins when it meets --p99-ms and the best so "
    "far does not, or both meet it and it has more than --min-gain more throughput (so noise does not "
    "steer the search); a refused or failed trial loses to any measured one; among trials that all miss "
    "the bound, throughput decides too (at a fixed concurrency more throughput is less mean latency, and "
    "a short window's p99 is its noisiest figure), and the best of them is reported with its p99. Expect "
    "a few trials per axis (23 for a 1,218-point space in the tests), each taking its load (seconds to "
    "start workers, longer with CUDA graphs to record) plus --warmup plus 2-3 x --duration. A trial that "
    "would not fit the device's memory budget beside the other models is refused, not run (nothing is "
    "evicted). At the end the best settings and their gain over trial 0 are printed and, with --write, "
    "written into the model's config.yaml or config.pbtxt; without it the model's repository config is "
    "loaded again. Mixed precision (autocast) is not searched."
)


@_guarded
def _tune(args: argparse.Namespace) -> int:
    from mpsd.tools.tune.run import DEFAULT_DELAYS_US, Options, run

    repository: Path | None = args.repository
    if repository is None and args.write:
        repository = default_repository(args.config)[0]
    delays = DEFAULT_DELAYS_US if args.delays is None else tuple(int(d) for d in args.delays.split(","))
    options = Options(
        model=args.model,
        concurrency=args.concurrency,
        p99_ms=args.p99_ms,
        duration_s=args.duration,
        warmup_s=args.warmup,
        max_instances=args.max_instances,
        max_batch=args.max_batch,
        delays_us=delays,
        min_gain=args.min_gain,
        inputs=tuple(args.input or ()),
        shapes=tuple(args.shape or ()),
        write=args.write,
        repository=repository,
        timeout=args.timeout,
    )
    return run(args, options)


def add_tune_parser(sub: Any) -> None:
    tune = sub.add_parser(
        "tune",
        help="search a running model's instances, batch size and queue delay for the best throughput",
        description=_wrap(DESCRIPTION),
        epilog="examples:\n"
        "  mpsd tune resnet --concurrency 16 --p99-ms 50\n"
        "  mpsd tune resnet --shape image=1,3,224,224 --duration 10 --write\n"
        "  mpsd tune encoder --input tokens=@tokens.npy --max-instances 2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tune.add_argument("model", help="model name (it must be loaded)")
    tune.add_argument("--concurrency", type=int, default=8, help="clients sending at once (default 8)")
    tune.add_argument("--p99-ms", type=float, help="p99 latency bound in ms (default: best throughput alone)")
    tune.add_argument("--duration", type=float, default=5.0, help="seconds measured per trial (default 5)")
    tune.add_argument(
        "--warmup", type=float, default=1.0, help="seconds of load before each trial (default 1)"
    )
    tune.add_argument("--max-instances", type=int, default=4, help="most instances tried (default 4)")
    tune.add_argument("--max-batch", type=int, help="largest max_batch_size tried (default: the config's)")
    tune.add_argument(
        "--delays",
        metavar="US,US,...",
        help="the queue delay grid in us (default 0,100,250,500,1000,2000,4000,8000)",
    )
    tune.add_argument(
        "--min-gain",
        type=float,
        default=0.02,
        help="a trial wins only by more than this fraction (default 0.02)",
    )
    tune.add_argument(
        "--input",
        "-i",
        action="append",
        metavar="NAME=VALUE",
        help="a recorded input, as `mpsd infer` takes it",
    )
    tune.add_argument(
        "--shape",
        action="append",
        metavar="NAME=D1,D2,...",
        help="the request shape of an input with -1 dims",
    )
    tune.add_argument("--write", action="store_true", help="write the best settings into the model's config")
    tune.add_argument("--repository", type=Path, help="model repository for --write (default: --config's)")
    _config(tune)
    _address(tune, 30.0)
    _debug(tune)
    tune.set_defaults(func=_tune)
