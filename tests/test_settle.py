"""Settling: with no queue delay, a batch that finds its instance free waits until the daemon's loop has
taken in the requests already on their way, and they join it; a request alone in the daemon does not wait.

The loop-level tests run on mpsd's own loop (`busy_poll.run`); the queue-level ones hand the queue a settle
the test controls, so what arrives "while the loop settles" is exact."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.dataplane.plane import VersionPlane
from mpsd.daemon.dataplane.queue import Pending, RequestQueue
from mpsd.daemon.dataplane.request import InferRequest, InferResult, InputTensor
from mpsd.net import busy_poll
from mpsd.net.settle import settled


def chain(length: int, done: list[int]) -> Callable[[], None]:
    """A callback that schedules itself `length` times in all (one per pass of the loop); `done` counts."""

    def step() -> None:
        done.append(1)
        if len(done) < length:
            asyncio.get_running_loop().call_soon(step)

    return step


def test_a_settle_waits_for_the_work_that_was_ready() -> None:
    """Work that keeps the loop busy for a few passes (a request on its way: gRPC's event, the task that
    reads it, the handler) has all run by the time the settle ends."""

    async def main() -> int:
        done: list[int] = []
        asyncio.get_running_loop().call_soon(chain(busy_poll.SETTLE_PASSES // 2, done))
        await asyncio.wait_for(settled(), 5)
        return len(done)

    assert busy_poll.run(main(), 0.0) == busy_poll.SETTLE_PASSES // 2


def test_a_loop_that_never_settles_still_ends_the_wait() -> None:
    async def main() -> int:
        done: list[int] = []
        asyncio.get_running_loop().call_soon(chain(10**9, done))
        await asyncio.wait_for(settled(), 5)
        return len(done)

    # The bound, plus the passes that wake the waiting tasks (`wait_for`'s and the test's).
    assert busy_poll.run(main(), 0.0) <= busy_poll.SETTLE_PASSES + 4


def test_an_idle_loop_settles_at_once_without_sleeping() -> None:
    """Nothing ready and nothing due: the loop would sleep in the kernel; the settle ends instead. With no
    timer and no I/O to come, a sleep here would last until `wait_for`'s timeout fails the test."""

    async def main() -> float:
        start = time.monotonic()
        await asyncio.wait_for(settled(), 5)
        return time.monotonic() - start

    assert busy_poll.run(main(), 0.0002) < 4


def test_a_cancelled_settle_leaves_the_loop_working() -> None:
    async def main() -> None:
        waiting = asyncio.create_task(settled())
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.wait_for(settled(), 5)  # the cancelled one's callback finds its waiter done

    busy_poll.run(main(), 0.0)


CONFIG = {
    "max_batch_size": 8,
    "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [-1]}],
    "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [-1]}],
    "dynamic_batching": {"max_queue_delay_microseconds": 0},
}


def pending(width: int = 4, rows: int = 1) -> Pending:
    request = InferRequest(
        "m", "1", "", (InputTensor("x", "FP32", (rows, width), bytes(4 * width * rows)),), ("y",), rows
    )
    return Pending(request, asyncio.get_running_loop().create_future(), time.perf_counter_ns())


class Settle:
    """A settle during whose first call `arrivals` arrive."""

    def __init__(self, arrivals: Callable[[], None] = lambda: None) -> None:
        self.calls = 0
        self.arrivals = arrivals

    async def __call__(self) -> None:
        self.calls += 1
        arrivals, self.arrivals = self.arrivals, lambda: None
        arrivals()
        await asyncio.sleep(0)


def test_requests_that_arrive_while_a_direct_request_settles_join_its_batch() -> None:
    async def scenario() -> None:
        queue: RequestQueue
        late = [pending(), pending(), pending(width=2), pending()]

        def arrive() -> None:
            assert not queue.runs_at_once(pending()), "a request went around the one gathering"
            for item in late:
                queue.put(item)

        settle = Settle(arrive)
        queue = RequestQueue(ModelConfig.model_validate(CONFIG), "m", settle)
        first = pending()
        assert queue.runs_at_once(first)
        batch = await asyncio.wait_for(queue.gather([first]), 5)
        assert batch == [first, late[0], late[1], late[3]]  # the other shape waits for a batch of its own
        assert list(queue._items) == [late[2]]
        assert queue.runs_at_once(pending()) is False  # something is queued
        assert len(await asyncio.wait_for(queue.next_batch(), 5)) == 1
        assert queue.runs_at_once(pending())

    asyncio.run(scenario())


