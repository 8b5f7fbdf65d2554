"""sd_notify: messages reach a real AF_UNIX datagram socket in the format systemd parses."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from mpsd.daemon.sdnotify import SdNotifier

pytestmark = pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="needs AF_UNIX sockets")


def _receive(sock: socket.socket) -> dict[str, str]:
    """One datagram parsed the way systemd does: newline-separated KEY=VALUE."""
    data = sock.recv(4096).decode("utf-8")
    return dict(line.split("=", 1) for line in data.split("\n") if line)


@pytest.fixture
def listener(sock_dir: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket standing in for systemd's notification socket."""
    path = sock_dir / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    yield sock, str(path)
    sock.close()


def test_ready_status_stopping_watchdog_arrive(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    notifier = SdNotifier({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    assert notifier.ready()
    assert _receive(sock) == {"READY": "1"}
    assert notifier.status("loading resnet50\nversion 2")
    assert _receive(sock) == {"STATUS": "loading resnet50 version 2"}
    assert notifier.watchdog()
    assert _receive(sock) == {"WATCHDOG": "1"}
    assert notifier.stopping()
    assert _receive(sock) == {"STOPPING": "1"}
    notifier.close()


def test_reloading_carries_current_monotonic_usec(listener: tuple[socket.socket, str]) -> None:
    """Type=notify-reload rejects RELOADING=1 without MONOTONIC_USEC (systemd >= 253)."""
    sock, path = listener
    notifier = SdNotifier({"NOTIFY_SOCKET": path})
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert notifier.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    message = _receive(sock)
    assert message["RELOADING"] == "1"
    assert before <= int(message["MONOTONIC_USEC"]) <= after
    notifier.close()


def test_reads_notify_socket_from_process_environment(
    listener: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, path = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    notifier = SdNotifier()
    assert notifier.ready()
    assert _receive(sock) == {"READY": "1"}
    notifier.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets are Linux-only")
def test_abstract_namespace_socket() -> None:
    name = f"mpsd-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    try:
        notifier = SdNotifier({"NOTIFY_SOCKET": "@" + name})
        assert notifier.ready()
        assert _receive(sock) == {"READY": "1"}
        notifier.close()
    finally:
        sock.close()


def test_no_op_without_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = SdNotifier()
    assert not notifier.enabled
    assert not notifier.ready()
    assert not notifier.reloading()
    assert not notifier.status("x")
    assert not notifier.watchdog()
    assert not notifier.stopping()


def test_send_failure_does_not_raise(sock_dir: Path) -> None:
    """Nobody listening (systemd gone, socket removed): the daemon keeps running."""
    notifier = SdNotifier({"NOTIFY_SOCKET": str(sock_dir / "missing.sock")})
    assert notifier.enabled
    assert notifier.ready() is False
    notifier.close()


def test_a_manager_that_stops_reading_does_not_stall_the_sender(listener: tuple[socket.socket, str]) -> None:
    """A notification socket nobody reads fills up (about a dozen datagrams on Linux): the notifier drops
    what does not fit instead of waiting, since it sends from the daemon's event loop."""
    _, path = listener
    notifier = SdNotifier({"NOTIFY_SOCKET": path})
    results: list[bool] = []
    sender = threading.Thread(
        target=lambda: results.extend(notifier.watchdog() for _ in range(500)), daemon=True
    )
    sender.start()
    sender.join(60)  # a bound on a hang, not a timing: 500 non-blocking sends take milliseconds
    assert not sender.is_alive(), "sd_notify blocked on a full notification socket"
    assert True in results and False in results
    notifier.close()


def test_unsupported_address_is_a_no_op() -> None:
    assert not SdNotifier({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled
    assert not SdNotifier({"NOTIFY_SOCKET": "relative/path"}).enabled


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    assert SdNotifier({"WATCHDOG_USEC": "30000000"}).watchdog_interval() == 15.0
    own_pid = {"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}
    assert SdNotifier(own_pid).watchdog_interval() == 2.0


def test_watchdog_interval_none_when_not_for_us() -> None:
    assert SdNotifier({}).watchdog_interval() is None
    other_pid = {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    assert SdNotifier(other_pid).watchdog_interval() is None
    assert SdNotifier({"WATCHDOG_USEC": "0"}).watchdog_interval() is None
    assert SdNotifier({"WATCHDOG_USEC": "soon"}).watchdog_interval() is None
