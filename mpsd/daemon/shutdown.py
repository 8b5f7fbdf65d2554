"""How the daemon ends, whatever runs when it is told to stop: loads in progress, loads that hang, a task
that never ends, a start that failed half way.

The orderly stop (health NOT_SERVING, the grace, the drain, the workers) runs on the event loop. Beside it,
from the first stop signal on, a deadline runs on a thread of its own, so that it fires even when the loop
is stuck: past `shutdown_grace_s + drain_timeout_s + worker_stop_timeout_s` and a margin, it kills the
daemon's children, removes its shared memory and exits. A second stop signal brings the deadline in to
`SECOND_SIGNAL_S`.

Exit statuses of `mpsd serve` (docs/service.md):
- 0: stopped cleanly, every request in flight answered;
- 1: stopped, but the drain was cut short (drain_timeout_s passed, or a second stop signal came) while
  requests were in flight: they ended with an error;
- 70: ended by the deadline (the orderly stop did not finish in time), or an unexpected error in the daemon;
- 78: a configuration the daemon cannot serve (its config file, an address it cannot listen on).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable

import psutil
import structlog

log = structlog.get_logger("mpsd.daemon")

EXIT_CLEAN = 0
EXIT_CUT_SHORT = 1
EXIT_FORCED = 70  # sysexits.h EX_SOFTWARE
MARGIN_S = 5.0  # beyond the configured bound: reaping, closing ports, the last log lines
SECOND_SIGNAL_S = 2.0


def stop_bound_s(shutdown_grace_s: float, drain_timeout_s: float, worker_stop_timeout_s: float) -> float:
    """The longest an orderly stop may take before the deadline ends it."""
    return max(shutdown_grace_s, 0.0) + max(drain_timeout_s, 0.0) + max(worker_stop_timeout_s, 0.0) + MARGIN_S


def kill_children() -> int:
    """SIGKILL every process the daemon started (workers, fronts, and what they started); how many."""
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return 0
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    return len(children)


class ExitDeadline:
    """Ends the process at a deadline, from a thread: a stuck event loop cannot hold it back.

    `cleanup` removes what would outlive the process (shared memory, socket directories); it must not need
    the event loop. An earlier deadline replaces a later one, never the other way round.
    """

    def __init__(
        self,
        cleanup: Callable[[], None],
        exit_now: Callable[[int], None] = os._exit,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cleanup = cleanup
        self._exit_now = exit_now
        self._clock = clock
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._at: float | None = None

    @property
    def armed(self) -> bool:
        return self._at is not None

    def arm(self, seconds: float, why: str) -> None:
        """End the process `seconds` from now, unless it has ended by then or an earlier deadline is set."""
        at = self._clock() + seconds
        with self._lock:
            if self._at is not None and self._at <= at:
                return
            if self._timer is not None:
                self._timer.cancel()
            self._at = at
            self._timer = threading.Timer(max(seconds, 0.0), self._fire, args=(seconds, why))
            self._timer.daemon = True  # a process that ends in time does not wait for it
            self._timer.start()

    def _fire(self, seconds: float, why: str) -> None:
        try:
            log.error("the daemon did not stop in time: ending it now", bound_s=round(seconds, 3), why=why)
            killed = kill_children()
            if killed:
                log.error("killed the daemon's processes", processes=killed)
            self._cleanup()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            self._exit_now(EXIT_FORCED)
