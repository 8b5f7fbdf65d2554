"""A front's call submitted where the daemon reads its frame (`FrontLink.submit`): no task of its own, its
answer sent from its future. Each call still gets exactly one reply, the one a task would have sent: the
response, the error's status, or CANCELLED once the front cancels it.

In-process: the front's `CoreLink` writes its frames into a recorder, and they are fed to the daemon's
`FrontLink`, whose `submit` is a stand-in that hands out futures the test answers. What the daemon's own
`submit` gives (the servicer's known header, the plane's future) is checked against the task's path in
tests/known_headers_scenarios.py and tests/test_dataplane.py; through running fronts, in test_fronts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from test_front_arena import Recorder, _settle
from tritonclient.grpc import service_pb2 as pb

from mpsd.daemon.supervise.fronts.link import FrontFailed, FrontLink
from mpsd.errors import InvalidArgument, Unavailable
from mpsd.front.main import CoreLink
from mpsd.ipc.front_wire import Kind
from mpsd.ipc.infer_wire import SplitRequest

OK = 0
CANCELLED = grpc.StatusCode.CANCELLED.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]


class Call:
    """What the stand-in `submit` hands out: a future the test answers, and the response it stands for."""

    def __init__(self, split: SplitRequest, then: Callable[[Call], None]) -> None:
        self.future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.future.add_done_callback(lambda _: then(self))
        self.request_id = split.request_id

    def parts(self) -> Sequence[bytes]:
        if self.request_id == b"s9":
            raise ValueError("a response that cannot be made")
        return [b"answer to ", bytes(self.request_id or b"")]


class Daemon:
    """The daemon's end of one front's link, with a `submit` that takes the calls whose id starts with
    "s" (raising for "x", refusing at once for "u"), and an `infer` that runs the others in tasks."""

    def __init__(self) -> None:
        self.submitted: dict[bytes, Call] = {}
        self.tasked: list[Any] = []
        self.front = CoreLink()
        self.to_daemon = Recorder()
        self.front.writer.transport = self.to_daemon  # type: ignore[assignment]
        self.link = FrontLink(0, self._infer, lambda _: None, submit=self._submit)  # type: ignore[arg-type]
        self.to_front = Recorder()
        self.link.attach(self.to_front)  # type: ignore[arg-type]

    def _submit(
        self, split: SplitRequest, deadline: float | None, then: Callable[[Call], None]
    ) -> asyncio.Future[Any] | None:
        rid = split.request_id or b""
        if rid.startswith(b"u"):
            raise Unavailable("model 'm' version 1 is not ready (loading)")
        if rid.startswith(b"x"):
            raise RuntimeError("a bug")
        if not rid.startswith(b"s"):
            return None
        call = self.submitted[rid] = Call(split, then)
        return call.future

    async def _infer(self, data: Any, deadline: float | None, traceparent: str | None) -> list[bytes]:
        self.tasked.append(data)
        return [b"from a task"]

    async def send(self, *request_ids: str) -> None:
        """Calls 1, 2, ... with these ids, each through the front's framing, read by the daemon."""
        for call_id, rid in enumerate(request_ids, 1):
            message = pb.ModelInferRequest(model_name="m", id=rid, raw_input_contents=[b"\x01" * 8])
            message.inputs.add(name="x", datatype="UINT8", shape=[8])
            self.front.send(self.front._infer_frame(call_id, -1.0, message.SerializeToString()))
        await _settle()
        self.deliver()
        await _settle()

    def deliver(self) -> None:
        frames, self.to_daemon.data = self.to_daemon.frames(), bytearray()
        for kind, call_id, number, payload in frames:
            self.link._on_frame(kind, call_id, number, payload)

    def replies(self) -> list[tuple[int, int, bytes]]:
        """(call id, status, payload) of each reply so far."""
        return [
            (c, int(status), body) for kind, c, status, body in self.to_front.frames() if kind == Kind.REPLY
        ]


def test_a_submitted_call_is_answered_from_its_future_without_a_task() -> None:
    async def run() -> None:
        daemon = Daemon()
        tasks_before = len(asyncio.all_tasks())
        await daemon.send("s1", "s2", "t3")
        assert list(daemon.submitted) == [b"s1", b"s2"] and len(daemon.tasked) == 1
        assert len(asyncio.all_tasks()) == tasks_before  # the task of "t3" has already ended
        assert daemon.replies() == [(3, OK, b"from a task")]
        assert sorted(daemon.link.calls) == [1, 2]  # in flight: they count against MAX_IN_FLIGHT
        daemon.submitted[b"s2"].future.set_result(None)
        await _settle()
        daemon.submitted[b"s1"].future.set_result(None)
        await _settle()
        assert daemon.replies()[1:] == [(2, OK, b"answer to s2"), (1, OK, b"answer to s1")]
        assert daemon.link.calls == {}
        assert daemon.link.counts.served == 3 and daemon.link.counts.split == 3

    asyncio.run(run())


def test_a_submitted_call_fails_and_is_cancelled_as_a_task_would_be() -> None:
    async def run() -> None:
        daemon = Daemon()
        await daemon.send("s1", "s2", "s3", "u4", "x5", "s6", "s7", "s8", "s9")
        # Refused at submission: answered at once, with its status (a bug is INTERNAL, named).
        assert daemon.replies() == [
            (4, UNAVAILABLE, b"model 'm' version 1 is not ready (loading)"),
            (5, INTERNAL, b"RuntimeError: a bug"),
        ]
        daemon.submitted[b"s1"].future.set_exception(InvalidArgument("input 'x': expected 8 bytes"))
        daemon.submitted[b"s2"].future.set_exception(KeyError("k"))
        daemon.link._on_frame(Kind.CANCEL, 3, 0.0, b"")
        daemon.submitted[b"s9"].future.set_result(None)
        await _settle()
        assert daemon.submitted[b"s3"].future.cancelled()  # the plane drops it from its batch
        assert daemon.replies()[2:] == [
            (1, INVALID, b"input 'x': expected 8 bytes"),
            (2, INTERNAL, b"KeyError: 'k'"),
            (3, CANCELLED, b"cancelled"),
            (9, INTERNAL, b"ValueError: a response that cannot be made"),
        ]
        assert sorted(daemon.link.calls) == [6, 7, 8]
        assert daemon.link.counts.served == 5  # a cancelled call is not counted as served

    asyncio.run(run())


def test_losing_the_front_cancels_its_submitted_calls() -> None:
    async def run() -> None:
        daemon = Daemon()
        await daemon.send("s1", "s2")
        daemon.link._lost(None)
        await _settle()
        assert isinstance(daemon.link.ready.exception(), FrontFailed)  # it never said it was ready
        assert all(call.future.cancelled() for call in daemon.submitted.values())
        assert daemon.link.calls == {}

    asyncio.run(run())
