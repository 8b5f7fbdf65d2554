"""A TaskGroup holds its tasks while they run and ends them with its owner: `join` waits for every task (those
started meanwhile too), `close` lets them finish for a grace period and then cancels the rest, and a task's
own failure stays its own."""

from __future__ import annotations

import asyncio

from mpsd.net.tasks import TaskGroup


def test_join_waits_for_tasks_started_while_it_waits() -> None:
    async def scenario() -> list[str]:
        group = TaskGroup()
        order: list[str] = []
        second_may_end = asyncio.Event()

        async def second() -> None:
            await second_may_end.wait()
            order.append("second")

        async def first() -> None:
            await asyncio.sleep(0)
            group.spawn(second())  # started while join already waits
            order.append("first")
            second_may_end.set()

        group.spawn(first())
        assert await group.join()
        assert len(group) == 0
        return order

    assert asyncio.run(scenario()) == ["first", "second"]


def test_join_with_a_timeout_leaves_the_tasks_running() -> None:
    async def scenario() -> None:
        group = TaskGroup()
        release = asyncio.Event()
        task = group.spawn(release.wait())
        assert not await group.join(0.01)
        assert not task.done() and len(group) == 1
        release.set()
        assert await group.join()

    asyncio.run(scenario())


def test_close_lets_tasks_finish_within_the_grace_then_cancels_the_rest() -> None:
    async def scenario() -> None:
        group = TaskGroup()
        quick_may_end = asyncio.Event()
        quick = group.spawn(quick_may_end.wait())
        never = group.spawn(asyncio.Event().wait())
        asyncio.get_running_loop().call_soon(quick_may_end.set)
        await group.close(grace_s=0.2)
        assert quick.done() and not quick.cancelled()
        assert never.cancelled()
        assert len(group) == 0

    asyncio.run(scenario())


def test_close_without_grace_cancels_at_once_and_waits_for_the_cleanup() -> None:
    async def scenario() -> list[str]:
        group = TaskGroup()
        cleaned: list[str] = []
        started = asyncio.Event()

        async def holds() -> None:
            started.set()
            try:
                await asyncio.Event().wait()
            finally:
                await asyncio.sleep(0)  # its cleanup takes a turn of the loop: close waits for it
                cleaned.append("done")

        group.spawn(holds())
        await started.wait()
        await group.close()
        return cleaned

    assert asyncio.run(scenario()) == ["done"]


def test_a_tasks_failure_is_not_raised_by_join() -> None:
    async def fails() -> None:
        raise ValueError("its own")

    async def scenario() -> bool:
        group = TaskGroup()
        task = group.spawn(fails())
        joined = await group.join()
        assert isinstance(task.exception(), ValueError)
        return joined

    assert asyncio.run(scenario())
