"""Watching an execution nobody waits for any more: its callers went away, or its deadline passed before the
worker started it. The execution's control block (byte 0 of its input region) tells the worker, which skips
an abandoned execution it has not started."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from mpsd.ipc import protocol as p


def watch(
    control: memoryview,
    waiting: Sequence[asyncio.Future[Any]],
    deadline: float | None,
    loop: asyncio.AbstractEventLoop,
    expired: Callable[[], None] | None = None,
) -> Callable[[], None]:
    """Mark the execution abandoned in its control block (byte 0) once every future in `waiting` is done or
    the deadline passes; returns what stops watching. The worker skips an abandoned execution it has not
    started, so a request cancelled or expired while the previous batch runs does not run after all. When
    the deadline passes before the worker marked the execution started, `expired` is called: the caller
    answers at once instead of waiting for the execution ahead of it to end."""

    def mark(why: int) -> bool:
        with contextlib.suppress(ValueError):  # the regions were released (the worker died)
            if control[0] == 0:
                control[0] = why
                return True
        return False

    def check(_: object = None) -> None:
        if waiting and all(f.done() for f in waiting):
            mark(p.ABANDONED_CANCELLED)

    def expire() -> None:
        if mark(p.ABANDONED_EXPIRED) and expired is not None:
            expired()

    for future in waiting:
        future.add_done_callback(check)
    timer = loop.call_later(max(0.0, deadline - time.monotonic()), expire) if deadline is not None else None

    def unwatch() -> None:
        for future in waiting:
            future.remove_done_callback(check)
        if timer is not None:
            timer.cancel()

    return unwatch
