"""Front processes are restarted with the workers' back-off policy. The pool runs on fake processes here (no
front is started; its spawn is replaced) with its sleep and clock injected, so the test asserts the delays it
chose. Real fronts dying and coming back: test_fronts."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, cast

from mpsd.config.daemon_config import DaemonConfig
from mpsd.daemon.supervise.fronts.link import FrontLink
from mpsd.daemon.supervise.fronts.pool import Front, FrontPool

_pids = itertools.count(500)


class FakeProcess:
    """A front process that ends when the test says so."""

    def __init__(self) -> None:
        self.pid = next(_pids)
        self.returncode: int | None = None
        self._ended = asyncio.Event()

    async def wait(self) -> int:
        await self._ended.wait()
        assert self.returncode is not None
        return self.returncode

    def end(self, code: int) -> None:
        self.returncode = code
        self._ended.set()


class Harness:
    """A pool whose spawn makes fake fronts, failing the attempts the test asks to fail."""

    def __init__(self, initial_s: float = 0.5, max_s: float = 4.0) -> None:
        config = DaemonConfig(restart_backoff_initial_s=initial_s, restart_backoff_max_s=max_s)
        self.pool = FrontPool(1, config, "unix:/nowhere", infer=self._never)
        self.now = 1000.0
        self.delays: list[float] = []
        self.failures_left = 0
        self.spawned: list[FakeProcess] = []
        self.slept = asyncio.Event()
        pool = cast(Any, self.pool)
        pool._sleep = self._sleep
        pool._clock = lambda: self.now
        pool._spawn = self._spawn

    @staticmethod
    async def _never(payload: object, deadline: float | None, traceparent: str | None) -> list[bytes]:
        raise AssertionError("no call reaches a fake front")

    async def _sleep(self, delay: float) -> None:
        self.delays.append(delay)
        self.now += delay
        self.slept.set()
        await asyncio.sleep(0)

    async def _spawn(self, index: int) -> Front:
        if self.failures_left:
            self.failures_left -= 1
            raise OSError("too many open files")
        process = FakeProcess()
        self.spawned.append(process)
        link = FrontLink(index, self._never, lambda _: None)
        front = Front(index, cast(asyncio.subprocess.Process, process), link)
        self.pool.fronts[index] = front
        return front

    async def until(self, predicate: Any) -> None:
        for _ in range(1000):
            if predicate():
                return
            await asyncio.sleep(0)
        raise AssertionError("the pool never got there")


def test_front_restarts_back_off_double_to_the_cap_and_reset_after_a_stable_run() -> None:
    async def main() -> None:
        h = Harness(initial_s=0.5, max_s=4.0)
        await h._spawn(0)
        h.pool._backoff(0).started(h.now)  # what start() does after the first spawn
        supervisor = asyncio.create_task(h.pool._supervise(0))
        # It dies at once and five attempts to start it again fail: 0.5, 1, 2, 4, 4 (the cap), then it runs.
        h.failures_left = 5
        h.spawned[-1].end(1)
        await h.until(lambda: len(h.spawned) == 2)
        assert h.delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
        assert h.pool.restarts == {0: 1}
        # It dies again soon: the back-off goes on from where it was.
        h.now += 5.0
        h.spawned[-1].end(1)
        await h.until(lambda: len(h.spawned) == 3)
        assert h.delays[-1] == 4.0
        # After a stable run (longer than 30 s) the next death starts the schedule over.
        h.now += 60.0
        h.spawned[-1].end(1)
        await h.until(lambda: len(h.spawned) == 4)
        assert h.delays[-1] == 0.5
        assert h.pool.restarts == {0: 3}
        h.pool._stopping = True
        supervisor.cancel()

    asyncio.run(main())


def test_a_stopping_pool_does_not_restart_a_front_that_ends() -> None:
    async def main() -> None:
        h = Harness()
        await h._spawn(0)
        supervisor = asyncio.create_task(h.pool._supervise(0))
        await asyncio.sleep(0)
        h.pool._stopping = True
        h.spawned[-1].end(0)
        await asyncio.wait_for(supervisor, 5)
        assert h.delays == [] and len(h.spawned) == 1

    asyncio.run(main())


def test_a_front_that_dies_soon_after_its_restart_is_not_forgiven() -> None:
    """The stable run is counted from the restart: a front that ran long, died, came back and died again at
    once gets the doubled delay, not the initial one."""

    async def main() -> None:
        h = Harness(initial_s=0.5, max_s=4.0)
        await h._spawn(0)
        h.pool._backoff(0).started(h.now)  # what start() does after the first spawn
        supervisor = asyncio.create_task(h.pool._supervise(0))
        h.now += 60.0
        h.spawned[-1].end(1)
        await h.until(lambda: len(h.spawned) == 2)
        h.now += 1.0
        h.spawned[-1].end(1)
        await h.until(lambda: len(h.spawned) == 3)
        assert h.delays == [0.5, 1.0]
        h.pool._stopping = True
        supervisor.cancel()

    asyncio.run(main())
