"""The event loop under the daemon and its front processes: asyncio's own, or uvloop on request.

Nothing in mpsd depends on which loop runs it. uvloop (libuv) runs the same asyncio code with cheaper
callbacks, futures and transports; on the shortened request path it measured no faster than asyncio's loop
(docs/performance.md), so it is a setting, not the default. asyncio's loop busy-polls before it sleeps
(`busy_poll`), gathers while work waits (`gather`), and tells when it has settled (`settle`); uvloop's
cannot be made to.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

from mpsd.errors import ConfigError
from mpsd.ipc.heap import keep_large_buffers_in_heap
from mpsd.net import busy_poll, gather

Choice = Literal["asyncio", "uvloop"]
T = TypeVar("T")


def check(choice: Choice) -> None:
    """Asking for uvloop where it is not installed is a configuration error, found before anything starts."""
    if choice == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            raise ConfigError("event_loop: uvloop is not installed (pip install 'mpsd[uvloop]')") from None


def run(main: Coroutine[Any, Any, T], choice: Choice, busy_poll_us: int = 0, gather_us: int = 0) -> T:
    """Run a gRPC-serving process (the daemon, a front) on its loop, its large buffers kept in the heap;
    asyncio's loop polls for up to `busy_poll_us` before each sleep that follows activity (0: never), and
    while some model version's lanes are all full and its batches leave full first gathers for up to
    `gather_us`, ending a wait that long before a worker's answer is due (0: never)."""
    keep_large_buffers_in_heap()
    if choice == "uvloop":
        import uvloop

        return uvloop.run(main)
    if gather_us > 0:
        return gather.run(main, busy_poll_us / 1e6, gather_us / 1e6)
    return busy_poll.run(main, busy_poll_us / 1e6)  # with 0 it never polls, and still tells a settled loop


def loop_name() -> str:
    """The running loop, for the start-up log line."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"


def busy_poll_us() -> int:
    """The running loop's busy-poll budget in microseconds (0: it sleeps at once), for the start-up log."""
    selector = _selector()
    return round(selector.budget_s * 1e6) if selector is not None else 0


def gather_us() -> int:
    """The running loop's longest gathering wait in microseconds (0: it never gathers), for the log."""
    selector = _selector()
    return round(selector.gather_s * 1e6) if isinstance(selector, gather.GatheringSelector) else 0


def wake_at_once(sock: socket.socket) -> None:
    """Events on `sock` end the running loop's gathering wait at once (a no-op on a loop that does not
    gather); until the loop stops watching it."""
    selector = _selector()
    if isinstance(selector, gather.GatheringSelector):
        selector.wake_at_once(sock.fileno())


def backlog_reporter() -> Callable[[gather.Backlog], None]:
    """What a backlog calls to tell the running loop it has one (`GatheringSelector.watch_backlog`); a no-op
    on a loop that does not gather, or where no loop runs."""
    try:
        selector = _selector()
    except RuntimeError:
        return _unheard
    return selector.watch_backlog if isinstance(selector, gather.GatheringSelector) else _unheard


def arrival_clock(clock_ns: Callable[[], int] = time.perf_counter_ns) -> Callable[[], int]:
    """What stamps a request as it arrives: `clock_ns`, or where that is perf_counter_ns on a loop that
    gathers, its selector's `arrived_ns`, which dates what a gathering wait held back from the wait's start
    (another clock, a test's, is kept as it is)."""
    if clock_ns is not time.perf_counter_ns:
        return clock_ns
    try:
        selector = _selector()
    except RuntimeError:
        return clock_ns
    return selector.arrived_ns if isinstance(selector, gather.GatheringSelector) else clock_ns


def _unheard(source: gather.Backlog) -> None:
    pass


def _selector() -> busy_poll.BusyPollSelector | None:
    selector = getattr(asyncio.get_running_loop(), "_selector", None)
    return selector if isinstance(selector, busy_poll.BusyPollSelector) else None
