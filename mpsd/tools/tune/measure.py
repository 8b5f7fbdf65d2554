"""One trial on the real daemon: refuse it if the memory budget says so, load its settings (a load with a
`config` parameter; no request is dropped meanwhile), run the load, and read what the daemon counted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mpsd.tools.tune.budget import Budget
from mpsd.tools.tune.daemon import Daemon, LoadFailed, worker_memory
from mpsd.tools.tune.load import run_load
from mpsd.tools.tune.overrides import override
from mpsd.tools.tune.trials import Settings, Trial


@dataclass(frozen=True)
class Load:
    """How each trial is driven."""

    concurrency: int
    duration_s: float
    warmup_s: float
    request_timeout_s: float
    load_timeout_s: float
    settle: float = 0.1  # a trial is measured again until two windows' throughputs agree within this
    max_windows: int = 3


def settled(trials: list[Trial], within: float) -> bool:
    """Whether the last two windows agree: the first after a load often still pays for it (graphs recorded,
    the old workers draining beside the new, allocator growth), so one window alone can be far off."""
    if len(trials) < 2:
        return False
    a, b = trials[-2].throughput, trials[-1].throughput
    return abs(a - b) <= within * max(a, b)


class DaemonMeasurer:
    """Measures settings on the daemon; `running` is what the model serves now (trial 0's at first)."""

    def __init__(
        self,
        daemon: Daemon,
        served: dict[str, Any],
        request: Any,
        load: Load,
        running: Settings,
        cuda_graphs: bool,
        budget: Budget,
        progress: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.daemon = daemon
        self.served = served
        self.request = request
        self.load = load
        self.running = running
        self.cuda_graphs = cuda_graphs
        self.budget = budget
        self.progress = progress
        self.overridden = False  # whether a trial's config serves now (restored at the end)

    def __call__(self, settings: Settings) -> Trial:
        if settings != self.running:
            refusal = self.budget.refusal(self.daemon.workers(), self.running, settings)
            if refusal:
                return Trial(settings, refused=refusal)
            self.progress(f"loading {settings.describe()}")
            try:
                self.daemon.load(override(self.served, settings, self.cuda_graphs), self.load.load_timeout_s)
            except LoadFailed as exc:
                if exc.refused:
                    return Trial(settings, refused=exc.message)
                return Trial(settings, failed=exc.message)
            finally:
                self.overridden = True
            self.running = settings
        windows = [self._measure(settings)]
        while len(windows) < self.load.max_windows and not windows[-1].failed:
            if settled(windows, self.load.settle):
                break
            windows.append(self._measure(settings))
        return windows[-1]

    def _measure(self, settings: Settings) -> Trial:
        counts: dict[str, dict[int, int]] = {}

        def at_window(edge: str) -> None:
            counts[edge] = self.daemon.batch_stats()

        load = self.load
        result = run_load(
            self.daemon.stub.ModelInfer,
            self.request,
            load.concurrency,
            load.warmup_s,
            load.duration_s,
            load.request_timeout_s,
            at_window,
        )
        before, after = counts.get("start", {}), counts.get("end", {})
        batches = {b: n - before.get(b, 0) for b, n in after.items() if n - before.get(b, 0) > 0}
        per_worker = worker_memory(self.daemon.workers(), self.daemon.model)
        self.budget.observe(per_worker)
        return Trial(
            settings,
            throughput=len(result.latencies_s) / result.window_s if result.window_s > 0 else 0.0,
            p50_ms=result.percentile_ms(50),
            p99_ms=result.percentile_ms(99),
            requests=len(result.latencies_s),
            errors=result.errors,
            memory_bytes=sum(per_worker) if per_worker else None,
            batches=batches,
            failed="; ".join(result.error_sample) if result.errors and not result.latencies_s else "",
        )
