"""Busy polling: an asyncio loop that checks its sockets for a short while before it sleeps in the kernel.

A thread that sleeps in epoll or kqueue and is woken by a socket pays for the wake-up: the scheduler, an
inter-processor interrupt and cold caches, 30-40 us a time on a 2-core VM. A small request makes the daemon's
loop sleep and wake several times: for gRPC's poller thread, which hands each completed call operation to
the loop through a socket, and for the worker's answer. Polling without blocking for up to the budget catches
those events while they are on their way, as kernel busy polling (SO_BUSY_POLL) does for network cards.

It spins only after activity: once a sleep ended on a timer with nothing to read, the loop is idle and sleeps
at once until a socket wakes it, so an idle daemon uses no CPU for this. A loop under load rarely sleeps,
so it rarely spins either; the cost is at most the budget per sleep in between.

The selector also tells when the loop has settled (`when_settled`, for `mpsd.net.settle`): it is the one
place that sees each pass of the loop and knows whether the loop has ready work left.

Gathering is the opposite trade, for a loop under load that reads many sockets (the daemon reading its
fronts' links): before a sleep it waits up to `gather_s`, so that one pass takes in the frames that arrive
meanwhile instead of waking for each (`mpsd.net.gather`). The sockets marked `wake_at_once` (the workers')
end that wait as soon as they are readable: an answer never waits, and neither does the batch behind it.
"""

from __future__ import annotations

import asyncio
import select
import selectors
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from mpsd.net.gather import LoadMeter

T = TypeVar("T")
Events = list[tuple[selectors.SelectorKey, int]]


# A settle waits at most this many passes of the loop: under a load that never lets the loop run out of
# work, the callbacks still run, after the loop has taken in a few requests' worth of events.
SETTLE_PASSES = 16


class BusyPollSelector(selectors.DefaultSelector):
    """The platform's default selector (epoll, kqueue), polling for up to `budget_s` before each sleep that
    follows activity. `caught` and `missed` count the polls that found an event and those that ran out."""

    def __init__(self, budget_s: float, gather_s: float = 0.0) -> None:
        super().__init__()
        self.budget_s = budget_s
        self.gather_s = gather_s
        self.caught = 0
        self.missed = 0
        self.held = 0  # waits for more work before a sleep (gathering)
        self.cut_short = 0  # of which a socket marked `wake_at_once` ended early
        self._meter = LoadMeter() if gather_s > 0 else None
        self._urgent: set[int] = set()  # the descriptors whose events end a gathering wait
        self._active = False  # the last sleep ended on an event, not a timer: more may be coming
        self._on_settled: list[Callable[[], None]] = []
        self._passes = 0  # passes of the loop since the first of `_on_settled` was registered

    def when_settled(self, callback: Callable[[], None]) -> None:
        """Call `callback` (on the loop's thread) at the first pass of the loop that finds no ready work
        left, or at the SETTLE_PASSES-th pass from now at the latest."""
        self._on_settled.append(callback)

    def wake_at_once(self, fd: int) -> None:
        """Let `fd`'s events end a gathering wait at once (until it is unregistered)."""
        if self._meter is not None:
            self._urgent.add(fd)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        key = super().unregister(fileobj)
        self._urgent.discard(key.fd)
        return key

    def select(self, timeout: float | None = None) -> Events:
        if self._meter is None:
            return self._select(timeout)
        self._meter.entered()
        try:
            return self._select(timeout)
        finally:
            self._meter.left()

    def _select(self, timeout: float | None) -> Events:
        if self._on_settled:
            timeout = self._settle_pass(timeout)
        if timeout is not None and timeout <= 0:  # the loop has callbacks ready: a poll, not a sleep
            events = super().select(timeout)
            self._active = self._active or bool(events)
            return events
        if self._meter is not None and self._meter.loaded:
            events, timeout = self._gather(timeout)
            if events:
                self._active = True
                return events
        if self._active and self.budget_s > 0:
            start = time.monotonic()
            spin_until = start + (self.budget_s if timeout is None else min(self.budget_s, timeout))
            while True:
                events = super().select(0)
                if events:
                    self.caught += 1
                    return events
                now = time.monotonic()
                if now >= spin_until:
                    break
            self.missed += 1
            if timeout is not None:
                timeout = max(0.0, timeout - (now - start))
        events = super().select(timeout)
        self._active = bool(events)
        return events

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
        """Sleep for `hold`, or until a descriptor marked `wake_at_once` is readable (True). select(2), not
        epoll: Python rounds epoll's timeout up to whole milliseconds, which made a 300 us wait 1 ms and
        cost 11-13% of the images/s at 64 clients (`bench/results/resnet50-h200-64-gather-1ms-beside`).
        select(2) takes descriptors below FD_SETSIZE only; beyond it the wait is plain."""
        if self._urgent:
            try:
                return bool(select.select(list(self._urgent), [], [], hold)[0])
            except ValueError:  # a descriptor beyond FD_SETSIZE
                pass
        time.sleep(hold)
        return False

    def _settle_pass(self, timeout: float | None) -> float | None:
        """The loop asks for I/O with `timeout` 0 while it has callbacks ready; otherwise it has settled.
        Once settled (or at the bound), run the waiting callbacks and poll instead of sleeping: the work
        they schedule runs in this pass."""
        self._passes += 1
        if timeout is not None and timeout <= 0 and self._passes < SETTLE_PASSES:
            return timeout
        callbacks, self._on_settled, self._passes = self._on_settled, [], 0
        for callback in callbacks:
            callback()
        return 0.0


def run(main: Coroutine[Any, Any, T], budget_s: float, gather_s: float = 0.0) -> T:
    """`asyncio.run(main)` on a selector event loop that busy-polls for up to `budget_s` before it sleeps,
    and under load gathers for up to `gather_s` first."""

    def factory() -> asyncio.AbstractEventLoop:
        return asyncio.SelectorEventLoop(BusyPollSelector(budget_s, gather_s))

    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(main)
    asyncio.set_event_loop_policy(_Policy(factory))  # Python 3.10: no Runner; asyncio.run asks the policy
    return asyncio.run(main)


class _Policy(asyncio.DefaultEventLoopPolicy):
    def __init__(self, factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
        super().__init__()
        self._factory = factory

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return self._factory()
