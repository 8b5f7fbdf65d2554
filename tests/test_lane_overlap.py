"""When the next batch goes to a worker that is running one: in one process, a real `VersionPlane` and its
queue against a fake worker channel whose executions end when the test says.

A worker that overlaps executions (CUDA: the next is launched behind the running one, its inputs copied
while the running one computes) gets the next batch once the running execution nears its typical end, not
after it: otherwise the device idles while the daemon hears of the end, sends the next and the worker
copies its inputs. A worker that does not overlap (the CPU, a Mac's) gets it only once the running one has
ended, so that every request that arrives meanwhile joins it. Through a real daemon on a GPU:
bench/gpu_resnet.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mpsd.daemon.dataplane.lane import NEXT_AT
from mpsd.daemon.dataplane.plane import VersionPlane
from tests.test_dataplane import FakeChannel, config, request


class Clock:
    """The lane's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class HeldChannel(FakeChannel):
    """A worker's channel (y = x + 1) whose executions each run until the test releases them."""

    def __init__(self, overlaps: bool) -> None:
        super().__init__([], "m/1#0")
        self.overlaps = overlaps
        self.started = self.executions
        self.release: list[asyncio.Event] = []
        self.changed = asyncio.Event()

    async def running(self) -> None:
        release = asyncio.Event()
        self.release.append(release)
        self.changed.set()
        await release.wait()

    async def wait_started(self, n: int) -> None:
        """Until `n` executions have started."""
        while len(self.started) < n:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 10)


async def turns(n: int = 50) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


class Served:
    """One version with one lane on `channel`, its dispatcher running; `clock` is the lane's, when given."""

    def __init__(self, channel: HeldChannel, clock: Clock | None) -> None:
        self.plane = VersionPlane("m", 1, config(8, batching=True))
        self.plane.lanes = [lane := self.plane.new_lane()]
        if clock is not None:
            lane._clock = clock
        lane.attach(channel)  # type: ignore[arg-type]
        self.plane.closed = None
        self.done_with = asyncio.Event()
        self.dispatcher = asyncio.create_task(lane.dispatch(channel, self.done_with))  # type: ignore[arg-type]
        self.lane = lane

    def send(self, rid: str) -> asyncio.Task[Any]:
        return asyncio.create_task(self.plane.infer(request(rid, 1, 2, False)))

    async def close(self) -> None:
        self.done_with.set()
        await self.lane.stop()
        self.dispatcher.cancel()
        await asyncio.gather(self.dispatcher, return_exceptions=True)


async def typical_second(channel: HeldChannel, served: Served, clock: Clock) -> None:
    """One execution that held the worker for one second of the lane's clock."""
    first = served.send("1")
    await channel.wait_started(1)
    clock.now += 1.0
    channel.release[0].set()
    await first


@pytest.mark.parametrize("overlaps", [True, False])
def test_the_next_batch_goes_near_the_running_ones_typical_end_only_where_the_worker_overlaps(
    overlaps: bool,
) -> None:
    async def main() -> None:
        channel, clock = HeldChannel(overlaps), Clock()
        served = Served(channel, clock)
        await typical_second(channel, served, clock)
        running = served.send("2")  # the lane is idle: it runs at once
        await channel.wait_started(2)
        waiting = [served.send("3"), served.send("4")]
        await turns()
        assert len(channel.started) == 2  # the running one has just begun: the next waits, gathering
        clock.now += NEXT_AT * 1.0 - 0.05
        served.lane._batches.wake()
        await turns()
        assert len(channel.started) == 2  # not yet near its end
        clock.now += 0.1
        served.lane._batches.wake()
        await turns()
        if overlaps:  # sent behind the running one, with both requests that queued meanwhile
            assert channel.started[2:] == [["3", "4"]]
        else:  # only once the running one ends
            assert len(channel.started) == 2
        channel.release[1].set()
        await running
        await channel.wait_started(3)
        assert channel.started[2] == ["3", "4"]
        channel.release[2].set()
        await asyncio.gather(*waiting)
        await served.close()

    asyncio.run(main())


def test_a_timer_wakes_the_queue_when_the_running_execution_nears_its_typical_end() -> None:
    """On the loop's own clock: nothing but the lane's timer wakes the queue while the execution runs."""

    async def main() -> None:
        channel = HeldChannel(overlaps=True)
        served = Served(channel, None)
        loop = asyncio.get_running_loop()
        first = served.send("1")
        await channel.wait_started(1)
        ended = loop.time() + 0.05
        while loop.time() < ended:  # the execution holds the worker for at least 50 ms
            await asyncio.sleep(0.01)
        channel.release[0].set()
        await first
        running = served.send("2")
        await channel.wait_started(2)
        queued = served.send("3")
        await channel.wait_started(3)  # goes while "2" still runs
        assert channel.started == [["1"], ["2"], ["3"]]
        for release in channel.release[1:]:
            release.set()
        await asyncio.gather(running, queued)
        await served.close()

    asyncio.run(main())
