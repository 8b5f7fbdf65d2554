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
place that sees each pass of the loop and knows whether the loop has ready work left. Gathering, the
opposite trade for a busy loop, is a selector of its own (`mpsd.net.gather`).
"""

from __future__ import annotations

import asyncio
import selectors
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
Events = list[tuple[selectors.SelectorKey, int]]


# A settle waits at most this many passes of the loop: under a load that never lets the loop run out of
# work, the callbacks still run, after the loop has taken in a few requests' worth of events.
SETTLE_PASSES = 16


class BusyPollSelector(selectors.DefaultSelector):
    """The platform's default selector (epoll, kqueue), polling for up to `budget_s` before each sleep that
    follows activity. `caught` and `missed` count the polls that found an event and those that ran out."""

    def __init__(self, budget_s: float) -> None:
        super().__init__()
        self.budget_s = budget_s
        self.caught = 0
        self.missed = 0
        self._active = False  # the last sleep ended on an event, not a timer: more may be coming
        self._on_settled: list[Callable[[], None]] = []
        self._passes = 0  # passes of the loop since the first of `_on_settled` was registered

    def when_settled(self, callback: Callable[[], None]) -> None:
        """Call `callback` (on the loop's thread) at the first pass of the loop that finds no ready work
        left, or at the SETTLE_PASSES-th pass from now at the latest."""
        self._on_settled.append(callback)

    def select(self, timeout: float | None = None) -> Events:
        if self._on_settled:
            timeout = self._settle_pass(timeout)
        if timeout is not None and timeout <= 0:  # the loop has callbacks ready: a poll, not a sleep
            events = super().select(timeout)
            self._active = self._active or bool(events)
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


def run(main: Coroutine[Any, Any, T], budget_s: float) -> T:
    """`asyncio.run(main)` on a selector event loop that busy-polls for up to `budget_s` before it sleeps."""
    return run_on(main, lambda: BusyPollSelector(budget_s))


def run_on(main: Coroutine[Any, Any, T], selector: Callable[[], selectors.BaseSelector]) -> T:
    """`asyncio.run(main)` on a selector event loop on the selector that `selector()` makes."""

    def factory() -> asyncio.AbstractEventLoop:
        return asyncio.SelectorEventLoop(selector())

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
