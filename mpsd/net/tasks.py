"""Tasks owned by the one thing whose lifetime they share: an instance's executions, a worker being retired, a
stream's requests, a front's stderr relay, versions draining after a rollout.

asyncio keeps only a weak reference to a task, so a task nobody holds can be collected mid-run; a set kept
by hand holds it, but nothing then ends it with its owner. A `TaskGroup` holds its tasks while they run and
ends them with its owner: `close` lets them finish for a grace period, then cancels the rest and waits for
them. (asyncio.TaskGroup, from Python 3.11, also cancels every task when one fails, which none of these
owners wants.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class TaskGroup:
    __slots__ = ("_tasks",)

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        """Start `coro` as a task of this group; it leaves the group when it is done."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def join(self, timeout_s: float | None = None) -> bool:
        """Wait (at most `timeout_s`) for every task, those started meanwhile too; True when none is left.
        A task's exception stays its own: it is retrieved, not raised here."""
        loop = asyncio.get_running_loop()
        end = None if timeout_s is None else loop.time() + timeout_s
        while self._tasks:
            left = None if end is None else end - loop.time()
            if left is not None and left <= 0:
                return False
            done, _ = await asyncio.wait(set(self._tasks), timeout=left)
            for task in done:
                if not task.cancelled():
                    task.exception()
        return True

    async def close(self, grace_s: float = 0.0) -> None:
        """Let the tasks finish for `grace_s`, then cancel those left and wait until they have ended."""
        if grace_s > 0 and await self.join(grace_s):
            return
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
