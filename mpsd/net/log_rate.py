"""At most one log event per interval for a condition that can recur thousands of times a second.

A failure that repeats in a tight loop (a listening socket that cannot accept) would otherwise fill the log,
and the disk under it, with copies of one line. The first occurrence is told at once; those within the next
interval are counted and told with the next event, so nothing is lost but the repetition.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Throttle:
    """Admits one occurrence per `interval_s` of `clock`, counting the ones it holds back."""

    def __init__(self, interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last: float | None = None  # when the last occurrence was admitted
        self.held = 0  # occurrences held back since then

    def admit(self) -> int | None:
        """One more occurrence: the count held back before it when it may be told now, else None (it is
        counted)."""
        now = self._clock()
        if self._last is not None and now - self._last < self.interval_s:
            self.held += 1
            return None
        return self._open(now)

    def wait_s(self) -> float:
        """Time until an occurrence would be admitted (0: now)."""
        if self._last is None:
            return 0.0
        return max(0.0, self._last + self.interval_s - self._clock())

    def flush(self) -> int:
        """At the end of an interval: the count held back, to be told now (0: nothing to tell); telling it
        starts a new interval."""
        if not self.held:
            return 0
        return self._open(self._clock())

    def _open(self, now: float) -> int:
        self._last = now
        held, self.held = self.held, 0
        return held
