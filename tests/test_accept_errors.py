"""Accept failures (out of file descriptors) are logged at most once a second, with the count of those held
back: in-process with a fake clock, and for real with a daemon whose open-file limit is pinned low under
more connections than it can take, which keeps serving once they close."""

from __future__ import annotations

import errno
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import RunningDaemon, http_request, wait_for
from structlog.testing import capture_logs

from mpsd.net.accept_errors import AcceptErrors
from mpsd.net.log_rate import Throttle

EVENT = "accepting connections failed"
ASYNCIO_LINE = "socket.accept() out of system resource"  # what asyncio's own handler writes, each time


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


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


# ---- for real ---------------------------------------------------------------------------------------------

CONNECTIONS = 150  # a daemon of 64 descriptors holds about 40 of them; the rest wait in the accept queue


def events(daemon: RunningDaemon) -> list[dict[str, Any]]:
    found = []
    for line in daemon.log().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == EVENT:
                found.append(event)
    return found


def test_a_daemon_out_of_descriptors_logs_it_a_bounded_number_of_times_and_serves_again(
    tmp_path: Path, start_daemon
) -> None:  # type: ignore[no-untyped-def]
    repo = tmp_path / "repo"
    repo.mkdir()
    config = tmp_path / "mpsd.yaml"
    config.write_text("open_files: 64\n")  # not raised beyond where it starts
    daemon = start_daemon(repo, config=config, open_files_soft=64)
    daemon.wait_ready()
    host, _, port = daemon.http_address.rpartition(":")
    started = time.monotonic()
    held = [socket.create_connection((host, int(port)), timeout=30) for _ in range(CONNECTIONS)]
    try:
        # the failures of asyncio's first pass over its backlog, held back and told at the interval's end
        wait_for(lambda: any(e["suppressed"] > 0 for e in events(daemon)), 30, f"{EVENT} with a count")
    finally:
        for sock in held:
            sock.close()
    wait_for(
        lambda: http_request(daemon.http_address, "GET", "/v2/health/live", timeout=5)[0] == 200,
        60,
        "the daemon serving HTTP again",
    )
    assert daemon.client.is_server_live()
    elapsed = time.monotonic() - started
    told = events(daemon)
    assert ASYNCIO_LINE not in daemon.log()  # asyncio's own handler, a traceback per failure, never ran
    assert len(told) <= elapsed + 2, (len(told), elapsed)  # one a second at most (and the last count)
    assert told[0]["errno"] == "EMFILE" and told[0]["address"] == daemon.http_address
