"""How `mpsd tune` searches: one setting at a time (coordinate descent), never every combination.

1. Trial 0 measures the model as it serves now: the baseline every gain is reported against.
2. Instances, at a mid batch size: 1, 2, 3, ... until a count does not beat the best before it.
3. The batch size, doubling from 1 with that instance count, until throughput stops improving or p99
   breaks the bound.
4. The queue delay, on the delay grid, starting at the point nearest the time the best trial took to fill
   one batch (batch size / throughput), moving to a neighbour while that beats the best (a hill climb).
5. Preferred batch sizes (with a delay only: without one the batcher never waits for a size): halving
   from the batch size, while that helps.
6. CUDA graphs flipped once at the best so far, where the model runs on CUDA.
7. A last pass over the neighbours of the best on every axis but CUDA graphs, repeated (up to
   POLISH_ROUNDS) while one of them wins, so that an axis fixed early is looked at again once the others
   have moved.

Every point is measured once (the results are kept by settings); a trial that the memory budget refuses
or that fails counts as worse than any measured one. On a surface where each setting has one peak given
the others, the search ends at that peak after a few trials per axis.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import product
from typing import TypeVar

from mpsd.tools.tune.trials import Objective, Settings, Trial

Measure = Callable[[Settings], Trial]

POLISH_ROUNDS = 3
T = TypeVar("T")


@dataclass(frozen=True)
class Space:
    """The values each setting may take, each ascending. `batches` is empty for a model that does not
    batch; `delays_us` starts at 0."""

    instances: tuple[int, ...]
    batches: tuple[int, ...]
    delays_us: tuple[int, ...]
    preferred: bool = True
    cuda_graphs: bool = False

    def preferred_options(self, batch: int) -> list[tuple[int, ...]]:
        """No preferred size, or one smaller than the batch size (a size equal to it changes nothing)."""
        if not self.preferred:
            return [()]
        return [()] + [(p,) for p in self.batches if p < batch]

    def points(self) -> Iterator[Settings]:
        """Every combination: what an exhaustive sweep measures (bench/tune_sweep.py)."""
        graphs = (False, True) if self.cuda_graphs else (False,)
        if not self.batches:
            for i, g in product(self.instances, graphs):
                yield Settings(i, 0, 0, (), g)
            return
        for i, b, d, g in product(self.instances, self.batches, self.delays_us, graphs):
            for p in self.preferred_options(b) if d > 0 else [()]:
                yield Settings(i, b, d, p, g)


class Search:
    """Runs the stages above with `measure`, calling `on_trial` with each new trial as it finishes."""

    def __init__(
        self,
        measure: Measure,
        space: Space,
        objective: Objective,
        on_trial: Callable[[Trial], None] = lambda trial: None,
    ) -> None:
        self._measure = measure
        self.space = space
        self.objective = objective
        self._on_trial = on_trial
        self.trials: list[Trial] = []
        self._seen: dict[Settings, Trial] = {}

    def trial(self, settings: Settings) -> Trial:
        found = self._seen.get(settings)
        if found is None:
            found = self._seen[settings] = self._measure(settings)
            self.trials.append(found)
            self._on_trial(found)
        return found

    @property
    def best(self) -> Trial:
        best = self.objective.best(self.trials)
        return best if best is not None else self.trials[0]

    def run(self, start: Settings) -> list[Trial]:
        self.trial(start)
        space = self.space
        if space.batches:
            mid = space.batches[(len(space.batches) - 1) // 2]
            self.walk(
                [replace(start, instances=i, max_batch_size=mid, preferred=()) for i in space.instances]
            )
            center = self.best.settings
            self.walk([replace(center, max_batch_size=b, preferred=()) for b in space.batches])
            self.delay()
            center = self.best.settings
            if center.delay_us > 0:
                smaller = reversed(space.preferred_options(center.max_batch_size)[1:])
                self.walk([replace(center, preferred=p) for p in smaller], self.best)
        else:
            self.walk([replace(start, instances=i) for i in space.instances])
        if space.cuda_graphs:
            center = self.best.settings
            self.trial(replace(center, cuda_graphs=not center.cuda_graphs))
        self.polish()
        return self.trials

    def walk(self, line: Sequence[Settings], best: Trial | None = None) -> None:
        """Along one axis in order, until a point does not beat `best` and the points before it."""
        for settings in line:
            trial = self.trial(settings)
            if best is not None and not self.objective.better(trial, best):
                return
            if self.objective.better(trial, best):
                best = trial

    def delay(self) -> None:
        """Hill climb on the delay grid from the point nearest the best trial's batch fill time."""
        best = self.best
        grid = self.space.delays_us
        fill_us = best.settings.max_batch_size / best.throughput * 1e6 if best.throughput > 0 else 0.0
        at = min(range(len(grid)), key=lambda i: abs(grid[i] - fill_us))
        current = self.trial(replace(best.settings, delay_us=grid[at], preferred=()))
        while True:
            steps = [i for i in (at - 1, at + 1) if 0 <= i < len(grid)]
            tried = [(i, self.trial(replace(current.settings, delay_us=grid[i]))) for i in steps]
            winner = self.objective.best([current] + [t for _, t in tried])
            if winner is None or winner is current:
                return
            at, current = next((i, t) for i, t in tried if t is winner)

    def polish(self) -> None:
        for _ in range(POLISH_ROUNDS):
            before = self.best
            for settings in self.neighbours(before.settings):
                self.trial(settings)
            if self.best is before:
                return

    def neighbours(self, s: Settings) -> list[Settings]:
        """The settings one step away on each axis (the values next to the current one)."""
        space = self.space
        out = [replace(s, instances=v) for v in _adjacent(space.instances, s.instances)]
        if space.batches:
            out += [
                replace(s, max_batch_size=v, preferred=()) for v in _adjacent(space.batches, s.max_batch_size)
            ]
            out += [
                replace(s, delay_us=v, preferred=s.preferred if v else ())
                for v in _adjacent(space.delays_us, s.delay_us)
            ]
            if s.delay_us > 0:
                options = space.preferred_options(s.max_batch_size)
                out += [replace(s, preferred=p) for p in _adjacent(options, s.preferred)]
        return out


def _adjacent(values: Sequence[T], value: T) -> list[T]:
    if value not in values:
        return []
    i = list(values).index(value)
    return [values[j] for j in (i - 1, i + 1) if 0 <= j < len(values)]
