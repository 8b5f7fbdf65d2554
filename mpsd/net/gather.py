"""Gathering: a busy event loop waits a little before it sleeps, so that one pass takes in the frames that
arrive meanwhile instead of waking for each, as a network card's interrupt moderation does.

A loop under load that reads many sockets (the daemon reading its fronts' links) wakes for each frame that
arrives while it sleeps: the wake-up, a pass of the loop and a read for one or two frames. Each request that
arrives during a wait waits with it, which is worth it only while the loop is busy: below `LOADED` of its
time running it sleeps at once. The sockets marked `wake_at_once` (the workers') end a wait as soon as they
are readable: an answer never waits, and neither does the batch behind it.
"""

from __future__ import annotations

import os
import select
import selectors
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from mpsd.net.busy_poll import BusyPollSelector, Events, run_on

T = TypeVar("T")

# The share of the last window that the loop spent running (not waiting in select) from which it gathers.
LOADED = 0.25
WINDOW_S = 0.02


class LoadMeter:
    """The share of time a loop spends running rather than waiting for events, over windows of
    `WINDOW_S`; `loaded` is the last whole window's verdict."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        now = clock()
        self._window_start = now
        self._left = now  # when the loop last came back from select
        self._running = 0.0  # the time it ran in this window
        self.loaded = False

    def entered(self) -> None:
        """The loop asks for events: it ran from the last return until now."""
        now = self._clock()
        self._running += now - self._left
        span = now - self._window_start
        if span >= WINDOW_S:
            self.loaded = self._running >= LOADED * span
            self._window_start, self._running = now, 0.0

    def left(self) -> None:
        """Select returned: the loop runs from now."""
        self._left = self._clock()


class GatheringSelector(BusyPollSelector):
    """A busy-polling selector that, while its loop is loaded, waits up to `gather_s` before each sleep.
    `held` counts those waits, `cut_short` the ones a socket marked `wake_at_once` ended."""

    def __init__(self, budget_s: float, gather_s: float) -> None:
        super().__init__(budget_s)
        self.gather_s = gather_s
        self.held = 0
        self.cut_short = 0
        self.meter = LoadMeter()
        self._urgent: set[int] = set()  # the descriptors whose events end a wait

    def wake_at_once(self, fd: int) -> None:
        """Let `fd`'s events end a wait at once (until it is unregistered: its number may be reused)."""
        self._urgent.add(fd)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        key = super().unregister(fileobj)
        self._urgent.discard(key.fd)
        return key

    def select(self, timeout: float | None = None) -> Events:
        self.meter.entered()
        try:
            # Not in a settling pass: its callbacks (a batch's start) run as soon as the loop has settled.
            if self.meter.loaded and not self._on_settled and (timeout is None or timeout > 0):
                events, timeout = self._gather(timeout)
                if events:
                    self._active = True
                    return events
            return super().select(timeout)
        finally:
            self.meter.left()

    def _gather(self, timeout: float | None) -> tuple[Events, float | None]:
        """Wait up to `gather_s` (less when a timer is due sooner, or a socket that wakes at once is
        readable), then poll: what arrived meanwhile, and what is left of `timeout`."""
        hold = self.gather_s if timeout is None else min(self.gather_s, timeout)
        start = time.monotonic()
        self.held += 1
        if self._wait_urgent(hold):
            self.cut_short += 1
        events = super().select(0)
        if timeout is not None:
            timeout = max(0.0, timeout - (time.monotonic() - start))
        return events, timeout

    def _wait_urgent(self, hold: float) -> bool:
        """Sleep for `hold`, or until a descriptor marked `wake_at_once` is readable (True). select(2), which
        Linux and macOS both have with microsecond timeouts, not the platform's default selector: on Linux
        Python rounds its timeout up to whole milliseconds, which made a 300 us wait 1 ms and cost 11-13%
        of the images/s at 64 clients (`bench/results/resnet50-h200-64-gather-1ms-beside`). select(2) takes
        descriptors below FD_SETSIZE only (1024 on both); beyond it the wait is plain."""
        if self._urgent:
            try:
                return bool(select.select(list(self._urgent), [], [], hold)[0])
            except ValueError:  # a descriptor beyond FD_SETSIZE
                pass
            except OSError:  # EBADF: one closed before the loop stopped watching it; forget it, as the
                # kernel's own selector (epoll on Linux, kqueue on macOS) forgets a closed descriptor
                self._urgent = {fd for fd in self._urgent if _open(fd)}
        time.sleep(hold)
        return False


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def run(main: Coroutine[Any, Any, T], budget_s: float, gather_s: float) -> T:
    """`asyncio.run(main)` on a loop that gathers for up to `gather_s` while loaded, and busy-polls for up
    to `budget_s` before it sleeps."""
    return run_on(main, lambda: GatheringSelector(budget_s, gather_s))
