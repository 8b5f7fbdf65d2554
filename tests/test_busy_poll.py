"""Busy polling in the event loop: events that come soon after activity are caught without a sleep, an idle
loop sleeps at once, and the daemon's setting reaches its loop."""

from __future__ import annotations

import asyncio
import selectors
import socket
import time
from collections.abc import Iterator

import pytest

from mpsd import osfacts
from mpsd.config.daemon_config import DaemonConfig
from mpsd.net import busy_poll, eventloop
from mpsd.net.busy_poll import BusyPollSelector


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def _active(selector: BusyPollSelector, a: socket.socket, b: socket.socket) -> None:
    """An event handled: the selector now counts as busy."""
    b.send(b"x")
    assert selector.select(timeout=5.0)
    a.recv(1)


def test_an_event_soon_after_activity_is_caught_by_polling(pair: tuple[socket.socket, socket.socket]) -> None:
    """`caught` counts only events a poll found: one that a sleep in the kernel returned does not count."""
    a, b = pair
    with BusyPollSelector(budget_s=5.0) as selector:
        selector.register(a, selectors.EVENT_READ)
        _active(selector, a, b)
        b.send(b"x")
        events = selector.select(timeout=10.0)
        assert [key.fileobj for key, _ in events] == [a]
        assert (selector.caught, selector.missed) == (1, 0)


def test_an_idle_loop_sleeps_without_polling(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    with BusyPollSelector(budget_s=0.002) as selector:
        selector.register(a, selectors.EVENT_READ)
        _active(selector, a, b)
        assert selector.select(timeout=0.05) == []  # polled for the budget, then slept out the timer
        assert (selector.caught, selector.missed) == (0, 1)
        b.send(b"x")
        assert selector.select(timeout=5.0)  # after a sleep that ended on the timer: no poll, a sleep
        assert (selector.caught, selector.missed) == (0, 1)


def test_polling_stops_at_the_loops_own_timeout(pair: tuple[socket.socket, socket.socket]) -> None:
    """A timer due before the budget is spent ends the poll on time: no event waits longer for it."""
    a, b = pair
    with BusyPollSelector(budget_s=60.0) as selector:
        selector.register(a, selectors.EVENT_READ)
        _active(selector, a, b)
        start = time.monotonic()
        assert selector.select(timeout=0.01) == []
        assert time.monotonic() - start < 30.0
        assert selector.missed == 1


def test_a_zero_budget_never_polls(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    with BusyPollSelector(budget_s=0.0) as selector:
        selector.register(a, selectors.EVENT_READ)
        _active(selector, a, b)
        b.send(b"x")
        assert selector.select(timeout=5.0)
        assert (selector.caught, selector.missed) == (0, 0)


def test_the_loop_runs_on_the_polling_selector_and_reports_its_budget() -> None:
    async def main() -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        try:
            a.setblocking(False)
            b.setblocking(False)
            await loop.sock_sendall(a, b"ping")
            return eventloop.busy_poll_us(), await loop.sock_recv(b, 4)
        finally:
            a.close()
            b.close()

    assert eventloop.run(main(), "asyncio", 150) == (150, b"ping")
    assert eventloop.run(main(), "asyncio", 0) == (0, b"ping")
    assert busy_poll.run(main(), 0.0005) == (500, b"ping")


def test_the_daemons_budget_has_a_default_and_bounds() -> None:
    with osfacts.use(osfacts.LINUX):
        assert DaemonConfig().busy_poll_us == 200
    assert DaemonConfig.model_validate({"busy_poll_us": 0}).busy_poll_us == 0
    for wrong in (-1, 10001):
        with pytest.raises(ValueError, match="busy_poll_us"):
            DaemonConfig.model_validate({"busy_poll_us": wrong})


def test_the_default_budget_on_macos_is_no_polling() -> None:
    """A Mac is often on battery, where the spin's CPU costs more than its latency gains: the loop sleeps at
    once there unless the config asks for polling."""
    with osfacts.use(osfacts.DARWIN):
        assert DaemonConfig().busy_poll_us == 0
        assert DaemonConfig.model_validate({"busy_poll_us": 150}).busy_poll_us == 150
