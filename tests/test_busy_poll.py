"""Busy polling in the event loop: events that come soon after activity are caught without a sleep, an idle
loop sleeps at once, one with a backlog gathers before it sleeps, and the daemon's settings reach its loop."""

from __future__ import annotations

import asyncio
import math
import selectors
import socket
import time
from collections.abc import Iterator

import pytest

from mpsd import osfacts
from mpsd.config.daemon_config import DaemonConfig
from mpsd.net import busy_poll, eventloop, gather
from mpsd.net.busy_poll import BusyPollSelector
from mpsd.net.gather import GatheringSelector


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


class Backlog:
    """A backlog as the loop sees one (in the daemon: a version's lanes, all full)."""

    def __init__(self, backlogged: bool = True, eases_at: float = math.inf) -> None:
        self.backlogged = backlogged
        self.eases_at = eases_at


def _backlogged(gather_s: float) -> GatheringSelector:
    """A selector told of a backlog that lasts."""
    selector = GatheringSelector(budget_s=0.0, gather_s=gather_s)
    selector.watch_backlog(Backlog())
    return selector


def _watching(sock: socket.socket, backlog: Backlog, gather_s: float) -> GatheringSelector:
    """A selector reading `sock`, told of `backlog`."""
    selector = GatheringSelector(budget_s=0.0, gather_s=gather_s)
    selector.register(sock, selectors.EVENT_READ)
    selector.watch_backlog(backlog)
    return selector


