"""Gathering: while work already waits behind what runs next, the event loop waits a little before it sleeps,
so that one pass takes in the frames that arrive meanwhile instead of waking for each, as a network card's
interrupt moderation does.

A loop under load that reads many sockets (the daemon reading its fronts' links) wakes for each frame that
arrives while it sleeps: the wake-up, a pass of the loop and a read for one or two frames. A request that
arrives during a wait waits with it. The loop gathers only while some `Backlog` says so (in the daemon, a
model version whose lanes are all full and whose batches leave full, so that what arrives for it waits for a
worker's answer anyway), stops a wait's length before the backlog is expected to ease, and sleeps at once
otherwise. What a wait held back is dated from its start (`arrived_ns`). The sockets marked `wake_at_once`
(the workers') end a wait as soon as they are readable: an answer never waits, and neither does the batch
behind it. Measured only on one model so far (docs/performance.md, "Gathering under load"), it is off by
default.
"""

from __future__ import annotations

import os
import select
import selectors
import time
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from mpsd.net.busy_poll import BusyPollSelector, Events, run_on

T = TypeVar("T")


class Backlog(Protocol):
    """Work that waits beyond what runs next (see `GatheringSelector.watch_backlog`)."""

    @property
    def backlogged(self) -> bool: ...

    @property
    def eases_at(self) -> float:
        """When (time.monotonic()) the backlog is expected to ease, a worker's answer due (inf: unknown)."""
        ...


class GatheringSelector(BusyPollSelector):
    """A busy-polling selector that, while some backlog it was told of lasts, waits up to `gather_s` before
    each sleep. `held` counts those waits, `cut_short` the ones a socket marked `wake_at_once` ended.

    A wait ends `gather_s` before the backlog is expected to ease: what it held back is then taken in
    while the worker still computes, not in one lump with its answer, ahead of the answer's replies and
    the next batch."""

    def __init__(self, budget_s: float, gather_s: float) -> None:
        super().__init__(budget_s)
        self.gather_s = gather_s
        self.held = 0
        self.cut_short = 0
        self._urgent: set[int] = set()  # the descriptors whose events end a wait
        self._backlogs: set[Backlog] = set()  # those that said they had one, until they no longer do
        self._held_since: int | None = None  # when the wait began whose events the loop handles now

    def wake_at_once(self, fd: int) -> None:
        """Let `fd`'s events end a wait at once (until it is unregistered: its number may be reused)."""
        self._urgent.add(fd)

    def watch_backlog(self, source: Backlog) -> None:
        """`source` has a backlog: the loop gathers until it says it has none, which it is asked before
        each sleep (so one that goes away, or forgets to say, holds nothing). Cheap to call again."""
        self._backlogs.add(source)

    def gathers(self) -> bool:
        """Whether a sleep now would first gather: some backlog the loop was told of lasts, and none is
        expected to ease within a wait's length."""
        return self._hold_s(None) > 0

    def _hold_s(self, timeout: float | None) -> float:
        """How long a sleep with `timeout` first gathers (0 or less: not at all); forgets the backlogs that
        are over."""
        backlogs = self._backlogs
        if not backlogs:
            return 0.0
        backlogs.difference_update([source for source in backlogs if not source.backlogged])
        if not backlogs:
            return 0.0
        eases_at = min(source.eases_at for source in backlogs)
        hold = self.gather_s if timeout is None else min(self.gather_s, timeout)
        return min(hold, eases_at - self.gather_s - time.monotonic())

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        key = super().unregister(fileobj)
        self._urgent.discard(key.fd)
        return key

    def arrived_ns(self) -> int:
        """The stamp of what the loop reads in this pass (time.perf_counter_ns): the start of the wait that
        held it back, when the loop would otherwise have read it, or now. A request submitted as its frame
        is read (a front link's) counts its queue delay and latency from there: the loop chose to leave it
        in its socket meanwhile. Cleared at the next pass: what runs later is stamped when it runs."""
        since = self._held_since
        return time.perf_counter_ns() if since is None else since

    def select(self, timeout: float | None = None) -> Events:
        self._held_since = None
        # Not in a settling pass: its callbacks (a batch's start) run as soon as the loop has settled.
        if (timeout is None or timeout > 0) and not self._on_settled and (hold := self._hold_s(timeout)) > 0:
            since = time.perf_counter_ns()
            events, timeout = self._gather(hold, timeout)
            if events:
                self._active = True
                self._held_since = since
                return events
        return super().select(timeout)

    def _gather(self, hold: float, timeout: float | None) -> tuple[Events, float | None]:
        """Wait up to `hold` (less when a socket that wakes at once is readable), then poll: what arrived
        meanwhile, and what is left of `timeout`."""
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
    """`asyncio.run(main)` on a loop that gathers for up to `gather_s` while a backlog lasts, and
    busy-polls for up to `budget_s` before it sleeps."""
    return run_on(main, lambda: GatheringSelector(budget_s, gather_s))
