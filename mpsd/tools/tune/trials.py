"""What one trial of `mpsd tune` tries (Settings), what it measured (Trial), and how trials compare
(Objective): the vocabulary the search, the measurer and the report share."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class Settings:
    """The serving settings a trial loads. `max_batch_size` 0: the model does not batch (left as it is)."""

    instances: int
    max_batch_size: int
    delay_us: int
    preferred: tuple[int, ...] = ()
    cuda_graphs: bool = False

    def describe(self) -> str:
        parts = [f"instances={self.instances}"]
        if self.max_batch_size:
            parts += [f"batch={self.max_batch_size}", f"delay={self.delay_us}us"]
            if self.preferred:
                parts.append("preferred=" + ",".join(str(p) for p in self.preferred))
        if self.cuda_graphs:
            parts.append("cuda_graphs")
        return " ".join(parts)


@dataclass(frozen=True)
class Trial:
    """One trial's measurement, or why it was not measured: `refused` (the memory budget, before any load,
    or the daemon's answer to the load) or `failed` (the load or the requests failed)."""

    settings: Settings
    throughput: float = 0.0  # requests per second
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    requests: int = 0
    errors: int = 0
    memory_bytes: int | None = None  # the model's workers together, as they last reported
    batches: dict[int, int] = field(default_factory=dict)  # batch size -> executions
    refused: str = ""
    failed: str = ""

    @property
    def measured(self) -> bool:
        return not self.refused and not self.failed and self.requests > 0

    def mean_batch(self) -> float:
        executions = sum(self.batches.values())
        return sum(b * n for b, n in self.batches.items()) / executions if executions else 0.0


@dataclass(frozen=True)
class Objective:
    """Best throughput among the trials whose p99 is within `p99_ms` (every measured trial when None).
    A trial beats another only by more than `min_gain` (a fraction), so that noise does not move the
    search. Among trials that all miss the bound, one without errors beats one with, then throughput decides
    as it does within the bound: at a fixed concurrency a closed loop's mean latency is concurrency /
    throughput, so more throughput is also less latency, while a short window's p99 is the noisiest figure a
    trial has (steered by it, a search on 2 cores stopped at batch 2, 0.42x of the sweep's best)."""

    p99_ms: float | None = None
    min_gain: float = 0.02

    def feasible(self, trial: Trial) -> bool:
        return trial.measured and trial.errors == 0 and (self.p99_ms is None or trial.p99_ms <= self.p99_ms)

    def better(self, new: Trial, old: Trial | None) -> bool:
        if old is None:
            return new.measured
        if self.feasible(new) != self.feasible(old):
            return self.feasible(new)
        if self.feasible(new):
            return new.throughput > old.throughput * (1 + self.min_gain)
        if not new.measured:
            return False
        if not old.measured:
            return True
        if (new.errors == 0) != (old.errors == 0):
            return new.errors == 0
        return new.throughput > old.throughput * (1 + self.min_gain)

    def best(self, trials: list[Trial]) -> Trial | None:
        """The best trial in order: a later trial must beat the best before it by the margin."""
        found: Trial | None = None
        for trial in trials:
            if self.better(trial, found):
                found = trial
        return found