def test_a_loop_gathers_while_a_backlog_it_was_told_of_lasts(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """It asks the backlog before each sleep: once it has none, the loop sleeps at once and forgets it."""
    a, b = pair
    backlog = Backlog()
    with GatheringSelector(budget_s=0.0, gather_s=0.001) as selector:
        selector.register(a, selectors.EVENT_READ)
        assert not selector.gathers()
        selector.watch_backlog(backlog)
        selector.watch_backlog(backlog)  # told again while it lasts
        assert selector.select(timeout=0.002) == [] and selector.held == 1
        backlog.backlogged = False
        b.send(b"x")
        assert selector.select(timeout=10.0) and selector.held == 1
        backlog.backlogged = True  # not told again: not heard
        assert not selector.gathers()


def test_a_backlogged_loop_gathers_before_it_sleeps(pair: tuple[socket.socket, socket.socket]) -> None:
    """What arrived during the wait is returned by the poll after it, without a sleep in the kernel."""
    a, b = pair
    with _backlogged(0.001) as selector:
        selector.register(a, selectors.EVENT_READ)
        b.send(b"x")
        assert [key.fileobj for key, _ in selector.select(timeout=10.0)] == [a]
        assert (selector.held, selector.cut_short) == (1, 0)


def test_what_a_wait_held_back_is_dated_from_the_waits_start_until_the_next_pass(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    backlog = Backlog()
    with _watching(a, backlog, 0.02) as selector:
        b.send(b"x")
        before = time.perf_counter_ns()
        assert selector.select(timeout=10.0) and selector.held == 1
        assert before <= selector.arrived_ns() <= time.perf_counter_ns() - 0.02e9
        a.recv(1)
        backlog.backlogged = False
        b.send(b"x")
        assert selector.select(timeout=10.0) and selector.held == 1
        before = time.perf_counter_ns()
        assert selector.arrived_ns() >= before, "read without a wait: now"


def test_a_wait_ends_a_waits_length_before_the_backlog_is_expected_to_ease(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """What a wait holds back is taken in before the worker's answer is due, not in one lump with it: the
    wait is cut to end `gather_s` before then, and none starts closer to it than that (the backlog is kept,
    and heard again once its answer is due later)."""
    a, b = pair
    backlog = Backlog()
    with _watching(a, backlog, 30.0) as selector:
        backlog.eases_at = time.monotonic() + 31.0
        b.send(b"x")
        started = time.monotonic()
        assert selector.select(timeout=60.0) and selector.held == 1
        assert time.monotonic() - started < 15.0, "cut to at most 1 s, not 30"
        backlog.eases_at = time.monotonic() + 29.9
        assert not selector.gathers()
        assert selector.select(timeout=60.0) and selector.held == 1, "slept at once"
        backlog.eases_at = math.inf
        assert selector.gathers()


def test_a_loop_without_a_backlog_sleeps_at_once(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    with GatheringSelector(budget_s=0.0, gather_s=30.0) as selector:
        selector.register(a, selectors.EVENT_READ)
        b.send(b"x")
        assert selector.select(timeout=10.0)
        assert selector.held == 0


def test_a_socket_marked_to_wake_at_once_ends_the_wait(pair: tuple[socket.socket, socket.socket]) -> None:
    """A wait of 30 s ends as soon as the marked socket (a worker's, in the daemon) is readable."""
    a, b = pair
    with _backlogged(30.0) as selector:
        selector.register(a, selectors.EVENT_READ)
        selector.wake_at_once(a.fileno())
        b.send(b"x")
        assert [key.fileobj for key, _ in selector.select(timeout=None)] == [a]
        assert (selector.held, selector.cut_short) == (1, 1)


def test_a_socket_no_longer_watched_no_longer_wakes(pair: tuple[socket.socket, socket.socket]) -> None:
    """Its descriptor may be reused for another socket once it is closed."""
    a, b = pair
    with _backlogged(0.001) as selector:
        selector.register(a, selectors.EVENT_READ)
        selector.wake_at_once(a.fileno())
        selector.unregister(a)
        b.send(b"x")
        assert selector.select(timeout=0.002) == []
        assert (selector.held, selector.cut_short) == (1, 0)


def test_a_marked_socket_closed_while_watched_is_forgotten(pair: tuple[socket.socket, socket.socket]) -> None:
    """As the kernel's selector (epoll, kqueue) forgets a closed descriptor, so does the wait, whose
    select(2) fails with EBADF on Linux and macOS alike: the loop goes on, and another socket that is
    marked still ends it."""
    a, _ = pair
    c, d = socket.socketpair()
    with _backlogged(30.0) as selector:
        selector.register(a, selectors.EVENT_READ)
        selector.wake_at_once(a.fileno())
        selector.register(c, selectors.EVENT_READ)
        selector.wake_at_once(c.fileno())
        a.close()  # the descriptor goes before the selector stops watching it
        assert selector.select(timeout=0.001) == []
        d.send(b"x")
        assert [key.fileobj for key, _ in selector.select(timeout=None)] == [c]
        assert selector.cut_short == 1
    c.close()
    d.close()


def test_a_descriptor_past_fd_setsize_makes_the_wait_plain(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """select(2) refuses a descriptor at or past FD_SETSIZE (1024 on Linux and macOS) with ValueError, as
    Python raises it there; injected here, since this test's descriptors are low. The wait is then a plain
    sleep, and the loop goes on."""
    a, b = pair

    def refuses(*args: object) -> object:
        raise ValueError("filedescriptor out of range in select()")

    monkeypatch.setattr(gather.select, "select", refuses)
    with _backlogged(0.001) as selector:
        selector.register(a, selectors.EVENT_READ)
        selector.wake_at_once(a.fileno())
        b.send(b"x")
        assert [key.fileobj for key, _ in selector.select(timeout=10.0)] == [a]
        assert (selector.held, selector.cut_short) == (1, 0)


def test_the_wait_ends_before_the_loops_next_timer(pair: tuple[socket.socket, socket.socket]) -> None:
    a, _ = pair
    with _backlogged(30.0) as selector:
        selector.register(a, selectors.EVENT_READ)
        assert selector.select(timeout=0.001) == []
        assert selector.held == 1


def test_a_settling_pass_is_not_held(pair: tuple[socket.socket, socket.socket]) -> None:
    """A loop that has settled runs its settle callbacks (a short batch's start) at once, never after a
    wait."""
    a, _ = pair
    with _backlogged(30.0) as selector:
        selector.register(a, selectors.EVENT_READ)
        settled: list[bool] = []
        selector.when_settled(lambda: settled.append(True))
        assert selector.select(timeout=None) == []
        assert settled == [True] and selector.held == 0


def test_the_loop_gathers_as_the_daemon_is_told() -> None:
    async def main() -> int:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        try:
            eventloop.wake_at_once(a)
            a.setblocking(False)
            loop.add_reader(a.fileno(), lambda: None)
            loop.remove_reader(a.fileno())
            return eventloop.gather_us()
        finally:
            a.close()
            b.close()

    assert eventloop.run(main(), "asyncio", 0, 300) == 300
    assert eventloop.run(main(), "asyncio", 0) == 0
    assert DaemonConfig().gather_us == 0
    for wrong in (-1, 10001):
        with pytest.raises(ValueError, match="gather_us"):
            DaemonConfig.model_validate({"gather_us": wrong})
