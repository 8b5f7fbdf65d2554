"""When to start a child process again after it ended: capped exponential back-off, forgiven after a stable
run. One policy for every supervised child (a model's workers; the fronts can share it), and no clock of its
own: callers pass the time, so tests need no sleeping."""

from __future__ import annotations

STABLE_AFTER_S = 30.0


class Backoff:
    """The first restart waits `initial_s`, each further one twice the last, at most `max_s`; a child that
    ran longer than `stable_after_s` before it ended brings the wait back to `initial_s`.

    The reset is judged once per end, not per attempt: failed attempts to start it again keep doubling.
    """

    def __init__(self, initial_s: float, max_s: float, stable_after_s: float = STABLE_AFTER_S) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self.stable_after_s = stable_after_s
        self._next = initial_s
        self._started_at = 0.0

    def started(self, now: float) -> None:
        """A child is running from `now` on."""
        self._started_at = now

    def ended(self, now: float) -> None:
        """The running child ended at `now`."""
        if now - self._started_at > self.stable_after_s:
            self._next = self.initial_s

    def delay(self) -> float:
        """The wait before the next attempt to start the child."""
        delay = self._next
        self._next = min(delay * 2, self.max_s)
        return delay