def test_a_gathered_batch_stops_at_max_rows() -> None:
    async def scenario() -> None:
        queue: RequestQueue
        settle = Settle(lambda: [queue.put(pending(rows=3)) for _ in range(3)])
        queue = RequestQueue(ModelConfig.model_validate(CONFIG), "m", settle)
        batch = await asyncio.wait_for(queue.gather([pending(rows=1)]), 5)
        assert [item.request.batch_size for item in batch] == [1, 3, 3]
        assert len(queue) == 1

    asyncio.run(scenario())


def test_a_queued_short_batch_waits_for_one_settle_and_takes_what_arrived() -> None:
    async def scenario() -> None:
        queue: RequestQueue
        settle = Settle(lambda: queue.put(pending()))
        queue = RequestQueue(ModelConfig.model_validate(CONFIG), "m", settle)
        queue.put(pending())
        assert len(await asyncio.wait_for(queue.next_batch(), 5)) == 2
        assert settle.calls == 1  # one settle, not one per arrival

    asyncio.run(scenario())


def test_no_settle_with_a_queue_delay_a_full_batch_or_without_batching() -> None:
    async def scenario() -> None:
        delayed = {**CONFIG, "dynamic_batching": {"max_queue_delay_microseconds": 100}}
        unbatched = {**CONFIG, "max_batch_size": 0, "dynamic_batching": None}
        del unbatched["dynamic_batching"]
        unbatched["input"] = [{"name": "x", "data_type": "TYPE_FP32", "dims": [1, 4]}]
        unbatched["output"] = [{"name": "y", "data_type": "TYPE_FP32", "dims": [1, 4]}]
        for config, first in ((delayed, pending()), (CONFIG, pending(rows=8)), (unbatched, pending())):
            settle = Settle()
            queue = RequestQueue(ModelConfig.model_validate(config), "m", settle)
            assert await queue.gather([first]) == [first]
            queue.put(pending(rows=first.request.batch_size))
            await asyncio.wait_for(queue.next_batch(), 5)
            assert settle.calls == 0, config

    asyncio.run(scenario())


class FakeLane:
    """A lane that is always free and records, for each direct execution, whether it gathered; each
    execution ends when the test releases it."""

    serving = True

    def __init__(self) -> None:
        self.gathered: list[bool] = []
        self.release = asyncio.Event()

    def direct_channel(self) -> object:
        return self

    async def run_direct(self, batch: list[Pending], channel: object, gather: bool = True) -> None:
        self.gathered.append(gather)
        await self.release.wait()
        for item in batch:
            item.future.set_result(InferResult("m", 1, ()))


def test_a_request_alone_in_the_daemon_runs_without_gathering_and_one_beside_others_gathers() -> None:
    """One client's requests, one after another, have nobody to wait for; a request that arrives while
    another of its model is in progress waits for the loop to settle."""

    async def scenario() -> list[bool]:
        plane = VersionPlane("m", 1, ModelConfig.model_validate(CONFIG))
        lane = FakeLane()
        plane.lanes = [lane]  # type: ignore[list-item]
        plane.closed = None
        request = pending().request
        lane.release.set()
        await plane.infer(request)  # alone
        lane.release.clear()
        first = asyncio.create_task(plane.infer(request))
        await until_called(lane, 2)
        second = asyncio.create_task(plane.infer(request))  # beside the first
        await until_called(lane, 3)
        lane.release.set()
        await asyncio.wait_for(asyncio.gather(first, second), 5)
        return lane.gathered

    assert asyncio.run(scenario()) == [False, False, True]


async def until_called(lane: FakeLane, calls: int) -> None:
    for _ in range(1000):
        if len(lane.gathered) >= calls:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{len(lane.gathered)} direct executions, expected {calls}")
