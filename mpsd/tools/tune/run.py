"""`mpsd tune`: connect, build the space from the served config, search, report, then write the best
settings (`--write`) or load the model's own config again."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from mpsd.tools.client import connect
from mpsd.tools.common import ToolError
from mpsd.tools.tune.budget import Budget
from mpsd.tools.tune.daemon import Daemon, device_of
from mpsd.tools.tune.load import build_request
from mpsd.tools.tune.measure import DaemonMeasurer, Load
from mpsd.tools.tune.overrides import batching, groups, start_settings
from mpsd.tools.tune.report import HEADER, summary, trial_line
from mpsd.tools.tune.search import Search, Space
from mpsd.tools.tune.trials import Objective, Settings, Trial
from mpsd.tools.tune.write import write_settings

DEFAULT_DELAYS_US = (0, 100, 250, 500, 1000, 2000, 4000, 8000)


@dataclass(frozen=True)
class Options:
    model: str
    concurrency: int
    p99_ms: float | None
    duration_s: float
    warmup_s: float
    max_instances: int
    max_batch: int | None
    delays_us: tuple[int, ...]
    min_gain: float
    inputs: tuple[str, ...]
    shapes: tuple[str, ...]
    write: bool
    repository: Path | None
    timeout: float


def space_for(served_max_batch: int, batches: bool, opts: Options, start: Settings, cuda: bool) -> Space:
    """Powers of two up to the config's max_batch_size (and --max-batch, and the concurrency: a closed
    loop of N clients never queues more than N requests), the config's own size too."""
    sizes: tuple[int, ...] = ()
    if batches:
        cap = min(served_max_batch, opts.max_batch or served_max_batch, max(opts.concurrency, 1))
        sizes = tuple(sorted({1 << k for k in range(cap.bit_length()) if 1 << k <= cap} | {cap}))
    instances = tuple(sorted({n for n in (1, 2, 3, 4, 6, 8, 12, 16) if n <= opts.max_instances}))
    return Space(instances, sizes, tuple(sorted(set(opts.delays_us) | {0})), cuda_graphs=cuda)


def run(conn: argparse.Namespace, opts: Options) -> int:
    if opts.write and opts.repository is None:
        raise ToolError("--write needs the model repository", "pass --repository or --config")
    objective = Objective(opts.p99_ms, opts.min_gain)
    with connect(conn) as channel:
        daemon = Daemon(channel, conn.address, opts.model, opts.timeout)
        served = daemon.served_config()
        if len(groups(served)) > 1:
            raise ToolError(
                f"model '{opts.model}' has {len(groups(served))} instance groups",
                "the tuner searches the count of one group: tune a copy with one group",
            )
        start = start_settings(served)
        cuda = device_of(daemon.workers(), opts.model) == "cuda"
        space = space_for(start.max_batch_size, batching(served), opts, start, cuda)
        request = build_request(opts.model, daemon.inputs(), batching(served), opts.inputs, opts.shapes)
        load = Load(opts.concurrency, opts.duration_s, opts.warmup_s, max(opts.timeout, 30.0), 600.0)
        measurer = DaemonMeasurer(daemon, served, request, load, start, cuda, Budget(opts.model), _progress)
        print(
            f"tuning {opts.model}: {opts.concurrency} clients, {opts.duration_s:g} s a trial"
            + (f", p99 <= {opts.p99_ms:g} ms" if opts.p99_ms is not None else ", best throughput")
            + (", CUDA graphs searched" if cuda else ""),
            flush=True,
        )
        print(HEADER, flush=True)
        search = Search(measurer, space, objective, lambda t: _print(len(search.trials) - 1, t, objective))
        try:
            trials = search.run(start)
        finally:
            chosen = search.best if search.trials else None
            _finish(daemon, measurer, chosen, trials_start(search), opts, served, cuda)
    return 0 if trials else 1


def trials_start(search: Search) -> Trial | None:
    return search.trials[0] if search.trials else None


def _finish(
    daemon: Daemon,
    measurer: DaemonMeasurer,
    best: Trial | None,
    baseline: Trial | None,
    opts: Options,
    served: dict[str, object],
    cuda: bool,
) -> None:
    """Report, then write the best settings (`--write`) or load the repository's config again."""
    objective = Objective(opts.p99_ms, opts.min_gain)
    complete = best is not None and baseline is not None and sys.exc_info()[0] is None
    if complete and best is not None and baseline is not None:
        for line in summary(best, baseline, objective):
            print(line)
    changed = complete and best is not None and baseline is not None and best.settings != baseline.settings
    try:
        if opts.write and changed and best is not None and opts.repository is not None:
            path = write_settings(opts.repository / opts.model, best.settings, batching(served), cuda)
            print(f"wrote {path}")
        elif opts.write and complete:
            print("the config as it is did best: nothing written")
        elif complete:
            print("not written (--write writes it to the model's config)")
    finally:
        if measurer.overridden:
            daemon.load(None, 600.0)  # the repository's config (written or not) serves again
            print(f"{opts.model} serves its repository config again", file=sys.stderr)


def _progress(line: str) -> None:
    print(f"     {line}", file=sys.stderr, flush=True)


def _print(index: int, trial: Trial, objective: Objective) -> None:
    print(trial_line(index, trial, objective), flush=True)
