"""Each model's requests over the last minutes, for the status page: their rate, failures and latency
quantiles.

Kept off the request path: requests only update the counters and latency buckets every version keeps
anyway (`VersionStats`); a sampler copies them every `step_s` and keeps `window_s` of copies, and the
figures are differences between copies, worked out when the page asks. A version loaded again starts its
counters at zero: differences are taken per version (per statistics object), so a reload or an unload is
never read as negative traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from mpsd.daemon.dataplane.stats import LATENCY_BUCKETS_S, VersionStats

STEP_S = 5.0
WINDOW_S = 300.0
QUANTILES = (0.5, 0.99)

# What the sampler reads: each model's statistics objects, one per version served now.
StatsSource = Callable[[], Mapping[str, Iterable[VersionStats]]]


@dataclass(frozen=True)
class Counts:
    """One version's counters at one moment; `stats` holds the object, so its id names it while kept.
    `served` is false for a version read once more after it left (its last requests still count)."""

    stats: VersionStats
    success: int
    failure: int
    buckets: tuple[int, ...]
    served: bool = True


def _counts(s: VersionStats, served: bool = True) -> Counts:
    return Counts(s, s.success.count, s.fail.count, tuple(s.latency_buckets), served)


Reading = dict[str, dict[int, Counts]]  # model -> id(stats) -> its counters


@dataclass(frozen=True)
class Figures:
    """A model's requests over `window_s`: per second, and the quantiles of successful ones' time."""

    window_s: float
    requests_per_s: float
    failures_per_s: float
    quantiles_s: dict[float, float | None]  # None: no successful request in the window
    series: list[float]  # requests per second in each whole step, oldest first


def quantile(q: float, buckets: Iterable[int], bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> float | None:
    """The q-quantile of the observations counted in `buckets` (per bucket, the last above every bound),
    interpolated within its bucket as Prometheus' histogram_quantile does; the highest bound when it lies
    above them all. None without observations."""
    counts = list(buckets)
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    below = 0
    for i, n in enumerate(counts):
        if n and below + n >= rank:
            if i == len(bounds):
                return bounds[-1]
            lower = bounds[i - 1] if i > 0 else 0.0
            return lower + (bounds[i] - lower) * (rank - below) / n
        below += n
    return bounds[-1]


def _increase(older: dict[int, Counts], newer: dict[int, Counts]) -> tuple[int, int, list[int]]:
    """Requests, failures and latency buckets between two readings of one model, version by version: a
    version that was not there before counts from zero."""
    success = failure = 0
    buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)
    for key, now in newer.items():
        then = older.get(key)
        success += now.success - (then.success if then else 0)
        failure += now.failure - (then.failure if then else 0)
        for i, n in enumerate(now.buckets):
            buckets[i] += n - (then.buckets[i] if then else 0)
    return success, failure, buckets


class RecentActivity:
    """The sampler and its window of readings."""

    def __init__(
        self,
        source: StatsSource,
        step_s: float = STEP_S,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._source = source
        self.step_s = step_s
        self._clock = clock
        self._readings: deque[tuple[float, Reading]] = deque(maxlen=max(1, round(window_s / step_s)))
        self.window_s = step_s * (self._readings.maxlen or 1)  # the longest span the figures cover
        self._task: asyncio.Task[None] | None = None

    def _read(self) -> Reading:
        """The counters now; a version served at the last reading and gone since (unloaded, replaced) is read
        once more, so the requests it answered after that reading are not lost."""
        reading = {model: {id(s): _counts(s) for s in versions} for model, versions in self._source().items()}
        last = self._readings[-1][1] if self._readings else {}
        for model, versions in last.items():
            now = reading.setdefault(model, {})
            for key, then in versions.items():
                if then.served and key not in now:
                    now[key] = _counts(then.stats, served=False)
        return reading

    def sample(self) -> None:
        self._readings.append((self._clock(), self._read()))

    def figures(self) -> dict[str, Figures]:
        """Per model known now, over the readings kept and the counters as they are now."""
        points = [*self._readings, (self._clock(), self._read())]
        start, now = points[0][0], points[-1][0]
        out: dict[str, Figures] = {}
        for model in self._source():
            success = failure = 0
            buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)
            series = []
            for i, ((t0, older), (t1, newer)) in enumerate(itertools.pairwise(points)):
                s, f, b = _increase(older.get(model, {}), newer.get(model, {}))
                success, failure = success + s, failure + f
                buckets = [x + y for x, y in zip(buckets, b, strict=True)]
                if i < len(points) - 2:  # whole steps only: the one under way would read as a spike
                    series.append((s + f) / (t1 - t0) if t1 > t0 else 0.0)
            span = now - start
            out[model] = Figures(
                window_s=span,
                requests_per_s=(success + failure) / span if span > 0 else 0.0,
                failures_per_s=failure / span if span > 0 else 0.0,
                quantiles_s={q: quantile(q, buckets) for q in QUANTILES},
                series=series,
            )
        return out

    def start(self) -> None:
        if self._task is None:
            self.sample()
            self._task = asyncio.create_task(self._sample_forever(), name="status sampler")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _sample_forever(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            self.sample()
