"""The moments a queue acts on its own: each queued request's deadline (or, under DELAY, its move back),
kept in one heap under one timer of the event loop's, the earliest's.

A timer of the loop's for each request (`call_later`) costs a handle, a push into the loop's heap, whose
entries compare in Python, and a cancellation when the request leaves the queue, nearly always long
before its deadline: a tenth of the daemon's CPU on a front's call, where clients set deadlines. Here a
request's alarm is a small object in a heap of tuples that compare in C; leaving the queue marks it
cancelled, and cancelled alarms are swept out once they are more than half the heap.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
# Below this many cancelled alarms the heap is not swept (a sweep walks it whole).
SWEEP_AFTER = 64


class Alarm(Generic[T]):
    """One request's moment: `cancel` once it leaves the queue (what `batching.disarm` calls)."""

    __slots__ = ("_alarms", "cancelled", "item", "moves")

    def __init__(self, alarms: Alarms[T], item: T, moves: bool) -> None:
        self._alarms = alarms
        self.item = item
        self.moves = moves  # under DELAY: the request moves back, it is not dropped
        self.cancelled = False

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._alarms.cancelled += 1


class Alarms(Generic[T]):
    """A queue's alarms: `ring(item, moves)` runs for each at its moment, unless it was cancelled first.
    `clock` is the time the moments are in (the loop's, in tests)."""

    def __init__(self, ring: Callable[[T, bool], None], clock: Callable[[], float]) -> None:
        self._ring = ring
        self._clock = clock
        self._heap: list[tuple[float, int, Alarm[T]]] = []
        self._order = itertools.count()  # equal moments ring in the order they were set
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self.cancelled = 0  # cancelled alarms still in the heap

    def __len__(self) -> int:
        return len(self._heap)

    def set(self, at: float, item: T, moves: bool = False) -> Alarm[T]:
        alarm = Alarm(self, item, moves)
        heapq.heappush(self._heap, (at, next(self._order), alarm))
        if at < self._timer_at:
            self._schedule(at)
        if self.cancelled > SWEEP_AFTER and 2 * self.cancelled > len(self._heap):
            self._sweep()
        return alarm

    def _schedule(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        delay = max(0.0, at - self._clock())
        self._timer = asyncio.get_running_loop().call_later(delay, self._due)
        self._timer_at = at

    def _due(self) -> None:
        """The loop's timer: ring every alarm whose moment has come, then wait for the next live one."""
        self._timer, self._timer_at = None, math.inf
        now = self._clock()
        # (`self._heap` each time: a ring may set an alarm, and a sweep then makes a new heap)
        while self._heap and (self._heap[0][2].cancelled or self._heap[0][0] <= now):
            alarm = heapq.heappop(self._heap)[2]
            if alarm.cancelled:
                self.cancelled -= 1
                continue
            alarm.cancelled = True  # rung: a later `cancel` counts nothing
            self._ring(alarm.item, alarm.moves)
        if self._heap and self._heap[0][0] < self._timer_at:
            self._schedule(self._heap[0][0])

    def _sweep(self) -> None:
        self._heap = [entry for entry in self._heap if not entry[2].cancelled]
        heapq.heapify(self._heap)
        self.cancelled = 0
