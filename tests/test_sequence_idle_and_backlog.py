"""The sequence scheduler's idle timeout and backlog order in one process, on a clock the test drives: a
sequence idle for less than `max_sequence_idle_microseconds` keeps its slot, one idle for that long is
ended; sequences waiting in the backlog get freed slots first come, first served."""

from __future__ import annotations

import asyncio

import pytest

from mpsd.daemon.dataplane.queue import Pending
from mpsd.daemon.dataplane.sequences import SequenceScheduler
from mpsd.errors import InvalidArgument
from tests.test_sequence_scheduler import _config, _done, _item, _next

IDLE_S = 0.1  # max_sequence_idle_microseconds of _config


class Clock:
    """What the scheduler reads as time.monotonic: moved by the test only."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _answer(items: list[Pending]) -> None:
    """Answer the requests and let the scheduler see it (their futures' callbacks run on the loop)."""
    _done(items)
    await asyncio.sleep(0)


def _scheduler(clock: Clock, max_batch_size: int) -> SequenceScheduler:
    scheduler = SequenceScheduler("acc", 1, _config(max_batch_size=max_batch_size), clock=clock)
    scheduler.new_lane().serving = True
    return scheduler


def test_an_idle_sequence_ends_at_its_timeout_and_not_before() -> None:
    async def body() -> None:
        clock = Clock()
        scheduler = _scheduler(clock, max_batch_size=2)
        [lane] = scheduler.lanes
        scheduler.put(_item(1, start=True))
        await _answer(await _next(lane))  # idle from here: its last request ended now
        ended_at = clock.now
        clock.now = ended_at + IDLE_S * 0.9
        scheduler._reap()  # what the scheduler's timer runs
        assert scheduler.counts.timed_out == 0 and scheduler.active == 1
        clock.now = ended_at + IDLE_S * 1.1
        scheduler._reap()
        assert scheduler.counts.timed_out == 1 and scheduler.active == 0
        with pytest.raises(InvalidArgument, match="START flag"):
            scheduler.put(_item(1))

    asyncio.run(body())


def test_a_request_restarts_the_idle_time() -> None:
    async def body() -> None:
        clock = Clock()
        scheduler = _scheduler(clock, max_batch_size=2)
        [lane] = scheduler.lanes
        scheduler.put(_item(1, start=True))
        await _answer(await _next(lane))
        clock.now += IDLE_S * 0.9
        scheduler.put(_item(1))
        await _answer(await _next(lane))
        clock.now += IDLE_S * 0.9  # 1.8 timeouts since the start, 0.9 since the last request
        scheduler._reap()
        assert scheduler.counts.timed_out == 0 and scheduler.active == 1

    asyncio.run(body())


def test_sequences_in_the_backlog_take_freed_slots_first_come_first_served() -> None:
    async def body() -> None:
        clock = Clock()
        scheduler = _scheduler(clock, max_batch_size=1)  # one slot
        [lane] = scheduler.lanes
        scheduler.put(_item(1, start=True))
        _done(await _next(lane))
        for corrid in (2, 3, 4):  # wait in the backlog, in this order
            scheduler.put(_item(corrid, start=True))
        assert [s.corrid for s in scheduler.backlog] == [2, 3, 4]
        order = []
        holder = 1
        for _ in range(3):
            scheduler.put(_item(holder, end=True))  # the holder ends: its slot goes to the backlog's first
            _done(await _next(lane))
            [started] = await _next(lane)
            holder = started.request.sequence.corrid
            order.append(holder)
            _done([started])
        assert order == [2, 3, 4]

    asyncio.run(body())
