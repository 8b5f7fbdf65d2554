"""The worker's heartbeat thread goes on beating while the daemon's datagram socket is full, whatever errno
the system says that with (macOS: ENOBUFS), and ends on any other error."""

from __future__ import annotations

import errno
import threading

import pytest

from mpsd import osfacts
from mpsd.worker.heartbeat import BEAT, start_heartbeat


class Beats:
    """A socket-like fake: `send` raises the given errors in turn, None meaning a beat goes through."""

    def __init__(self, *outcomes: int | None) -> None:
        self.outcomes = list(outcomes)
        self.sent = 0

    def send(self, data: bytes, flags: int = 0) -> int:
        assert data == BEAT
        outcome = self.outcomes.pop(0) if self.outcomes else errno.EPIPE
        if outcome is not None:
            raise OSError(outcome, "send")
        self.sent += 1
        return 1


def run(beats: Beats, facts: osfacts.OsFacts) -> threading.Thread:
    with osfacts.use(facts):
        thread = start_heartbeat(beats, 0.001)  # type: ignore[arg-type]
    thread.join(timeout=30)
    assert not thread.is_alive()
    return thread


def test_on_macos_a_full_socket_answering_enobufs_does_not_end_the_beats() -> None:
    nobufs = errno.ENOBUFS
    beats = Beats(nobufs, nobufs, nobufs, None, nobufs, None, errno.EPIPE)
    run(beats, osfacts.DARWIN)
    assert beats.sent == 2  # it beat on after each ENOBUFS, and ended at EPIPE (the daemon gone)


@pytest.mark.parametrize("facts", [osfacts.DARWIN, osfacts.LINUX])
def test_a_full_socket_answering_eagain_does_not_end_the_beats(facts: osfacts.OsFacts) -> None:
    beats = Beats(errno.EAGAIN, None, errno.EAGAIN, None, errno.ECONNREFUSED)
    run(beats, facts)
    assert beats.sent == 2


def test_other_errors_end_the_thread() -> None:
    beats = Beats(errno.ECONNREFUSED, None)  # the beat after the refusal is never tried
    run(beats, osfacts.DARWIN)
    assert beats.sent == 0 and beats.outcomes == [None]
    beats = Beats(errno.ENOBUFS, None)  # on Linux ENOBUFS is no full socket's answer
    run(beats, osfacts.LINUX)
    assert beats.sent == 0
