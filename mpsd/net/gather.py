"""How busy an event loop is, for gathering (`busy_poll`): a loop that spends most of its time asleep
answers at once; one that is busy enough to gain waits a little before each sleep.

A loop under load that reads many sockets wakes for each frame that arrives while it sleeps: the wake-up,
a pass of the loop and a read for one or two frames. Waiting a little before the sleep lets one pass take
in all that arrived meanwhile, as a network card's interrupt moderation does. It costs each request that
arrives during the wait up to the wait, which is worth it only while the loop is busy: at saturation the
requests wait in the queue for the device anyway. Below `LOADED` the loop sleeps as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable

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
