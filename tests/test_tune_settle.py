"""A trial is measured until two windows agree: the first window after a load can still be paying for it
(CUDA graphs recorded, the old workers draining, the allocator growing), and one such window decided a
search on the H200. In-process, with scripted windows in place of the daemon's load."""

from __future__ import annotations

from typing import Any

from mpsd.tools.tune.measure import DaemonMeasurer, Load, settled
from mpsd.tools.tune.trials import Settings, Trial

START = Settings(instances=1, max_batch_size=8, delay_us=0)
OTHER = Settings(instances=1, max_batch_size=16, delay_us=0)


class FakeDaemon:
    def __init__(self) -> None:
        self.loads = 0

    def load(self, config: Any, timeout: float) -> None:
        self.loads += 1

    def workers(self) -> Any:
        return None


class FreeBudget:
    def refusal(self, listing: Any, running: Settings, trial: Settings) -> str:
        return ""


class Scripted(DaemonMeasurer):
    """Each window's throughput from a script, in order."""

    def __init__(self, windows: list[float], load: Load) -> None:
        super().__init__(FakeDaemon(), {}, None, load, START, False, FreeBudget())  # type: ignore[arg-type]
        self.windows = list(windows)
        self.measured = 0

    def _measure(self, settings: Settings) -> Trial:
        self.measured += 1
        return Trial(settings, self.windows.pop(0), 1.0, 2.0, requests=100)


LOAD = Load(concurrency=4, duration_s=1.0, warmup_s=0.5, request_timeout_s=5.0, load_timeout_s=30.0)


def test_a_first_window_far_from_the_next_is_measured_again() -> None:
    measurer = Scripted([2356.0, 5800.0, 5900.0], LOAD)
    trial = measurer(OTHER)
    assert measurer.measured == 3 and trial.throughput == 5900.0


def test_two_windows_that_agree_end_the_trial() -> None:
    measurer = Scripted([5000.0, 5200.0, 1.0], LOAD)
    assert measurer(OTHER).throughput == 5200.0 and measurer.measured == 2


def test_windows_are_bounded() -> None:
    measurer = Scripted([100.0, 1000.0, 10.0, 5.0], LOAD)
    assert measurer(START).throughput == 10.0 and measurer.measured == LOAD.max_windows


def test_settled_needs_two_windows_within_the_tolerance() -> None:
    def t(x: float) -> Trial:
        return Trial(START, x, 1.0, 2.0)

    assert not settled([t(100.0)], 0.1)
    assert settled([t(100.0), t(91.0)], 0.1)
    assert not settled([t(100.0), t(89.0)], 0.1)
