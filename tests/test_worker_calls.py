"""A python model's side of calling another model (worker/calls.py's `Models`), in one process on a socket
pair: what it sends for a call, and what it refuses before sending. The daemon's side is
test_model_calls.py's; calls between real workers over the wire are test_calls.py's."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch

from mpsd.errors import ErrorCode
from mpsd.ipc import protocol as p
from mpsd.ipc.framing import FrameReader, recv_blocking
from mpsd.worker.calls import CallError, Models
from mpsd.worker.inbox import Inbox


@pytest.fixture
def worker() -> Iterator[tuple[Models, socket.socket]]:
    """A serving worker's `models` during an execution (request 5), and the daemon's end of its socket."""
    ours, daemons = socket.socketpair()
    ours.settimeout(10)  # a send nobody reads fails, rather than hanging the test
    daemons.settimeout(10)
    inbox = Inbox(ours, FrameReader(ours, 1.0))
    inbox.req_id = 5
    try:
        yield Models(inbox, torch.device("cpu")), daemons
    finally:
        ours.close()
        daemons.close()


@pytest.mark.parametrize(("version", "sent"), [("", ""), (-1, ""), (None, ""), (2, "2"), ("3", "3")])
def test_a_call_names_the_version_asked_or_none_for_the_latest(
    worker: tuple[Models, socket.socket], version: object, sent: str
) -> None:
    """docs/calling-models.md: `version` "" or -1 (Triton's) is the latest ready version."""
    models, daemons = worker
    models.infer_async("adder", {"x": torch.ones(2)}, version=version)  # type: ignore[arg-type]
    call = recv_blocking(daemons)
    assert isinstance(call, p.Call) and (call.model, call.version, call.req_id) == ("adder", sent, 5)


def test_inputs_past_what_a_call_carries_are_refused_before_anything_is_sent(
    worker: tuple[Models, socket.socket],
) -> None:
    """docs/calling-models.md: a call's inputs travel inline, at most MAX_CALL_BYTES (60 MiB):
    RESOURCE_EXHAUSTED, and the daemon hears nothing."""
    models, daemons = worker
    with pytest.raises(CallError) as refused:
        models.infer_async("adder", {"x": torch.zeros(p.MAX_CALL_BYTES // 4 + 1)})
    assert refused.value.code is ErrorCode.RESOURCE_EXHAUSTED
    assert f"a call carries at most {p.MAX_CALL_BYTES}" in refused.value.message
    daemons.setblocking(False)
    with pytest.raises(BlockingIOError):
        daemons.recv(1)
