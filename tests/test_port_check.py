"""The check that a port is free before listening, with macOS's facts in force: BSD lets 127.0.0.1:P bind
beside another process's listener on *:P (SO_REUSEADDR), so the check also tries a connection. No BSD
kernel here: its bind, which succeeds, is stood in; the listener and the connection are real."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from mpsd import osfacts
from mpsd.daemon.supervise.fronts import policy
from mpsd.net.listen import parse_address
from tests.conftest import free_port


@pytest.fixture
def bsd_bind(monkeypatch: pytest.MonkeyPatch) -> None:
    """macOS's answer to binding 127.0.0.1:P beside a wildcard listener on P: it succeeds."""

    def bind(probe: socket.socket, sockaddr: Any) -> None:
        probe.bind((sockaddr[0], 0))

    monkeypatch.setattr(policy, "_bind", bind)


@pytest.fixture
def wildcard_listener() -> Iterator[int]:
    port = free_port()
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", port))
        listener.listen()
        yield port


def test_a_wildcard_listener_makes_the_loopback_port_taken_on_macos(
    bsd_bind: None, wildcard_listener: int
) -> None:
    address = parse_address(f"127.0.0.1:{wildcard_listener}")
    with osfacts.use(osfacts.DARWIN), pytest.raises(OSError) as taken:
        policy.check_port_free(address)
    assert str(taken.value) == f"cannot listen on 127.0.0.1:{wildcard_listener}: the port is in use"


def test_a_port_no_one_listens_on_is_free_on_macos(bsd_bind: None) -> None:
    with osfacts.use(osfacts.DARWIN):
        policy.check_port_free(parse_address(f"127.0.0.1:{free_port()}"))
        policy.check_port_free(parse_address(f"0.0.0.0:{free_port()}"))
