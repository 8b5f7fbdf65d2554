"""Accept failures (out of file descriptors) are logged at most once a second, with the count of those held
back, in-process with a fake clock. A real daemon out of descriptors, which keeps serving once they close,
is test_open_files.py's."""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from typing import Any

from structlog.testing import capture_logs

from mpsd.net.accept_errors import AcceptErrors
from mpsd.net.log_rate import Throttle
from tests.manual_clock import Clock

EVENT = "accepting connections failed"
ASYNCIO_LINE = "socket.accept() out of system resource"  # what asyncio's own handler writes, each time


def test_the_throttle_admits_one_per_interval_and_counts_the_rest() -> None:
    clock = Clock()
    throttle = Throttle(1.0, clock)
    assert throttle.admit() == 0
    assert [throttle.admit() for _ in range(3)] == [None, None, None]
    clock.now += 0.99
    assert throttle.admit() is None
    assert abs(throttle.wait_s() - 0.01) < 1e-9
    clock.now += 0.01
    assert throttle.admit() == 4  # the four held back, told with this one
    assert throttle.flush() == 0  # nothing held since
    assert throttle.admit() is None
    clock.now += 1.0
    assert throttle.flush() == 1
    assert throttle.admit() is None  # the flush opened a new interval


class FakeLoop:
    """What the handler uses of a loop: timers it can fire by hand, and the default handler."""

    def __init__(self) -> None:
        self.timers: list[tuple[float, Callable[[], None]]] = []
        self.defaulted: list[dict[str, Any]] = []

    def call_later(self, delay: float, callback: Callable[[], None]) -> object:
        self.timers.append((delay, callback))
        return callback  # a handle

    def fire(self) -> None:
        timers, self.timers = self.timers, []
        for _, callback in timers:
            callback()


def accept_failure() -> dict[str, Any]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    try:
        return {
            "message": ASYNCIO_LINE,
            "exception": OSError(errno.EMFILE, "Too many open files"),
            "socket": listener,
        }
    finally:
        listener.close()


def test_accept_failures_are_one_event_per_second_with_the_count_held_back() -> None:
    clock = Clock()
    loop = FakeLoop()
    handler = AcceptErrors(Throttle(1.0, clock), lambda _, context: loop.defaulted.append(context))
    failure = accept_failure()
    with capture_logs() as logs:
        for _ in range(500):  # one pass of asyncio's accept loop over its backlog
            handler(loop, failure)  # type: ignore[arg-type]
        assert [e["suppressed"] for e in logs] == [0]
        assert logs[0]["event"] == EVENT and logs[0]["errno"] == "EMFILE"
        assert [delay for delay, _ in loop.timers] == [1.0]  # one timer for the count, not one per failure
        clock.now += 0.5
        handler(loop, failure)  # type: ignore[arg-type]
        assert len(logs) == 1 and len(loop.timers) == 1
        clock.now += 0.5
        loop.fire()  # the interval's end: the 500 held back are told, no failure needed to tell them
        assert [e["suppressed"] for e in logs] == [0, 499]
        clock.now += 0.2
        handler(loop, failure)  # type: ignore[arg-type]
        clock.now += 1.0
        handler(loop, failure)  # type: ignore[arg-type]
        loop.fire()  # told already by the failure above
        assert [e["suppressed"] for e in logs] == [0, 499, 1]
    assert len(logs) + sum(e["suppressed"] for e in logs) == 500 + 1 + 2  # every failure counted once
    assert loop.defaulted == []


def test_other_exceptions_go_to_the_default_handler() -> None:
    loop = FakeLoop()
    handler = AcceptErrors(Throttle(1.0, Clock()), lambda _, context: loop.defaulted.append(context))
    other = {"message": "Task exception was never retrieved", "exception": RuntimeError("x")}
    refused = {"message": "socket.accept() failed", "exception": OSError(errno.EPERM, "no")}
    with capture_logs() as logs:
        handler(loop, other)  # type: ignore[arg-type]
        handler(loop, refused)  # type: ignore[arg-type]
    assert loop.defaulted == [other, refused] and logs == []
